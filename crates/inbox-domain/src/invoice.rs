//! The invoice business: a handler set like any application's own, registered by
//! [`Registry::with_invoice_handlers`]. A forward-only status machine, one ledger booking per
//! invoice, an outbox row only for a new booking, and reconciliation items for payments on voided
//! invoices.
//!
//! Status ranks: `draft < open < uncollectible < paid`, `void` terminal, and `paid` is never
//! voided (a payment is not undone by a late `invoice.voided`). Every event moves the invoice to
//! the higher of its current and its own status, creating it when absent, so any delivery order
//! of a lifecycle ends in the same state.
//!
//! The fields read, against the nullability of Stripe's invoice schema (checked with the invoice
//! fixture of Stripe's OpenAPI repository and its Accounts v2 variant in `tests/e2e/stripe_shapes.rs`):
//! `id` (string, never null) and `amount_paid` (integer, never null) are required — a payload
//! without them is malformed and fails; `customer` and `customer_account` (nullable: under
//! Accounts v2 `customer` is null and `customer_account` names the payer) are recorded as they come;
//! `status` (nullable) only matters to `invoice.created`, which records the one it carries (`draft`
//! when null or not one of the five); `currency` (a string in Stripe's schema) goes to the invoice,
//! its ledger entry and the outbox row, so that an amount always says what money it is;
//! `amount_due` and `total` (integers) are recorded by `invoice.created`; and
//! `status_transitions.paid_at` (nullable, unix seconds) is when Stripe says the invoice was paid —
//! the invoice's `paid_at`, the processing time only when the event does not say.

use std::collections::HashSet;

use deadpool_postgres::Transaction;

use crate::handler::{HandlerError, HandlerFuture, Registry};
use crate::inbox::event::InboxEvent;

/// Registers the five invoice handlers.
pub fn register(registry: &mut Registry) {
    registry
        .register("invoice.created", created)
        .register("invoice.finalized", finalized)
        .register("invoice.paid", paid)
        .register("invoice.voided", voided)
        .register("invoice.marked_uncollectible", marked_uncollectible)
        .register_batch("invoice.paid", paid_batch);
}

/// `invoice.created`: insert if absent, with what the event carries — its status (one of the five;
/// `draft` otherwise), currency and amounts (`$5` currency, `$6` amount_due, `$7` total, `$8`
/// amount_paid); never changes an existing invoice.
pub const INSERT_IF_ABSENT_SQL: &str = "\
INSERT INTO invoices (id, customer_id, customer_account, status, currency, amount_due, total, amount_paid)
VALUES ($1, $2, $4, $3, $5, $6, $7, COALESCE($8::int8, 0))
ON CONFLICT (id) DO NOTHING";

/// Moves an invoice forward to `$3` (creating it when absent, with the event's currency `$5`). The
/// WHERE is the transition rule: only to a higher rank, never out of `void`, never from `paid` to
/// `void`.
pub const ADVANCE_SQL: &str = "\
INSERT INTO invoices (id, customer_id, customer_account, status, currency)
VALUES ($1, $2, $4, $3, $5)
ON CONFLICT (id) DO UPDATE
   SET status = EXCLUDED.status, currency = COALESCE(invoices.currency, EXCLUDED.currency), updated_at = now()
 WHERE array_position(ARRAY['draft','open','uncollectible','paid','void'], EXCLUDED.status)
     > array_position(ARRAY['draft','open','uncollectible','paid','void'], invoices.status)
   AND invoices.status <> 'void'
   AND NOT (invoices.status = 'paid' AND EXCLUDED.status = 'void')";

