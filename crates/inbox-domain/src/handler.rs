//! Handlers: the business effect of an event type, applied inside the worker's process
//! transaction, and the [`Registry`] that maps event types to them.
//!
//! A handler applies one event's effect inside the transaction that also marks the inbox row
//! processed: the effect and the mark commit together or not at all. Handlers must be idempotent
//! and order-independent (Stripe redelivers, sends the same fact as two Event objects, and never
//! promises order): write them as forward-only state transitions guarded by unique business keys,
//! and never order by the event's `created`. `docs/handlers.md` says how, and what a handler must
//! never do (commit, sleep, call the network).
//!
//! A handler is a value implementing [`Handler`], so it can hold state (configuration, a client
//! used outside the transaction, counters); a plain function with the same signature is one too:
//! ```
//! use inbox_domain::handler::{Handler, HandlerFuture, Registry};
//! use inbox_domain::inbox::event::InboxEvent;
//! use deadpool_postgres::Transaction;
//!
//! fn customer_deleted<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
//!     Box::pin(async move {
//!         let id = event.object_str("id")?;
//!         tx.execute("UPDATE customers SET deleted = true WHERE id = $1", &[&id]).await?;
//!         Ok(())
//!     })
//! }
//!
//! /// Tags each new customer with a plan configured at start-up.
//! struct CustomerCreated {
//!     default_plan: String,
//! }
//!
//! impl Handler for CustomerCreated {
//!     fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
//!         Box::pin(async move {
//!             let id = event.object_str("id")?;
//!             tx.execute(
//!                 "INSERT INTO customers (id, plan) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
//!                 &[&id, &self.default_plan],
//!             )
//!             .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! let mut registry = Registry::with_invoice_handlers();
//! registry
//!     .register("customer.deleted", customer_deleted)
//!     .register("customer.created", CustomerCreated { default_plan: "free".into() });
//! assert!(registry.get("customer.created").is_some());
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use deadpool_postgres::Transaction;

use crate::db::describe_db_error;
use crate::inbox::event::InboxEvent;
use crate::inbox::schema::Migrations;

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

/// What a handler returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// Applies one event type's business effect inside the worker's process transaction.
///
/// `&self`: a handler may hold state (configuration, a client for work done outside the
/// transaction, counters), shared by every event in flight. Functions with the same signature
/// are handlers too.
pub trait Handler: Send + Sync + 'static {
    /// Applies `event` inside `tx`. Must not commit, roll back, sleep or call the network: the
    /// worker commits the effect together with the processed mark, and the row locks are held
    /// until then. An `Err` (or a panic) rolls the effect back and is retried with backoff.
    fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a>;
}

impl<F> Handler for F
where
    F: for<'a, 'b> Fn(&'a Transaction<'b>, &'a InboxEvent) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
        self(tx, event)
    }
}

/// A set-based handler: applies several events of one type inside `tx`, with the same effect as
/// the type's [`Handler`] run on each of them in order — typically one statement for the whole
/// set instead of one per event. All or nothing: on `Err` the worker rolls the batch back and
/// runs every event again with the per-event handler, each in its own savepoint, so a batch
/// handler may refuse anything unusual (a bad payload, an unexpected state) and leave it to the
/// per-event path.
pub trait BatchHandler: Send + Sync + 'static {
    /// Applies `events`, all of this handler's type, inside `tx`.
    fn handle_batch<'a>(&'a self, tx: &'a Transaction<'_>, events: &'a [&'a InboxEvent])
        -> HandlerFuture<'a>;
}

impl<F> BatchHandler for F
where
    F: for<'a, 'b> Fn(&'a Transaction<'b>, &'a [&'a InboxEvent]) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    fn handle_batch<'a>(
        &'a self,
        tx: &'a Transaction<'_>,
        events: &'a [&'a InboxEvent],
    ) -> HandlerFuture<'a> {
        self(tx, events)
    }
}

/// An event-type pattern, as [`Registry::ignore`] and `run --ignore` take it: `*` (every type),
/// `prefix.*` (every type that starts with `prefix.`), or one type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EventTypePattern {
    /// `*`.
    Any,
    /// `prefix.*`: the prefix with its final dot.
    Prefix(String),
    /// One event type.
    Exact(String),
}

impl std::str::FromStr for EventTypePattern {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let valid = |s: &str| {
            !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        if text == "*" {
            return Ok(EventTypePattern::Any);
        }
        if let Some(prefix) = text.strip_suffix(".*") {
            if valid(prefix) {
                return Ok(EventTypePattern::Prefix(format!("{prefix}.")));
            }
        } else if valid(text) {
            return Ok(EventTypePattern::Exact(text.to_owned()));
        }
        Err(format!(
            "{text:?} is not an event-type pattern: use `*`, `prefix.*` (e.g. `customer.*`) or one type \
             (e.g. `customer.created`)"
        ))
    }
}

