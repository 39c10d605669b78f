//! Regression tests for promises no other test pins down: the backoff after a failure (never
//! before the failure, at most `min(300, 2^attempts)` s, full jitter over that window, capped at
//! 300 s however many attempts); the shutdown hand-back of rows a worker claimed but never started
//! (a real `inbox-worker run` and a real SIGTERM); and a first processing that fails while a second
//! worker waits on the same row's lock, which then takes the row over and books it once. Each
//! test names the breakage it was seen to fail on.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_domain::handler::{HandlerError, HandlerFuture, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::queue::{Claimed, Failure};
use inbox_test_support::db::{admin_config, scalar, url_with_dbname};
use inbox_test_support::events::invoice_paid;
use inbox_test_support::process::{command, Proc};
use inbox_test_support::proxy::postgres_addr;
use inbox_test_support::worker::{claim, eventually, execute, pool, store_event, test_limits};
use inbox_test_support::TestDb;
use inbox_worker::completer::{self, FailureRecord};
use inbox_worker::conn::Conn;
use inbox_worker::executor::{self, Outcome};
use tokio::sync::watch;

// ---------------------------------------------------------------------------------------------
// Backoff: `available_at = now() + least(300, 2^attempts) * random()` seconds (RECORD_FAILURES_SQL:
// "full jitter"). Its lower bound is 0 — the failure write's own `now()` — not some fraction of
// 2^attempts: a retry may come at once, never before the failure.

/// A handler that always fails.
fn always_fails<'a>(_: &'a deadpool_postgres::Transaction<'_>, _: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async { Err(HandlerError::Other("this handler always fails".to_owned())) })
}

/// High enough that no row of these tests is parked: the backoff is what they measure.
const NO_PARKING: i32 = 1000;

/// One failed row: the attempt its claim counted and where its `available_at` lies, in seconds,
/// from just before the failure write started (`since_before`) and just after it returned
/// (`since_after`). The write's own `now()` lies between, so the backoff it applied is at most
/// `since_before` and at least `since_after`.
#[derive(Debug)]
struct Backoff {
    attempts: i32,
    since_before: f64,
    since_after: f64,
}

impl Backoff {
    /// `min(300, 2^attempts)`: the promised top of the window.
    fn cap(&self) -> f64 {
        2f64.powi(self.attempts).min(300.0)
    }
}

/// Queues `rows` events of a type whose handler always fails, each group at the attempt count
/// given (the attempt the claim counts, so the row is stored one below), claims them all, runs them
/// in one batch and records their failures as the worker does (executor, then completer); returns
/// the backoff each row got.
async fn fail_rows_at(groups: &[(i32, i32)]) -> Vec<Backoff> {
    let db = TestDb::new().await;
    let client = db.client().await;
    for &(attempts, rows) in groups {
        client
            .execute(
                "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, attempts)
                 SELECT 'stripe', 'billing', id, 'test.always_fails',
                        jsonb_build_object('id', id, 'type', 'test.always_fails'), $1::int4 - 1
                   FROM generate_series(1, $2::int4) AS i, format('evt_%s_%s', $1::int4, i) AS id",
                &[&attempts, &rows],
            )
            .await
            .unwrap();
    }
    let total: i32 = groups.iter().map(|g| g.1).sum();
    let pool = pool(&db, 2);
    let claimed = claim(&pool, i64::from(total), Duration::from_secs(600), NO_PARKING).await;
    assert_eq!(claimed.len(), total as usize, "every row claimed, none parked");
    let mut registry = Registry::new();
    registry.register("test.always_fails", always_fails);
    let mut conn = Conn::get(&pool).await.unwrap();
    let outcomes =
        executor::execute_batch(&mut conn, &registry, &claimed, &test_limits(Duration::from_secs(10))).await;
    let failures: Vec<Failure<'_>> = claimed
        .iter()
        .zip(&outcomes)
        .map(|(claimed, outcome)| match outcome {
            Outcome::Failed(error) => Failure { claimed, error },
            other => panic!("the handler always fails, got {other:?}"),
        })
        .collect();
    let clock = "SELECT extract(epoch FROM clock_timestamp())::float8";
    let before: f64 = client.query_one(clock, &[]).await.unwrap().get(0);
    let records = completer::record_failures(&pool, Some(conn), &failures, NO_PARKING).await;
    let after: f64 = client.query_one(clock, &[]).await.unwrap().get(0);
    assert!(records.iter().all(|r| *r == FailureRecord::Retrying), "{records:?}");

    // A failure changes neither the attempt count (the claim counted it) nor the row's state.
    let rows = client
        .query(
            "SELECT attempts, extract(epoch FROM available_at)::float8, last_error,
                    processed_at IS NULL AND parked_at IS NULL
               FROM webhook_inbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), total as usize);
    let mut backoffs = Vec::new();
    for row in rows {
        assert_eq!(row.get::<_, Option<String>>(2).as_deref(), Some("this handler always fails"));
        assert!(row.get::<_, bool>(3), "a failed row stays unprocessed and unparked");
        let available: f64 = row.get(1);
        backoffs.push(Backoff {
            attempts: row.get(0),
            since_before: available - before,
            since_after: available - after,
        });
    }
    let mut counted: BTreeMap<i32, i32> = BTreeMap::new();
    for b in &backoffs {
        *counted.entry(b.attempts).or_default() += 1;
    }
    assert_eq!(counted, groups.iter().copied().collect(), "each row keeps the attempt its claim counted");
    backoffs
}

