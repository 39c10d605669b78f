//! Connection hygiene and bounded damage: pools recover from every fault kind without a restart,
//! a cancelled request or event never hands back a connection inside a transaction, transaction-
//! local limits do not leak, lock / idle-in-transaction timeouts fire and are recorded, and the
//! pipeline's writes ask the kernel for write-back unless an operator chose otherwise.

use std::time::Duration;

use inbox_domain::handler::{HandlerFuture, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_test_support::db::{scalar, slow_writes, unprocessed};
use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::proxy::{postgres_addr, FaultProxy, Mode};
use inbox_test_support::worker::{
    claim, eventually, execute, pool, spawn_worker, store_event, test_limits, TestWorker,
};
use inbox_test_support::{spawn_app_with, TestDb};
use inbox_worker::conn::Conn;
use inbox_worker::executor::{self, Limits, Outcome};

/// Sessions of `application_name` on this database left inside a transaction.
async fn in_transaction(client: &tokio_postgres::Client, application_name: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
               AND application_name = $1 AND state LIKE 'idle in transaction%'",
            &[&application_name],
        )
        .await
        .unwrap()
        .get(0)
}

/// A worker with the stock handlers whose database connections go through a fault proxy, one
/// event (`evt_before`) already processed through it, and a direct connection to its database.
async fn worker_behind_proxy() -> (FaultProxy, TestDb, tokio_postgres::Client, TestWorker) {
    let proxy = FaultProxy::start(postgres_addr()).await;
    let db = TestDb::new().await;
    let client = db.client().await;
    let via_proxy = db.config_via_port(proxy.port);
    let worker =
        spawn_worker(&db, Registry::with_invoice_handlers(), |s| s.database = via_proxy.into()).await;
    store_event(&client, "billing", &invoice_paid("evt_before", "in_1", 100)).await;
    assert!(eventually(Duration::from_secs(10), || async { unprocessed(&client).await == 0 }).await);
    (proxy, db, client, worker)
}

#[tokio::test]
async fn the_worker_recovers_from_cut_connections_without_a_restart() {
    let (proxy, _db, client, worker) = worker_behind_proxy().await;

    proxy.set(Mode::Refuse); // every connection cut, new ones refused
    store_event(&client, "billing", &invoice_paid("evt_during", "in_2", 100)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(unprocessed(&client).await, 1);
    proxy.set(Mode::Pass);
    assert!(eventually(Duration::from_secs(15), || async { unprocessed(&client).await == 0 }).await);

    proxy.set(Mode::Blackhole); // connections hang
    store_event(&client, "billing", &invoice_paid("evt_hole", "in_3", 100)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.set(Mode::Pass);
    assert!(eventually(Duration::from_secs(20), || async { unprocessed(&client).await == 0 }).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 3);
    worker.stop().await;
}

/// Connections the network dropped without a word (the proxy holds them open and passes nothing)
/// hold no row and no claim for long: every statement of the worker has a deadline, and a
/// connection that misses it is discarded, not handed back to the pool.
#[tokio::test]
async fn the_worker_recovers_from_connections_the_network_dropped_silently() {
    let (proxy, _db, client, worker) = worker_behind_proxy().await;

    proxy.set(Mode::Freeze); // the open connections go silent, new ones pass
    store_event(&client, "billing", &invoice_paid("evt_frozen", "in_2", 100)).await;
    assert!(
        eventually(Duration::from_secs(30), || async { unprocessed(&client).await == 0 }).await,
        "the event stored after the freeze was not processed"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 2);
    worker.stop().await;
}

#[tokio::test]
async fn the_worker_recovers_from_terminated_backends() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let worker = spawn_worker(&db, Registry::with_invoice_handlers(), |s| {
        s.poll_interval = Duration::from_millis(200)
    })
    .await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    assert!(eventually(Duration::from_secs(10), || async { unprocessed(&client).await == 0 }).await);
    let killed = scalar(
        &client,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name LIKE 'inbox-worker%'",
    )
    .await;
    assert!(killed >= 2, "the pool and the listener had sessions: {killed}");
    for i in 2..6 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100)).await;
    }
    assert!(eventually(Duration::from_secs(15), || async { unprocessed(&client).await == 0 }).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 5);
    // The wake-up listener came back too: it is LISTENing again.
    assert!(
        eventually(Duration::from_secs(10), || async {
            scalar(&client, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'inbox-worker-listener'").await == 1
        })
        .await
    );
    worker.stop().await;
}

