//! The subscription business: which Stripe subscriptions of this product exist, and whether each
//! is pending, live or ended — a forward-only state machine in the style of the stock invoice
//! handlers, driven by `customer.subscription.created`, `.updated` and `.deleted`.
//!
//! # Why a coarse stage and not Stripe's `status`
//! Stripe does not deliver events in order, redelivers them, and may send one fact as two Event
//! objects; an event's `created` is not an order either (two events can share a second, and a
//! retried delivery of an old event arrives after a newer one). A handler can therefore only keep
//! what every delivery order agrees on. Stripe's `status` moves back and forth (`active` →
//! `past_due` → `active` again, `paused` ↔ `active`): from the events alone, nothing tells the
//! last `active` from the last `past_due`. The stage keeps only the part of the lifecycle that
//! never goes back — a subscription is first `pending` (its first payment is not made), then
//! `live` (the customer has the product), then `ended` for good — and every event moves the row
//! to the higher of its stage and the event's own. Any order of any subset of the events, with
//! any duplicates, ends in the same row.
//!
//! A feature that needs the exact current status (dunning e-mails for `past_due`, say) fetches the
//! subscription from Stripe's API *after* the event is processed — from a job fed by the outbox
//! or by this table — never inside the handler: the handler runs in the worker's transaction,
//! holding row locks, and must not call the network.
//!
//! # Which subscriptions
//! One Stripe account often sells several products. A [`SubscriptionHandler`] is configured with
//! the price ids this product sells ([`Prices`], from `SUBSCRIPTION_PRICES`); an event whose
//! subscription has none of them among its items is someone else's and is processed with no
//! effect. The rule looks at each event's own snapshot only, which keeps it order-independent —
//! and has a consequence: a subscription moved entirely to another product's prices stays at the
//! stage its last matching event gave it (reconcile such moves from Stripe's API if they happen).

use std::collections::BTreeSet;
use std::sync::Arc;

use inbox_worker::prelude::*;
use serde::Deserialize;

/// The event types the handler is registered for.
pub const EVENT_TYPES: [&str; 3] =
    ["customer.subscription.created", "customer.subscription.updated", "customer.subscription.deleted"];

/// The event that always means the subscription ended, whatever its payload's `status` says.
const DELETED: &str = "customer.subscription.deleted";

/// The environment variable that configures [`Prices`].
pub const PRICES_ENV: &str = "SUBSCRIPTION_PRICES";

/// Moves a subscription forward to stage `$3` (creating it when absent), in one statement so
/// concurrent events on one subscription serialise on its row. The WHERE is the whole transition
/// rule: only to a higher rank (`pending < live < ended`), so `ended` is terminal and a duplicate
/// or a late, older event changes nothing. `ended_at` is set by the statement that moves the row
/// to `ended` — from `$4` (unix seconds: the payload's `ended_at`, else `canceled_at`), else the
/// transaction's time — and never after: an ended row never moves again (and the COALESCE keeps
/// a set `ended_at` even if the rule were loosened). `customer` is the first event's; a
/// subscription never changes customer.
pub const ADVANCE_SQL: &str = "\
INSERT INTO subscriptions (id, customer, stage, ended_at)
VALUES ($1, $2, $3::text,
        CASE WHEN $3::text = 'ended' THEN COALESCE(to_timestamp($4::bigint), now()) END)
ON CONFLICT (id) DO UPDATE
   SET stage = EXCLUDED.stage,
       ended_at = COALESCE(subscriptions.ended_at, EXCLUDED.ended_at),
       updated_at = now()
 WHERE array_position(ARRAY['pending','live','ended'], EXCLUDED.stage)
     > array_position(ARRAY['pending','live','ended'], subscriptions.stage)";

/// Where a subscription is in its life, as far as events can tell (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Created, first payment not made (`incomplete`).
    Pending,
    /// The customer has the product, paying or not yet (`trialing`, `active`, `past_due`,
    /// `unpaid`, `paused`).
    Live,
    /// Over for good (`canceled`, `incomplete_expired`, or deleted).
    Ended,
}

