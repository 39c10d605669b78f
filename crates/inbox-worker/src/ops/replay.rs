//! `replay`: runs an already processed event again with this binary's handler — the same
//! registry `run` uses — in one transaction with the row locked, its `processed_at` renewed and
//! the audit record. Handlers are idempotent (forward-only transitions, unique business keys), so
//! a replay repairs business rows that went missing and never books twice. A handler error rolls
//! everything back; an event type this binary has no handler for is refused (nothing to apply,
//! and most likely the wrong binary), and nothing changes.

use clap::Args as ClapArgs;
use inbox_domain::db::Pooler;
use inbox_domain::handler::Registry;
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::{admin, queue, set_limits};
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, OutputArgs};
use super::{db_error, lock_one_event, ActorArgs, EventArgs, LIMITS};

/// Flags of `replay`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub event: EventArgs,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `replay`.
pub async fn run(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    pooler: Pooler,
    args: &Args,
) -> anyhow::Result<()> {
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let event_id = args.event.event_id.as_str();
    let row = lock_one_event(&*tx, event_id, args.event.endpoint.as_deref()).await?;
    if row.processed_at.is_none() {
        anyhow::bail!(
            "event {event_id} (endpoint {}) is not processed yet; requeue it instead \
             (`requeue --event-id {event_id}`) or let the workers take it",
            row.endpoint
        );
    }
    let Some(handler) = registry.get(&row.event_type) else {
        anyhow::bail!(
            "event {event_id} (endpoint {}) is a {} event, which this binary has no handler for \
             (it handles: {}): nothing to replay, nothing changed",
            row.endpoint,
            row.event_type,
            registry.event_types().join(", ")
        );
    };
    let Some(payload) = row.payload else {
        anyhow::bail!(
            "event {event_id} (endpoint {}) has no payload to replay: its body was kept as raw bytes \
             (unstorable as jsonb); nothing changed",
            row.endpoint
        );
    };
    let event = InboxEvent::new(
        PROVIDER_STRIPE.to_owned(),
        row.endpoint.clone(),
        event_id.to_owned(),
        row.event_type.clone(),
        payload,
    );
    let applied = handler.handle(&tx, &event).await;
    if pooler == Pooler::Transaction {
        // Close the statements the handler prepared before the transaction ends, on the server
        // connection that has them (as the worker's executor does).
        tx.statement_cache.clear();
    }
    if let Err(e) = applied {
        let _ = tx.rollback().await;
        anyhow::bail!(
            "replay of event {event_id} (endpoint {}, {}) failed, nothing changed: {e}",
            event.endpoint,
            event.event_type
        );
    }
    queue::mark_processed(&tx, &[row.ctid.as_str()])
        .await
        .map_err(db_error("marking the event processed"))?;
    // A row a person dismissed is applied after all: it is no longer "closed unapplied".
    admin::undismiss(&*tx, &event.endpoint, event_id).await.map_err(db_error("clearing the dismissal"))?;
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "endpoint": event.endpoint,
        "event_id": event_id,
        "event_type": event.event_type,
    });
    let audit_id = admin::insert_audit(&*tx, &args.actor.actor, "replay", &target, 1)
        .await
        .map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the replay"))?;

    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            action: &'static str,
            endpoint: &'a str,
            event_id: &'a str,
            event_type: &'a str,
            audit_id: i64,
        }
        return emit_json(&Report {
            action: "replay",
            endpoint: &event.endpoint,
            event_id,
            event_type: &event.event_type,
            audit_id,
        });
    }
    emit(&format!(
        "replayed event {event_id} (endpoint {}, {}): handler applied; audit record {audit_id}\n",
        event.endpoint, event.event_type
    ))
}
