//! Every row of the README's HTTP API table and every signature edge case (missing, empty or
//! malformed header, duplicate `t`, only `v0`, bad `v1`, several `v1`, whitespace, timestamp at the
//! tolerance's edges, an altered body, a non-UTF-8 body): the status code, the body, and what the
//! inbox holds afterwards.

use inbox_domain::inbox::signature::{compute_v1, sign_header};
use inbox_test_support::app::concurrent_posts;
use inbox_test_support::db::column;
use inbox_test_support::events::{invoice_paid, now, sign, SECRET_A, SECRET_B, SECRET_C};
use inbox_test_support::proxy::{postgres_addr, FaultProxy, Mode};
use inbox_test_support::{spawn_app, spawn_app_with, TestDb};

#[tokio::test]
async fn a_new_event_is_committed_unprocessed_before_the_200() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_new_1", "in_1", 4200);
    let reply = app.post_signed(body.clone()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body, serde_json::json!({ "status": "accepted" }));

    let row = app
        .db
        .client()
        .await
        .query_one(
            "SELECT provider, endpoint, event_type, payload, attempts, processed_at IS NULL, last_error IS NULL,
                    available_at <= now()
               FROM webhook_inbox WHERE event_id = 'evt_new_1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "stripe");
    assert_eq!(row.get::<_, String>(1), "billing");
    assert_eq!(row.get::<_, String>(2), "invoice.paid");
    let stored: serde_json::Value = row.get(3);
    assert_eq!(stored, serde_json::from_slice::<serde_json::Value>(&body).unwrap());
    assert_eq!(row.get::<_, i32>(4), 0);
    assert!(row.get::<_, bool>(5), "stored processed");
    assert!(row.get::<_, bool>(6));
    assert!(row.get::<_, bool>(7), "not immediately available");
}

#[tokio::test]
async fn the_same_event_twice_re_signed_is_one_row_and_two_200s() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_dup_1", "in_1", 4200);
    let first = app.post("billing", Some(&sign_header(SECRET_A, now() - 10, &body)), body.clone()).await;
    let second = app.post("billing", Some(&sign_header(SECRET_B, now(), &body)), body).await;
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.body["status"], "accepted");
    assert_eq!(second.body["status"], "duplicate");
    assert_eq!(app.inbox_rows().await, 1);
}

#[test]
fn sixteen_concurrent_deliveries_make_one_row() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(spawn_app());
    let body = invoice_paid("evt_race_1", "in_1", 4200);
    let requests = (0..16).map(|_| ("billing".to_owned(), sign(SECRET_A, &body), body.clone())).collect();
    let replies = concurrent_posts(&app.address, requests);
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    let accepted = replies.iter().filter(|r| r.body["status"] == "accepted").count();
    assert_eq!(accepted, 1, "{replies:?}");
    assert_eq!(rt.block_on(app.inbox_rows()), 1);
}

#[tokio::test]
async fn the_same_event_on_two_endpoints_is_two_rows() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_two_ep", "in_1", 4200);
    let a = app.post("billing", Some(&sign(SECRET_A, &body)), body.clone()).await;
    let b = app.post("analytics", Some(&sign(SECRET_C, &body)), body).await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!((a.body["status"].as_str(), b.body["status"].as_str()), (Some("accepted"), Some("accepted")));
    let endpoints: Vec<String> = column(
        &app.db.client().await,
        "SELECT endpoint FROM webhook_inbox WHERE event_id = 'evt_two_ep' ORDER BY 1",
    )
    .await;
    assert_eq!(endpoints, ["analytics", "billing"]);
}

#[tokio::test]
async fn an_endpoint_only_accepts_its_own_secrets() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_wrong_ep", "in_1", 4200);
    let reply = app.post("analytics", Some(&sign(SECRET_A, &body)), body).await;
    assert_eq!(reply.status, 400);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn an_unknown_endpoint_is_404_and_writes_nothing() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_404", "in_1", 4200);
    let reply = app.post("nope", Some(&sign(SECRET_A, &body)), body).await;
    assert_eq!(reply.status, 404);
    assert!(reply.body["error"].is_string());
    assert_eq!(app.inbox_rows().await, 0);
}

