//! `inbox-worker fetch`: applies thin events with the object they name as it is now.
//!
//! A thin event (API v2, `"object": "v2.core.event"`) says *that* an object changed, not what it
//! looks like: its handler needs the object, fetched from Stripe. A fetch inside the worker's
//! transaction would hold the batch's row locks for as long as Stripe takes, be made again on every
//! retry and could not be rolled back. So the types whose handler needs the object are registered
//! with `Registry::register_fetched`, and:
//!
//! 1. `fetch` claims their rows exactly as `run` claims the others (the same statement: SKIP
//!    LOCKED, attempt and lease committed first, the fence on every later write); `run` leaves them;
//! 2. before the batch's transaction, with no transaction open, it reads which object each event
//!    names (`related_object.url`, the event's account) and fetches each object **once** for every
//!    event about it that is waiting — one GET per object per batch, and none at all when the
//!    object's snapshot was taken after the event arrived (another batch fetched it meanwhile) —
//!    with `Stripe-Context: <account>`, through [`crate::stripe`]'s retries;
//! 3. it keeps each answer in `stripe_object_snapshots` (404 kept as "gone"), then applies the batch
//!    like `run`: the handler reads the snapshot with [`snapshot`] in its transaction, and the
//!    event is marked processed with its effect.
//!
//! A fetch that fails after the client's retries (Stripe down, a key without the permission) fails
//! the attempt of the events about that object: their `last_error` says why, they are retried with
//! backoff and park at the attempt limit, like any failure. The design keeps the event the unit of
//! work — one row, one attempt count, one processed mark — so `stats`, `needs-review`, `requeue`
//! and `replay` (which re-applies the kept snapshot) work on thin events unchanged. The other
//! design, marking the event done once a fetch is queued and applying the object from a queue of
//! its own, needs a second queue with its own retries, parking and operator commands; see
//! `docs/handlers.md`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::Args;
use deadpool_postgres::{Pool, Transaction};
use inbox_domain::db::describe_db_error;
use inbox_domain::handler::HandlerError;
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::fetch::{self as store, NewSnapshot, Target};
use inbox_domain::inbox::store::queue::Claimed;
use serde_json::value::RawValue;

use crate::cli::{RunArgs, StripeArgs};
use crate::stripe::{self, RequestOptions};

/// Flags of `fetch`: those of `run`, how to reach Stripe, and how many requests at once.
#[derive(Debug, Args)]
pub struct FetchArgs {
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub stripe: StripeArgs,
    /// Requests to Stripe in flight at once in this process. Stripe allows about 100 reads a
    /// second in live mode and 25 in test mode per account; a few concurrent requests stay well
    /// within that, and the client backs off on 429.
    #[arg(long, env = "INBOX_FETCH_CONCURRENCY", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_fetches: u32,
}

/// Fetches the objects of claimed batches before they are applied.
pub struct Fetcher {
    client: stripe::Client,
    /// Requests in flight, at most `--max-fetches`.
    slots: Arc<tokio::sync::Semaphore>,
    /// Bound on the reads and writes of snapshots.
    db_timeout: Duration,
    /// Bound on one object's fetch, retries included: well inside the rows' lease, so a batch
    /// whose fetch drags on fails its attempt instead of being claimed again under it.
    fetch_deadline: Duration,
}

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher").field("client", &self.client).finish()
    }
}

/// What [`Fetcher::prepare`] made of a batch.
pub struct Prepared {
    /// Rows whose object is kept: apply them.
    pub ready: Vec<Claimed>,
    /// Rows whose object could not be had, with why: their attempt fails.
    pub failed: Vec<(Claimed, String)>,
}

impl Fetcher {
    /// A fetcher of at most `max_fetches` requests at once, each object's fetch (retries
    /// included) bounded by half of `lease`.
    pub fn new(client: stripe::Client, max_fetches: u32, db_timeout: Duration, lease: Duration) -> Fetcher {
        Fetcher {
            client,
            slots: Arc::new(tokio::sync::Semaphore::new(max_fetches as usize)),
            db_timeout,
            fetch_deadline: lease / 2,
        }
    }

