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

use deadpool_postgres::Transaction;

/// A verified event as stored in the inbox.
#[derive(Debug, Clone)]
pub struct InboxEvent {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub payload: serde_json::Value,
}

impl InboxEvent {
    /// The event's `data.object`.
    pub fn object(&self) -> Result<&serde_json::Map<String, serde_json::Value>, HandlerError> {
        self.payload
            .get("data")
            .and_then(|d| d.get("object"))
            .and_then(|o| o.as_object())
            .ok_or(HandlerError::Payload("data.object is missing or not an object".into()))
    }

    /// A required string field of `data.object`.
    pub fn object_str(&self, field: &str) -> Result<&str, HandlerError> {
        self.object()?
            .get(field)
            .and_then(|v| v.as_str())
            .ok_or_else(|| HandlerError::Payload(format!("data.object.{field} is missing or not a string")))
    }

    /// A required integer field of `data.object`.
    pub fn object_i64(&self, field: &str) -> Result<i64, HandlerError> {
        self.object()?
            .get(field)
            .and_then(|v| v.as_i64())
            .ok_or_else(|| HandlerError::Payload(format!("data.object.{field} is missing or not an integer")))
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
