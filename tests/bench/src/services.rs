//! The release binaries as processes: `inbox-worker migrate`, `inbox-ingest`, `inbox-worker run`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use inbox_test_support::process::Proc;

use crate::payload::SECRET;

/// Where the service binaries are (beside this one: `target/release`).
pub struct Bins {
    pub dir: PathBuf,
    /// Extra arguments of every `inbox-ingest` (`--ingest-arg`).
    pub ingest_args: Vec<String>,
    /// `RUST_LOG` of the services (`--service-log`).
    pub log: String,
}

/// Lines of each kind a service's output keeps for the error that quotes it (see
/// `Proc::spawn_collected`): its warnings and errors, and its last lines at `info`.
const KEEP_LINES: usize = 2000;

impl Bins {
    pub fn new(dir: PathBuf, ingest_args: Vec<String>, log: String) -> anyhow::Result<Bins> {
        for name in ["inbox-ingest", "inbox-worker"] {
            let path = dir.join(name);
            if !path.exists() {
                bail!(
                    "{} not found: build them first (`cargo build --release --workspace --bins`)",
                    path.display()
                );
            }
        }
        Ok(Bins { dir, ingest_args, log })
    }

    /// A command with a clean environment, JSON logs at `--service-log`'s level.
    pub fn command(&self, name: &str, database_url: &str) -> Command {
        let mut cmd = Command::new(self.dir.join(name));
        cmd.env_clear();
        if let Some(path) = std::env::var_os("PATH") {
            cmd.env("PATH", path);
        }
        cmd.env("LOG_FORMAT", "json").env("RUST_LOG", &self.log).env("DATABASE_URL", database_url);
        cmd
    }

    /// `inbox-worker migrate` on `database_url`.
    pub fn migrate(&self, database_url: &str) -> anyhow::Result<()> {
        let out = self
            .command("inbox-worker", database_url)
            .arg("migrate")
            .output()
            .context("running inbox-worker migrate")?;
        if !out.status.success() {
            bail!(
                "inbox-worker migrate failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Starts `inbox-ingest` on a free port and waits until `/healthz` answers 200.
    pub async fn start_ingest(&self, database_url: &str) -> anyhow::Result<(Proc, SocketAddr)> {
        self.start_ingest_with_env(database_url, &[]).await
    }

    /// [`Bins::start_ingest`] with more environment (e.g. `INBOX_SIGNATURE_TOLERANCE`).
    pub async fn start_ingest_with_env(
        &self,
        database_url: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<(Proc, SocketAddr)> {
        let port = inbox_test_support::port::free();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let mut cmd = self.command("inbox-ingest", database_url);
        cmd.env("INBOX_ENDPOINTS", format!("billing={SECRET}")).env("INBOX_LISTEN", addr.to_string());
        cmd.envs(env.iter().copied()).args(&self.ingest_args);
        let mut proc = Proc::spawn_collected(cmd, KEEP_LINES);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = proc.child.try_wait()? {
                bail!("inbox-ingest exited at start-up ({status}):\n{}", proc.output());
            }
            if matches!(crate::http::get_status(addr, "/healthz").await, Ok(200)) {
                return Ok((proc, addr));
            }
            if Instant::now() > deadline {
                bail!("inbox-ingest did not answer /healthz within 30 s:\n{}", proc.output());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts `inbox-worker run`, with `--concurrency` and `--batch-size` when given (without
    /// them the worker runs with its own defaults), plus `extra` arguments.
    pub fn start_worker(
        &self,
        database_url: &str,
        concurrency: Option<usize>,
        batch_size: Option<usize>,
        extra: &[&str],
    ) -> Proc {
        let mut cmd = self.command("inbox-worker", database_url);
        cmd.arg("run").args(extra);
        if let Some(n) = concurrency {
            cmd.arg("--concurrency").arg(n.to_string());
        }
        if let Some(n) = batch_size {
            cmd.arg("--batch-size").arg(n.to_string());
        }
        Proc::spawn_collected(cmd, KEEP_LINES)
    }

    /// Starts `inbox-worker relay` with `args` (a destination, nothing else: its defaults) and
    /// `env` (the signing secret).
    pub fn start_relay(&self, database_url: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = self.command("inbox-worker", database_url);
        cmd.arg("relay").args(args).envs(env.iter().copied());
        Proc::spawn_collected(cmd, KEEP_LINES)
    }

    /// The defaults `inbox-worker run` states in its `--help` for the tuning options
    /// (`--concurrency`, `--batch-size`, `--max-bytes-in-flight`) and the lease (`--lease`), as
    /// written there (`null` for an option it does not have or states no default for). The command's environment is
    /// cleared, as for the workers the bench starts, so these are the values they run with.
    pub fn worker_defaults(&self) -> serde_json::Value {
        let help = self
            .command("inbox-worker", "")
            .env_remove("DATABASE_URL")
            .args(["run", "--help"])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut out = serde_json::Map::new();
        for (key, flag) in [
            ("concurrency", "--concurrency"),
            ("batch_size", "--batch-size"),
            ("max_bytes_in_flight", "--max-bytes-in-flight"),
            ("lease", "--lease"),
        ] {
            out.insert(key.into(), help_default(&help, flag).map_or(serde_json::Value::Null, Into::into));
        }
        serde_json::Value::Object(out)
    }
}

/// The `[default: …]` clap prints in the paragraph of option `flag` of a `--help` text.
fn help_default(help: &str, flag: &str) -> Option<String> {
    let is_option = |l: &str| {
        let l = l.trim_start();
        l.starts_with("--") || (l.starts_with('-') && l.chars().nth(2) == Some(','))
    };
    // `--concurrency <N>`, not `--concurrency-x`.
    let names_flag = |l: &str| {
        l.trim_start()
            .strip_prefix(flag)
            .is_some_and(|rest| !rest.starts_with(|c: char| c.is_alphanumeric() || c == '-'))
    };
    let mut lines = help.lines().skip_while(|l| !names_flag(l));
    let first = lines.next()?;
    let paragraph: Vec<&str> =
        std::iter::once(first).chain(lines.take_while(|l| !is_option(l))).map(str::trim).collect();
    let text = paragraph.join(" ");
    let rest = &text[text.find("[default: ")? + "[default: ".len()..];
    Some(rest[..rest.find(']')?].trim().to_owned())
}

/// Fails when the process has exited (it should be serving).
pub fn check_alive(proc: &mut Proc, what: &str) -> anyhow::Result<()> {
    if let Some(status) = proc.child.try_wait()? {
        bail!("{what} exited unexpectedly ({status}):\n{}", proc.output());
    }
    Ok(())
}

/// SIGTERM, then SIGKILL after `timeout`; returns whether it exited on its own in time.
pub async fn stop(proc: &mut Proc, timeout: Duration) -> bool {
    if matches!(proc.child.try_wait(), Ok(Some(_))) {
        return true;
    }
    inbox_test_support::process::kill(proc.child.id() as i32, libc::SIGTERM);
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if matches!(proc.child.try_wait(), Ok(Some(_))) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = proc.child.kill();
    let _ = proc.child.wait();
    false
}
