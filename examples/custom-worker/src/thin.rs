//! Thin events: Stripe's v2 events (`"object": "v2.core.event"`) carry no snapshot of the object
//! they are about, only its `related_object {id, type, url}` and, for a connected account's
//! event, the account in `context`. What changed is whatever the object looks like *now*, so the
//! object is fetched from Stripe's API — by the library's `fetch`, before the handler runs, never
//! by the handler.
//!
//! # How `fetch` works, and why the call stays out of the transaction
//! The types are registered with `Registry::register_fetched` (`main.rs`). `custom-worker run`
//! leaves their events; `custom-worker fetch` claims them the way `run` claims the others (the
//! same claim, lease and fence, attempts and parking). Before a claimed batch's transaction it
//! reads which object each event names and GETs each object **once** for every event about it
//! in the batch — `GET https://api.stripe.com{url}`, with `Stripe-Context: {account}` for a connected
//! account's event, retried by the client on 429 and 5xx — and none at all when the object's
//! kept snapshot was taken after the event arrived. It keeps the answer (a 404 as "gone") in the
//! inbox's `stripe_object_snapshots`, and then applies the batch like `run`: [`RecordObject`]
//! reads the snapshot with [`snapshot`] in the worker's transaction and writes it to this
//! binary's `stripe_objects` (`migrations/V3__stripe_objects.sql`), and the event is marked
//! processed in the same commit.
//!
//! The GET is made before the transaction, not in the handler: the handler runs inside the
//! transaction that holds the batch's row locks, so a call to Stripe there would hold them for as
//! long as Stripe takes, be made again by every retry of the batch, and could not be taken back by
//! a rollback (`docs/handlers.md`, "What a handler must never do"). A fetch that fails after the
//! client's retries (Stripe down, a key without the permission) fails the attempt of the events
//! about that object, with the reason as their `last_error`: retried with backoff, parked at the
//! limit, listed by `needs-review`, like any failure.
//!
//! # Why one row per object, and why the later `as_of` wins
//! The snapshot is the object's current state, so one answers every event about the object that
//! arrived before it was taken, in any order: [`RECORD_OBJECT_SQL`] upserts one row per object id
//! and replaces it only with a snapshot taken later (`as_of`). Duplicates, redeliveries, replays
//! and out-of-order events leave the newest state seen; a replay re-applies the kept snapshot
//! (no fetch), so it rebuilds a lost row and changes nothing else.

use inbox_worker::prelude::*;
use serde::Deserialize;

/// The thin event types the handler is registered for (with `Registry::register_fetched`).
pub const EVENT_TYPES: [&str; 2] = ["v1.billing.meter.error_report_triggered", "v2.core.account.updated"];

/// Records the current state of object `$1` (type `$2`, API path `$3`, connected account `$4` or
/// NULL) as event `$5`'s snapshot gives it: `$6` the object's JSON (NULL when Stripe answered 404,
/// then `$7` gone is true), `$8` the snapshot's `as_of`, `$9` Stripe's request id. One statement:
/// the first event about the object inserts its row; a later one replaces it only with a snapshot
/// taken later (a row from V2 has none yet, and takes the first), so the row never goes back to
/// an older state and an event served by the snapshot already shown changes nothing.
pub const RECORD_OBJECT_SQL: &str = "\
INSERT INTO stripe_objects AS o (object_id, object_type, url, account, event_id, object, gone, as_of, request_id)
VALUES ($1, $2, $3, $4, $5, $6::text::jsonb, $7, $8, $9)
ON CONFLICT (object_id) DO UPDATE
   SET object_type = EXCLUDED.object_type,
       url = EXCLUDED.url,
       account = EXCLUDED.account,
       event_id = EXCLUDED.event_id,
       object = EXCLUDED.object,
       gone = EXCLUDED.gone,
       as_of = EXCLUDED.as_of,
       request_id = EXCLUDED.request_id,
       updated_at = now()
 WHERE o.as_of IS NULL OR o.as_of < EXCLUDED.as_of";

/// The handler of the thin event types: it holds nothing, so one value serves every
/// registration.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordObject;

impl Handler for RecordObject {
    fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
        Box::pin(async move {
            let related = object_to_fetch(event)?;
            // Kept by `fetch` before this transaction began; an error when there is none (the
            // event was applied by something that does not fetch).
            let snapshot = snapshot(tx, event).await?;
            if let Some(fetched) = snapshot.object_as::<Named>()? {
                if fetched.id != related.id {
                    return Err(HandlerError::Payload(format!(
                        "GET {} answered object {:?}, not the related_object {:?} the event names",
                        related.url, fetched.id, related.id
                    )));
                }
            }
            let object = snapshot.object.as_ref().map(|o| o.get());
            let gone = object.is_none();
            let stmt = tx.prepare_cached(RECORD_OBJECT_SQL).await?;
            tx.execute(
                &stmt,
                &[
                    &related.id,
                    &related.object_type,
                    &related.url,
                    &event.account(),
                    &event.event_id,
                    &object,
                    &gone,
                    &snapshot.as_of,
                    &snapshot.request_id,
                ],
            )
            .await?;
            Ok(())
        })
    }
}

/// What the handler checks of the fetched object: that it is the one the event names.
#[derive(Deserialize)]
struct Named {
    id: String,
}

/// The object a thin event names: its `related_object`, whose `url` must be a path on
/// `api.stripe.com` (`fetch` prefixes the API's base). A payload without one is
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
