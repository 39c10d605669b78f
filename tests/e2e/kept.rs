//! Every event Stripe sends is kept: a verified body `jsonb` refuses is stored byte for byte and
//! parked; each row records which secret verified it; an endpoint declared live parks test events.
//! The ingest in-process, the operator commands and the worker as processes.

use std::time::Duration;

use inbox_domain::config::EndpointMode;
use inbox_domain::inbox::signature::{fingerprint, sign_header};
use inbox_test_support::app::{spawn_app_with, TestApp};
use inbox_test_support::db::{column, scalar};
use inbox_test_support::events::{invoice_paid, now, sign, SECRET_A, SECRET_B};
use inbox_test_support::process::{command, run, Proc};
use inbox_test_support::worker::eventually;
use inbox_test_support::TestDb;
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(60);

/// `inbox-worker <args>` on the app's database; returns (exit code, stdout + stderr).
async fn worker(app: &TestApp, args: &[&str]) -> (i32, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).env("USER", "tester").args(args);
    tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
}

/// `inbox-worker <args> --json`, which must succeed: its stdout parsed.
async fn worker_json(app: &TestApp, args: &[&str]) -> Value {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).env("USER", "tester").args(args).arg("--json");
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The three bodies PostgreSQL's jsonb refuses though serde reads them: a NUL escape, a lone
/// surrogate, and nesting deeper than the server's stack (50,000 levels).
fn unstorable_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let deep = format!(
        r#"{{"id":"evt_deep","object":"event","type":"invoice.paid","data":{}{}}}"#,
        "[".repeat(50_000),
        "]".repeat(50_000)
    );
    vec![
        ("evt_nul", br#"{"id":"evt_nul","object":"event","type":"invoice.paid","data":{"object":{"memo":"a\u0000b"}}}"#.to_vec()),
        ("evt_surrogate", br#"{"id":"evt_surrogate","object":"event","type":"invoice.paid","data":{"object":{"memo":"\ud800"}}}"#.to_vec()),
        ("evt_deep", deep.into_bytes()),
    ]
}

async fn app_with_big_bodies() -> TestApp {
    spawn_app_with(TestDb::new().await, |s| s.max_body = 1 << 20).await
}

#[tokio::test]
async fn a_verified_body_jsonb_refuses_is_200_kept_byte_exact_parked_with_its_reason_and_listed_for_review() {
    let app = app_with_big_bodies().await;
    let client = app.db.client().await;
    for (id, body) in unstorable_bodies() {
        let reply = app.post_signed(body.clone()).await;
        assert_eq!(reply.status, 200, "{id}: {}", reply.text);
        assert_eq!(reply.body["status"], "accepted", "{id}");
        // Stripe retries what it did not see answered: the retry is a duplicate, still one row.
        let again = app.post_signed(body.clone()).await;
        assert_eq!((again.status, again.body["status"].as_str()), (200, Some("duplicate")), "{id}");

        let row = client
            .query_one(
                "SELECT raw_body, payload IS NULL, held, parked_at IS NOT NULL, last_error, attempts, secret_position
                   FROM webhook_inbox WHERE event_id = $1",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, Vec<u8>>(0), body, "{id}: kept byte for byte");
        assert!(row.get::<_, bool>(1), "{id}: no payload");
        assert_eq!(row.get::<_, Option<String>>(2).as_deref(), Some("unstorable"), "{id}");
        assert!(row.get::<_, bool>(3), "{id}: parked");
        let reason: String = row.get(4);
        assert!(reason.contains("SQLSTATE"), "{id}: the reason names PostgreSQL's: {reason}");
        assert_eq!(row.get::<_, i32>(5), 0, "{id}: no worker attempt");
        assert_eq!(row.get::<_, Option<i16>>(6), Some(0), "{id}: verified by the first secret");
    }
    let reason: String = client
        .query_one("SELECT last_error FROM webhook_inbox WHERE event_id = 'evt_deep'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(reason.contains("54001"), "nesting is the stack depth: {reason}");

    let metrics = app.get("/metrics").await.text;
    assert!(metrics.contains(r#"inbox_ingest_unstorable_total{endpoint="billing"} 3"#), "{metrics}");
    assert!(
        metrics.contains(r#"inbox_ingest_unstorable_total{endpoint="analytics"} 0"#),
        "born at 0: {metrics}"
    );

    let review = worker_json(&app, &["needs-review"]).await;
    let listed: Vec<(&str, &str)> = review["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["event_id"].as_str().unwrap(), r["held"].as_str().unwrap()))
        .collect();
    assert_eq!(listed.len(), 3, "{review}");
    assert!(listed.iter().all(|(_, held)| *held == "unstorable"), "{review}");
    let stats = worker_json(&app, &["stats"]).await;
    assert_eq!(stats["needs_review"], 3, "{stats}");

    // Nothing a handler could read: requeue by id is refused by name, --all leaves them.
    let (code, output) = worker(&app, &["requeue", "--event-id", "evt_nul"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("raw_body"), "{output}");
    let (code, output) = worker(&app, &["requeue", "--all"]).await;
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("3 more held on arrival"), "{output}");
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox WHERE held = 'unstorable' AND parked_at IS NOT NULL"
        )
        .await,
        3
    );
    // A hold cleared by hand puts a row without a payload in the queue: the claim parks it again
    // (held as unstorable), never hands it to a handler, and the other rows are processed.
    client
        .execute("UPDATE webhook_inbox SET held = NULL, parked_at = NULL WHERE event_id = 'evt_nul'", &[])
        .await
        .unwrap();
    let good = invoice_paid("evt_good", "in_good", 100);
    assert_eq!(app.post_signed(good).await.status, 200);
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).args(["run", "--poll-interval", "100ms"]);
    let worker_proc = Proc::spawn(cmd);
    worker_proc.wait_for_line("inbox-worker running", Duration::from_secs(30));
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(
                &client,
                "SELECT count(*) FROM webhook_inbox WHERE event_id = 'evt_good' AND processed_at IS NOT NULL",
            )
            .await
                == 1
        })
        .await
    );
    let row = client
        .query_one("SELECT held, parked_at IS NOT NULL, processed_at IS NULL, last_error FROM webhook_inbox WHERE event_id = 'evt_nul'", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("unstorable"));
    assert!(row.get::<_, bool>(1) && row.get::<_, bool>(2), "parked again, not processed");
    assert!(row.get::<_, String>(3).contains("raw_body"), "{:?}", row.get::<_, String>(3));
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1, "only evt_good booked");
    drop(worker_proc);
}

