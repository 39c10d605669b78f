//! The relays in the chaos run: what the workers write to `outbox` goes to two destinations at
//! once — two `inbox-worker relay --to-url` to an HTTP receiver of the run's own, two
//! `relay --to-nats` to a nats-server with JetStream — under every fault of the run plus their
//! own (`relay_sigkill`, `relay_sigstop`, `nats_restart`, in faults.rs).
//!
//! A row is published once per table, so the NATS relays deliver a copy of the outbox: a trigger
//! of this harness (not of the product) inserts every outbox row, id included, into
//! `chaos_nats.outbox` in the same transaction, and the NATS relays connect with
//! `search_path=chaos_nats,public`. Both tables hold the same rows, committed together.
//!
//! The receiver misbehaves as downstream services do — 500s, 429s with `Retry-After`, stalls
//! longer than the relay's delivery timeout — and refuses a stale attempt (a lower
//! `inbox-fencing-token` than one it already took for the `webhook-id`), as a receiver with side
//! effects of its own should. After the drain, per destination: every outbox row delivered
//! (the deduplicated set of deliveries is the outbox exactly), duplicates counted (allowed), each
//! aggregate's rows first delivered in id order, and no stale attempt accepted.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_test_support::nats::{self, Nats};
use inbox_test_support::receiver::{Receiver, Reply};

pub const SUBJECT: &str = "chaos.outbox";
pub const STREAM: &str = "CHAOS_OUTBOX";
/// The schema of the outbox copy the NATS relays deliver.
pub const COPY_SCHEMA: &str = "chaos_nats";
/// The relays' signing secret (Standard Webhooks: whsec_ + base64 of 32 bytes).
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The outbox copy and its trigger; `relay_role` (the production role on the run's own cluster)
/// may claim and mark the copy as it may the outbox. Run as a superuser after the migrations.
pub fn copy_sql(relay_role: Option<&str>) -> String {
    let mut sql = format!(
        "CREATE SCHEMA {COPY_SCHEMA};
         CREATE TABLE {COPY_SCHEMA}.outbox (LIKE public.outbox INCLUDING DEFAULTS INCLUDING INDEXES);
         CREATE FUNCTION {COPY_SCHEMA}.copy_outbox() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
             SET search_path = pg_catalog, pg_temp AS $$
         BEGIN
             INSERT INTO {COPY_SCHEMA}.outbox SELECT NEW.*;
             RETURN NULL;
         END $$;
         CREATE TRIGGER chaos_copy_outbox AFTER INSERT ON public.outbox
             FOR EACH ROW EXECUTE FUNCTION {COPY_SCHEMA}.copy_outbox();"
    );
    if let Some(role) = relay_role {
        sql.push_str(&format!(
            "GRANT USAGE ON SCHEMA {COPY_SCHEMA} TO {role};
             GRANT SELECT, UPDATE ON {COPY_SCHEMA}.outbox TO {role};"
        ));
    }
    sql
}

/// `url` with the copy's schema first on the search path.
pub fn nats_db_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{COPY_SCHEMA}%2Cpublic%2Cpg_temp")
}

/// The destinations of the run.
pub struct Destinations {
    pub receiver: Receiver,
    pub nats: Option<Arc<Mutex<Nats>>>,
    pub nats_url: Option<String>,
    /// Why there is no NATS destination.
    pub nats_skipped: Option<String>,
}

/// Starts the receiver (answering as [`misbehave`] says) and, where nats-server is installed,
/// a server with JetStream and the stream capturing [`SUBJECT`].
pub async fn start(seed: u64) -> anyhow::Result<Destinations> {
    let receiver = Receiver::start(true).await;
    receiver.script(move |delivery, nth| misbehave(seed, &delivery.id, nth));
    let Some(server) = tokio::task::spawn_blocking(Nats::single).await? else {
        return Ok(Destinations {
            receiver,
            nats: None,
            nats_url: None,
            nats_skipped: Some("nats-server is not installed (make deps installs it)".to_owned()),
        });
    };
    let url = server.urls();
    let js = nats::jetstream(&url).await;
    nats::create_stream(&js, STREAM, SUBJECT, 1).await;
    Ok(Destinations {
        receiver,
        nats: Some(Arc::new(Mutex::new(server))),
        nats_url: Some(url),
        nats_skipped: None,
    })
}

