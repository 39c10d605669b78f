//! What a security review found at the edges: ingestion stopped without the secret, sources not
//! restricted, payload bytes in debug logs, readiness probes on the writers' connections, `verify`
//! mistaking a database error for tampering and trusting a rewritten event id, one log line per
//! refused request, secrets accepted as flags. Each test drives the built binaries or the
//! in-process service the way an attacker or an operator would.

use std::time::Duration;

use inbox_test_support::app::post_signed_to;
use inbox_test_support::db::scalar;
use inbox_test_support::events::{invoice_paid, now, sign, SECRET_A};
use inbox_test_support::process::{command, run, start_ingest, Proc};
use inbox_test_support::worker::eventually;
use inbox_test_support::{spawn_app_with, TestDb};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const TIMEOUT: Duration = Duration::from_secs(60);

/// The request head of a delivery declaring `length` body bytes, signed with a fresh `t` and a
/// `v1` that matches nothing (what anyone can write without the secret).
fn bogus_head(address: &str, length: usize) -> String {
    format!(
        "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Stripe-Signature: t={},v1={}\r\nContent-Length: {length}\r\n\r\n",
        now(),
        "0".repeat(64)
    )
}

/// Reads until the status line is in (or the connection ends); returns it.
async fn status_line(stream: &mut TcpStream) -> String {
    let mut response = Vec::new();
    let mut buf = [0u8; 512];
    while !response.windows(2).any(|w| w == b"\r\n") {
        match stream.read(&mut buf).await {
            Ok(n) if n > 0 => response.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&response).lines().next().unwrap_or_default().to_owned()
}

/// `inbox-ingest` on `db`, endpoint `billing` with secret A, on a free port, with `env`; returns it
/// and its base URL.
async fn ingest(db: &TestDb, env: &[(&str, &str)]) -> (Proc, String) {
    let mut ingest = command("inbox-ingest");
    ingest.env("DATABASE_URL", db.url()).env("INBOX_LISTEN", "127.0.0.1:0");
    ingest.env("INBOX_ENDPOINTS", format!("billing={SECRET_A}")).envs(env.iter().copied());
    tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap()
}

#[tokio::test]
async fn forty_headers_declaring_a_mebibyte_each_keep_no_signed_event_out() {
    let db = TestDb::new().await;
    // The defaults (1 MiB bodies, 32 MiB in flight, 5 s database timeout), but a body timeout
    // far longer than the test: only the minimum rate can end the header-only requests in time.
    let (ingest, base) = ingest(&db, &[("INBOX_BODY_TIMEOUT", "120s")]).await;
    let address = base.trim_start_matches("http://").to_owned();

    let mut holders = Vec::new();
    for _ in 0..40 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream.write_all(bogus_head(&address, 1 << 20).as_bytes()).await.unwrap();
        holders.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A real delivery meanwhile: stored, not told to come back later.
    let body = invoice_paid("evt_real", "in_real", 100);
    assert_eq!(post_signed_to(&base, body).await, 200, "{}", ingest.output());
    assert_eq!(db.count("webhook_inbox").await, 1);

    // The header-only requests send nothing: 408, from the minimum rate, not the body timeout.
    for stream in &mut holders {
        let status = tokio::time::timeout(Duration::from_secs(30), status_line(stream)).await;
        let status = status.unwrap_or_else(|_| panic!("still held:\n{}", ingest.output()));
        assert!(status.starts_with("HTTP/1.1 408"), "{status}");
    }
    let metrics = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("inbox_ingest_body_bytes_held 0"), "{metrics}");
    drop::<Proc>(ingest);
}

