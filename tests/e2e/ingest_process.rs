//! `inbox-ingest` as a process: start-up refusals, secrets kept out of every output, SIGTERM.

use std::time::Duration;

use inbox_test_support::db::slow_writes;
use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::process::{command, json_lines, run, start_ingest as start};
use inbox_test_support::TestDb;

const DB_PASSWORD: &str = "db-password-never-printed";

/// A database URL for `db` carrying a password (trust auth ignores it) that must never show.
fn url_with_password(db: &TestDb) -> String {
    db.url().replacen("postgres://postgres@", &format!("postgres://postgres:{DB_PASSWORD}@"), 1)
}

fn ingest(db_url: &str, endpoints: &str) -> std::process::Command {
    let mut cmd = command("inbox-ingest");
    cmd.env("DATABASE_URL", db_url).env("INBOX_ENDPOINTS", endpoints).env("INBOX_LISTEN", "127.0.0.1:0");
    cmd
}

fn assert_refused(cmd: std::process::Command, expect_in_message: &str) {
    let (code, output) = run(cmd, Duration::from_secs(20));
    assert_eq!(code, 1, "exit code; output:\n{output}");
    assert!(output.contains(expect_in_message), "expected {expect_in_message:?} in:\n{output}");
    assert!(!output.contains(SECRET_A), "secret printed:\n{output}");
    assert!(!output.contains(DB_PASSWORD), "password printed:\n{output}");
}

#[tokio::test]
async fn start_up_refusals_exit_1_with_a_clear_message() {
    let db = TestDb::new().await;
    let url = url_with_password(&db);
    let good = format!("billing={SECRET_A}");

    let mut cmd = ingest(&url, &good);
    cmd.env("INBOX_SIGNATURE_TOLERANCE", "0");
    assert_refused(cmd, "must be above 0");

    assert_refused(ingest(&url, "billing="), "empty secret");
    assert_refused(ingest(&url, &format!("billing={SECRET_A},")), "empty secret");
    assert_refused(ingest(&url, SECRET_A), "not NAME=SECRET");
    assert_refused(ingest(&url, &format!("bad name={SECRET_A}")), "invalid name");
    assert_refused(ingest(&url, &format!("billing={SECRET_A};billing={SECRET_A}")), "configured twice");
    assert_refused(ingest(&url, ""), "no endpoint configured");
    // Two endpoints separated by a comma would make the second a secret of the first.
    assert_refused(
        ingest(&url, &format!("billing={SECRET_A},shop={SECRET_A}")),
        "separate endpoints with `;`",
    );
    // An API key pasted where the signing secret goes.
    assert_refused(ingest(&url, "billing=sk_test_51HxQkNotASigningSecret"), "is a Stripe API key (sk_");

    // Nothing listens on this port: connection refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let unreachable = format!("postgres://postgres:{DB_PASSWORD}@127.0.0.1:{closed}/inbox");
    assert_refused(ingest(&unreachable, &good), "cannot connect to the database");

    // A usage error is exit 2.
    let mut cmd = ingest(&url, &good);
    cmd.arg("--no-such-flag");
    let (code, _) = run(cmd, Duration::from_secs(20));
    assert_eq!(code, 2);
    // An allow-list that came out empty (a failed fetch of Stripe's list) stops the ingest rather
    // than opening it to everyone; so does a proxy list with no allow-list to serve.
    for (name, value, says) in [
        ("INBOX_ALLOW_FROM", "", "unset the variable"),
        ("INBOX_ALLOW_FROM", "203.0.113.0/24,", "unset the variable"),
        ("INBOX_ALLOW_FROM", "stripe", "CIDR notation"),
    ] {
        let mut cmd = ingest(&url, &good);
        cmd.env(name, value);
        let (code, output) = run(cmd, Duration::from_secs(20));
        assert_eq!(code, 2, "{name}={value:?}: {output}");
        assert!(output.contains(says), "{output}");
    }
    let mut cmd = ingest(&url, &good);
    cmd.env("INBOX_TRUSTED_PROXIES", "10.0.0.0/8");
    assert_refused(cmd, "only read for --allow-from");
}

#[test]
fn help_does_not_show_secrets_from_the_environment() {
    let mut cmd = ingest(&format!("postgres://u:{DB_PASSWORD}@127.0.0.1/x"), &format!("billing={SECRET_A}"));
    cmd.arg("--help");
    let (code, output) = run(cmd, Duration::from_secs(20));
    assert_eq!(code, 0);
    assert!(output.contains("--endpoint"), "{output}");
    assert!(!output.contains(SECRET_A) && !output.contains(DB_PASSWORD), "{output}");
}