/// Clock resolution between the server's timestamps (microseconds) and this test's arithmetic.
const TOLERANCE_S: f64 = 0.001;

/// After a failed attempt the row becomes claimable again no sooner than the failure itself and no
/// later than `min(300, 2^attempts)` seconds after it — whatever the attempt: 1 (2 s), 3 (8 s),
/// 8 (256 s), 9 (512 → 300 s), 12, 20. Fails on: a higher cap (3000), a jitter that can go
/// negative (`random() - 0.5`).
#[tokio::test]
async fn a_failed_row_waits_between_zero_and_min_300_or_2_to_the_attempts_seconds() {
    let backoffs = fail_rows_at(&[(1, 30), (3, 30), (8, 30), (9, 30), (12, 30), (20, 30)]).await;
    for b in &backoffs {
        assert!(b.since_before >= -TOLERANCE_S, "available before the failure was written: {b:?}");
        assert!(
            b.since_after <= b.cap() + TOLERANCE_S,
            "backoff over min(300, 2^attempts) = {}: {b:?}",
            b.cap()
        );
    }
}

/// Full jitter: 200 rows failing at attempt 8 (window 256 s) spread over the whole window — some
/// in its first fifth, some in its last, about half below its middle, hardly two alike — instead
/// of all waiting the same time (a thundering herd at every retry). Fails on: `random()` dropped
/// (all at 256 s), no backoff (all at 0 s), a lower cap (60), a jitter that can go negative.
#[tokio::test]
async fn backoff_is_full_jitter_spread_over_the_whole_window() {
    let backoffs = fail_rows_at(&[(8, 200)]).await;
    let window = 256.0;
    let delays: Vec<f64> = backoffs.iter().map(|b| b.since_before).collect();
    let min = delays.iter().copied().fold(f64::INFINITY, f64::min);
    let max = delays.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mean = delays.iter().sum::<f64>() / delays.len() as f64;
    let below_middle = delays.iter().filter(|d| **d < window / 2.0).count();
    let distinct: BTreeSet<u64> = delays.iter().map(|d| (d * 1e3) as u64).collect();
    let summary = format!("min {min:.1} s, max {max:.1} s, mean {mean:.1} s, {below_middle}/200 below 128 s");
    assert!(min < 0.2 * window, "nothing in the window's first fifth: {summary}");
    assert!(max > 0.8 * window, "nothing in the window's last fifth: {summary}");
    // Uniform over 256 s: the mean of 200 is 128 s ± 5 s (one standard deviation), the count
    // below the middle 100 ± 7.
    assert!((100.0..156.0).contains(&mean), "not uniform over the window: {summary}");
    assert!((65..135).contains(&below_middle), "not uniform over the window: {summary}");
    assert!(distinct.len() >= 190, "only {} distinct delays of 200: {summary}", distinct.len());
}

