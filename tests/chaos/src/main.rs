//! `make chaos`: the whole system under Stripe-like load while processes, connections and the
//! PostgreSQL server are killed, then a check that no acknowledged event was lost and no payment
//! booked twice.
//!
//! Runs on a PostgreSQL cluster of its own (`--cluster own`, the default where `initdb` is
//! installed: created in `$TMPDIR`, removed at the end), so that it may restart the server, take
//! every connection slot and fill the disk under the WAL without touching anybody's databases;
//! there the ingest and the workers connect as the production roles of `deploy/roles.sql`
//! (`inbox_ingest`, `inbox_worker`), the faults as a superuser. With `--cluster url` it runs on the
//! server of `DATABASE_URL` instead (`scripts/with-db.sh` sets the local cluster's), in a database
//! of its own, `inbox_chaos_<pid>`, dropped at the end unless `--keep`; the faults that hit the
//! whole server are then skipped, and restarts run only on the cluster of `scripts/pg.sh`.
//!
//! Starts two `inbox-ingest`, three `inbox-worker run` and four `inbox-worker relay` (two to an
//! HTTP receiver, two to NATS JetStream: `relay.rs`) from `target/debug` (or `$INBOX_BIN_DIR`), a
//! load generator and a fault injector (`faults.rs` lists the faults: process kills and freezes,
//! terminated backends, blocked connections, restarts of PostgreSQL and of nats-server, an xmin
//! pinned by a session idle in transaction, the server's connections exhausted by another client,
//! the WAL's disk full); after
//! `--duration` it stops the faults, lets the senders finish their retries, waits for the queue to
//! drain and for the relays to deliver the outbox, and checks the database and both
//! destinations. Prints a report and writes it to `target/chaos/report.json`:
//! besides the checks, how often each fault ran (and why one was skipped), webhook_inbox's dead
//! tuples and size before, during and after, and what the server's log says (PANICs, refusals).
//! Exits 0 only when nothing was lost, doubled, stuck or parked and every fault kind that can run
//! here was injected.

#![recursion_limit = "256"]

mod check;
mod cluster;
mod faults;
mod load;
mod procs;
mod relay;
mod rng;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::faults::{Faults, Kind, Server, KINDS};
use crate::load::Load;
use crate::procs::{RelaySpec, Spec, Supervisor};
use crate::rng::Rng;