impl std::fmt::Display for EventTypePattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventTypePattern::Any => f.write_str("*"),
            EventTypePattern::Prefix(prefix) => write!(f, "{prefix}*"),
            EventTypePattern::Exact(event_type) => f.write_str(event_type),
        }
    }
}

impl EventTypePattern {
    /// Whether `event_type` matches.
    pub fn matches(&self, event_type: &str) -> bool {
        match self {
            EventTypePattern::Any => true,
            EventTypePattern::Prefix(prefix) => event_type.starts_with(prefix.as_str()),
            EventTypePattern::Exact(exact) => event_type == exact,
        }
    }

    /// Whether every type `other` matches, this one matches too.
    fn covers(&self, other: &EventTypePattern) -> bool {
        match (self, other) {
            (EventTypePattern::Any, _) => true,
            (EventTypePattern::Prefix(a), EventTypePattern::Prefix(b)) => b.starts_with(a.as_str()),
            (_, EventTypePattern::Exact(t)) => self.matches(t),
            _ => false,
        }
    }
}

/// What a worker with a registry claims (see `store::queue::claim`): every type, or the types it
/// handles or ignores by name and those that start with one of its ignored prefixes. A worker
/// never claims an event it could neither apply nor was told to ignore: that event waits for a
/// worker that can, counted as having no handler (`stats`, `inbox_no_handler`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimFilter {
    /// Every type (`*` is ignored): the claim takes the oldest ready rows whatever their type.
    pub all: bool,
    /// Types claimed by name: the handled ones and those ignored by name. Sorted.
    pub exact: Vec<String>,
    /// Prefixes (each ending in `.`) of the types ignored by a `prefix.*`, none covering another.
    pub prefixes: Vec<String>,
}

impl ClaimFilter {
    /// Whether a worker with this filter claims `event_type`.
    pub fn claims(&self, event_type: &str) -> bool {
        self.all
            || self.exact.iter().any(|t| t == event_type)
            || self.prefixes.iter().any(|p| event_type.starts_with(p.as_str()))
    }
}

/// What a worker binary applies: handlers by event type, the types it ignores (processed with no
/// effect), and the migrations of the tables its handlers write when those are not the inbox's
/// own. A worker claims only the types it handles or ignores ([`Registry::claim_filter`]): an
/// event of any other type is never marked done by it, and waits for a worker that handles it.
/// The same registry serves `run` and `replay`, and its migrations run after the inbox's in
/// `migrate`.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Arc<dyn Handler>>,
    /// Optional set-based handlers, used for two or more events of a type in one batch.
    batch_handlers: HashMap<String, Arc<dyn BatchHandler>>,
    /// Types processed with no effect ([`Registry::ignore`]), unless a handler is registered.
    ignored: Vec<EventTypePattern>,
    /// The application's own migrations, applied by `migrate` after the inbox's.
    migrations: Option<Migrations>,
    /// Types whose handler needs the current state of the object the event names (thin events):
    /// `fetch` applies them after fetching it, `run` leaves them ([`Registry::register_fetched`]).
    fetched: std::collections::BTreeSet<String>,
}

impl Registry {
    /// A registry without handlers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The stock handlers: the invoice state machine of [`crate::invoice`], and [`crate::health`]'s
    /// handler of `v2.core.health.event_generation_failure.resolved` (an event Stripe failed to
    /// generate, recorded as a reconciliation item for a person). The one place they are
    /// registered: the stock binary, `replay` and a team's binary built on this get the same set.
    pub fn with_invoice_handlers() -> Self {
        let mut registry = Self::new();
        crate::invoice::register(&mut registry);
        crate::health::register(&mut registry);
        registry
    }

    /// Registers (or replaces) the handler of `event_type`; replacing it drops the type's
    /// set-based handler, if any.
    pub fn register(&mut self, event_type: &str, handler: impl Handler) -> &mut Self {
        self.handlers.insert(event_type.to_owned(), Arc::new(handler));
        self.batch_handlers.remove(event_type);
        self.fetched.remove(event_type);
        self
    }

    /// Registers the handler of a thin event type whose handler needs the object the event names
    /// as it is now: `inbox-worker fetch` claims these events, fetches each object once for every
    /// event about it that is waiting (`related_object.url`, with the event's account context),
    /// stores the snapshot, then runs the handler, which reads it with
    /// `inbox_worker::fetch::snapshot`. `run` does not claim these types.
    pub fn register_fetched(&mut self, event_type: &str, handler: impl Handler) -> &mut Self {
        self.register(event_type, handler);
        self.fetched.insert(event_type.to_owned());
        self
    }