#[tokio::test]
async fn webhooks_from_outside_the_allowed_networks_are_403_and_the_forwarded_header_counts_only_from_our_proxy(
) {
    let app = spawn_app_with(TestDb::new().await, |s| {
        s.sources.allow = vec!["203.0.113.0/24".parse().unwrap()];
        s.sources.trusted_proxies = vec!["127.0.0.1/32".parse().unwrap()];
    })
    .await;
    let post = |id: &'static str, forwarded: Option<&'static str>| {
        let app = &app;
        async move {
            let body = invoice_paid(id, "in_src", 100);
            let mut request = app
                .http
                .post(format!("{}/webhooks/stripe/billing", app.address))
                .header("Stripe-Signature", sign(SECRET_A, &body))
                .body(body);
            if let Some(forwarded) = forwarded {
                request = request.header("X-Forwarded-For", forwarded);
            }
            request.send().await.unwrap().status().as_u16()
        }
    };
    // Our proxy (127.0.0.1) says the client is in the allowed network.
    assert_eq!(post("evt_allowed", Some("203.0.113.7")).await, 200);
    // Our proxy says the client is elsewhere; a client that wrote an allowed address first is
    // still where our proxy saw it.
    assert_eq!(post("evt_outside", Some("198.51.100.1")).await, 403);
    assert_eq!(post("evt_spoofed", Some("203.0.113.7, 198.51.100.1")).await, 403);
    // No header from our proxy: the proxy itself is the client, not allowed.
    assert_eq!(post("evt_no_header", None).await, 403);
    let stored: Vec<String> =
        inbox_test_support::db::column(&app.db.client().await, "SELECT event_id FROM webhook_inbox").await;
    assert_eq!(stored, ["evt_allowed"], "nothing refused reached the database");
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains(r#"inbox_ingest_requests_total{endpoint="billing",outcome="forbidden_source"} 3"#),
        "{metrics}"
    );
    // Health and readiness stay open to the probes.
    assert_eq!(app.get("/healthz").await.status, 200);

    // Without trusted proxies the header is never read.
    let app =
        spawn_app_with(TestDb::new().await, |s| s.sources.allow = vec!["203.0.113.0/24".parse().unwrap()])
            .await;
    let body = invoice_paid("evt_claims", "in_src", 100);
    let status = app
        .http
        .post(format!("{}/webhooks/stripe/billing", app.address))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .header("X-Forwarded-For", "203.0.113.7")
        .body(body)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status.as_u16(), 403);
    let app =
        spawn_app_with(TestDb::new().await, |s| s.sources.allow = vec!["127.0.0.0/8".parse().unwrap()]).await;
    assert_eq!(app.post_signed(invoice_paid("evt_local", "in_src", 1)).await.status, 200);
}

#[tokio::test]
async fn debug_logs_never_show_a_body_kept_byte_for_byte() {
    let db = TestDb::new().await;
    let (ingest, base) = ingest(&db, &[("INBOX_KEEP_RAW", "true"), ("RUST_LOG", "debug")]).await;
    // One stored as jsonb and kept raw, one jsonb refuses (a \u0000) kept raw only.
    let with_customer = |id: &str, description: &str| {
        format!(
            r#"{{"id":"{id}","object":"event","type":"invoice.paid","data":{{"object":{{"id":"in_pii","object":"invoice","amount_paid":100,"description":"{description}"}}}}}}"#
        )
        .into_bytes()
    };
    for body in [
        with_customer("evt_pii", "Jane Roe, 1 Main St"),
        with_customer("evt_pii_nul", r"Jane Roe\u0000, 1 Main St"),
    ] {
        assert_eq!(post_signed_to(&base, body).await, 200, "{}", ingest.output());
    }
    assert_eq!(db.count("webhook_inbox").await, 2);
    assert_eq!(
        scalar(&db.client().await, "SELECT count(*) FROM webhook_inbox WHERE held = 'unstorable'").await,
        1
    );
    let logs = ingest.wait_for_output("executing statement", Duration::from_secs(10));
    let as_numbers = format!("{:?}", b"Jane Roe");
    let as_numbers = &as_numbers[1..as_numbers.len() - 1];
    for needle in ["Jane Roe", as_numbers] {
        assert!(!logs.contains(needle), "{needle} in the logs:\n{logs}");
    }
    drop::<Proc>(ingest);
}