/// Chaos run of stripe-inbox: Stripe-like load, faults, then a check of every acknowledged event.
#[derive(Debug, Parser)]
#[command(name = "chaos", max_term_width = 100)]
struct Args {
    /// How long load and faults run (then: final retries, drain, checks).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// New events offered per second.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// HTTP requests in flight at most.
    #[arg(long, default_value_t = 16)]
    senders: usize,
    /// Mean time between two faults (each wait is 0.5–1.5 times this).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    fault_interval: Duration,
    /// Seed of every random choice [default: from the clock].
    #[arg(long)]
    seed: Option<u64>,
    /// After the duration, how long the senders keep retrying unacknowledged events.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    final_retry: Duration,
    /// How long to wait for the queue to drain before checking.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Number of inbox-ingest processes.
    #[arg(long, default_value_t = 2)]
    ingests: usize,
    /// Number of inbox-worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// The workers' --max-attempts (high, so that faults do not park legitimate events).
    #[arg(long, default_value_t = 50)]
    max_attempts: u32,
    /// Keep the chaos database (and print its URL) instead of dropping it; with `--cluster own`,
    /// the whole cluster, until the next run.
    #[arg(long)]
    keep: bool,
    /// Where PostgreSQL comes from: `own` (a cluster the run creates and removes: needed by
    /// pool_exhausted and wal_disk_full), `url` (the server of DATABASE_URL), `auto` (own where
    /// initdb and pg_ctl are installed, else url).
    #[arg(long, value_enum, default_value_t = ClusterMode::Auto)]
    cluster: ClusterMode,
    /// How long the xmin_pinned fault holds its snapshot [default: min(60 s, duration / 3)].
    #[arg(long, value_parser = humantime::parse_duration)]
    xmin_pin: Option<Duration>,
    /// Where report.json and logs/ go [default: <repo>/target/chaos].
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Self-test of the checks: after the drain, delete one acknowledged row, add a second outbox
    /// row for one payment (marked published: no relay delivers it), un-process one row and park
    /// another; the run must then FAIL with lost, doubled, stuck and parked at 1, and one outbox
    /// row lost for each relay destination.
    #[arg(long, hide = true)]
    sabotage: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ClusterMode {
    Auto,
    Own,
    Url,
}

const SECRET: &str = inbox_test_support::events::SECRET_A;
const DB_PREFIX: &str = "inbox_chaos_";
/// The role `pool_exhausted` connects as on the run's own cluster (no superuser: the reserve
/// stays for the fault injector).
const HOG_ROLE: &str = "chaos_hog";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("chaos: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let root = repo_root();
    let out_dir = args.out_dir.clone().unwrap_or_else(|| root.join("target/chaos"));
    let log_dir = out_dir.join("logs");
    if log_dir.exists() {
        std::fs::remove_dir_all(&log_dir).context("clearing the old logs")?;
    }
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
            as u64
    });
    let mut rng = Rng::new(seed);

    let own = match args.cluster {
        ClusterMode::Own => {
            cluster::available().map_err(|e| anyhow::anyhow!("--cluster own: {e}"))?;
            true
        }
        ClusterMode::Url => false,
        ClusterMode::Auto => match cluster::available() {
            Ok(()) => true,
            Err(e) => {
                println!("chaos: no cluster of our own ({e}): running on DATABASE_URL's server");
                false
            }
        },
    };
    let (cluster, admin_url, server) = if own {
        let port = inbox_test_support::port::free();
        let dir = log_dir.clone();
        let mut cluster = tokio::task::spawn_blocking(move || Cluster::create(port, &dir))
            .await?
            .context("creating the run's own PostgreSQL cluster")?;
        cluster.keep = args.keep;
        let cluster = Arc::new(cluster);
        println!(
            "chaos: PostgreSQL cluster of our own in {} on port {}; pg_wal {}",
            cluster.dir.display(),
            cluster.port,
            match &cluster.wal_fs {
                Ok(mount) => format!("on a {} MiB tmpfs at {}", cluster::WAL_FS_MIB, mount.display()),
                Err(why) => format!("in the data directory ({why})"),
            }
        );
        let url = cluster.url("postgres", "postgres");
        (Some(cluster.clone()), url, Server::Own(cluster))
    } else {
        let url = std::env::var("DATABASE_URL")
            .context("DATABASE_URL is not set (run `make chaos`, which starts the local PostgreSQL)")?;
        let config: tokio_postgres::Config =
            url.parse().context("DATABASE_URL is not a valid connection string")?;
        let server = match local_cluster(&root, &config) {
            (true, _) => Server::PgSh(root.clone()),
            (false, note) => {
                println!("chaos: PostgreSQL restarts skipped: {note}");
                Server::Foreign
            }
        };
        (None, url, server)
    };
    let admin: tokio_postgres::Config = admin_url.parse().context("the admin URL is not valid")?;

    // A database of our own; leftovers of killed runs go first.
    let database = format!("{DB_PREFIX}{}", std::process::id());
    let client = faults::connect(&admin).await.context("connecting to DATABASE_URL")?;
    let server_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    for r in
        client.query("SELECT datname FROM pg_database WHERE datname LIKE 'inbox\\_chaos\\_%'", &[]).await?
    {
        let name: String = r.get(0);
        let pid = name.trim_start_matches(DB_PREFIX).parse::<u32>().ok();
        if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
            println!("chaos: dropping the leftover database {name}");
            client.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await?;
        }
    }
    client
        .batch_execute(&format!("CREATE DATABASE \"{database}\""))
        .await
        .context("creating the chaos database")?;
    drop(client);
    let database_url = inbox_test_support::db::url_with_dbname(&admin_url, &database);
    let mut db_config = admin.clone();
    db_config.dbname(&database);

    let result = chaos(
        &args,
        seed,
        &mut rng,
        Target {
            admin: &admin,
            database: &database,
            database_url: &database_url,
            db_config: &db_config,
            server,
        },
        &log_dir,
        &out_dir,
        &root,
        &server_version,
    )
    .await;

    // Clean up whatever happened.
    let _ = faults::allow_connections(&admin, &database).await;
    if args.keep {
        println!("chaos: kept the database: {database_url}");
    } else if let Some(cluster) = cluster {
        // Stops and deletes the cluster (unless the run is still holding it, which it is not).
        tokio::task::spawn_blocking(move || drop(cluster)).await?;
    } else if let Ok(client) = faults::connect(&admin).await {
        if let Err(e) =
            client.batch_execute(&format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)")).await
        {
            eprintln!("chaos: dropping {database}: {e}");
        }
    }
    result
}

