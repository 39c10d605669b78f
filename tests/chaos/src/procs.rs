//! The service processes: two `inbox-ingest`, three `inbox-worker run`, two `inbox-worker relay`
//! to the HTTP receiver and two to NATS JetStream, each in a slot that is
//! restarted when its process is gone (killed by the fault injector, or refused to start because
//! the database was away at that moment). Output goes to `target/chaos/logs/<slot>.log`.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Ingest,
    Worker,
    /// `inbox-worker relay --to-url` the run's receiver.
    RelayHttp,
    /// `inbox-worker relay --to-nats` the run's nats-server.
    RelayNats,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Ingest => "ingest",
            Role::Worker => "worker",
            Role::RelayHttp => "relay-http",
            Role::RelayNats => "relay-nats",
        }
    }
}

/// How the service processes are started.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The ingest's and the workers' `DATABASE_URL` (each its own role on the run's own cluster).
    pub ingest_url: String,
    pub worker_url: String,
    pub endpoints: String,
    pub max_attempts: u32,
    pub log_dir: PathBuf,
    /// The relays: `DATABASE_URL` of the HTTP ones (the outbox) and of the NATS ones (its copy,
    /// see relay.rs), the receiver's URL and signing secret, the nats-server's URL. No relay slot
    /// for a destination that is None.
    pub relay: Option<RelaySpec>,
}

/// How the relays are started.
#[derive(Debug, Clone)]
pub struct RelaySpec {
    pub http_db_url: String,
    pub nats_db_url: String,
    pub receiver_url: String,
    pub secret: String,
    pub nats_url: Option<String>,
    pub subject: String,
    /// Relays per destination.
    pub per_destination: usize,
}

struct Slot {
    role: Role,
    index: usize,
    /// Ingest only: the fixed port, kept across restarts.
    port: u16,
    child: Option<Child>,
    started: Instant,
    log_path: PathBuf,
    /// Where this instance's output starts in the log file.
    log_offset: u64,
    /// When a process that is gone should be started again.
    restart_at: Option<Instant>,
    /// The current process was stopped on purpose (fault or shutdown).
    stopping: bool,
    /// SIGTERM sent: SIGKILL after this instant.
    kill_after: Option<Instant>,
    /// Consecutive start-ups that ended before the process served.
    failed_starts: u32,
}

/// A process exit nobody asked for.
#[derive(Debug, Clone)]
pub struct Exit {
    pub slot: String,
    pub pid: u32,
    pub status: String,
    pub uptime_s: f64,
    /// Exit 1 with "cannot connect to the database": the documented refusal to start while the
    /// database is away (expected under these faults). Anything else is a crash.
    pub startup_refused: bool,
    pub log_tail: String,
}

/// A process that did not stop cleanly at the end (SIGTERM → exit 0 expected).
#[derive(Debug, Clone)]
pub struct UncleanStop {
    pub slot: String,
    pub status: String,
}

pub struct Supervisor {
    spec: Spec,
    slots: Mutex<Vec<Slot>>,
    exits: Mutex<Vec<Exit>>,
    starts: Mutex<u64>,
}

impl Supervisor {
    pub fn new(spec: Spec, ingest_ports: &[u16], workers: usize) -> Supervisor {
        let mut slots = Vec::new();
        let mut add = |role: Role, index: usize, port: u16| {
            slots.push(Slot {
                role,
                index,
                port,
                child: None,
                started: Instant::now(),
                log_path: spec.log_dir.join(format!("{}-{index}.log", role.name())),
                log_offset: 0,
                restart_at: Some(Instant::now()),
                stopping: false,
                kill_after: None,
                failed_starts: 0,
            });
        };
        for (i, port) in ingest_ports.iter().enumerate() {
            add(Role::Ingest, i, *port);
        }
        for i in 0..workers {
            add(Role::Worker, i, 0);
        }
        if let Some(relay) = &spec.relay {
            for i in 0..relay.per_destination {
                add(Role::RelayHttp, i, 0);
                if relay.nats_url.is_some() {
                    add(Role::RelayNats, i, 0);
                }
            }
        }
        Supervisor { spec, slots: Mutex::new(slots), exits: Mutex::default(), starts: Mutex::new(0) }
    }

