//! Events: what the ingest reads from a verified webhook body ([`EventHead`]) and how the body
//! reaches PostgreSQL ([`JsonBytes`]), and the stored event as handlers see it ([`InboxEvent`]).

use std::borrow::Cow;
use std::sync::OnceLock;

use postgres_types::{to_sql_checked, IsNull, ToSql, Type};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::handler::HandlerError;

/// The longest event id we store. Stripe's ids are about 30 characters; anything much longer is
/// not a Stripe event and would only bloat the primary key.
pub const MAX_EVENT_ID_LEN: usize = 255;
/// The longest event type we store (Stripe's longest type names are under 80 characters).
pub const MAX_EVENT_TYPE_LEN: usize = 255;

/// The fields of a Stripe event the ingest needs: its id (the inbox key), its type, and whether
/// it happened in live mode.
///
/// Parsing this from the body checks that the body is one JSON object and that its syntax is
/// valid (serde reads every value it skips). It does **not** make the body storable as `jsonb`:
/// serde skips the strings it does not keep without judging their escapes, so a `\u0000`, a lone
/// surrogate or nesting deeper than the server's stack pass here and are refused by PostgreSQL.
/// The ingest keeps such a body byte for byte and parks it (see `store::ingest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventHead<'a> {
    pub id: Cow<'a, str>,
    pub event_type: Cow<'a, str>,
    /// `livemode`; None when absent or not a boolean.
    pub livemode: Option<bool>,
}

/// Why a verified body is not an event we can store. The texts are safe to return to the caller:
/// they never echo the payload.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
pub enum EventHeadError {
    #[error("body is not a JSON object")]
    NotJson,
    #[error("event has no string `id`")]
    MissingId,
    #[error("event has no string `type`")]
    MissingType,
    #[error("event `id` is empty or too long")]
    BadId,
    #[error("event `type` is empty or too long")]
    BadType,
}

#[derive(Deserialize)]
struct RawHead<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "type")]
    event_type: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient")]
    livemode: Option<bool>,
}

impl<'a> EventHead<'a> {
    /// Parses a verified body. Extra fields are ignored; `id` and `type` must be non-empty strings.
    pub fn parse(body: &'a [u8]) -> Result<Self, EventHeadError> {
        // serde reads a struct from a JSON array too (its elements in field order): only an
        // object is an event.
        if body.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r')) != Some(&b'{') {
            return Err(EventHeadError::NotJson);
        }
        // A non-string `id`/`type` is a type error from serde: distinguish it from broken JSON by
        // checking the syntax separately only on that (rare) path.
        let raw: RawHead<'a> = match serde_json::from_slice(body) {
            Ok(raw) => raw,
            Err(e) if e.is_data() => {
                return Err(match serde_json::from_slice::<serde_json::Value>(body) {
                    Ok(serde_json::Value::Object(map)) => {
                        if !map.get("id").is_some_and(|v| v.is_string()) {
                            EventHeadError::MissingId
                        } else {
                            EventHeadError::MissingType
                        }
                    }
                    _ => EventHeadError::NotJson,
                })
            }
            Err(_) => return Err(EventHeadError::NotJson),
        };
        let id = raw.id.ok_or(EventHeadError::MissingId)?;
        let event_type = raw.event_type.ok_or(EventHeadError::MissingType)?;
        if id.is_empty() || id.len() > MAX_EVENT_ID_LEN {
            return Err(EventHeadError::BadId);
        }
        if event_type.is_empty() || event_type.len() > MAX_EVENT_TYPE_LEN {
            return Err(EventHeadError::BadType);
        }
        Ok(EventHead { id, event_type, livemode: raw.livemode })
    }
}

/// A JSON document already validated, passed to PostgreSQL as `json`/`jsonb` without parsing it
/// into a tree and serialising it again (the ingest's hot path sends the body as received).
#[derive(Clone, Copy)]
pub struct JsonBytes<'a>(pub &'a [u8]);

/// Prints the size only: the driver's debug logs list parameters, and payloads hold customer data.
impl std::fmt::Debug for JsonBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JsonBytes({} bytes)", self.0.len())
    }
}

