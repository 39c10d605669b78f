//! The worker's three transactions against a real PostgreSQL: every way an event can arrive or
//! fail — twice, concurrently, out of order, while a worker dies or its lease expires, from a
//! handler that errs, panics or times out — ends with its effect applied exactly once.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use inbox_domain::db::Pooler;
use inbox_domain::handler::{HandlerFuture, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::queue::{self, Failure};
use inbox_test_support::db::{
    buffers_read, column, explain_rolled_back, hold_snapshot, in_batches_of_64, other_scans, scalar,
    slow_writes, timestamptz_literal,
};
use inbox_test_support::events::{invoice_event, invoice_paid};
use inbox_test_support::worker::{claim, claim_for, eventually, execute, pool, store_event, test_limits};
use inbox_test_support::TestDb;
use inbox_worker::completer::FailureRecord;
use inbox_worker::executor::Outcome;

const LEASE: Duration = Duration::from_secs(30);

fn invoices() -> Registry {
    Registry::with_invoice_handlers()
}

/// Claims what `registry` claims and executes everything ready of it, one row at a time; returns
/// the outcomes.
async fn drain(pool: &deadpool_postgres::Pool, registry: &Registry) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    loop {
        let rows = claim_for(pool, registry, 1, LEASE, 10).await;
        let Some(row) = rows.first() else { return outcomes };
        outcomes.push(execute(pool, registry, row, &test_limits(Duration::from_secs(5))).await);
    }
}

/// Claims what is ready once and executes it (no second round: a failed row whose random
/// backoff happens to be ~0 s must not be retried within the same assertion).
async fn run_once(pool: &deadpool_postgres::Pool, registry: &Registry) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    for row in claim(pool, 100, LEASE, 10).await {
        outcomes.push(execute(pool, registry, &row, &test_limits(Duration::from_secs(5))).await);
    }
    outcomes
}

#[tokio::test]
async fn the_claim_counts_the_attempt_and_leases_the_row_before_any_work() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let pool = pool(&db, 2);
    let claimed = claim(&pool, 10, LEASE, 10).await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].attempts, 1);
    // Committed: another session sees the attempt and the lease, and cannot claim the row.
    let row = client
        .query_one("SELECT attempts, available_at > now() + interval '25 seconds', processed_at IS NULL FROM webhook_inbox", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    assert!(row.get::<_, bool>(1), "leased for the lease duration");
    assert!(row.get::<_, bool>(2));
    assert!(claim(&pool, 10, LEASE, 10).await.is_empty(), "a leased row is not claimed again");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 0);
}

/// The claim runs under a server-side statement timeout shorter than the worker's own deadline:
/// a claim slower than it is abandoned by the server and leases nothing, so a worker that stopped
/// waiting never leaves rows leased to nobody; the connection is left outside any transaction.
#[tokio::test]
async fn a_claim_over_its_server_side_timeout_leases_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    slow_writes(&client, "webhook_inbox", "BEFORE UPDATE", 2.0).await;
    let pool = pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let started = std::time::Instant::now();
    let error = queue::claim(
        &conn,
        Pooler::None,
        &inbox_test_support::worker::EVERY_TYPE,
        None,
        10,
        10,
        i64::MAX,
        LEASE,
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert_eq!(error.code(), Some(&tokio_postgres::error::SqlState::QUERY_CANCELED), "{error}");
    assert!(started.elapsed() < Duration::from_millis(1500), "the server gave up, not the trigger");
    let row =
        client.query_one("SELECT attempts, available_at <= now() FROM webhook_inbox", &[]).await.unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (0, true), "no attempt counted, no lease");
    let timeout: String =
        conn.query_one("SELECT current_setting('statement_timeout')", &[]).await.unwrap().get(0);
    assert_eq!(timeout, "0", "the claim's limits ended with its transaction");

    client.batch_execute("DROP TRIGGER slow ON webhook_inbox").await.unwrap();
    let claimed = queue::claim(
        &conn,
        Pooler::None,
        &inbox_test_support::worker::EVERY_TYPE,
        None,
        10,
        10,
        i64::MAX,
        LEASE,
        Duration::from_millis(300),
    )
    .await
    .unwrap();
    assert_eq!(claimed.claimed.len(), 1, "the same connection claims once the fault is gone");
}

/// A claim takes rows while the payload bytes before them stay under its budget — at least one
/// row, at most one row over — so a worker's memory follows the bytes it holds, not the count.
/// A row stored without `payload_bytes` is measured from its text.
#[tokio::test]
async fn a_claim_stops_at_its_byte_budget_and_always_takes_one_row() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for i in 0..5 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100)).await;
    }
    client.batch_execute("UPDATE webhook_inbox SET payload_bytes = 100000").await.unwrap();
    let pool = pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let claim = |limit: i64, budget: i64| {
        let conn = &conn;
        async move {
            queue::claim(
                conn,
                Pooler::None,
                &inbox_test_support::worker::EVERY_TYPE,
                None,
                10,
                limit,
                budget,
                LEASE,
                Duration::from_secs(5),
            )
            .await
            .unwrap()
            .claimed
        }
    };
    let three = claim(5, 250_000).await;
    assert_eq!(three.len(), 3, "0, 100k and 200k before them are under 250k; the 4th is not");
    assert!(three.iter().all(|c| c.bytes == 100_000));
    let one = claim(5, 1).await;
    assert_eq!(one.len(), 1, "a budget smaller than one row still takes one");

    client
        .batch_execute("UPDATE webhook_inbox SET payload_bytes = NULL, available_at = now(), attempts = 0")
        .await
        .unwrap();
    let text: i64 =
        scalar(&client, "SELECT min(octet_length(payload::text))::bigint FROM webhook_inbox").await;
    let measured = claim(5, i64::MAX).await;
    assert_eq!(measured.len(), 5);
    assert!(measured.iter().all(|c| c.bytes >= text), "legacy rows are measured from their text");
}

#[tokio::test]
async fn processing_commits_the_effect_and_processed_at_together() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 4200)).await;
    let pool = pool(&db, 2);
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed]);
    let row = client
        .query_one("SELECT processed_at IS NOT NULL, last_error IS NULL, attempts FROM webhook_inbox", &[])
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0) && row.get::<_, bool>(1));
    assert_eq!(row.get::<_, i32>(2), 1);
    let invoice = client
        .query_one("SELECT status, amount_paid, customer_id FROM invoices WHERE id = 'in_1'", &[])
        .await
        .unwrap();
    assert_eq!(invoice.get::<_, String>(0), "paid");
    assert_eq!(invoice.get::<_, i64>(1), 4200);
    assert_eq!(invoice.get::<_, String>(2), "cus_TEST0001");
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_1' AND amount = 4200")
            .await,
        1
    );
    let outbox: serde_json::Value = client
        .query_one(
            "SELECT payload FROM outbox WHERE aggregate_id = 'in_1' AND event_type = 'InvoicePaymentBooked'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outbox, serde_json::json!({ "invoice_id": "in_1", "amount": 4200, "currency": "jpy" }));
    // What Stripe says, not the processing time: the event's status_transitions.paid_at.
    let (paid_at, currency): (i64, String) = {
        let row = client
            .query_one(
                "SELECT extract(epoch FROM paid_at)::int8, currency FROM invoices WHERE id = 'in_1'",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((paid_at, currency.as_str()), (1_790_000_100, "jpy"));
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_1' AND currency = 'jpy'")
            .await,
        1,
        "the booking says what money it is"
    );
}

/// The same event twice → processed once, one booking.
#[tokio::test]
async fn the_same_event_delivered_twice_is_booked_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed]);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await; // redelivery: ON CONFLICT
    assert!(drain(&pool, &invoices()).await.is_empty());
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
}