/// `invoice.paid`, one statement for one event or a whole batch (`$1..$6`: arrays of invoice id,
/// customer id, amount, customer account, currency, and the time Stripe says it was paid —
/// `status_transitions.paid_at`, unix seconds, NULL when the event does not say, then the
/// processing time — in the events' order): upsert each invoice to `paid` unless it is
/// already `paid` or `void`, and book those it moved — ledger once (UNIQUE (invoice_id,
/// kind) is the second line of defence against the same payment sent as two Event objects), the
/// outbox row only for a new booking — so status, ledger and outbox cannot disagree. An invoice
/// named by several events is paid and booked once, with the first event's amount, as running
/// the events one at a time does. Invoices are written in id order, so two batches sharing
/// invoices lock them in the same order. Returns the ids it moved to `paid`; for every other event
/// (invoice already `paid` or `void`, or committed by another transaction during the statement)
/// [`STATUS_SQL`] reads the status with a fresh snapshot, then [`BOOK_PAYMENT_SQL`] or
/// [`RECONCILE_SQL`] follows. Deliberately no read of `invoices` beyond the upsert's own index
/// lookups: a plan cached while the table was small must not scan it once it is large.
pub const PAY_SQL: &str = "\
WITH input AS (
    SELECT DISTINCT ON (id) id, customer_id, customer_account, amount, currency,
           COALESCE(to_timestamp(paid_at), now()) AS paid_at
      FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::bigint[])
           WITH ORDINALITY AS e(id, customer_id, amount, customer_account, currency, paid_at, n)
     ORDER BY id, n
), paid AS (
    INSERT INTO invoices (id, customer_id, customer_account, status, amount_paid, paid_at, currency)
    SELECT id, customer_id, customer_account, 'paid', amount, paid_at, currency FROM input ORDER BY id
    ON CONFLICT (id) DO UPDATE
       SET status = 'paid',
           amount_paid = EXCLUDED.amount_paid,
           paid_at = EXCLUDED.paid_at,
           currency = COALESCE(invoices.currency, EXCLUDED.currency),
           updated_at = now()
     WHERE invoices.status NOT IN ('paid', 'void')
    RETURNING id
), booked AS (
    INSERT INTO ledger_entries (invoice_id, kind, amount, currency)
    SELECT paid.id, 'payment', input.amount, input.currency
      FROM paid JOIN input ON input.id = paid.id
     ORDER BY paid.id
    ON CONFLICT (invoice_id, kind) DO NOTHING
    RETURNING invoice_id, amount, currency
), announced AS (
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
    SELECT 'Invoice', invoice_id, 'InvoicePaymentBooked',
           jsonb_build_object('invoice_id', invoice_id, 'amount', amount, 'currency', currency)
      FROM booked
)
SELECT id FROM paid";

/// `invoice.paid`, for an event whose invoice [`PAY_SQL`] did not move: the status, with a fresh
/// snapshot.
pub const STATUS_SQL: &str = "SELECT status FROM invoices WHERE id = $1";

/// `invoice.paid`, when [`PAY_SQL`] did not move the invoice and the fresh status is `paid`: book
/// the payment once and, only when the booking is new, write the outbox row (as [`PAY_SQL`] does).
pub const BOOK_PAYMENT_SQL: &str = "\
WITH booked AS (
    INSERT INTO ledger_entries (invoice_id, kind, amount, currency)
    VALUES ($1, 'payment', $2, $3)
    ON CONFLICT (invoice_id, kind) DO NOTHING
    RETURNING invoice_id, amount, currency
)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'Invoice', invoice_id, 'InvoicePaymentBooked',
       jsonb_build_object('invoice_id', invoice_id, 'amount', amount, 'currency', currency)
  FROM booked";

/// `invoice.paid` on a voided invoice: book nothing, record it for a person once per event.
pub const RECONCILE_SQL: &str = "\
INSERT INTO reconciliation_items (invoice_id, event_id, reason, detail)
SELECT $1, $2, 'payment_on_void_invoice', jsonb_build_object('amount_paid', $3::bigint, 'endpoint', $4::text)
 WHERE NOT EXISTS (SELECT 1 FROM reconciliation_items
                    WHERE invoice_id = $1 AND event_id = $2 AND reason = 'payment_on_void_invoice')";

/// Who is billed: `customer` (a Customer), or `customer_account` under Accounts v2, where
/// `customer` is null. Both are nullable in Stripe's schema; an invoice is recorded and booked
/// whichever is present (the ledger does not need the payer). A field of another type than a
/// string is a malformed payload.
fn payer(event: &InboxEvent) -> Result<(Option<&str>, Option<&str>), HandlerError> {
    Ok((event.object_opt_str("customer")?, event.object_opt_str("customer_account")?))
}

/// An integer field of the invoice the event carries, None when absent or not an integer.
fn object_amount(event: &InboxEvent, field: &str) -> Option<i64> {
    event.object_i64(field).ok()
}

fn created<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async move {
        let id = event.object_str("id")?;
        let (customer, account) = payer(event)?;
        // `status` is nullable: the one the event carries when it is one of ours, else draft.
        let status = match event.object_opt_str("status") {
            Ok(Some(status @ ("draft" | "open" | "paid" | "uncollectible" | "void"))) => status,
            _ => "draft",
        };
        let currency = event.object_opt_str("currency").ok().flatten();
        let (due, total, paid) = (
            object_amount(event, "amount_due"),
            object_amount(event, "total"),
            object_amount(event, "amount_paid"),
        );
        let stmt = tx.prepare_cached(INSERT_IF_ABSENT_SQL).await?;
        tx.execute(&stmt, &[&id, &customer, &status, &account, &currency, &due, &total, &paid]).await?;
        Ok(())
    })
}

async fn advance(tx: &Transaction<'_>, event: &InboxEvent, status: &str) -> Result<(), HandlerError> {
    let id = event.object_str("id")?;
    let (customer, account) = payer(event)?;
    let currency = event.object_opt_str("currency").ok().flatten();
    let stmt = tx.prepare_cached(ADVANCE_SQL).await?;
    tx.execute(&stmt, &[&id, &customer, &status, &account, &currency]).await?;
    Ok(())
}

