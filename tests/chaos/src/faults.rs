//! The fault injector: one fault at a time, about every `--fault-interval`; every kind once
//! (round-robin, in [`KINDS`]' order) first, then at random.
//!
//! - `worker_sigkill`, `ingest_restart` (SIGKILL or SIGTERM): a service process dies; its slot
//!   starts it again about a second later.
//! - `backend_terminated`: `pg_terminate_backend` on 1–3 of the services' backends.
//! - `connections_blocked`: `ALLOW_CONNECTIONS false` on the database for 2–5 s.
//! - `pg_restart_fast`, `pg_restart_immediate`: the server restarts (an immediate one crash-recovers).
//! - `xmin_pinned`: a session opens a REPEATABLE READ transaction, takes its snapshot and an xid,
//!   and stays idle in transaction for min(60 s, duration / 3) (`--xmin-pin`), exempt from the
//!   server's `idle_in_transaction_session_timeout` (20 s on the run's own cluster) by a `SET` of
//!   its own: vacuum can remove no row version that died since, so dead tuples pile up while the
//!   queue keeps turning over. It runs in the background, other faults go on meanwhile; a session
//!   a restart ends is opened again until its time is up.
//! - `pool_exhausted`: another client (role `chaos_hog`, no superuser) opens connections until
//!   the server refuses more: every slot but the superuser reserve is taken. It terminates one of
//!   the ingest's backends and one of the workers', so that both must reconnect into the full
//!   server, takes the slots they free, holds everything 3–6 s and lets go. The services answer
//!   503 and retry meanwhile; nothing may be lost, doubled or parked.
//! - `wal_disk_full`: the filesystem under `pg_wal` (a 256 MiB tmpfs of the run's own cluster,
//!   `cluster.rs`) is filled with a ballast file and the WAL switched to new segments until
//!   PostgreSQL must create one: it cannot (ENOSPC) and PANICs. Its crash recovery either finds
//!   room in a recycled segment or cannot write the WAL either and the server shuts itself down.
//!   After 2–4 s the ballast goes (an operator frees space) and the server is started again if it
//!   is down, as one would. Only where the run owns its cluster and could mount the tmpfs (root);
//!   otherwise skipped, saying why. (PostgreSQL cannot put WAL in a tablespace: a small tablespace
//!   would fill up with table data, not WAL.)
//!
//! - `relay_sigkill`: a relay (HTTP or NATS) dies between any two steps — after a claim, during a
//!   delivery, before its mark; its slot starts it again. Its rows come back after their lease.
//! - `relay_sigstop`: a relay is frozen (SIGSTOP) for longer than its lease (6 s), so another
//!   relay claims its rows with the next fencing token, then resumed (SIGCONT): its marks and
//!   failure records are fenced out, and a delivery it sends late carries a stale token, which
//!   the receiver refuses.
//! - `nats_restart`: the nats-server is SIGKILLed and started again on its port and store after
//!   1–3 s; publishes in flight get no ack and are retried (`Nats-Msg-Id` dedupes them).
//!
//! `pool_exhausted` and `wal_disk_full` hit the whole server: they run only against the run's own
//! cluster (`--cluster own`), like the restarts, which otherwise run only against the cluster of
//! `scripts/pg.sh`.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::procs::{Role, Supervisor};
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    XminPinned,
    WorkerSigkill,
    BackendTerminated,
    PoolExhausted,
    ConnectionsBlocked,
    IngestRestart,
    WalDiskFull,
    PgRestartFast,
    PgRestartImmediate,
    RelaySigkill,
    RelaySigstop,
    NatsRestart,
}

