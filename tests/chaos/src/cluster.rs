//! The run's own PostgreSQL cluster (`--cluster own`, the default where `initdb` is installed):
//! created in `$TMPDIR/inbox-chaos-pg-<pid>`, started with `pg_ctl`, stopped and deleted at the end.
//! As root the server runs as the `postgres` user, as `scripts/pg.sh` runs the shared cluster.
//!
//! Owning the cluster is what lets the run exhaust `max_connections`, restart the server and fill
//! the disk under its write-ahead log without touching anyone else's databases. For the last,
//! `pg_wal` is put (`initdb --waldir`) on a filesystem of its own: a [`WAL_FS_MIB`] MiB tmpfs the
//! run mounts, which needs root (CAP_SYS_ADMIN). Without it the cluster keeps `pg_wal` in its data
//! directory and the `wal_disk_full` fault is skipped, saying why. The tmpfs holds only the WAL
//! (the data files stay on disk, fsynced; a WAL fsync on tmpfs costs nothing, so commits are
//! cheaper than on a disk, which the checks do not depend on); filling it is bounded by its size
//! (memory, for the seconds of the fault) and touches nothing else on the machine. A run that was
//! killed leaves its cluster, mount included, to the next run, which stops and removes it.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// Size of the filesystem holding `pg_wal`: about two and a half times `max_wal_size`, so that
/// only the ballast fills it.
pub const WAL_FS_MIB: u64 = 256;
const DIR_PREFIX: &str = "inbox-chaos-pg-";
/// Connections the server takes; a few are reserved for superusers (the fault injector).
pub const MAX_CONNECTIONS: u32 = 100;
pub const SUPERUSER_RESERVED: u32 = 3;

pub struct Cluster {
    pub dir: PathBuf,
    data: PathBuf,
    pub port: u16,
    server_log: PathBuf,
    /// pg_ctl's own output, appended.
    ctl_log: PathBuf,
    /// Where the server's log is copied when the cluster is removed.
    log_copy: PathBuf,
    /// The mount point of `pg_wal`'s filesystem, or why there is none.
    pub wal_fs: Result<PathBuf, String>,
    /// `--keep`: leave the cluster running at the end.
    pub keep: bool,
}

pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    unsafe {
        libc::geteuid() == 0
    }
}

