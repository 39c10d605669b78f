//! Stripe's own data, copied into `tests/fixtures/stripe-openapi/` (see the README there): every
//! webhook event type, the resource fixtures of its OpenAPI repository and the thin-event schema,
//! and events built from them the way Stripe wraps an object.

use std::sync::OnceLock;

use serde_json::{json, Map, Value};

const EVENT_TYPES_JSON: &str = include_str!("../../fixtures/stripe-openapi/event_types.json");
const FIXTURES_JSON: &str = include_str!("../../fixtures/stripe-openapi/fixtures.json");
const THIN_EVENT_SCHEMA_JSON: &str = include_str!("../../fixtures/stripe-openapi/v2_core_event.schema.json");

/// The API version the fixtures and the event types were taken at.
pub const API_VERSION: &str = "2026-07-29.dahlia";

fn parse(what: &str, text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("tests/fixtures/stripe-openapi/{what}: {e}"))
}

fn strings(value: &Value, what: &str) -> Vec<String> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("{what} is not an array"))
        .iter()
        .map(|t| t.as_str().unwrap_or_else(|| panic!("{what} holds a non-string")).to_owned())
        .collect()
}

/// The webhook event types a `POST /v1/webhook_endpoints` accepts (`enabled_events`, `*` left
/// out), in Stripe's order.
pub fn enabled_events() -> Vec<String> {
    strings(&parse("event_types.json", EVENT_TYPES_JSON)["enabled_events"], "enabled_events")
}

/// The types Stripe's Python SDK lists beyond [`enabled_events`] (`apps.install.*`,
/// `three_d_secure.authentication.*`).
pub fn sdk_only_event_types() -> Vec<String> {
    strings(&parse("event_types.json", EVENT_TYPES_JSON)["sdk_only"]["types"], "sdk_only.types")
}

/// Every event type: [`enabled_events`], then [`sdk_only_event_types`].
pub fn all_event_types() -> Vec<String> {
    let mut types = enabled_events();
    types.extend(sdk_only_event_types());
    types
}

/// The resource fixtures, keyed by object name (`invoice`, `issuing.card`, `checkout.session`, …).
pub fn resources() -> &'static Map<String, Value> {
    static RESOURCES: OnceLock<Map<String, Value>> = OnceLock::new();
    RESOURCES.get_or_init(|| match parse("fixtures.json", FIXTURES_JSON)["resources"].take() {
        Value::Object(map) => map,
        _ => panic!("fixtures.json has no `resources` object"),
    })
}

/// The resource fixture named `key`, as Stripe wrote it.
pub fn resource(key: &str) -> Value {
    resources().get(key).unwrap_or_else(|| panic!("no fixture {key:?}")).clone()
}

/// Event types (their words before the action) whose object the general rule of
/// [`resource_key`] gets wrong or cannot find.
const EXPLICIT: [(&str, &str); 3] = [
    // The customer's payment source: a card nowadays (the legacy `source` object has its own
    // `source.*` events).
    ("customer.source", "card"),
    // An application fee's refund is a `fee_refund`, not a charge's `refund`.
    ("application_fee.refund", "fee_refund"),
    // The one fixture named after its event (`billing.alert.triggered`) rather than an object.
    ("billing.alert", "billing.alert_triggered"),
];

/// The fixture whose object an event of `event_type` carries in `data.object`; None when the
/// fixtures have none.
///
/// The explicit table first, then the longest run of the type's dot-separated words that names a
/// fixture, the innermost run first among runs of one length: each run joined by dots
/// (`checkout.session`), by underscores (`source.transaction` → `source_transaction`) and with its
/// first underscore read as a dot (`issuing_card` → `issuing.card`). So `charge.dispute.closed`
/// carries a `dispute`, `customer.subscription.updated` a `subscription`,
/// `account.application.authorized` an `application`, `source.mandate_notification` a
/// `source_mandate_notification`, and `invoice.paid` an `invoice`.
///
/// The types without a fixture (Stripe's fixtures have no such object): `apps.install.created`,
/// `apps.install.deleted`, `apps.install.updated` and the seven
/// `three_d_secure.authentication.*` (`canceled`, `challenge_started`, `errored`, `failed`,
/// `requires_challenge`, `requires_submission`, `succeeded`), all from the SDK-only list.
pub fn resource_key(event_type: &str) -> Option<&'static str> {
    let fixtures = resources();
    let words: Vec<&str> = event_type.split('.').collect();
    let object_words = &words[..words.len().saturating_sub(1)];
    if let Some((_, key)) = EXPLICIT.iter().find(|(prefix, _)| *prefix == object_words.join(".")) {
        return Some(fixtures.get_key_value(*key).expect("the explicit table names fixtures").0);
    }
    for len in (1..=words.len()).rev() {
        for start in (0..=words.len() - len).rev() {
            let run = &words[start..start + len];
            let dotted = run.join(".");
            for candidate in [run.join("."), run.join("_"), dotted.replacen('_', ".", 1)] {
                if let Some((key, _)) = fixtures.get_key_value(&candidate) {
                    return Some(key);
                }
            }
        }
    }
    None
}

/// The object an event of `event_type` carries: its fixture (true), or, when there is none, a
/// minimal `{"id", "object"}` named after the type's words before the action (false).
pub fn object_for(event_type: &str) -> (Value, bool) {
    match resource_key(event_type) {
        Some(key) => (resource(key), true),
        None => {
            let object = event_type.rsplit_once('.').map_or(event_type, |(object, _)| object);
            let prefix: String = object.chars().filter(char::is_ascii_alphanumeric).take(8).collect();
            (json!({ "id": format!("{prefix}_shapes"), "object": object }), false)
        }
    }
}