/// However many attempts — up to 999, the last that fails into a retry under the largest
/// `--max-attempts` (1000), where 2^attempts is ~5e300 — no retry waits more than 300 s; and the
/// cap is 300, not less: the late rows come close to it. Fails on: a cap of 3000, a cap of 60, no
/// backoff, a jitter that can go negative.
#[tokio::test]
async fn backoff_never_exceeds_300_seconds_however_many_attempts() {
    let backoffs = fail_rows_at(&[(12, 50), (20, 50), (64, 25), (999, 25)]).await;
    let max = backoffs.iter().map(|b| b.since_before).fold(f64::NEG_INFINITY, f64::max);
    for b in &backoffs {
        assert!(b.since_after <= 300.0 + TOLERANCE_S, "over the 300 s cap: {b:?}");
        assert!(b.since_before >= -TOLERANCE_S, "available before the failure was written: {b:?}");
    }
    assert!(max > 0.8 * 300.0, "150 rows, none above 240 s (max {max:.1} s): the cap is below 300 s");
}

// ---------------------------------------------------------------------------------------------
// Shutdown hand-back, on a real process and a real SIGTERM.

/// A TCP proxy in front of PostgreSQL with a gate: while shut, a new connection is accepted and
/// held, not forwarded, until the gate opens (a database slow to hand out connections); open
/// connections are not touched. Runs on a thread of its own, so a test blocked on a process does
/// not stall the worker's traffic. Stops when dropped.
struct Gate {
    port: u16,
    open: watch::Sender<bool>,
    held: Arc<AtomicUsize>,
}

impl Gate {
    fn start(target: SocketAddr) -> Gate {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (open, mut gate) = watch::channel(true);
        let held = Arc::new(AtomicUsize::new(0));
        let waiting = held.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    tokio::select! {
                        changed = gate.changed() => if changed.is_err() { return },
                        accepted = listener.accept() => {
                            let Ok((mut client, _)) = accepted else { continue };
                            let (mut gate, waiting) = (gate.clone(), waiting.clone());
                            tokio::spawn(async move {
                                if !*gate.borrow_and_update() {
                                    waiting.fetch_add(1, Ordering::SeqCst);
                                    let opened = gate.wait_for(|open| *open).await.is_ok();
                                    waiting.fetch_sub(1, Ordering::SeqCst);
                                    if !opened {
                                        return;
                                    }
                                }
                                if let Ok(mut server) = tokio::net::TcpStream::connect(target).await {
                                    // No Nagle delays: the worker's own socket sets none either.
                                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                                }
                            });
                        }
                    }
                }
            });
        });
        Gate { port, open, held }
    }

    fn shut(&self) {
        self.open.send_replace(false);
    }

    fn open(&self) {
        self.open.send_replace(true);
    }

    /// Connections waiting at the shut gate.
    fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// `DATABASE_URL` of `db` through this gate.
    fn url(&self, db: &TestDb) -> String {
        let config = admin_config();
        let user = config.get_user().unwrap_or("postgres");
        let mut url = format!("host=127.0.0.1 port={} user={user}", self.port);
        if let Some(password) = config.get_password() {
            url.push_str(&format!(" password={}", String::from_utf8_lossy(password)));
        }
        url_with_dbname(&url, &db.name)
    }
}