#[tokio::test]
async fn a_verified_array_is_not_an_event_and_is_refused_with_400() {
    let app = app_with_big_bodies().await;
    for body in [&br#"["evt_1","invoice.paid"]"#[..], br#"  ["evt_1","invoice.paid",false]"#] {
        let reply = app.post_signed(body.to_vec()).await;
        assert_eq!(reply.status, 400, "{}", reply.text);
    }
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn each_row_records_the_secret_that_verified_it_and_stats_count_per_secret_during_a_roll() {
    let app = app_with_big_bodies().await;
    // A roll: billing accepts A (old) and B (new). 3 deliveries signed with A, 5 with B, and one
    // of B's delivered twice (counted once as a row, twice as a verification).
    let mut signed_at = Vec::new();
    for i in 0..8 {
        let body = invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100);
        let t = now() - i;
        let secret = if i < 3 { SECRET_A } else { SECRET_B };
        let header = sign_header(secret, t, &body);
        let reply = app.post("billing", Some(&header), body.clone()).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        if i == 7 {
            assert_eq!(app.post("billing", Some(&header), body).await.body["status"], "duplicate");
        }
        signed_at.push(t);
    }
    let client = app.db.client().await;
    let recorded: Vec<(String, i16, String, i64)> = client
        .query(
            "SELECT event_id, secret_position, secret_fingerprint, signature_t FROM webhook_inbox ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    for (i, (event_id, position, fp, t)) in recorded.iter().enumerate() {
        let (want_position, want_secret) = if i < 3 { (0, SECRET_A) } else { (1, SECRET_B) };
        assert_eq!(
            (*position, fp.as_str(), *t),
            (want_position, fingerprint(want_secret).as_str(), signed_at[i]),
            "{event_id}"
        );
        assert!(!fp.contains("whsec"));
    }

    let stats = worker_json(&app, &["stats"]).await;
    let by_secret: Vec<(String, i64, String, i64, i64)> = stats["by_secret"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["endpoint"].as_str().unwrap().to_owned(),
                s["position"].as_i64().unwrap(),
                s["fingerprint"].as_str().unwrap().to_owned(),
                s["rows"].as_i64().unwrap(),
                s["rows_last_24h"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by_secret,
        [
            ("billing".to_owned(), 0, fingerprint(SECRET_A), 3, 3),
            ("billing".to_owned(), 1, fingerprint(SECRET_B), 5, 5),
        ],
        "{stats}"
    );
    let (code, table) = worker(&app, &["stats"]).await;
    assert_eq!(code, 0);
    assert!(table.contains(&fingerprint(SECRET_B)), "{table}");
    assert!(!table.contains("whsec") && !stats.to_string().contains("whsec"));

    let metrics = app.get("/metrics").await.text;
    for (secret, n) in [(SECRET_A, 3), (SECRET_B, 6)] {
        let line = format!(
            r#"inbox_ingest_verified_total{{endpoint="billing",secret="{}"}} {n}"#,
            fingerprint(secret)
        );
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
    assert!(!metrics.contains("whsec"));
}

#[tokio::test]
async fn a_test_mode_event_on_an_endpoint_declared_live_is_stored_parked_and_never_applied() {
    let app = spawn_app_with(TestDb::new().await, |s| {
        s.endpoints[0].mode = Some(EndpointMode::Live);
    })
    .await;
    let event = |id: &str, invoice: &str, livemode: Option<bool>| {
        let mut body: Value = serde_json::from_slice(&invoice_paid(id, invoice, 500)).unwrap();
        match livemode {
            Some(live) => body["livemode"] = Value::Bool(live),
            None => drop(body.as_object_mut().unwrap().remove("livemode")),
        }
        serde_json::to_vec(&body).unwrap()
    };
    for body in [
        event("evt_test", "in_test", Some(false)),
        event("evt_unknown", "in_unknown", None),
        event("evt_live", "in_live", Some(true)),
    ] {
        let reply = app.post_signed(body).await;
        assert_eq!((reply.status, reply.body["status"].as_str()), (200, Some("accepted")), "{}", reply.text);
    }
    // The other endpoint declares nothing: both modes are applied there.
    let body = event("evt_any", "in_any", Some(false));
    let reply = app.post("analytics", Some(&sign(inbox_test_support::events::SECRET_C, &body)), body).await;
    assert_eq!(reply.status, 200);

    let client = app.db.client().await;
    let held: Vec<String> = column(
        &client,
        "SELECT event_id FROM webhook_inbox WHERE held = 'livemode' AND parked_at IS NOT NULL ORDER BY 1",
    )
    .await;
    assert_eq!(held, ["evt_test", "evt_unknown"]);
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains(r#"inbox_ingest_requests_total{endpoint="billing",outcome="held_livemode"} 2"#),
        "{metrics}"
    );

    // A worker runs: the live event books, the held ones do not.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", app.db.url()).args(["run", "--poll-interval", "100ms"]);
    let worker_proc = Proc::spawn(cmd);
    worker_proc.wait_for_line("inbox-worker running", Duration::from_secs(30));
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await == 2
        })
        .await,
        "the live event and the undeclared endpoint's event are processed"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let booked: Vec<String> = column(&client, "SELECT invoice_id FROM ledger_entries ORDER BY 1").await;
    assert_eq!(booked, ["in_any", "in_live"], "the test-mode event never reached the ledger");

    let review = worker_json(&app, &["needs-review"]).await;
    let row = &review["rows"][0];
    assert_eq!(
        (row["event_id"].as_str(), row["held"].as_str(), row["livemode"].as_bool()),
        (Some("evt_test"), Some("livemode"), Some(false)),
        "{review}"
    );
    assert!(row["last_error"].as_str().unwrap().contains("declared live"), "{review}");
    let (code, table) = worker(&app, &["needs-review"]).await;
    assert_eq!(code, 0);
    assert!(table.contains("livemode"), "{table}");

    // --all leaves them; a person may take one by id (it belonged here after all), and it books.
    let (code, output) = worker(&app, &["requeue", "--all"]).await;
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("2 more held on arrival"), "{output}");
    assert!(booked.len() == 2 && scalar(&client, "SELECT count(*) FROM ledger_entries").await == 2);
    let (code, output) = worker(&app, &["requeue", "--event-id", "evt_unknown"]).await;
    assert_eq!(code, 0, "{output}");
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_unknown'").await == 1
        })
        .await
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_test'").await, 0);
    drop(worker_proc);
}