#[tokio::test]
async fn a_request_abandoned_mid_insert_leaves_no_connection_in_a_transaction() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_writes(&client, "webhook_inbox", "BEFORE INSERT", 1.0).await;
    let app = spawn_app_with(db, |s| s.pool_size = 2).await;
    // Clients that give up after 100 ms, while their inserts are still running.
    for i in 0..4 {
        let body = invoice_paid(&format!("evt_gone_{i}"), "in_1", 100);
        let request = app
            .http
            .post(format!("{}/webhooks/stripe/billing", app.address))
            .header("Stripe-Signature", sign(SECRET_A, &body))
            .body(body)
            .timeout(Duration::from_millis(100))
            .send();
        assert!(request.await.is_err(), "the client gave up");
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(in_transaction(&client, "inbox-ingest").await, 0);
    client.batch_execute("DROP TRIGGER slow ON webhook_inbox").await.unwrap();
    for i in 0..6 {
        let reply = app.post_signed(invoice_paid(&format!("evt_after_{i}"), "in_1", 100)).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
}

#[tokio::test]
async fn an_event_cut_off_mid_transaction_never_returns_its_connection_to_the_pool() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_writes(&client, "ledger_entries", "BEFORE INSERT", 2.0).await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let pool = pool(&db, 1);
    let row = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    // The worker's own deadline (500 ms) ends the event while its booking is still running.
    let limits = Limits { deadline: Duration::from_millis(500), ..test_limits(Duration::from_secs(5)) };
    let outcome = execute(&pool, &Registry::with_invoice_handlers(), &row, &limits).await;
    assert!(matches!(&outcome, Outcome::Failed(e) if e.contains("longer than")), "{outcome:?}");
    let last_error: String =
        client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert!(last_error.contains("longer than"), "{last_error}");
    // The one pooled connection is a fresh one, outside any transaction, with default settings.
    let conn = pool.get().await.unwrap();
    let status: String =
        conn.query_one("SELECT current_setting('statement_timeout')", &[]).await.unwrap().get(0);
    assert_eq!(status, "0");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(in_transaction(&client, "inbox-test").await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 0);
}

#[tokio::test]
async fn transaction_local_limits_do_not_leak_into_the_next_transaction() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let pool = pool(&db, 1); // one connection: the check below runs on the one the event used
    let row = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    let mut conn = Conn::get(&pool).await.unwrap();
    let pid: i32 = conn.client().query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let outcome = executor::execute(
        &mut conn,
        &Registry::with_invoice_handlers(),
        &row,
        &test_limits(Duration::from_millis(700)),
    )
    .await;
    assert_eq!(outcome, Outcome::Processed);
    assert!(conn.is_clean());
    drop(conn);
    let again = pool.get().await.unwrap();
    let row = again
        .query_one(
            "SELECT pg_backend_pid(), current_setting('statement_timeout'), current_setting('lock_timeout'),
                    current_setting('idle_in_transaction_session_timeout'),
                    current_setting('backend_flush_after')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), pid, "same connection");
    assert_eq!(
        (row.get::<_, String>(1), row.get::<_, String>(2), row.get::<_, String>(3), row.get::<_, String>(4)),
        ("0".into(), "0".into(), "0".into(), "0".into())
    );
}

/// A pool whose sessions ask for write-back themselves, as the ingest's, the worker's and the
/// relay's do when they connect directly.
fn direct_pool(db: &TestDb) -> deadpool_postgres::Pool {
    inbox_domain::db::build_pool(
        &db.config().into(),
        &inbox_domain::db::PoolOptions {
            max_size: 1,
            timeout: Duration::from_secs(10),
            application_name: "inbox-test",
            session_statement_timeout: Some(Duration::from_secs(5)),
            session_write_back: true,
            verify_on_checkout: true,
        },
    )
    .unwrap()
}

/// `backend_flush_after` as `client` (a session, or a transaction in one) sees it now.
async fn flush_after(client: &impl deadpool_postgres::GenericClient) -> String {
    client.query_one("SELECT current_setting('backend_flush_after')", &[]).await.unwrap().get(0)
}