/// A failing handler → attempts 1, last_error kept, processed on a later attempt.
#[tokio::test]
async fn a_failure_is_recorded_and_retried_after_the_backoff() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    let mut body: serde_json::Value = serde_json::from_slice(&invoice_paid("evt_1", "in_1", 100)).unwrap();
    body["data"]["object"].as_object_mut().unwrap().remove("amount_paid");
    store_event(&client, "billing", &serde_json::to_vec(&body).unwrap()).await;
    let outcomes = run_once(&pool, &invoices()).await;
    assert!(
        matches!(&outcomes[..], [Outcome::Failed(e)] if e.contains("data.object.amount_paid")),
        "{outcomes:?}"
    );
    let row = client
        .query_one(
            "SELECT attempts, last_error, processed_at IS NULL, available_at <= now() + interval '2 seconds' FROM webhook_inbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    assert!(row.get::<_, String>(1).contains("amount_paid"));
    assert!(row.get::<_, bool>(2));
    assert!(row.get::<_, bool>(3), "backoff after attempt 1 is at most 2 s");
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices").await, 0, "rolled back");

    // The sender's data is fixed; the retry after the backoff processes it.
    client
        .execute(
            "UPDATE webhook_inbox SET payload = jsonb_set(payload, '{data,object,amount_paid}', '100')",
            &[],
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed]);
    assert_eq!(scalar(&client, "SELECT attempts::bigint FROM webhook_inbox").await, 2);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
}

/// A worker that dies right after each claim, three times with a limit of 3 → parked.
#[tokio::test]
async fn a_row_whose_worker_dies_after_every_claim_is_parked_at_the_attempt_limit() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    for attempt in 1..=3 {
        // Claim with a tiny lease and "die" (never process).
        let rows = claim(&pool, 1, Duration::from_millis(50), 3).await;
        assert_eq!(rows.len(), 1, "attempt {attempt}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The next claim meets it at the limit with no outcome recorded: it parks it, with the reason.
    let conn = pool.get().await.unwrap();
    let next = queue::claim(
        &conn,
        Pooler::None,
        &inbox_test_support::worker::EVERY_TYPE,
        None,
        3,
        1,
        i64::MAX,
        LEASE,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(next.claimed.is_empty(), "a row at the limit is not claimed again");
    assert_eq!(next.parked.iter().map(|p| p.key.event_id.as_str()).collect::<Vec<_>>(), ["evt_1"]);
    let row = client
        .query_one("SELECT attempts, parked_at IS NOT NULL, last_error FROM webhook_inbox", &[])
        .await
        .unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (3, true));
    let reason: String = row.get(2);
    assert!(reason.contains("attempt 3 of 3 ended without an outcome"), "{reason}");
    assert!(claim(&pool, 1, LEASE, 10).await.is_empty(), "parked: not claimed even by a worker allowing 10");
    assert_eq!(scalar(&client, "SELECT attempts::bigint FROM webhook_inbox").await, 3);
}

/// A row whose failed attempts are past a lowered `--max-attempts` is parked by the next claim with
/// the truth: the limit was lowered, and what its last error was — not "its worker stopped".
#[tokio::test]
async fn lowering_the_attempt_limit_below_a_rows_attempts_parks_it_saying_so() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    client
        .batch_execute("UPDATE webhook_inbox SET attempts = 5, last_error = 'payload: no amount_paid'")
        .await
        .unwrap();
    assert!(claim(&pool, 1, LEASE, 3).await.is_empty(), "parked, not claimed");
    let reason: String = client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert!(
        reason.starts_with("attempt limit lowered to 3 (--max-attempts): the row had used 5 attempts"),
        "{reason}"
    );
    assert!(reason.contains("its last error: payload: no amount_paid"), "{reason}");
    assert!(!reason.contains("worker stopped"), "{reason}");
}

/// A's lease expires, B processes, A comes back → A does nothing.
#[tokio::test]
async fn a_worker_returning_after_its_lease_was_taken_does_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 3);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let a = claim(&pool, 1, Duration::from_millis(100), 10).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = claim(&pool, 1, LEASE, 10).await;
    assert_eq!((a.len(), b.len()), (1, 1));
    let limits = test_limits(Duration::from_secs(5));
    assert_eq!(execute(&pool, &invoices(), &b[0], &limits).await, Outcome::Processed);
    assert_eq!(execute(&pool, &invoices(), &a[0], &limits).await, Outcome::AlreadyProcessed);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT attempts::bigint FROM webhook_inbox").await, 2);
}

/// A's lease expires and B claims the row; A's attempt then fails: its failure record is fenced
/// by its claim (the attempt it counted), so B's lease and error stay as B left them.
#[tokio::test]
async fn a_failure_recorded_after_the_lease_was_taken_leaves_the_new_claim_alone() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 3);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let a = claim(&pool, 1, Duration::from_millis(100), 10).await.remove(0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = claim(&pool, 1, LEASE, 10).await.remove(0);
    assert_eq!((a.attempts, b.attempts), (1, 2));
    let before =
        client.query_one("SELECT available_at::text, last_error FROM webhook_inbox", &[]).await.unwrap();

    let records = inbox_worker::completer::record_failures(
        &pool,
        None,
        &[Failure { claimed: &a, error: "A's stale failure" }],
        10,
    )
    .await;
    assert_eq!(records, [FailureRecord::Superseded]);
    let after =
        client.query_one("SELECT available_at::text, last_error FROM webhook_inbox", &[]).await.unwrap();
    assert_eq!(after.get::<_, String>(0), before.get::<_, String>(0), "B's lease is untouched");
    assert_eq!(after.get::<_, Option<String>>(1), None, "A's error is not recorded over B's claim");

    // B's own failure is recorded.
    let records = inbox_worker::completer::record_failures(
        &pool,
        None,
        &[Failure { claimed: &b, error: "B's failure" }],
        10,
    )
    .await;
    assert_eq!(records, [FailureRecord::Retrying]);
    let error: String = client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert_eq!(error, "B's failure");
}

/// While A holds the row in its process transaction, B waits for the lock (no SKIP
/// LOCKED), then sees it processed and backs off.
#[tokio::test]
async fn a_second_worker_waits_for_the_row_lock_then_sees_it_processed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 3);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let a = claim(&pool, 1, Duration::from_millis(100), 10).await.remove(0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = claim(&pool, 1, LEASE, 10).await.remove(0);
    // A processes slowly: a trigger holds its transaction open for 1 s after the booking.
    slow_writes(&client, "ledger_entries", "AFTER INSERT", 1.0).await;
    let limits = test_limits(Duration::from_secs(5));
    let (pa, pb) = (pool.clone(), pool.clone());
    let first =
        tokio::spawn(
            async move { execute(&pa, &invoices(), &a, &test_limits(Duration::from_secs(5))).await },
        );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let second = execute(&pb, &invoices(), &b, &limits).await;
    assert!(started.elapsed() > Duration::from_millis(500), "B waited for A's lock");
    assert_eq!(first.await.unwrap(), Outcome::Processed);
    assert_eq!(second, Outcome::AlreadyProcessed);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
}

/// A handler over `statement_timeout` → recorded as such, still unprocessed.
#[tokio::test]
async fn a_handler_over_the_statement_timeout_is_recorded_and_stays_unprocessed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    slow_writes(&client, "ledger_entries", "BEFORE INSERT", 3.0).await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let row = claim(&pool, 1, LEASE, 10).await.remove(0);
    let outcome = execute(&pool, &invoices(), &row, &test_limits(Duration::from_millis(500))).await;
    assert!(
        matches!(&outcome, Outcome::Failed(e) if e.contains("statement timeout") && e.contains("57014")),
        "{outcome:?}"
    );
    let last_error: String =
        client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert!(last_error.contains("57014"), "{last_error}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices").await, 0);
    // The transaction-local timeout did not leak into the pooled connection.
    let conn = pool.get().await.unwrap();
    let timeout: String = conn.query_one("SHOW statement_timeout", &[]).await.unwrap().get(0);
    assert_eq!(timeout, "0");
}

/// A lock held elsewhere on the invoice → lock_timeout (below the statement timeout) fires.
#[tokio::test]
async fn a_handler_blocked_on_a_lock_hits_the_lock_timeout() {
    let db = TestDb::new().await;
    let mut holder = db.client().await;
    let pool = pool(&db, 2);
    holder
        .batch_execute("INSERT INTO invoices (id, customer_id, status) VALUES ('in_1', 'cus_1', 'open')")
        .await
        .unwrap();
    store_event(&holder, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("SELECT * FROM invoices WHERE id = 'in_1' FOR UPDATE").await.unwrap();
    let row = claim(&pool, 1, LEASE, 10).await.remove(0);
    let outcome = execute(&pool, &invoices(), &row, &test_limits(Duration::from_secs(2))).await;
    assert!(
        matches!(&outcome, Outcome::Failed(e) if e.contains("lock timeout") && e.contains("55P03")),
        "{outcome:?}"
    );
    tx.rollback().await.unwrap();
}

fn panicking<'a>(_: &'a deadpool_postgres::Transaction<'_>, _: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async { panic!("boom in a handler") })
}