impl ToSql for JsonBytes<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // jsonb's binary format: a version byte, then the JSON text.
            out.extend_from_slice(&[1]);
        }
        out.extend_from_slice(self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSON || *ty == Type::JSONB
    }

    to_sql_checked!();
}

/// Bytes passed to PostgreSQL as `bytea` (a body kept byte for byte, a signature), printed by
/// their size only: the driver's debug logs list parameters, and a raw body holds customer data
/// as surely as its `jsonb` copy ([`JsonBytes`]).
#[derive(Clone, Copy)]
pub struct RawBytes<'a>(pub &'a [u8]);

impl std::fmt::Debug for RawBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawBytes({} bytes)", self.0.len())
    }
}

impl ToSql for RawBytes<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.0.to_sql(ty, out)
    }

    fn accepts(ty: &Type) -> bool {
        <&[u8] as ToSql>::accepts(ty)
    }

    to_sql_checked!();
}

/// A verified event as stored in the inbox, as handlers see it.
///
/// The payload stays JSON text: handlers read the fields they need through the accessors, which
/// parse the event's top-level fields and `data.object`'s top-level strings and integers once, at
/// the first call, and skip everything else without building a tree of the whole event (that was
/// a third of the worker's CPU). `serde_json::from_str(event.payload.get())` reads the payload as
/// any type, for nested fields.
#[derive(Debug, Clone)]
pub struct InboxEvent {
    pub provider: String,
    /// The endpoint that received it (the `{endpoint}` of the webhook URL).
    pub endpoint: String,
    /// Stripe's event id (`evt_…`): with the provider and the endpoint, the inbox key.
    pub event_id: String,
    /// Stripe's event type, e.g. `invoice.paid`; handlers are registered by it.
    pub event_type: String,
    /// The stored payload (the `jsonb` as JSON text).
    pub payload: Box<RawValue>,
    /// The fields the accessors read, parsed at the first call.
    fields: OnceLock<Result<Fields, String>>,
}

/// The `related_object` of a thin event (`"object": "v2.core.event"`): what the event is about.
/// A thin event carries no snapshot of the object; a handler that needs it fetches it from
/// Stripe after the event is processed, never inside the transaction (see `docs/handlers.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelatedObject<'a> {
    pub id: &'a str,
    /// The object's type, e.g. `v2.core.account`.
    pub object_type: &'a str,
    /// The API path to retrieve it, e.g. `/v2/core/accounts/acct_123`.
    pub url: &'a str,
}

impl InboxEvent {
    /// An event as the worker loads it from its row.
    pub fn new(
        provider: String,
        endpoint: String,
        event_id: String,
        event_type: String,
        payload: Box<RawValue>,
    ) -> Self {
        InboxEvent { provider, endpoint, event_id, event_type, payload, fields: OnceLock::new() }
    }

    /// An event from a webhook body as Stripe sends it (its `id` and `type` are read from it), as
    /// received on `endpoint`: for a handler's tests.
    pub fn from_payload(endpoint: &str, payload: &str) -> Result<Self, HandlerError> {
        let head = EventHead::parse(payload.as_bytes()).map_err(|e| HandlerError::Payload(e.to_string()))?;
        let (event_id, event_type) = (head.id.into_owned(), head.event_type.into_owned());
        let payload =
            RawValue::from_string(payload.to_owned()).map_err(|e| HandlerError::Payload(e.to_string()))?;
        Ok(Self::new(crate::PROVIDER_STRIPE.to_owned(), endpoint.to_owned(), event_id, event_type, payload))
    }

    /// Whether Stripe sent it in live mode (`livemode`); None when the payload has no boolean
    /// `livemode`.
    pub fn livemode(&self) -> Option<bool> {
        self.fields()?.livemode
    }

    /// The connected account the event happened on (Connect): the event's `account`, or a thin
    /// event's `context`. None for the platform's own events.
    pub fn account(&self) -> Option<&str> {
        let fields = self.fields()?;
        fields.account.as_deref().or(fields.context.as_deref())
    }

    /// The API version the event's object was rendered with (`api_version`); None when absent
    /// or null (thin events have none).
    pub fn api_version(&self) -> Option<&str> {
        self.fields()?.api_version.as_deref()
    }

