//! Stripe's health events that leave work for a person: a handler set registered with the invoice
//! handlers by [`Registry::with_invoice_handlers`] (together, the stock handlers).
//!
//! `v2.core.health.event_generation_failure.resolved`: Stripe failed to generate an event — about a
//! PaymentIntent, an invoice, a subscription — and has since fixed what failed. The event itself is
//! lost for good: Stripe delivers it to no endpoint, shows it nowhere in the Dashboard and lists it
//! in no page of List Events, so neither Stripe's retries nor `inbox-worker reconcile` will ever
//! bring it. What this integration should have learned from it can only be had by fetching the
//! object's current state, and deciding what it means, which is a person's work: the handler
//! records a `reconciliation_items` row with reason `event_generation_failure` (listed by
//! `inbox-worker reconciliation`, counted by the gauge `inbox_reconciliation_items_open`, announced
//! by the alert StripeInboxReconciliationItemsOpen) and fetches nothing itself: a handler never
//! calls the network.
//!
//! What the item names comes from what the event carries. The announcement is a thin event (`"object":
//! "v2.core.event"`): the webhook body has the envelope — `id`, `type`, `created`, `livemode`,
//! `context` (the connected account, if any) — and a `related_object` when Stripe gives one. The
//! alert's details, `data` (`alert_id`, `summary`, `resolved_at`, `severity`, and `impact`: the type
//! of the lost event, its `context`, its `related_object {id, type, url}`), are what Stripe's API
//! reference calls a fetched attribute: present when the event was retrieved with
//! `GET /v2/core/events/{id}`. So the object to re-fetch is the top-level `related_object`, else
//! `data.impact.related_object`, else `data.impact.related_object_id` (the public preview's shape: an
//! id only). An announcement naming none of them still makes an item, naming no object: its
//! `detail.event_url` says where the alert's details are (`/v2/core/events/{id}`, with the account
//! as `Stripe-Context`; the Workbench's Health tab shows them too). `detail` keeps the endpoint, the
//! account (`context`, else the impact's), that URL, and `data` as it came.
//!
//! Idempotent: one item per event id — the partial unique index of migration V13, whatever the
//! redeliveries, the endpoints the event reached and the replays.

use deadpool_postgres::Transaction;
use serde_json::Value;

use crate::handler::{HandlerFuture, Registry};
use crate::inbox::event::InboxEvent;

/// The type of Stripe's announcement that it failed to generate an event.
pub const EVENT_GENERATION_FAILURE_RESOLVED: &str = "v2.core.health.event_generation_failure.resolved";

/// The `reason` of the items [`RECORD_FAILURE_SQL`] writes (the literal in the statement and the
/// predicate of its unique index).
pub const REASON_EVENT_GENERATION_FAILURE: &str = "event_generation_failure";

/// Registers the handler of [`EVENT_GENERATION_FAILURE_RESOLVED`].
pub fn register(registry: &mut Registry) {
    registry.register(EVENT_GENERATION_FAILURE_RESOLVED, event_generation_failure_resolved);
}

/// One item for a failed event generation (`$1` the announcement's event id, `$2`..`$4` the object's
/// id, type and URL, each NULL when the event does not say, `$5` the detail), unless the event has
/// one already. The conflict target is the partial unique index
/// `reconciliation_items_event_generation_failure` (V13), named by its column and its predicate:
/// two transactions processing the same event at once (two endpoints, a replay beside a
/// redelivery) insert one row, where a `WHERE NOT EXISTS` would let both through. `invoice_id`
/// stays NULL: the object is whatever Stripe names.
pub const RECORD_FAILURE_SQL: &str = "\
INSERT INTO reconciliation_items (event_id, reason, object_id, object_type, object_url, detail)
VALUES ($1, 'event_generation_failure', $2, $3, $4, $5)
ON CONFLICT (event_id) WHERE reason = 'event_generation_failure' DO NOTHING";

/// The object whose event Stripe failed to generate: what a person re-fetches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostObject {
    pub id: String,
    /// Stripe's object tag, e.g. `payment_intent`; None when only the id is known.
    pub object_type: Option<String>,
    /// The API path to retrieve it, e.g. `/v1/payment_intents/pi_…`; None when not given.
    pub url: Option<String>,
}

/// What the item records of one announcement.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureItem {
    /// None when the event names no object (see the module doc).
    pub object: Option<LostObject>,
    /// `{endpoint, account?, event_url, data?}`.
    pub detail: Value,
}

/// Reads what the item says from the announcement (see the module doc for where each part comes
/// from). Never fails: an announcement is worth an item whatever it lacks.
pub fn failure_item(event: &InboxEvent) -> FailureItem {
    let payload: Value = serde_json::from_str(event.payload.get()).unwrap_or(Value::Null);
    let data = payload.get("data").filter(|data| data.is_object());
    let impact = data.and_then(|data| data.get("impact"));
    let text = |value: Option<&Value>, key: &str| {
        value.and_then(|v| v.get(key)).and_then(Value::as_str).map(str::to_owned)
    };
    let object = match event.related_object() {
        Some(related) => Some(LostObject {
            id: related.id.to_owned(),
            object_type: Some(related.object_type.to_owned()),
            url: Some(related.url.to_owned()),
        }),
        None => {
            let related = impact.and_then(|impact| impact.get("related_object"));
            match text(related, "id") {
                Some(id) => {
                    Some(LostObject { id, object_type: text(related, "type"), url: text(related, "url") })
                }
                None => text(impact, "related_object_id").map(|id| LostObject {
                    id,
                    object_type: None,
                    url: None,
                }),
            }
        }
    };
    let account = event
        .account()
        .map(str::to_owned)
        .or_else(|| text(impact, "context"))
        .or_else(|| text(impact, "account"));
    let mut detail = serde_json::Map::new();
    detail.insert("endpoint".to_owned(), Value::from(event.endpoint.as_str()));
    if let Some(account) = account {
        detail.insert("account".to_owned(), Value::from(account));
    }
    detail.insert("event_url".to_owned(), Value::from(format!("/v2/core/events/{}", event.event_id)));
    if let Some(data) = data {
        detail.insert("data".to_owned(), data.clone());
    }
    FailureItem { object, detail: Value::Object(detail) }
}