/// Why the pipeline asks for it: `store::SESSION_WRITE_BACK_SQL`. Behind a transaction pooler only
/// the transactions' own setting applies, and it must end with them.
#[tokio::test]
async fn the_pipelines_writes_ask_for_write_back_where_the_server_leaves_it_at_0_and_keep_a_value_chosen_for_it(
) {
    use inbox_domain::inbox::store::{set_limits, TransactionLimits, WRITE_BACK};
    let limits = TransactionLimits {
        statement_timeout: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(5),
    };
    let db = TestDb::new().await;
    let client = db.client().await;
    assert_eq!(
        flush_after(&pool(&db, 1).get().await.unwrap()).await,
        "0",
        "the test cluster keeps PostgreSQL's default"
    );
    assert_eq!(WRITE_BACK, "256kB");

    // Connected directly: the whole session.
    let direct = direct_pool(&db);
    assert_eq!(flush_after(&direct.get().await.unwrap()).await, WRITE_BACK);
    // Every transaction with the limits (the worker's, and each one behind a pooler): for the
    // transaction, and then the session's own value again.
    let plain = pool(&db, 1);
    let mut conn = plain.get().await.unwrap();
    assert_eq!(flush_after(&conn).await, "0");
    let tx = conn.transaction().await.unwrap();
    set_limits(&tx, &limits).await.unwrap();
    assert_eq!(flush_after(&tx).await, WRITE_BACK);
    tx.commit().await.unwrap();
    assert_eq!(flush_after(&conn).await, "0");

    // A value an operator chose for the database (or the role, or the server) is kept by both.
    client
        .batch_execute(&format!("ALTER DATABASE \"{}\" SET backend_flush_after = '1MB'", db.name))
        .await
        .unwrap();
    let direct = direct_pool(&db);
    assert_eq!(flush_after(&direct.get().await.unwrap()).await, "1MB");
    let plain = pool(&db, 1);
    let mut conn = plain.get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    set_limits(&tx, &limits).await.unwrap();
    assert_eq!(flush_after(&tx).await, "1MB");
    tx.commit().await.unwrap();
}

fn stalls_mid_transaction<'a>(
    tx: &'a deadpool_postgres::Transaction<'_>,
    _: &'a InboxEvent,
) -> HandlerFuture<'a> {
    Box::pin(async move {
        tx.execute("SELECT 1", &[]).await?;
        tokio::time::sleep(Duration::from_millis(1500)).await; // e.g. a slow call outside the database
        tx.execute("SELECT 1", &[]).await?;
        Ok(())
    })
}

#[tokio::test]
async fn idle_in_transaction_timeout_cuts_a_stalled_event_and_is_recorded() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let pool = pool(&db, 2);
    let mut registry = Registry::new();
    registry.register("invoice.paid", stalls_mid_transaction);
    let row = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    let limits = Limits { idle_timeout: Duration::from_millis(500), ..test_limits(Duration::from_secs(5)) };
    let outcome = execute(&pool, &registry, &row, &limits).await;
    // From the worker, a session the server cut off looks like any lost connection: interrupted.
    assert!(matches!(&outcome, Outcome::Interrupted(_)), "{outcome:?}");
    let last_error: String =
        client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert!(last_error.contains("idle_in_transaction_session_timeout"), "{last_error}");
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND attempts = 0 AND interruptions = 1"
        )
        .await,
        1,
        "the attempt is given back, the interruption counted apart"
    );

    // But a handler that stalls every time must still park one day: once the row has been
    // interrupted as many times in a row as the attempt limit (10 here), its attempts count.
    client.batch_execute("UPDATE webhook_inbox SET interruptions = 10, available_at = now()").await.unwrap();
    let row = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    let outcome = execute(&pool, &registry, &row, &limits).await;
    assert!(matches!(&outcome, Outcome::Interrupted(_)), "{outcome:?}");
    let (attempts, last_error): (i32, String) = {
        let r = client.query_one("SELECT attempts, last_error FROM webhook_inbox", &[]).await.unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(attempts, 1, "counted: {last_error}");
    assert!(last_error.contains("11 times in a row"), "{last_error}");
}
