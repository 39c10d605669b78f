//! The fault injector: one fault at a time, about every `--fault-interval`; every kind once
//! (round-robin) first, then at random.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;

use crate::procs::{Role, Supervisor};
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    WorkerSigkill,
    BackendTerminated,
    ConnectionsBlocked,
    IngestRestart,
    PgRestartFast,
    PgRestartImmediate,
}

pub const KINDS: [Kind; 6] = [
    Kind::WorkerSigkill,
    Kind::BackendTerminated,
    Kind::ConnectionsBlocked,
    Kind::IngestRestart,
    Kind::PgRestartFast,
    Kind::PgRestartImmediate,
];

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::WorkerSigkill => "worker_sigkill",
            Kind::BackendTerminated => "backend_terminated",
            Kind::ConnectionsBlocked => "connections_blocked",
            Kind::IngestRestart => "ingest_restart",
            Kind::PgRestartFast => "pg_restart_fast",
            Kind::PgRestartImmediate => "pg_restart_immediate",
        }
    }

    /// Relative weight once every kind was injected once.
    fn weight(self) -> u32 {
        match self {
            Kind::WorkerSigkill => 30,
            Kind::BackendTerminated => 25,
            Kind::ConnectionsBlocked => 15,
            Kind::IngestRestart => 10,
            Kind::PgRestartFast => 10,
            Kind::PgRestartImmediate => 10,
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

pub struct Faults {
    pub admin: tokio_postgres::Config,
    pub database: String,
    pub repo_root: PathBuf,
    pub log_dir: PathBuf,
    pub supervisor: Arc<Supervisor>,
    /// Kinds that cannot be injected here (PostgreSQL restarts of a server we do not manage).
    pub disabled: Vec<Kind>,
    pub counts: Mutex<[u64; 6]>,
    pub backends_terminated: Mutex<u64>,
    pub log: Mutex<Vec<Injected>>,
    pub errors: Mutex<Vec<String>>,
    pub started: Instant,
}

impl Faults {
    pub fn count(&self, kind: Kind) -> u64 {
        self.counts.lock().unwrap()[kind.index()]
    }

    /// Injects faults until `stop`; returns after the fault in progress is over.
    pub async fn run(self: Arc<Self>, interval: Duration, mut rng: Rng, stop: CancellationToken) {
        let enabled: Vec<Kind> = KINDS.iter().copied().filter(|k| !self.disabled.contains(k)).collect();
        let mut first_round: std::collections::VecDeque<Kind> = enabled.iter().copied().collect();
        let mut ingest_graceful = false;
        loop {
            let wait = interval.mul_f64(rng.range(0.5, 1.5));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let kind = match first_round.pop_front() {
                Some(k) => k,
                None => pick_weighted(&enabled, &mut rng),
            };
            let began = Instant::now();
            let result = match kind {
                Kind::WorkerSigkill => Ok(self
                    .supervisor
                    .stop_random(Role::Worker, false, &mut rng)
                    .map(|(slot, pid)| format!("SIGKILL {slot} (pid {pid}); restarted after ~1 s"))),
                Kind::IngestRestart => {
                    // Alternate between a crash (SIGKILL) and a graceful stop (SIGTERM).
                    ingest_graceful = !ingest_graceful;
                    let graceful = !ingest_graceful;
                    Ok(self.supervisor.stop_random(Role::Ingest, graceful, &mut rng).map(|(slot, pid)| {
                        let how = if graceful { "SIGTERM" } else { "SIGKILL" };
                        format!("{how} {slot} (pid {pid}); restarted on the same port after ~1 s")
                    }))
                }
                Kind::BackendTerminated => self.terminate_backends(&mut rng).await,
                Kind::ConnectionsBlocked => self.block_connections(&mut rng).await.map(Some),
                Kind::PgRestartFast => self.pg_restart("fast").await.map(Some),
                Kind::PgRestartImmediate => self.pg_restart("immediate").await.map(Some),
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
    }

    async fn admin_client(&self) -> anyhow::Result<tokio_postgres::Client> {
        connect(&self.admin).await
    }

    /// `pg_terminate_backend` on 1–3 random backends of the services on the chaos database.
    async fn terminate_backends(&self, rng: &mut Rng) -> anyhow::Result<Option<String>> {
        let client = self.admin_client().await?;
        let rows = client
            .query(
                "SELECT pid, application_name, state FROM pg_stat_activity
                  WHERE datname = $1 AND application_name LIKE 'inbox-%' AND pid <> pg_backend_pid()",
                &[&self.database],
            )
            .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut victims: Vec<(i32, String, String)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get::<_, Option<String>>(2).unwrap_or_default()))
            .collect();
        let n = (1 + rng.below(3)).min(victims.len());
        let mut done = Vec::new();
        for _ in 0..n {
            // Half the time prefer a backend in the middle of something (a transaction, a
            // statement): that is where a lost connection hurts.
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
        if done.is_empty() {
            return Ok(None);
        }
        *self.backends_terminated.lock().unwrap() += done.len() as u64;
        Ok(Some(format!("terminated {} of {} backends: {}", done.len(), rows.len(), done.join(", "))))
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

    /// `scripts/pg.sh restart <mode>`: the local cluster restarts and waits until it is ready.
    async fn pg_restart(&self, mode: &'static str) -> anyhow::Result<String> {
        let script = self.repo_root.join("scripts/pg.sh");
        let log_path = self.log_dir.join("pg-restarts.log");
        let started = Instant::now();
        let status = tokio::task::spawn_blocking(move || -> anyhow::Result<std::process::ExitStatus> {
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
        Ok(format!("pg_ctl restart -m {mode}: ready again after {:.1} s", started.elapsed().as_secs_f64()))
    }
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
