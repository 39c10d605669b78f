//! `make bench`: the throughput and latency of stripe-inbox as ratios to what this PostgreSQL
//! can commit, all measured in one run on one server.
//!
//! Phases (`--phases`, default all but soak):
//!   a      the limit: `pgbench -M prepared` running the ingest's INSERT … ON CONFLICT DO NOTHING
//!          with the same ~2 KB body, at each `--connections` client count;
//!   b      ingest: pre-signed unique `invoice.paid` webhooks over N keep-alive connections
//!          (closed loop): req/s, latency percentiles, non-2xx, rows stored = 2xx; with (a), in
//!          `--ab-rounds` rounds (a b, b a, …), each figure the total of its rounds;
//!   c      worker drain of `--drain-rows` queued rows with the full handler, 1 and 2 processes
//!          with `--worker-concurrency` (and `--worker-batch-size`): events/s, commits/event,
//!          WAL bytes/event, dead tuples and sizes after the drain; then the same drain by 1
//!          process started with no tuning flags (the worker's defaults), as a ratio to the
//!          tuned 1-process rate; `--drain-rounds` rounds of those two and the relay phase, in
//!          alternating order;
//!   relay  `--drain-rows` outbox rows delivered by 1 `inbox-worker relay` process with no tuning
//!          flags, to an HTTP receiver in this process and to a nats-server with JetStream:
//!          deliveries/s beside (c)'s default-flag worker rate, commits and WAL per row;
//!   d      end to end at half of (b)'s 32-connection rate: receive-to-processed p50/p99;
//!   e      peak RSS (VmHWM) of each binary in b, c, d;
//!   mem    `--mem-rows` queued rows of ~1 MiB bodies drained by 1 worker process with no
//!          tuning flags: events/s, MiB/s, and the worker's peak RSS (VmHWM at the end, or the
//!          highest of the samples taken during the drain) against the worker pod's 256 MiB
//!          memory limit;
//!   scale  the one-process drain of (c) in a table with `--scale-rows` processed rows and in an
//!          empty one, alternated for `--scale-rounds` rounds: the ratio of the rates; claim EXPLAINs;
//!   soak   not in the default list (`make soak`: `--phases b,soak`): 1 ingest, 1 worker and 1
//!          relay (to an HTTP receiver), worker and relay with no tuning flags, fed open loop at
//!          `--soak-rate` (default: half of (b)'s 32-connection rate) for `--soak-duration`, with
//!          `inbox-worker purge` at its shortest retention every `--soak-purge-every` and a
//!          REPEATABLE READ snapshot held `--soak-snapshot` from the middle; a sample every
//!          `--soak-sample` (receive→processed p50/p99, claim latency, table/TOAST/index sizes,
//!          dead tuples, HOT share, WAL, commits and dead index entries per event, RSS and CPU per
//!          event of each process) into <out>/soak/samples.csv, samples.json and SVG charts;
//!          stopped as failed once a sample's p99 is over `--soak-max-lag` (a rate the machine
//!          does not carry);
//!   disk   not in the default list: 8 KiB writes, each made durable by `fdatasync`, back to back
//!          for `--disk-duration` in `--disk-dir`, before any other phase: the flush's
//!          percentiles and the stalls over 20 ms, what every commit's WAL flush waits for;
//!   console  the operator console with `--console-parked` parked rows (and `--console-history`
//!          processed in the last 6 hours): median and p95 of `--console-requests` GETs each of the
//!          needs-review list, a filtered page of it and the overview, signed in (target: p95 under
//!          300 ms).
//!
//! Each phase runs in a fresh database `inbox_bench_<pid>_<phase>` on the server of
//! `DATABASE_URL` (scripts/with-db.sh: the local cluster), migrated by `inbox-worker migrate`
//! and dropped afterwards. Service binaries are taken from this binary's directory
//! (target/release); the bench starts them with a cleared environment, so "no tuning flags" means
//! the defaults the worker states in `inbox-worker run --help` (read there, and reported). Prints
//! one table and writes target/bench/report.json.

#![recursion_limit = "256"]

mod console;
mod disk;
mod drain;
mod e2e;
mod http;
mod ingest;
mod mem;
mod payload;
mod pg;
mod pgbench;
mod relay;
mod report;
mod scale;
mod services;
mod soak;
mod svg;
mod util;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Phase {
    A,
    B,
    C,
    Relay,
    D,
    E,
    Mem,
    Scale,
    Console,
    Soak,
    Disk,
}

