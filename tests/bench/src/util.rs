//! Percentiles, CPU and memory readings from /proc, and small formatting helpers.

use std::time::Instant;

/// Linux reports CPU times in USER_HZ ticks, 100 per second on every mainstream architecture.
const TICKS_PER_S: f64 = 100.0;

/// Latency percentiles (input in microseconds) in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

impl Percentiles {
    pub fn of(mut micros: Vec<u32>) -> Percentiles {
        micros.sort_unstable();
        Percentiles::of_sorted(&micros)
    }

    /// [`Percentiles::of`] latencies already in ascending order.
    pub fn of_sorted(micros: &[u32]) -> Percentiles {
        if micros.is_empty() {
            return Percentiles::default();
        }
        let at = |q: f64| {
            let i = ((q * micros.len() as f64).ceil() as usize).clamp(1, micros.len()) - 1;
            micros[i] as f64 / 1e3
        };
        let sum: u64 = micros.iter().map(|&v| v as u64).sum();
        Percentiles {
            count: micros.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            p999: at(0.999),
            max: *micros.last().unwrap() as f64 / 1e3,
            mean: sum as f64 / micros.len() as f64 / 1e3,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count, "p50_ms": r3(self.p50), "p90_ms": r3(self.p90), "p99_ms": r3(self.p99),
            "p99_9_ms": r3(self.p999), "max_ms": r3(self.max), "mean_ms": r3(self.mean),
        })
    }
}

pub fn r3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

pub use inbox_test_support::process::rss_kib;

/// utime + stime (and, with `children`, cutime + cstime) of a process, in ticks.
fn proc_ticks(pid: u32, children: bool) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(4).filter_map(|v| v.parse().ok()).collect();
    if f.len() < 4 {
        return None;
    }
    Some(f[0] + f[1] + if children { f[2] + f[3] } else { 0 })
}

fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split_whitespace().nth(1)?.parse().ok()
}

/// CPU of the whole PostgreSQL server: the postmaster, the children it has reaped (cutime) and
/// the live children.
fn postgres_ticks(postmaster: u32) -> Option<u64> {
    let mut total = proc_ticks(postmaster, true)?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if parent_pid(pid) == Some(postmaster) {
            total += proc_ticks(pid, false).unwrap_or(0);
        }
    }
    Some(total)
}

/// (busy, steal, total) ticks of all the machine's cores from /proc/stat; busy includes steal.
fn machine_ticks() -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<u64> =
        stat.lines().next()?.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, v.get(7).copied().unwrap_or(0), total))
}

/// The share (0..1) of the machine's ticks between two readings that a counter grew by: `part`
/// from `p0` to `p1` while all ticks went from `t0` to `t1`. None when no tick passed.
fn tick_share((p0, t0): (u64, u64), (p1, t1): (u64, u64)) -> Option<f64> {
    (t1 > t0).then(|| p1.saturating_sub(p0) as f64 / (t1 - t0) as f64)
}

/// What the machine did in each second of a window, to tell a bad second of the pipeline from
/// one of the machine: all its CPU taken, or every runnable task waiting on the disk at once (a
/// WAL flush that stalls stalls every committing backend), or a hypervisor that gave the VM's
/// time to someone else.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineSecond {
    /// Share of all cores not idle, steal included, in percent.
    pub busy_pct: Option<f64>,
    /// Share of all cores the hypervisor ran something else on (`steal` in /proc/stat).
    pub steal_pct: Option<f64>,
    /// Milliseconds of the second in which every non-idle task waited on I/O
    /// (`/proc/pressure/io`, `full`; absent on kernels without pressure stall information).
    pub io_stall_ms: Option<f64>,
}

impl MachineSecond {
    pub fn json(&self) -> serde_json::Value {
        let r1 = |v: Option<f64>| v.map(|v| (v * 10.0).round() / 10.0);
        serde_json::json!({
            "busy_pct": r1(self.busy_pct), "steal_pct": r1(self.steal_pct), "io_stall_ms": r1(self.io_stall_ms),
        })
    }
}

/// One reading of the counters [`MachineSecond`] is made of.
#[derive(Debug, Clone, Copy)]
struct MachineCounters {
    /// busy (steal included), steal, total ticks of all cores.
    ticks: Option<(u64, u64, u64)>,
    /// `full` total of /proc/pressure/io, microseconds.
    io_full_us: Option<u64>,
}