/// The database the run uses and how it reaches it.
struct Target<'a> {
    /// A superuser's settings, on the server's admin database.
    admin: &'a tokio_postgres::Config,
    database: &'a str,
    /// A superuser's URL and settings on the chaos database.
    database_url: &'a str,
    db_config: &'a tokio_postgres::Config,
    server: Server,
}

#[allow(clippy::too_many_arguments)]
async fn chaos(
    args: &Args,
    seed: u64,
    rng: &mut Rng,
    target: Target<'_>,
    log_dir: &Path,
    out_dir: &Path,
    root: &Path,
    server_version: &str,
) -> anyhow::Result<bool> {
    let Target { admin, database, database_url, db_config, server } = target;
    // Schema, the way operators apply it.
    let mut migrate = inbox_test_support::process::command("inbox-worker");
    migrate.arg("migrate").env("DATABASE_URL", database_url);
    let (code, output) = inbox_test_support::process::run(migrate, Duration::from_secs(120));
    std::fs::write(log_dir.join("migrate.log"), &output)?;
    anyhow::ensure!(code == 0, "inbox-worker migrate failed (exit {code}):\n{output}");
    let setup = faults::connect(db_config).await?;
    // Exact dead-tuple counts for the report, where the extension is installed (best effort).
    let _ = setup.batch_execute("CREATE EXTENSION IF NOT EXISTS pgstattuple").await;
    let (ingest_url, worker_url) = if let Server::Own(cluster) = &server {
        // The production roles, and a role for the client that exhausts the connections.
        let roles =
            std::fs::read_to_string(root.join("deploy/roles.sql")).context("reading deploy/roles.sql")?;
        setup.batch_execute(&roles).await.context("applying deploy/roles.sql")?;
        setup.batch_execute(&format!("CREATE ROLE {HOG_ROLE} LOGIN")).await?;
        setup.batch_execute(&relay::copy_sql(Some("inbox_relay"))).await.context("the outbox copy")?;
        (cluster.url("inbox_ingest", database), cluster.url("inbox_worker", database))
    } else {
        setup.batch_execute(&relay::copy_sql(None)).await.context("the outbox copy")?;
        (database_url.to_owned(), database_url.to_owned())
    };
    let relay_db_url = match &server {
        Server::Own(cluster) => cluster.url("inbox_relay", database),
        _ => database_url.to_owned(),
    };
    let destinations = relay::start(seed).await.context("starting the relays' destinations")?;
    drop(setup);
    let before = check::table_stats(db_config, true).await.context("webhook_inbox's statistics")?;

    let ports: Vec<u16> = (0..args.ingests).map(|_| inbox_test_support::port::free()).collect();
    let supervisor = Arc::new(Supervisor::new(
        Spec {
            ingest_url,
            worker_url,
            endpoints: format!("billing={SECRET}"),
            max_attempts: args.max_attempts,
            log_dir: log_dir.to_owned(),
            relay: Some(RelaySpec {
                nats_db_url: relay::nats_db_url(&relay_db_url),
                http_db_url: relay_db_url,
                receiver_url: destinations.receiver.url.clone(),
                secret: relay::SECRET.to_owned(),
                nats_url: destinations.nats_url.clone(),
                subject: relay::SUBJECT.to_owned(),
                per_destination: 2,
            }),
        },
        &ports,
        args.workers,
    ));
    let stop_supervisor = CancellationToken::new();
    // Whatever way this function ends, the background tasks stop (and with the last reference to
    // the supervisor, its processes).
    let _stop_supervisor = stop_supervisor.clone().drop_guard();
    let supervising = tokio::spawn({
        let supervisor = supervisor.clone();
        let stop = stop_supervisor.clone();
        async move {
            while !stop.is_cancelled() {
                supervisor.tick();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    wait_for_ingests(&ports, Duration::from_secs(60)).await?;
    println!(
        "chaos: {} ingest (ports {ports:?}) + {} workers on {database}; {:.0} events/s for {}, a fault every ~{}; seed {seed}",
        args.ingests,
        args.workers,
        args.rate,
        humantime::format_duration(args.duration),
        humantime::format_duration(args.fault_interval)
    );

    let started = Instant::now();
    let load = Arc::new(Load::new(&ports, SECRET, args.senders));
    let stop_load = CancellationToken::new();
    let _stop_load = stop_load.clone().drop_guard();
    let _give_up = load.give_up.clone().drop_guard();
    let generating = tokio::spawn(load.clone().generate(args.rate, seed, rng.fork(), stop_load.clone()));

    let mut disabled = Vec::new();
    if matches!(server, Server::Foreign) {
        let why = "not the cluster of scripts/pg.sh nor one of our own".to_owned();
        disabled.push((Kind::PgRestartFast, why.clone()));
        disabled.push((Kind::PgRestartImmediate, why));
    }
    match &server {
        Server::Own(cluster) => {
            if let Err(why) = &cluster.wal_fs {
                disabled.push((Kind::WalDiskFull, why.clone()));
            }
        }
        _ => {
            let why = "hits the whole server: only on a cluster of our own (--cluster own)".to_owned();
            disabled.push((Kind::PoolExhausted, why.clone()));
            disabled.push((Kind::WalDiskFull, why));
        }
    }
    if let Some(why) = &destinations.nats_skipped {
        disabled.push((Kind::NatsRestart, why.clone()));
    }
    let xmin_hold = args.xmin_pin.unwrap_or_else(|| Duration::from_secs(60).min(args.duration / 3));
    let mut faults = Faults::new(
        admin.clone(),
        database.to_owned(),
        server,
        log_dir.to_owned(),
        supervisor.clone(),
        disabled,
        xmin_hold,
        HOG_ROLE.to_owned(),
        started,
    );
    faults.nats = destinations.nats.clone();
    let faults = Arc::new(faults);
    let stop_faults = CancellationToken::new();
    let _stop_faults = stop_faults.clone().drop_guard();
    // The first round (every kind once) fits in about half the run.
    let first_round_wait = args.duration / (2 * KINDS.len() as u32);
    let injecting = tokio::spawn(faults.clone().run(
        args.fault_interval,
        first_round_wait,
        rng.fork(),
        stop_faults.clone(),
    ));
    let stop_sampling = CancellationToken::new();
    let _stop_sampling = stop_sampling.clone().drop_guard();
    let sampling = tokio::spawn(check::sample_peaks(db_config.clone(), stop_sampling.clone()));

    let interrupted = tokio::select! {
        _ = tokio::time::sleep(args.duration) => false,
        _ = tokio::signal::ctrl_c() => true,
    };
    let load_s = started.elapsed().as_secs_f64();
    stop_load.cancel();
    stop_faults.cancel();
    let _ = generating.await;
    println!("chaos: load over after {load_s:.1}s; waiting for the fault in progress to end");
    let _ = injecting.await;
    faults::allow_connections(admin, database).await?;
    if interrupted {
        load.give_up.cancel();
        stop_supervisor.cancel();
        let _ = supervising.await;
        supervisor.shutdown(Duration::from_secs(10));
        anyhow::bail!("interrupted");
    }

    // Faults are over: every process back up, the senders finish their retries.
    let t = Instant::now();
    while !supervisor.all_up(Duration::from_secs(2)) && t.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "chaos: faults stopped; senders retrying what is not acknowledged (up to {})",
        humantime::format_duration(args.final_retry)
    );
    load.tasks.close();
    let finished = tokio::time::timeout(args.final_retry, load.tasks.wait()).await.is_ok();
    load.give_up.cancel();
    load.tasks.wait().await;
    let retry_s = t.elapsed().as_secs_f64();

    println!("chaos: draining the queue (up to {})", humantime::format_duration(args.drain_timeout));
    let (drain_time, drained) = check::drain(db_config, args.drain_timeout).await;
    println!(
        "chaos: waiting for the relays to deliver the outbox (up to {})",
        humantime::format_duration(args.drain_timeout)
    );
    let relays_drained = relay::drain(db_config, args.drain_timeout).await;
    let offered: Vec<_> = load.events.lock().unwrap().clone();
    if args.sabotage {
        sabotage(db_config, &offered).await.context("sabotaging")?;
    }
    let verdict = check::verify(db_config, &offered).await.context("checking the database")?;
    let http = relay::verify_http(db_config, &destinations.receiver)
        .await
        .context("checking the HTTP deliveries")?;
    let nats = match &destinations.nats_url {
        Some(url) => Some(relay::verify_nats(db_config, url).await.context("checking the JetStream stream")?),
        None => None,
    };
    let relays_ok = relays_drained && http.ok() && nats.as_ref().is_none_or(relay::Verdict::ok);
    stop_sampling.cancel();
    let peaks = sampling.await.unwrap_or_default();

    stop_supervisor.cancel();
    let _ = supervising.await;
    let sup = supervisor.clone();
    let unclean = tokio::task::spawn_blocking(move || sup.shutdown(Duration::from_secs(20))).await?;
    // After the services are gone (their backends' statistics are flushed when they exit).
    let after = check::table_stats(db_config, true).await.context("webhook_inbox's statistics")?;
    let server_log = match &faults.server {
        Server::Own(cluster) => check::ServerLog::read(cluster.server_log()),
        _ => None,
    };
    let exits = supervisor.exits();
    let crashes: Vec<_> = exits.iter().filter(|e| !e.startup_refused).cloned().collect();
    let refused = exits.len() - crashes.len();

    // The report.
    let s = &load.stats;
    let counts: Vec<(Kind, u64)> = KINDS.iter().map(|k| (*k, faults.count(*k))).collect();
    let missing_kinds: Vec<&str> = counts
        .iter()
        .filter(|(k, n)| *n == 0 && faults.skipped(*k).is_none())
        .map(|(k, _)| k.name())
        .collect();
    let skipped: serde_json::Map<String, serde_json::Value> =
        faults.disabled.iter().map(|(k, why)| (k.name().to_owned(), why.clone().into())).collect();
    let pins: Vec<faults::Pin> = faults.pins.lock().unwrap().clone();
    let fault_log: Vec<faults::Injected> = faults.log.lock().unwrap().clone();
    let unacked = load.unacknowledged();
    let duplicates_sent = s.redeliveries.load(Relaxed) + s.burst_extras.load(Relaxed);
    let passed = verdict.ok() && missing_kinds.is_empty() && crashes.is_empty() && drained && relays_ok;
    let fault_obj: serde_json::Map<String, serde_json::Value> =
        counts.iter().map(|(k, n)| (k.name().to_owned(), (*n).into())).collect();
    let statuses: serde_json::Map<String, serde_json::Value> =
        s.by_status.lock().unwrap().iter().map(|(k, v)| (k.to_string(), (*v).into())).collect();
    let transport: serde_json::Map<String, serde_json::Value> =
        s.transport_kinds.lock().unwrap().iter().map(|(k, v)| ((*k).to_owned(), (*v).into())).collect();
    let total_s = started.elapsed().as_secs_f64();
    let report = serde_json::json!({
        "passed": passed,
        "duration_s": round1(load_s),
        "total_s": round1(total_s),
        "final_retry_s": round1(retry_s),
        "drain_s": round1(drain_time.as_secs_f64()),
        "drained": drained,
        "seed": seed,
        "rate_per_s": args.rate,
        "ingests": args.ingests,
        "workers": args.workers,
        "max_attempts": args.max_attempts,
        "postgres_version": server_version,
        "cluster": match &faults.server {
            Server::Own(c) => serde_json::json!({
                "mode": "own",
                "dir": c.dir.display().to_string(),
                "max_connections": cluster::MAX_CONNECTIONS,
                "superuser_reserved_connections": cluster::SUPERUSER_RESERVED,
                "pg_wal": match &c.wal_fs {
                    Ok(m) => format!("tmpfs of {} MiB at {}", cluster::WAL_FS_MIB, m.display()),
                    Err(why) => format!("in the data directory: {why}"),
                },
                "service_roles": ["inbox_ingest", "inbox_worker", "inbox_relay"],
            }),
            Server::PgSh(_) => serde_json::json!({ "mode": "url", "server": "the cluster of scripts/pg.sh" }),
            Server::Foreign => serde_json::json!({ "mode": "url", "server": "DATABASE_URL's" }),
        },
        "events_offered": s.offered.load(Relaxed),
        "acknowledged": s.acked.load(Relaxed),
        "unacknowledged": unacked,
        "requests": s.requests.load(Relaxed),
        "non_2xx_answers": s.non_2xx.load(Relaxed),
        "transport_errors": s.transport_errors.load(Relaxed),
        "answers_by_status": statuses,
        "transport_errors_by_kind": transport,
        "duplicates_sent": duplicates_sent,
        "redeliveries": s.redeliveries.load(Relaxed),
        "burst_extras": s.burst_extras.load(Relaxed),
        "duplicate_answers": s.duplicate_answers.load(Relaxed),
        "second_event_objects": s.second_objects.load(Relaxed),
        "faults": fault_obj,
        "faults_skipped": skipped,
        "xmin_pins": pins.iter().map(|p| serde_json::json!({
            "at_s": round1(p.at_s), "held_s": round1(p.held_s), "sessions": p.sessions, "ended_by": p.ended_by,
            "xmin_age_at_release": p.xmin_age_at_release,
            "n_dead_tup_at_start": p.dead_tuples_start, "n_dead_tup_at_release": p.dead_tuples_release,
        })).collect::<Vec<_>>(),
        "webhook_inbox": {
            "before": before.json(),
            "after": after.json(),
            "peak_during_run": {
                "n_dead_tup": peaks.dead_tuples,
                "total_bytes": peaks.total_bytes,
                "oldest_xmin_age": peaks.xmin_age,
                "samples": peaks.samples,
            },
            "note": "n_live_tup/n_dead_tup are pg_stat counters: approximate, and restarted from zero by each crash restart (immediate restart, WAL PANIC); pgstattuple_* are exact counts by a full scan",
        },
        "server_log": server_log.as_ref().map(check::ServerLog::json),
        "backends_terminated_total": *faults.backends_terminated.lock().unwrap(),
        "fault_errors": faults.errors.lock().unwrap().clone(),
        "fault_log": faults.log.lock().unwrap().iter().map(|f| serde_json::json!({
            "at_s": round1(f.at_s), "kind": f.kind.name(), "took_ms": f.took_ms, "detail": f.detail,
        })).collect::<Vec<_>>(),
        "lost": verdict.lost,
        "doubled": verdict.doubled,
        "stuck": verdict.stuck,
        "parked": verdict.parked,
        "parked_without_reason": verdict.parked_without_reason,
        "unbooked_payments": verdict.unbooked,
        "unbooked_payments_parked": verdict.unbooked_parked,
        "wrong_amount": verdict.wrong_amount,
        "wrong_status": verdict.wrong_status,
        "acknowledged_payments": verdict.acked_payments,
        "ledger_rows": verdict.ledger_rows,
        "outbox_rows": verdict.outbox_rows,
        "inbox_rows": verdict.inbox_rows,
        "processed_rows": verdict.processed_rows,
        "max_receive_to_processed_ms": verdict.latency_max_ms.round(),
        "p50_receive_to_processed_ms": verdict.latency_p50_ms.round(),
        "p99_receive_to_processed_ms": verdict.latency_p99_ms.round(),
        "process_starts": supervisor.starts(),
        "startup_refusals": refused,
        "crashes": crashes.iter().map(|e| serde_json::json!({
            "process": e.slot, "pid": e.pid, "status": e.status, "uptime_s": round1(e.uptime_s), "log_tail": e.log_tail,
        })).collect::<Vec<_>>(),
        "unclean_stops": unclean.iter().map(|u| serde_json::json!({ "process": u.slot, "status": u.status })).collect::<Vec<_>>(),
        "examples": {
            "lost": verdict.lost_examples, "doubled": verdict.doubled_examples, "stuck": verdict.stuck_examples,
            "parked": verdict.parked_examples, "unbooked": verdict.unbooked_examples,
        },
        "relay": {
            "drained": relays_drained,
            "http": http.json(),
            "nats": nats.as_ref().map(relay::Verdict::json),
            "nats_skipped": destinations.nats_skipped,
            "note": "per destination: deliveries taken (HTTP 2xx, JetStream stored) against its outbox table; duplicates are allowed (at least once) and counted; an aggregate's rows must be first taken in id order; the receiver refuses attempts with a stale fencing token",
        },
        "missing_fault_kinds": missing_kinds,
        "logs": log_dir.display().to_string(),
        "all_senders_finished_in_time": finished,
    });
    let path = out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;

    println!();
    println!("chaos report ({})", path.display());
    let line = |name: &str, value: String| println!("  {name:<36} {value}");
    line("PostgreSQL", server_version.to_owned());
    line(
        "duration (load + faults)",
        format!("{load_s:.1} s (then {retry_s:.1} s retries, {:.1} s drain)", drain_time.as_secs_f64()),
    );
    line("seed", seed.to_string());
    line(
        "events offered",
        format!(
            "{} ({:.0}/s; {} second event objects)",
            s.offered.load(Relaxed),
            s.offered.load(Relaxed) as f64 / load_s,
            s.second_objects.load(Relaxed)
        ),
    );
    line("acknowledged (2xx)", s.acked.load(Relaxed).to_string());
    line("unacknowledged (gave up)", unacked.to_string());
    line("requests", s.requests.load(Relaxed).to_string());
    line(
        "non-2xx answers",
        format!(
            "{} {}",
            s.non_2xx.load(Relaxed),
            serde_json::Value::Object(report["answers_by_status"].as_object().cloned().unwrap_or_default())
        ),
    );
    line(
        "transport errors",
        format!(
            "{} {}",
            s.transport_errors.load(Relaxed),
            serde_json::Value::Object(
                report["transport_errors_by_kind"].as_object().cloned().unwrap_or_default()
            )
        ),
    );
    line(
        "duplicates sent",
        format!(
            "{duplicates_sent} ({} redeliveries, {} burst extras; {} answered duplicate)",
            s.redeliveries.load(Relaxed),
            s.burst_extras.load(Relaxed),
            s.duplicate_answers.load(Relaxed)
        ),
    );
    for (k, n) in &counts {
        let note = faults.skipped(*k).map(|why| format!(" (skipped: {why})")).unwrap_or_default();
        line(&format!("fault {}", k.name()), format!("{n}{note}"));
    }
    for p in &pins {
        line("  xmin_pinned", p.describe());
    }
    for f in fault_log.iter().filter(|f| matches!(f.kind, Kind::PoolExhausted | Kind::WalDiskFull)) {
        line(&format!("  {} at {:.1} s", f.kind.name(), f.at_s), f.detail.clone());
    }
    line("webhook_inbox before", before.describe());
    line("webhook_inbox after", after.describe());
    line(
        "webhook_inbox peak during the run",
        format!(
            "{} dead tuples, {} total; oldest xmin {} transactions old",
            peaks.dead_tuples,
            check::mib(peaks.total_bytes),
            peaks.xmin_age
        ),
    );
    if let Some(log) = &server_log {
        line(
            "server log",
            format!(
                "{} PANIC ({} no space left), {} crash recoveries, {} startup failures, {} times ready",
                log.panics, log.no_space, log.crash_recoveries, log.startup_failures, log.ready
            ),
        );
        line(
            "  refused: server full (by user)",
            serde_json::to_string(&log.full_refusals).unwrap_or_default(),
        );
        line(
            "  terminated: by admin / idle in tx",
            format!("{} / {}", log.terminated_by_admin, log.idle_in_transaction_timeouts),
        );
    }
    line("backends terminated (total)", faults.backends_terminated.lock().unwrap().to_string());
    line(
        "process starts / refusals / crashes",
        format!("{} / {refused} / {}", supervisor.starts(), crashes.len()),
    );
    line("inbox rows / processed", format!("{} / {}", verdict.inbox_rows, verdict.processed_rows));
    line(
        "acked payments / ledger / outbox",
        format!("{} / {} / {}", verdict.acked_payments, verdict.ledger_rows, verdict.outbox_rows),
    );
    line("relay → HTTP receiver", http.describe());
    match &nats {
        Some(nats) => line("relay → NATS JetStream", nats.describe()),
        None => line(
            "relay → NATS JetStream",
            format!("skipped: {}", destinations.nats_skipped.as_deref().unwrap_or("?")),
        ),
    }
    for e in http.examples.iter().chain(nats.iter().flat_map(|n| n.examples.iter())) {
        println!("  e.g. relay: {e}");
    }
    if !relays_drained {
        line("relay", "outbox not drained in time".to_owned());
    }
    line("LOST", verdict.lost.to_string());
    line("DOUBLED", verdict.doubled.to_string());
    line("stuck", format!("{}{}", verdict.stuck, if drained { "" } else { " (drain timed out)" }));
    line("PARKED (without reason)", format!("{} ({})", verdict.parked, verdict.parked_without_reason));
    line("unbooked payments (parked)", format!("{} ({})", verdict.unbooked, verdict.unbooked_parked));
    line("wrong amount / wrong status", format!("{} / {}", verdict.wrong_amount, verdict.wrong_status));
    line(
        "receive→processed ms",
        format!(
            "max {:.0}, p99 {:.0}, p50 {:.0}",
            verdict.latency_max_ms, verdict.latency_p99_ms, verdict.latency_p50_ms
        ),
    );
    for (name, list) in [
        ("lost", &verdict.lost_examples),
        ("doubled", &verdict.doubled_examples),
        ("stuck", &verdict.stuck_examples),
        ("parked", &verdict.parked_examples),
        ("unbooked", &verdict.unbooked_examples),
    ] {
        for e in list {
            println!("  e.g. {name}: {e}");
        }
    }
    for c in &crashes {
        println!(
            "  CRASH {} pid {} {} after {:.1}s; log tail:\n{}",
            c.slot, c.pid, c.status, c.uptime_s, c.log_tail
        );
    }
    for u in &unclean {
        println!("  unclean stop: {} {}", u.slot, u.status);
    }
    if !missing_kinds.is_empty() {
        println!("  fault kinds never injected: {missing_kinds:?}");
    }
    for e in faults.errors.lock().unwrap().iter() {
        println!("  fault injection error: {e}");
    }
    println!("  {:<36} {}", "RESULT", if passed { "PASS" } else { "FAIL" });
    Ok(passed)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Whether `admin` points at the cluster `scripts/pg.sh` manages (then it may be restarted).
fn local_cluster(root: &Path, admin: &tokio_postgres::Config) -> (bool, String) {
    let output = std::process::Command::new(root.join("scripts/pg.sh"))
        .arg("url")
        .stderr(std::process::Stdio::null())
        .output();
    let local = match output {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => return (false, "scripts/pg.sh manages no cluster here".into()),
    };
    let Ok(local) = local.parse::<tokio_postgres::Config>() else {
        return (false, format!("cannot parse scripts/pg.sh url output {local:?}"));
    };
    let ours = endpoint(&local);
    let theirs = endpoint(admin);
    if ours == theirs && ours.is_some() {
        (true, String::new())
    } else {
        (false, format!("DATABASE_URL is {theirs:?}, the local cluster is {ours:?}"))
    }
}

fn endpoint(config: &tokio_postgres::Config) -> Option<(String, u16)> {
    let host = match config.get_hosts().first()? {
        tokio_postgres::config::Host::Tcp(h) if h == "localhost" => "127.0.0.1".to_owned(),
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    Some((host, config.get_ports().first().copied().unwrap_or(5432)))
}

async fn wait_for_ingests(ports: &[u16], timeout: Duration) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(2)).build()?;
    let deadline = Instant::now() + timeout;
    for port in ports {
        loop {
            let ok = http
                .get(format!("http://127.0.0.1:{port}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "inbox-ingest on port {port} not ready within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// `--sabotage`: one lost event, one doubled booking, one stuck row, one parked row (distinct
/// invoices).
async fn sabotage(config: &tokio_postgres::Config, offered: &[Arc<load::Offered>]) -> anyhow::Result<()> {
    let mut seen = std::collections::HashSet::new();
    let victims: Vec<_> = offered
        .iter()
        .filter(|e| {
            e.acked.load(Relaxed) && e.event_type == "invoice.paid" && seen.insert(e.invoice_id.clone())
        })
        .filter(|e| offered.iter().filter(|o| o.invoice_id == e.invoice_id).count() == 1)
        .take(4)
        .collect();
    anyhow::ensure!(victims.len() == 4, "not enough acknowledged payments to sabotage");
    let client = faults::connect(config).await?;
    client.execute("DELETE FROM webhook_inbox WHERE event_id = $1", &[&victims[0].id]).await?;
    client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, published_at)
             VALUES ('Invoice', $1, 'InvoicePaymentBooked', '{}', now())",
            &[&victims[1].invoice_id],
        )
        .await?;
    client
        .execute(
            "UPDATE webhook_inbox SET processed_at = NULL, attempts = 1, available_at = now() + interval '1 hour'
              WHERE event_id = $1",
            &[&victims[2].id],
        )
        .await?;
    client
        .execute(
            "UPDATE webhook_inbox SET processed_at = NULL, parked_at = now(), last_error = 'chaos --sabotage'
              WHERE event_id = $1",
            &[&victims[3].id],
        )
        .await?;
    println!(
        "chaos: SABOTAGE: deleted {}, doubled the outbox row of {} (marked published, never delivered), un-processed {}, parked {}: expect FAIL with lost 1, doubled 1, stuck 1, parked 1, and 1 outbox row lost per relay destination",
        victims[0].id, victims[1].invoice_id, victims[2].id, victims[3].id
    );
    Ok(())
}