/// A panic in a handler is a recorded failure like any other.
#[tokio::test]
async fn a_panicking_handler_is_a_recorded_failure() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    let mut registry = invoices();
    registry.register("invoice.paid", panicking);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let outcomes = run_once(&pool, &registry).await;
    assert!(matches!(&outcomes[..], [Outcome::Failed(e)] if e.contains("boom in a handler")), "{outcomes:?}");
    let last_error: String =
        client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert!(last_error.contains("panicked"), "{last_error}");
}

#[tokio::test]
async fn an_event_type_a_worker_neither_handles_nor_ignores_is_never_claimed_by_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_event("evt_1", "customer.created", "in_1", "open", 0)).await;
    store_event(&client, "billing", &invoice_paid("evt_2", "in_2", 100)).await;
    // The invoice worker takes its own type and leaves the other untouched: no attempt counted.
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed]);
    let row = client
        .query_one("SELECT attempts, processed_at IS NULL FROM webhook_inbox WHERE event_id = 'evt_1'", &[])
        .await
        .unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (0, true), "never claimed, never marked done");
    // A worker told to ignore the type marks it processed with no effect.
    let mut ignoring = invoices();
    ignoring.ignore("customer.*");
    assert_eq!(drain(&pool, &ignoring).await, [Outcome::Ignored]);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await, 2);
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices").await, 1);
}

/// `invoice.paid` before `invoice.created` → paid.
#[tokio::test]
async fn paid_before_created_ends_paid() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_paid", "in_1", 100)).await;
    drain(&pool, &invoices()).await;
    store_event(&client, "billing", &invoice_event("evt_created", "invoice.created", "in_1", "draft", 0))
        .await;
    drain(&pool, &invoices()).await;
    let status: String =
        client.query_one("SELECT status FROM invoices WHERE id = 'in_1'", &[]).await.unwrap().get(0);
    assert_eq!(status, "paid");
}

/// The same payment as two Event objects → one booking, one outbox row.
#[tokio::test]
async fn the_same_payment_as_two_event_objects_is_booked_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_A", "in_1", 100)).await;
    store_event(&client, "billing", &invoice_paid("evt_B", "in_1", 100)).await;
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed, Outcome::Processed]);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
}

/// `invoice.paid` on a voided invoice → no booking, no outbox, a reconciliation item.
#[tokio::test]
async fn a_payment_on_a_voided_invoice_books_nothing_and_asks_a_person() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_event("evt_v", "invoice.voided", "in_1", "void", 0)).await;
    store_event(&client, "billing", &invoice_paid("evt_p", "in_1", 100)).await;
    drain(&pool, &invoices()).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 0);
    let item =
        client.query_one("SELECT invoice_id, event_id, reason FROM reconciliation_items", &[]).await.unwrap();
    assert_eq!(
        (item.get::<_, String>(0), item.get::<_, String>(1), item.get::<_, String>(2)),
        ("in_1".into(), "evt_p".into(), "payment_on_void_invoice".into())
    );
    let status: String = client.query_one("SELECT status FROM invoices", &[]).await.unwrap().get(0);
    assert_eq!(status, "void");
}

/// `invoice.paid` whose upsert waits on another transaction's uncommitted insert of the same
/// invoice: the payment statement's snapshot predates that commit, so it finds no status and the
/// handler reads it again with a fresh snapshot. A void committed meanwhile → a reconciliation
/// item and no booking; a payment booked meanwhile (a second Event object) → still one booking.
#[tokio::test]
async fn a_payment_racing_a_concurrent_insert_of_its_invoice_acts_on_the_committed_status() {
    for (other_status, ledger, reconciliation) in [("void", 0, 1), ("paid", 1, 0)] {
        let db = TestDb::new().await;
        let client = db.client().await;
        let pool = pool(&db, 2);
        store_event(&client, "billing", &invoice_paid("evt_p", "in_1", 100)).await;
        let row = claim(&pool, 1, LEASE, 10).await.remove(0);
        let other = db.client().await;
        other.batch_execute("BEGIN").await.unwrap();
        other
            .execute(
                "INSERT INTO invoices (id, customer_id, status) VALUES ('in_1', 'cus_1', $1)",
                &[&other_status],
            )
            .await
            .unwrap();
        if other_status == "paid" {
            other
                .batch_execute(
                    "INSERT INTO ledger_entries (invoice_id, kind, amount) VALUES ('in_1', 'payment', 100)",
                )
                .await
                .unwrap();
        }
        let p = pool.clone();
        let processing = tokio::spawn(async move {
            execute(&p, &invoices(), &row, &test_limits(Duration::from_secs(10))).await
        });
        // Commit only once the worker's upsert waits on the uncommitted invoice row.
        let waiting = "SELECT count(*) FROM pg_stat_activity
                        WHERE datname = current_database() AND wait_event_type = 'Lock'";
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while scalar(&client, waiting).await == 0 {
            assert!(std::time::Instant::now() < deadline, "the worker never waited on the invoice");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        other.batch_execute("COMMIT").await.unwrap();
        assert_eq!(processing.await.unwrap(), Outcome::Processed, "{other_status}");
        assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, ledger, "{other_status}");
        assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 0, "{other_status}");
        assert_eq!(
            scalar(&client, "SELECT count(*) FROM reconciliation_items").await,
            reconciliation,
            "{other_status}"
        );
        let status: String = client.query_one("SELECT status FROM invoices", &[]).await.unwrap().get(0);
        assert_eq!(status, other_status);
    }
}

/// The set-based `invoice.paid` handler has the effect of the per-event one run on each event in
/// order. One batch — a new invoice, the same payment as a second Event object, an open invoice,
/// an invoice already paid and booked, a void invoice paid by two events, an invoice paid twice
/// with different amounts — is processed in one transaction in one database and one event at a
/// time in another: the business tables come out identical, and as expected.
#[tokio::test]
async fn a_batch_of_payments_has_the_effect_of_paying_one_event_at_a_time() {
    let events = [
        invoice_paid("evt_1", "in_new", 100),
        invoice_paid("evt_2", "in_new", 100),
        invoice_paid("evt_3", "in_open", 200),
        invoice_paid("evt_4", "in_paid", 300),
        invoice_paid("evt_5", "in_void", 400),
        invoice_paid("evt_6", "in_void", 400),
        invoice_paid("evt_7", "in_twice", 500),
        invoice_paid("evt_8", "in_twice", 999),
    ];
    let prepare = |db: TestDb| async {
        let client = db.client().await;
        client
            .batch_execute(
                "INSERT INTO invoices (id, customer_id, status) VALUES ('in_open', 'cus_1', 'open'), ('in_void', 'cus_1', 'void');
                 INSERT INTO invoices (id, customer_id, status, amount_paid) VALUES ('in_paid', 'cus_1', 'paid', 300);
                 INSERT INTO ledger_entries (invoice_id, kind, amount) VALUES ('in_paid', 'payment', 300);",
            )
            .await
            .unwrap();
        for body in &events {
            store_event(&client, "billing", body).await;
        }
        (db, client)
    };
    let (batched_db, batched) = prepare(TestDb::new().await).await;
    let pool_a = pool(&batched_db, 2);
    let claimed = claim(&pool_a, 100, LEASE, 10).await;
    assert_eq!(claimed.len(), events.len());
    let mut conn = inbox_worker::conn::Conn::get(&pool_a).await.unwrap();
    let outcomes = inbox_worker::executor::execute_batch(
        &mut conn,
        &invoices(),
        &claimed,
        &test_limits(Duration::from_secs(5)),
    )
    .await;
    assert!(outcomes.iter().all(|o| *o == Outcome::Processed), "{outcomes:?}");

    let (single_db, single) = prepare(TestDb::new().await).await;
    let outcomes = drain(&pool(&single_db, 2), &invoices()).await;
    assert!(
        outcomes.len() == events.len() && outcomes.iter().all(|o| *o == Outcome::Processed),
        "{outcomes:?}"
    );

    async fn rows(client: &tokio_postgres::Client, sql: &str) -> Vec<String> {
        client
            .simple_query(sql)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => {
                    Some((0..row.len()).map(|i| row.get(i).unwrap_or("NULL")).collect::<Vec<_>>().join("|"))
                }
                _ => None,
            })
            .collect()
    }
    let expected: [(&str, &[&str]); 4] = [
        (
            "SELECT id, status, amount_paid, paid_at IS NOT NULL FROM invoices ORDER BY id",
            &[
                "in_new|paid|100|t",
                "in_open|paid|200|t",
                "in_paid|paid|300|f",
                "in_twice|paid|500|t",
                "in_void|void|0|f",
            ],
        ),
        (
            "SELECT invoice_id, kind, amount FROM ledger_entries ORDER BY 1",
            &["in_new|payment|100", "in_open|payment|200", "in_paid|payment|300", "in_twice|payment|500"],
        ),
        (
            "SELECT aggregate_id, payload->>'amount' FROM outbox ORDER BY 1",
            &["in_new|100", "in_open|200", "in_twice|500"],
        ),
        (
            "SELECT invoice_id, event_id, reason FROM reconciliation_items ORDER BY 1, 2",
            &["in_void|evt_5|payment_on_void_invoice", "in_void|evt_6|payment_on_void_invoice"],
        ),
    ];
    for (sql, want) in expected {
        let (a, b) = (rows(&batched, sql).await, rows(&single, sql).await);
        assert_eq!(a, b, "one batch vs one event at a time: {sql}");
        assert_eq!(a, want, "{sql}");
    }
}

