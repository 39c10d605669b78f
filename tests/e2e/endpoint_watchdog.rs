//! The endpoint watchdog's signal: the ingest exports, per endpoint, when it last stored a new
//! event (`inbox_ingest_last_stored_timestamp_seconds`), which the alert StripeInboxEndpointQuiet
//! watches (deploy/prometheus/alerts.yaml; its promtool tests are in alerts.test.yaml). A
//! duplicate does not move it; an endpoint that stored nothing has no series.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_test_support::events::{invoice_paid, sign, SECRET_C};
use inbox_test_support::spawn_app;

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The value of `inbox_ingest_last_stored_timestamp_seconds{endpoint="…"}` in an exposition.
fn last_stored(exposition: &str, endpoint: &str) -> Option<f64> {
    let series = format!("inbox_ingest_last_stored_timestamp_seconds{{endpoint=\"{endpoint}\"}} ");
    exposition.lines().find_map(|line| line.strip_prefix(series.as_str())).map(|v| v.parse().unwrap())
}

#[tokio::test]
async fn the_ingest_says_per_endpoint_when_it_last_stored_a_new_event_and_a_duplicate_does_not_move_it() {
    let app = spawn_app().await;
    let metrics = || async { app.get("/metrics").await.text };
    assert_eq!(last_stored(&metrics().await, "billing"), None, "nothing stored yet: no series");

    let before = unix_now();
    let body = invoice_paid("evt_watch_1", "in_watch_1", 100);
    assert_eq!(app.post_signed(body.clone()).await.body["status"], "accepted");
    let after = unix_now();
    let text = metrics().await;
    let stored = last_stored(&text, "billing").unwrap_or_else(|| panic!("no billing series:\n{text}"));
    assert!(before <= stored && stored <= after, "{before} <= {stored} <= {after}");
    assert_eq!(last_stored(&text, "analytics"), None, "analytics stored nothing:\n{text}");

    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(app.post_signed(body).await.body["status"], "duplicate");
    assert_eq!(last_stored(&metrics().await, "billing"), Some(stored), "a duplicate stores nothing new");

    let other = invoice_paid("evt_watch_2", "in_watch_2", 100);
    let before = unix_now();
    let reply = app.post("analytics", Some(&sign(SECRET_C, &other)), other).await;
    assert_eq!(reply.body["status"], "accepted", "{}", reply.text);
    let text = metrics().await;
    let analytics = last_stored(&text, "analytics").unwrap_or_else(|| panic!("no analytics series:\n{text}"));
    assert!(before <= analytics && analytics <= unix_now(), "{analytics}");
    assert_eq!(last_stored(&text, "billing"), Some(stored), "the other endpoint's time is its own");
}