    /// The object a thin event is about; None for a snapshot event (which has `data.object`).
    pub fn related_object(&self) -> Option<RelatedObject<'_>> {
        let related = self.fields()?.related_object.as_ref()?;
        Some(RelatedObject { id: &related.id, object_type: &related.object_type, url: &related.url })
    }

    fn parsed(&self) -> &Result<Fields, String> {
        self.fields
            .get_or_init(|| serde_json::from_str::<Fields>(self.payload.get()).map_err(|e| e.to_string()))
    }

    fn fields(&self) -> Option<&Fields> {
        self.parsed().as_ref().ok()
    }

    fn object(&self) -> Result<&[(String, Scalar)], HandlerError> {
        match self.parsed() {
            Ok(Fields { data: Some(Data { object: Some(ObjectFields(Some(fields))) }), .. }) => Ok(fields),
            Ok(_) => Err(HandlerError::Payload("data.object is missing or not an object".to_owned())),
            Err(e) => Err(HandlerError::Payload(format!("data.object is missing or not an object: {e}"))),
        }
    }

    fn field(&self, field: &str) -> Result<Option<&Scalar>, HandlerError> {
        Ok(self.object()?.iter().find(|(name, _)| name == field).map(|(_, value)| value))
    }

    /// A required string field of `data.object`.
    pub fn object_str(&self, field: &str) -> Result<&str, HandlerError> {
        match self.field(field)? {
            Some(Scalar::Str(s)) => Ok(s),
            _ => Err(HandlerError::Payload(format!("data.object.{field} is missing or not a string"))),
        }
    }

    /// An optional string field of `data.object`: None when it is null or absent (Stripe's
    /// nullable fields, e.g. an invoice's `customer` under Accounts v2); an error when it holds
    /// something else.
    pub fn object_opt_str(&self, field: &str) -> Result<Option<&str>, HandlerError> {
        match self.field(field)? {
            Some(Scalar::Str(s)) => Ok(Some(s)),
            None | Some(Scalar::Null) => Ok(None),
            Some(_) => Err(HandlerError::Payload(format!("data.object.{field} is not a string"))),
        }
    }

    /// A required integer field of `data.object`.
    pub fn object_i64(&self, field: &str) -> Result<i64, HandlerError> {
        match self.field(field)? {
            Some(Scalar::Int(i)) => Ok(*i),
            _ => Err(HandlerError::Payload(format!("data.object.{field} is missing or not an integer"))),
        }
    }
}

/// The part of an event the accessors read; everything else is skipped without being stored.
#[derive(Debug, Clone, Deserialize)]
struct Fields {
    #[serde(default, deserialize_with = "lenient")]
    livemode: Option<bool>,
    #[serde(default, deserialize_with = "lenient")]
    account: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    context: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    api_version: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    related_object: Option<Related>,
    data: Option<Data>,
}

#[derive(Debug, Clone, Deserialize)]
struct Related {
    id: String,
    #[serde(rename = "type")]
    object_type: String,
    url: String,
}

#[derive(Debug, Clone, Deserialize)]
struct Data {
    object: Option<ObjectFields>,
}

/// An optional field that reads as None when it holds another type than expected, so one odd
/// field never hides the others.
fn lenient<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either<T> {
        Expected(T),
        Other(IgnoredAny),
    }
    Ok(match Either::<T>::deserialize(deserializer)? {
        Either::Expected(value) => Some(value),
        Either::Other(_) => None,
    })
}

/// The top-level fields of `data.object` (jsonb keeps one value per key); None when `data.object`
/// is not an object (read past without failing the other fields).
#[derive(Debug, Clone)]
struct ObjectFields(Option<Vec<(String, Scalar)>>);

/// A field's value as far as the accessors care.
#[derive(Debug, Clone)]
enum Scalar {
    Str(String),
    Int(i64),
    Null,
    /// Anything else (objects and arrays are skipped, not stored).
    Other,
}

