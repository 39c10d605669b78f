//! The built binaries run as processes, the way operators run them.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Path of a workspace binary: `$INBOX_BIN_DIR/<name>`, else `target/debug/<name>`
/// (`make test` builds them before running the tests).
pub fn bin_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("INBOX_BIN_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")));
        target.join("debug")
    });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the binaries first (`cargo build --bins`, done by `make test`)",
        path.display()
    );
    path
}

/// A command for a workspace binary with a clean environment (no inherited DATABASE_URL etc.).
pub fn command(name: &str) -> Command {
    let mut cmd = Command::new(bin_path(name));
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd.env("LOG_FORMAT", "json");
    cmd
}

/// A running binary whose stderr (the logs) is collected line by line.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stdout: Arc<Mutex<Vec<String>>>,
    rx: mpsc::Receiver<String>,
    /// The threads reading stdout and stderr: each ends at its stream's end, so once both ended
    /// after the process exited, `output()` holds every line it printed.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().expect("starting the binary");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let stdout: Arc<Mutex<Vec<String>>> = Arc::default();
        let (tx, rx) = mpsc::channel();
        let mut readers = Vec::new();
        for (stream, own) in [
            (Box::new(child.stderr.take().unwrap()) as Box<dyn std::io::Read + Send>, None),
            (Box::new(child.stdout.take().unwrap()), Some(stdout.clone())),
        ] {
            let lines = lines.clone();
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line.clone());
                    if let Some(own) = &own {
                        own.lock().unwrap().push(line.clone());
                    }
                    let _ = tx.send(line);
                }
            }));
        }
        Proc { child, lines, stdout, rx, readers }
    }

    /// Waits for an output line containing `needle` and returns it.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => {
                    panic!("no line containing {needle:?} within {timeout:?}; output:\n{}", self.output())
                }
            }
        }
    }

    /// Waits until what the process printed contains `needle` (whether or not `wait_for_line`
    /// already passed that line) and returns all of it. For a line written after something the
    /// test observed outside the process (an HTTP answer, a row), which its reader thread may
    /// not have read yet.
    pub fn wait_for_output(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let output = self.output();
            if output.contains(needle) {
                return output;
            }
            if Instant::now() > deadline {
                panic!("no output containing {needle:?} within {timeout:?}; output:\n{output}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything printed so far (stdout and stderr).
    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// What was printed on stdout only.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    pub fn signal(&self, signal: i32) {
        let rc = kill(self.child.id() as i32, signal);
        assert_eq!(rc, 0, "kill failed");
    }

    /// Waits for the exit status, killing the process after `timeout`; then for the reader
    /// threads to reach the end of its output, so that `output()` holds all of it.
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The pipes end when the process and anything that inherited them are gone; a
                // descendant still holding one is not waited for past the deadline.
                let drained = Instant::now() + Duration::from_secs(10);
                while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < drained {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("process did not exit within {timeout:?}; output:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
/// The state letter of process `pid` (`R`, `S`, `T` for stopped, `Z` for a zombie…), None when it
/// is gone.
pub fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

/// The processes whose parent is `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).ok().is_some_and(|stat| {
                // After "(comm) ": state, then the parent's pid.
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|ppid| ppid.parse::<i32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

/// Sends `signal` to `pid` (SIGTERM, SIGKILL, SIGSTOP, …); returns kill(2)'s result.
#[allow(unsafe_code)]
pub fn kill(pid: i32, signal: i32) -> i32 {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, signal) }
}

/// Runs a binary to completion and returns (exit code, stdout + stderr).
pub fn run(cmd: Command, timeout: Duration) -> (i32, String) {
    let (code, _, output) = run_split(cmd, timeout);
    (code, output)
}

/// Runs a binary to completion and returns (exit code, stdout, stdout + stderr).
pub fn run_split(cmd: Command, timeout: Duration) -> (i32, String, String) {
    let mut p = Proc::spawn(cmd);
    let status = p.wait(timeout);
    (status.code().unwrap_or(-1), p.stdout(), p.output())
}

/// Starts `inbox-ingest` (with `INBOX_LISTEN=127.0.0.1:0`) and returns it with its base URL,
/// read from its "serving" log line.
pub fn start_ingest(cmd: Command) -> (Proc, String) {
    let proc = Proc::spawn(cmd);
    let line = proc.wait_for_line("inbox-ingest serving", Duration::from_secs(30));
    let log: serde_json::Value = serde_json::from_str(&line).expect("json log line");
    let listen = log["listen"].as_str().expect("listen field").to_owned();
    (proc, format!("http://{listen}"))
}

/// A process's resident set size and its peak (VmRSS, VmHWM) in KiB, from /proc/<pid>/status;
/// None when the process is gone.
pub fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Starts `inbox-worker run` (with `--metrics-listen 127.0.0.1:0`) and returns it with the
/// address its metrics are served on, read from its "running" log line.
pub fn start_worker_with_metrics(cmd: Command) -> (Proc, String) {
    let proc = Proc::spawn(cmd);
    let line = proc.wait_for_line("inbox-worker running", Duration::from_secs(30));
    let log: serde_json::Value = serde_json::from_str(&line).expect("json log line");
    let address = log["metrics"].as_str().expect("metrics field").to_owned();
    (proc, address)
}
