//! The invoice domain (seed 5.2, completed): a forward-only status machine, one ledger booking
//! per invoice, an outbox row only for a new booking, and reconciliation items for payments on
//! voided invoices.
//!
//! Status ranks: `draft < open < uncollectible < paid`, `void` terminal, and `paid` is never
//! voided (a payment is not undone by a late `invoice.voided`). Every event moves the invoice to
//! the higher of its current and its own status, creating it when absent, so any delivery order
//! of a lifecycle ends in the same state.

use deadpool_postgres::Transaction;

use std::collections::HashSet;

use super::{HandlerError, HandlerFuture, InboxEvent, Registry};

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

/// `invoice.paid`, in one round trip on the common path: upsert the invoice to `paid` unless it
/// is already `paid` or `void` (seed 5.2); read the status it has afterwards; when that is
/// `paid`, book the payment once (UNIQUE (invoice_id, kind) is the second line of defence against
/// the same payment sent as two Event objects) and write the outbox row only when the booking is
/// new — one statement, so status, ledger and outbox cannot disagree. Returns the status.
///
/// The row is locked by the upsert (updated or not), so the status stays true until commit. The
/// second branch of `current` reads the statement's snapshot: it misses a row another
/// transaction committed *during* this statement, and then no row comes back and nothing is
/// booked — [`STATUS_SQL`] reads the status with a fresh snapshot and [`BOOK_PAYMENT_SQL`] books.
pub const PAY_SQL: &str = "\
WITH paid AS (
    INSERT INTO invoices (id, customer_id, status, amount_paid, paid_at)
    VALUES ($1, $2, 'paid', $3, now())
    ON CONFLICT (id) DO UPDATE
       SET status = 'paid',
           amount_paid = EXCLUDED.amount_paid,
           paid_at = COALESCE(invoices.paid_at, EXCLUDED.paid_at),
           updated_at = now()
     WHERE invoices.status NOT IN ('paid', 'void')
    RETURNING status
), current AS (
    SELECT status FROM paid
    UNION ALL
    SELECT status FROM invoices WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM paid)
), booked AS (
    INSERT INTO ledger_entries (invoice_id, kind, amount)
    SELECT $1, 'payment', $3 FROM current WHERE status = 'paid'
    ON CONFLICT (invoice_id, kind) DO NOTHING
    RETURNING invoice_id, amount
), announced AS (
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
    SELECT 'Invoice', invoice_id, 'InvoicePaymentBooked',
           jsonb_build_object('invoice_id', invoice_id, 'amount', amount)
      FROM booked
)
SELECT status FROM current";

/// The common path of [`PAY_SQL`] for a set of `invoice.paid` events in one statement (`$1..$3`:
/// arrays of invoice id, customer id and amount, in the events' order): upsert each invoice to
/// `paid` unless it is already `paid` or `void`, and book those it moved (ledger once, outbox only
/// for a new booking). An invoice named by several events is paid and booked once, with the first
/// event's amount, as [`PAY_SQL`] run on each event in order does. Invoices are written in id
/// order, so two batches sharing invoices lock them in the same order. Returns the ids it moved
/// to `paid`; every other event (invoice already `paid` or `void`, or committed by another
/// transaction during the statement) is settled like [`PAY_SQL`]'s no-row case, with a fresh
/// snapshot. Deliberately no read of `invoices` beyond the upsert's own index lookups: a plan
/// cached while the table was small must not scan it once it is large.
pub const PAY_BATCH_SQL: &str = "\
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

/// `invoice.paid`, only when [`PAY_SQL`] returned no row: the status, with a fresh snapshot.
pub const STATUS_SQL: &str = "SELECT status FROM invoices WHERE id = $1";

/// `invoice.paid`, only when [`PAY_SQL`] returned no row and the fresh status is `paid`: book the
/// payment once and, only when the booking is new, write the outbox row (as [`PAY_SQL`] does).
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
    Box::pin(async move {
        let (id, customer, amount) = paid_fields(event)?;
        let pay = tx.prepare_cached(PAY_SQL).await?;
        let status = tx.query_opt(&pay, &[&id, &customer, &amount]).await?.map(|row| row.get(0));
        settle_payment(tx, event, id, amount, status).await
    })
}

/// `invoice.paid` for several events at once: [`PAY_BATCH_SQL`], then, per event it did not pay,
/// what the per-event handler does when its payment statement returns no row.
fn paid_batch<'a>(tx: &'a Transaction<'_>, events: &'a [&'a InboxEvent]) -> HandlerFuture<'a> {
    Box::pin(async move {
        let fields = events.iter().map(|e| paid_fields(e)).collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<&str> = fields.iter().map(|f| f.0).collect();
        let customers: Vec<&str> = fields.iter().map(|f| f.1).collect();
        let amounts: Vec<i64> = fields.iter().map(|f| f.2).collect();
        let pay = tx.prepare_cached(PAY_BATCH_SQL).await?;
        let paid: HashSet<String> =
            tx.query(&pay, &[&ids, &customers, &amounts]).await?.into_iter().map(|row| row.get(0)).collect();
        for (event, (id, _, amount)) in events.iter().zip(&fields) {
            let status = paid.contains(*id).then(|| "paid".to_owned());
            settle_payment(tx, event, id, *amount, status).await?;
        }
        Ok(())
    })
}

/// The rest of `invoice.paid` once the payment statement ran and returned `status` — after which
/// a `paid` invoice is booked. `None`: the invoice was committed by another transaction during
/// that statement; read its status with a fresh snapshot and book it here if it is `paid`.
async fn settle_payment(
    tx: &Transaction<'_>,
    event: &InboxEvent,
    id: &str,
    amount: i64,
    status: Option<String>,
) -> Result<(), HandlerError> {
    let (status, booked) = match status {
        Some(status) => (status, true),
        None => {
            let status_stmt = tx.prepare_cached(STATUS_SQL).await?;
            (tx.query_one(&status_stmt, &[&id]).await?.get(0), false)
        }
    };
    match status.as_str() {
        "paid" => {
            if !booked {
                let book = tx.prepare_cached(BOOK_PAYMENT_SQL).await?;
                tx.execute(&book, &[&id, &amount]).await?;
            }
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
