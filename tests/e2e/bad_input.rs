//! Hostile and broken HTTP input: slow drips, oversized headers, lying lengths, floods of
//! unknown endpoints and of oversized bodies. Each asserts the answer and that nothing was written.

use std::time::{Duration, Instant};

use inbox_test_support::app::raw_request;
use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::process::{command, rss_kib, start_ingest};
use inbox_test_support::{spawn_app_with, TestDb};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[tokio::test]
async fn a_slow_drip_body_is_cut_off_at_the_body_deadline() {
    let app = spawn_app_with(TestDb::new().await, |s| s.body_timeout = Duration::from_secs(1)).await;
    let body = invoice_paid("evt_drip", "in_1", 100);
    let head = format!(
        "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nStripe-Signature: {}\r\nContent-Length: {}\r\n\r\n",
        sign(SECRET_A, &body),
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(app.address.trim_start_matches("http://")).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut response = Vec::new();
    let mut buf = [0u8; 1024];
    // One byte every 200 ms: the whole body would take minutes.
    for byte in body.iter() {
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => response.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if !response.is_empty() || started.elapsed() > Duration::from_secs(10) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 408"), "{text:?} after {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn headers_over_8_kib_are_431_and_write_nothing() {
    let app = spawn_app_with(TestDb::new().await, |_| {}).await;
    let body = invoice_paid("evt_big_header", "in_1", 100);
    let response = app
        .http
        .post(format!("{}/webhooks/stripe/billing", app.address))
        .header("Stripe-Signature", sign(SECRET_A, &body))
        .header("X-Padding", "p".repeat(9 * 1024))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 431);
    // A huge Stripe-Signature made of many v1 candidates is refused the same way.
    let many = format!("{},{}", sign(SECRET_A, &body), vec![format!("v1={}", "0".repeat(64)); 200].join(","));
    let reply = app.post("billing", Some(&many), body).await;
    assert_eq!(reply.status, 431, "{}", reply.text);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn lying_content_lengths_write_nothing() {
    let app = spawn_app_with(TestDb::new().await, |s| s.body_timeout = Duration::from_secs(1)).await;
    let body = invoice_paid("evt_liar", "in_1", 100);
    let sig = sign(SECRET_A, &body);
    // Claims less than it sends: the body is cut at the declared length and fails verification.
    let short = [
        format!("POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nStripe-Signature: {sig}\r\nContent-Length: 100\r\n\r\n")
            .into_bytes(),
        body.clone(),
    ]
    .concat();
    let status = raw_request(&app.address, &short).await;
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    // Claims more than it sends: waits for the rest until the body deadline.
    let long = [
        format!(
            "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nStripe-Signature: {sig}\r\nContent-Length: {}\r\n\r\n",
            body.len() + 500
        )
        .into_bytes(),
        body.clone(),
    ]
    .concat();
    let status = raw_request(&app.address, &long).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status}");
    // Not a number at all.
    let junk = [
        format!("POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nStripe-Signature: {sig}\r\nContent-Length: lots\r\n\r\n")
            .into_bytes(),
        body,
    ]
    .concat();
    let status = raw_request(&app.address, &junk).await;
    assert!(status.starts_with("HTTP/1.1 4"), "{status}");
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn ten_thousand_unknown_endpoints_are_404s_without_memory_growth() {
    let db = TestDb::new().await;
    let mut cmd = command("inbox-ingest");
    cmd.env("DATABASE_URL", db.url())
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (proc, base) = start_ingest(cmd);
    let http = inbox_test_support::app::http_client();
    let send = |i: usize| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            http.post(format!("{base}/webhooks/stripe/unknown_{i}"))
                .body("{}")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    for i in 0..500 {
        assert_eq!(send(i).await, 404);
    }
    let (warm, _) = rss_kib(proc.child.id()).expect("the ingest runs");
    for chunk in (500..10_000).collect::<Vec<_>>().chunks(50) {
        let statuses = futures_join(chunk.iter().map(|&i| send(i))).await;
        assert!(statuses.iter().all(|s| *s == 404));
    }
    let (after, _) = rss_kib(proc.child.id()).expect("the ingest runs");
    assert!(after < warm + 8 * 1024, "RSS grew from {warm} KiB to {after} KiB over 9500 unknown endpoints");
    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let unknown_series = metrics
        .lines()
        .filter(|l| l.starts_with("inbox_ingest_requests_total{") && l.contains("unknown_endpoint"))
        .count();
    assert_eq!(unknown_series, 1, "one series for all unknown names:\n{metrics}");
    assert!(!metrics.contains("unknown_42"));
    assert_eq!(db.count("webhook_inbox").await, 0);
}

#[tokio::test]
async fn many_concurrent_oversized_bodies_keep_memory_bounded() {
    let db = TestDb::new().await;
    let mut cmd = command("inbox-ingest");
    cmd.env("DATABASE_URL", db.url())
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0")
        .env("INBOX_MAX_BODY", "256KiB");
    let (proc, base) = start_ingest(cmd);
    let address = base.trim_start_matches("http://").to_owned();
    // 64 clients each stream 4 MiB without a Content-Length (chunked): the limit must stop them.
    let clients = (0..64).map(|_| {
        let address = address.clone();
        async move {
            let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
            let head =
                "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
            stream.write_all(head.as_bytes()).await.unwrap();
            let chunk =
                [format!("{:x}\r\n", 64 * 1024).into_bytes(), vec![b'x'; 64 * 1024], b"\r\n".to_vec()]
                    .concat();
            for _ in 0..64 {
                if stream.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            let mut response = vec![0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut response))
                .await
                .ok()
                .and_then(Result::ok);
            String::from_utf8_lossy(&response[..n.unwrap_or(0)]).lines().next().unwrap_or_default().to_owned()
        }
    });
    let statuses = futures_join(clients).await;
    let answered_413 = statuses.iter().filter(|s| s.starts_with("HTTP/1.1 413")).count();
    assert!(answered_413 >= 60, "{statuses:?}");
    let (_, peak) = rss_kib(proc.child.id()).expect("the ingest runs");
    assert!(peak < 128 * 1024, "peak RSS {peak} KiB for 64 x 4 MiB attempted uploads");
    assert_eq!(db.count("webhook_inbox").await, 0);
}

/// Runs futures concurrently and collects their outputs in order.
async fn futures_join<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