#[tokio::test]
async fn no_secret_in_logs_or_responses_even_at_debug_level() {
    let db = TestDb::new().await;
    let mut cmd = ingest(&url_with_password(&db), &format!("billing={SECRET_A}"));
    cmd.env("RUST_LOG", "debug");
    let (mut proc, base) = start(cmd);
    let http = inbox_test_support::app::http_client();
    let body = invoice_paid("evt_logs", "in_1", 1);
    let mut texts = Vec::new();
    for sig in [Some(sign(SECRET_A, &body)), Some("t=1,v1=00".to_owned()), None] {
        let mut req = http.post(format!("{base}/webhooks/stripe/billing")).body(body.clone());
        if let Some(sig) = sig {
            req = req.header("Stripe-Signature", sig);
        }
        texts.push(req.send().await.unwrap().text().await.unwrap());
    }
    texts.push(http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap());
    texts.push(http.get(format!("{base}/readyz")).send().await.unwrap().text().await.unwrap());
    proc.signal(libc::SIGTERM);
    assert!(proc.wait(Duration::from_secs(30)).success());
    let logs = proc.output();
    assert!(logs.contains("evt_logs"), "the event id is logged: {logs}");
    for text in texts.iter().chain(std::iter::once(&logs)) {
        assert!(!text.contains(SECRET_A), "secret leaked: {text}");
        assert!(!text.contains(DB_PASSWORD), "password leaked: {text}");
    }
    assert_eq!(db.count("webhook_inbox").await, 1);
}

