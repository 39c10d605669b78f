//! After PostgreSQL crashed: its cumulative statistics are gone (PostgreSQL 15 discards them in
//! crash recovery), so autovacuum no longer knows of the dead tuples the queue made before, and
//! leaves `webhook_inbox` and its indexes to bloat. The workers find the queue tables without
//! statistics and analyse them (migration V16's function, `store::maintenance`), after which
//! autovacuum vacuums them on its own.
//!
//! The crash is real: a PostgreSQL cluster of this test's own (in `$TMPDIR/inbox-crash-<pid>-<n>`,
//! on a free port of 127.0.0.1, run as the `postgres` user when we are root), its postmaster and
//! every child SIGKILLed as when a machine or a container dies, then started again: crash
//! recovery. `autovacuum_naptime = 1s` and `log_autovacuum_min_duration = 0`, so that autovacuum
//! acts (and says so in the log) within seconds of having a reason to.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use inbox_domain::inbox::store::maintenance::{self, StatsResetAnalysis};
use inbox_domain::inbox::store::TransactionLimits;
use inbox_test_support::db::{connect, scalar};
use inbox_test_support::process::{children, command, run, start_worker_with_metrics, state, Proc};
use inbox_test_support::server_user::{self, as_server, running_as_root, write_as_server};
use inbox_test_support::worker::eventually;
use inbox_test_support::TestDb;
use tokio_postgres::Client;

const ROLES_SQL: &str = include_str!("../../deploy/roles.sql");
const DIR_PREFIX: &str = "inbox-crash-";
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Events the worker processes before the crash, and which are then purged: each leaves a dead
/// row (its claim and its processed mark are HOT updates, pruned on their page without vacuum:
/// V17, V18; the purge's delete is not), well beyond what makes autovacuum vacuum `webhook_inbox`
/// (1000 + 1% of the rows, migration V1).
const EVENTS: i64 = 5000;

/// A single PostgreSQL cluster with database `inbox`, stopped and removed when dropped.
struct Cluster {
    dir: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
}