/// Benchmark of stripe-inbox against the commit rate of its PostgreSQL (see `make bench`).
#[derive(Debug, Parser)]
#[command(name = "bench", max_term_width = 100)]
pub struct Args {
    /// The server to run on; each phase creates (and drops) a database of its own there.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Phases to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "a,b,c,relay,d,e,mem,scale,console")]
    phases: Vec<Phase>,
    /// Measured time of each pgbench run, ingest run and the end-to-end run.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Unmeasured load before each measured window.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Rounds of (a) and (b) when both run, alternating their order; each figure is the total
    /// of its rounds. pgbench's rate on a shared 2-core VM drifts by ±30 % from one minute to the
    /// next, with the ingest's only partly following it.
    #[arg(long, default_value_t = 2)]
    ab_rounds: usize,
    /// Client / connection counts of (a) and (b).
    #[arg(long, value_delimiter = ',', default_value = "32,256")]
    connections: Vec<usize>,
    /// Rows queued for the drain (c).
    #[arg(long, default_value_t = 50_000)]
    drain_rows: u64,
    /// Worker process counts of the tuned drains of (c); (c) then drains once more with 1
    /// process and no tuning flags.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    drain_processes: Vec<usize>,
    /// Rounds of (c)'s two 1-process drains, tuned and default-flag, and of the relay phase, in
    /// alternating order; each rate is the total of its rounds. Single drains of ~3 s on a shared
    /// VM differ by ±15 %.
    #[arg(long, default_value_t = 2)]
    drain_rounds: usize,
    /// `inbox-worker run --concurrency` in the tuned drains of (c), in (d) and scale: with the
    /// default --batch-size of 64, four transactions in flight per process. The default-flag
    /// drain of (c) and mem pass no --concurrency.
    #[arg(long, default_value_t = 256)]
    worker_concurrency: usize,
    /// `inbox-worker run --batch-size` in the tuned drains of (c), in (d) and scale [default: the
    /// service's default]
    #[arg(long)]
    worker_batch_size: Option<usize>,
    /// `inbox-worker run --poll-interval` in the drains (c, mem, scale).
    #[arg(long, default_value = "50ms")]
    worker_poll_interval: String,
    /// Extra `inbox-worker relay` flags for the relay phase, space-separated (e.g. "--concurrency
    /// 512"); empty: the relay's defaults, as shipped.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    relay_args: String,
    /// Give up on a drain after this long.
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Rows of ~1 MiB bodies queued for mem, drained by 1 worker process at its defaults.
    #[arg(long, default_value_t = 300)]
    mem_rows: u64,
    /// Processed rows present in the scale phase's table.
    #[arg(long, default_value_t = 1_000_000)]
    scale_rows: u64,
    /// Queued rows drained in the scale phase (by 1 worker process) [default: --drain-rows, so
    /// that its rate differs from (c)'s one-process drain by the processed rows alone: ~2 KB rows
    /// take a heap page each at the inbox's fillfactor, and a queue larger than shared_buffers
    /// drains slower with or without the processed rows].
    #[arg(long)]
    scale_queued: Option<u64>,
    /// Rounds of the scale phase, each a drain with the processed rows and one without, in
    /// alternating order; the ratio is the rate over all of them. A drain of 50k rows lasts ~4 s,
    /// and on a shared VM single drains differ by ±15 %: four rounds (~2 minutes) narrow that.
    #[arg(long, default_value_t = 4)]
    scale_rounds: usize,
    /// Parked rows in the console phase's needs-review list.
    #[arg(long, default_value_t = 10_000)]
    console_parked: u64,
    /// Rows processed over the last 6 hours in the console phase (the overview's charts read them).
    #[arg(long, default_value_t = 50_000)]
    console_history: u64,
    /// Timed GETs of each page in the console phase.
    #[arg(long, default_value_t = 50)]
    console_requests: usize,
    /// How long the disk phase writes and flushes.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    disk_duration: Duration,
    /// Where the disk phase writes its 16 MiB file: a directory on the device of PostgreSQL's
    /// pg_wal [default: the out dir].
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// Webhooks/s of (d) [default: half of (b)'s rate at 32 connections].
    #[arg(long)]
    e2e_rate: Option<f64>,
    /// Connections the open-loop sender of (d) spreads its requests over [default: enough for
    /// 100 ms per request at the rate, 32 to 256].
    #[arg(long)]
    e2e_connections: Option<usize>,
    /// `inbox-worker run --poll-interval` in (d) [default: the service's default; it relies on
    /// the ingest's NOTIFY].
    #[arg(long)]
    e2e_poll_interval: Option<String>,
    /// How long the soak phase sends its load.
    #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
    soak_duration: Duration,
    /// The soak phase's sampling interval (one row of samples.csv, one point of each chart).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    soak_sample: Duration,
    /// How often the soak phase runs `inbox-worker purge` (at the shortest retention it allows).
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    soak_purge_every: Duration,
    /// How long the soak phase holds a REPEATABLE READ transaction open, from the middle of the run.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    soak_snapshot: Duration,
    /// Webhooks/s of the soak phase [default: half of (b)'s rate at 32 connections].
    #[arg(long)]
    soak_rate: Option<f64>,
    /// Stops the soak phase, as failed, once a sample's receive→processed p99 is over this: the
    /// pipeline is that far behind the load, so the machine does not carry `--soak-rate`, and
    /// the rest of the run would only grow the backlog (0: never stop).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    soak_max_lag: Duration,
    /// Also copy the soak phase's SVG charts to docs/performance/soak/.
    #[arg(long)]
    soak_publish: bool,
    /// Also attribute the soak's WAL to the tables it changed (indexes with their table, TOAST apart),
    /// from every record's description (`pg_get_wal_records_info`). It costs the server ~2 s of
    /// CPU per 10 s of WAL at 800 events/s (a fifth of a core), so its run's CPU and latency
    /// figures are not the default's.
    #[arg(long)]
    soak_wal_by_table: bool,
    /// An extra argument for every `inbox-ingest` the bench starts (repeatable), to measure an
    /// option beside the defaults, e.g. `--ingest-arg=--keep-raw`.
    #[arg(long, allow_hyphen_values = true)]
    ingest_arg: Vec<String>,
    /// `RUST_LOG` of every service the bench starts. The default is the level the deploy files
    /// set and the binaries use without one: a JSON line per webhook (ingest), per event (worker)
    /// and per delivery (relay), read from a pipe and counted as a log collector on the same
    /// machine would. `warn` measures the services without those lines.
    #[arg(long, default_value = "info")]
    service_log: String,
    /// pgbench -j.
    #[arg(long, default_value_t = 2)]
    pgbench_threads: usize,
    /// Threads of this program's runtime (the load generator).
    #[arg(long, default_value_t = 2)]
    loadgen_threads: usize,
    /// Directory of inbox-ingest and inbox-worker [default: this binary's directory].
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where report.json and the pgbench files go [default: <target>/bench].
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Exit 1 when a figure misses its target (the run itself failing always exits 1).
    #[arg(long)]
    check: bool,
}

