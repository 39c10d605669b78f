//! Thin events: Stripe's v2 events (`"object": "v2.core.event"`) carry no snapshot of the object
//! they are about, only its `related_object {id, type, url}` and, for a connected account's
//! event, the account in `context`. What changed is whatever the object looks like *now*, so the
//! team fetches it from Stripe's API — but never here.
//!
//! # Why the handler only queues
//! The handler runs inside the worker's transaction, which holds the batch's row locks and marks
//! the events processed when it commits. A call to Stripe there would hold those locks for as long
//! as Stripe takes, be made again on every retry, and could not be taken back by a rollback
//! (`docs/handlers.md`, "What a handler must never do"). So [`QueueFetch`] records in
//! `stripe_fetches` (`migrations/V2__stripe_fetches.sql`), in the transaction, that the object
//! must be fetched, and a separate process — not part of this example; the README says how it
//! works — fetches `GET https://api.stripe.com{url}` with `Stripe-Context: {account}` after the
//! commit and applies the current object in a transaction of its own.
//!
//! # Why one row per object
//! The fetch reads the object's current state, so one fetch answers every event about the object
//! that came before it, in any order: [`QUEUE_FETCH_SQL`] upserts one row per object id and, on
//! every event, makes the fetch due again (`fetched_at` back to NULL) and records the event.
//! Duplicates, redeliveries, replays and out-of-order events cost at most one more fetch, never a
//! wrong state.

use inbox_worker::prelude::*;

/// The thin event types the handler is registered for.
pub const EVENT_TYPES: [&str; 2] = ["v1.billing.meter.error_report_triggered", "v2.core.account.updated"];

/// Queues a fetch of object `$1` (type `$2`, API path `$3`, connected account `$4` or NULL) for
/// event `$5`, in one statement: the first event about the object inserts its row; every later
/// one makes the fetch due again — `fetched_at` back to NULL, `queued_at` renewed — and records
/// itself as the object's last event, with the path and account it gives.
pub const QUEUE_FETCH_SQL: &str = "\
INSERT INTO stripe_fetches (object_id, object_type, url, account, last_event_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (object_id) DO UPDATE
   SET object_type = EXCLUDED.object_type,
       url = EXCLUDED.url,
       account = EXCLUDED.account,
       last_event_id = EXCLUDED.last_event_id,
       queued_at = now(),
       fetched_at = NULL";

/// The handler of the thin event types: it holds nothing, so one value serves every
/// registration.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueFetch;

impl Handler for QueueFetch {
    fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
        Box::pin(async move {
            let related = object_to_fetch(event)?;
            let stmt = tx.prepare_cached(QUEUE_FETCH_SQL).await?;
            tx.execute(
                &stmt,
                &[&related.id, &related.object_type, &related.url, &event.account(), &event.event_id],
            )
            .await?;
            Ok(())
        })
    }
}

/// The object a thin event asks to fetch: its `related_object`, whose `url` must be a path on
/// `api.stripe.com` (the fetcher prefixes the host). A payload without one is
/// [`HandlerError::Payload`]: retrying will not add it, so the row parks for a person.
pub fn object_to_fetch(event: &InboxEvent) -> Result<RelatedObject<'_>, HandlerError> {
    let related = event.related_object().ok_or_else(|| {
        HandlerError::Payload(format!(
            "related_object {{id, type, url}} is missing or incomplete: a thin event (\"object\": \
             \"v2.core.event\") of type {} must name the object to fetch",
            event.event_type
        ))
    })?;
    if related.id.is_empty() || !related.url.starts_with('/') || related.url.starts_with("//") {
        return Err(HandlerError::Payload(format!(
            "related_object {{id: {:?}, url: {:?}}} does not name an object to fetch: expected an id \
             and an API path such as /v1/billing/meters/mtr_123",
            related.id, related.url
        )));
    }
    Ok(related)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_test_support::stripe_fixtures::{thin_event, Related};

    fn connect_meter_error(related: Related<'_>) -> serde_json::Value {
        thin_event(
            "evt_test_thin",
            "v1.billing.meter.error_report_triggered",
            related,
            Some("acct_1Connected"),
            "2026-10-01T12:00:00.000Z",
        )
    }

    fn inbox_event(payload: &serde_json::Value) -> InboxEvent {
        InboxEvent::from_payload("billing", &payload.to_string()).unwrap()
    }

    #[test]
    fn the_object_to_fetch_is_the_related_object_of_a_thin_event() {
        let meter = Related { id: "mtr_1", object_type: "billing.meter", url: "/v1/billing/meters/mtr_1" };
        let event = inbox_event(&connect_meter_error(meter));
        assert_eq!(
            object_to_fetch(&event).unwrap(),
            RelatedObject { id: "mtr_1", object_type: "billing.meter", url: "/v1/billing/meters/mtr_1" }
        );
        assert_eq!(event.account(), Some("acct_1Connected"));
    }

    #[test]
    fn a_thin_event_without_a_fetchable_related_object_is_a_payload_error_saying_what_is_missing() {
        let mut without =
            connect_meter_error(Related { id: "mtr_1", object_type: "billing.meter", url: "/x" });
        without.as_object_mut().unwrap().remove("related_object");
        let error = object_to_fetch(&inbox_event(&without)).unwrap_err();
        assert!(
            matches!(&error, HandlerError::Payload(m)
                if m.contains("related_object {id, type, url} is missing")
                    && m.contains("v1.billing.meter.error_report_triggered")),
            "{error}"
        );

        for (id, url) in [
            ("mtr_1", "https://evil.example/v1/billing/meters/mtr_1"),
            ("mtr_1", "//evil.example"),
            ("", "/v1/x"),
        ] {
            let event = inbox_event(&connect_meter_error(Related { id, object_type: "billing.meter", url }));
            let error = object_to_fetch(&event).unwrap_err();
            assert!(
                matches!(&error, HandlerError::Payload(m) if m.contains("does not name an object to fetch")),
                "{url}: {error}"
            );
        }
    }
}