/// Every signature edge case: (name, header, body, expected status).
fn signature_cases() -> Vec<(&'static str, Option<String>, Vec<u8>, u16)> {
    let body = invoice_paid("evt_sig", "in_sig", 4200);
    let t = now();
    let good = compute_v1(SECRET_A, t, &body);
    let mut altered = body.clone();
    let mid = altered.len() / 2;
    altered[mid] ^= 0x01;
    let non_utf8: Vec<u8> = b"\xff\xfe{\"id\":\"evt_x\",\"type\":\"x\"}".to_vec();
    vec![
        ("missing header", None, body.clone(), 400),
        ("empty header", Some(String::new()), body.clone(), 400),
        ("no t", Some(format!("v1={good}")), body.clone(), 400),
        ("non-numeric t", Some(format!("t=abc,v1={good}")), body.clone(), 400),
        ("duplicate t", Some(format!("t={t},t={t},v1={good}")), body.clone(), 400),
        ("only v0", Some(format!("t={t},v0={good}")), body.clone(), 400),
        ("v1 of wrong length", Some(format!("t={t},v1={}", &good[..40])), body.clone(), 400),
        ("v1 not hex", Some(format!("t={t},v1={}", "zz".repeat(32))), body.clone(), 400),
        ("wrong secret", Some(sign_header("whsec_other", t, &body)), body.clone(), 400),
        ("timestamp 301 s old", Some(sign_header(SECRET_A, t - 301, &body)), body.clone(), 400),
        // 302: the service's clock may have turned to the next second since `t` was read, and a
        // timestamp 300 s ahead is still accepted.
        ("timestamp 302 s ahead", Some(sign_header(SECRET_A, t + 302, &body)), body.clone(), 400),
        ("body altered by one byte", Some(format!("t={t},v1={good}")), altered, 400),
        ("non-UTF-8 body, signed", Some(sign_header(SECRET_A, t, &non_utf8)), non_utf8, 400),
        (
            "several v1, one good",
            Some(format!("t={t},v1={},v1={good},v1={}", "0".repeat(64), "f".repeat(64))),
            body.clone(),
            200,
        ),
        ("whitespace around elements", Some(format!("t={t}, v1={good}")), body.clone(), 200),
        ("timestamp 290 s old", Some(sign_header(SECRET_A, t - 290, &body)), body.clone(), 200),
        ("second secret of the endpoint", Some(sign_header(SECRET_B, t, &body)), body.clone(), 200),
    ]
}

#[tokio::test]
async fn signature_cases_answer_as_designed_and_rejected_ones_write_nothing() {
    for i in 0..signature_cases().len() {
        let app = spawn_app().await;
        // Built right before sending: the timestamps are relative to now.
        let (name, header, body, expected) = signature_cases().swap_remove(i);
        let reply = app.post("billing", header.as_deref(), body).await;
        assert_eq!(reply.status, expected, "{name}: {}", reply.text);
        let rows = app.inbox_rows().await;
        assert_eq!(rows, i64::from(expected == 200), "{name}: rows");
        if expected != 200 {
            assert!(reply.body["error"].is_string(), "{name}: {}", reply.text);
            assert!(
                !reply.text.contains(SECRET_A) && !reply.text.contains("v1="),
                "{name} echoes: {}",
                reply.text
            );
        }
    }
}