    /// The types registered with [`Registry::register_fetched`], sorted.
    pub fn fetched_types(&self) -> Vec<&str> {
        self.fetched.iter().map(String::as_str).collect()
    }

    /// What `run` applies: this registry without the fetched types (which `fetch` applies).
    pub fn without_fetched(&self) -> Registry {
        let mut registry = self.clone();
        for t in &self.fetched {
            registry.handlers.remove(t);
            registry.batch_handlers.remove(t);
        }
        registry.fetched.clear();
        registry
    }

    /// What `fetch` applies: only the fetched types, nothing ignored.
    pub fn only_fetched(&self) -> Registry {
        let mut registry = Registry::new();
        for t in &self.fetched {
            if let Some(handler) = self.handlers.get(t) {
                registry.handlers.insert(t.clone(), handler.clone());
            }
            registry.fetched.insert(t.clone());
        }
        registry
    }

    /// The handler of `event_type`, if any.
    pub fn get(&self, event_type: &str) -> Option<&dyn Handler> {
        self.handlers.get(event_type).map(|h| &**h)
    }

    /// Registers (or replaces) the set-based handler of `event_type`, which must have a per-event
    /// handler too (the fallback, and what `replay` runs). Replacing the per-event handler later
    /// drops the set-based one, so the two never disagree.
    ///
    /// # Panics
    /// When `event_type` has no per-event handler: a programming error, caught at start-up.
    pub fn register_batch(&mut self, event_type: &str, handler: impl BatchHandler) -> &mut Self {
        assert!(
            self.handlers.contains_key(event_type),
            "register the per-event handler of {event_type} before its batch handler"
        );
        self.batch_handlers.insert(event_type.to_owned(), Arc::new(handler));
        self
    }

    /// The set-based handler of `event_type`, if any.
    pub fn get_batch(&self, event_type: &str) -> Option<&dyn BatchHandler> {
        self.batch_handlers.get(event_type).map(|h| &**h)
    }

    /// The registered event types, sorted.
    pub fn event_types(&self) -> Vec<&str> {
        let mut types: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        types.sort_unstable();
        types
    }

    /// Marks the types `pattern` matches (`*`, `prefix.*`, or one type) as ignored: this worker
    /// claims them and marks them processed with no effect (outcome `ignored`). A type with a
    /// handler is always handled, whatever the patterns say.
    ///
    /// # Panics
    /// When `pattern` is not a pattern (see [`EventTypePattern`]): a programming error, caught at
    /// start-up. Patterns from the outside go through [`EventTypePattern`]'s `FromStr` and
    /// [`Registry::ignore_pattern`].
    pub fn ignore(&mut self, pattern: &str) -> &mut Self {
        let pattern = pattern.parse().unwrap_or_else(|e| panic!("Registry::ignore: {e}"));
        self.ignore_pattern(pattern)
    }

    /// [`Registry::ignore`] with a parsed pattern.
    pub fn ignore_pattern(&mut self, pattern: EventTypePattern) -> &mut Self {
        if !self.ignored.contains(&pattern) {
            self.ignored.push(pattern);
        }
        self
    }

    /// The ignore patterns, as given.
    pub fn ignore_patterns(&self) -> &[EventTypePattern] {
        &self.ignored
    }

    /// Whether events of `event_type` are ignored: no handler, and a pattern matches.
    pub fn ignores(&self, event_type: &str) -> bool {
        !self.handlers.contains_key(event_type) && self.ignored.iter().any(|p| p.matches(event_type))
    }

    /// What a worker with this registry claims: the handled types and the ignored ones.
    pub fn claim_filter(&self) -> ClaimFilter {
        let broadest: Vec<&EventTypePattern> =
            self.ignored.iter().filter(|p| !self.ignored.iter().any(|q| q != *p && q.covers(p))).collect();
        if broadest.contains(&&EventTypePattern::Any) {
            return ClaimFilter { all: true, ..ClaimFilter::default() };
        }
        let mut prefixes: Vec<String> = broadest
            .iter()
            .filter_map(|p| match p {
                EventTypePattern::Prefix(prefix) => Some(prefix.clone()),
                _ => None,
            })
            .collect();
        prefixes.sort_unstable();
        prefixes.dedup();
        let by_name = broadest.iter().filter_map(|p| match p {
            EventTypePattern::Exact(t) => Some(t.as_str()),
            _ => None,
        });
        let mut exact: Vec<String> = self
            .handlers
            .keys()
            .map(String::as_str)
            .chain(by_name)
            // A type a prefix claims already is not claimed twice.
            .filter(|t| !prefixes.iter().any(|p| t.starts_with(p.as_str())))
            .map(str::to_owned)
            .collect();
        exact.sort_unstable();
        exact.dedup();
        ClaimFilter { all: false, exact, prefixes }
    }