impl Stage {
    /// The stage of a Stripe subscription `status`; None for a status this code does not know
    /// (Stripe adds some from time to time: a person decides where it goes).
    pub fn of_status(status: &str) -> Option<Stage> {
        match status {
            "incomplete" => Some(Stage::Pending),
            "trialing" | "active" | "past_due" | "unpaid" | "paused" => Some(Stage::Live),
            "canceled" | "incomplete_expired" => Some(Stage::Ended),
            _ => None,
        }
    }

    /// The value stored in `subscriptions.stage`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Pending => "pending",
            Stage::Live => "live",
            Stage::Ended => "ended",
        }
    }
}

/// The subscriptions this product tracks: every one, or those with an item at one of these
/// Stripe price ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prices {
    All,
    Only(BTreeSet<String>),
}

impl Prices {
    /// From [`PRICES_ENV`]: unset means every subscription; otherwise [`Prices::parse`]. The error
    /// names the variable and says what is wrong.
    pub fn from_env() -> Result<Prices, String> {
        match std::env::var(PRICES_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Prices::All),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{PRICES_ENV} is not valid UTF-8")),
            Ok(value) => Prices::parse(&value).map_err(|e| format!("{PRICES_ENV}: {e}")),
        }
    }

    /// A comma-separated list of price ids (`price_123,price_456`; spaces around items are
    /// ignored). Refuses an empty list and empty items (a stray comma is a typo, not "every
    /// subscription"), and items with spaces or control characters inside (no Stripe id has
    /// them). No `price_` prefix is required: a legacy plan's price id is the plan's own id.
    pub fn parse(value: &str) -> Result<Prices, String> {
        const EXPECTED: &str = "expected comma-separated Stripe price ids such as price_123,price_456, \
                                or leave it unset to track every subscription";
        if value.trim().is_empty() {
            return Err(format!("is set but empty; {EXPECTED}"));
        }
        let mut prices = BTreeSet::new();
        for (n, item) in value.split(',').map(str::trim).enumerate() {
            if item.is_empty() {
                return Err(format!("item {} of {value:?} is empty; {EXPECTED}", n + 1));
            }
            if !item.chars().all(|c| c.is_ascii_graphic()) {
                return Err(format!(
                    "item {} ({item:?}) is not a Stripe price id (ASCII letters, digits and \
                     punctuation only); {EXPECTED}",
                    n + 1
                ));
            }
            prices.insert(item.to_owned());
        }
        Ok(Prices::Only(prices))
    }
}

/// The handler of the three subscription event types: one value, cloned into each registration,
/// sharing its configuration.
#[derive(Debug, Clone)]
pub struct SubscriptionHandler {
    prices: Arc<Prices>,
}

impl SubscriptionHandler {
    pub fn new(prices: Prices) -> Self {
        SubscriptionHandler { prices: Arc::new(prices) }
    }

    /// Whether this product tracks the subscription: with [`Prices::All`] without reading the
    /// items, else when one of its items' `price.id` is configured.
    fn tracks(&self, event: &InboxEvent) -> Result<bool, HandlerError> {
        let Prices::Only(prices) = &*self.prices else {
            return Ok(true);
        };
        let items = nested(event)?.items.ok_or_else(|| {
            HandlerError::Payload("data.object.items is missing: cannot tell which prices it is for".into())
        })?;
        if items.data.iter().filter_map(|item| item.price.as_ref()).any(|price| prices.contains(&price.id)) {
            return Ok(true);
        }
        if items.has_more {
            // The rest of the list is not in the event: guessing either way could drop or
            // invent a subscription, so a person looks (the row parks after its retries).
            return Err(HandlerError::Payload(format!(
                "data.object.items lists {} items, none at a configured price, and has more that \
                 the event does not carry: cannot tell whether this product sells it",
                items.data.len()
            )));
        }
        Ok(false)
    }
}