    /// Reaps exited processes and starts the slots that are due. Call it often (every 200 ms).
    pub fn tick(&self) {
        let mut slots = self.slots.lock().unwrap();
        let now = Instant::now();
        for slot in slots.iter_mut() {
            if let Some(child) = slot.child.as_mut() {
                if let (Some(deadline), true) = (slot.kill_after, slot.stopping) {
                    if now >= deadline {
                        let _ = child.kill();
                        slot.kill_after = None;
                    }
                }
                match child.try_wait() {
                    Ok(Some(status)) => {
                        let pid = child.id();
                        slot.child = None;
                        let uptime = slot.started.elapsed();
                        if slot.stopping {
                            slot.stopping = false;
                            slot.kill_after = None;
                            slot.failed_starts = 0;
                            slot.restart_at = Some(now + Duration::from_secs(1));
                        } else {
                            let tail = log_tail(&slot.log_path, slot.log_offset, 2048);
                            let refused = status.code() == Some(1)
                                && (tail.contains("cannot connect to the database")
                                    || tail.contains("the database does not answer")
                                    // A relay starting while nats-server restarts.
                                    || tail.contains("cannot connect to NATS")
                                    || tail.contains("finding the JetStream stream"));
                            slot.failed_starts = if refused { slot.failed_starts + 1 } else { 0 };
                            let backoff = Duration::from_millis(500 << slot.failed_starts.min(3));
                            slot.restart_at = Some(now + backoff);
                            self.exits.lock().unwrap().push(Exit {
                                slot: slot_name(slot),
                                pid,
                                status: status.to_string(),
                                uptime_s: uptime.as_secs_f64(),
                                startup_refused: refused,
                                log_tail: tail,
                            });
                        }
                    }
                    Ok(None) => {}
                    Err(e) => eprintln!("chaos: waiting for {}: {e}", slot_name(slot)),
                }
            }
            if slot.child.is_none() && slot.restart_at.is_some_and(|at| at <= now) {
                slot.restart_at = None;
                if let Err(e) = self.start(slot) {
                    eprintln!("chaos: starting {}: {e:#}", slot_name(slot));
                    slot.restart_at = Some(now + Duration::from_secs(1));
                }
            }
        }
    }

