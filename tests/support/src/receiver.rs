//! An HTTP receiver for the relay's deliveries: records every request (headers, body, what it
//! answered) and answers as a script says — 200, an error status with or without `Retry-After`,
//! after a delay — the way a real downstream service misbehaves. It can refuse stale attempts as
//! a receiver with side effects does: an attempt whose `inbox-fencing-token` is lower than one it
//! already took for the same `webhook-id` is answered 409 and counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

/// One request the receiver got.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: String,
    pub timestamp: String,
    pub signature: String,
    pub fencing_token: i64,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub body: Vec<u8>,
    /// What the receiver answered.
    pub status: u16,
    pub at: Instant,
}

impl Delivery {
    /// The headers a Standard Webhooks verifier reads, and the body, as JSON (for the
    /// independent verifier).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "headers": {
                "webhook-id": self.id,
                "webhook-timestamp": self.timestamp,
                "webhook-signature": self.signature,
            },
            "body": String::from_utf8_lossy(&self.body),
        })
    }
}

/// How to answer one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    /// Wait this long before answering (a slow or stalled receiver).
    pub delay: Duration,
    /// The answer's body (receivers often say `{"received":true}`).
    pub body: &'static str,
}

impl Reply {
    pub fn ok() -> Self {
        Reply { status: 200, retry_after: None, delay: Duration::ZERO, body: "" }
    }

    pub fn status(status: u16) -> Self {
        Reply { status, retry_after: None, delay: Duration::ZERO, body: "" }
    }
}

/// Decides each answer: given the request and how many requests with its id came before it.
pub type Script = Box<dyn Fn(&Delivery, usize) -> Reply + Send + Sync>;

struct State {
    deliveries: Mutex<Vec<Delivery>>,
    script: Mutex<Arc<Script>>,
    refuse_stale: bool,
    highest_token: Mutex<HashMap<String, i64>>,
    /// Requests so far per id (what the script is told), kept so that a run of 100,000
    /// deliveries does not scan them all on each request.
    per_id: Mutex<HashMap<String, usize>>,
    stale_refused: AtomicU64,
    stale_accepted: AtomicU64,
    /// TCP connections accepted (a client that reuses its connections opens few).
    connections: AtomicU64,
}

/// A running receiver, stopped when dropped.
pub struct Receiver {
    /// Where to POST: `http://127.0.0.1:PORT/hooks`.
    pub url: String,
    state: Arc<State>,
    handle: actix_web::dev::ServerHandle,
}

impl Receiver {
    /// Starts a receiver answering 200 to everything; `refuse_stale` makes it refuse attempts
    /// with a lower fencing token than one it took for the same id.
    pub async fn start(refuse_stale: bool) -> Receiver {
        let state = Arc::new(State {
            deliveries: Mutex::default(),
            script: Mutex::new(Arc::new(Box::new(|_, _| Reply::ok()))),
            refuse_stale,
            highest_token: Mutex::default(),
            per_id: Mutex::default(),
            stale_refused: AtomicU64::new(0),
            stale_accepted: AtomicU64::new(0),
            connections: AtomicU64::new(0),
        });
        let counted = state.clone();
        let (url, handle) = serve(state.clone(), receive, move || {
            counted.connections.fetch_add(1, Ordering::Relaxed);
        });
        Receiver { url, state, handle }
    }

    /// Answers from now on as `script` says.
    pub fn script(&self, script: impl Fn(&Delivery, usize) -> Reply + Send + Sync + 'static) {
        *self.state.script.lock().unwrap() = Arc::new(Box::new(script));
    }

    /// Every request so far, in arrival order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state.deliveries.lock().unwrap().clone()
    }

    /// The requests answered 2xx.
    pub fn accepted(&self) -> Vec<Delivery> {
        self.deliveries().into_iter().filter(|d| (200..300).contains(&d.status)).collect()
    }

    /// Attempts refused as stale (a lower fencing token than one taken for the id).
    pub fn stale_refused(&self) -> u64 {
        self.state.stale_refused.load(Ordering::Relaxed)
    }

    /// Stale attempts taken (only when not refusing them).
    pub fn stale_accepted(&self) -> u64 {
        self.state.stale_accepted.load(Ordering::Relaxed)
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// Waits until `n` requests arrived, or `timeout`.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.state.deliveries.lock().unwrap().len() < n {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let handle = self.handle.clone();
        tokio::spawn(async move { handle.stop(false).await });
    }
}

