//! The ingest service in-process, on port 0, against a test database.

use std::net::TcpListener;
use std::time::Duration;

use inbox_domain::config::EndpointSpec;
use inbox_ingest::{Application, Settings};

use crate::db::TestDb;
use crate::events::{sign, SECRET_A, SECRET_B, SECRET_C};

/// A running ingest service and the database behind it.
pub struct TestApp {
    pub address: String,
    pub db: TestDb,
    pub http: reqwest::Client,
    handle: inbox_ingest::ServerHandle,
}

/// The settings every test starts from: endpoints `billing` (secrets A and B) and `analytics`
/// (secret C), 5 min tolerance, 64 KiB body limit, 2 s database timeout.
pub fn test_settings(db: &TestDb) -> Settings {
    Settings {
        database: db.config().into(),
        endpoints: vec![
            EndpointSpec {
                name: "billing".into(),
                secrets: vec![SECRET_A.into(), SECRET_B.into()],
                mode: None,
            },
            EndpointSpec { name: "analytics".into(), secrets: vec![SECRET_C.into()], mode: None },
        ],
        tolerance: Duration::from_secs(300),
        max_body: 64 * 1024,
        max_bytes_in_flight: 64 << 20,
        pool_size: 20,
        db_timeout: Duration::from_secs(2),
        body_timeout: Duration::from_secs(5),
        min_body_rate: 64 * 1024,
        sources: Default::default(),
        keep_raw: false,
        handle_signals: false,
    }
}

/// A plain HTTP client: one connection pool, no proxy.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build().unwrap()
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(TestDb::new().await, |_| {}).await
}

/// Starts the service on `db` with the test settings changed by `adjust`.
pub async fn spawn_app_with(db: TestDb, adjust: impl FnOnce(&mut Settings)) -> TestApp {
    let mut settings = test_settings(&db);
    adjust(&mut settings);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let app = Application::build(settings, listener).await.expect("building the application");
    let address = format!("http://127.0.0.1:{}", app.port());
    let handle = app.handle();
    tokio::spawn(app.run_until_stopped());
    TestApp { address, db, http: http_client(), handle }
}

/// A response's status and parsed JSON body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: serde_json::Value,
    pub text: String,
}

impl TestApp {
    /// POSTs `body` to endpoint `endpoint` with the given `Stripe-Signature` (None: no header).
    pub async fn post(&self, endpoint: &str, signature: Option<&str>, body: Vec<u8>) -> Reply {
        let mut request = self
            .http
            .post(format!("{}/webhooks/stripe/{endpoint}", self.address))
            .header("Content-Type", "application/json")
            .body(body);
        if let Some(sig) = signature {
            request = request.header("Stripe-Signature", sig);
        }
        reply(request.send().await.expect("sending the webhook")).await
    }

    /// POSTs `body` to `billing`, freshly signed with secret A.
    pub async fn post_signed(&self, body: Vec<u8>) -> Reply {
        let sig = sign(SECRET_A, &body);
        self.post("billing", Some(&sig), body).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        reply(self.http.get(format!("{}{path}", self.address)).send().await.unwrap()).await
    }

    /// Rows in the inbox.
    pub async fn inbox_rows(&self) -> i64 {
        self.db.count("webhook_inbox").await
    }

    /// Stops the server gracefully.
    pub async fn stop(&self) {
        self.handle.stop(true).await;
    }
}

pub async fn reply(response: reqwest::Response) -> Reply {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    Reply { status, body, text }
}

/// Sends raw bytes over a new TCP connection and returns the response's status line
/// (for requests a well-behaved client cannot make: chunked bodies, lying lengths).
pub async fn raw_request(address: &str, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = address.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before reading everything: ignore write errors.
    let _ = stream.write_all(request).await;
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !response.windows(2).any(|w| w == b"\r\n") {
        match tokio::time::timeout(Duration::from_secs(15), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => response.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&response).lines().next().unwrap_or_default().to_owned()
}

/// POSTs `body`, signed now with secret A, to endpoint `billing` of the service at `base` (a
/// running `inbox-ingest`); returns the status code.
pub async fn post_signed_to(base: &str, body: Vec<u8>) -> u16 {
    http_client()
        .post(format!("{base}/webhooks/stripe/billing"))
        .header("Stripe-Signature", crate::events::sign(crate::events::SECRET_A, &body))
        .body(body)
        .send()
        .await
        .expect("the ingest answers")
        .status()
        .as_u16()
}

/// Sends `requests` (endpoint, Stripe-Signature, body) at once: one thread and one connection
/// each, lined up on a barrier. Returns the replies in order.
pub fn concurrent_posts(address: &str, requests: Vec<(String, String, Vec<u8>)>) -> Vec<Reply> {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(requests.len()));
    let threads: Vec<_> = requests
        .into_iter()
        .map(|(endpoint, signature, body)| {
            let barrier = barrier.clone();
            let url = format!("{address}/webhooks/stripe/{endpoint}");
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    let client = http_client();
                    let request = client.post(&url).header("Stripe-Signature", signature).body(body);
                    barrier.wait();
                    reply(request.send().await.unwrap()).await
                })
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