    fn start(&self, slot: &mut Slot) -> anyhow::Result<()> {
        let mut log = File::options().create(true).append(true).open(&slot.log_path)?;
        slot.log_offset = log.metadata()?.len();
        let mut cmd = match slot.role {
            Role::Ingest => {
                let mut cmd = inbox_test_support::process::command("inbox-ingest");
                cmd.env("INBOX_LISTEN", format!("127.0.0.1:{}", slot.port))
                    .env("INBOX_ENDPOINTS", &self.spec.endpoints)
                    .env("INBOX_DB_TIMEOUT", "2s")
                    .env("DATABASE_URL", &self.spec.ingest_url);
                cmd
            }
            Role::Worker => {
                let mut cmd = inbox_test_support::process::command("inbox-worker");
                cmd.args([
                    "run",
                    "--concurrency",
                    "4",
                    "--lease",
                    "10s",
                    "--statement-timeout",
                    "3s",
                    "--poll-interval",
                    "200ms",
                    "--shutdown-timeout",
                    "5s",
                    "--max-attempts",
                ])
                .arg(self.spec.max_attempts.to_string())
                .env("DATABASE_URL", &self.spec.worker_url);
                cmd
            }
            Role::RelayHttp | Role::RelayNats => {
                let relay = self.spec.relay.as_ref().expect("relay slots only with a relay spec");
                let mut cmd = inbox_test_support::process::command("inbox-worker");
                // Short lease and retries, so that kills and stalls are retried within the run;
                // attempts high, so that the receiver's errors park nothing.
                cmd.args([
                    "relay",
                    "--lease",
                    "6s",
                    "--delivery-timeout",
                    "2s",
                    "--backoff",
                    "200ms",
                    "--max-backoff",
                    "2s",
                    "--max-attempts",
                    "1000",
                    "--poll-interval",
                    "200ms",
                    "--shutdown-timeout",
                    "5s",
                ]);
                if slot.role == Role::RelayHttp {
                    cmd.args(["--to-url", &relay.receiver_url])
                        .env("INBOX_RELAY_SECRET", &relay.secret)
                        .env("DATABASE_URL", &relay.http_db_url);
                } else {
                    cmd.args(["--to-nats", relay.nats_url.as_deref().unwrap_or_default()])
                        .args(["--subject", &relay.subject])
                        .env("DATABASE_URL", &relay.nats_db_url);
                }
                cmd
            }
        };
        cmd.env("LOG_FORMAT", "json")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log.try_clone()?);
        die_with_parent(&mut cmd);
        writeln!(log, "=== chaos: starting {} at {} ===", slot_name(slot), unix_now())?;
        let child = cmd.spawn()?;
        slot.child = Some(child);
        slot.started = Instant::now();
        slot.stopping = false;
        slot.kill_after = None;
        *self.starts.lock().unwrap() += 1;
        Ok(())
    }

    /// SIGKILLs (or SIGTERMs, when `graceful`) a random running process of one of `roles`; the
    /// slot restarts it about a second after it is gone. Returns the victim's name and pid.
    pub fn stop_random(&self, roles: &[Role], graceful: bool, rng: &mut Rng) -> Option<(String, u32)> {
        let mut slots = self.slots.lock().unwrap();
        let candidates: Vec<usize> = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| roles.contains(&s.role) && s.child.is_some() && !s.stopping)
            .map(|(i, _)| i)
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let slot = &mut slots[candidates[rng.below(candidates.len())]];
        let child = slot.child.as_mut()?;
        let pid = child.id();
        slot.stopping = true;
        if graceful {
            inbox_test_support::process::kill(pid as i32, libc::SIGTERM);
            slot.kill_after = Some(Instant::now() + Duration::from_secs(15));
        } else {
            let _ = child.kill();
        }
        Some((slot_name(slot), pid))
    }

    /// The pid of a random running process of one of `roles`, left running (for SIGSTOP).
    pub fn pick_running(&self, roles: &[Role], rng: &mut Rng) -> Option<(String, u32)> {
        let slots = self.slots.lock().unwrap();
        let candidates: Vec<&Slot> =
            slots.iter().filter(|s| roles.contains(&s.role) && s.child.is_some() && !s.stopping).collect();
        if candidates.is_empty() {
            return None;
        }
        let slot = candidates[rng.below(candidates.len())];
        Some((slot_name(slot), slot.child.as_ref()?.id()))
    }

    /// Whether every slot has a process that has been up for at least `min_uptime`.
    pub fn all_up(&self, min_uptime: Duration) -> bool {
        self.slots
            .lock()
            .unwrap()
            .iter()
            .all(|s| s.child.is_some() && !s.stopping && s.started.elapsed() >= min_uptime)
    }

    /// SIGTERM to every process, then waits (SIGKILL after `timeout`). Returns the processes that
    /// did not exit 0 on SIGTERM.
    pub fn shutdown(&self, timeout: Duration) -> Vec<UncleanStop> {
        let mut slots = self.slots.lock().unwrap();
        for slot in slots.iter_mut() {
            slot.restart_at = None;
            if let Some(child) = &slot.child {
                inbox_test_support::process::kill(child.id() as i32, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + timeout;
        let mut unclean = Vec::new();
        for slot in slots.iter_mut() {
            let Some(mut child) = slot.child.take() else { continue };
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break None;
                    }
                }
            };
            match status {
                Some(s) if s.success() => {}
                Some(s) => unclean.push(UncleanStop { slot: slot_name(slot), status: s.to_string() }),
                None => unclean.push(UncleanStop {
                    slot: slot_name(slot),
                    status: format!("still running {}s after SIGTERM: killed", timeout.as_secs()),
                }),
            }
        }
        unclean
    }

    pub fn exits(&self) -> Vec<Exit> {
        self.exits.lock().unwrap().clone()
    }

    pub fn starts(&self) -> u64 {
        *self.starts.lock().unwrap()
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if let Ok(mut slots) = self.slots.lock() {
            for slot in slots.iter_mut() {
                if let Some(mut child) = slot.child.take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
    }
}

fn slot_name(slot: &Slot) -> String {
    format!("{}-{}", slot.role.name(), slot.index)
}

pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The last `max` bytes this instance wrote to its log.
fn log_tail(path: &std::path::Path, offset: u64, max: u64) -> String {
    let Ok(mut file) = File::open(path) else { return String::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let from = offset.max(len.saturating_sub(max));
    let mut text = Vec::new();
    if file.seek(SeekFrom::Start(from)).is_ok() {
        let _ = file.read_to_end(&mut text);
    }
    String::from_utf8_lossy(&text).trim().to_owned()
}

/// The children die with the harness (SIGKILL when the thread that started them exits: the
/// processes are only ever started from the runtime's long-lived threads), so an interrupted or
/// killed run leaves no service processes behind.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
    // async-signal-safe; it allocates nothing and touches no shared state.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