/// `(event_id, processed, attempts, available_at as epoch seconds)` of every row.
async fn inbox_rows(client: &tokio_postgres::Client) -> Vec<(String, bool, i32, f64)> {
    client
        .query(
            "SELECT event_id, processed_at IS NOT NULL, attempts, extract(epoch FROM available_at)::float8
               FROM webhook_inbox ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// SIGTERM while a worker holds claimed rows it has not started (their batches wait for a
/// database connection): the worker exits 0 within `--shutdown-timeout`; each such row is handed
/// back — unprocessed, its attempt returned (0 again) and available at once (from the hand-back,
/// after the signal), leased to nobody — and the worker reports as many as it handed back; what it
/// had started it finished, booked once. Another worker then books every row once, each in one
/// attempt.
///
/// A worker claims only what it has room for, so the one moment a claimed row waits unstarted is
/// its batch's wait for a connection; a gate in front of PostgreSQL holds new connections to make
/// that moment last until the signal. Fails on: a hand-back that keeps the attempt counted, one
/// that leaves the lease, and a shutdown that runs unstarted batches instead of handing them back.
#[tokio::test]
async fn sigterm_hands_back_claimed_but_unstarted_rows_with_their_attempt_returned_for_another_worker() {
    const ROWS: usize = 12;
    let db = TestDb::new().await;
    let client = db.client().await;
    let gate = Gate::start(postgres_addr());
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", gate.url(&db)).args([
        "run",
        "--poll-interval",
        "100ms",
        "--concurrency",
        "6",
        "--batch-size",
        "2",
        "--shutdown-timeout",
        "10s",
    ]);
    let mut w = Proc::spawn(cmd);
    w.wait_for_line("inbox-worker running", Duration::from_secs(30));
    // Connected: the pool's first connection (the start-up check) and the wake-up listener's.
    let listening = eventually(Duration::from_secs(10), || async {
        scalar(
            &client,
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = 'inbox-worker-listener'",
        )
        .await
            == 1
    })
    .await;
    assert!(listening, "{}", w.output());

    // From now on the worker gets no new connection: its one pooled connection claims batch after
    // batch, and a batch that does not get that connection waits for a new one — claimed, leased,
    // not started.
    gate.shut();
    client.batch_execute("BEGIN").await.unwrap();
    for i in 0..ROWS {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i:02}"), &format!("in_{i:02}"), 100))
            .await;
    }
    client.batch_execute("COMMIT").await.unwrap();
    let all_claimed =
        "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND available_at <= now()";
    let settled = eventually(Duration::from_secs(20), || async {
        gate.held() >= 1 && scalar(&client, all_claimed).await == 0
    })
    .await;
    assert!(settled, "no batch waiting for a connection with every row claimed; {}", w.output());
    let leased: BTreeSet<String> =
        inbox_rows(&client).await.into_iter().filter(|r| !r.1).map(|r| r.0).collect();
    assert!(!leased.is_empty());

    let clock = "SELECT extract(epoch FROM clock_timestamp())::float8";
    let signalled: f64 = client.query_one(clock, &[]).await.unwrap().get(0);
    let started = Instant::now();
    w.signal(libc::SIGTERM);
    w.wait_for_line("stop signal", Duration::from_secs(10));
    gate.open(); // the waiting batches get their connections after the signal
    let status = w.wait(Duration::from_secs(30));
    let took = started.elapsed();
    assert_eq!(status.code(), Some(0), "{}", w.output());
    assert!(took < Duration::from_secs(10), "exited after {took:?}, over --shutdown-timeout");
    let exited: f64 = client.query_one(clock, &[]).await.unwrap().get(0);

    let rows = inbox_rows(&client).await;
    let processed = rows.iter().filter(|r| r.1).count() as i64;
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, processed, "booked once each");
    for (id, done, attempts, available) in &rows {
        if *done {
            assert_eq!(*attempts, 1, "{id}: processed in the attempt it was claimed for");
        } else {
            assert_eq!(*attempts, 0, "{id}: handed back with its attempt returned; {rows:?}");
            assert!(*available <= exited, "{id}: still leased after the worker exited; {rows:?}");
        }
    }
    let handed_back: BTreeSet<String> =
        rows.iter().filter(|r| !r.1 && r.3 >= signalled).map(|r| r.0.clone()).collect();
    assert!(!handed_back.is_empty(), "nothing handed back; {rows:?}\n{}", w.output());
    assert!(handed_back.is_subset(&leased), "handed back {handed_back:?}, claimed before SIGTERM {leased:?}");
    let reported: u64 = w
        .output()
        .lines()
        .filter(|l| l.contains("claimed rows handed back at shutdown"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(reported, handed_back.len() as u64, "{}", w.output());

    let mut next = command("inbox-worker");
    next.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms"]);
    let next = Proc::spawn(next);
    let drained = eventually(Duration::from_secs(30), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await;
    assert!(drained, "{}", next.output());
    assert_eq!(
        scalar(&client, "SELECT count(DISTINCT invoice_id) FROM ledger_entries").await,
        ROWS as i64,
        "every invoice booked"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, ROWS as i64, "none twice");
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, ROWS as i64);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await,
        0,
        "a handed-back row costs no attempt"
    );
}

