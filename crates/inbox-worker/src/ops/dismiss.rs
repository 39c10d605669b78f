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
use super::{db_error, lock_one_event, ActorArgs, EventArgs, LIMITS};

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

/// `dismiss`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    let reason = args.reason.trim();
    anyhow::ensure!(
        !reason.is_empty(),
        "--reason must say why the row must not run: it is kept with the row"
    );
    let event_id = args.event.event_id.as_str();
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let row = lock_one_event(&*tx, event_id, args.event.endpoint.as_deref()).await?;
    if let Some(at) = &row.processed_at {
        anyhow::bail!(
            "event {event_id} (endpoint {}) was already processed at {at}: nothing to dismiss",
            row.endpoint
        );
    }
    if !row.parked && row.held.is_none() {
        anyhow::bail!(
            "event {event_id} (endpoint {}) is in the queue, not parked or held: the workers will take \
             it; dismiss closes only rows waiting for a person (see `needs-review`)",
            row.endpoint
        );
    }
    let who = args.actor.name();
    let last_error = format!("dismissed by {who}: {reason}");
    let closed = admin::dismiss(&*tx, &row.endpoint, event_id, &last_error)
        .await
        .map_err(db_error("closing the row"))?;
    anyhow::ensure!(
        closed,
        "event {event_id} (endpoint {}) changed meanwhile: nothing dismissed",
        row.endpoint
    );
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "endpoint": row.endpoint,
        "event_id": event_id,
        "event_type": row.event_type,
        "held": row.held,
        "reason": reason,
    });
    let audit_id = admin::insert_audit(&*tx, who, "dismiss", &target, 1)
        .await
        .map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the dismissal"))?;
    if args.output.json {
        return emit_json(&Report {
            action: "dismiss",
            endpoint: &row.endpoint,
            event_id,
            event_type: &row.event_type,
            held: row.held.as_deref(),
            audit_id,
        });
    }
    emit(&format!(
        "dismissed event {event_id} (endpoint {}, {}): closed without processing, kept; audit record {audit_id}\n",
        row.endpoint, row.event_type
    ))
}