/// A snapshot event (`"object": "event"`) of `event_type` carrying `object`, as Stripe sends it.
pub fn snapshot_event(event_id: &str, event_type: &str, object: Value, created: i64) -> Value {
    json!({
        "id": event_id,
        "object": "event",
        "api_version": API_VERSION,
        "created": created,
        "data": { "object": object },
        "livemode": false,
        "pending_webhooks": 1,
        "request": { "id": null, "idempotency_key": null },
        "type": event_type,
    })
}

/// `event` as a Connect event: it happened on the connected account `account`.
pub fn on_connected_account(mut event: Value, account: &str) -> Value {
    event["account"] = json!(account);
    event
}

/// What a thin event is about: its `related_object`.
pub struct Related<'a> {
    pub id: &'a str,
    /// The object's type, e.g. `v2.core.account` or `billing.meter`.
    pub object_type: &'a str,
    /// The API path to retrieve it.
    pub url: &'a str,
}

/// A thin event (`"object": "v2.core.event"`): `created` as RFC 3339 text, a `related_object`, no
/// `data.object`; `context` is the connected account it happened on, if any.
pub fn thin_event(
    event_id: &str,
    event_type: &str,
    related: Related<'_>,
    context: Option<&str>,
    created_rfc3339: &str,
) -> Value {
    let mut event = json!({
        "id": event_id,
        "object": "v2.core.event",
        "type": event_type,
        "created": created_rfc3339,
        "livemode": false,
        "related_object": { "id": related.id, "type": related.object_type, "url": related.url },
        "reason": { "type": "request", "request": { "id": "req_shapes", "idempotency_key": "shapes" } },
    });
    if let Some(context) = context {
        event["context"] = json!(context);
    }
    assert_matches_thin_event_schema(&event);
    event
}

/// Panics unless `event` has every field Stripe's `v2.core.event` schema requires, each field
/// the schema describes has its type (and `object` its enumerated value), and `related_object` and
/// `reason` have their required fields.
pub fn assert_matches_thin_event_schema(event: &Value) {
    let schema = parse("v2_core_event.schema.json", THIN_EVENT_SCHEMA_JSON)["schema"].take();
    check_against(event, &schema, "event");
}

fn check_against(value: &Value, schema: &Value, at: &str) {
    let type_ok = match schema["type"].as_str() {
        Some("object") => value.is_object(),
        Some("string") => value.is_string(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    assert!(type_ok, "{at} is not of type {}: {value}", schema["type"]);
    if let Some(allowed) = schema["enum"].as_array() {
        assert!(allowed.contains(value), "{at} is not one of {allowed:?}: {value}");
    }
    for required in schema["required"].as_array().into_iter().flatten() {
        let name = required.as_str().expect("required names are strings");
        assert!(value.get(name).is_some(), "{at} has no {name:?} (required): {value}");
    }
    if let Some(properties) = schema["properties"].as_object() {
        for (name, property) in properties {
            if let Some(field) = value.get(name) {
                check_against(field, property, &format!("{at}.{name}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_has_stripes_counts() {
        assert_eq!(enabled_events().len(), 265);
        assert_eq!(sdk_only_event_types().len(), 10);
        assert_eq!(resources().len(), 82);
    }

    #[test]
    fn event_types_map_to_the_object_they_carry() {
        for (event_type, key) in [
            ("invoice.paid", Some("invoice")),
            ("customer.subscription.updated", Some("subscription")),
            ("charge.dispute.closed", Some("dispute")),
            ("charge.refund.updated", Some("refund")),
            ("account.application.authorized", Some("application")),
            ("account.external_account.created", Some("external_account")),
            ("invoice_payment.paid", Some("invoice_payment")),
            ("issuing_card.created", Some("issuing.card")),
            ("issuing_personalization_design.activated", Some("issuing.personalization_design")),
            ("source.mandate_notification", Some("source_mandate_notification")),
            ("source.transaction.created", Some("source_transaction")),
            ("source.chargeable", Some("source")),
            ("sigma.scheduled_query_run.created", Some("scheduled_query_run")),
            ("reserve.plan.disabled", Some("reserve.plan")),
            ("customer.source.created", Some("card")),
            ("application_fee.refund.updated", Some("fee_refund")),
            ("billing.alert.triggered", Some("billing.alert_triggered")),
            ("three_d_secure.authentication.succeeded", None),
        ] {
            assert_eq!(resource_key(event_type), key, "{event_type}");
        }
        // Every type Stripe's API lists has a fixture; only the SDK-only ones may not.
        for event_type in enabled_events() {
            assert!(resource_key(&event_type).is_some(), "{event_type} has no fixture");
        }
    }

    #[test]
    #[should_panic(expected = "event.related_object has no \"url\"")]
    fn a_thin_event_whose_related_object_has_no_url_is_refused() {
        assert_matches_thin_event_schema(&json!({
            "id": "evt_1", "object": "v2.core.event", "type": "v2.core.account.updated",
            "created": "2026-10-01T12:00:00.000Z", "livemode": false,
            "related_object": { "id": "acct_1", "type": "v2.core.account" },
        }));
    }

    #[test]
    #[should_panic(expected = "event.created is not of type")]
    fn a_thin_event_with_a_unix_created_is_refused() {
        assert_matches_thin_event_schema(&json!({
            "id": "evt_1", "object": "v2.core.event", "type": "v2.core.account.updated",
            "created": 1_790_000_000, "livemode": false,
        }));
    }
}