/// `program args…`, as the `postgres` user when we are root.
fn as_server(program: &str) -> Command {
    let mut cmd = if running_as_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--", program]);
        cmd
    } else {
        Command::new(program)
    };
    cmd.current_dir("/").stdin(Stdio::null());
    cmd
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether a cluster of our own can be made here; if not, why.
pub fn available() -> Result<(), String> {
    for program in ["initdb", "pg_ctl"] {
        if !on_path(program) {
            return Err(format!("{program} is not on PATH"));
        }
    }
    if running_as_root() {
        let ok =
            Command::new("id").args(["-u", "postgres"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !ok.is_ok_and(|s| s.success()) {
            return Err("running as root and there is no `postgres` user to run the server".into());
        }
    }
    Ok(())
}

fn run(mut cmd: Command, what: &str, log: &Path) -> anyhow::Result<()> {
    let mut file = File::options().create(true).append(true).open(log)?;
    writeln!(file, "=== chaos: {what} at {:.1} ===", crate::procs::unix_now())?;
    let status = cmd
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("{what}: cannot start"))?;
    anyhow::ensure!(status.success(), "{what} failed ({status}); see {}", log.display());
    Ok(())
}

fn mounted(path: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else { return false };
    let path = path.to_string_lossy();
    mounts.lines().any(|l| l.split_whitespace().nth(1) == Some(path.as_ref()))
}

fn unmount(path: &Path) {
    if mounted(path) {
        let ok = Command::new("umount").arg(path).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        if !ok {
            // Busy (a process still has a file open there): detach it now, freed when it closes.
            let _ = Command::new("umount").arg("-l").arg(path).status();
        }
    }
}

/// Stops and removes the clusters of chaos runs that are gone (killed before their clean-up).
fn remove_leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(DIR_PREFIX).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let dir = entry.path();
        println!("chaos: removing the cluster a killed run left in {}", dir.display());
        if dir.join("data/postmaster.pid").exists() {
            let mut stop = as_server("pg_ctl");
            stop.arg("-D").arg(dir.join("data")).args(["-m", "immediate", "-w", "-t", "30", "stop"]);
            let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        unmount(&dir.join("wal"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

impl Cluster {
    /// Creates and starts the cluster (blocking: call it off the runtime).
    pub fn create(port: u16, log_dir: &Path) -> anyhow::Result<Cluster> {
        remove_leftovers();
        let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}", std::process::id()));
        if dir.exists() {
            unmount(&dir.join("wal"));
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let ctl_log = log_dir.join("pg-ctl.log");
        let mut cluster = Cluster {
            data: dir.join("data"),
            server_log: dir.join("postgres.log"),
            log_copy: log_dir.join("postgres.log"),
            ctl_log: ctl_log.clone(),
            dir: dir.clone(),
            port,
            wal_fs: Err(String::new()),
            keep: false,
        };
        if running_as_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:").arg(&dir);
            run(chown, "chown", &ctl_log)?;
        }
        cluster.wal_fs = mount_wal_fs(&dir.join("wal"), &ctl_log);
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
        if let Ok(wal) = &cluster.wal_fs {
            initdb.arg(format!("--waldir={}", wal.join("pg_wal").display()));
        }
        run(initdb, "initdb", &ctl_log)?;
        // Like scripts/pg.sh's cluster (fsync and synchronous_commit on), with fewer connections
        // (cheaper to exhaust) and a max_wal_size that fits the WAL filesystem. A server-wide
        // idle_in_transaction_session_timeout, as production servers often have: shorter than
        // the xmin pin, which must turn it off for its own session. The log prefix names the
        // user, so that refusals can be told apart per role in the report.
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{dir}'\n\
             max_connections = {MAX_CONNECTIONS}\nsuperuser_reserved_connections = {SUPERUSER_RESERVED}\n\
             idle_in_transaction_session_timeout = '20s'\n\
             shared_buffers = 256MB\nwork_mem = 16MB\nmax_wal_size = 96MB\nmin_wal_size = 48MB\n\
             log_line_prefix = '%m [%p] %q%u@%d '\nlog_destination = 'stderr'\nlogging_collector = off\n",
            dir = dir.display()
        );
        let mut tee = as_server("tee");
        tee.arg(cluster.data.join("postgresql.auto.conf")).stdin(Stdio::piped()).stdout(Stdio::null());
        let mut child = tee.spawn().context("writing postgresql.auto.conf")?;
        child.stdin.take().unwrap().write_all(conf.as_bytes())?;
        anyhow::ensure!(child.wait()?.success(), "writing postgresql.auto.conf failed");
        cluster.start()?;
        Ok(cluster)
    }

    /// `postgres://{user}@127.0.0.1:{port}/{database}`.
    pub fn url(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }

    pub fn server_log(&self) -> &Path {
        &self.server_log
    }

    /// The server log's length now, for [`Cluster::log_since`].
    pub fn log_len(&self) -> u64 {
        std::fs::metadata(&self.server_log).map_or(0, |m| m.len())
    }

    /// What the server logged from `offset` on.
    pub fn log_since(&self, offset: u64) -> String {
        use std::io::{Read as _, Seek as _};
        let mut text = Vec::new();
        if let Ok(mut file) = File::open(&self.server_log) {
            if file.seek(std::io::SeekFrom::Start(offset)).is_ok() {
                let _ = file.read_to_end(&mut text);
            }
        }
        String::from_utf8_lossy(&text).into_owned()
    }

    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut cmd = as_server("pg_ctl");
        cmd.arg("-D").arg(&self.data).arg("-l").arg(&self.server_log).args(args);
        cmd
    }

    /// `pg_ctl start`, waiting until the server accepts connections.
    pub fn start(&self) -> anyhow::Result<()> {
        run(self.pg_ctl(&["-w", "-t", "60", "start"]), "pg_ctl start", &self.ctl_log)
    }

    /// `pg_ctl restart -m <mode>`, waiting until the server accepts connections.
    pub fn restart(&self, mode: &str) -> anyhow::Result<()> {
        run(
            self.pg_ctl(&["-m", mode, "-w", "-t", "60", "restart"]),
            &format!("pg_ctl restart -m {mode}"),
            &self.ctl_log,
        )
    }

    /// Whether a postmaster runs (`pg_ctl status`).
    pub fn running(&self) -> bool {
        let mut cmd = as_server("pg_ctl");
        cmd.arg("-D").arg(&self.data).arg("status").stdout(Stdio::null()).stderr(Stdio::null());
        cmd.status().is_ok_and(|s| s.success())
    }

    fn ballast(&self) -> Option<PathBuf> {
        self.wal_fs.as_ref().ok().map(|m| m.join("ballast"))
    }

    /// Fills `pg_wal`'s filesystem with a ballast file until it has no byte left; returns the
    /// ballast's size.
    pub fn fill_wal_fs(&self) -> anyhow::Result<u64> {
        let path = self.ballast().context("pg_wal has no filesystem of its own")?;
        let mut file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let chunk = vec![0u8; 1 << 20];
        let mut written = 0u64;
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => return Err(e).context("writing the ballast"),
            }
        }
        Ok(written)
    }

    pub fn remove_ballast(&self) {
        if let Some(path) = self.ballast() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Mounts a tmpfs for `pg_wal` at `mount_point`, owned by the server's user.
fn mount_wal_fs(mount_point: &Path, log: &Path) -> Result<PathBuf, String> {
    if !running_as_root() {
        return Err("mounting a filesystem for pg_wal needs root (CAP_SYS_ADMIN)".into());
    }
    std::fs::create_dir_all(mount_point).map_err(|e| format!("creating {}: {e}", mount_point.display()))?;
    let output = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={WAL_FS_MIB}m,mode=0700"), "inbox-chaos-wal"])
        .arg(mount_point)
        .output()
        .map_err(|e| format!("cannot run mount: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cannot mount a tmpfs for pg_wal: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let mut chown = Command::new("chown");
    chown.arg("postgres:").arg(mount_point);
    if let Err(e) = run(chown, "chown the WAL filesystem", log) {
        unmount(mount_point);
        return Err(format!("{e:#}"));
    }
    Ok(mount_point.to_owned())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            println!(
                "chaos: kept the cluster in {} (port {}); the next chaos run removes it, or: pg_ctl -D {} stop{}",
                self.dir.display(),
                self.port,
                self.data.display(),
                if self.wal_fs.is_ok() { format!(" && umount {}", self.dir.join("wal").display()) } else { String::new() }
            );
            return;
        }
        self.remove_ballast();
        let _ =
            run(self.pg_ctl(&["-m", "immediate", "-w", "-t", "30", "stop"]), "pg_ctl stop", &self.ctl_log);
        let _ = std::fs::copy(&self.server_log, &self.log_copy);
        // The postmaster's children are gone a moment after it.
        let deadline = Instant::now() + Duration::from_secs(10);
        let wal = self.dir.join("wal");
        while mounted(&wal) && Instant::now() < deadline {
            unmount(&wal);
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
