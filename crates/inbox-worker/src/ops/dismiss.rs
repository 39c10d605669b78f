//! `dismiss`: closes a parked or held row without processing it — a test event that reached the
//! live endpoint, a body no handler can read — keeping the row, with the reason in `last_error` and
//! an audit record of who and why, in one transaction. The row leaves `needs-review` (and the
//! alert on it); no worker claims it; `purge` removes it with the other closed rows. `replay`
//! applies it after all, should the person change their mind.

use clap::Args as ClapArgs;
use inbox_domain::inbox::store::{admin, set_limits};
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, OutputArgs};
use super::{db_error, lock_one_event, refuse, Actor, ActorArgs, EventArgs, LIMITS};

/// Flags of `dismiss`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub event: EventArgs,
    /// Why the row must not run: kept in its last_error and in the audit record.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `dismiss --json` prints.
#[derive(Serialize)]
struct Report<'a> {
    action: &'static str,
    endpoint: &'a str,
    event_id: &'a str,
    event_type: &'a str,
    held: Option<&'a str>,
    audit_id: i64,
}

/// What [`dismiss_one`] closed.
#[derive(Debug, Clone)]
pub struct Dismissed {
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    /// Why the ingest had held it, when it had.
    pub held: Option<String>,
    pub audit_id: i64,
}

/// `dismiss`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    let done = dismiss_one(
        client,
        &args.event.event_id,
        args.event.endpoint.as_deref(),
        &args.reason,
        args.actor.actor(),
    )
    .await?;
    if args.output.json {
        return emit_json(&Report {
            action: "dismiss",
            endpoint: &done.endpoint,
            event_id: &done.event_id,
            event_type: &done.event_type,
            held: done.held.as_deref(),
            audit_id: done.audit_id,
        });
    }
    emit(&format!(
        "dismissed event {} (endpoint {}, {}): closed without processing, kept; audit record {}\n",
        done.event_id, done.endpoint, done.event_type, done.audit_id
    ))
}

/// Closes the parked or held row of `event_id` (and `endpoint`) without processing it, `reason`
/// (trimmed, required) kept in its `last_error` with the actor's name and in the audit record, in
/// one transaction. Refused, changing nothing: no reason, a processed row, a row in the queue.
pub async fn dismiss_one(
    client: &mut deadpool_postgres::Object,
    event_id: &str,
    endpoint: Option<&str>,
    reason: &str,
    actor: Actor<'_>,
) -> anyhow::Result<Dismissed> {
    let reason = reason.trim();
    if reason.is_empty() {
        refuse!("--reason must say why the row must not run: it is kept with the row");
    }
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let row = lock_one_event(&*tx, event_id, endpoint).await?;
    if let Some(at) = &row.processed_at {
        refuse!(
            "event {event_id} (endpoint {}) was already processed at {at}: nothing to dismiss",
            row.endpoint
        );
    }
    if !row.parked && row.held.is_none() {
        refuse!(
            "event {event_id} (endpoint {}) is in the queue, not parked or held: the workers will take \
             it; dismiss closes only rows waiting for a person (see `needs-review`)",
            row.endpoint
        );
    }
    let who = actor.name;
    let last_error = format!("dismissed by {who}: {reason}");
    let closed = admin::dismiss(&*tx, &row.endpoint, event_id, &last_error)
        .await
        .map_err(db_error("closing the row"))?;
    if !closed {
        refuse!("event {event_id} (endpoint {}) changed meanwhile: nothing dismissed", row.endpoint);
    }
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "endpoint": row.endpoint,
        "event_id": event_id,
        "event_type": row.event_type,
        "held": row.held,
        "reason": reason,
    });
    let audit_id =
        actor.audit(&*tx, "dismiss", &target, 1).await.map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the dismissal"))?;
    Ok(Dismissed {
        endpoint: row.endpoint,
        event_id: event_id.to_owned(),
        event_type: row.event_type,
        held: row.held,
        audit_id,
    })
}
