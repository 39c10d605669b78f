//! The files in `deploy/` against the running code: every metric name that the alert rules
//! (`deploy/prometheus/alerts.yaml`) and the dashboard (`deploy/grafana/dashboard.json`) use is
//! exported by the built binaries — the ingest, the worker and the relay — (a renamed metric would
//! silently turn an alert off), the workers' KEDA scaler query
//! (`deploy/k8s/base/worker-scaledobject.yaml`) counts what `stats` calls ready, and the relays'
//! (`deploy/k8s/base/relay-scaledobject.yaml`) the outbox rows a relay's claim can take.

use std::collections::BTreeSet;
use std::time::Duration;

use inbox_test_support::db::scalar;
use inbox_test_support::events::{invoice_event, invoice_paid, sign, SECRET_A};
use inbox_test_support::process::command;
use inbox_test_support::receiver::Receiver;
use inbox_test_support::worker::{eventually, store_event};
use inbox_test_support::{spawn_app, TestDb};

/// The relay's Standard Webhooks signing secret in these tests: whsec_ and the base64 of 24 bytes.
const RELAY_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A file of the repository, by its path from the root.
fn repo_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

/// The `inbox_…` identifiers in `text`: a plain scan, so it needs no YAML or PromQL parser.
fn metric_names(text: &str) -> BTreeSet<String> {
    let is_ident = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("inbox_") {
        let starts_a_word =
            !rest[..at].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let word: String = rest[at..].chars().take_while(|&c| is_ident(c)).collect();
        if starts_a_word {
            names.insert(word.clone());
        }
        rest = &rest[at + word.len()..];
    }
    names
}