/// The same event on two endpoints → both processed (and still one booking).
#[tokio::test]
async fn the_same_event_on_two_endpoints_is_processed_on_both() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    store_event(&client, "analytics", &invoice_paid("evt_1", "in_1", 100)).await;
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed, Outcome::Processed]);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await, 2);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
}

/// 50 events, 4 workers (threads lined up on a barrier, one connection each) → exactly 50
/// bookings, nothing left, every row in one attempt.
#[test]
fn fifty_events_over_four_concurrent_workers_are_each_booked_once_in_one_attempt() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(TestDb::new());
    rt.block_on(async {
        let client = db.client().await;
        for i in 0..50 {
            store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100 + i))
                .await;
        }
    });
    let barrier = Arc::new(Barrier::new(4));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (barrier, config) = (barrier.clone(), db.config());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let pool = inbox_domain::db::build_pool(
                        &config.into(),
                        &inbox_domain::db::PoolOptions {
                            max_size: 1,
                            timeout: Duration::from_secs(10),
                            application_name: "inbox-test",
                            session_statement_timeout: None,
                            session_write_back: false,
                            verify_on_checkout: true,
                        },
                    )
                    .unwrap();
                    drop(pool.get().await.unwrap()); // connected before the start line
                    barrier.wait();
                    drain(&pool, &invoices()).await.len()
                })
            })
        })
        .collect();
    let processed: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(processed, 50);
    rt.block_on(async {
        let client = db.client().await;
        assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 50);
        assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await, 0);
        assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
    });
}

/// Shutdown hands back rows claimed but never started, returning their attempt — unless the
/// lease already expired and another worker claimed the row.
#[tokio::test]
async fn handing_back_an_unstarted_claim_returns_its_attempt_only_while_it_is_ours() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    store_event(&client, "billing", &invoice_paid("evt_2", "in_2", 100)).await;
    let mine = claim(&pool, 2, LEASE, 10).await;
    assert_eq!(inbox_worker::completer::hand_back(&pool, &mine).await, 2);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts = 0 AND available_at <= now()")
            .await,
        2
    );

    // A claim whose lease expired and was taken by another worker is not ours to hand back.
    let stale = claim(&pool, 1, Duration::from_millis(50), 10).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut taken = claim(&pool, 2, LEASE, 10).await;
    taken.retain(|c| c.key == stale[0].key);
    assert_eq!(taken[0].attempts, 2);
    assert_eq!(inbox_worker::completer::hand_back(&pool, &stale).await, 0);
    let attempts: i32 = client
        .query_one("SELECT attempts FROM webhook_inbox WHERE event_id = $1", &[&stale[0].key.event_id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempts, 2);
}

/// Several events share one transaction; when one fails, the batch is redone one event per
/// savepoint: a failing, a timing-out and a panicking event do not poison their neighbours, whose
/// effects commit.
#[tokio::test]
async fn one_failing_event_does_not_poison_the_others_of_its_batch() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    let mut registry = invoices();
    registry.register("test.panic", panicking).ignore("customer.*");
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let mut broken: serde_json::Value = serde_json::from_slice(&invoice_paid("evt_2", "in_2", 100)).unwrap();
    broken["data"]["object"].as_object_mut().unwrap().remove("amount_paid");
    store_event(&client, "billing", &serde_json::to_vec(&broken).unwrap()).await;
    store_event(&client, "billing", &invoice_paid("evt_3", "in_3", 100)).await;
    store_event(&client, "billing", &invoice_event("evt_4", "test.panic", "in_4", "open", 0)).await;
    // evt_5's booking runs into the statement timeout (a trigger sleeps for in_5 only).
    client
        .batch_execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN IF NEW.invoice_id = 'in_5' THEN PERFORM pg_sleep(2); END IF; RETURN NEW; END $$;
             CREATE TRIGGER slow BEFORE INSERT ON ledger_entries FOR EACH ROW EXECUTE FUNCTION slow();",
        )
        .await
        .unwrap();
    store_event(&client, "billing", &invoice_paid("evt_5", "in_5", 100)).await;
    store_event(&client, "billing", &invoice_event("evt_6", "customer.created", "in_6", "open", 0)).await;

    let claimed = claim(&pool, 10, LEASE, 10).await;
    assert_eq!(claimed.len(), 6);
    let mut conn = inbox_worker::conn::Conn::get(&pool).await.unwrap();
    let outcomes = inbox_worker::executor::execute_batch(
        &mut conn,
        &registry,
        &claimed,
        // The worker's own deadline is generous: only evt_5's statement may time out.
        &inbox_worker::executor::Limits {
            deadline: Duration::from_secs(30),
            ..test_limits(Duration::from_millis(700))
        },
    )
    .await;
    assert!(conn.is_clean(), "{outcomes:?}");
    let by_id: std::collections::HashMap<&str, &Outcome> =
        claimed.iter().map(|c| c.key.event_id.as_str()).zip(outcomes.iter()).collect();
    assert_eq!(by_id["evt_1"], &Outcome::Processed);
    assert!(matches!(by_id["evt_2"], Outcome::Failed(e) if e.contains("amount_paid")), "{outcomes:?}");
    assert_eq!(by_id["evt_3"], &Outcome::Processed);
    assert!(matches!(by_id["evt_4"], Outcome::Failed(e) if e.contains("panicked")), "{outcomes:?}");
    assert!(matches!(by_id["evt_5"], Outcome::Failed(e) if e.contains("57014")), "{outcomes:?}");
    assert_eq!(by_id["evt_6"], &Outcome::Ignored);

    let processed: Vec<String> =
        column(&client, "SELECT event_id FROM webhook_inbox WHERE processed_at IS NOT NULL ORDER BY 1").await;
    assert_eq!(processed, ["evt_1", "evt_3", "evt_6"]);
    let booked: Vec<String> = column(&client, "SELECT invoice_id FROM ledger_entries ORDER BY 1").await;
    assert_eq!(booked, ["in_1", "in_3"]);
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices WHERE id IN ('in_2', 'in_5')").await, 0);
}

/// Queues `n` unprocessed rows of `event_type` with ~1.5 KB payloads, in one statement.
async fn queue_rows(client: &tokio_postgres::Client, n: i32, event_type: &str) {
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_' || i, $2, jsonb_build_object('pad', repeat('x', 1500))
               FROM generate_series(1, $1) i",
            &[&n, &event_type],
        )
        .await
        .unwrap();
}

/// How many rows the queue table and the inbox disagree on: a waiting row (neither processed nor
/// parked) missing from the queue or differing there, or a queue entry with no such row.
async fn queue_disagreements(client: &tokio_postgres::Client) -> i64 {
    scalar(
        client,
        "WITH waiting AS (SELECT provider, endpoint, event_id, event_type, available_at, received_at
                            FROM webhook_inbox WHERE processed_at IS NULL AND parked_at IS NULL),
              queued AS (SELECT provider, endpoint, event_id, event_type, available_at, received_at
                           FROM webhook_inbox_queue)
         SELECT (SELECT count(*) FROM (TABLE waiting EXCEPT TABLE queued) AS missing)
              + (SELECT count(*) FROM (TABLE queued EXCEPT TABLE waiting) AS stale)",
    )
    .await
}