impl<'de> Deserialize<'de> for ObjectFields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = ObjectFields;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ObjectFields, A::Error> {
                let mut fields = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    fields.push((name, map.next_value::<Scalar>()?));
                }
                Ok(ObjectFields(Some(fields)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<ObjectFields, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ObjectFields(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
            fn visit_unit<E>(self) -> Result<ObjectFields, E> {
                Ok(ObjectFields(None))
            }
        }
        deserializer.deserialize_any(Fields)
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Value;
        impl<'de> serde::de::Visitor<'de> for Value {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar::Str(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(i64::try_from(v).map_or(Scalar::Other, Scalar::Int))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        deserializer.deserialize_any(Value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_id_and_type_and_ignores_the_rest() {
        let head =
            EventHead::parse(br#"{"id":"evt_1","object":"event","data":{"x":[1,2]},"type":"invoice.paid"}"#)
                .unwrap();
        assert_eq!(head.id, "evt_1");
        assert_eq!(head.event_type, "invoice.paid");
        assert_eq!(head.livemode, None);
        let live = EventHead::parse(br#"{"id":"evt_1","type":"t","livemode":true}"#).unwrap();
        assert_eq!(live.livemode, Some(true));
        // An odd livemode is unknown, not a reason to refuse the event.
        let odd = EventHead::parse(br#"{"id":"evt_1","livemode":"yes","type":"t"}"#).unwrap();
        assert_eq!((odd.id.as_ref(), odd.event_type.as_ref(), odd.livemode), ("evt_1", "t", None));
    }

    #[test]
    fn refuses_what_is_not_an_event() {
        assert_eq!(EventHead::parse(b"not json"), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(b"[1,2]"), Err(EventHeadError::NotJson));
        // Two strings in an array read as a struct's fields in order: serde accepts it, we must not.
        assert_eq!(EventHead::parse(br#"["evt_1","invoice.paid"]"#), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(b" \n[\"evt_1\",\"invoice.paid\"]"), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1","type":"x"} trailing"#), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(br#"{"type":"x"}"#), Err(EventHeadError::MissingId));
        assert_eq!(EventHead::parse(br#"{"id":1,"type":"x"}"#), Err(EventHeadError::MissingId));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1"}"#), Err(EventHeadError::MissingType));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1","type":null}"#), Err(EventHeadError::MissingType));
        assert_eq!(EventHead::parse(br#"{"id":"","type":"x"}"#), Err(EventHeadError::BadId));
        assert_eq!(EventHead::parse(br#"{"id":"e","type":""}"#), Err(EventHeadError::BadType));
        let long = format!(r#"{{"id":"{}","type":"x"}}"#, "e".repeat(MAX_EVENT_ID_LEN + 1));
        assert_eq!(EventHead::parse(long.as_bytes()), Err(EventHeadError::BadId));
    }

    #[test]
    fn escaped_strings_are_unescaped() {
        let head = EventHead::parse(br#"{"id":"evt_\u0031","type":"invoice.paid"}"#).unwrap();
        assert_eq!(head.id, "evt_1");
    }

    fn event(payload: &str) -> InboxEvent {
        InboxEvent::from_payload("billing", payload).unwrap()
    }

    #[test]
    fn accessors_read_top_level_fields_of_data_object_past_nested_values() {
        let e = event(
            r#"{"id": "evt_1", "object": "event", "type": "invoice.paid", "data": {"previous_attributes": {"id": "wrong"},
                "object": {"lines": {"data": [{"id": "il_1", "amount_paid": 1}]}, "id": "in_\u00e9\"1",
                           "amount_paid": 4200, "total": 1.5, "paid": true, "customer": "cus_1",
                           "big": 18446744073709551615, "due": null}}}"#,
        );
        assert_eq!(
            (e.event_id.as_str(), e.event_type.as_str(), e.endpoint.as_str()),
            ("evt_1", "invoice.paid", "billing")
        );
        assert_eq!(e.object_str("id").unwrap(), "in_\u{e9}\"1");
        assert_eq!(e.object_str("customer").unwrap(), "cus_1");
        assert_eq!(e.object_i64("amount_paid").unwrap(), 4200);
        for (field, wrong) in
            [("total", "integer"), ("big", "integer"), ("due", "integer"), ("lines", "integer")]
        {
            let err = e.object_i64(field).unwrap_err().to_string();
            assert!(err.contains(field) && err.contains(wrong), "{err}");
        }
        assert!(e.object_str("amount_paid").unwrap_err().to_string().contains("not a string"));
        assert!(e.object_str("status").unwrap_err().to_string().contains("data.object.status is missing"));
        assert_eq!(e.object_opt_str("due").unwrap(), None, "null");
        assert_eq!(e.object_opt_str("status").unwrap(), None, "absent");
        assert_eq!(e.object_opt_str("customer").unwrap(), Some("cus_1"));
        assert!(e.object_opt_str("total").is_err(), "a number is not a missing string");
    }

    #[test]
    fn accessors_refuse_a_payload_without_an_object_at_data_object() {
        for payload in [
            r#"{"id": "evt_1", "type": "t"}"#,
            r#"{"id": "evt_1", "type": "t", "data": {}}"#,
            r#"{"id": "evt_1", "type": "t", "data": {"object": ["in_1"]}}"#,
            r#"{"id": "evt_1", "type": "t", "data": "x"}"#,
        ] {
            let err = event(payload).object_str("id").unwrap_err();
            assert!(
                matches!(&err, HandlerError::Payload(m) if m.starts_with("data.object is missing")),
                "{payload}: {err}"
            );
        }
    }

    #[test]
    fn envelope_accessors_read_livemode_account_and_api_version_of_a_connect_event() {
        let e = event(
            r#"{"id": "evt_1", "object": "event", "account": "acct_1Connected", "api_version": "2026-07-29.dahlia",
                "created": 1790000000, "data": {"object": {"id": "cus_1", "object": "customer"}},
                "livemode": true, "pending_webhooks": 1, "request": {"id": null, "idempotency_key": null},
                "type": "customer.created"}"#,
        );
        assert_eq!(e.livemode(), Some(true));
        assert_eq!(e.account(), Some("acct_1Connected"));
        assert_eq!(e.api_version(), Some("2026-07-29.dahlia"));
        assert_eq!(e.related_object(), None);
        assert_eq!(e.object_str("id").unwrap(), "cus_1");

        let platform = event(
            r#"{"id": "evt_2", "type": "customer.created", "api_version": null, "livemode": false,
                                 "data": {"object": {"id": "cus_2"}}}"#,
        );
        assert_eq!(
            (platform.livemode(), platform.account(), platform.api_version()),
            (Some(false), None, None)
        );
    }

    #[test]
    fn a_thin_event_exposes_its_related_object_and_context() {
        // The shape of Stripe's `v2.core.event`: no data.object, `created` as RFC 3339 text.
        let e = event(
            r#"{"id": "evt_test_65R9", "object": "v2.core.event", "type": "v2.core.account.updated",
                "created": "2026-10-01T12:00:00.000Z", "livemode": false, "context": "acct_1Connected",
                "related_object": {"id": "acct_1Connected", "type": "v2.core.account",
                                   "url": "/v2/core/accounts/acct_1Connected"},
                "reason": {"type": "request", "request": {"id": "req_1", "idempotency_key": "k"}}}"#,
        );
        assert_eq!(
            e.related_object(),
            Some(RelatedObject {
                id: "acct_1Connected",
                object_type: "v2.core.account",
                url: "/v2/core/accounts/acct_1Connected"
            })
        );
        assert_eq!(
            (e.livemode(), e.account(), e.api_version()),
            (Some(false), Some("acct_1Connected"), None)
        );
        assert!(e.object_str("id").is_err(), "a thin event has no data.object");
    }

    #[test]
    fn an_odd_envelope_field_hides_nothing_else() {
        let e = event(
            r#"{"id": "evt_1", "type": "t", "livemode": "yes", "account": 7, "related_object": "x",
                          "api_version": "2026-07-29.dahlia", "data": {"object": {"id": "o_1"}}}"#,
        );
        assert_eq!((e.livemode(), e.account(), e.related_object()), (None, None, None));
        assert_eq!(e.api_version(), Some("2026-07-29.dahlia"));
        assert_eq!(e.object_str("id").unwrap(), "o_1");
    }
}