/// What every phase uses.
pub struct Ctx {
    pub args: Args,
    pub server: pg::Server,
    pub bins: services::Bins,
    pub out_dir: PathBuf,
    pub start: Instant,
    /// The `invoice.paid` body template (see [`payload`]).
    pub template: String,
    /// What `inbox-worker run` runs with when given no tuning flags (see
    /// [`services::Bins::worker_defaults`]).
    pub worker_defaults: serde_json::Value,
}

impl Ctx {
    pub fn say(&self, msg: &str) {
        eprintln!("[{}] {msg}", util::elapsed(self.start));
    }

    pub async fn migrate(&self, url: &str) -> anyhow::Result<()> {
        tokio::task::block_in_place(|| self.bins.migrate(url))
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.loadgen_threads.max(1))
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the phases; Ok(false) when a phase failed (or, with --check, a target was missed).
async fn run(args: Args) -> anyhow::Result<bool> {
    let start = Instant::now();
    let started_at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?.parent().context("no directory of the bench binary")?.to_path_buf(),
    };
    let bins = services::Bins::new(bin_dir.clone(), args.ingest_arg.clone(), args.service_log.clone())?;
    let out_dir = args.out_dir.clone().unwrap_or_else(|| {
        bin_dir.parent().map_or_else(|| PathBuf::from("target"), |p| p.to_path_buf()).join("bench")
    });
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let server = pg::Server::open(&args.database_url).await?;
    let worker_defaults = bins.worker_defaults();
    let ctx = Ctx {
        args,
        server,
        bins,
        out_dir,
        start,
        template: payload::invoice_paid_template(),
        worker_defaults: worker_defaults.clone(),
    };
    let machine = machine_info(&ctx).await?;
    for line in report::machine_lines(&machine) {
        ctx.say(&line);
    }

