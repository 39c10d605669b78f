//! The invoice business: a handler set like any application's own, registered by
//! [`Registry::with_invoice_handlers`]. A forward-only status machine, one ledger booking per
//! invoice, an outbox row only for a new booking, and reconciliation items for payments on voided
//! invoices.
//!
//! Status ranks: `draft < open < uncollectible < paid`, `void` terminal, and `paid` is never
//! voided (a payment is not undone by a late `invoice.voided`). Every event moves the invoice to
//! the higher of its current and its own status, creating it when absent, so any delivery order
//! of a lifecycle ends in the same state.

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

/// `invoice.created`: insert if absent, with the payload's status when it is `draft` or `open`
/// (`draft` otherwise); never changes an existing invoice.
pub const INSERT_IF_ABSENT_SQL: &str = "\
INSERT INTO invoices (id, customer_id, status)
VALUES ($1, $2, $3)
ON CONFLICT (id) DO NOTHING";

/// Moves an invoice forward to `$3` (creating it when absent). The WHERE is the transition rule:
/// only to a higher rank, never out of `void`, never from `paid` to `void`.
pub const ADVANCE_SQL: &str = "\
INSERT INTO invoices (id, customer_id, status)
VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE
   SET status = EXCLUDED.status, updated_at = now()
 WHERE array_position(ARRAY['draft','open','uncollectible','paid','void'], EXCLUDED.status)
     > array_position(ARRAY['draft','open','uncollectible','paid','void'], invoices.status)
   AND invoices.status <> 'void'
   AND NOT (invoices.status = 'paid' AND EXCLUDED.status = 'void')";

/// `invoice.paid`, one statement for one event or a whole batch (`$1..$3`: arrays of invoice id,
/// customer id and amount, in the events' order): upsert each invoice to `paid` unless it is
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
    SELECT DISTINCT ON (id) id, customer_id, amount
      FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS e(id, customer_id, amount, n)
     ORDER BY id, n
), paid AS (
    INSERT INTO invoices (id, customer_id, status, amount_paid, paid_at)
    SELECT id, customer_id, 'paid', amount, now() FROM input ORDER BY id
    ON CONFLICT (id) DO UPDATE
       SET status = 'paid',
           amount_paid = EXCLUDED.amount_paid,
           paid_at = COALESCE(invoices.paid_at, EXCLUDED.paid_at),
           updated_at = now()
     WHERE invoices.status NOT IN ('paid', 'void')
    RETURNING id
), booked AS (
    INSERT INTO ledger_entries (invoice_id, kind, amount)
    SELECT paid.id, 'payment', input.amount
      FROM paid JOIN input ON input.id = paid.id
     ORDER BY paid.id
    ON CONFLICT (invoice_id, kind) DO NOTHING
    RETURNING invoice_id, amount
), announced AS (
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
    SELECT 'Invoice', invoice_id, 'InvoicePaymentBooked',
           jsonb_build_object('invoice_id', invoice_id, 'amount', amount)
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
    INSERT INTO ledger_entries (invoice_id, kind, amount)
    VALUES ($1, 'payment', $2)
    ON CONFLICT (invoice_id, kind) DO NOTHING
    RETURNING invoice_id, amount
)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'Invoice', invoice_id, 'InvoicePaymentBooked',
       jsonb_build_object('invoice_id', invoice_id, 'amount', amount)
  FROM booked";

/// `invoice.paid` on a voided invoice: book nothing, record it for a person once per event.
pub const RECONCILE_SQL: &str = "\
INSERT INTO reconciliation_items (invoice_id, event_id, reason, detail)
SELECT $1, $2, 'payment_on_void_invoice', jsonb_build_object('amount_paid', $3::bigint, 'endpoint', $4::text)
 WHERE NOT EXISTS (SELECT 1 FROM reconciliation_items
                    WHERE invoice_id = $1 AND event_id = $2 AND reason = 'payment_on_void_invoice')";

fn created<'a>(tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async move {
        let id = event.object_str("id")?;
        let customer = event.object_str("customer")?;
        let status = match event.object_str("status") {
            Ok("open") => "open",
            _ => "draft",
        };
        let stmt = tx.prepare_cached(INSERT_IF_ABSENT_SQL).await?;
        tx.execute(&stmt, &[&id, &customer, &status]).await?;
        Ok(())
    })
}

async fn advance(tx: &Transaction<'_>, event: &InboxEvent, status: &str) -> Result<(), HandlerError> {
    let id = event.object_str("id")?;
    let customer = event.object_str("customer")?;
    let stmt = tx.prepare_cached(ADVANCE_SQL).await?;
    tx.execute(&stmt, &[&id, &customer, &status]).await?;
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

/// The fields `invoice.paid` needs: invoice id, customer id, amount (never negative).
fn paid_fields(event: &InboxEvent) -> Result<(&str, &str, i64), HandlerError> {
    let id = event.object_str("id")?;
    let customer = event.object_str("customer")?;
    let amount = event.object_i64("amount_paid")?;
    if amount < 0 {
        return Err(HandlerError::Payload("data.object.amount_paid is negative".into()));
    }
    Ok((id, customer, amount))
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
    let ids: Vec<&str> = fields.iter().map(|f| f.0).collect();
    let customers: Vec<&str> = fields.iter().map(|f| f.1).collect();
    let amounts: Vec<i64> = fields.iter().map(|f| f.2).collect();
    let stmt = tx.prepare_cached(PAY_SQL).await?;
    let paid: HashSet<String> =
        tx.query(&stmt, &[&ids, &customers, &amounts]).await?.into_iter().map(|row| row.get(0)).collect();
    for (event, (id, _, amount)) in events.iter().zip(&fields) {
        if !paid.contains(*id) {
            settle_payment(tx, event, id, *amount).await?;
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
    id: &str,
    amount: i64,
) -> Result<(), HandlerError> {
    let status_stmt = tx.prepare_cached(STATUS_SQL).await?;
    let status: String = tx.query_one(&status_stmt, &[&id]).await?.get(0);
    match status.as_str() {
        "paid" => {
            let book = tx.prepare_cached(BOOK_PAYMENT_SQL).await?;
            tx.execute(&book, &[&id, &amount]).await?;
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