#[tokio::test]
async fn readiness_probes_by_the_hundred_query_the_database_about_once_a_second() {
    let app = spawn_app_with(TestDb::new().await, |_| {}).await;
    let mut probes = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (http, url) = (app.http.clone(), format!("{}/readyz", app.address));
        probes.spawn(async move { http.get(url).send().await.unwrap().status().as_u16() });
    }
    while let Some(status) = probes.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    app.stop().await;
    // The ingest's sessions report their table reads when they end.
    let client = app.db.client().await;
    let reads = "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0)::bigint FROM pg_stat_user_tables
                  WHERE relname = 'refinery_schema_history'";
    eventually(Duration::from_secs(15), || async {
        client.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
        scalar(&client, reads).await > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
    let reads = scalar(&client, reads).await;
    assert!((1..=3).contains(&reads), "{reads} reads of the schema version for 100 probes");
}

#[tokio::test]
async fn verify_names_a_database_error_as_one_and_a_rewritten_event_id_as_tampering() {
    let app = spawn_app_with(TestDb::new().await, |s| s.keep_raw = true).await;
    assert_eq!(app.post_signed(invoice_paid("evt_a", "in_a", 100)).await.status, 200);
    assert_eq!(app.post_signed(invoice_paid("evt_b", "in_b", 200)).await.status, 200);
    let client = app.db.client().await;
    let verify = |role: Option<String>, id: &'static str| {
        let url = match role {
            Some(role) => app.db.url().replacen("://postgres@", &format!("://{role}@"), 1),
            None => app.db.url(),
        };
        async move {
            let mut cmd = command("inbox-worker");
            cmd.env("DATABASE_URL", url).env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"));
            cmd.args(["verify", "--event-id", id]);
            tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
        }
    };
    let (code, output) = verify(None, "evt_a").await;
    assert_eq!(code, 0, "{output}");

    // The comparison of the payload with the signed body fails for the database's own reasons (a
    // policy that raises as a statement timeout would): an error naming it, not "DIFFERS".
    let role = format!("verifier_{}", app.db.name);
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT SELECT ON webhook_inbox TO {role};
             CREATE FUNCTION fault_on_compare() RETURNS boolean LANGUAGE plpgsql AS $$
             BEGIN
                 IF current_query() LIKE '%convert_from%' THEN
                     RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = 'query_canceled';
                 END IF;
                 RETURN true;
             END $$;
             ALTER TABLE webhook_inbox ENABLE ROW LEVEL SECURITY;
             CREATE POLICY fault ON webhook_inbox FOR SELECT TO {role} USING (fault_on_compare());"
        ))
        .await
        .unwrap();
    let (code, output) = verify(Some(role.clone()), "evt_a").await;
    client
        .batch_execute(&format!(
            "DROP POLICY fault ON webhook_inbox; ALTER TABLE webhook_inbox DISABLE ROW LEVEL SECURITY;
             REVOKE ALL ON webhook_inbox FROM {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("comparing the payload with the signed body"), "{output}");
    assert!(output.contains("(57014)"), "{output}");
    assert!(!output.contains("DIFFERS"), "a database error is not tampering: {output}");

    // A row whose event id (and type) were rewritten keeps another event's signed bytes: the
    // signature is valid, the row is not.
    client
        .batch_execute(
            "DELETE FROM webhook_inbox WHERE event_id = 'evt_a';
             UPDATE webhook_inbox SET event_id = 'evt_a' WHERE event_id = 'evt_b'",
        )
        .await
        .unwrap();
    let (code, output) = verify(None, "evt_a").await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("the signed body is event evt_b"), "{output}");
}

#[tokio::test]
async fn a_flood_of_refused_requests_is_counted_exactly_and_logged_a_few_lines_at_a_time() {
    let db = TestDb::new().await;
    let (ingest, base) = ingest(&db, &[]).await;
    let http = inbox_test_support::app::http_client();
    for i in 0..300 {
        let body = invoice_paid(&format!("evt_flood_{i}"), "in_flood", 1);
        let reply = http
            .post(format!("{base}/webhooks/stripe/billing"))
            .header("Stripe-Signature", format!("t={},v1={}", now(), "0".repeat(64)))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status().as_u16(), 400);
    }
    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"inbox_ingest_requests_total{endpoint="billing",outcome="bad_signature"} 300"#),
        "every refusal counted: {metrics}"
    );
    let logged = ingest.output().lines().filter(|l| l.contains("webhook refused")).count();
    assert!((1..=40).contains(&logged), "{logged} lines for 300 refusals");
    assert_eq!(db.count("webhook_inbox").await, 0);
    drop::<Proc>(ingest);
}

#[tokio::test]
async fn secrets_given_as_flags_are_warned_about_and_never_printed() {
    let db = TestDb::new().await;
    let with_password = db.url().replacen("://postgres@", "://postgres:hunter2-pw@", 1);
    let mut cmd = command("inbox-worker");
    cmd.args(["--database-url", &with_password, "stats"]);
    let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 0, "{output}");
    assert!(
        output.contains("--database-url with a password carries a secret on the command line"),
        "{output}"
    );
    assert!(output.contains("DATABASE_PASSWORD_FILE"), "{output}");
    assert!(!output.contains("hunter2"), "{output}");

    // From the environment: nothing to warn about.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", &with_password).arg("stats");
    let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 0, "{output}");
    assert!(!output.contains("command line"), "{output}");

    let mut ingest = command("inbox-ingest");
    ingest.env("DATABASE_URL", db.url()).env("INBOX_LISTEN", "127.0.0.1:0");
    ingest.args(["--endpoint", &format!("billing={SECRET_A}")]);
    let (ingest, _) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let logs = ingest.output();
    assert!(logs.contains("--endpoint carries a secret on the command line"), "{logs}");
    assert!(logs.contains("INBOX_ENDPOINTS or --endpoints-file"), "{logs}");
    assert!(!logs.contains(SECRET_A), "{logs}");
    drop::<Proc>(ingest);
}