// ---------------------------------------------------------------------------------------------
// Two processings of one row (a lease expired in between): the second waits on the row lock.

/// A pool whose sessions show `name` as their `application_name`.
fn named_pool(db: &TestDb, name: &'static str) -> deadpool_postgres::Pool {
    inbox_domain::db::build_pool(
        &db.config().into(),
        &inbox_domain::db::PoolOptions {
            max_size: 2,
            timeout: Duration::from_secs(10),
            application_name: name,
            session_statement_timeout: None,
            session_write_back: false,
            verify_on_checkout: true,
        },
    )
    .unwrap()
}

const FIRST: &str = "inbox-test-first";
const SECOND: &str = "inbox-test-second";
/// The advisory lock the first processing's booking waits on while the test holds it.
const HOLD: i64 = 0x5245_4752;

/// Polls `check` every 10 ms until it holds; panics saying `what` after 20 s.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sessions of `application_name` on this database waiting on a lock of kind `event`
/// (`pg_stat_activity.wait_event`: `advisory`, `transactionid`, `tuple`; `%` for any).
async fn waiting_on_lock(client: &tokio_postgres::Client, application_name: &str, event: &str) -> bool {
    let n: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = $1
                AND wait_event_type = 'Lock' AND wait_event LIKE $2",
            &[&application_name, &event],
        )
        .await
        .unwrap()
        .get(0);
    n > 0
}

/// Two processings of one row, the second waiting on the row lock while the first runs.
struct Race {
    /// The first worker's claim (its lease had expired when the second claimed the row).
    first: Claimed,
    first_pool: deadpool_postgres::Pool,
    /// The first processing's outcome (its transaction only: no failure written yet).
    first_outcome: Outcome,
    /// The second processing's outcome, its failure (if any) written as the worker does.
    second_outcome: Outcome,
    /// When the second processing started (epoch seconds, the server's clock).
    second_started: f64,
}