/// The queue table holds exactly the inbox's waiting rows after every kind of write, each made by
/// hand as a team's own SQL would: rows stored, leased, processed, parked, moved to another key and
/// requeued, several of them in one statement; a write of no queue column; a statement that
/// changes nothing; a delete; and an entry lost by hand, restored by its row's next change.
#[tokio::test]
async fn the_queue_table_follows_every_write_of_the_inbox_however_many_rows_a_statement_changes() {
    let db = TestDb::new().await;
    let client = db.client().await;
    queue_rows(&client, 8, "invoice.paid").await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 8);
    let steps = [
        ("a lease of three rows", "UPDATE webhook_inbox SET available_at = now() + interval '2 min', attempts = attempts + 1 WHERE event_id IN ('evt_1', 'evt_2', 'evt_3')"),
        (
            "one processed, one parked, one moved, one renamed, in one statement",
            "UPDATE webhook_inbox
                SET processed_at = CASE event_id WHEN 'evt_1' THEN now() END,
                    parked_at = CASE event_id WHEN 'evt_2' THEN now() END,
                    available_at = CASE event_id WHEN 'evt_3' THEN now() + interval '5 s' ELSE available_at END,
                    event_id = CASE event_id WHEN 'evt_4' THEN 'evt_40' ELSE event_id END
              WHERE event_id IN ('evt_1', 'evt_2', 'evt_3', 'evt_4')",
        ),
        ("a failure's error alone", "UPDATE webhook_inbox SET last_error = 'boom' WHERE event_id = 'evt_5'"),
        ("a statement that changes no row", "UPDATE webhook_inbox SET available_at = now() WHERE false"),
        ("the processed and the parked row requeued", "UPDATE webhook_inbox SET processed_at = NULL, parked_at = NULL, attempts = 0, available_at = now() WHERE event_id IN ('evt_1', 'evt_2')"),
        ("a renamed row takes a freed key", "UPDATE webhook_inbox SET event_id = CASE event_id WHEN 'evt_40' THEN 'evt_4' ELSE 'evt_400' END WHERE event_id IN ('evt_40', 'evt_6')"),
        ("a waiting row deleted", "DELETE FROM webhook_inbox WHERE event_id = 'evt_7'"),
        ("an entry lost by hand", "DELETE FROM webhook_inbox_queue WHERE event_id = 'evt_8'"),
        ("its row's next change", "UPDATE webhook_inbox SET available_at = now() - interval '1 s' WHERE event_id = 'evt_8'"),
        ("every row processed", "UPDATE webhook_inbox SET processed_at = now()"),
    ];
    for (step, sql) in steps {
        client.batch_execute(sql).await.unwrap();
        let expected = if step == "an entry lost by hand" { 1 } else { 0 };
        assert_eq!(queue_disagreements(&client).await, expected, "after {step}");
    }
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
}

/// A claim or a mark of a whole batch keeps the queue table in one call of its trigger function,
/// not one per row: the calls (their switch to the table's owner, their statements through SPI)
/// were a quarter of PostgreSQL's CPU in the benchmark's drain. And the call finds the batch's
/// entries by key, never by reading the whole queue table: the table is small, so the planner
/// likes a sequential scan of it, but while a long snapshot is open it keeps every dead entry,
/// and a scan per claim and per mark then reads them all (the workers fell 17 s behind in the soak).
#[tokio::test]
async fn a_batch_leased_or_processed_in_one_statement_keeps_the_queue_table_in_one_trigger_call_by_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    queue_rows(&client, 64, "invoice.paid").await;
    client.batch_execute("ANALYZE webhook_inbox_queue").await.unwrap();
    client.batch_execute("BEGIN; SET LOCAL track_functions = 'pl'").await.unwrap();
    let calls = "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_xact_user_functions
                  WHERE funcname = 'webhook_inbox_queue_follow'";
    let scans = "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'webhook_inbox_queue'";
    client
        .batch_execute(
            "UPDATE webhook_inbox SET available_at = now() + interval '2 min', attempts = attempts + 1",
        )
        .await
        .unwrap();
    assert_eq!(scalar(&client, calls).await, 1, "a lease of 64 rows");
    client.batch_execute("UPDATE webhook_inbox SET processed_at = now()").await.unwrap();
    assert_eq!(scalar(&client, calls).await, 2, "a mark of 64 rows");
    assert_eq!(scalar(&client, scans).await, 0, "sequential scans of the queue table");
    client.batch_execute("COMMIT").await.unwrap();
    assert_eq!(queue_disagreements(&client).await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
}

/// A connection to `db` on which `auto_explain` sends the plan of every statement, the triggers'
/// included (`log_nested_statements`), to the client as a notice; the messages, in order.
async fn explaining_client(
    db: &TestDb,
) -> (tokio_postgres::Client, tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::AsyncMessage>) {
    let (client, messages) = inbox_test_support::db::connect_with_messages(&db.config()).await;
    client
        .batch_execute(
            "LOAD 'auto_explain';
             SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on;
             SET client_min_messages = log",
        )
        .await
        .unwrap();
    (client, messages)
}

/// The plans `auto_explain` has sent to `client` so far (see [`explaining_client`]), in order, each
/// as its query's text and the whole notice. One round trip first, so that the notices of every
/// statement before have arrived.
async fn reported_plans(
    client: &tokio_postgres::Client,
    messages: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::AsyncMessage>,
) -> Vec<(String, String)> {
    client.batch_execute("SELECT 1").await.unwrap();
    let mut reported = Vec::new();
    while let Ok(message) = messages.try_recv() {
        let tokio_postgres::AsyncMessage::Notice(notice) = message else { continue };
        let plan = notice.message().to_owned();
        if let Some(text) = plan.split("Query Text: ").nth(1) {
            reported.push((text.to_owned(), plan));
        }
    }
    reported
}