impl Handler for SubscriptionHandler {
    fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
        Box::pin(async move {
            if !self.tracks(event)? {
                return Ok(()); // another product's subscription: processed, no effect
            }
            let id = event.object_str("id")?;
            let stage = if event.event_type == DELETED {
                Stage::Ended
            } else {
                let status = event.object_str("status")?;
                Stage::of_status(status).ok_or_else(|| {
                    HandlerError::Payload(format!(
                        "data.object.status {status:?} is not a subscription status this handler \
                         knows: map it to a stage in Stage::of_status, then requeue"
                    ))
                })?
            };
            // Accounts v2: the payer is a customer account, and `customer` is null.
            let customer = match event.object_opt_str("customer")? {
                Some(customer) => customer,
                None => event.object_opt_str("customer_account")?.ok_or_else(|| {
                    HandlerError::Payload(
                        "data.object.customer and data.object.customer_account are both null: \
                         the subscription has no payer to record"
                            .into(),
                    )
                })?,
            };
            let ended_at = match stage {
                Stage::Ended => {
                    let object = nested(event)?;
                    object.ended_at.or(object.canceled_at)
                }
                _ => None,
            };
            let stmt = tx.prepare_cached(ADVANCE_SQL).await?;
            tx.execute(&stmt, &[&id, &customer, &stage.as_str(), &ended_at]).await?;
            Ok(())
        })
    }
}

/// The nested and nullable fields of `data.object` the accessors do not read.
#[derive(Deserialize)]
struct Subscription {
    #[serde(default)]
    items: Option<List<Item>>,
    #[serde(default)]
    ended_at: Option<i64>,
    #[serde(default)]
    canceled_at: Option<i64>,
}

#[derive(Deserialize)]
struct List<T> {
    data: Vec<T>,
    #[serde(default)]
    has_more: bool,
}

#[derive(Deserialize)]
struct Item {
    #[serde(default)]
    price: Option<Price>,
}

#[derive(Deserialize)]
struct Price {
    id: String,
}

/// Parses [`Subscription`] out of the event (serde skips every other field).
fn nested(event: &InboxEvent) -> Result<Subscription, HandlerError> {
    #[derive(Deserialize)]
    struct Event {
        data: Data,
    }
    #[derive(Deserialize)]
    struct Data {
        object: Subscription,
    }
    serde_json::from_str::<Event>(event.payload.get())
        .map(|e| e.data.object)
        .map_err(|e| HandlerError::Payload(format!("data.object is not a subscription: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stripe_status_has_a_stage_and_the_stages_are_ordered() {
        let stage = |s| Stage::of_status(s).unwrap();
        assert_eq!(stage("incomplete"), Stage::Pending);
        for s in ["trialing", "active", "past_due", "unpaid", "paused"] {
            assert_eq!(stage(s), Stage::Live, "{s}");
        }
        assert_eq!(stage("canceled"), Stage::Ended);
        assert_eq!(stage("incomplete_expired"), Stage::Ended);
        assert_eq!(Stage::of_status("on_hold"), None);
        assert!(Stage::Pending < Stage::Live && Stage::Live < Stage::Ended);
    }

    #[test]
    fn the_price_list_accepts_ids_and_refuses_typos_with_a_reason() {
        assert_eq!(
            Prices::parse(" price_a , gold-monthly").unwrap(),
            Prices::Only(["price_a".to_owned(), "gold-monthly".to_owned()].into())
        );
        for (value, reason) in [
            ("", "set but empty"),
            ("  ", "set but empty"),
            (",,", "item 1 of \",,\" is empty"),
            ("price_a,", "item 2"),
            ("price a", "not a Stripe price id"),
            ("price_\u{e9}", "not a Stripe price id"),
        ] {
            let error = Prices::parse(value).unwrap_err();
            assert!(error.contains(reason) && error.contains("price_123,price_456"), "{value:?}: {error}");
        }
    }
}