/// `v2.core.health.event_generation_failure.resolved`: one reconciliation item (see the module doc).
fn event_generation_failure_resolved<'a>(
    tx: &'a Transaction<'_>,
    event: &'a InboxEvent,
) -> HandlerFuture<'a> {
    Box::pin(async move {
        let item = failure_item(event);
        let (id, object_type, url) = match &item.object {
            Some(o) => (Some(o.id.as_str()), o.object_type.as_deref(), o.url.as_deref()),
            None => (None, None, None),
        };
        let stmt = tx.prepare_cached(RECORD_FAILURE_SQL).await?;
        tx.execute(&stmt, &[&event.event_id, &id, &object_type, &url, &item.detail]).await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(payload: Value) -> InboxEvent {
        InboxEvent::from_payload("billing", &payload.to_string()).unwrap()
    }

    /// The announcement's envelope as a webhook carries it (a thin event: no `data`).
    fn envelope() -> Value {
        json!({
            "id": "evt_test_65Health", "object": "v2.core.event", "type": EVENT_GENERATION_FAILURE_RESOLVED,
            "created": "2026-10-30T16:05:44.000Z", "livemode": false,
            "reason": {"type": "request", "request": {"id": "req_1", "idempotency_key": "k"}}
        })
    }

    #[test]
    fn the_statement_and_the_reason_agree() {
        assert!(RECORD_FAILURE_SQL.contains(&format!("'{REASON_EVENT_GENERATION_FAILURE}'")));
    }

    #[test]
    fn the_object_comes_from_the_top_level_related_object_first() {
        let mut payload = envelope();
        payload["context"] = json!("acct_1Connected");
        payload["related_object"] =
            json!({"id": "pi_1", "type": "payment_intent", "url": "/v1/payment_intents/pi_1"});
        payload["data"] = json!({"impact": {"related_object": {"id": "pi_other", "type": "x", "url": "/x"}}});
        let item = failure_item(&event(payload));
        assert_eq!(
            item.object,
            Some(LostObject {
                id: "pi_1".into(),
                object_type: Some("payment_intent".into()),
                url: Some("/v1/payment_intents/pi_1".into())
            })
        );
        assert_eq!(item.detail["account"], "acct_1Connected");
        assert_eq!(item.detail["endpoint"], "billing");
        assert_eq!(item.detail["event_url"], "/v2/core/events/evt_test_65Health");
        assert_eq!(item.detail["data"]["impact"]["related_object"]["id"], "pi_other", "data kept as it came");
    }

    #[test]
    fn a_fetched_event_names_the_object_of_its_impact_and_the_impacts_account() {
        let mut payload = envelope();
        payload["data"] = json!({
            "alert_id": "halert_61RF", "grouping_key": "_grouping_s8Pg", "severity": "critical",
            "impact": {"event_type": "payment_intent.requires_action", "context": "acct_1Impact",
                       "related_object": {"id": "pi_1QA8", "type": "payment_intent",
                                          "url": "/v1/payment_intents/pi_1QA8"}},
            "resolved_at": "2025-10-30T16:05:44.000Z",
            "summary": "We have failed to create a notification for your Stripe account."
        });
        let item = failure_item(&event(payload.clone()));
        assert_eq!(
            item.object,
            Some(LostObject {
                id: "pi_1QA8".into(),
                object_type: Some("payment_intent".into()),
                url: Some("/v1/payment_intents/pi_1QA8".into())
            })
        );
        assert_eq!(item.detail["account"], "acct_1Impact");
        assert_eq!(item.detail["data"], payload["data"]);
    }

    #[test]
    fn the_preview_shape_names_the_object_by_its_id_only() {
        let mut payload = envelope();
        payload["data"] = json!({"impact": {"event_type": "invoice.paid", "related_object_id": "in_1",
                                            "account": "acct_1Preview", "missing_delivery_attempts": 2}});
        let item = failure_item(&event(payload));
        assert_eq!(item.object, Some(LostObject { id: "in_1".into(), object_type: None, url: None }));
        assert_eq!(item.detail["account"], "acct_1Preview");
    }

    #[test]
    fn an_announcement_that_names_nothing_still_makes_an_item_saying_where_to_read_the_alert() {
        let item = failure_item(&event(envelope()));
        assert_eq!(item.object, None);
        assert_eq!(
            item.detail,
            json!({"endpoint": "billing", "event_url": "/v2/core/events/evt_test_65Health"}),
            "no account, no data: nothing made up"
        );
    }
}