/// Serves `POST /hooks` with `handler` (given `data`) on a free localhost port, two workers,
/// calling `connected` for each TCP connection accepted; returns the URL and the server's handle.
fn serve<T, F, Args>(
    data: Arc<T>,
    handler: F,
    connected: impl Fn() + Send + Sync + 'static,
) -> (String, actix_web::dev::ServerHandle)
where
    T: Send + Sync + 'static,
    F: actix_web::Handler<Args> + Clone + Send + 'static,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = HttpServer::new(move || {
        App::new()
            .app_data(web::Data::from(data.clone()))
            .app_data(web::PayloadConfig::new(64 << 20))
            .route("/hooks", web::post().to(handler.clone()))
    })
    .on_connect(move |_, _| connected())
    .workers(2)
    .disable_signals()
    .shutdown_timeout(1)
    .listen(listener)
    .unwrap()
    .run();
    let handle = server.handle();
    tokio::spawn(server);
    (format!("http://127.0.0.1:{port}/hooks"), handle)
}

async fn receive(state: web::Data<State>, request: HttpRequest, body: web::Bytes) -> HttpResponse {
    let header =
        |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let mut delivery = Delivery {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        fencing_token: header("inbox-fencing-token").parse().unwrap_or(-1),
        event_type: header("inbox-event-type"),
        aggregate_type: header("inbox-aggregate-type"),
        aggregate_id: header("inbox-aggregate-id"),
        body: body.to_vec(),
        status: 0,
        at: Instant::now(),
    };
    let before = {
        let mut per_id = state.per_id.lock().unwrap();
        let n = per_id.entry(delivery.id.clone()).or_insert(0);
        *n += 1;
        *n - 1
    };
    let script = state.script.lock().unwrap().clone();
    let mut reply = script(&delivery, before);
    if (200..300).contains(&reply.status) {
        let mut highest = state.highest_token.lock().unwrap();
        let seen = highest.get(&delivery.id).copied();
        if seen.is_some_and(|seen| delivery.fencing_token < seen) {
            if state.refuse_stale {
                state.stale_refused.fetch_add(1, Ordering::Relaxed);
                reply = Reply::status(409);
            } else {
                state.stale_accepted.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            highest.insert(delivery.id.clone(), delivery.fencing_token);
        }
    }
    delivery.status = reply.status;
    // Recorded on arrival (a test may act while the answer is held back).
    state.deliveries.lock().unwrap().push(delivery);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut response = HttpResponse::build(actix_web::http::StatusCode::from_u16(reply.status).unwrap());
    if let Some(retry_after) = &reply.retry_after {
        response.insert_header(("Retry-After", retry_after.as_str()));
    }
    response.body(if reply.status == 409 { "stale fencing token" } else { reply.body })
}

/// A receiver for the bench: answers 200 to every request and keeps only how many requests each
/// `webhook-id` got — as little work per request as a receiver can do, so that a benchmark of the
/// relay measures the relay.
pub struct Counter {
    /// Where to POST: `http://127.0.0.1:PORT/hooks`.
    pub url: String,
    ids: Arc<Mutex<HashMap<u64, u32>>>,
    handle: actix_web::dev::ServerHandle,
}

impl Counter {
    pub async fn start() -> Counter {
        let ids: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
        let (url, handle) = serve(ids.clone(), count, || {});
        Counter { url, ids, handle }
    }

    /// Requests answered.
    pub fn requests(&self) -> u64 {
        self.ids.lock().unwrap().values().map(|n| u64::from(*n)).sum()
    }

    /// Distinct `webhook-id`s received.
    pub fn distinct(&self) -> usize {
        self.ids.lock().unwrap().len()
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        let handle = self.handle.clone();
        tokio::spawn(async move { handle.stop(false).await });
    }
}

async fn count(
    ids: web::Data<Mutex<HashMap<u64, u32>>>,
    request: HttpRequest,
    _body: web::Bytes,
) -> HttpResponse {
    let id = request.headers().get("webhook-id").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    match id {
        Some(id) => {
            *ids.lock().unwrap().entry(id).or_insert(0) += 1;
            HttpResponse::Ok().finish()
        }
        None => HttpResponse::BadRequest().finish(),
    }
}