/// The span's fields are recorded one by one as the request learns them (the endpoint once it is
/// known to be configured, the event's id and type once the body is verified): each JSON line
/// carries them all once, under "span", and a refused body's id is never among them.
#[tokio::test]
async fn a_json_line_carries_the_webhooks_span_with_each_field_recorded_and_no_unverified_id() {
    let db = TestDb::new().await;
    let mut cmd = ingest(&db.url(), &format!("billing={SECRET_A}"));
    cmd.env("LOG_FORMAT", "json").env("RUST_LOG", "info");
    let (proc, base) = tokio::task::spawn_blocking(move || start(cmd)).await.unwrap();
    let http = inbox_test_support::app::http_client();
    let url = format!("{base}/webhooks/stripe/billing");
    let body = invoice_paid("evt_span", "in_span", 100);
    let signature = sign(SECRET_A, &body);
    let ok = http.post(&url).header("Stripe-Signature", signature).body(body).send().await.unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    let forged = invoice_paid("evt_forged", "in_forged", 100);
    let refused = http.post(&url).header("Stripe-Signature", "t=1,v1=00").body(forged).send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    // The answers can arrive before the process's lines have been read.
    proc.wait_for_line("webhook refused", Duration::from_secs(10));
    let logs = proc.output();
    let lines = json_lines(&logs);
    let line = |message: &str| {
        let found = lines.iter().find(|l| l["message"] == message).cloned();
        found.unwrap_or_else(|| panic!("no {message:?} line:\n{logs}"))
    };

    let stored = line("webhook stored");
    assert_eq!(
        stored["span"],
        serde_json::json!({
            "name": "webhook", "provider": "stripe", "endpoint": "billing",
            "event_id": "evt_span", "event_type": "invoice.paid",
        }),
        "{stored}"
    );
    assert_eq!(
        (&stored["level"], &stored["target"]),
        (&"INFO".into(), &"inbox_ingest::routes".into()),
        "{stored}"
    );
    assert_eq!(stored["outcome"], "accepted", "{stored}");
    assert!(stored["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{stored}");
    assert!(stored["elapsed_ms"].is_number(), "{stored}");
    assert!(stored.get("spans").is_none(), "one copy of the span's fields per line: {stored}");

    let refusal = line("webhook refused");
    assert_eq!(
        refusal["span"],
        serde_json::json!({ "name": "webhook", "provider": "stripe", "endpoint": "billing" }),
        "{refusal}"
    );
    assert!(!logs.contains("evt_forged"), "an unverified body's id is not logged:\n{logs}");
    drop(proc);
}

#[tokio::test]
async fn sigterm_answers_in_flight_requests_then_exits_0() {
    let db = TestDb::new().await;
    // Every insert takes 2 s: the request is in flight when the signal arrives.
    slow_writes(&db.client().await, "webhook_inbox", "BEFORE INSERT", 2.0).await;
    let (mut proc, base) = start(ingest(&db.url(), &format!("billing={SECRET_A}")));
    let http = inbox_test_support::app::http_client();
    let body = invoice_paid("evt_inflight", "in_1", 1);
    let request = http
        .post(format!("{base}/webhooks/stripe/billing"))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .body(body)
        .send();
    let in_flight = tokio::spawn(request);
    // Wait until the insert is running in PostgreSQL, then ask the service to stop.
    let observer = db.client().await;
    for _ in 0..100 {
        let running: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND application_name = 'inbox-ingest' AND query LIKE 'INSERT INTO webhook_inbox%' AND state = 'active'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if running > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proc.signal(libc::SIGTERM);
    let response = in_flight.await.unwrap().expect("the in-flight request is answered");
    assert_eq!(response.status().as_u16(), 200);
    let status = tokio::task::spawn_blocking(move || {
        let status = proc.wait(Duration::from_secs(40));
        (status, proc)
    })
    .await
    .unwrap();
    assert_eq!(status.0.code(), Some(0), "{}", status.1.output());
    assert_eq!(db.count("webhook_inbox").await, 1);
}

#[tokio::test]
async fn an_odd_secret_and_a_misspelt_endpoint_are_warned_about_by_name() {
    let db = TestDb::new().await;
    let cmd = ingest(&db.url(), "billing=not-a-stripe-secret;shop=whsec_fine");
    let (proc, base) = tokio::task::spawn_blocking(move || start(cmd)).await.unwrap();
    let body = invoice_paid("evt_case", "in_case", 100);
    let status = inbox_test_support::app::http_client()
        .post(format!("{base}/webhooks/stripe/Billing"))
        .header("Stripe-Signature", sign("not-a-stripe-secret", &body))
        .body(body)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status.as_u16(), 404);
    // The answer can arrive before the process's log line has been read.
    proc.wait_for_line("\"requested\":\"Billing\"", Duration::from_secs(10));
    let logs = proc.output();
    let lines = json_lines(&logs);
    let secret_warning = lines.iter().find(|l| {
        l["level"] == "WARN"
            && l["message"].as_str().is_some_and(|m| m.contains("does not start with whsec_"))
    });
    let secret_warning = secret_warning.unwrap_or_else(|| panic!("no warning about the odd secret:\n{logs}"));
    assert!(
        secret_warning["message"].as_str().unwrap().contains("\"billing\": its secret #1"),
        "{secret_warning}"
    );
    let unknown = lines.iter().find(|l| l["level"] == "WARN" && l["requested"] == "Billing");
    let unknown = unknown.unwrap_or_else(|| panic!("no warning about the unknown endpoint:\n{logs}"));
    assert_eq!(unknown["configured"], "billing, shop", "{unknown}");
    assert!(!logs.contains("not-a-stripe-secret"), "the secret is never printed:\n{logs}");
    drop(proc);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_the_log_names_the_limit_and_its_setting() {
    let db = TestDb::new().await;
    let mut cmd = ingest(&db.url(), &format!("billing={SECRET_A}"));
    cmd.env("INBOX_MAX_BODY", "4KiB").env("INBOX_MAX_BYTES_IN_FLIGHT", "1MiB");
    let (proc, base) = tokio::task::spawn_blocking(move || start(cmd)).await.unwrap();
    let body = vec![b' '; 8192];
    let status = inbox_test_support::app::http_client()
        .post(format!("{base}/webhooks/stripe/billing"))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .body(body)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status.as_u16(), 413);
    let logs = tokio::task::spawn_blocking(move || {
        proc.wait_for_line("too_large", Duration::from_secs(10));
        proc
    })
    .await
    .unwrap();
    let proc = logs;
    let logs = proc.output();
    let line = json_lines(&logs)
        .into_iter()
        .find(|l| l["outcome"] == "too_large")
        .unwrap_or_else(|| panic!("no line for the 413:\n{logs}"));
    assert_eq!(line["level"], "WARN", "{line}");
    assert_eq!(line["limit_bytes"], 4096, "{line}");
    assert_eq!(line["setting"], "--max-body / INBOX_MAX_BODY", "{line}");
    drop(proc);
}

/// `make run` (scripts/run.sh) with its listen port taken: it stops with an error naming the
/// component and INBOX_LISTEN, instead of printing "running" over a dead ingest.
#[tokio::test]
async fn make_run_stops_naming_the_component_when_the_listen_port_is_taken() {
    let db = TestDb::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let bin_dir = inbox_test_support::process::bin_path("inbox-ingest").parent().unwrap().to_owned();
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/run.sh"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", db.url())
        .env("INBOX_BIN_DIR", bin_dir)
        .env("INBOX_LISTEN", format!("127.0.0.1:{port}"))
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"));
    let (code, output) =
        tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(60))).await.unwrap();
    drop(taken);
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("inbox-ingest stopped at start") && output.contains("INBOX_LISTEN"), "{output}");
    assert!(!output.contains("stripe-inbox is running"), "{output}");
}