/// The queue table's triggers never compile a statement with JIT, whatever its plan is estimated to
/// cost. At a steady few thousand events a second the queue's primary key grows to thousands of
/// pages within autovacuum's minute while its last vacuum counted a few dozen live entries, so the
/// planner costs each of a mark's key probes at ~2000; a mark of 64 rows then passed
/// `jit_above_cost`, and each one spent 40–67 ms compiling a delete that reads ~200 buffers (in
/// one 150-second run the workers fell 4.5 s behind for 20 s). Here the session has JIT compile
/// everything (`jit_above_cost = 0`) and `auto_explain` sends every statement's plan, the
/// triggers' included, to the client: the session's own statements are compiled, none of the
/// triggers' is — through a store, a lease, a mark, a delete and a truncate.
#[tokio::test]
async fn the_queue_tables_triggers_never_compile_their_statements_with_jit_however_costly_they_look() {
    let db = TestDb::new().await;
    let (client, mut plans) = explaining_client(&db).await;
    let available: bool = client.query_one("SELECT pg_jit_available()", &[]).await.unwrap().get(0);
    assert!(available, "this test needs a server with JIT (Debian's postgresql-15 has llvmjit)");
    client.batch_execute("SET jit_above_cost = 0").await.unwrap();
    let steps = [
        "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
         SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', '{}' FROM generate_series(1, 64) i",
        "UPDATE webhook_inbox SET available_at = now() + interval '2 min', attempts = attempts + 1",
        "UPDATE webhook_inbox SET processed_at = now() WHERE event_id <> 'evt_1'",
        "DELETE FROM webhook_inbox WHERE event_id = 'evt_1'",
        "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
         VALUES ('stripe', 'billing', 'evt_x', 'invoice.paid', '{}')",
        "TRUNCATE webhook_inbox",
    ];
    for step in steps {
        client.batch_execute(step).await.unwrap();
    }
    let mut triggers = Vec::new();
    let mut compiled_own = 0;
    for (text, plan) in reported_plans(&client, &mut plans).await {
        if text.contains("webhook_inbox_queue") {
            triggers.push(plan);
        } else if plan.contains("JIT:") {
            compiled_own += 1;
        }
    }
    assert!(compiled_own >= steps.len() - 1, "the session's own statements are compiled ({compiled_own})");
    // The store's enter, the lease's upsert, the mark's delete, the delete's leave, the truncate's clear.
    assert!(triggers.len() >= 5, "the triggers' statements reported: {triggers:#?}");
    let compiled: Vec<&String> = triggers.iter().filter(|plan| plan.contains("JIT:")).collect();
    assert!(compiled.is_empty(), "trigger statements compiled with JIT:\n{compiled:#?}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
}

/// The mark's trigger finds each processed row's queue entry with a plain index scan of the
/// queue's primary key, never a bitmap scan, however the queue was last analysed. The plain scan
/// marks the dead entry it steps over (the claim's upsert leaves one per event), so that b-tree
/// removes it itself when the page fills; a bitmap scan marks nothing, and the key then kept every
/// entry until autovacuum came (in a soak at 800 events/s, ~140 leaf pages a minute instead of
/// ~6; docs/performance.md, "What the two sizes are"). The planner chose the bitmap scan once the
/// queue had been analysed with few live rows in many pages: here a burst of 20k events, all but
/// 11 processed, is analysed in that state (autovacuum off for the test), and a mark of 50 more
/// rows reports its trigger's plans.
#[tokio::test]
async fn the_marks_probe_of_the_queues_key_is_a_plain_index_scan_however_the_queue_was_analysed() {
    let db = TestDb::new().await;
    let (client, mut plans) = explaining_client(&db).await;
    client
        .batch_execute(
            "SET auto_explain.log_min_duration = -1;
             ALTER TABLE webhook_inbox SET (autovacuum_enabled = off);
             ALTER TABLE webhook_inbox_queue SET (autovacuum_enabled = off);
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_a' || lpad(i::text, 8, '0'), 'invoice.paid', '{}'
               FROM generate_series(1, 20000) i;
             UPDATE webhook_inbox SET available_at = now() + interval '2 min', attempts = attempts + 1;
             UPDATE webhook_inbox SET processed_at = now() WHERE event_id < 'evt_a00019990';
             ANALYZE webhook_inbox_queue;
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_b' || lpad(i::text, 8, '0'), 'invoice.paid', '{}'
               FROM generate_series(1, 50) i;
             UPDATE webhook_inbox SET available_at = now() + interval '2 min', attempts = attempts + 1
              WHERE event_id >= 'evt_b'",
        )
        .await
        .unwrap();
    client
        .batch_execute(
            "SET auto_explain.log_min_duration = 0;
             UPDATE webhook_inbox SET processed_at = now() WHERE event_id >= 'evt_b'",
        )
        .await
        .unwrap();
    let probes: Vec<String> = reported_plans(&client, &mut plans)
        .await
        .into_iter()
        .filter(|(text, _)| text.contains("DELETE FROM webhook_inbox_queue"))
        .map(|(_, plan)| plan)
        .collect();
    assert_eq!(probes.len(), 1, "the mark's trigger deletes its entries in one statement: {probes:#?}");
    let plan = &probes[0];
    assert!(
        plan.contains("Index Scan using webhook_inbox_queue_pkey") && !plan.contains("Bitmap"),
        "the trigger's delete must probe the key with a plain index scan:\n{plan}"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 11);
    assert_eq!(queue_disagreements(&client).await, 0);
}

/// Planned for their arguments (the worker sends them unnamed), the claims (of every type, and of
/// some types), the lock and the mark find a batch's rows through the queue's index (and each
/// one's inbox row by its key) or by TID on a queue of 20k rows that autovacuum has not analysed
/// yet — no plan scans the queue.
#[tokio::test]
async fn the_queue_statements_planned_for_their_arguments_do_not_scan_a_grown_queue() {
    use inbox_domain::inbox::store::queue::{
        CLAIM_PLANNER_SQL, CLAIM_SQL, CLAIM_TYPED_SQL, LOCK_BY_CTID_SQL, MARK_PROCESSED_SQL,
    };
    let db = TestDb::new().await;
    let client = db.client().await;
    let ctids = format!("('{{{}}}')", (1..=32).map(|i| format!("\"(0,{i})\"")).collect::<Vec<_>>().join(","));
    // (name, statement, parameter types, arguments, the access its plan must use)
    let statements = [
        (
            "claim",
            CLAIM_SQL,
            "int, bigint, float8, bigint, timestamptz",
            "(10, 32, 30.0, 33554432, NULL)".to_owned(),
            "using webhook_inbox_queue_by_type",
        ),
        (
            "typed_claim",
            CLAIM_TYPED_SQL,
            "int, bigint, float8, bigint, timestamptz, text[], text[], text[]",
            "(10, 32, 30.0, 33554432, NULL, '{invoice.paid}', '{customer.}', '{customer/}')".to_owned(),
            "using webhook_inbox_queue_by_type",
        ),
        ("lock", LOCK_BY_CTID_SQL, "text[]", ctids.clone(), "Tid Scan"),
        ("mark", MARK_PROCESSED_SQL, "text[]", ctids, "Tid Scan"),
    ];
    // What an unnamed statement gets: a plan for its arguments at each execution; and, for the
    // claims, what the claim's transaction sets (the lock and the mark run without it).
    client.batch_execute("SET plan_cache_mode = force_custom_plan").await.unwrap();
    for (name, sql, types, _, _) in &statements {
        client.batch_execute(&format!("PREPARE {name}({types}) AS {sql}")).await.unwrap();
    }
    queue_rows(&client, 20_000, "invoice.paid").await;
    for (name, _, _, args, access) in &statements {
        let planner = if name.ends_with("claim") {
            CLAIM_PLANNER_SQL.replace("SET LOCAL", "SET")
        } else {
            "RESET enable_bitmapscan; RESET enable_sort; RESET jit".to_owned()
        };
        client.batch_execute(&planner).await.unwrap();
        let plan: Vec<String> = column(&client, &format!("EXPLAIN (COSTS OFF) EXECUTE {name}{args}")).await;
        let plan = plan.join("\n");
        // A probe of the primary key per candidate (the claim finds each queued row's inbox row
        // by its key) reads as many rows as the index scan feeding it.
        let other_scans =
            other_scans(&plan, " on webhook_inbox", &[access, "Tid Scan", "using webhook_inbox_pkey"]);
        assert!(
            plan.contains(access) && other_scans.is_empty() && !plan.contains("Hash"),
            "{name} must find its rows by {access}, not scan the queue:\n{plan}"
        );
    }
}

/// Prepared on a worker's connection, a claim runs one generic plan, made at its first execution —
/// on an empty queue when the worker starts on a fresh database — and kept until an analyse or a
/// vacuum of a table it reads. Under the claim's settings that plan reads the queue's index in
/// order and probes the inbox by key, whatever sizes the planner saw: made on an empty queue and
/// run on one grown to 20k rows that nothing has analysed yet, no step of it scans the queue or the
/// inbox, for the claim of every type and the claim of some types.
#[tokio::test]
async fn the_claims_generic_plan_made_on_an_empty_queue_reads_only_the_queues_index_once_it_grew() {
    use inbox_domain::inbox::store::queue::{CLAIM_SQL, CLAIM_TYPED_SQL};
    use inbox_test_support::db::prepare_generic_claim;
    let db = TestDb::new().await;
    let client = db.client().await;
    let claims = [
        ("claim", CLAIM_SQL, "int, bigint, float8, bigint, timestamptz", "(10, 32, 30.0, 33554432, NULL)"),
        (
            "typed_claim",
            CLAIM_TYPED_SQL,
            "int, bigint, float8, bigint, timestamptz, text[], text[], text[]",
            "(10, 32, 30.0, 33554432, NULL, '{invoice.paid}', '{customer.}', '{customer/}')",
        ),
    ];
    for (name, sql, types, args) in claims {
        // The first claim, on the empty queue, makes the plan.
        prepare_generic_claim(&client, name, types, sql, args).await;
    }
    queue_rows(&client, 20_000, "invoice.paid").await;
    for (name, _, _, args) in claims {
        let plan: Vec<String> = column(&client, &format!("EXPLAIN (COSTS OFF) EXECUTE {name}{args}")).await;
        let plan = plan.join("\n");
        assert!(plan.contains("$5"), "{name}: the cached generic plan (its arguments unknown):\n{plan}");
        let allowed =
            ["using webhook_inbox_queue_by_type", "Tid Scan", "using webhook_inbox_pkey on webhook_inbox w"];
        let other_scans = other_scans(&plan, " on webhook_inbox", &allowed);
        assert!(
            plan.contains("using webhook_inbox_queue_by_type")
                && other_scans.is_empty()
                && !plan.contains("Hash"),
            "{name} must read the queue's index in order and probe the inbox by key:\n{plan}"
        );
    }
}

/// The same trap on the worker's real path: one session (as a worker's pooled connection)
/// processes its first batches while the queue is small — PostgreSQL caches a prepared
/// statement's generic plan after five executions — then the queue grows to 20k rows; claiming
/// and processing a batch of 32 must read about those 32 rows, not the queue. The claim runs as a
/// worker runs it, prepared, its generic plan held to its shape (`CLAIM_GENERIC_PLANNER_SQL`); with
/// the claim prepared without those settings, and the lock and mark prepared, their cached plans
/// (bitmap scan and sort of every ready row, partial index scans) read 45k.
#[tokio::test]
async fn a_batch_reads_its_rows_not_the_queue_when_the_queue_grew_after_the_first_batches() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 1);
    let mut registry = invoices();
    registry.ignore("test.*");
    let limits = test_limits(Duration::from_secs(5));
    for i in 0..8 {
        for j in 0..32 {
            store_event(
                &client,
                "billing",
                &invoice_paid(&format!("evt_w{i}_{j}"), &format!("in_w{i}_{j}"), 1),
            )
            .await;
        }
        let claimed = claim(&pool, 32, LEASE, 10).await;
        let mut conn = inbox_worker::conn::Conn::get(&pool).await.unwrap();
        let outcomes = inbox_worker::executor::execute_batch(&mut conn, &registry, &claimed, &limits).await;
        assert_eq!(outcomes, vec![Outcome::Processed; 32]);
    }
    queue_rows(&client, 20_000, "test.unhandled").await;
    let claimed = claim(&pool, 32, LEASE, 10).await;
    let mut conn = inbox_worker::conn::Conn::get(&pool).await.unwrap();
    let outcomes = inbox_worker::executor::execute_batch(&mut conn, &registry, &claimed, &limits).await;
    assert_eq!(outcomes, vec![Outcome::Ignored; 32]);
    drop(conn);
    // The session ends, and reports its statistics before it leaves pg_stat_activity.
    pool.close();
    let sessions = "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND application_name = 'inbox-test'";
    eventually(Duration::from_secs(2), || async { scalar(&client, sessions).await == 0 }).await;
    let tuples_read = scalar(
        &client,
        "SELECT (SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relname = 'webhook_inbox')
              + (SELECT sum(idx_tup_read)::bigint FROM pg_stat_user_indexes WHERE relname = 'webhook_inbox')",
    )
    .await;
    assert!(tuples_read > 0, "the session's statistics were reported");
    // The first batches read up to ~7k index entries and rows in all (the queue's dead entries
    // accumulate, no vacuum ran); one statement scanning the grown queue reads 20k more.
    assert!(
        tuples_read < 15_000,
        "the worker's statements read {tuples_read} rows and index entries of the inbox"
    );
}

