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
    printed: Arc<Mutex<Printed>>,
    stdout: Arc<Mutex<Vec<String>>>,
    /// Every line, for `wait_for_line`; None for a process started with [`Proc::spawn_collected`].
    rx: Option<mpsc::Receiver<String>>,
    /// The threads reading stdout and stderr: each ends at its stream's end, so once both ended
    /// after the process exited, `output()` holds every line it printed (or, collected, what was
    /// kept of them).
    readers: Vec<std::thread::JoinHandle<()>>,
}

/// What a [`Proc`] keeps of its output, and how much there was.
#[derive(Default)]
struct Printed {
    /// Every line; collected ([`Proc::spawn_collected`]), the lines that are not log lines at
    /// `info` or below — warnings, errors, a panic's message — up to `keep` of them.
    lines: Vec<String>,
    /// Collected: the last `keep` log lines at `info` or below.
    tail: std::collections::VecDeque<String>,
    /// Collected: how many lines of each kind to keep. None: every line.
    keep: Option<usize>,
    /// Lines read and not kept.
    dropped: u64,
    /// Lines and bytes read (each line with its newline).
    count: u64,
    bytes: u64,
}

impl Printed {
    fn push(&mut self, line: &str) {
        self.count += 1;
        self.bytes += line.len() as u64 + 1;
        let Some(keep) = self.keep else {
            self.lines.push(line.to_owned());
            return;
        };
        let quiet = ["\"level\":\"INFO\"", "\"level\":\"DEBUG\"", "\"level\":\"TRACE\""]
            .iter()
            .any(|level| line.contains(level));
        if !quiet {
            if self.lines.len() < keep {
                self.lines.push(line.to_owned());
            } else {
                self.dropped += 1;
            }
            return;
        }
        if self.tail.len() == keep {
            self.tail.pop_front();
            self.dropped += 1;
        }
        self.tail.push_back(line.to_owned());
    }

    /// The lines kept, in order; collected, then a note of how many were not and the tail (both
    /// empty for a process whose every line is kept).
    fn text(&self) -> String {
        let mut text = self.lines.join("\n");
        if self.dropped > 0 {
            text.push_str(&format!(
                "\n[{} lines not kept; the last lines at info and below follow]",
                self.dropped
            ));
        }
        for line in &self.tail {
            text.push('\n');
            text.push_str(line);
        }
        text
    }
}

impl Proc {
    /// Starts `cmd` and keeps every line it prints (see [`Proc::wait_for_line`]).
    pub fn spawn(cmd: Command) -> Proc {
        Proc::start(cmd, None)
    }

    /// Starts `cmd` with its output read as a log collector reads it, for a process that logs a
    /// line per request or event for minutes (a benchmark's services at the level they ship
    /// with): every line is read and counted ([`Proc::printed`]); kept are the lines that are not
    /// log lines at `info` or below (warnings, errors, a panic), up to `keep`, and the last `keep`
    /// lines at `info` or below, which [`Proc::output`] shows. [`Proc::wait_for_line`] is not
    /// available.
    pub fn spawn_collected(cmd: Command, keep: usize) -> Proc {
        Proc::start(cmd, Some(keep))
    }

    fn start(mut cmd: Command, keep: Option<usize>) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().expect("starting the binary");
        let printed = Arc::new(Mutex::new(Printed { keep, ..Printed::default() }));
        let stdout: Arc<Mutex<Vec<String>>> = Arc::default();
        // Every line goes to `wait_for_line` too, unless collected.
        let (tx, rx) = match keep {
            None => {
                let (tx, rx) = mpsc::channel();
                (Some(tx), Some(rx))
            }
            Some(_) => (None, None),
        };
        let mut readers = Vec::new();
        for (stream, own) in [
            (Box::new(child.stderr.take().unwrap()) as Box<dyn std::io::Read + Send>, None),
            (Box::new(child.stdout.take().unwrap()), Some(stdout.clone())),
        ] {
            let printed = printed.clone();
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    printed.lock().unwrap().push(&line);
                    if let Some(own) = &own {
                        own.lock().unwrap().push(line.clone());
                    }
                    if let Some(tx) = &tx {
                        let _ = tx.send(line);
                    }
                }
            }));
        }
        Proc { child, printed, stdout, rx, readers }
    }

    /// Lines and bytes the process printed so far (stdout and stderr, each line with its newline).
    pub fn printed(&self) -> (u64, u64) {
        let printed = self.printed.lock().unwrap();
        (printed.count, printed.bytes)
    }

    /// Waits for an output line containing `needle` and returns it.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let rx = self.rx.as_ref().expect("wait_for_line needs a process started with Proc::spawn");
            match rx.recv_timeout(left) {
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

    /// Everything printed so far (stdout and stderr); collected, what was kept of it.
    pub fn output(&self) -> String {
        self.printed.lock().unwrap().text()
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

/// The JSON log lines in a process's `output`, in order; lines that are not JSON (a text log, a
/// panic, a command's own printout) are left out.
pub fn json_lines(output: &str) -> Vec<serde_json::Value> {
    output.lines().filter_map(|line| serde_json::from_str(line).ok()).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collected_process_counts_every_line_and_keeps_its_warnings_and_its_last_info_lines() {
        // 5000 info lines, a warning among them, then a panic-like line that is not JSON.
        let script = r#"
            i=0
            while [ $i -lt 5000 ]; do
                printf '{"level":"INFO","message":"event done","n":%d}\n' $i >&2
                if [ $i -eq 10 ]; then printf '{"level":"WARN","message":"claim failed"}\n' >&2; fi
                i=$((i+1))
            done
            echo 'thread main panicked' >&2
        "#;
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        let mut p = Proc::spawn_collected(cmd, 100);
        assert!(p.wait(Duration::from_secs(60)).success());
        let (lines, bytes) = p.printed();
        assert_eq!(lines, 5002);
        let info: u64 = (0..5000)
            .map(|i| format!(r#"{{"level":"INFO","message":"event done","n":{i}}}"#).len() as u64 + 1)
            .sum();
        let others = r#"{"level":"WARN","message":"claim failed"}"#.len() as u64
            + 1
            + "thread main panicked".len() as u64
            + 1;
        assert_eq!(bytes, info + others);
        let output = p.output();
        assert!(output.contains("claim failed") && output.contains("thread main panicked"), "{output}");
        assert!(
            output.contains(r#""n":4999}"#) && output.contains(r#""n":4900}"#),
            "the last 100 info lines"
        );
        assert!(!output.contains(r#""n":4899}"#) && !output.contains(r#""n":10}"#), "no more of them");
        assert!(output.contains("[4900 lines not kept"), "{}", &output[..200.min(output.len())]);
    }
}
