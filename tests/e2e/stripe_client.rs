//! The library's Stripe API client (`inbox_worker::stripe`) against the local stand-in for
//! Stripe's API: retries, headers and errors as Stripe documents them.

use std::time::Duration;

use inbox_test_support::stripe_api::{Fault, StripeApi};
use inbox_worker::stripe::{ApiKey, Client, Config, Error, RequestOptions};
use serde_json::json;

const KEY: &str = "sk_test_51ClientKeyThatNeverAppearsInAnError";

fn client(api: &StripeApi, timeout: Duration) -> Client {
    let mut config = Config::new(ApiKey::new(KEY).unwrap());
    config.base = api.base_url();
    config.timeout = timeout;
    config.max_backoff = Duration::from_millis(200);
    Client::new(config).unwrap()
}

#[tokio::test]
async fn a_write_retried_after_a_500_carries_the_same_idempotency_key() {
    let api = StripeApi::start(KEY).await;
    api.fail_nth("/v1/customers", 1, Fault::ServerError);
    // The stand-in knows no writes: the retry is answered 404, which is final.
    let error = client(&api, Duration::from_secs(5))
        .post_form("/v1/customers", &[("email", "a@example.com".into())], &RequestOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::NotFound { .. }), "{error}");
    let keys: Vec<Option<String>> = api.requests().into_iter().map(|r| r.idempotency_key).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys[0].is_some() && keys[0] == keys[1], "one key for every attempt of a write: {keys:?}");
}

#[tokio::test]
async fn a_request_stalled_past_the_timeout_is_retried_and_a_connected_account_is_named() {
    let api = StripeApi::start(KEY).await;
    api.add_object_for_account(
        "acct_1Connected",
        "/v1/customers/cus_1",
        json!({"id": "cus_1", "object": "customer"}),
    );
    api.fail_nth("/v1/customers", 1, Fault::Stall(Duration::from_secs(3)));
    let options =
        RequestOptions { stripe_account: Some("acct_1Connected".into()), ..RequestOptions::default() };
    let object =
        client(&api, Duration::from_millis(500)).retrieve("/v1/customers/cus_1", &options).await.unwrap();
    assert!(object.get().contains("\"cus_1\""));
    let requests = api.requests();
    assert_eq!(requests.len(), 2, "the stalled request, then its retry");
    assert!(requests.iter().all(|r| r.stripe_account.as_deref() == Some("acct_1Connected")));
}

#[tokio::test]
async fn a_restricted_key_without_the_permission_is_named_403_with_the_request_id_and_not_retried() {
    let api = StripeApi::start(KEY).await;
    api.forbid("/v1/events");
    let mut list = client(&api, Duration::from_secs(5)).list("/v1/events", Vec::new(), 100);
    let error = list.next_page().await.unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, Error::Forbidden { .. }), "{text}");
    assert!(text.contains("403 Forbidden") && text.contains("req_"), "{text}");
    assert!(!text.contains(&KEY[8..]), "{text}");
    assert_eq!(api.requests().len(), 1, "a 403 is final");
}

#[tokio::test]
async fn rate_limited_pages_are_retried_until_stripe_answers_and_paging_goes_on_from_the_cursor() {
    let api = StripeApi::start(KEY).await;
    api.add_events((0..25).map(|i| {
        inbox_test_support::stripe_fixtures::snapshot_event(
            &format!("evt_c{i:03}"),
            "customer.created",
            json!({"id": format!("cus_{i}"), "object": "customer"}),
            1_800_000_000 + i,
        )
    }));
    api.fail_nth("/v1/events", 2, Fault::RateLimited { retry_after: None });
    api.fail_nth("/v1/events", 3, Fault::RateLimited { retry_after: None });
    let mut list = client(&api, Duration::from_secs(5)).list("/v1/events", Vec::new(), 10);
    let mut ids = Vec::new();
    while let Some(page) = list.next_page().await.unwrap() {
        for item in page.data {
            let event: serde_json::Value = serde_json::from_str(item.get()).unwrap();
            ids.push(event["id"].as_str().unwrap().to_owned());
        }
    }
    let expected: Vec<String> = (0..25).rev().map(|i| format!("evt_c{i:03}")).collect();
    assert_eq!(ids, expected, "every event once, newest first");
    let statuses: Vec<u16> = api.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 429, 429, 200, 200]);
}
