//! A PostgreSQL 15 primary and an asynchronous streaming replica of it, on localhost, for the
//! failover tests: the fault a managed database's failover to an asynchronous replica is — the
//! replica falls behind, the primary dies, the replica is promoted without the last commits.
//!
//! Both clusters live in `$TMPDIR/inbox-replica-<pid>-<n>` (`primary/`, `replica/`, their logs and
//! the Unix sockets), each on a free TCP port of 127.0.0.1, and run as the `postgres` user when we
//! are root, as `scripts/pg.sh` runs the shared cluster. The primary has `wal_level = replica`,
//! trust for `replication` from 127.0.0.1 in `pg_hba.conf`, database `inbox` migrated with the
//! project's migrations; the replica is `pg_basebackup -R` of it (a standby streaming from the
//! primary, hot standby: it answers reads). No `synchronous_standby_names`: a commit on the
//! primary waits for nothing of the replica, as with a read replica of a managed service.
//!
//! The fault ([`ReplicaPair::pause_replica`]) is a SIGSTOP of the replica's walreceiver, the one
//! process that reads the primary's WAL stream and writes it to the replica's `pg_wal`. Stopping
//! the startup process instead (or `pg_wal_replay_pause()`) would only stop *applying* WAL: the
//! WAL would still reach the replica's disk, and a promotion replays everything received before it
//! ends recovery, so nothing would be lost. Stopping the whole replica would do what stopping the
//! walreceiver does, and make the replica unreadable meanwhile. Stopping the walreceiver stops WAL
//! from *reaching* the replica, as when a replica lags or its network stalls: the primary's
//! walsender fills the socket buffers (the kernel's, on both ends) and then sends nothing more;
//! [`ReplicaPair::wal_positions`] shows its `sent_lsn` standing still while the primary's WAL
//! grows. A commit whose WAL lies beyond `sent_lsn` when the primary is SIGKILLed
//! ([`ReplicaPair::kill_primary`]) never reaches the replica: that is the loss the tests count on.
//! What the socket buffers held may or may not: the walreceiver, resumed, reads some of it and
//! acknowledges what it flushed; the dead primary's kernel answers that with a reset, and the
//! walreceiver, seeing the connection reset, reads nothing more (as it races, anything from none to
//! all of the buffers arrives). A machine that dies sends no reset; its replica reads the buffers
//! to the end. The buffers are megabytes (Linux sizes them up to
//! `net.ipv4.tcp_wmem`/`tcp_rmem`'s maximum), so [`ReplicaPair::write_until_the_walsender_stalls`]
//! fills them with a burst of writes, as a batch job or a bulk load makes a real replica lag.
//!
//! `dynamic_shared_memory_type = mmap` keeps the servers' dynamic shared memory in their data
//! directories, so a SIGKILLed server leaves nothing in `/dev/shm`; its small System V segment is
//! removed when the pair is dropped. Pairs of test processes that died before their clean-up are
//! stopped and removed when the next pair starts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Config};

use crate::db::{connect, scalar};
use crate::process::{children, state};
use crate::server_user::{as_server, run, running_as_root, write_as_server};

const DIR_PREFIX: &str = "inbox-replica-";
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// How long a server may take to start, stop, stream or promote.
const WAIT: Duration = Duration::from_secs(60);

/// Whether `pid` runs (a zombie does not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()).is_some_and(|s| s != 'Z')
        }
        Err(_) => false,
    }
}

/// One cluster of the pair.
struct Node {
    name: &'static str,
    data: PathBuf,
    log: PathBuf,
    port: u16,
}