    /// Makes sure each claimed row's object has a snapshot taken after the row arrived, fetching
    /// what is missing (once per object). An error reading the rows is returned (the batch is then
    /// given back, attempt not counted: the database, not the events, failed).
    pub async fn prepare(&self, pool: &Pool, claimed: Vec<Claimed>) -> Result<Prepared, String> {
        let keys: Vec<_> = claimed.iter().map(|c| &c.key).collect();
        let provider = claimed.first().map(|c| c.key.provider.clone()).unwrap_or_default();
        let read = async {
            let client = pool.get().await.map_err(|e| inbox_domain::db::describe_pool_error(&e))?;
            store::targets(&**client, &provider, &keys).await.map_err(|e| describe_db_error(&e))
        };
        let targets = tokio::time::timeout(self.db_timeout, read).await.unwrap_or_else(|_| {
            Err(format!("reading the objects to fetch took longer than {:?}", self.db_timeout))
        })?;
        let by_key: HashMap<_, _> = targets.iter().map(|t| (&t.key, t)).collect();

        // The objects to fetch: each once, for the latest arrival among its waiting events.
        let mut objects: HashMap<(&str, &str), &Target> = HashMap::new();
        let mut refused: HashMap<String, String> = HashMap::new();
        for target in &targets {
            let (Some(url), Some(_), Some(_)) = (&target.url, &target.object_id, &target.object_type) else {
                refused.insert(
                    target.key.event_id.clone(),
                    "payload: no related_object {id, type, url}: only thin events can be registered as fetched"
                        .to_owned(),
                );
                continue;
            };
            if !url.starts_with('/') || url.starts_with("//") {
                refused.insert(
                    target.key.event_id.clone(),
                    format!("payload: related_object.url {url:?} is not an API path such as /v1/billing/meters/mtr_123"),
                );
                continue;
            }
            let fresh = target.snapshot_as_of.is_some_and(|as_of| as_of >= target.received_at);
            if fresh {
                continue;
            }
            objects
                .entry((target.account.as_str(), url.as_str()))
                .and_modify(|t| {
                    if target.received_at > t.received_at {
                        *t = target;
                    }
                })
                .or_insert(target);
        }

        let fetches = objects.into_iter().map(|((account, url), target)| async move {
            let outcome =
                tokio::time::timeout(self.fetch_deadline, self.fetch_one(pool, account, url, target))
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!(
                            "fetching {url} took longer than {:?} (half the lease), retries included",
                            self.fetch_deadline
                        ))
                    });
            ((account.to_owned(), url.to_owned()), outcome)
        });
        let outcomes: HashMap<(String, String), Result<(), String>> =
            futures_util::future::join_all(fetches).await.into_iter().collect();

        let mut prepared = Prepared { ready: Vec::new(), failed: Vec::new() };
        for row in claimed {
            if let Some(why) = refused.remove(&row.key.event_id) {
                prepared.failed.push((row, why));
                continue;
            }
            let failure = by_key.get(&row.key).and_then(|t| {
                let url = t.url.as_deref()?;
                outcomes.get(&(t.account.clone(), url.to_owned()))?.as_ref().err().cloned()
            });
            match failure {
                Some(why) => prepared.failed.push((row, why)),
                // Fetched, fresh already, or no longer in the inbox (the executor finds it gone).
                None => prepared.ready.push(row),
            }
        }
        Ok(prepared)
    }

    /// Fetches one object and keeps it; the error is the events' `last_error`.
    async fn fetch_one(&self, pool: &Pool, account: &str, url: &str, target: &Target) -> Result<(), String> {
        let _slot = self.slots.acquire().await.map_err(|_| "shutting down".to_owned())?;
        let options = RequestOptions {
            stripe_context: (!account.is_empty()).then(|| account.to_owned()),
            ..RequestOptions::default()
        };
        // The snapshot shows the object at the database's clock of the read, or later.
        let as_of = target.now;
        let started = std::time::Instant::now();
        let (object, request_id) = match self.client.get(url, &[], &options).await {
            Ok(answer) => {
                let object: Box<RawValue> = serde_json::from_slice(&answer.body).map_err(|e| {
                    format!(
                        "fetching {url}: Stripe's answer is not JSON: {e} (request {})",
                        answer.request_id
                    )
                })?;
                (Some(object), answer.request_id)
            }
            Err(stripe::Error::NotFound { detail, .. }) => (None, detail.request_id),
            Err(e) => return Err(format!("fetching the related object: {e}")),
        };
        tracing::info!(
            url,
            account,
            found = object.is_some(),
            request_id,
            elapsed_ms = inbox_domain::telemetry::millis(started.elapsed()),
            "fetched the object of thin events"
        );
        let snapshot = NewSnapshot {
            account,
            url,
            object_id: target.object_id.as_deref().unwrap_or_default(),
            object_type: target.object_type.as_deref().unwrap_or_default(),
            object: object.as_ref().map(|o| o.get().as_bytes()),
            as_of,
            request_id: &request_id,
        };
        let keep = async {
            let client = pool.get().await.map_err(|e| inbox_domain::db::describe_pool_error(&e))?;
            store::keep_snapshot(&**client, &snapshot).await.map_err(|e| describe_db_error(&e))
        };
        tokio::time::timeout(self.db_timeout, keep)
            .await
            .unwrap_or_else(|_| Err(format!("keeping the snapshot took longer than {:?}", self.db_timeout)))
            .map_err(|e| format!("keeping the snapshot of {url}: {e}"))
    }
}