/// While a snapshot older than the processed rows is open (a reporting query held for minutes),
/// neither vacuum nor the scans can remove the dead entries each claim and each processed mark
/// leave in the queue's index, at the front of their type's part of it. 19,500 of 20,000 queued
/// rows are claimed and processed under such a snapshot, by claims that each start where the one
/// before left off (`ClaimCursor`); the next claim from there must visit none of the dead entries
/// (heap fetches of the queue's index scans), where a claim from the front of the queue (the
/// cursor's periodic full scan, and every claim before the cursor) visits all 19,500.
#[tokio::test]
async fn a_claim_under_a_held_snapshot_starts_where_the_last_claim_left_off_not_at_the_dead_entries() {
    use inbox_domain::inbox::store::cursor::ClaimCursor;
    use inbox_domain::inbox::store::queue::CLAIM_SQL;
    let db = TestDb::new().await;
    let mut client = db.client().await;
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at, available_at)
             SELECT 'stripe', 'billing', 'evt_' || i, 'test.unhandled', jsonb_build_object('pad', repeat('x', 500)),
                    now() - interval '10 hours' + i * interval '1 s', now() - interval '10 hours' + i * interval '1 s'
               FROM generate_series(1, 20000) i",
            &[],
        )
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE webhook_inbox, webhook_inbox_queue").await.unwrap();
    let reporting = hold_snapshot(&db, "webhook_inbox").await;

    let pool = pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let mut cursor = ClaimCursor::new();
    let mut resume_from = None;
    for limit in std::iter::repeat_n(1000, 19).chain([500]) {
        let claim = queue::claim(
            &conn,
            Pooler::None,
            &inbox_test_support::worker::EVERY_TYPE,
            cursor.start(),
            10,
            limit,
            i64::MAX,
            LEASE,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(claim.claimed.len() as i64, limit, "every claim takes its oldest rows");
        cursor.advance(claim.resume_from);
        client
            .execute(
                "UPDATE webhook_inbox SET processed_at = now() WHERE attempts = 1 AND processed_at IS NULL",
                &[],
            )
            .await
            .unwrap();
        resume_from = claim.resume_from;
    }
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 500);
    // Where the next claim starts: the cursor's start, unless its full scan is due.
    let since = resume_from.unwrap() - ClaimCursor::SLACK;
    let since = timestamptz_literal(&client, since).await;

    // The plan a worker runs directly and the one behind a transaction pooler.
    for (n, planner) in inbox_test_support::db::claim_planners().iter().enumerate() {
        let types = "int, bigint, float8, bigint, timestamptz";
        inbox_test_support::db::prepare_claim(&client, planner, &format!("claim{n}"), types, CLAIM_SQL).await;
        let mut visited = Vec::new();
        for start in [since.clone(), "NULL".to_owned()] {
            let (plan, oldest) = explain_rolled_back(
                &mut client,
                &format!("EXECUTE claim{n}(10, 32, 30.0, 33554432, {start})"),
                "SELECT event_id FROM webhook_inbox WHERE attempts = 1 AND processed_at IS NULL ORDER BY received_at",
            )
            .await;
            let expected: Vec<String> = (19_501..19_533).map(|i| format!("evt_{i}")).collect();
            assert_eq!(oldest, expected, "from {start}, the oldest 32 ready rows: {plan}");
            // The rows the queue's index scans visited in the table: its dead entries and the live.
            let heap_fetches: u64 = plan
                .lines()
                .filter_map(|l| l.trim().strip_prefix("Heap Fetches: "))
                .map(|n| n.parse::<u64>().unwrap())
                .sum();
            visited.push(heap_fetches);
        }
        let [from_cursor, from_front] = visited[..] else { unreachable!() };
        assert!(
            from_cursor < 100 && from_front >= 19_500,
            "under `{planner}`, the claim's scans visited {from_cursor} entries from the cursor, {from_front} from the front"
        );
    }
    reporting.batch_execute("COMMIT").await.unwrap();
}