impl Cluster {
    /// initdb, the settings, start, and database `inbox`. Autovacuum starts off: the dead tuples
    /// made before the crash must still be there when it comes (a vacuum of them before it would
    /// leave nothing to forget); [`Cluster::crash_and_restart`] turns it on for the restart.
    /// Blocking: call it off the runtime.
    fn start() -> Cluster {
        remove_leftovers();
        let dir = std::env::temp_dir().join(format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        if running_as_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:").arg(&dir);
            server_user::run(chown, "chown");
        }
        let port = inbox_test_support::port::free();
        let cluster = Cluster { data: dir.join("data"), log: dir.join("postgres.log"), dir, port };
        let mut initdb = as_server("initdb");
        initdb.arg("-D").arg(&cluster.data).args([
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--auth=trust",
            "--no-sync",
            "--no-instructions",
        ]);
        server_user::run(initdb, "initdb");
        // fsync off: the fault is a killed server, not a machine that lost its page cache.
        // dynamic_shared_memory_type = mmap: a killed server leaves nothing in /dev/shm.
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             max_connections = 40\nshared_buffers = 32MB\nfsync = off\n\
             dynamic_shared_memory_type = mmap\n\
             autovacuum = off\nautovacuum_naptime = 1s\nlog_autovacuum_min_duration = 0\n\
             log_line_prefix = '%m [%p] %q%a '\nlogging_collector = off\n",
            cluster.port,
            cluster.dir.display()
        );
        write_as_server(&cluster.data.join("postgresql.auto.conf"), &conf, false);
        write_as_server(
            &cluster.data.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n",
            false,
        );
        cluster.pg_ctl_start();
        let mut psql = as_server("psql");
        psql.args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&cluster.dir)
            .args(["-p", &cluster.port.to_string(), "-U", "postgres", "-d", "postgres"])
            .args(["-c", "CREATE DATABASE inbox"]);
        server_user::run(psql, "CREATE DATABASE inbox");
        cluster
    }

    fn pg_ctl_start(&self) {
        let mut start = as_server("pg_ctl");
        start.arg("-D").arg(&self.data).arg("-l").arg(&self.log).args(["-w", "-t", "60", "start"]);
        start.stdout(Stdio::null()).stderr(Stdio::null());
        let status = start.status().expect("pg_ctl start");
        assert!(status.success(), "pg_ctl start failed:\n{}", self.log_tail());
    }

    fn url(&self, role: &str) -> String {
        format!("postgres://{role}@127.0.0.1:{}/inbox", self.port)
    }

    async fn client(&self) -> Client {
        connect(&self.url("postgres").parse().unwrap()).await
    }

    fn postmaster(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// SIGKILL of the postmaster and every child of it (backends, checkpointer, autovacuum…), as a
    /// machine or a container dies: nothing written, nothing shut down. The postmaster is stopped
    /// first so that it forks nothing while its children are listed. Then `pg_ctl start`: crash
    /// recovery (asserted from the server's log), with autovacuum on.
    fn crash_and_restart(&self) {
        let pid = self.postmaster().expect("postmaster.pid");
        assert!(matches!(state(pid), Some(s) if s != 'Z'), "the postmaster {pid} is not running");
        inbox_test_support::process::kill(pid, libc::SIGSTOP);
        let children = children(pid);
        assert!(!children.is_empty(), "the postmaster {pid} has no children");
        for child in &children {
            inbox_test_support::process::kill(*child, libc::SIGKILL);
        }
        inbox_test_support::process::kill(pid, libc::SIGKILL);
        let gone = |p: i32| matches!(state(p), None | Some('Z'));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !gone(pid) || !children.iter().all(|c| gone(*c)) {
            assert!(Instant::now() < deadline, "the server's processes outlived SIGKILL");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The dead postmaster was adopted by init, which reaps it in its own time; until then its
        // pid still answers kill(pid, 0), and the new postmaster would take the lock files (the
        // data directory's and the socket's) for those of a live one. A dead process's lock files
        // are stale: removed, as an operator would once the process is gone.
        let deadline = Instant::now() + Duration::from_secs(5);
        while state(pid).is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if state(pid).is_some() {
            let mut rm = as_server("rm");
            rm.arg("-f")
                .arg(self.data.join("postmaster.pid"))
                .arg(self.dir.join(format!(".s.PGSQL.{}.lock", self.port)));
            server_user::run(rm, "removing the dead postmaster's lock files");
        }
        let log_before = std::fs::read_to_string(&self.log).unwrap_or_default().len();
        self.pg_ctl_start();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(
            log[log_before..].contains("not properly shut down; automatic recovery in progress"),
            "the restart did not run crash recovery:\n{}",
            self.log_tail()
        );
    }

    /// The server's log since byte `from`.
    fn log_since(&self, from: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.get(from..).unwrap_or_default().to_owned()
    }

    fn log_len(&self) -> usize {
        std::fs::metadata(&self.log).map_or(0, |m| m.len() as usize)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    fn stop(data: &Path) {
        if data.join("postmaster.pid").exists() {
            let mut stop = as_server("pg_ctl");
            stop.arg("-D").arg(data).args(["-m", "immediate", "-w", "-t", "30", "stop"]);
            let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        Cluster::stop(&self.data);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Stops and removes the clusters of test processes that died before their clean-up.
fn remove_leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(DIR_PREFIX).and_then(|rest| rest.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else { continue };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        Cluster::stop(&entry.path().join("data"));
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

/// What `pg_stat_user_tables` says of a table, and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TableStats {
    live: i64,
    dead: i64,
    /// last_analyze (an ANALYZE by a session: the worker's) and last_autoanalyze.
    analyzed: bool,
    autoanalyzed: bool,
    vacuumed: bool,
    autovacuumed: bool,
    /// vacuum_count + autovacuum_count + analyze_count + autoanalyze_count.
    maintenance_count: i64,
    bytes: i64,
}

impl TableStats {
    /// What crash recovery leaves: nothing counted, nothing recorded.
    fn reset(&self) -> bool {
        self.live == 0
            && self.dead == 0
            && !(self.analyzed || self.autoanalyzed || self.vacuumed || self.autovacuumed)
            && self.maintenance_count == 0
    }
}

async fn table_stats(client: &Client, table: &str) -> TableStats {
    client.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
    let row = client
        .query_one(
            "SELECT n_live_tup, n_dead_tup, last_analyze IS NOT NULL, last_autoanalyze IS NOT NULL,
                    last_vacuum IS NOT NULL, last_autovacuum IS NOT NULL,
                    vacuum_count + autovacuum_count + analyze_count + autoanalyze_count,
                    pg_relation_size(relid)
               FROM pg_stat_user_tables WHERE relname = $1",
            &[&table],
        )
        .await
        .unwrap();
    TableStats {
        live: row.get(0),
        dead: row.get(1),
        analyzed: row.get(2),
        autoanalyzed: row.get(3),
        vacuumed: row.get(4),
        autovacuumed: row.get(5),
        maintenance_count: row.get(6),
        bytes: row.get(7),
    }
}

/// Polls `table`'s statistics until `done` holds of them or `timeout` passes: whether it held, and
/// the last ones read.
async fn stats_until(
    client: &Client,
    table: &str,
    timeout: Duration,
    done: impl Fn(&TableStats) -> bool,
) -> (bool, TableStats) {
    let deadline = Instant::now() + timeout;
    loop {
        let stats = table_stats(client, table).await;
        if done(&stats) || Instant::now() > deadline {
            return (done(&stats), stats);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `inbox-worker run` as inbox_worker, marking every event processed with no effect, serving
/// its metrics; returns it and its metrics address.
fn start_worker(cluster: &Cluster) -> (Proc, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", cluster.url("inbox_worker")).args([
        "run",
        "--ignore",
        "*",
        "--poll-interval",
        "100ms",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    start_worker_with_metrics(cmd)
}

/// `inbox_worker_stats_reset_analyses_total{table="<table>"}` as the worker at `address` serves it.
async fn analyses_counted(address: &str, table: &str) -> Option<f64> {
    let text = inbox_test_support::app::http_client()
        .get(format!("http://{address}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!("inbox_worker_stats_reset_analyses_total{{table=\"{table}\"}} ");
    text.lines().find_map(|line| line.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn after_postgres_crashed_the_worker_analyses_the_inbox_so_that_autovacuum_vacuums_what_the_crash_made_it_forget(
) {
    let started = Instant::now();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let mut migrate = command("inbox-worker");
    migrate.env("DATABASE_URL", cluster.url("postgres")).arg("migrate");
    let (code, output) =
        tokio::task::spawn_blocking(move || run(migrate, Duration::from_secs(60))).await.unwrap();
    assert_eq!(code, 0, "migrate: {output}");
    let admin = cluster.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");

    // A queue's life before the crash: events stored, claimed and marked processed by the worker
    // (as inbox_worker, the production role) and purged, and outbox rows written and marked
    // published.
    admin
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_crash_' || g, 'customer.created',
                    jsonb_build_object('id', 'evt_crash_' || g, 'object', 'event',
                                       'type', 'customer.created', 'created', 1767225600,
                                       'livemode', false, 'api_version', '2025-03-31.basil',
                                       'data', jsonb_build_object('object', jsonb_build_object(
                                           'id', 'cus_' || g, 'object', 'customer',
                                           'description', repeat('x', 400))))
               FROM generate_series(1, $1::int8) AS g",
            &[&EVENTS],
        )
        .await
        .unwrap();
    admin
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'invoice', 'in_crash_' || g, 'invoice.paid', '{}' FROM generate_series(1, 300) AS g;
             UPDATE outbox SET published_at = now();",
        )
        .await
        .unwrap();
    let (mut worker, _) = start_worker(&cluster);
    let drained = eventually(Duration::from_secs(120), || async {
        scalar(&admin, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await;
    assert!(drained, "the worker did not process the events:\n{}", worker.output());
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(Duration::from_secs(30)).success(), "{}", worker.output());
    // The retention passed for most of them: `purge` deletes those (the rest keep the table's
    // pages from being truncated away by the vacuum below, for the second crash).
    admin
        .batch_execute("DELETE FROM webhook_inbox WHERE processed_at IS NOT NULL AND event_id NOT LIKE '%0'")
        .await
        .unwrap();
    let processed_at = started.elapsed();
    // The worker's sessions report their counts as they end.
    let (counted, before) =
        stats_until(&admin, "webhook_inbox", Duration::from_secs(15), |s| s.dead > 1000 + EVENTS / 100).await;
    assert!(counted, "the processing's dead tuples are not counted: {before:?}");
    assert!(!before.autovacuumed && !before.vacuumed, "nothing vacuumed them before the crash: {before:?}");
    drop(admin);

    // The crash. Autovacuum is on from the restart.
    let admin_before_crash = cluster.client().await;
    admin_before_crash.batch_execute("ALTER SYSTEM SET autovacuum = on").await.unwrap();
    drop(admin_before_crash);
    let log_at_crash = cluster.log_len();
    let crash = Instant::now();
    let cluster = crash_and_restart(cluster).await;
    let restarted_in = crash.elapsed();
    let admin = cluster.client().await;

    // The premise: the statistics are gone while the table and its dead tuples are not.
    let after = table_stats(&admin, "webhook_inbox").await;
    assert!(
        after.reset() && after.bytes > 0,
        "crash recovery did not reset webhook_inbox's statistics — the premise of this test: \
         before the crash {before:?}, after {after:?}"
    );
    let outbox_after = table_stats(&admin, "outbox").await;
    assert!(outbox_after.reset() && outbox_after.bytes > 0, "outbox's statistics: {outbox_after:?}");
    // On its own, autovacuum forgot them: five of its rounds go by and it does nothing.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let forgotten = table_stats(&admin, "webhook_inbox").await;
    assert!(forgotten.reset(), "autovacuum did something after all: {forgotten:?}");
    assert!(
        !cluster.log_since(log_at_crash).contains("automatic vacuum of table \"inbox.public.webhook_inbox\""),
        "{}",
        cluster.log_tail()
    );

    // The worker starts, finds the queue tables without statistics and analyses them: the dead
    // tuples are counted again...
    let worker_start = Instant::now();
    let (worker, address) = start_worker(&cluster);
    let (found, analysed) =
        stats_until(&admin, "webhook_inbox", Duration::from_secs(30), |s| s.analyzed).await;
    let analysed_in = worker_start.elapsed();
    assert!(found, "the worker did not analyse webhook_inbox: {analysed:?}\n{}", worker.output());
    assert!(
        analysed.dead > 1000 + analysed.live / 100,
        "the analyse counts the dead tuples again, beyond autovacuum's threshold: {analysed:?}"
    );
    // The analyse can show in the statistics before the worker's log lines have been read; the
    // two tables' lines in either order.
    worker.wait_for_output("analysed webhook_inbox", Duration::from_secs(10));
    let output = worker.wait_for_output("analysed outbox", Duration::from_secs(10));
    let line = output
        .lines()
        .find(|line| line.contains("analysed webhook_inbox"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no log line of the analyse:\n{}", worker.output()));
    let log: serde_json::Value = serde_json::from_str(&line).expect("a json log line");
    assert_eq!(
        (log["level"].as_str(), log["table"].as_str()),
        (Some("INFO"), Some("webhook_inbox")),
        "{line}"
    );
    assert!(log["dead_tuples"].as_i64().is_some_and(|d| d > 1000), "{line}");
    assert_eq!(analyses_counted(&address, "webhook_inbox").await, Some(1.0));
    assert_eq!(analyses_counted(&address, "outbox").await, Some(1.0));

    // ...and autovacuum vacuums them on its own.
    let analysed_at = Instant::now();
    let (done, vacuumed) =
        stats_until(&admin, "webhook_inbox", Duration::from_secs(60), |s| s.autovacuumed && s.dead < 100)
            .await;
    let vacuumed_in = analysed_at.elapsed();
    assert!(done, "autovacuum did not vacuum webhook_inbox: {vacuumed:?}\n{}", cluster.log_tail());
    assert!(
        cluster.log_since(log_at_crash).contains("automatic vacuum of table \"inbox.public.webhook_inbox\""),
        "{}",
        cluster.log_tail()
    );

    // A worker that runs through a crash, reconnecting, finds the tables without statistics again
    // at one of its next checks (every 30 s), and analyses them once more.
    let second_crash = Instant::now();
    let cluster = crash_and_restart(cluster).await;
    let admin = cluster.client().await;
    let after = table_stats(&admin, "webhook_inbox").await;
    assert!(!after.autovacuumed, "the second crash reset the statistics (last_autovacuum): {after:?}");
    let again = eventually(Duration::from_secs(45), || async {
        table_stats(&admin, "webhook_inbox").await.analyzed
            && analyses_counted(&address, "webhook_inbox").await == Some(2.0)
    })
    .await;
    let again_in = second_crash.elapsed();
    assert!(again, "the running worker did not analyse webhook_inbox again:\n{}", worker.output());

    eprintln!(
        "after_crash timings: setup and {EVENTS} events processed {processed_at:.1?}; crash and restart \
         {restarted_in:.1?}; worker started -> webhook_inbox analysed {analysed_in:.1?} \
         (n_dead_tup {} re-estimated, {} before the crash; {} bytes); analysed -> autovacuumed {vacuumed_in:.1?} \
         (n_dead_tup {}); second crash -> analysed by the running worker {again_in:.1?}; total {:.1?}",
        analysed.dead,
        before.dead,
        analysed.bytes,
        vacuumed.dead,
        started.elapsed()
    );
}

/// [`Cluster::crash_and_restart`], off the runtime.
async fn crash_and_restart(cluster: Cluster) -> Cluster {
    tokio::task::spawn_blocking(move || {
        cluster.crash_and_restart();
        cluster
    })
    .await
    .unwrap()
}

/// The tables a check found, and whether it analysed each.
fn found(analyses: &[StatsResetAnalysis]) -> Vec<(&str, bool)> {
    analyses.iter().map(|a| (a.table.as_str(), a.analysed)).collect()
}

/// V16's check is the workers' alone — SECURITY DEFINER, owned by inbox_owner once
/// deploy/roles.sql ran, its search_path pinned, executable by inbox_worker (and inbox_fetcher, a
/// member) and no other role — and they need it: inbox_worker may not ANALYZE the inbox itself. It
/// analyses a queue table whose statistics record no vacuum or analyse while it has pages, once;
/// not an empty one; not while another VACUUM or ANALYZE holds it (it says so, without waiting).
#[tokio::test]
async fn only_the_workers_run_the_statistics_check_which_analyses_a_queue_table_without_statistics_once() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    let function = admin
        .query_one(
            "SELECT pg_get_userbyid(proowner), prosecdef, proconfig FROM pg_proc
              WHERE oid = 'inbox_analyze_after_stats_reset()'::regprocedure",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(function.get::<_, String>(0), "inbox_owner", "the tables' owner: it may ANALYZE them");
    assert!(function.get::<_, bool>(1), "SECURITY DEFINER");
    assert_eq!(function.get::<_, Vec<String>>(2), vec!["search_path=public, pg_temp".to_owned()]);
    for (role, may) in [
        ("inbox_worker", true),
        ("inbox_fetcher", true),
        ("inbox_ingest", false),
        ("inbox_relay", false),
        ("inbox_operator", false),
        ("inbox_console", false),
        ("inbox_metrics", false),
        ("inbox_reconciler", false),
    ] {
        let granted: bool = admin
            .query_one(
                "SELECT has_function_privilege($1, 'inbox_analyze_after_stats_reset()', 'EXECUTE')",
                &[&role],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(granted, may, "{role} may execute inbox_analyze_after_stats_reset()");
    }

    admin
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_' || g, 'customer.created', '{}' FROM generate_series(1, 200) AS g",
            &[],
        )
        .await
        .unwrap();
    let mut config = db.config();
    config.user("inbox_worker");
    let mut worker = connect(&config).await;
    // PostgreSQL 15 skips an ANALYZE by a role that does not own the table (with a warning).
    worker.batch_execute("ANALYZE webhook_inbox").await.unwrap();
    assert!(!table_stats(&admin, "webhook_inbox").await.analyzed, "inbox_worker analysed the inbox itself");

    let limits = TransactionLimits {
        statement_timeout: Duration::from_secs(30),
        lock_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(30),
    };
    // A new database's tables have no statistics yet: the empty outbox needs no analyse; the
    // inbox and its queue (the 200 rows are unprocessed) do.
    let first = maintenance::analyze_after_stats_reset(&mut worker, &limits).await.unwrap();
    assert_eq!(found(&first), vec![("webhook_inbox", true), ("webhook_inbox_queue", true)], "{first:?}");
    assert_eq!((first[1].live_tuples, first[1].dead_tuples), (Some(200), Some(0)), "{first:?}");
    assert_eq!((first[0].live_tuples, first[0].dead_tuples), (Some(200), Some(0)), "{first:?}");
    assert!(first[0].bytes > 0, "{first:?}");
    assert!(table_stats(&admin, "webhook_inbox").await.analyzed);
    let second = maintenance::analyze_after_stats_reset(&mut worker, &limits).await.unwrap();
    assert!(second.is_empty(), "analysed once, then its statistics are there: {second:?}");

    // Its statistics reset, as crash recovery resets every table's.
    admin
        .batch_execute("SELECT pg_stat_reset_single_table_counters('webhook_inbox'::regclass)")
        .await
        .unwrap();
    assert!(table_stats(&admin, "webhook_inbox").await.reset());
    // Autovacuum (or an operator's VACUUM) holds the table: not waited for, said, left for later.
    let vacuum = db.client().await;
    vacuum.batch_execute("BEGIN; LOCK TABLE webhook_inbox IN SHARE UPDATE EXCLUSIVE MODE").await.unwrap();
    let busy = maintenance::analyze_after_stats_reset(&mut worker, &limits).await.unwrap();
    assert_eq!(found(&busy), vec![("webhook_inbox", false)], "{busy:?}");
    assert!(table_stats(&admin, "webhook_inbox").await.reset());
    vacuum.batch_execute("COMMIT").await.unwrap();
    let again = maintenance::analyze_after_stats_reset(&mut worker, &limits).await.unwrap();
    assert_eq!(found(&again), vec![("webhook_inbox", true)], "{again:?}");
    assert_eq!(again[0].live_tuples, Some(200), "{again:?}");
}