/// The receiver's answer to the `nth` request for a row: for its first three attempts, 8 % 500,
/// 5 % 429 with `Retry-After: 1`, 3 % a 3 s stall (past the relay's 2 s delivery timeout: the
/// receiver took it, the relay sees a timeout and delivers again); otherwise, and after, 200.
fn misbehave(seed: u64, id: &str, nth: usize) -> Reply {
    if nth >= 3 {
        return Reply::ok();
    }
    let mut h = seed ^ (nth as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in id.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    let r = (h % 1000) as f64 / 1000.0;
    if r < 0.08 {
        Reply::status(500)
    } else if r < 0.13 {
        Reply { retry_after: Some("1".to_owned()), ..Reply::status(429) }
    } else if r < 0.16 {
        Reply { delay: Duration::from_secs(3), ..Reply::ok() }
    } else {
        Reply::ok()
    }
}

/// Waits until neither table has an unpublished row, or `timeout`; returns whether it drained.
pub async fn drain(db: &tokio_postgres::Config, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let sql = format!(
        "SELECT (SELECT count(*) FROM public.outbox WHERE published_at IS NULL)
              + (SELECT count(*) FROM {COPY_SCHEMA}.outbox WHERE published_at IS NULL)"
    );
    while Instant::now() < deadline {
        if let Ok(client) = crate::faults::connect(db).await {
            if let Ok(row) = client.query_one(&sql, &[]).await {
                if row.get::<_, i64>(0) == 0 {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// What one destination got, against its table.
#[derive(Debug, Default)]
pub struct Verdict {
    pub destination: &'static str,
    pub outbox_rows: usize,
    /// Requests (HTTP) or stored messages (JetStream).
    pub deliveries: usize,
    /// Deliveries taken: answered 2xx, or stored.
    pub accepted: usize,
    /// Taken more than once (allowed: at least once; counted).
    pub duplicates: usize,
    /// Outbox rows never taken.
    pub lost: usize,
    /// Taken ids that are no outbox row.
    pub extra: usize,
    /// An aggregate's row first taken after a later row of the same aggregate.
    pub order_violations: usize,
    /// Attempts refused for a stale fencing token (HTTP), and stale ones taken.
    pub stale_refused: u64,
    pub stale_accepted: usize,
    pub unpublished: i64,
    pub parked: i64,
    pub examples: Vec<String>,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.extra == 0
            && self.order_violations == 0
            && self.stale_accepted == 0
            && self.unpublished == 0
            && self.parked == 0
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "outbox_rows": self.outbox_rows,
            "deliveries": self.deliveries,
            "accepted": self.accepted,
            "duplicates_delivered": self.duplicates,
            "lost": self.lost,
            "not_in_outbox": self.extra,
            "deduplicated_set_equals_outbox": self.lost == 0 && self.extra == 0,
            "order_violations": self.order_violations,
            "stale_tokens_refused": self.stale_refused,
            "stale_tokens_accepted": self.stale_accepted,
            "unpublished": self.unpublished,
            "parked": self.parked,
            "examples": self.examples,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "{} rows, {} deliveries ({} taken, {} duplicates), lost {}, not in outbox {}, order violations {}, stale tokens refused {} / accepted {}, unpublished {}, parked {}",
            self.outbox_rows,
            self.deliveries,
            self.accepted,
            self.duplicates,
            self.lost,
            self.extra,
            self.order_violations,
            self.stale_refused,
            self.stale_accepted,
            self.unpublished,
            self.parked
        )
    }
}

/// The outbox table `schema`.outbox: id → aggregate, and its unpublished / parked counts.
async fn table(
    db: &tokio_postgres::Config,
    schema: &str,
) -> anyhow::Result<(HashMap<i64, String>, i64, i64)> {
    let client = crate::faults::connect(db).await?;
    let rows = client
        .query(&format!("SELECT id, aggregate_type || '/' || aggregate_id FROM {schema}.outbox"), &[])
        .await?;
    let counts = client
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE published_at IS NULL),
                        count(*) FILTER (WHERE parked_at IS NOT NULL) FROM {schema}.outbox"
            ),
            &[],
        )
        .await?;
    Ok((rows.iter().map(|r| (r.get(0), r.get(1))).collect(), counts.get(0), counts.get(1)))
}

/// Deliveries `(id, aggregate, fencing token)` in the order the destination took them, checked
/// against `rows`.
fn judge(
    destination: &'static str,
    rows: &HashMap<i64, String>,
    taken: &[(i64, String, i64)],
    verdict: &mut Verdict,
) {
    verdict.destination = destination;
    verdict.outbox_rows = rows.len();
    verdict.accepted = taken.len();
    let mut first: BTreeSet<i64> = BTreeSet::new();
    let mut highest_token: HashMap<i64, i64> = HashMap::new();
    let mut latest_of_aggregate: HashMap<&str, i64> = HashMap::new();
    for (id, aggregate, token) in taken {
        let highest = highest_token.entry(*id).or_insert(*token);
        if *token < *highest {
            verdict.stale_accepted += 1;
        }
        *highest = (*highest).max(*token);
        if !first.insert(*id) {
            verdict.duplicates += 1;
            continue;
        }
        if !rows.contains_key(id) {
            verdict.extra += 1;
            continue;
        }
        let latest = latest_of_aggregate.entry(aggregate.as_str()).or_insert(*id);
        if *id < *latest {
            verdict.order_violations += 1;
            if verdict.examples.len() < 5 {
                verdict.examples.push(format!("{aggregate}: row {id} first taken after row {latest}"));
            }
        }
        *latest = (*latest).max(*id);
    }
    let missing: Vec<i64> = rows.keys().filter(|id| !first.contains(id)).copied().collect();
    verdict.lost = missing.len();
    for id in missing.iter().take(5) {
        verdict.examples.push(format!("row {id} ({}) never taken", rows[id]));
    }
}

/// The HTTP destination: what the receiver answered 2xx, against `public.outbox`.
pub async fn verify_http(db: &tokio_postgres::Config, receiver: &Receiver) -> anyhow::Result<Verdict> {
    let (rows, unpublished, parked) = table(db, "public").await?;
    let deliveries = receiver.deliveries();
    let taken: Vec<(i64, String, i64)> = deliveries
        .iter()
        .filter(|d| (200..300).contains(&d.status))
        .map(|d| {
            (d.id.parse().unwrap_or(-1), format!("{}/{}", d.aggregate_type, d.aggregate_id), d.fencing_token)
        })
        .collect();
    let mut verdict = Verdict { deliveries: deliveries.len(), unpublished, parked, ..Verdict::default() };
    judge("http", &rows, &taken, &mut verdict);
    verdict.stale_refused = receiver.stale_refused();
    Ok(verdict)
}

/// The JetStream destination: every message the stream stores, in sequence order, against the
/// outbox copy.
pub async fn verify_nats(db: &tokio_postgres::Config, url: &str) -> anyhow::Result<Verdict> {
    let (rows, unpublished, parked) = table(db, COPY_SCHEMA).await?;
    let js = nats::jetstream(url).await;
    let stored = nats::stored(&js, STREAM).await;
    let aggregates: HashMap<String, String> =
        rows.iter().map(|(id, aggregate)| (id.to_string(), aggregate.clone())).collect();
    let taken: Vec<(i64, String, i64)> = stored
        .iter()
        .map(|m| {
            let aggregate = aggregates.get(&m.msg_id).cloned().unwrap_or_else(|| m.aggregate_id.clone());
            (m.msg_id.parse().unwrap_or(-1), aggregate, m.fencing_token)
        })
        .collect();
    let mut verdict = Verdict { deliveries: stored.len(), unpublished, parked, ..Verdict::default() };
    // A stream refuses no token: the duplicate window (Nats-Msg-Id) is what keeps a late publish
    // of a stored row out, so a stale token could only show in a duplicate stored.
    judge("nats", &rows, &taken, &mut verdict);
    Ok(verdict)
}