impl MachineCounters {
    fn read() -> MachineCounters {
        let ticks = machine_ticks();
        let io_full_us = (|| {
            let psi = std::fs::read_to_string("/proc/pressure/io").ok()?;
            let full = psi.lines().find(|l| l.starts_with("full "))?;
            full.split_whitespace().find_map(|f| f.strip_prefix("total="))?.parse().ok()
        })();
        MachineCounters { ticks, io_full_us }
    }

    fn since(&self, earlier: &MachineCounters) -> MachineSecond {
        let (busy_pct, steal_pct) = match (earlier.ticks, self.ticks) {
            (Some((b0, s0, t0)), Some((b1, s1, t1))) => {
                let pct = |a, b| tick_share((a, t0), (b, t1)).map(|share| share * 100.0);
                (pct(b0, b1), pct(s0, s1))
            }
            _ => (None, None),
        };
        let io_stall_ms = match (earlier.io_full_us, self.io_full_us) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e3),
            _ => None,
        };
        MachineSecond { busy_pct, steal_pct, io_stall_ms }
    }
}

/// Reads [`MachineSecond`]s from `t0`, one a second, until [`MachineSampler::finish`], which adds
/// the part second since the last.
pub struct MachineSampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<MachineSecond>>,
}

impl MachineSampler {
    pub fn start(t0: Instant) -> MachineSampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut seconds = Vec::new();
            let mut last = MachineCounters::read();
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::from_std(t0) + std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(1),
            );
            loop {
                let done = tokio::select! {
                    _ = &mut stopped => true,
                    _ = tick.tick() => false,
                };
                let now = MachineCounters::read();
                seconds.push(now.since(&last));
                last = now;
                if done {
                    break seconds;
                }
            }
        });
        MachineSampler { stop, task }
    }

    pub async fn finish(self) -> Vec<MachineSecond> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

/// A CPU reading of the machine, this process, PostgreSQL and the named service processes.
#[derive(Debug, Clone)]
pub struct CpuSample {
    at: Instant,
    machine: Option<(u64, u64, u64)>,
    own: Option<u64>,
    postgres: Option<u64>,
    procs: Vec<(String, u32, Option<u64>)>,
}

impl CpuSample {
    pub fn take(postmaster: Option<u32>, procs: &[(&str, u32)]) -> CpuSample {
        CpuSample {
            at: Instant::now(),
            machine: machine_ticks(),
            own: proc_ticks(std::process::id(), true),
            postgres: postmaster.and_then(postgres_ticks),
            procs: procs.iter().map(|&(n, pid)| (n.to_owned(), pid, proc_ticks(pid, false))).collect(),
        }
    }

    /// CPU used between `self` and `later`, in percent of one core (machine: of all cores), and
    /// in CPU-microseconds per `units` (requests, events) where given.
    pub fn usage(&self, later: &CpuSample, units: Option<f64>) -> serde_json::Value {
        let secs = later.at.duration_since(self.at).as_secs_f64().max(1e-6);
        let pct = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => {
                serde_json::json!((b.saturating_sub(a) as f64 / TICKS_PER_S / secs * 1000.0).round() / 10.0)
            }
            _ => serde_json::Value::Null,
        };
        let per_unit = |a: Option<u64>, b: Option<u64>| match (a, b, units) {
            (Some(a), Some(b), Some(u)) if u > 0.0 => {
                serde_json::json!((b.saturating_sub(a) as f64 / TICKS_PER_S * 1e6 / u).round())
            }
            _ => serde_json::Value::Null,
        };
        let mut out = serde_json::json!({
            "seconds": r3(secs),
            "postgres_pct_of_core": pct(self.postgres, later.postgres),
            "bench_pct_of_core": pct(self.own, later.own),
            "postgres_cpu_us_per_unit": per_unit(self.postgres, later.postgres),
        });
        // Processes with the same name (several workers) are summed.
        let mut names: Vec<&str> = self.procs.iter().map(|p| p.0.as_str()).collect();
        names.dedup();
        for name in names {
            let sum = |s: &CpuSample| {
                s.procs
                    .iter()
                    .filter(|p| p.0 == name)
                    .map(|p| p.2)
                    .try_fold(0u64, |acc, t| t.map(|t| acc + t))
            };
            let (a, b) = (sum(self), sum(later));
            out[format!("{name}_pct_of_core")] = pct(a, b);
            out[format!("{name}_cpu_us_per_unit")] = per_unit(a, b);
        }
        if let (Some((b0, _, t0)), Some((b1, _, t1))) = (self.machine, later.machine) {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let busy = tick_share((b0, t0), (b1, t1)).unwrap_or(0.0);
            out["machine_busy_pct"] = serde_json::json!((busy * 1000.0).round() / 10.0);
            out["machine_cores"] = serde_json::json!(cores);
            // Whatever else ran meanwhile (other people's builds and tests on a shared machine).
            let known: f64 = out
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.ends_with("_pct_of_core"))
                .filter_map(|(_, v)| v.as_f64())
                .sum();
            out["other_pct_of_core"] = serde_json::json!((busy * cores * 100.0 - known).max(0.0).round());
        }
        out
    }
}