#[tokio::test]
async fn with_keep_raw_every_row_keeps_its_signed_bytes_and_verify_proves_them_or_names_the_tampering() {
    let app = spawn_app_with(TestDb::new().await, |s| {
        s.keep_raw = true;
        s.max_body = 1 << 20;
    })
    .await;
    let body = invoice_paid("evt_kept", "in_kept", 700);
    let t = now();
    let reply = app.post("billing", Some(&sign_header(SECRET_B, t, &body)), body.clone()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let nul = unstorable_bodies().remove(0).1;
    assert_eq!(app.post_signed(nul).await.status, 200);
    let client = app.db.client().await;
    let (raw, v1): (Vec<u8>, Vec<u8>) = {
        let row = client
            .query_one("SELECT raw_body, signature_v1 FROM webhook_inbox WHERE event_id = 'evt_kept'", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(raw, body, "the exact bytes, beside the payload");
    assert_eq!(hex::encode(&v1), inbox_domain::inbox::signature::compute_v1(SECRET_B, t, &body));

    let secrets = format!("billing={SECRET_A},{SECRET_B}");
    let verify = |id: &'static str, secrets: String| {
        let app_url = app.db.url();
        async move {
            let mut cmd = command("inbox-worker");
            cmd.env("DATABASE_URL", app_url).env("INBOX_ENDPOINTS", secrets).args([
                "verify",
                "--event-id",
                id,
            ]);
            tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
        }
    };
    let (code, output) = verify("evt_kept", secrets.clone()).await;
    assert_eq!(code, 0, "{output}");
    assert!(
        output.contains(&format!(
            "valid, made by secret {} (position 1 of the 2 configured, from 0 as in `stats`)",
            fingerprint(SECRET_B)
        )),
        "secrets are named by fingerprint and numbered as `stats` numbers them: {output}"
    );
    assert!(
        output.contains(&format!("the ingest recorded secret {} (position 1)", fingerprint(SECRET_B))),
        "{output}"
    );
    assert!(output.contains("the stored payload is the signed body"), "{output}");
    let (code, output) = verify("evt_nul", secrets.clone()).await;
    assert_eq!(code, 0, "an unstorable body is evidence too: {output}");
    assert!(output.contains("payload: none"), "{output}");

    // Only the other secret configured: the kept signature names no secret.
    let (code, output) = verify("evt_kept", format!("billing={SECRET_A}")).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("NOT VALID"), "{output}");
    // One byte of the kept body changed.
    client
        .execute(
            "UPDATE webhook_inbox SET raw_body = raw_body || '\\x20'::bytea WHERE event_id = 'evt_kept'",
            &[],
        )
        .await
        .unwrap();
    let (code, output) = verify("evt_kept", secrets.clone()).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("NOT VALID"), "{output}");
    // The body restored, the payload handlers read changed instead.
    client
        .execute(
            "UPDATE webhook_inbox SET raw_body = $1,
                    payload = jsonb_set(payload, '{data,object,amount_paid}', '7000') WHERE event_id = 'evt_kept'",
            &[&raw],
        )
        .await
        .unwrap();
    let (code, output) = verify("evt_kept", secrets.clone()).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("DIFFERS"), "{output}");
    assert!(!output.contains("whsec"), "no secret in the output: {output}");

    // A row stored without --keep-raw has nothing to verify, and says so.
    client
        .execute(
            "UPDATE webhook_inbox SET raw_body = NULL, signature_v1 = NULL WHERE event_id = 'evt_kept'",
            &[],
        )
        .await
        .unwrap();
    let (code, output) = verify("evt_kept", secrets).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("--keep-raw"), "{output}");
}