    let outcome = phases(&ctx).await;
    ctx.server.drop_all().await;
    let mut results = outcome;
    results.insert("machine".into(), machine);
    results.insert("load_average_end".into(), json!(load_average()));
    results.insert("started_at".into(), json!(started_at));
    results.insert("run_seconds".into(), json!(start.elapsed().as_secs_f64()));
    results.insert("settings".into(), settings_json(&ctx.args));
    results.insert("worker_defaults".into(), worker_defaults);

    let table = report::Table::build(&results);
    let failed_phases = results.get("errors").and_then(|e| e.as_object()).is_some_and(|e| !e.is_empty());
    eprintln!();
    for line in report::machine_lines(&results["machine"]) {
        println!("{line}");
    }
    table.print();
    println!("full run: {:.0} s", start.elapsed().as_secs_f64());
    results.insert("table".into(), table.json());
    let path = ctx.out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&serde_json::Value::Object(results))?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("report: {}", path.display());
    let missed = ctx.args.check && table.any_missed();
    Ok(!failed_phases && !missed)
}

/// What (c)'s rounds run, in order.
#[derive(Clone, Copy)]
enum Step {
    Tuned,
    Shipped,
    Relay,
}

/// One run of the relay phase to each destination.
async fn relay_round(
    ctx: &Ctx,
    rounds: &mut BTreeMap<&'static str, Vec<serde_json::Value>>,
    note_err: &mut impl FnMut(String, anyhow::Error, &Ctx),
) {
    for destination in [relay::Destination::Http, relay::Destination::Nats] {
        match relay::run(ctx, destination).await {
            Ok(v) => rounds.entry(destination.name()).or_default().push(v),
            Err(e) => note_err(format!("relay-{}", destination.name()), e, ctx),
        }
    }
}

