//! TLS to PostgreSQL as `DATABASE_URL` asks for it, against a cluster that accepts TCP connections
//! over TLS only, with certificates made for the test: every binary connects with
//! `sslmode=verify-full`, and a wrong CA, a certificate for another host or no TLS at all is a
//! refusal at start-up (exit 1) that says which.

use std::time::Duration;

use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::process::{command, run_split, start_ingest};
use inbox_test_support::tls::TlsCluster;

const TIMEOUT: Duration = Duration::from_secs(60);

/// `inbox-worker <args>` with `url`; returns (exit code, stdout, all output).
async fn worker(url: &str, args: &[&str]) -> (i32, String, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", url).env("USER", "tls-test").args(args);
    tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap()
}

async fn refused(url: &str, because: &str) {
    let (code, _, output) = worker(url, &["stats"]).await;
    assert_eq!(code, 1, "refused at start-up: {output}");
    assert!(output.contains(because), "the message says why ({because}): {output}");
}

#[tokio::test]
async fn verify_full_serves_every_binary_and_a_wrong_ca_another_host_or_no_tls_are_refused_by_name() {
    let cluster = tokio::task::spawn_blocking(TlsCluster::start).await.unwrap();
    let ca = cluster.ca.display().to_string();
    let good = cluster.url("postgres", "localhost", &format!("sslmode=verify-full&sslrootcert={ca}"));

    let (code, _, output) = worker(&good, &["migrate"]).await;
    assert_eq!(code, 0, "migrate over verify-full: {output}");

    // The ingest stores over TLS, the worker processes over TLS (pool and LISTEN connection).
    let mut ingest = command("inbox-ingest");
    ingest.env("DATABASE_URL", &good).env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"));
    ingest.env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let mut run = command("inbox-worker");
    run.env("DATABASE_URL", &good).args(["run", "--poll-interval", "100ms"]);
    let run = inbox_test_support::process::Proc::spawn(run);
    let body = invoice_paid("evt_tls", "in_tls", 100);
    let reply = post_webhook(&base, &sign(SECRET_A, &body), body).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}\n{}", ingest.output());
    let mut processed = false;
    for _ in 0..100 {
        let (code, stdout, output) = worker(&good, &["stats", "--json"]).await;
        assert_eq!(code, 0, "stats over verify-full: {output}");
        let stats: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        if stats["processed_last_hour"] == 1 {
            processed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(processed, "the worker processed the event over TLS:\n{}", run.output());
    let (code, _, output) = worker(&good, &["requeue", "--all", "--dry-run"]).await;
    assert_eq!(code, 0, "requeue over verify-full: {output}");
    drop(run);
    drop(ingest);

    // verify-ca checks the chain, not the name; require checks nothing but encrypts.
    let (code, _, output) = worker(
        &cluster.url("postgres", "127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}")),
        &["stats"],
    )
    .await;
    assert_eq!(code, 0, "verify-ca does not check the host name: {output}");
    let (code, _, output) =
        worker(&cluster.url("postgres", "127.0.0.1", "sslmode=require"), &["stats"]).await;
    assert_eq!(code, 0, "require: {output}");

    // Refusals, each naming its cause.
    let other = cluster.other_ca.display().to_string();
    refused(
        &cluster.url("postgres", "localhost", &format!("sslmode=verify-full&sslrootcert={other}")),
        "not signed by a CA of sslrootcert",
    )
    .await;
    refused(
        &cluster.url("postgres", "127.0.0.1", &format!("sslmode=verify-full&sslrootcert={ca}")),
        "not issued for the host in DATABASE_URL",
    )
    .await;
    refused(&cluster.url("postgres", "localhost", "sslmode=disable"), "no encryption").await;
    refused(
        &cluster.url("postgres", "localhost", "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"),
        "sslrootcert /nonexistent/ca.pem",
    )
    .await;
    // The ingest refuses to start on a certificate it cannot trust.
    let mut ingest = command("inbox-ingest");
    ingest
        .env(
            "DATABASE_URL",
            cluster.url("postgres", "localhost", &format!("sslmode=verify-full&sslrootcert={other}")),
        )
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (code, _, output) = tokio::task::spawn_blocking(move || run_split(ingest, TIMEOUT)).await.unwrap();
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("not signed by a CA of sslrootcert"), "{output}");

    // A client certificate: role inbox_cert logs in by certificate only.
    let (cert, key) = (cluster.client_cert.display().to_string(), cluster.client_key.display().to_string());
    let with_cert = format!("sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}");
    let (code, _, output) = worker(&cluster.url("inbox_cert", "localhost", &with_cert), &["stats"]).await;
    assert_eq!(code, 0, "certificate login: {output}");
    refused(
        &cluster.url("inbox_cert", "localhost", &format!("sslmode=verify-full&sslrootcert={ca}")),
        "certificate",
    )
    .await;
}

/// POSTs a signed webhook over a raw TCP connection; returns the status line.
async fn post_webhook(base: &str, signature: &str, body: Vec<u8>) -> String {
    let mut request = format!(
        "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Stripe-Signature: {signature}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    inbox_test_support::app::raw_request(base, &request).await
}

#[tokio::test]
async fn verify_ca_checks_the_chain_itself_and_the_system_roots_serve_only_verify_full() {
    let cluster = tokio::task::spawn_blocking(TlsCluster::start).await.unwrap();
    let (ca, other) = (cluster.ca.display().to_string(), cluster.other_ca.display().to_string());

    // verify-ca: a certificate of the right CA for another name passes; one of another CA fails,
    // and fails for its CA even when its name is wrong too (the name is never looked at).
    let (code, _, output) = worker(
        &cluster.url("postgres", "127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}")),
        &["migrate"],
    )
    .await;
    assert_eq!(code, 0, "the right CA, another name: {output}");
    refused(
        &cluster.url("postgres", "127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={other}")),
        "not signed by a CA of sslrootcert",
    )
    .await;
    // require with a CA file acts as verify-ca, as libpq does.
    refused(
        &cluster.url("postgres", "127.0.0.1", &format!("sslmode=require&sslrootcert={other}")),
        "not signed by a CA of sslrootcert",
    )
    .await;

    // The system's CA store would let any public certificate for any name pass verify-ca or
    // require: refused before connecting, naming verify-full, given or implied.
    for params in
        ["sslmode=verify-ca&sslrootcert=system", "sslmode=require&sslrootcert=system", "sslmode=verify-ca"]
    {
        refused(&cluster.url("postgres", "localhost", params), "verify-full").await;
    }
    // verify-full may use it (and sslrootcert=system alone means verify-full, as in libpq 16): the
    // test CA is in no system store, so the server is refused for its issuer.
    for params in ["sslmode=verify-full&sslrootcert=system", "sslrootcert=system", "sslmode=verify-full"] {
        refused(&cluster.url("postgres", "localhost", params), "not signed by a CA").await;
    }
}