/// Runs of one measurement in several rounds (drains, relay deliveries) as one figure: the last
/// run's figures (sizes, plans, CPU), with `rate` as all runs' `count` over all their `seconds`,
/// and each run's rate under `rounds_<rate>`. `None` when no run succeeded.
pub fn total_rate(rounds: Vec<serde_json::Value>, count: &str, rate: &str) -> Option<serde_json::Value> {
    let sum = |k: &str| rounds.iter().map(|r| r[k].as_f64().unwrap_or(f64::NAN)).sum::<f64>();
    let (n, seconds) = (sum(count), sum("seconds"));
    let mut out = rounds.last()?.clone();
    if rounds.len() > 1 {
        out["seconds"] = serde_json::json!(seconds);
        out[rate] = serde_json::json!(n / seconds);
        out[format!("rounds_{rate}")] = rounds.iter().map(|r| r[rate].clone()).collect();
    }
    Some(out)
}

/// The CPU usage of several measured windows of one figure (rounds) as one: shares of a core
/// weighted by each window's seconds, microseconds per unit by its units (requests, events).
pub fn combine_cpu(parts: &[(&serde_json::Value, f64)]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    let Some((first, _)) = parts.first() else { return serde_json::Value::Null };
    for key in first.as_object().into_iter().flatten().map(|(k, _)| k) {
        let weighted = |weight: &dyn Fn(&serde_json::Value, f64) -> f64| {
            let (mut sum, mut weights) = (0.0, 0.0);
            for (cpu, units) in parts {
                let (Some(v), w) = (cpu[key].as_f64(), weight(cpu, *units)) else {
                    return serde_json::Value::Null;
                };
                sum += v * w;
                weights += w;
            }
            serde_json::json!((sum / weights.max(1e-9) * 10.0).round() / 10.0)
        };
        let value = if key == "seconds" {
            serde_json::json!(r3(parts.iter().filter_map(|(c, _)| c[key].as_f64()).sum()))
        } else if key.ends_with("_pct_of_core") || key == "machine_busy_pct" {
            weighted(&|cpu, _| cpu["seconds"].as_f64().unwrap_or(0.0))
        } else if key.ends_with("_cpu_us_per_unit") {
            weighted(&|_, units| units)
        } else {
            first[key].clone()
        };
        out.insert(key.clone(), value);
    }
    serde_json::Value::Object(out)
}

/// How much the named services had logged at one moment (lines and bytes, see `Proc::printed`).
#[derive(Debug, Clone)]
pub struct LogSample {
    procs: Vec<(String, u64, u64)>,
}

impl LogSample {
    pub fn take(procs: &[(&str, &inbox_test_support::process::Proc)]) -> LogSample {
        LogSample {
            procs: procs
                .iter()
                .map(|(name, proc)| {
                    let (lines, bytes) = proc.printed();
                    ((*name).to_owned(), lines, bytes)
                })
                .collect(),
        }
    }