#[tokio::test]
async fn two_signature_headers_are_refused() {
    let app = spawn_app().await;
    let body = invoice_paid("evt_two_headers", "in_1", 4200);
    let response = app
        .http
        .post(format!("{}/webhooks/stripe/billing", app.address))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn bad_signatures_are_refused_without_touching_the_database() {
    // The database behind the service swallows every connection: anything that touched it
    // would hang until the database timeout and answer 503.
    let proxy = FaultProxy::start(postgres_addr()).await;
    let db = TestDb::new().await;
    let config = db.config_via_port(proxy.port);
    let app = spawn_app_with(db, |s| {
        s.database = config.into();
        s.db_timeout = std::time::Duration::from_secs(3);
    })
    .await;
    proxy.set(Mode::Blackhole);
    for i in 0..signature_cases().len() {
        let (name, header, body, expected) = signature_cases().swap_remove(i);
        if expected != 400 || name.starts_with("non-UTF-8") {
            continue;
        }
        let started = std::time::Instant::now();
        let reply = app.post("billing", header.as_deref(), body).await;
        assert_eq!(reply.status, 400, "{name}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "{name} waited for the database");
    }
    proxy.set(Mode::Pass);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn verified_bodies_that_are_not_events_are_400_and_write_nothing() {
    let app = spawn_app().await;
    let cases: [&[u8]; 8] = [
        b"not json at all",
        b"[1,2,3]",
        br#"["evt_1","invoice.paid"]"#,
        br#"{"type":"invoice.paid"}"#,
        br#"{"id":42,"type":"invoice.paid"}"#,
        br#"{"id":"evt_1"}"#,
        br#"{"id":"evt_1","type":["invoice.paid"]}"#,
        br#"{"id":"evt_1","type":"invoice.paid"} {"#,
    ];
    for body in cases {
        let reply = app.post("billing", Some(&sign(SECRET_A, body)), body.to_vec()).await;
        assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(body));
    }
    // (JSON that PostgreSQL's jsonb refuses is an event all the same: kept, see `kept`.)
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn bodies_over_the_limit_are_413_before_verification() {
    let app = spawn_app_with(TestDb::new().await, |s| s.max_body = 4096).await;
    let big = vec![b' '; 4097];
    // No signature at all: the size is judged first.
    let reply = app.post("billing", None, big.clone()).await;
    assert_eq!(reply.status, 413, "{}", reply.text);
    // Signed correctly, still too large.
    let reply = app.post("billing", Some(&sign(SECRET_A, &big)), big.clone()).await;
    assert_eq!(reply.status, 413);
    // Chunked (no Content-Length): refused once the stream passes the limit.
    let mut request =
        b"POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for chunk in big.chunks(1000) {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let status = inbox_test_support::app::raw_request(&app.address, &request).await;
    assert!(status.starts_with("HTTP/1.1 413"), "{status}");
    // Exactly at the limit is fine.
    let mut body = invoice_paid("evt_at_limit", "in_1", 1).to_vec();
    body.resize(4096, b' ');
    let reply = app.post_signed(body).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let app = spawn_app().await;
    assert_eq!(app.get("/healthz").await.status, 200);
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, 200, "{}", ready.text);
    assert_eq!(ready.body["schema_version"], inbox_domain::inbox::schema::expected_version());

    app.post_signed(invoice_paid("evt_m1", "in_1", 1)).await;
    app.post_signed(invoice_paid("evt_m1", "in_1", 1)).await;
    app.post("billing", None, b"{}".to_vec()).await;
    app.post("zzz", None, b"{}".to_vec()).await;
    let metrics = app.get("/metrics").await;
    assert_eq!(metrics.status, 200);
    for needle in [
        r#"inbox_ingest_requests_total{endpoint="billing",outcome="accepted"} 1"#,
        r#"inbox_ingest_requests_total{endpoint="billing",outcome="duplicate"} 1"#,
        r#"inbox_ingest_requests_total{endpoint="billing",outcome="bad_signature"} 1"#,
        r#"inbox_ingest_requests_total{endpoint="_unknown",outcome="unknown_endpoint"} 1"#,
        r#"inbox_ingest_signature_failures_total{endpoint="billing",reason="missing_header"} 1"#,
        "inbox_ingest_request_duration_seconds_bucket",
    ] {
        assert!(metrics.text.contains(needle), "missing {needle} in\n{}", metrics.text);
    }
}

#[tokio::test]
async fn readyz_is_503_when_the_schema_is_older_than_the_binary() {
    let app = spawn_app_with(TestDb::empty().await, |_| {}).await;
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert!(ready.body["error"].as_str().unwrap().contains("inbox-worker migrate"), "{}", ready.text);
    assert_eq!(app.get("/healthz").await.status, 200);
}

#[tokio::test]
async fn other_methods_and_paths() {
    let app = spawn_app().await;
    let r = app.get("/webhooks/stripe/billing").await;
    assert_eq!(r.status, 405, "{}", r.text);
    assert_eq!(app.get("/nothing-here").await.status, 404);
}

/// A readiness check that runs out of time answers 503 and does not leave its query running: the
/// connection is cancelled and discarded, not handed back to the pool (where a batch writer would
/// get it still busy) nor left waiting on the server.
#[tokio::test]
async fn readyz_that_times_out_leaves_no_query_running_on_the_server() {
    // A statement timeout (the ingest's db timeout) far above readyz's own 2 s bound.
    let app =
        spawn_app_with(TestDb::new().await, |s| s.db_timeout = std::time::Duration::from_secs(20)).await;
    let mut locker = app.db.client().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE refinery_schema_history IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert_eq!(ready.body["error"], "database timed out");
    let observer = app.db.client().await;
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                     AND application_name = 'inbox-ingest' AND wait_event_type = 'Lock'";
    let gone = inbox_test_support::worker::eventually(std::time::Duration::from_secs(2), || async {
        inbox_test_support::db::scalar(&observer, waiting).await == 0
    })
    .await;
    assert!(gone, "the timed-out readiness query is still waiting on the server");
    tx.rollback().await.unwrap();
    // The answer is kept for a second (crate::readiness::CACHE_FOR).
    let ready = inbox_test_support::worker::eventually(std::time::Duration::from_secs(3), || async {
        app.get("/readyz").await.status == 200
    })
    .await;
    assert!(ready, "ready again once the lock is gone");
    assert_eq!(app.post_signed(invoice_paid("evt_after", "in_1", 100)).await.status, 200);
}