fn finalized<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(advance(tx, event, "open"))
}

fn voided<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(advance(tx, event, "void"))
}

fn marked_uncollectible<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(advance(tx, event, "uncollectible"))
}

/// The fields `invoice.paid` needs: invoice id, amount (never negative), the payer, the currency
/// and when Stripe says it was paid.
struct PaidFields<'a> {
    id: &'a str,
    amount: i64,
    customer: Option<&'a str>,
    account: Option<&'a str>,
    currency: Option<&'a str>,
    /// `status_transitions.paid_at`, unix seconds.
    paid_at: Option<i64>,
}

fn paid_fields(event: &InboxEvent) -> Result<PaidFields<'_>, HandlerError> {
    let id = event.object_str("id")?;
    let (customer, account) = payer(event)?;
    let amount = event.object_i64("amount_paid")?;
    if amount < 0 {
        return Err(HandlerError::Payload("data.object.amount_paid is negative".into()));
    }
    let currency = event.object_opt_str("currency")?;
    let paid_at = stripe_paid_at(event);
    Ok(PaidFields { id, amount, customer, account, currency, paid_at })
}

/// `data.object.status_transitions.paid_at` (unix seconds): when Stripe says the invoice was
/// paid. None when absent, null or not an integer (the booking then takes the processing time).
/// Read apart from the accessors, which keep only the object's top-level fields.
fn stripe_paid_at(event: &InboxEvent) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct Event {
        data: Data,
    }
    #[derive(serde::Deserialize)]
    struct Data {
        object: Object,
    }
    #[derive(serde::Deserialize)]
    struct Object {
        status_transitions: Option<Transitions>,
    }
    #[derive(serde::Deserialize)]
    struct Transitions {
        paid_at: Option<i64>,
    }
    serde_json::from_str::<Event>(event.payload.get()).ok()?.data.object.status_transitions?.paid_at
}

fn paid<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async move { pay(tx, &[event]).await })
}

/// `invoice.paid` for several events at once: the same statement as for one.
fn paid_batch<'a>(tx: &'a Transaction<'_>, events: &'a [&'a InboxEvent]) -> HandlerFuture<'a> {
    Box::pin(pay(tx, events))
}

/// [`PAY_SQL`] for `events`, then, per event whose invoice it did not move, the fresh-snapshot path.
async fn pay(tx: &Transaction<'_>, events: &[&InboxEvent]) -> Result<(), HandlerError> {
    let fields = events.iter().map(|e| paid_fields(e)).collect::<Result<Vec<_>, _>>()?;
    let ids: Vec<&str> = fields.iter().map(|f| f.id).collect();
    let customers: Vec<Option<&str>> = fields.iter().map(|f| f.customer).collect();
    let amounts: Vec<i64> = fields.iter().map(|f| f.amount).collect();
    let accounts: Vec<Option<&str>> = fields.iter().map(|f| f.account).collect();
    let currencies: Vec<Option<&str>> = fields.iter().map(|f| f.currency).collect();
    let paid_ats: Vec<Option<i64>> = fields.iter().map(|f| f.paid_at).collect();
    let stmt = tx.prepare_cached(PAY_SQL).await?;
    let paid: HashSet<String> = tx
        .query(&stmt, &[&ids, &customers, &amounts, &accounts, &currencies, &paid_ats])
        .await?
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    for (event, f) in events.iter().zip(&fields) {
        if !paid.contains(f.id) {
            settle_payment(tx, event, f).await?;
        }
    }
    Ok(())
}

/// The rest of `invoice.paid` for an event whose invoice [`PAY_SQL`] did not move (already `paid`
/// or `void`, or committed by another transaction during that statement): the status with a fresh
/// snapshot, then book a `paid` invoice (once) or record a payment on a `void` one.
async fn settle_payment(
    tx: &Transaction<'_>,
    event: &InboxEvent,
    f: &PaidFields<'_>,
) -> Result<(), HandlerError> {
    let (id, amount) = (f.id, f.amount);
    let status_stmt = tx.prepare_cached(STATUS_SQL).await?;
    let status: String = tx.query_one(&status_stmt, &[&id]).await?.get(0);
    match status.as_str() {
        "paid" => {
            let book = tx.prepare_cached(BOOK_PAYMENT_SQL).await?;
            tx.execute(&book, &[&id, &amount, &f.currency]).await?;
        }
        "void" => {
            let reconcile = tx.prepare_cached(RECONCILE_SQL).await?;
            tx.execute(&reconcile, &[&id, &event.event_id, &amount, &event.endpoint]).await?;
        }
        other => {
            return Err(HandlerError::Other(format!("invoice {id} is {other} after invoice.paid")));
        }
    }
    Ok(())
}
