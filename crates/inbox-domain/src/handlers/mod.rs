//! Handlers: plain async functions over the processing transaction, registered by event type.
//!
//! A handler applies one event's business effect inside the worker's process transaction, which
//! also marks the inbox row processed: the effect and the mark commit together or not at all.
//! Handlers must be idempotent and order-independent (Stripe redelivers, sends the same fact as
//! two Event objects, and never promises order): write them as forward-only state transitions
//! guarded by unique business keys. Never order by the event's `created`.
//!
//! Add your own event types without touching the worker:
//! ```
//! use inbox_domain::handlers::{HandlerFuture, InboxEvent, Registry};
//! fn customer_deleted<'a>(tx: &'a deadpool_postgres::Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
//!     Box::pin(async move {
//!         let _id = event.object_str("id")?;
//!         let _ = tx; // UPDATE customers … WHERE id = $1
//!         Ok(())
//!     })
//! }
//! let mut registry = Registry::with_invoice_handlers();
//! registry.register("customer.deleted", customer_deleted);
//! assert!(registry.get("customer.deleted").is_some());
//! ```

pub mod invoice;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;

use std::sync::OnceLock;

use deadpool_postgres::Transaction;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

/// A verified event as stored in the inbox.
///
/// The payload stays JSON text: handlers read the fields they need, and the worker does not build a
/// tree of the whole 2 KB event for each of them (that was a third of its CPU).
#[derive(Debug, Clone)]
pub struct InboxEvent {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    /// The stored payload (the `jsonb` as JSON text). `serde_json::from_str(payload.get())` reads
    /// it as any type.
    pub payload: Box<RawValue>,
    /// `data.object`'s top-level strings and integers, parsed at the first accessor call.
    object: OnceLock<Result<ObjectFields, String>>,
}

impl InboxEvent {
    pub fn new(
        provider: String,
        endpoint: String,
        event_id: String,
        event_type: String,
        payload: Box<RawValue>,
    ) -> Self {
        InboxEvent { provider, endpoint, event_id, event_type, payload, object: OnceLock::new() }
    }

    fn object(&self) -> Result<&ObjectFields, HandlerError> {
        self.object
            .get_or_init(|| match serde_json::from_str::<Envelope>(self.payload.get()) {
                Ok(Envelope { data: Some(Data { object: Some(fields) }) }) => Ok(fields),
                Ok(_) => Err("data.object is missing or not an object".to_owned()),
                Err(e) => Err(format!("data.object is missing or not an object: {e}")),
            })
            .as_ref()
            .map_err(|e| HandlerError::Payload(e.clone()))
    }

    fn field(&self, field: &str) -> Result<Option<&Scalar>, HandlerError> {
        Ok(self.object()?.0.iter().find(|(name, _)| name == field).map(|(_, value)| value))
    }

    /// A required string field of `data.object`.
    pub fn object_str(&self, field: &str) -> Result<&str, HandlerError> {
        match self.field(field)? {
            Some(Scalar::Str(s)) => Ok(s),
            _ => Err(HandlerError::Payload(format!("data.object.{field} is missing or not a string"))),
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
#[derive(Deserialize)]
struct Envelope {
    data: Option<Data>,
}

#[derive(Deserialize)]
struct Data {
    object: Option<ObjectFields>,
}

/// The top-level fields of `data.object` (jsonb keeps one value per key).
#[derive(Debug, Clone)]
struct ObjectFields(Vec<(String, Scalar)>);

/// A field's value as far as the accessors care.
#[derive(Debug, Clone)]
enum Scalar {
    Str(String),
    Int(i64),
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
                Ok(ObjectFields(fields))
            }
        }
        deserializer.deserialize_map(Fields)
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
                Ok(Scalar::Other)
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

/// Why a handler failed. The worker records the message in `last_error`, retries with backoff,
/// and parks the row at the attempt limit.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The payload lacks something the handler needs: retrying will not help, but a person can
    /// look at it (the row parks) and `requeue` once a handler change accepts it.
    #[error("payload: {0}")]
    Payload(String),
    /// A database error, including statement/lock timeouts.
    #[error("database: {}", describe_db_error(.0))]
    Database(#[from] tokio_postgres::Error),
    /// Anything else a handler wants to report.
    #[error("{0}")]
    Other(String),
}

/// A database error with its SQLSTATE, e.g. `canceling statement due to statement timeout (57014)`.
pub fn describe_db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// What a handler returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// A handler: applies `event` inside `tx`.
pub type Handler = for<'a, 'b> fn(&'a Transaction<'b>, &'a InboxEvent) -> HandlerFuture<'a>;

/// A set-based handler: applies several events of one type inside `tx`, with the same effect as
/// the type's [`Handler`] run on each of them in order — typically one statement for the whole
/// set instead of one per event. All or nothing: on `Err` the worker rolls the batch back and
/// runs every event again with the per-event handler, each in its own savepoint, so a batch
/// handler may refuse anything unusual (a bad payload, an unexpected state) and leave it to the
/// per-event path.
pub type BatchHandler = for<'a, 'b> fn(&'a Transaction<'b>, &'a [&'a InboxEvent]) -> HandlerFuture<'a>;

/// Handlers by event type. Types without a handler are processed with no effect ("ignored").
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Handler>,
    /// Optional set-based handlers, used for two or more events of a type in one batch.
    batch_handlers: HashMap<String, BatchHandler>,
}

impl Registry {
    /// A registry without handlers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The invoice state machine of [`invoice`].
    pub fn with_invoice_handlers() -> Self {
        let mut registry = Self::new();
        invoice::register(&mut registry);
        registry
    }

