//! The load generator: sends events the way Stripe does.
//!
//! - Every new event is an invoice lifecycle step: mostly `invoice.paid` for a new invoice, some
//!   `invoice.created` / `invoice.finalized` (and later `invoice.paid`) of a longer lifecycle.
//! - A delivery counts as acknowledged only on a 2xx. Any other answer or a transport error is
//!   retried with a fresh signature (timestamp now) after a backoff of 100 ms doubling to 2 s,
//!   on a random ingest process, until acknowledged or the run gives up.
//! - After the acknowledgement, 20 % of the events are delivered once more (Stripe redelivers).
//! - 10 % of the payments are also sent as a second event object: another event id, the same
//!   invoice and amount.
//! - 5 % of first deliveries are a burst: four identical deliveries at the same instant.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_domain::inbox::signature::sign_header;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::rng::Rng;

const REDELIVER_P: f64 = 0.20;
const SECOND_OBJECT_P: f64 = 0.10;
const BURST_P: f64 = 0.05;
const BURST_SIZE: usize = 4;
const ENDPOINT: &str = "billing";

/// One event the generator offered.
#[derive(Debug)]
pub struct Offered {
    pub id: String,
    pub event_type: &'static str,
    pub invoice_id: String,
    pub amount: i64,
    pub acked: AtomicBool,
}

#[derive(Debug, Default)]
pub struct Stats {
    pub offered: AtomicU64,
    pub second_objects: AtomicU64,
    pub requests: AtomicU64,
    pub acked: AtomicU64,
    pub non_2xx: AtomicU64,
    pub transport_errors: AtomicU64,
    pub redeliveries: AtomicU64,
    pub burst_extras: AtomicU64,
    /// 2xx answers saying `duplicate` (redeliveries, bursts, retries of a committed request).
    pub duplicate_answers: AtomicU64,
    pub by_status: Mutex<BTreeMap<u16, u64>>,
    pub transport_kinds: Mutex<BTreeMap<&'static str, u64>>,
}

pub struct Load {
    http: reqwest::Client,
    targets: Vec<String>,
    secret: String,
    permits: Semaphore,
    pub stats: Stats,
    pub events: Mutex<Vec<Arc<Offered>>>,
    /// Cancelled when the run ends and the final retry window is over: stop retrying.
    pub give_up: CancellationToken,
    pub tasks: TaskTracker,
}

