//! Running PostgreSQL's programs, and the few tools that touch its files, as the server's user:
//! PostgreSQL refuses to run as root, so as root each command runs as `postgres` (`runuser`), as
//! `scripts/pg.sh` runs the shared cluster. The test clusters of their own (TLS, a primary and its
//! replica) are started with these.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where the PostgreSQL programs are: the directory of the `initdb` on PATH (Debian links
/// `/usr/local/bin/initdb` to `/usr/lib/postgresql/15/bin/initdb`; its `pg_basebackup` on PATH is
/// a wrapper that picks a version), else `pg_config --bindir`, else Debian's PostgreSQL 15.
pub fn bin_dir() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("initdb"))
        .find(|p| p.is_file())
        .and_then(|p| std::fs::canonicalize(p).ok())
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .filter(|dir| dir.join("pg_basebackup").is_file() && dir.join("pg_ctl").is_file());
    on_path
        .or_else(|| {
            let out = Command::new("pg_config").arg("--bindir").output().ok()?;
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            dir.join("pg_basebackup").is_file().then_some(dir)
        })
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

/// Whether this process runs as root.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    #[allow(unsafe_code)]
    unsafe {
        libc::geteuid() == 0
    }
}

/// A PostgreSQL program (from [`bin_dir`]) or a plain one, as the `postgres` user when we are root.
pub fn as_server(program: &str) -> Command {
    let bin = bin_dir().join(program);
    let program = if bin.is_file() { bin.into_os_string() } else { program.into() };
    let mut cmd = if running_as_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    };
    cmd.current_dir("/").stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to its end; panics naming `what` and its output when it fails.
pub fn run(mut cmd: Command, what: &str) {
    let output = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Writes (or with `append`, appends) `text` to `path` as the server's user.
pub fn write_as_server(path: &Path, text: &str, append: bool) {
    let mut tee = as_server("tee");
    if append {
        tee.arg("-a");
    }
    tee.arg(path).stdin(Stdio::piped()).stdout(Stdio::null());
    let mut child = tee.spawn().expect("tee");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success(), "writing {}", path.display());
}