async fn phases(ctx: &Ctx) -> serde_json::Map<String, serde_json::Value> {
    let want = |p: Phase| ctx.args.phases.contains(&p);
    let mut out = serde_json::Map::new();
    let mut errors = serde_json::Map::new();
    let mut note_err = |key: String, e: anyhow::Error, ctx: &Ctx| {
        ctx.say(&format!("{key}: FAILED: {e:#}"));
        errors.insert(key, json!(format!("{e:#}")));
    };

    // Before everything else, so that nothing else runs on the machine.
    if want(Phase::Disk) {
        match disk::run(ctx).await {
            Ok(v) => {
                out.insert("disk".into(), v);
            }
            Err(e) => note_err("disk".into(), e, ctx),
        }
    }

    // (a) and (b) in rounds, the second in the opposite order (a b, b a, a b…), so that the
    // ratio of the ingest to pgbench does not follow the VM's drift between them.
    let rounds = if want(Phase::A) && want(Phase::B) { ctx.args.ab_rounds.max(1) } else { 1 };
    let mut a_rounds: BTreeMap<usize, Vec<serde_json::Value>> = BTreeMap::new();
    let mut b_rounds: BTreeMap<usize, Vec<ingest::Round>> = BTreeMap::new();
    for round in 0..rounds {
        if rounds > 1 {
            ctx.say(&format!("a, b: round {} of {rounds}", round + 1));
        }
        for phase in if round % 2 == 0 { [Phase::A, Phase::B] } else { [Phase::B, Phase::A] } {
            if !want(phase) {
                continue;
            }
            for &c in &ctx.args.connections {
                if phase == Phase::A {
                    match pgbench::run(ctx, c).await {
                        Ok(v) => a_rounds.entry(c).or_default().push(v),
                        Err(e) => note_err(format!("a{c}"), e, ctx),
                    }
                } else {
                    let tps = a_rounds.get(&c).and_then(|r| r.first()).and_then(|v| v["tps"].as_f64());
                    match ingest::run(ctx, c, tps).await {
                        Ok(v) => b_rounds.entry(c).or_default().push(v),
                        Err(e) => note_err(format!("b{c}"), e, ctx),
                    }
                }
            }
        }
    }
    let pgbench: BTreeMap<usize, serde_json::Value> =
        a_rounds.into_iter().map(|(c, r)| (c, pgbench::combine(r))).collect();
    let ingest: BTreeMap<usize, serde_json::Value> =
        b_rounds.into_iter().map(|(c, r)| (c, ingest::combine(r))).collect();

    let mut drains = BTreeMap::new();
    let mut relay_rounds: BTreeMap<&'static str, Vec<serde_json::Value>> = BTreeMap::new();
    if want(Phase::C) {
        let labels: BTreeMap<usize, String> =
            ctx.args.drain_processes.iter().map(|p| (*p, format!("c{p}"))).collect();
        let tuned = |p: usize| drain::Plan {
            label: &labels[&p],
            db_suffix: format!("c{p}"),
            processes: p,
            concurrency: Some(ctx.args.worker_concurrency),
            batch_size: ctx.args.worker_batch_size,
            queued: ctx.args.drain_rows,
            history: 0,
            pgstattuple: true,
        };
        // The worker as shipped: the same rows, 1 process, none of the tuning flags.
        let shipped = drain::Plan {
            label: "c1-default",
            db_suffix: "c1default".into(),
            processes: 1,
            concurrency: None,
            batch_size: None,
            queued: ctx.args.drain_rows,
            history: 0,
            pgstattuple: true,
        };
        // The tuned drains, the default-flag one and the relay; further rounds drain the two
        // 1-process plans again and run the relay again, in alternating order (T S R, R S T, …),
        // for the ratios of the defaults to the tuned flags and of the relay to the defaults.
        let rounds = ctx.args.drain_rounds.max(1);
        let mut tuned_rounds: BTreeMap<usize, Vec<serde_json::Value>> = BTreeMap::new();
        let mut shipped_rounds = Vec::new();
        for round in 0..rounds {
            let steps = if round % 2 == 0 {
                [Step::Tuned, Step::Shipped, Step::Relay]
            } else {
                [Step::Relay, Step::Shipped, Step::Tuned]
            };
            for step in steps {
                match step {
                    Step::Tuned => {
                        for &p in ctx.args.drain_processes.iter().filter(|&&p| round == 0 || p == 1) {
                            match drain::run(ctx, &tuned(p)).await {
                                Ok(v) => tuned_rounds.entry(p).or_default().push(v),
                                Err(e) => note_err(format!("c{p}"), e, ctx),
                            }
                        }
                    }
                    Step::Shipped => match drain::run(ctx, &shipped).await {
                        Ok(v) => shipped_rounds.push(v),
                        Err(e) => note_err("c1-default".into(), e, ctx),
                    },
                    Step::Relay if want(Phase::Relay) => {
                        relay_round(ctx, &mut relay_rounds, &mut note_err).await
                    }
                    Step::Relay => {}
                }
            }
        }
        let combine = |r| util::total_rate(r, "queued_rows", "events_per_s");
        drains.extend(tuned_rounds.into_iter().filter_map(|(p, r)| Some((p, combine(r)?))));
        if let Some(v) = combine(shipped_rounds) {
            out.insert("drain_default".into(), v);
        }
    } else if want(Phase::Relay) {
        relay_round(ctx, &mut relay_rounds, &mut note_err).await;
    }
    if want(Phase::Relay) {
        let relays: serde_json::Map<String, serde_json::Value> = relay_rounds
            .into_iter()
            .filter_map(|(name, r)| Some((name.to_owned(), util::total_rate(r, "rows", "deliveries_per_s")?)))
            .collect();
        out.insert("relay".into(), serde_json::Value::Object(relays));
    }

    // Half of (b)'s rate at 32 connections, unless given.
    let half_b = |given: Option<f64>, flag: &str| {
        let b32 = ingest.get(&32).or_else(|| ingest.values().next());
        match (given, b32) {
            (Some(r), _) => (r, flag.to_owned()),
            (None, Some(b)) => {
                (b["req_per_s"].as_f64().unwrap_or(600.0) / 2.0, format!("half of b{}", b["connections"]))
            }
            (None, None) => (300.0, "no (b) result: default 300/s".to_owned()),
        }
    };

    if want(Phase::D) {
        let (rate, source) = half_b(ctx.args.e2e_rate, "--e2e-rate");
        match e2e::run(ctx, rate.max(1.0), &source).await {
            Ok(v) => {
                out.insert("e2e".into(), v);
            }
            Err(e) => note_err("d".into(), e, ctx),
        }
    }

    if want(Phase::Mem) {
        match mem::run(ctx).await {
            Ok(v) => {
                out.insert("mem".into(), v);
            }
            Err(e) => note_err("mem".into(), e, ctx),
        }
    }

    if want(Phase::Scale) {
        match scale::run(ctx).await {
            Ok(v) => {
                out.insert("scale".into(), v);
            }
            Err(e) => note_err("scale".into(), e, ctx),
        }
    }

    if want(Phase::Console) {
        match console::run(ctx).await {
            Ok(v) => {
                out.insert("console".into(), v);
            }
            Err(e) => note_err("console".into(), e, ctx),
        }
    }

    if want(Phase::Soak) {
        let (rate, source) = half_b(ctx.args.soak_rate, "--soak-rate");
        match soak::run(ctx, rate.max(1.0), &source).await {
            Ok(v) => {
                out.insert("soak".into(), v);
            }
            Err(e) => note_err("soak".into(), e, ctx),
        }
    }

    let keyed = |m: BTreeMap<usize, serde_json::Value>| {
        serde_json::Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    };
    out.insert("pgbench".into(), keyed(pgbench));
    out.insert("ingest".into(), keyed(ingest));
    out.insert("drain".into(), keyed(drains));
    out.insert("rss".into(), report::rss_json(&out));
    out.insert(
        "phases".into(),
        json!(ctx.args.phases.iter().map(|p| format!("{p:?}").to_lowercase()).collect::<Vec<_>>()),
    );
    out.insert("errors".into(), serde_json::Value::Object(errors));
    out
}