/// Lines up two processings of one `invoice.paid` row for real: the first worker's claim, whose
/// lease then expires; the second worker's claim of the same row; the first processing, held
/// inside its booking (its row lock taken) by an advisory lock the test holds; the second
/// processing, seen waiting on the row's lock. Then lets the first go on — failing if `first_fails`
/// (a trigger raises in its booking), else committing — and waits for both to end.
async fn first_processing_while_a_second_waits(db: &TestDb, first_fails: bool) -> Race {
    let control = db.client().await;
    store_event(&control, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    control
        .batch_execute(&format!(
            "CREATE FUNCTION hold_first_booking() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF current_setting('application_name') = '{FIRST}' THEN
                     PERFORM pg_advisory_xact_lock({HOLD});
                     IF {first_fails} THEN
                         RAISE EXCEPTION 'the first processing fails in its booking';
                     END IF;
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER hold_first BEFORE INSERT ON ledger_entries
                 FOR EACH ROW EXECUTE FUNCTION hold_first_booking();"
        ))
        .await
        .unwrap();
    let (first_pool, second_pool) = (named_pool(db, FIRST), named_pool(db, SECOND));
    let first = claim(&first_pool, 1, Duration::from_millis(1), 10).await.remove(0);
    // The second claim takes the row once the first's lease (1 ms) has expired.
    let deadline = Instant::now() + Duration::from_secs(20);
    let second = loop {
        if let Some(second) = claim(&second_pool, 1, Duration::from_secs(60), 10).await.pop() {
            break second;
        }
        assert!(Instant::now() < deadline, "the first claim's lease never expired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!((first.attempts, second.attempts), (1, 2));

    // Generous limits: the lock waits below end by the test's hand, not by lock_timeout.
    let limits = test_limits(Duration::from_secs(20));
    control.execute("SELECT pg_advisory_lock($1)", &[&HOLD]).await.unwrap();
    let first_run = tokio::spawn({
        let (pool, first) = (first_pool.clone(), first.clone());
        async move {
            let mut conn = Conn::get(&pool).await.unwrap();
            executor::execute(&mut conn, &Registry::with_invoice_handlers(), &first, &limits).await
        }
    });
    until("the first processing never reached its booking", || waiting_on_lock(&control, FIRST, "advisory"))
        .await;
    let second_started: f64 =
        control.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await.unwrap().get(0);
    let second_run = tokio::spawn({
        let pool = second_pool.clone();
        async move { execute(&pool, &Registry::with_invoice_handlers(), &second, &limits).await }
    });
    // The second processing waits on the row the first holds (or, broken, gave up at once).
    until("the second processing neither waited on the row lock nor ended", || async {
        second_run.is_finished() || waiting_on_lock(&control, SECOND, "%").await
    })
    .await;
    control.execute("SELECT pg_advisory_unlock($1)", &[&HOLD]).await.unwrap();
    let first_outcome = first_run.await.unwrap();
    let second_outcome = second_run.await.unwrap();
    Race { first, first_pool, first_outcome, second_outcome, second_started }
}

/// The seed's case: the first processing fails (and rolls back) while a second worker, whose claim
/// followed the first's expired lease, waits on the row's lock; the second then takes the row
/// over — still unprocessed under its lock — and books it: processed once, one ledger entry, one
/// outbox row. The first's failure, written after that, is not recorded over the second's outcome.
/// Fails on: the lock statements skipping locked rows (`SKIP LOCKED`: the second gives up and
/// leaves the row leased), a failure write without its claim fence.
#[tokio::test]
async fn a_first_processing_that_fails_while_a_second_waits_on_the_row_lock_is_taken_over_and_booked_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let race = first_processing_while_a_second_waits(&db, true).await;
    let Outcome::Failed(error) = &race.first_outcome else {
        panic!("the first processing must fail: {:?}", race.first_outcome)
    };
    assert!(error.contains("the first processing fails"), "{error}");
    assert_eq!(race.second_outcome, Outcome::Processed, "the second processing takes the row over");
    // The first worker writes its failure as a worker does, once its transaction rolled back —
    // here after the second committed (the order in which a stale write would do harm).
    let records =
        completer::record_failures(&race.first_pool, None, &[Failure { claimed: &race.first, error }], 10)
            .await;
    assert_eq!(records, [FailureRecord::Superseded]);
    let row = client
        .query_one(
            "SELECT processed_at IS NOT NULL, attempts, last_error, parked_at IS NULL FROM webhook_inbox",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0), "processed");
    assert_eq!(row.get::<_, i32>(1), 2, "the second claim's attempt");
    assert_eq!(row.get::<_, Option<String>>(2), None, "the first's failure is not recorded over it");
    assert!(row.get::<_, bool>(3));
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_1' AND amount = 100")
            .await,
        1
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
    let status: String =
        client.query_one("SELECT status FROM invoices WHERE id = 'in_1'", &[]).await.unwrap().get(0);
    assert_eq!(status, "paid");
}

/// The counterpart: the first processing commits while the second waits on the row's lock; the
/// second, re-checking `processed_at` under the lock, finds the row done and does nothing — the
/// row keeps the first's mark, one ledger entry, one outbox row. Fails on: the `processed_at IS
/// NULL` re-check removed from the lock statements (the second runs the handler again and re-marks
/// the row).
#[tokio::test]
async fn a_first_processing_that_commits_while_a_second_waits_on_the_row_lock_leaves_the_second_nothing_to_do(
) {
    let db = TestDb::new().await;
    let client = db.client().await;
    let race = first_processing_while_a_second_waits(&db, false).await;
    assert_eq!(race.first_outcome, Outcome::Processed);
    assert_eq!(
        race.second_outcome,
        Outcome::AlreadyProcessed,
        "the second finds the row processed under its lock"
    );
    let row = client
        .query_one(
            "SELECT extract(epoch FROM processed_at)::float8, attempts, last_error FROM webhook_inbox",
            &[],
        )
        .await
        .unwrap();
    let processed_at: f64 = row.get(0);
    let second_started = race.second_started;
    assert!(
        processed_at < second_started,
        "processed_at {processed_at} is the first's, not re-marked by the second (started {second_started})"
    );
    assert_eq!(row.get::<_, i32>(1), 2);
    assert_eq!(row.get::<_, Option<String>>(2), None);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
}