    /// What each service logged between `self` and `later`, per `units` (requests, events), the
    /// processes of one name together: `{"ingest": {"lines_per_unit": …, "bytes_per_unit": …}, …}`.
    pub fn per_unit(&self, later: &LogSample, units: f64) -> serde_json::Value {
        let units = units.max(1.0);
        let mut totals: Vec<(&str, u64, u64)> = Vec::new();
        for ((name, lines0, bytes0), (_, lines1, bytes1)) in self.procs.iter().zip(&later.procs) {
            let (lines, bytes) = (lines1.saturating_sub(*lines0), bytes1.saturating_sub(*bytes0));
            match totals.iter_mut().find(|t| t.0 == name) {
                Some(t) => (t.1, t.2) = (t.1 + lines, t.2 + bytes),
                None => totals.push((name, lines, bytes)),
            }
        }
        let mut out = serde_json::Map::new();
        for (name, lines, bytes) in totals {
            out.insert(
                name.to_owned(),
                serde_json::json!({
                    "lines_per_unit": (lines as f64 / units * 100.0).round() / 100.0,
                    "bytes_per_unit": (bytes as f64 / units).round(),
                }),
            );
        }
        serde_json::Value::Object(out)
    }
}

/// A short human form of a log object ([`LogSample::per_unit`]): `ingest 1.0 lines / 283 B`.
pub fn log_text(log: &serde_json::Value) -> String {
    let parts: Vec<String> = log
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, v)| {
            let lines = v["lines_per_unit"].as_f64().unwrap_or(0.0);
            format!("{name} {lines:.1} lines / {:.0} B", v["bytes_per_unit"].as_f64().unwrap_or(0.0))
        })
        .collect();
    parts.join(", ")
}

/// [`log_text`] for a progress line: `logs per unit: ingest 1.0 lines / 283 B`.
pub fn log_summary(log: &serde_json::Value) -> String {
    format!("logs per unit: {}", log_text(log))
}

/// A short human form of a CPU usage object: `postgres 95%, ingest 80%, bench 20%, machine 97%`.
pub fn cpu_summary(cpu: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    if let Some(map) = cpu.as_object() {
        for (k, v) in map {
            if let (Some(name), Some(v)) = (k.strip_suffix("_pct_of_core"), v.as_f64()) {
                parts.push(format!("{name} {v:.0}%"));
            }
        }
    }
    if let Some(v) = cpu["machine_busy_pct"].as_f64() {
        parts.push(format!("machine busy {v:.0}%"));
    }
    parts.join(", ")
}

/// Seconds since `start`, for progress lines.
pub fn elapsed(start: Instant) -> String {
    format!("{:7.1}s", start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn runs_in_rounds_give_their_rows_over_their_seconds_and_keep_the_last_runs_figures() {
        let run = |rows: f64, seconds: f64, size: i64| json!({ "rows": rows, "seconds": seconds, "deliveries_per_s": rows / seconds, "bytes": size });
        let v =
            super::total_rate(vec![run(50_000.0, 2.0, 1), run(50_000.0, 3.0, 2)], "rows", "deliveries_per_s")
                .unwrap();
        // 100k rows in 5 s, where the mean of the two rates would be 20833.
        assert_eq!(v["deliveries_per_s"], json!(20_000.0));
        assert_eq!(v["rounds_deliveries_per_s"], json!([25_000.0, 50_000.0 / 3.0]));
        assert_eq!(v["bytes"], json!(2));
        assert!(super::total_rate(Vec::new(), "rows", "deliveries_per_s").is_none());
        let one = super::total_rate(vec![run(10.0, 1.0, 3)], "rows", "deliveries_per_s").unwrap();
        assert!(one.get("rounds_deliveries_per_s").is_none(), "one run has no rounds: {one}");
    }

    #[test]
    fn a_second_of_the_machine_is_its_busy_and_stolen_share_of_all_cores_and_its_io_stall() {
        use super::MachineCounters;
        let at =
            |busy, steal, total, io| MachineCounters { ticks: Some((busy, steal, total)), io_full_us: io };
        // Two cores, 200 ticks: 180 busy of which 4 stolen; 46 ms with every task on I/O.
        let s = at(1180, 14, 2200, Some(5_046_000)).since(&at(1000, 10, 2000, Some(5_000_000)));
        assert_eq!((s.busy_pct, s.steal_pct, s.io_stall_ms), (Some(90.0), Some(2.0), Some(46.0)));
        assert_eq!(s.json(), json!({ "busy_pct": 90.0, "steal_pct": 2.0, "io_stall_ms": 46.0 }));
        // A kernel without pressure stall information; no tick between the readings.
        let s = at(1000, 10, 2000, None).since(&at(1000, 10, 2000, None));
        assert_eq!((s.busy_pct, s.steal_pct, s.io_stall_ms), (None, None, None));
    }
}