/// Every kind, in the order of the first round. The xmin pin goes first, so that it spans the
/// faults that follow.
pub const KINDS: [Kind; 12] = [
    Kind::XminPinned,
    Kind::RelaySigstop,
    Kind::WorkerSigkill,
    Kind::RelaySigkill,
    Kind::BackendTerminated,
    Kind::PoolExhausted,
    Kind::ConnectionsBlocked,
    Kind::IngestRestart,
    Kind::WalDiskFull,
    Kind::PgRestartFast,
    Kind::NatsRestart,
    Kind::PgRestartImmediate,
];

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::XminPinned => "xmin_pinned",
            Kind::WorkerSigkill => "worker_sigkill",
            Kind::BackendTerminated => "backend_terminated",
            Kind::PoolExhausted => "pool_exhausted",
            Kind::ConnectionsBlocked => "connections_blocked",
            Kind::IngestRestart => "ingest_restart",
            Kind::WalDiskFull => "wal_disk_full",
            Kind::PgRestartFast => "pg_restart_fast",
            Kind::PgRestartImmediate => "pg_restart_immediate",
            Kind::RelaySigkill => "relay_sigkill",
            Kind::RelaySigstop => "relay_sigstop",
            Kind::NatsRestart => "nats_restart",
        }
    }

    /// Relative weight once every kind was injected once.
    fn weight(self) -> u32 {
        match self {
            Kind::XminPinned => 3,
            Kind::WorkerSigkill => 30,
            Kind::BackendTerminated => 25,
            Kind::PoolExhausted => 12,
            Kind::ConnectionsBlocked => 15,
            Kind::IngestRestart => 10,
            Kind::WalDiskFull => 6,
            Kind::PgRestartFast => 10,
            Kind::PgRestartImmediate => 10,
            Kind::RelaySigkill => 20,
            Kind::RelaySigstop => 8,
            Kind::NatsRestart => 6,
        }
    }

    fn index(self) -> usize {
        KINDS.iter().position(|k| *k == self).unwrap()
    }
}

/// One injected fault, for the report.
#[derive(Debug, Clone)]
pub struct Injected {
    pub at_s: f64,
    pub kind: Kind,
    pub took_ms: u64,
    pub detail: String,
}

/// One xmin pin, from its start to its release.
#[derive(Debug, Clone)]
pub struct Pin {
    pub at_s: f64,
    pub held_s: f64,
    /// Sessions it took: more than one when a restart ended one.
    pub sessions: u32,
    /// `age(backend_xmin)` of the pinning session just before its release.
    pub xmin_age_at_release: Option<i32>,
    /// webhook_inbox's `n_dead_tup` at the start and at the release (pg_stat counters).
    pub dead_tuples_start: Option<i64>,
    pub dead_tuples_release: Option<i64>,
    pub ended_by: &'static str,
}

/// How the server can be restarted.
pub enum Server {
    /// The run's own cluster.
    Own(Arc<Cluster>),
    /// The cluster of `scripts/pg.sh` (in this repository).
    PgSh(PathBuf),
    /// Somebody else's: no restarts.
    Foreign,
}

pub struct Faults {
    /// A superuser's connection settings (database: the server's admin database).
    pub admin: tokio_postgres::Config,
    pub database: String,
    pub server: Server,
    pub log_dir: PathBuf,
    pub supervisor: Arc<Supervisor>,
    /// Kinds that cannot be injected here, and why.
    pub disabled: Vec<(Kind, String)>,
    /// How long an xmin pin lasts.
    pub xmin_hold: Duration,
    /// The role `pool_exhausted` connects as.
    pub hog_role: String,
    pub counts: Mutex<[u64; KINDS.len()]>,
    pub backends_terminated: Mutex<u64>,
    pub log: Mutex<Vec<Injected>>,
    pub errors: Mutex<Vec<String>>,
    pub pins: Mutex<Vec<Pin>>,
    pub started: Instant,
    /// The run's nats-server (`nats_restart`), when there is one.
    pub nats: Option<Arc<Mutex<inbox_test_support::nats::Nats>>>,
    pin_active: AtomicBool,
    pin_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Faults {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        admin: tokio_postgres::Config,
        database: String,
        server: Server,
        log_dir: PathBuf,
        supervisor: Arc<Supervisor>,
        disabled: Vec<(Kind, String)>,
        xmin_hold: Duration,
        hog_role: String,
        started: Instant,
    ) -> Faults {
        Faults {
            admin,
            database,
            server,
            log_dir,
            supervisor,
            disabled,
            xmin_hold,
            hog_role,
            counts: Mutex::default(),
            backends_terminated: Mutex::default(),
            log: Mutex::default(),
            errors: Mutex::default(),
            pins: Mutex::default(),
            started,
            nats: None,
            pin_active: AtomicBool::new(false),
            pin_task: Mutex::default(),
        }
    }

