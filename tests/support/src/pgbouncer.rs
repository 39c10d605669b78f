//! A PgBouncer of its own, in transaction mode, in front of the test cluster: every client
//! transaction may run on another server connection, and server connections are shared by every
//! client — so a statement kept across transactions, a setting made at connect or a session-level
//! lock does not survive, as with a production pooler. `options` in the startup packet is refused
//! (PgBouncer's default), as Debian's 1.18 does.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running pgbouncer, stopped when dropped.
pub struct PgBouncer {
    dir: PathBuf,
    child: Child,
    pub port: u16,
}

/// Where pgbouncer is installed, if it is (Debian puts it in /usr/sbin).
pub fn binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("pgbouncer"));
    on_path.chain([PathBuf::from("/usr/sbin/pgbouncer")]).find(|p| p.is_file())
}

impl PgBouncer {
    /// Starts pgbouncer for the server at `host:port` (every database, as user `user`), with at
    /// most `server_connections` server connections per database. None when pgbouncer is not
    /// installed. Blocking.
    pub fn start(host: &str, port: u16, user: &str, server_connections: u32) -> Option<PgBouncer> {
        let binary = binary()?;
        let dir = std::env::temp_dir().join(format!(
            "inbox-pgbouncer-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let listen = crate::port::free();
        let ini = format!(
            "[databases]\n* = host={host} port={port} user={user}\n\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n\
             auth_type = any\npool_mode = transaction\nmax_client_conn = 500\n\
             default_pool_size = {server_connections}\nmin_pool_size = 0\nreserve_pool_size = 0\n\
             server_lifetime = 3600\nserver_idle_timeout = 600\nlogfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\nverbose = 0\n",
            dir = dir.display()
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        // pgbouncer refuses to run as root: as root, run it as the postgres user.
        // SAFETY: geteuid has no preconditions.
        #[allow(unsafe_code)]
        let root = unsafe { libc::geteuid() } == 0;
        let mut cmd = if root {
            let mut chown = Command::new("chown");
            chown.args(["-R", "postgres"]).arg(&dir);
            assert!(chown.status().unwrap().success(), "chown of the pgbouncer directory");
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&binary);
            cmd
        } else {
            Command::new(&binary)
        };
        cmd.arg(dir.join("pgbouncer.ini")).current_dir("/").stdout(Stdio::null()).stderr(Stdio::null());
        let child = cmd.spawn().expect("starting pgbouncer");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", listen)).is_err() {
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen on {listen}: {}",
                std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(PgBouncer { dir, child, port: listen })
    }

    /// pgbouncer's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // pgbouncer itself (under runuser, the child is runuser), then whatever started it.
        let pid =
            std::fs::read_to_string(self.dir.join("pgbouncer.pid")).ok().and_then(|p| p.trim().parse().ok());
        if let Some(pid) = pid {
            crate::process::kill(pid, libc::SIGTERM);
        }
        crate::process::kill(self.child.id() as i32, libc::SIGTERM);
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