    /// Registers (or replaces) the handler of `event_type`; replacing it drops the type's
    /// set-based handler, if any.
    pub fn register(&mut self, event_type: &str, handler: Handler) -> &mut Self {
        self.handlers.insert(event_type.to_owned(), handler);
        self.batch_handlers.remove(event_type);
        self
    }

    pub fn get(&self, event_type: &str) -> Option<Handler> {
        self.handlers.get(event_type).copied()
    }

    /// Registers (or replaces) the set-based handler of `event_type`, which must have a per-event
    /// handler too (the fallback, and what `replay` runs). Replacing the per-event handler later
    /// drops the set-based one, so the two never disagree.
    pub fn register_batch(&mut self, event_type: &str, handler: BatchHandler) -> &mut Self {
        assert!(
            self.handlers.contains_key(event_type),
            "register the per-event handler of {event_type} before its batch handler"
        );
        self.batch_handlers.insert(event_type.to_owned(), handler);
        self
    }

    /// The set-based handler of `event_type`, if any.
    pub fn get_batch(&self, event_type: &str) -> Option<BatchHandler> {
        self.batch_handlers.get(event_type).copied()
    }

    /// The registered event types, sorted.
    pub fn event_types(&self) -> Vec<&str> {
        let mut types: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        types.sort_unstable();
        types
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("event_types", &self.event_types()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn other<'a>(_: &'a Transaction<'_>, _: &'a InboxEvent) -> HandlerFuture<'a> {
        Box::pin(async { Ok(()) })
    }

    fn event(payload: &str) -> InboxEvent {
        let payload = RawValue::from_string(payload.to_owned()).unwrap();
        InboxEvent::new("stripe".into(), "billing".into(), "evt_1".into(), "invoice.paid".into(), payload)
    }

    #[test]
    fn accessors_read_top_level_fields_of_data_object_past_nested_values() {
        let e = event(
            r#"{"id": "evt_1", "object": "event", "data": {"previous_attributes": {"id": "wrong"},
                "object": {"lines": {"data": [{"id": "il_1", "amount_paid": 1}]}, "id": "in_\u00e9\"1",
                           "amount_paid": 4200, "total": 1.5, "paid": true, "customer": "cus_1",
                           "big": 18446744073709551615, "due": null}}}"#,
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
    }

    #[test]
    fn accessors_refuse_a_payload_without_an_object_at_data_object() {
        for payload in
            [r#"{"id": "evt_1"}"#, r#"{"data": {}}"#, r#"{"data": {"object": ["in_1"]}}"#, r#"{"data": "x"}"#]
        {
            let err = event(payload).object_str("id").unwrap_err();
            assert!(
                matches!(&err, HandlerError::Payload(m) if m.starts_with("data.object is missing")),
                "{payload}: {err}"
            );
        }
    }

    #[test]
    fn replacing_a_handler_drops_its_set_based_handler() {
        let mut registry = Registry::with_invoice_handlers();
        assert!(registry.get_batch("invoice.paid").is_some());
        registry.register("invoice.paid", other);
        assert!(registry.get("invoice.paid").is_some());
        assert!(
            registry.get_batch("invoice.paid").is_none(),
            "a set-based handler must not outlive its per-event one"
        );
    }

    #[test]
    #[should_panic(expected = "before its batch handler")]
    fn a_set_based_handler_needs_a_per_event_handler() {
        fn batch<'a>(_: &'a Transaction<'_>, _: &'a [&'a InboxEvent]) -> HandlerFuture<'a> {
            Box::pin(async { Ok(()) })
        }
        Registry::new().register_batch("customer.deleted", batch);
    }
}