impl Node {
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/inbox", self.port)
    }

    fn config(&self) -> Config {
        self.url().parse().unwrap()
    }

    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut cmd = as_server("pg_ctl");
        cmd.arg("-D").arg(&self.data).arg("-l").arg(&self.log).args(args);
        cmd
    }

    fn start(&self) {
        let mut start = self.pg_ctl(&["-w", "-t", "60", "start"]);
        start.stdout(Stdio::null());
        let status = start.status().expect("pg_ctl start");
        assert!(status.success(), "pg_ctl start of the {} failed:\n{}", self.name, self.log_tail());
    }

    /// The postmaster's pid and its System V segment (key, id), from `postmaster.pid`.
    fn postmaster(&self) -> Option<(i32, Option<(i64, i32)>)> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        let lines: Vec<&str> = text.lines().collect();
        let pid = lines.first()?.trim().parse().ok()?;
        let shm = lines.get(6).and_then(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
        });
        Some((pid, shm))
    }

    /// Stops the server (immediate shutdown) if it runs; if it was killed, removes the System V
    /// segment it left (only when its key matches and nothing is attached to it).
    fn stop(&self) {
        let Some((pid, shm)) = self.postmaster() else { return };
        if alive(pid) {
            let mut stop = self.pg_ctl(&["-m", "immediate", "-w", "-t", "30", "stop"]);
            let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
        } else if let Some((key, id)) = shm {
            remove_segment(key, id);
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// `IPC_RMID` of System V segment `id` if its key is `key` and no process is attached.
#[allow(unsafe_code)]
fn remove_segment(key: i64, id: i32) {
    // SAFETY: shmid_ds is plain data; shmctl only writes into it.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT on any id is harmless; it fails for an id that is gone.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) } != 0 {
        return;
    }
    if i64::from(ds.shm_perm.__key) == key && ds.shm_nattch == 0 {
        // SAFETY: as above; the segment is ours (its key) and unused.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

/// Stops and removes the pairs of test processes that are gone (killed before their clean-up).
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
        let dir = entry.path();
        for node in ["replica", "primary"] {
            let node =
                Node { name: "leftover", data: dir.join(node), log: dir.join("leftover.log"), port: 0 };
            node.stop();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Where the primary's WAL is and how much of it went to the replica, in bytes from `0/0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalPositions {
    /// `pg_current_wal_lsn()`: the end of the WAL the primary wrote.
    pub written: i64,
    /// The replica's `sent_lsn` in `pg_stat_replication`: what the walsender handed to the
    /// socket. A commit beyond it cannot be on the replica. None when no replica is connected.
    pub sent: Option<i64>,
}

/// A primary and its asynchronous streaming replica, stopped and removed when dropped.
pub struct ReplicaPair {
    dir: PathBuf,
    primary: Node,
    replica: Node,
    /// The replica's walreceiver while it is stopped.
    paused: Option<i32>,
}

impl ReplicaPair {
    /// Creates the primary (database `inbox`, migrated), takes the replica with `pg_basebackup
    /// -R`, starts it and waits until it streams.
    pub async fn start() -> ReplicaPair {
        let pair = tokio::task::spawn_blocking(ReplicaPair::create_primary).await.unwrap();
        let admin = connect(&{
            let mut config = pair.primary.config();
            config.dbname("postgres");
            config
        })
        .await;
        admin.batch_execute("CREATE DATABASE inbox").await.unwrap();
        let (mut client, connection) = pair.primary.config().connect(tokio_postgres::NoTls).await.unwrap();
        let conn = tokio::spawn(connection);
        inbox_domain::inbox::schema::migrate(&mut client, None).await.expect("migrating the primary");
        drop(client);
        let _ = conn.await;
        let pair = tokio::task::spawn_blocking(move || {
            pair.create_replica();
            pair
        })
        .await
        .unwrap();
        let deadline = Instant::now() + WAIT;
        while scalar(&admin, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'").await < 1 {
            assert!(Instant::now() < deadline, "the replica does not stream:\n{}", pair.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pair
    }

    fn create_primary() -> ReplicaPair {
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
            run(chown, "chown");
        }
        let node = |name: &'static str| Node {
            name,
            data: dir.join(name),
            log: dir.join(format!("{name}.log")),
            port: crate::port::free(),
        };
        let pair = ReplicaPair { primary: node("primary"), replica: node("replica"), dir, paused: None };
        let mut initdb = as_server("initdb");
        initdb.arg("-D").arg(&pair.primary.data).args([
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--auth=trust",
            "--no-sync",
            "--no-instructions",
        ]);
        run(initdb, "initdb");
        // The replica's copy of this file (pg_basebackup) gets its own port and name appended.
        // No wal_sender_timeout: a walsender whose replica is paused must not give up on it (and
        // let the replica reconnect and catch up) before the primary is killed. fsync off: no
        // test here crashes the machine, only processes.
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             cluster_name = 'primary'\nwal_level = replica\nmax_wal_senders = 4\n\
             wal_sender_timeout = 0\nhot_standby = on\nmax_connections = 60\nshared_buffers = 64MB\n\
             fsync = off\ndynamic_shared_memory_type = mmap\n\
             log_line_prefix = '%m [%p] %q%a '\nlog_destination = 'stderr'\nlogging_collector = off\n",
            pair.primary.port,
            pair.dir.display()
        );
        write_as_server(&pair.primary.data.join("postgresql.auto.conf"), &conf, false);
        let hba = "local all all trust\nhost all all 127.0.0.1/32 trust\n\
                   local replication all trust\nhost replication all 127.0.0.1/32 trust\n";
        write_as_server(&pair.primary.data.join("pg_hba.conf"), hba, false);
        pair.primary.start();
        pair
    }

    fn create_replica(&self) {
        let mut backup = as_server("pg_basebackup");
        backup.arg("-D").arg(&self.replica.data).args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.primary.port.to_string(),
            "-U",
            "postgres",
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        ]);
        run(backup, "pg_basebackup");
        write_as_server(
            &self.replica.data.join("postgresql.auto.conf"),
            &format!("port = {}\ncluster_name = 'replica'\n", self.replica.port),
            true,
        );
        self.replica.start();
    }

    /// `postgres://postgres@127.0.0.1:<primary's port>/inbox`.
    pub fn primary_url(&self) -> String {
        self.primary.url()
    }

    /// `postgres://postgres@127.0.0.1:<replica's port>/inbox`.
    pub fn replica_url(&self) -> String {
        self.replica.url()
    }

    /// A connection to the primary's `inbox`.
    pub async fn primary_client(&self) -> Client {
        connect(&self.primary.config()).await
    }

    /// A connection to the replica's `inbox` (read-only until it is promoted).
    pub async fn replica_client(&self) -> Client {
        connect(&self.replica.config()).await
    }

    /// The primary's [`WalPositions`].
    pub async fn wal_positions(&self) -> WalPositions {
        let client = self.primary_client().await;
        let row = client
            .query_one(
                "SELECT (pg_current_wal_lsn() - '0/0')::int8,
                        (SELECT (max(sent_lsn) - '0/0')::int8 FROM pg_stat_replication)",
                &[],
            )
            .await
            .unwrap();
        WalPositions { written: row.get(0), sent: row.get(1) }
    }

    /// With the replica paused: writes WAL on the primary (rows of 1 KiB into a table of database
    /// `postgres`, 1 MiB at a time) until the walsender has stopped sending — its `sent_lsn` stands
    /// still with written WAL beyond it — and returns the positions then. The socket buffers are
    /// full: nothing committed from now on reaches the replica before the walreceiver runs again.
    pub async fn write_until_the_walsender_stalls(&self) -> WalPositions {
        assert!(self.paused.is_some(), "the replica is not paused: the walsender would keep sending");
        let mut config = self.primary.config();
        config.dbname("postgres");
        let client = connect(&config).await;
        client.batch_execute("CREATE TABLE IF NOT EXISTS burst (filler text)").await.unwrap();
        let (mut last_sent, mut still) = (None, 0);
        for _ in 0..512 {
            client
                .batch_execute(
                    "INSERT INTO burst SELECT repeat(md5(random()::text), 32) FROM generate_series(1, 1024)",
                )
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let positions = self.wal_positions().await;
            let sent = positions.sent.expect("the paused replica is still connected");
            still = if Some(sent) == last_sent && positions.written - sent > 1 << 20 { still + 1 } else { 0 };
            if still == 2 {
                return positions;
            }
            last_sent = Some(sent);
        }
        panic!("512 MiB of WAL written and the walsender still sends:\n{}", self.logs());
    }

    /// Waits until the replica has replayed all the WAL the primary has written so far.
    pub async fn wait_replayed(&self) {
        let target = self.wal_positions().await.written;
        let replica = self.replica_client().await;
        let deadline = Instant::now() + WAIT;
        while scalar(&replica, "SELECT COALESCE((pg_last_wal_replay_lsn() - '0/0')::int8, 0)").await < target
        {
            assert!(Instant::now() < deadline, "the replica did not catch up:\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops WAL from reaching the replica: SIGSTOP of its walreceiver (see the module's doc for
    /// why that process). Returns the walreceiver's pid.
    pub async fn pause_replica(&mut self) -> i32 {
        assert!(self.paused.is_none(), "the replica is already paused");
        let replica = self.replica_client().await;
        let pid: i32 = replica
            .query_opt("SELECT pid FROM pg_stat_wal_receiver WHERE status = 'streaming'", &[])
            .await
            .unwrap()
            .expect("the replica has no streaming walreceiver")
            .get(0);
        assert_eq!(crate::process::kill(pid, libc::SIGSTOP), 0, "SIGSTOP of the walreceiver {pid}");
        let deadline = Instant::now() + Duration::from_secs(5);
        while state(pid) != Some('T') {
            assert!(Instant::now() < deadline, "the walreceiver {pid} did not stop: {:?}", state(pid));
            std::thread::sleep(Duration::from_millis(2));
        }
        self.paused = Some(pid);
        pid
    }

    /// Lets the walreceiver run again (SIGCONT): it reads what the socket buffers still hold, all
    /// of it while the primary runs, some of it once the primary was killed (see the module's doc).
    pub fn resume_replica(&mut self) {
        if let Some(pid) = self.paused.take() {
            crate::process::kill(pid, libc::SIGCONT);
        }
    }

    /// SIGKILL of the primary's postmaster and every child of it (backends, walsender,
    /// checkpointer…), as a machine or a container dies: no shutdown, nothing more sent. The
    /// postmaster is stopped first so that it forks nothing while its children are listed.
    pub fn kill_primary(&mut self) {
        let (pid, _) = self.primary.postmaster().expect("the primary's postmaster.pid");
        assert!(alive(pid), "the primary's postmaster {pid} is not running");
        crate::process::kill(pid, libc::SIGSTOP);
        let children = children(pid);
        for child in &children {
            crate::process::kill(*child, libc::SIGKILL);
        }
        crate::process::kill(pid, libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) || children.iter().any(|c| alive(*c)) {
            assert!(Instant::now() < deadline, "the primary's processes outlived SIGKILL");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the replica's walreceiver has read what it still could and lost the
    /// connection (the primary is gone), then promotes the replica (`pg_promote()`) and waits
    /// until it is out of recovery.
    pub async fn promote_replica(&self) {
        let replica = self.replica_client().await;
        let deadline = Instant::now() + Duration::from_secs(15);
        while scalar(&replica, "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'").await
            > 0
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let promoted: bool = replica.query_one("SELECT pg_promote(true, 60)", &[]).await.unwrap().get(0);
        assert!(promoted, "pg_promote() did not finish within 60 s:\n{}", self.logs());
        let deadline = Instant::now() + WAIT;
        loop {
            let in_recovery: bool =
                replica.query_one("SELECT pg_is_in_recovery()", &[]).await.unwrap().get(0);
            if !in_recovery {
                break;
            }
            assert!(Instant::now() < deadline, "the replica is still in recovery:\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last lines of both servers' logs, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- primary ({}) ---\n{}\n--- replica ({}) ---\n{}",
            self.primary.log.display(),
            self.primary.log_tail(),
            self.replica.log.display(),
            self.replica.log_tail()
        )
    }
}

impl Drop for ReplicaPair {
    fn drop(&mut self) {
        self.resume_replica();
        self.replica.stop();
        self.primary.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