    /// Sets the migrations of the application's own tables, which `migrate` applies after the
    /// inbox's, with their own history table (see [`Migrations`]).
    pub fn migrations(&mut self, migrations: Migrations) -> &mut Self {
        self.migrations = Some(migrations);
        self
    }

    /// The application's own migrations, if any.
    pub fn app_migrations(&self) -> Option<&Migrations> {
        self.migrations.as_ref()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("event_types", &self.event_types())
            .field("ignored", &self.ignored)
            .field("migrations", &self.migrations)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    fn a_worker_claims_what_it_handles_or_ignores_and_handling_wins_over_ignoring() {
        let mut registry = Registry::with_invoice_handlers();
        let filter = registry.claim_filter();
        assert!(!filter.all);
        assert!(filter.claims("invoice.paid") && !filter.claims("customer.created"));
        assert!(filter.prefixes.is_empty());

        registry
            .ignore("customer.*")
            .ignore("customer.subscription.*")
            .ignore("customer.created")
            .ignore("charge.succeeded")
            .ignore("invoice.*");
        let filter = registry.claim_filter();
        // The narrower patterns are covered by customer.* and invoice.*; the handled invoice types
        // are claimed through the prefix; the stock health handler's type by name.
        assert_eq!(filter.prefixes, ["customer.", "invoice."]);
        assert_eq!(filter.exact, ["charge.succeeded", crate::health::EVENT_GENERATION_FAILURE_RESOLVED]);
        assert!(filter.claims("customer.subscription.created") && filter.claims("invoice.upcoming"));
        assert!(!filter.claims("charge.refunded") && !filter.claims("customerx.created"));
        assert!(registry.ignores("invoice.upcoming"), "no handler, a pattern matches");
        assert!(!registry.ignores("invoice.paid"), "a handled type is handled, whatever the patterns");

        registry.ignore("*");
        assert_eq!(registry.claim_filter(), ClaimFilter { all: true, ..ClaimFilter::default() });
        assert!(registry.ignores("anything.at_all") && !registry.ignores("invoice.paid"));
    }

    #[test]
    fn patterns_are_a_star_a_prefix_or_one_type() {
        let parse = |s: &str| s.parse::<EventTypePattern>();
        assert_eq!(parse("*"), Ok(EventTypePattern::Any));
        assert_eq!(parse(" customer.* "), Ok(EventTypePattern::Prefix("customer.".into())));
        assert_eq!(
            parse("v2.core.event_destination.ping"),
            Ok(EventTypePattern::Exact("v2.core.event_destination.ping".into()))
        );
        for bad in ["", "customer*", "*.created", "customer.*.created", "a b", ".*", "customer.%"] {
            let error = parse(bad).unwrap_err();
            assert!(error.contains("not an event-type pattern"), "{bad}: {error}");
        }
        assert_eq!(parse("customer.*").unwrap().to_string(), "customer.*");
    }

    #[test]
    #[should_panic(expected = "before its batch handler")]
    fn a_set_based_handler_needs_a_per_event_handler() {
        fn batch<'a>(_: &'a Transaction<'_>, _: &'a [&'a InboxEvent]) -> HandlerFuture<'a> {
            Box::pin(async { Ok(()) })
        }
        Registry::new().register_batch("customer.deleted", batch);
    }

    #[test]
    fn a_stateful_handler_and_a_function_register_side_by_side_and_clones_share_state() {
        struct Counting(Arc<AtomicUsize>);
        impl Handler for Counting {
            fn handle<'a>(&'a self, _: &'a Transaction<'_>, _: &'a InboxEvent) -> HandlerFuture<'a> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(()) })
            }
        }
        let seen = Arc::new(AtomicUsize::new(0));
        let mut registry = Registry::new();
        registry.register("customer.created", Counting(seen.clone())).register("customer.deleted", other);
        assert_eq!(registry.event_types(), ["customer.created", "customer.deleted"]);
        let copy = registry.clone();
        assert!(std::ptr::addr_eq(
            registry.get("customer.created").unwrap(),
            copy.get("customer.created").unwrap()
        ));
        assert_eq!(seen.load(Ordering::SeqCst), 0);
    }
}