/// The object a thin event names, as `fetch` found it before applying the event.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The object's JSON as Stripe sent it; `None` when Stripe answered 404 (deleted, or not
    /// visible to the key).
    pub object: Option<Box<RawValue>>,
    /// The object is shown as it was at this time or later (it was fetched after this).
    pub as_of: SystemTime,
    /// Stripe's request id of the fetch.
    pub request_id: Option<String>,
}

impl Snapshot {
    /// The object as `T` (a struct of the fields the handler needs, or `serde_json::Value`);
    /// `None` when Stripe answered 404.
    pub fn object_as<T: serde::de::DeserializeOwned>(&self) -> Result<Option<T>, HandlerError> {
        self.object.as_ref().map(|o| serde_json::from_str(o.get())).transpose().map_err(|e| {
            HandlerError::Payload(format!("the fetched object is not what the handler reads: {e}"))
        })
    }
}

/// The snapshot of the object `event` names, read in the handler's transaction `tx`: what a handler
/// registered with `Registry::register_fetched` works from. An error when the event names no
/// object (a payload error: it parks) or when no snapshot is kept (the event was applied by a
/// worker that does not fetch, such as `run` or `replay` before any fetch).
pub async fn snapshot(tx: &Transaction<'_>, event: &InboxEvent) -> Result<Snapshot, HandlerError> {
    let related = event.related_object().ok_or_else(|| {
        HandlerError::Payload(format!(
            "related_object {{id, type, url}} is missing: a thin event of type {} must name its object",
            event.event_type
        ))
    })?;
    let account = event.account().unwrap_or("");
    let kept = store::snapshot(&**tx, account, related.url).await?;
    let kept = kept.ok_or_else(|| {
        HandlerError::Other(format!(
            "no snapshot of {} is kept: events of {} are applied by `inbox-worker fetch`, which fetches it first",
            related.url, event.event_type
        ))
    })?;
    let object =
        kept.object.map(RawValue::from_string).transpose().map_err(|e| {
            HandlerError::Other(format!("the kept snapshot of {} is not JSON: {e}", related.url))
        })?;
    Ok(Snapshot { object, as_of: kept.as_of, request_id: kept.request_id })
}