impl Load {
    pub fn new(ingest_ports: &[u16], secret: &str, senders: usize) -> Load {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .connect_timeout(Duration::from_secs(2))
            .pool_idle_timeout(Duration::from_secs(20))
            .build()
            .expect("building the HTTP client");
        Load {
            http,
            targets: ingest_ports
                .iter()
                .map(|p| format!("http://127.0.0.1:{p}/webhooks/stripe/{ENDPOINT}"))
                .collect(),
            secret: secret.to_owned(),
            permits: Semaphore::new(senders),
            stats: Stats::default(),
            events: Mutex::default(),
            give_up: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// Offers new events at `rate` per second until `stop` is cancelled.
    pub async fn generate(self: Arc<Self>, rate: f64, seed: u64, mut rng: Rng, stop: CancellationToken) {
        let mut interval = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.1)));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut n = 0u64;
        let mut open_invoices: VecDeque<(String, i64)> = VecDeque::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = interval.tick() => {}
            }
            n += 1;
            let event_id = format!("evt_chaos_{seed:x}_{n}");
            let roll = rng.unit();
            let (event_type, invoice_id, amount) = if roll < 0.15 {
                let invoice = format!("in_chaos_{seed:x}_{n}");
                let amount = 100 + rng.below(100_000) as i64;
                if open_invoices.len() < 1000 {
                    open_invoices.push_back((invoice.clone(), amount));
                }
                ("invoice.created", invoice, amount)
            } else if roll < 0.25 && !open_invoices.is_empty() {
                let (invoice, amount) = open_invoices[rng.below(open_invoices.len())].clone();
                ("invoice.finalized", invoice, amount)
            } else if rng.chance(0.3) && !open_invoices.is_empty() {
                let (invoice, amount) = open_invoices.pop_front().unwrap();
                ("invoice.paid", invoice, amount)
            } else {
                ("invoice.paid", format!("in_chaos_{seed:x}_{n}"), 100 + rng.below(100_000) as i64)
            };
            let burst = rng.chance(BURST_P);
            self.offer(
                event_id.clone(),
                event_type,
                invoice_id.clone(),
                amount,
                burst,
                Duration::ZERO,
                rng.fork(),
            );
            if event_type == "invoice.paid" && rng.chance(SECOND_OBJECT_P) {
                // The same payment as a second Event object, a little later (or at once).
                let delay = if rng.chance(0.3) {
                    Duration::ZERO
                } else {
                    Duration::from_secs_f64(rng.range(0.0, 2.0))
                };
                self.stats.second_objects.fetch_add(1, Relaxed);
                self.offer(
                    format!("{event_id}_second"),
                    event_type,
                    invoice_id,
                    amount,
                    false,
                    delay,
                    rng.fork(),
                );
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn offer(
        self: &Arc<Self>,
        id: String,
        event_type: &'static str,
        invoice_id: String,
        amount: i64,
        burst: bool,
        delay: Duration,
        rng: Rng,
    ) {
        let status = match event_type {
            "invoice.created" => "draft",
            "invoice.finalized" => "open",
            _ => "paid",
        };
        let body = inbox_test_support::events::invoice_event(&id, event_type, &invoice_id, status, amount);
        let offered = Arc::new(Offered { id, event_type, invoice_id, amount, acked: AtomicBool::new(false) });
        self.events.lock().unwrap().push(offered.clone());
        self.stats.offered.fetch_add(1, Relaxed);
        let this = self.clone();
        self.tasks.spawn(async move { this.lifecycle(offered, body, burst, delay, rng).await });
    }

    async fn lifecycle(
        &self,
        event: Arc<Offered>,
        body: Vec<u8>,
        burst: bool,
        delay: Duration,
        mut rng: Rng,
    ) {
        if !delay.is_zero() && !self.sleep(delay).await {
            return;
        }
        if !self.deliver(&body, burst, &mut rng).await {
            return;
        }
        event.acked.store(true, Relaxed);
        self.stats.acked.fetch_add(1, Relaxed);
        if rng.chance(REDELIVER_P) {
            if !self.sleep(Duration::from_secs_f64(rng.range(0.2, 5.0))).await {
                return;
            }
            self.stats.redeliveries.fetch_add(1, Relaxed);
            self.deliver(&body, false, &mut rng).await;
        }
    }

    /// Sleeps, unless the run gives up first (then false).
    async fn sleep(&self, d: Duration) -> bool {
        tokio::select! {
            _ = self.give_up.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }

    /// Delivers until a 2xx (true) or until the run gives up (false).
    async fn deliver(&self, body: &[u8], mut burst: bool, rng: &mut Rng) -> bool {
        let mut backoff = Duration::from_millis(100);
        loop {
            let acked = if burst {
                burst = false;
                self.burst(body, rng).await
            } else {
                let _permit = self.permits.acquire().await.expect("semaphore closed");
                self.send(body, rng.below(self.targets.len())).await
            };
            if acked {
                return true;
            }
            if self.give_up.is_cancelled() || !self.sleep(backoff.mul_f64(rng.range(0.5, 1.5))).await {
                return false;
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Four identical deliveries at once; acknowledged when any of them got a 2xx.
    async fn burst(&self, body: &[u8], rng: &mut Rng) -> bool {
        let _permits = self.permits.acquire_many(BURST_SIZE as u32).await.expect("semaphore closed");
        self.stats.burst_extras.fetch_add(BURST_SIZE as u64 - 1, Relaxed);
        let t: Vec<usize> = (0..BURST_SIZE).map(|_| rng.below(self.targets.len())).collect();
        let (a, b, c, d) = tokio::join!(
            self.send(body, t[0]),
            self.send(body, t[1]),
            self.send(body, t[2]),
            self.send(body, t[3])
        );
        a || b || c || d
    }

    /// One delivery, signed now. True on a 2xx.
    async fn send(&self, body: &[u8], target: usize) -> bool {
        self.stats.requests.fetch_add(1, Relaxed);
        let signature = sign_header(&self.secret, inbox_test_support::events::now(), body);
        let result = self
            .http
            .post(&self.targets[target])
            .header("Stripe-Signature", signature)
            .header("Content-Type", "application/json")
            .body(body.to_vec())
            .send()
            .await;
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                self.transport_error(&e);
                return false;
            }
        };
        let status = response.status().as_u16();
        *self.stats.by_status.lock().unwrap().entry(status).or_default() += 1;
        if !response.status().is_success() {
            self.stats.non_2xx.fetch_add(1, Relaxed);
            return false;
        }
        // The row is committed once the status line says 2xx; the body only tells a duplicate.
        if let Ok(text) = response.text().await {
            if text.contains("duplicate") {
                self.stats.duplicate_answers.fetch_add(1, Relaxed);
            }
        }
        true
    }

    fn transport_error(&self, e: &reqwest::Error) {
        self.stats.transport_errors.fetch_add(1, Relaxed);
        let kind = if e.is_connect() {
            "connect"
        } else if e.is_timeout() {
            "timeout"
        } else if e.is_request() {
            "request"
        } else if e.is_body() {
            "body"
        } else {
            "other"
        };
        *self.stats.transport_kinds.lock().unwrap().entry(kind).or_default() += 1;
    }

    /// Events offered but never acknowledged (Stripe would still be retrying them).
    pub fn unacknowledged(&self) -> u64 {
        self.events.lock().unwrap().iter().filter(|e| !e.acked.load(Relaxed)).count() as u64
    }
}