/// Every `expr` of the dashboard's panels (the JSON must parse).
fn dashboard_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match v {
                    serde_json::Value::String(s) if key == "expr" => out.push(s.clone()),
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// The series names of a Prometheus / OpenMetrics exposition: histograms appear as
/// `name_bucket`, `name_sum` and `name_count`, counters with their `_total`, as Prometheus
/// stores them.
fn exported_series(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn every_metric_the_alerts_and_the_dashboard_use_is_exported() {
    // Referenced names, histograms by their series (`_bucket`, `_sum`, `_count`) as PromQL uses them.
    let alerts = metric_names(&repo_file("deploy/prometheus/alerts.yaml"));
    let dashboard: serde_json::Value = serde_json::from_str(&repo_file("deploy/grafana/dashboard.json"))
        .expect("deploy/grafana/dashboard.json is not valid JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    assert!(!exprs.is_empty(), "the dashboard has no expr");
    let dashboard_names = metric_names(&exprs.join("\n"));
    // The scan found what the files are about (guards against a scan that finds nothing).
    let expected = [
        "inbox_needs_review",
        "inbox_oldest_unprocessed_age_seconds",
        "inbox_ingest_requests_total",
        "inbox_outbox_parked",
        "inbox_outbox_oldest_pending_age_seconds",
        "inbox_relay_deliveries_total",
        "inbox_reconciliation_items_open",
        "inbox_ingest_last_stored_timestamp_seconds",
    ];
    for name in expected {
        assert!(alerts.contains(name), "alerts.yaml should use {name}: found {alerts:?}");
        assert!(dashboard_names.contains(name), "the dashboard should use {name}: {dashboard_names:?}");
    }

    // The ingest, with labelled series touched: a Family prints only the label sets it has seen.
    let app = spawn_app().await;
    let body = invoice_paid("evt_metrics_1", "in_metrics_1", 4200);
    assert_eq!(app.post_signed(body.clone()).await.status, 200); // accepted
    assert_eq!(app.post_signed(body.clone()).await.status, 200); // duplicate
    assert_eq!(app.post("billing", Some("t=1,v1=00"), body.clone()).await.status, 400); // bad signature
    let signed = sign(SECRET_A, &body);
    assert_eq!(app.post("no-such-endpoint", Some(&signed), body.clone()).await.status, 404);
    let ingest = app.get("/metrics").await;
    assert_eq!(ingest.status, 200);

    // The worker binary with its metrics endpoint; it processes the event stored above and an
    // ignored one, so that its outcome series and histograms exist.
    let client = app.db.client().await;
    store_event(&client, "billing", &invoice_event("evt_metrics_2", "customer.created", "in_m2", "open", 0))
        .await;
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).arg("run").args([
        "--poll-interval",
        "100ms",
        "--metrics-listen",
        "127.0.0.1:0",
        "--ignore",
        "customer.*",
    ]);
    let (worker, address) = inbox_test_support::process::start_worker_with_metrics(cmd);
    let http = inbox_test_support::app::http_client();
    let scrape = || {
        let (http, address) = (http.clone(), address.clone());
        async move { http.get(format!("http://{address}/metrics")).send().await.unwrap().text().await.unwrap() }
    };
    let processed = eventually(Duration::from_secs(20), || async {
        let text = scrape().await;
        text.contains(r#"inbox_worker_events_total{outcome="processed"}"#)
            && text.contains(r#"inbox_worker_events_total{outcome="ignored"}"#)
    })
    .await;
    let worker_text = scrape().await;
    assert!(processed, "the worker processed nothing:\n{worker_text}\n{}", worker.output());

    // The relay with its metrics endpoint, delivering to a receiver that answers 2xx: one outbox
    // row written here (besides those the worker's handler wrote), so that its delivery series
    // exists. Its metrics address is in its "running" log line.
    let receiver = Receiver::start(false).await;
    crate::relay::write_outbox(&client, "in_metrics_relay", "invoice.paid", 1).await;
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).env("INBOX_RELAY_SECRET", RELAY_SECRET).arg("relay").args([
        "--to-url",
        &receiver.url,
        "--metrics-listen",
        "127.0.0.1:0",
        "--poll-interval",
        "100ms",
    ]);
    let relay = crate::relay::start(cmd).await;
    let running = relay.output();
    let running =
        running.lines().find(|line| line.contains("inbox-relay running")).expect("its running line");
    let log: serde_json::Value = serde_json::from_str(running).expect("json log line");
    let relay_address = log["metrics"].as_str().expect("metrics field").to_owned();
    let scrape_relay = || {
        let (http, address) = (http.clone(), relay_address.clone());
        async move { http.get(format!("http://{address}/metrics")).send().await.unwrap().text().await.unwrap() }
    };
    let delivered = eventually(Duration::from_secs(20), || async {
        scrape_relay()
            .await
            .contains(r#"inbox_relay_deliveries_total{destination="http",outcome="delivered"}"#)
    })
    .await;
    let relay_text = scrape_relay().await;
    assert!(delivered, "the relay delivered nothing:\n{relay_text}\n{}", relay.output());
    assert!(!receiver.accepted().is_empty(), "the receiver got nothing");

    let mut exported = exported_series(&ingest.text);
    exported.extend(exported_series(&worker_text));
    exported.extend(exported_series(&relay_text));
    for (file, names) in
        [("deploy/prometheus/alerts.yaml", &alerts), ("deploy/grafana/dashboard.json", &dashboard_names)]
    {
        // A histogram may also be named by its family (in prose: "p99 of …_seconds").
        let missing: Vec<_> = names
            .iter()
            .filter(|name| !exported.contains(*name) && !exported.contains(&format!("{name}_bucket")))
            .collect();
        assert!(
            missing.is_empty(),
            "{file} uses metrics the binaries do not export: {missing:?}\nexported: {exported:?}"
        );
    }
}

#[tokio::test]
async fn the_keda_query_counts_the_rows_stats_calls_ready() {
    let manifest = repo_file("deploy/k8s/base/worker-scaledobject.yaml");
    let query = manifest
        .lines()
        .find_map(|line| line.trim().strip_prefix("query: "))
        .expect("no `query:` in worker-scaledobject.yaml")
        .trim_matches('"')
        .to_owned();
    let db = TestDb::new().await;
    let client = db.client().await;
    for (id, state) in [
        ("evt_ready", "attempts = 0"),
        ("evt_retry_later", "attempts = 3, available_at = now() + interval '1 minute', last_error = 'boom'"),
        ("evt_leased", "attempts = 1, available_at = now() + interval '2 minutes'"),
        ("evt_parked", "attempts = 3, last_error = 'boom', parked_at = now()"),
        ("evt_processed", "attempts = 1, processed_at = now()"),
    ] {
        store_event(&client, "billing", &invoice_paid(id, &format!("in_{id}"), 100)).await;
        client
            .execute(&format!("UPDATE webhook_inbox SET {state} WHERE event_id = $1"), &[&id])
            .await
            .unwrap();
    }
    let keda = scalar(&client, &query).await;
    let gauges = inbox_domain::inbox::store::admin::queue_gauges(&client).await.unwrap();
    assert_eq!(keda, 1, "the KEDA query should count only the ready row: {query}");
    assert_eq!(keda, gauges.ready, "the KEDA query and the inbox_ready gauge disagree");
}

#[tokio::test]
async fn the_relay_keda_query_counts_the_outbox_rows_a_claim_can_take() {
    let manifest = repo_file("deploy/k8s/base/relay-scaledobject.yaml");
    let query = manifest
        .lines()
        .find_map(|line| line.trim().strip_prefix("query: "))
        .expect("no `query:` in relay-scaledobject.yaml")
        .trim_matches('"')
        .to_owned();
    let db = TestDb::new().await;
    let client = db.client().await;
    let ready = crate::relay::write_outbox(&client, "in_ready", "invoice.paid", 1).await;
    // The same aggregate's next row: ready too, until a claim meets it and holds it back.
    crate::relay::write_outbox(&client, "in_ready", "invoice.paid", 2).await;
    for (aggregate, state) in [
        ("in_leased", "attempts = 1, fencing_token = 1, available_at = now() + interval '2 minutes'"),
        ("in_retry_later", "attempts = 3, available_at = now() + interval '1 minute', last_error = 'boom'"),
        ("in_parked", "attempts = 16, last_error = 'boom', parked_at = now()"),
        ("in_published", "attempts = 1, published_at = now()"),
    ] {
        let id = crate::relay::write_outbox(&client, aggregate, "invoice.paid", 1).await;
        client.execute(&format!("UPDATE outbox SET {state} WHERE id = $1"), &[&id]).await.unwrap();
    }
    assert_eq!(scalar(&client, &query).await, 2, "the two available rows of in_ready: {query}");

    let pool = inbox_test_support::worker::pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let claim = inbox_domain::inbox::store::outbox::claim(
        &conn,
        inbox_domain::db::Pooler::None,
        None,
        16,
        100,
        i64::MAX,
        Duration::from_secs(120),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let claimed: Vec<i64> = claim.claimed.iter().map(|row| row.id).collect();
    assert_eq!((claimed, claim.parked.len(), claim.held), (vec![ready], 0, 1));
    assert_eq!(
        scalar(&client, &query).await,
        0,
        "after the claim, the claimed row is leased and the one behind it held: nothing a relay could take"
    );
}