/// While a snapshot older than them is open, the queue table's indexes keep the dead entry of
/// every lease and every processed mark, and autovacuum's analyse, finding the table empty of live
/// rows, tells the planner so: it then costs a whole scan of an index at one page, less than a probe
/// per row. 30,000 rows are stored, leased and processed under such a snapshot, 64 at a time, and
/// the queue analysed; a batch of 8 is then claimed (by a worker that claims its types by name) and
/// marked processed as the worker does, and must find its entries by key (each claim and mark
/// updates the queue through its trigger): in all, it reads a fraction of the queue's primary key,
/// where a plan reading the grown index reads all of it at each statement (V19's delete: 43,761
/// buffers against a primary key of 457 pages; V20's: 157).
#[tokio::test]
async fn under_a_held_snapshot_a_batch_finds_its_queue_entries_by_key_not_by_reading_the_grown_index() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Stored, leased and processed 64 at a time. The rows arrived hours ago (as far as the queue
    // knows): the claim's cursor below starts after them (see the test above).
    let batch = "(provider, endpoint, event_id) IN (SELECT 'stripe', 'billing', 'evt_old_' || i FROM generate_series($1::int4, $2::int4) i)";
    let reporting = hold_snapshot(&db, "webhook_inbox").await;
    in_batches_of_64(
        &client,
        30_000,
        &[
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at, available_at)
             SELECT 'stripe', 'billing', 'evt_old_' || i, 'invoice.paid', '{}', now() - interval '10 hours', now() - interval '10 hours'
               FROM generate_series($1::int4, $2::int4) i",
            &format!("UPDATE webhook_inbox SET available_at = now() + interval '30 s', attempts = 1 WHERE {batch}"),
            &format!("UPDATE webhook_inbox SET processed_at = now() WHERE {batch}"),
        ],
    )
    .await;
    client.batch_execute("ANALYZE webhook_inbox_queue").await.unwrap();
    client
        .batch_execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_new_' || i, 'invoice.paid', '{}' FROM generate_series(1, 8) i",
        )
        .await
        .unwrap();
    let primary_key_pages =
        scalar(&client, "SELECT pg_relation_size('webhook_inbox_queue_pkey') / 8192").await;

    // A worker's connection: the claim is prepared on it.
    let pool = pool(&db, 1);
    let mut conn = pool.get().await.unwrap();
    let before = buffers_read(&conn, "webhook_inbox_queue").await;
    // Where the next claim would start: the cursor's slack before now.
    let since = std::time::SystemTime::now() - inbox_domain::inbox::store::cursor::ClaimCursor::SLACK;
    let claim = queue::claim(
        &conn,
        Pooler::None,
        &invoices().claim_filter(),
        Some(since),
        10,
        8,
        i64::MAX,
        LEASE,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(claim.claimed.len(), 8, "the new batch is claimed");
    let ctids: Vec<&str> = claim.claimed.iter().map(|c| c.ctid.as_str()).collect();
    let tx = conn.transaction().await.unwrap();
    assert_eq!(queue::mark_processed(&tx, &ctids).await.unwrap(), 8);
    tx.commit().await.unwrap();
    let read = buffers_read(&conn, "webhook_inbox_queue").await - before;
    reporting.batch_execute("COMMIT").await.unwrap();

    assert_eq!(queue_disagreements(&client).await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
    assert!(
        read < primary_key_pages / 2,
        "claiming and marking 8 rows read {read} buffers of the queue table, whose primary key has {primary_key_pages} pages"
    );
}

/// A stale worker's failure (or returned attempt) lands only on its own claim. After its lease
/// expired, an operator requeued the row (attempts back to 0) and another worker claimed it — the
/// same attempt number again — the stale write must still miss: the claim is identified by its
/// attempt *and* its lease's end, not by the attempt alone.
#[tokio::test]
async fn a_stale_claim_cannot_write_over_a_newer_claim_with_the_same_attempt_number() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let stale = claim(&pool, 1, Duration::from_millis(50), 10).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // What `requeue --event-id` does, then a new claim by another worker.
    client
        .execute("UPDATE webhook_inbox SET attempts = 0, available_at = now(), parked_at = NULL", &[])
        .await
        .unwrap();
    let fresh = claim(&pool, 1, LEASE, 10).await;
    assert_eq!((stale[0].attempts, fresh[0].attempts), (1, 1), "the same attempt number twice");
    let before = lease_of(&client).await;

    let failure = Failure { claimed: &stale[0], error: "stale worker's error" };
    let recorded = inbox_worker::completer::record_failures(&pool, None, &[failure], 10).await;
    assert_eq!(recorded, [FailureRecord::Superseded]);
    assert_eq!(inbox_worker::completer::return_interrupted(&pool, &stale, "stale interruption", 10).await, 0);
    assert_eq!(inbox_worker::completer::hand_back(&pool, &stale).await, 0);
    assert_eq!(lease_of(&client).await, before, "the fresh claim's lease, error and attempt are untouched");

    // The fresh claim's own writes still land.
    assert_eq!(inbox_worker::completer::return_interrupted(&pool, &fresh, "connection lost", 10).await, 1);
    let (_, error, attempts) = lease_of(&client).await;
    assert_eq!((error.as_deref(), attempts), (Some("connection lost"), 0), "attempt given back, error kept");
}

/// The row's lease end, last error and attempts.
async fn lease_of(client: &tokio_postgres::Client) -> (std::time::SystemTime, Option<String>, i32) {
    let row =
        client.query_one("SELECT available_at, last_error, attempts FROM webhook_inbox", &[]).await.unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A worker claims only the types it handles or ignores, and claiming them does not read the
/// rows of the types it leaves: 20k unhandled rows queued in front of 32 payments, the invoice
/// worker's claim takes the 32 payments reading a few dozen pages — through
/// `webhook_inbox_queue_by_type`, one ordered scan per claimed type — where a claim in order of
/// availability would step over all 20k (thousands of pages).
#[tokio::test]
async fn a_typed_claim_reads_the_rows_of_its_types_not_the_unhandled_rows_queued_in_front_of_them() {
    use inbox_domain::inbox::store::queue::CLAIM_TYPED_SQL;
    let db = TestDb::new().await;
    let mut client = db.client().await;
    queue_rows(&client, 20_000, "customer.updated").await;
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, available_at)
             SELECT 'stripe', 'billing', 'evt_inv_' || i, 'invoice.paid', jsonb_build_object('pad', repeat('x', 1500)),
                    now() + interval '1 ms'
               FROM generate_series(1, 32) i",
            &[],
        )
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE webhook_inbox").await.unwrap();
    let filter = invoices().claim_filter();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "PREPARE typed(int, bigint, float8, bigint, timestamptz, text[], text[], text[]) AS {CLAIM_TYPED_SQL}"
    ))
    .await
    .unwrap();
    let exact = format!("'{{{}}}'", filter.exact.join(","));
    let explain = format!(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE typed(10, 32, 30.0, 33554432, NULL, {exact}, '{{}}', '{{}}')"
    );
    let plan: Vec<String> = column(&tx, &explain).await;
    let claimed = scalar(&tx, "SELECT count(*) FROM webhook_inbox WHERE attempts = 1").await;
    let types: Vec<String> =
        column(&tx, "SELECT DISTINCT event_type FROM webhook_inbox WHERE attempts = 1").await;
    tx.rollback().await.unwrap();
    let plan = plan.join("\n");
    assert_eq!(claimed, 32, "{plan}");
    assert_eq!(types, ["invoice.paid"], "only its own types");
    // The statement's own buffers: the first "Buffers:" line is the top node's, the total.
    let buffers: u64 = plan
        .lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('=').and_then(|(_, n)| n.parse::<u64>().ok()))
                .sum()
        })
        .unwrap_or(0);
    assert!(plan.contains("webhook_inbox_queue_by_type"), "{plan}");
    eprintln!("typed claim: {buffers} buffers for 32 rows behind 20k of another type");
    assert!(buffers > 0 && buffers < 600, "the claim read {buffers} buffers:\n{plan}");
}

/// `invoice.created` records what it carries: the status (here `open`), the currency, the amount
/// due and the total.
#[tokio::test]
async fn invoice_created_records_its_status_currency_and_amounts() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    let mut created: serde_json::Value =
        serde_json::from_slice(&invoice_event("evt_c", "invoice.created", "in_c", "open", 0)).unwrap();
    created["data"]["object"]["amount_due"] = serde_json::json!(1500);
    created["data"]["object"]["total"] = serde_json::json!(1650);
    store_event(&client, "billing", &serde_json::to_vec(&created).unwrap()).await;
    assert_eq!(drain(&pool, &invoices()).await, [Outcome::Processed]);
    let row = client
        .query_one(
            "SELECT status, currency, amount_due, total, amount_paid FROM invoices WHERE id = 'in_c'",
            &[],
        )
        .await
        .unwrap();
    let got: (String, String, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(got, ("open".into(), "jpy".into(), 1500, 1650, 0));
}

/// Migration V11 fills what it can for the rows booked before it: the currency of invoices and
/// their ledger entries, and Stripe's paid_at, from the invoice events still in the inbox.
#[tokio::test]
async fn the_currency_and_paid_at_migration_fills_existing_rows_from_the_events_in_the_inbox() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    store_event(&client, "billing", &invoice_paid("evt_old", "in_old", 700)).await;
    drain(&pool, &invoices()).await;
    // The state before V11: no currency columns, paid_at the processing time.
    client
        .batch_execute(
            "ALTER TABLE invoices DROP COLUMN currency, DROP COLUMN amount_due, DROP COLUMN total;
             ALTER TABLE ledger_entries DROP COLUMN currency;
             UPDATE invoices SET paid_at = now();",
        )
        .await
        .unwrap();
    client
        .batch_execute(include_str!("../../migrations/V11__invoice_currency_and_stripe_times.sql"))
        .await
        .unwrap();
    let row = client
        .query_one("SELECT currency, extract(epoch FROM paid_at)::int8, amount_due FROM invoices WHERE id = 'in_old'", &[])
        .await
        .unwrap();
    let got: (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(got, ("jpy".into(), 1_790_000_100, 700));
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries WHERE currency = 'jpy'").await, 1);
}