    pub fn count(&self, kind: Kind) -> u64 {
        self.counts.lock().unwrap()[kind.index()]
    }

    pub fn skipped(&self, kind: Kind) -> Option<&str> {
        self.disabled.iter().find(|(k, _)| *k == kind).map(|(_, why)| why.as_str())
    }

    /// Injects faults until `stop`; returns after the fault in progress (and an xmin pin) is
    /// over. In the first round, a wait is at most `first_round_wait`, so that a short run still
    /// sees every kind.
    pub async fn run(
        self: Arc<Self>,
        interval: Duration,
        first_round_wait: Duration,
        mut rng: Rng,
        stop: CancellationToken,
    ) {
        let enabled: Vec<Kind> = KINDS.iter().copied().filter(|k| self.skipped(*k).is_none()).collect();
        let mut first_round: std::collections::VecDeque<Kind> = enabled.iter().copied().collect();
        let mut ingest_graceful = false;
        loop {
            let mut wait = interval.mul_f64(rng.range(0.5, 1.5));
            if !first_round.is_empty() {
                wait = wait.min(first_round_wait);
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
            let kind = match first_round.pop_front() {
                Some(k) => k,
                None => {
                    // One pin at a time.
                    let pinned = self.pin_active.load(Ordering::SeqCst);
                    let now: Vec<Kind> =
                        enabled.iter().copied().filter(|k| !(pinned && *k == Kind::XminPinned)).collect();
                    pick_weighted(&now, &mut rng)
                }
            };
            let began = Instant::now();
            let result = match kind {
                Kind::WorkerSigkill => Ok(self
                    .supervisor
                    .stop_random(&[Role::Worker], false, &mut rng)
                    .map(|(slot, pid)| format!("SIGKILL {slot} (pid {pid}); restarted after ~1 s"))),
                Kind::IngestRestart => {
                    // Alternate between a crash (SIGKILL) and a graceful stop (SIGTERM).
                    ingest_graceful = !ingest_graceful;
                    let graceful = !ingest_graceful;
                    Ok(self.supervisor.stop_random(&[Role::Ingest], graceful, &mut rng).map(|(slot, pid)| {
                        let how = if graceful { "SIGTERM" } else { "SIGKILL" };
                        format!("{how} {slot} (pid {pid}); restarted on the same port after ~1 s")
                    }))
                }
                Kind::BackendTerminated => self.terminate_backends(&mut rng).await,
                Kind::ConnectionsBlocked => self.block_connections(&mut rng).await.map(Some),
                Kind::PgRestartFast => self.pg_restart("fast").await.map(Some),
                Kind::PgRestartImmediate => self.pg_restart("immediate").await.map(Some),
                Kind::XminPinned => self.pin_xmin(stop.clone()).await.map(Some),
                Kind::PoolExhausted => self.exhaust_pool(&mut rng).await.map(Some),
                Kind::WalDiskFull => self.fill_wal_disk(&mut rng).await.map(Some),
                Kind::RelaySigkill => Ok(self
                    .supervisor
                    .stop_random(&[Role::RelayHttp, Role::RelayNats], false, &mut rng)
                    .map(|(slot, pid)| format!("SIGKILL {slot} (pid {pid}); restarted after ~1 s"))),
                Kind::RelaySigstop => self.freeze_relay(&mut rng).await,
                Kind::NatsRestart => self.restart_nats(&mut rng).await.map(Some),
            };
            match result {
                Ok(Some(detail)) => {
                    self.counts.lock().unwrap()[kind.index()] += 1;
                    let took_ms = began.elapsed().as_millis() as u64;
                    let at_s = began.duration_since(self.started).as_secs_f64();
                    println!("chaos: {at_s:7.1}s  {:<22} {detail}", kind.name());
                    self.log.lock().unwrap().push(Injected { at_s, kind, took_ms, detail });
                }
                // Nothing to hit right now (e.g. every worker is restarting): try again soon.
                Ok(None) => first_round.push_front(kind),
                Err(e) => {
                    let text = format!("{}: {e:#}", kind.name());
                    eprintln!("chaos: fault injection failed: {text}");
                    self.errors.lock().unwrap().push(text);
                    first_round.push_front(kind);
                }
            }
        }
        let pin = self.pin_task.lock().unwrap().take();
        if let Some(pin) = pin {
            let _ = pin.await;
        }
    }

    async fn admin_client(&self) -> anyhow::Result<tokio_postgres::Client> {
        connect(&self.admin).await
    }

    /// `pg_terminate_backend` on 1–3 random backends of the services on the chaos database.
    async fn terminate_backends(&self, rng: &mut Rng) -> anyhow::Result<Option<String>> {
        let client = self.admin_client().await?;
        let (done, of) = self.terminate_service_backends(&client, rng).await?;
        if done.is_empty() {
            return Ok(None);
        }
        Ok(Some(format!("terminated {} of {of} backends: {}", done.len(), done.join(", "))))
    }

    /// Terminates 1–3 of the services' backends (half the time preferring one in the middle of
    /// something: a transaction, a statement, where a lost connection hurts). Returns what it
    /// terminated and of how many.
    async fn terminate_service_backends(
        &self,
        client: &tokio_postgres::Client,
        rng: &mut Rng,
    ) -> anyhow::Result<(Vec<String>, usize)> {
        let rows = client
            .query(
                "SELECT pid, application_name, state FROM pg_stat_activity
                  WHERE datname = $1 AND application_name LIKE 'inbox-%' AND pid <> pg_backend_pid()",
                &[&self.database],
            )
            .await?;
        let mut victims: Vec<(i32, String, String)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get::<_, Option<String>>(2).unwrap_or_default()))
            .collect();
        let n = (1 + rng.below(3)).min(victims.len());
        let mut done = Vec::new();
        for _ in 0..n {
            let busy: Vec<usize> = (0..victims.len()).filter(|i| victims[*i].2 != "idle").collect();
            let pick = if !busy.is_empty() && rng.chance(0.5) {
                busy[rng.below(busy.len())]
            } else {
                rng.below(victims.len())
            };
            let (pid, app, state) = victims.swap_remove(pick);
            let ok: bool = client.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await?.get(0);
            if ok {
                done.push(format!("{app}/{pid} ({state})"));
            }
        }
        *self.backends_terminated.lock().unwrap() += done.len() as u64;
        Ok((done, rows.len()))
    }

    /// Terminates one backend of the chaos database whose application_name is `app` (one in a
    /// transaction or a statement when there is one).
    async fn terminate_one(
        &self,
        client: &tokio_postgres::Client,
        app: &str,
        rng: &mut Rng,
    ) -> anyhow::Result<Option<String>> {
        let rows = client
            .query(
                "SELECT pid, state FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                &[&self.database, &app],
            )
            .await?;
        let busy: Vec<_> = rows.iter().filter(|r| r.get::<_, Option<&str>>(1) != Some("idle")).collect();
        let pool = if busy.is_empty() { rows.iter().collect() } else { busy };
        if pool.is_empty() {
            return Ok(None);
        }
        let row = pool[rng.below(pool.len())];
        let (pid, state): (i32, Option<String>) = (row.get(0), row.get(1));
        let ok: bool = client.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await?.get(0);
        if !ok {
            return Ok(None);
        }
        *self.backends_terminated.lock().unwrap() += 1;
        Ok(Some(format!("{app}/{pid} ({})", state.unwrap_or_default())))
    }

    /// `ALLOW_CONNECTIONS false` for 2–5 s: sessions already open keep working, new ones fail.
    async fn block_connections(&self, rng: &mut Rng) -> anyhow::Result<String> {
        let client = self.admin_client().await?;
        client
            .batch_execute(&format!("ALTER DATABASE \"{}\" WITH ALLOW_CONNECTIONS false", self.database))
            .await?;
        let hold = Duration::from_secs_f64(rng.range(2.0, 5.0));
        tokio::time::sleep(hold).await;
        allow_connections(&self.admin, &self.database).await?;
        Ok(format!("new connections to {} refused for {:.1} s", self.database, hold.as_secs_f64()))
    }

    /// SIGSTOP a relay for 8–10 s (past its 6 s lease), then SIGCONT.
    async fn freeze_relay(&self, rng: &mut Rng) -> anyhow::Result<Option<String>> {
        let Some((slot, pid)) = self.supervisor.pick_running(&[Role::RelayHttp, Role::RelayNats], rng) else {
            return Ok(None);
        };
        let hold = Duration::from_secs_f64(rng.range(8.0, 10.0));
        inbox_test_support::process::kill(pid as i32, libc::SIGSTOP);
        tokio::time::sleep(hold).await;
        inbox_test_support::process::kill(pid as i32, libc::SIGCONT);
        Ok(Some(format!("SIGSTOP {slot} (pid {pid}) for {:.1} s, then SIGCONT", hold.as_secs_f64())))
    }

    /// SIGKILL the nats-server, start it again on its port and store after 1–3 s.
    async fn restart_nats(&self, rng: &mut Rng) -> anyhow::Result<String> {
        let nats = self.nats.clone().ok_or_else(|| anyhow::anyhow!("no nats-server"))?;
        let down = Duration::from_secs_f64(rng.range(1.0, 3.0));
        let n = nats.clone();
        tokio::task::spawn_blocking(move || n.lock().unwrap().kill(0)).await?;
        tokio::time::sleep(down).await;
        tokio::task::spawn_blocking(move || nats.lock().unwrap().start_node(0)).await?;
        Ok(format!("nats-server SIGKILLed, started again after {:.1} s", down.as_secs_f64()))
    }

    /// The server restarts (`pg_ctl restart -m <mode>`; `scripts/pg.sh restart <mode>` for its
    /// cluster) and is waited for until it accepts connections.
    async fn pg_restart(&self, mode: &'static str) -> anyhow::Result<String> {
        let started = Instant::now();
        match &self.server {
            Server::Own(cluster) => {
                let cluster = cluster.clone();
                tokio::task::spawn_blocking(move || cluster.restart(mode)).await??;
            }
            Server::PgSh(root) => {
                let script = root.join("scripts/pg.sh");
                let log_path = self.log_dir.join("pg-restarts.log");
                let status =
                    tokio::task::spawn_blocking(move || -> anyhow::Result<std::process::ExitStatus> {
                        let mut log = std::fs::File::options().create(true).append(true).open(&log_path)?;
                        use std::io::Write as _;
                        writeln!(log, "=== chaos: pg.sh restart {mode} at {} ===", crate::procs::unix_now())?;
                        Ok(std::process::Command::new(script)
                            .args(["restart", mode])
                            .stdin(Stdio::null())
                            .stdout(log.try_clone()?)
                            .stderr(log)
                            .status()?)
                    })
                    .await??;
                if !status.success() {
                    anyhow::bail!("scripts/pg.sh restart {mode} failed ({status}); see pg-restarts.log");
                }
            }
            Server::Foreign => anyhow::bail!("not our server: no restarts"),
        }
        Ok(format!("pg_ctl restart -m {mode}: ready again after {:.1} s", started.elapsed().as_secs_f64()))
    }

    /// Connection settings of the xmin-pinning session.
    fn pin_config(&self) -> tokio_postgres::Config {
        let mut config = self.admin.clone();
        config.dbname(&self.database).application_name("chaos-xmin-pin");
        config
    }

    /// Opens a session that holds a snapshot and an xid, idle in transaction. Returns it and its
    /// backend's pid.
    async fn open_pin(&self) -> anyhow::Result<(tokio_postgres::Client, i32)> {
        let client = connect(&self.pin_config()).await?;
        // Exempt from a server-wide idle_in_transaction_session_timeout, if one is set.
        client
            .batch_execute("SET idle_in_transaction_session_timeout = 0; SET statement_timeout = 0")
            .await?;
        client.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ").await?;
        // The first statement takes the transaction's snapshot; then an xid of its own.
        client.query_one("SELECT count(*) FROM webhook_inbox", &[]).await?;
        let pid: i32 =
            client.query_one("SELECT pg_current_xact_id() IS NOT NULL, pg_backend_pid()", &[]).await?.get(1);
        Ok((client, pid))
    }

    /// `xmin_pinned`: opens the pinning session and leaves a task holding it for
    /// [`Faults::xmin_hold`] (or until `stop`).
    async fn pin_xmin(self: &Arc<Self>, stop: CancellationToken) -> anyhow::Result<String> {
        let (client, pid) = self.open_pin().await?;
        let admin = connect(&self.pin_config()).await?;
        let row = admin
            .query_one(
                "SELECT backend_xid::text, backend_xmin::text, state FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await?;
        let (xid, xmin, state): (Option<String>, Option<String>, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        let dead = dead_tuples(&admin).await.ok();
        drop(admin);
        self.pin_active.store(true, Ordering::SeqCst);
        let at_s = self.started.elapsed().as_secs_f64();
        let this = self.clone();
        let task = tokio::spawn(async move { this.hold_pin(client, pid, at_s, dead, stop).await });
        if let Some(previous) = self.pin_task.lock().unwrap().replace(task) {
            previous.abort();
        }
        Ok(format!(
            "backend {pid} ({}, REPEATABLE READ, xid {}, xmin {}) holds its snapshot for {:.0} s (webhook_inbox \
             n_dead_tup now {})",
            state.unwrap_or_default(),
            xid.unwrap_or_default(),
            xmin.unwrap_or_default(),
            self.xmin_hold.as_secs_f64(),
            dead.map_or("?".into(), |d| d.to_string())
        ))
    }

    async fn hold_pin(
        self: Arc<Self>,
        mut client: tokio_postgres::Client,
        mut pid: i32,
        at_s: f64,
        dead_start: Option<i64>,
        stop: CancellationToken,
    ) {
        let began = Instant::now();
        let deadline = tokio::time::Instant::now() + self.xmin_hold;
        let mut sessions = 1;
        let ended_by = loop {
            tokio::select! {
                _ = stop.cancelled() => break "the end of the load",
                _ = tokio::time::sleep_until(deadline) => break "its time",
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            if client.is_closed() {
                // A restart (or a PANIC) ended the session: pin again as soon as the server is back.
                if let Ok((c, p)) = self.open_pin().await {
                    (client, pid) = (c, p);
                    sessions += 1;
                }
            }
        };
        let mut xmin_age = None;
        let mut dead_release = None;
        // The server may be restarting right now: try for a few seconds.
        for _ in 0..20 {
            let Ok(admin) = connect(&self.pin_config()).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            if !client.is_closed() {
                xmin_age = admin
                    .query_opt("SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = $1", &[&pid])
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| r.get::<_, Option<i32>>(0));
            }
            dead_release = dead_tuples(&admin).await.ok();
            break;
        }
        let _ = client.batch_execute("ROLLBACK").await;
        drop(client);
        self.pin_active.store(false, Ordering::SeqCst);
        let pin = Pin {
            at_s,
            held_s: began.elapsed().as_secs_f64(),
            sessions,
            xmin_age_at_release: xmin_age,
            dead_tuples_start: dead_start,
            dead_tuples_release: dead_release,
            ended_by,
        };
        println!(
            "chaos: {:7.1}s  {:<22} {}",
            self.started.elapsed().as_secs_f64(),
            "xmin_pinned (end)",
            pin.describe()
        );
        self.pins.lock().unwrap().push(pin);
    }

    /// `pool_exhausted`: see the module's documentation.
    async fn exhaust_pool(&self, rng: &mut Rng) -> anyhow::Result<String> {
        // Our own superuser session first: the reserve keeps it possible once the server is full.
        let admin = self.admin_client().await?;
        let max: String = admin.query_one("SHOW max_connections", &[]).await?.get(0);
        let reserved: String = admin.query_one("SHOW superuser_reserved_connections", &[]).await?.get(0);
        let mut hog = self.admin.clone();
        hog.user(&self.hog_role)
            .dbname("postgres")
            .application_name("chaos-pool-hog")
            .connect_timeout(Duration::from_secs(5));
        let started = Instant::now();
        let mut held: Vec<tokio_postgres::Client> = Vec::new();
        // Eight at a time until the server says it is full.
        loop {
            anyhow::ensure!(held.len() < 2000, "the server took 2000 connections without refusing one");
            let attempts = futures_join8(&hog).await;
            let mut full = false;
            for attempt in attempts {
                match attempt {
                    Ok(client) => held.push(client),
                    Err(e) if too_many_connections(&e) => full = true,
                    Err(e) => anyhow::bail!("opening connection {}: {e:#}", held.len() + 1),
                }
            }
            if full {
                break;
            }
        }
        let filled_ms = started.elapsed().as_millis();
        let backends: i64 = admin
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'", &[])
            .await?
            .get(0);
        // The services must now open connections into a full server: one of the ingest's and
        // one of the workers' is terminated.
        let mut terminated = Vec::new();
        for app in ["inbox-ingest", "inbox-worker"] {
            terminated.extend(self.terminate_one(&admin, app, rng).await?);
        }
        let hold = Duration::from_secs_f64(rng.range(3.0, 6.0));
        let until = Instant::now() + hold;
        let mut retaken = 0;
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Ok(client) = connect_raw(&hog).await {
                held.push(client);
                retaken += 1;
            }
        }
        let n = held.len();
        drop(held);
        Ok(format!(
            "{n} connections of role {} (max_connections {max}, {reserved} reserved for superusers; \
             {backends} client backends in all) filled the server in {filled_ms} ms; terminated {} service \
             backend(s) [{}]; re-took {retaken} freed slot(s); released after {:.1} s",
            self.hog_role,
            terminated.len(),
            terminated.join(", "),
            hold.as_secs_f64()
        ))
    }

    /// `wal_disk_full`: see the module's documentation.
    async fn fill_wal_disk(&self, rng: &mut Rng) -> anyhow::Result<String> {
        let Server::Own(cluster) = &self.server else { anyhow::bail!("not our own cluster") };
        let started = Instant::now();
        let log_from = cluster.log_len();
        let c = cluster.clone();
        let ballast = tokio::task::spawn_blocking(move || c.fill_wal_fs()).await?;
        // Whatever happens from here, the ballast goes.
        let _remove = Ballast(cluster.clone());
        let ballast = ballast?;
        // New segments until PostgreSQL must create one (the recycled ones are reused first).
        let mut switches = 0;
        let mut lost_at = None;
        if let Ok(admin) = self.admin_client().await {
            while started.elapsed() < Duration::from_secs(20) {
                switches += 1;
                if admin.query_one("SELECT pg_switch_wal()::text", &[]).await.is_err() {
                    lost_at = Some(started.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        } else {
            lost_at = Some(started.elapsed());
        }
        // The disk stays full a little longer: the server crash-restarts into it.
        tokio::time::sleep(Duration::from_secs_f64(rng.range(2.0, 4.0))).await;
        let up_while_full = match self.admin_client().await {
            Ok(client) => client.simple_query("SELECT 1").await.is_ok(),
            Err(_) => false,
        };
        let c = cluster.clone();
        let postmaster_alive = tokio::task::spawn_blocking(move || c.running()).await?;
        cluster.remove_ballast();
        let freed_at = started.elapsed();
        // Back up: by itself if its recovery had not reached the full disk, else started again.
        let mut started_by_us = false;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(client) = self.admin_client().await {
                if client.simple_query("SELECT 1").await.is_ok() {
                    break;
                }
            }
            anyhow::ensure!(Instant::now() < deadline, "PostgreSQL not back 90 s after the disk was freed");
            let c = cluster.clone();
            if !tokio::task::spawn_blocking(move || c.running()).await? {
                let c = cluster.clone();
                if tokio::task::spawn_blocking(move || c.start()).await?.is_ok() {
                    started_by_us = true;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // What the server said meanwhile.
        let said = cluster.log_since(log_from);
        let panic = said
            .lines()
            .find(|l| l.contains(" PANIC: "))
            .map(|l| l.split_once(" PANIC: ").map_or(l, |(_, message)| message).trim().to_owned());
        let startup_failed = said.contains("shutting down due to startup process failure");
        let what = match (&panic, lost_at) {
            (Some(message), _) => format!(
                "PANIC: {message} (at WAL switch {switches}); {}",
                if startup_failed {
                    "its crash recovery could not write WAL either: the server shut itself down"
                } else if up_while_full {
                    "it crash-recovered into a recycled segment while the disk was still full"
                } else if postmaster_alive {
                    "it was still crash-recovering when the space was freed"
                } else {
                    "the server was down"
                }
            ),
            (None, Some(t)) => {
                format!("lost the connection after {:.1} s but the server logged no PANIC", t.as_secs_f64())
            }
            (None, None) => format!("no PANIC within 20 s ({switches} WAL switches)"),
        };
        Ok(format!(
            "pg_wal's filesystem filled ({} MiB ballast); {what}; space freed after {:.1} s; {}accepting connections \
             after {:.1} s",
            ballast >> 20,
            freed_at.as_secs_f64(),
            if started_by_us { "started again, " } else { "" },
            started.elapsed().as_secs_f64()
        ))
    }
}

impl Pin {
    pub fn describe(&self) -> String {
        let n = |v: Option<i64>| v.map_or("?".into(), |v| v.to_string());
        format!(
            "xmin pinned {:.1} s from {:.1} s ({} session{}), ended by {}; age(backend_xmin) at release {}; \
             webhook_inbox n_dead_tup {} -> {}",
            self.held_s,
            self.at_s,
            self.sessions,
            if self.sessions == 1 { "" } else { "s: restarts ended the others" },
            self.ended_by,
            self.xmin_age_at_release
                .map_or("? (a restart had just ended the session)".into(), |a| a.to_string()),
            n(self.dead_tuples_start),
            n(self.dead_tuples_release)
        )
    }
}

/// Removes the WAL ballast when dropped.
struct Ballast(Arc<Cluster>);

impl Drop for Ballast {
    fn drop(&mut self) {
        self.0.remove_ballast();
    }
}

/// webhook_inbox's `n_dead_tup` (pg_stat counters: approximate, and reset by a crash restart).
async fn dead_tuples(client: &tokio_postgres::Client) -> anyhow::Result<i64> {
    Ok(client
        .query_one("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'webhook_inbox'", &[])
        .await?
        .get(0))
}

/// Eight connection attempts at once.
async fn futures_join8(
    config: &tokio_postgres::Config,
) -> Vec<Result<tokio_postgres::Client, tokio_postgres::Error>> {
    let (a, b, c, d, e, f, g, h) = tokio::join!(
        connect_raw(config),
        connect_raw(config),
        connect_raw(config),
        connect_raw(config),
        connect_raw(config),
        connect_raw(config),
        connect_raw(config),
        connect_raw(config)
    );
    vec![a, b, c, d, e, f, g, h]
}

fn too_many_connections(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::TOO_MANY_CONNECTIONS)
}

/// Connects and drives the connection in the background; the driver's error as it is.
async fn connect_raw(
    config: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn pick_weighted(kinds: &[Kind], rng: &mut Rng) -> Kind {
    let total: u32 = kinds.iter().map(|k| k.weight()).sum();
    let mut roll = rng.below(total as usize) as u32;
    for k in kinds {
        if roll < k.weight() {
            return *k;
        }
        roll -= k.weight();
    }
    kinds[0]
}

/// Connects (5 s timeout) and drives the connection in the background.
pub async fn connect(config: &tokio_postgres::Config) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio::time::timeout(Duration::from_secs(5), config.connect(NoTls))
        .await
        .map_err(|_| anyhow::anyhow!("connecting to PostgreSQL timed out"))??;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// `ALLOW_CONNECTIONS true`, retried for up to a minute (the server may be restarting).
pub async fn allow_connections(admin: &tokio_postgres::Config, database: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let client = connect(admin).await?;
            client
                .batch_execute(&format!("ALTER DATABASE \"{database}\" WITH ALLOW_CONNECTIONS true"))
                .await?;
            anyhow::Ok(())
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(e.context("re-allowing connections")),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}
