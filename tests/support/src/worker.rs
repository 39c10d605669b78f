//! The worker in-process and its building blocks, against a test database.

use std::future::Future;
use std::time::{Duration, Instant};

use inbox_domain::handler::Registry;
use inbox_domain::inbox::store::queue::Claimed;
use inbox_domain::inbox::store::queue::Failure;
use inbox_worker::conn::Conn;
use inbox_worker::executor::{self, Limits, Outcome};
use inbox_worker::producer::Capacity;
use inbox_worker::runner::{self, Settings};
use tokio_util::sync::CancellationToken;

use crate::db::TestDb;

/// Worker settings for tests: 4 in flight (one transaction), 32 MiB, 10 attempts, 10 s lease,
/// 2 s statement timeout, 100 ms poll.
pub fn test_settings(db: &TestDb) -> Settings {
    Settings {
        database: db.config().into(),
        max_attempts: 10,
        capacity: Capacity::new(4, 4, 32 << 20),
        lease: Duration::from_secs(10),
        limits: test_limits(Duration::from_secs(2)),
        poll_interval: Duration::from_millis(100),
        metrics_listen: None,
        shutdown_timeout: Duration::from_secs(10),
        program: "inbox-test-worker".to_owned(),
        fetcher: None,
    }
}

/// Limits as `run` derives them from a statement timeout.
pub fn test_limits(statement_timeout: Duration) -> Limits {
    Limits {
        pooler: inbox_domain::db::Pooler::None,
        statement_timeout,
        lock_timeout: statement_timeout / 2,
        idle_timeout: statement_timeout,
        deadline: statement_timeout * 4,
    }
}

/// A claim of every event type (what `run --ignore '*'` claims), for tests of the claim itself.
pub const EVERY_TYPE: inbox_domain::handler::ClaimFilter =
    inbox_domain::handler::ClaimFilter { all: true, exact: Vec::new(), prefixes: Vec::new() };

/// A worker running in this process.
pub struct TestWorker {
    pub shutdown: CancellationToken,
    pub done: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl TestWorker {
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.done.await.unwrap().unwrap();
    }
}

pub async fn spawn_worker(db: &TestDb, registry: Registry, adjust: impl FnOnce(&mut Settings)) -> TestWorker {
    let mut settings = test_settings(db);
    adjust(&mut settings);
    let shutdown = CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let done = tokio::spawn(runner::run_with(settings, registry, shutdown.clone(), move |_| async move {
        let _ = tx.send(());
    }));
    rx.await.expect("the worker started");
    TestWorker { shutdown, done }
}

/// A pool of `size` connections to `db` (for the executor's building blocks).
pub fn pool(db: &TestDb, size: usize) -> deadpool_postgres::Pool {
    inbox_domain::db::build_pool(
        &db.config().into(),
        &inbox_domain::db::PoolOptions {
            max_size: size,
            timeout: Duration::from_secs(10),
            application_name: "inbox-test",
            session_statement_timeout: None,
            session_write_back: false,
            verify_on_checkout: true,
        },
    )
    .unwrap()
}

/// Claims up to `n` rows of any type with `lease`; returns the claimed rows (not those the claim
/// parked).
pub async fn claim(
    pool: &deadpool_postgres::Pool,
    n: i64,
    lease: Duration,
    max_attempts: i32,
) -> Vec<Claimed> {
    let client = pool.get().await.unwrap();
    inbox_domain::inbox::store::queue::claim(
        &client,
        inbox_domain::db::Pooler::None,
        &EVERY_TYPE,
        None,
        max_attempts,
        n,
        i64::MAX,
        lease,
        Duration::from_secs(10),
    )
    .await
    .unwrap()
    .claimed
}

/// Claims up to `n` rows of the types `registry` handles or ignores, as a worker with it does.
pub async fn claim_for(
    pool: &deadpool_postgres::Pool,
    registry: &Registry,
    n: i64,
    lease: Duration,
    max_attempts: i32,
) -> Vec<Claimed> {
    let client = pool.get().await.unwrap();
    inbox_domain::inbox::store::queue::claim(
        &client,
        inbox_domain::db::Pooler::None,
        &registry.claim_filter(),
        None,
        max_attempts,
        n,
        i64::MAX,
        lease,
        Duration::from_secs(10),
    )
    .await
    .unwrap()
    .claimed
}

/// Executes one claimed row and, on failure, records it — or, when an infrastructure fault
/// interrupted it, gives its attempt back (as the worker does; attempt limit 10).
pub async fn execute(
    pool: &deadpool_postgres::Pool,
    registry: &Registry,
    claimed: &Claimed,
    limits: &Limits,
) -> Outcome {
    let mut conn = Conn::get(pool).await.unwrap();
    let outcome = executor::execute(&mut conn, registry, claimed, limits).await;
    match &outcome {
        Outcome::Failed(error) => {
            inbox_worker::completer::record_failures(pool, Some(conn), &[Failure { claimed, error }], 10)
                .await;
        }
        Outcome::Interrupted(error) => {
            inbox_worker::completer::return_interrupted(pool, std::slice::from_ref(claimed), error, 10).await;
        }
        _ => {}
    }
    outcome
}

/// Stores an event row directly (as the ingest would).
pub async fn store_event(client: &tokio_postgres::Client, endpoint: &str, body: &[u8]) {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             VALUES ('stripe', $1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[&endpoint, &value["id"].as_str().unwrap(), &value["type"].as_str().unwrap(), &value],
        )
        .await
        .unwrap();
}

/// Polls `check` until it returns true or `timeout` passes; returns whether it did.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