async fn machine_info(ctx: &Ctx) -> anyhow::Result<serde_json::Value> {
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
    });
    let mem_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok())
    });
    let repo = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    Ok(json!({
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu_model": cpu_model,
        "memory_kib": mem_kib,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_owned()),
        "load_average_start": load_average(),
        "postgres": ctx.server.machine_info().await?,
        "postgres_local": ctx.server.postmaster.is_some(),
        "git_commit": git(&["rev-parse", "--short", "HEAD"]),
        "git_dirty": git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty()),
        "bin_dir": ctx.bins.dir.display().to_string(),
        "service_log": ctx.bins.log,
    }))
}

fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn settings_json(a: &Args) -> serde_json::Value {
    json!({
        "phases": a.phases.iter().map(|p| format!("{p:?}").to_lowercase()).collect::<Vec<_>>(),
        "duration_s": a.duration.as_secs_f64(),
        "warmup_s": a.warmup.as_secs_f64(),
        "connections": a.connections,
        "ab_rounds": a.ab_rounds,
        "drain_rows": a.drain_rows,
        "drain_processes": a.drain_processes,
        "drain_rounds": a.drain_rounds,
        "worker_concurrency": a.worker_concurrency,
        "ingest_args": a.ingest_arg,
        "service_log": a.service_log,
        "worker_batch_size": a.worker_batch_size,
        "worker_poll_interval": a.worker_poll_interval,
        "mem_rows": a.mem_rows,
        "mem_event_bytes": mem::EVENT_BYTES,
        "scale_rows": a.scale_rows,
        "scale_queued": a.scale_queued.unwrap_or(a.drain_rows),
        "scale_rounds": a.scale_rounds,
        "console_parked": a.console_parked,
        "console_history": a.console_history,
        "console_requests": a.console_requests,
        "disk_duration_s": a.disk_duration.as_secs_f64(),
        "disk_dir": a.disk_dir,
        "e2e_rate": a.e2e_rate,
        "e2e_connections": a.e2e_connections,
        "e2e_poll_interval": a.e2e_poll_interval,
        "soak_duration_s": a.soak_duration.as_secs_f64(),
        "soak_sample_s": a.soak_sample.as_secs_f64(),
        "soak_purge_every_s": a.soak_purge_every.as_secs_f64(),
        "soak_snapshot_s": a.soak_snapshot.as_secs_f64(),
        "soak_rate": a.soak_rate,
        "soak_max_lag_s": a.soak_max_lag.as_secs_f64(),
        "soak_publish": a.soak_publish,
        "soak_wal_by_table": a.soak_wal_by_table,
        "pgbench_threads": a.pgbench_threads,
        "loadgen_threads": a.loadgen_threads,
        "body_bytes": payload::invoice_paid_template()
            .replace(payload::EVT, &payload::event_id("b32_", 0))
            .replace(payload::INV, &payload::invoice_id("b32_", 0))
            .len(),
    })
}
