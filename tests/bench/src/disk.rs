//! disk: how long this machine's disk takes to make a write durable, and how often it stalls.
//! An 8 KiB write and its `fdatasync`, back to back, for `--disk-duration` in a 16 MiB file of
//! `--disk-dir`, on an otherwise idle machine: what every commit's WAL flush waits for. PostgreSQL's
//! `pg_test_fsync` reports the mean; the tail is what a receive→processed p99 over a few seconds
//! feels: while one flush stalls, every committing transaction waits for it, the ingest's and the
//! worker's alike, and the pipeline then works off the backlog with whatever CPU it has spare.

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;

use crate::util::{r3, Percentiles};
use crate::Ctx;

/// Flushes over this long are counted and listed as stalls: several times a loaded second's
/// commit latency, and enough to put that second's receive→processed p99 over 25 ms at half the
/// ingest's rate on two cores.
const STALL: Duration = Duration::from_millis(20);

/// Stalls listed in the run's output; report.json has them all.
const SHOWN: usize = 20;

/// The file's size: 2048 blocks written in turn, so that each write overwrites an allocated block
/// as PostgreSQL's recycled WAL segments do, and the flush carries no file-size change.
const FILE_BYTES: u64 = 16 << 20;
const BLOCK: usize = 8192;

pub async fn run(ctx: &Ctx) -> anyhow::Result<serde_json::Value> {
    let dir = ctx.args.disk_dir.clone().unwrap_or_else(|| ctx.out_dir.clone());
    let duration = ctx.args.disk_duration;
    anyhow::ensure!(duration >= Duration::from_secs(1), "--disk-duration must be at least 1s");
    ctx.say(&format!(
        "disk: 8 KiB writes, each with fdatasync, for {} s in {}",
        duration.as_secs(),
        dir.display()
    ));
    let Probe { flushes_us, stalls } = tokio::task::spawn_blocking(move || probe(&dir, duration)).await??;
    let p = Percentiles::of(flushes_us);
    let minutes = duration.as_secs_f64() / 60.0;
    // Every listed stall is over STALL (20 ms); those over 40 ms are a part of them.
    let over_20_per_min = stalls.len() as f64 / minutes;
    let over_40_per_min = stalls.iter().filter(|s| s.ms > 40.0).count() as f64 / minutes;
    ctx.say(&format!(
        "disk: {} flushes, p50 {:.2} ms p99 {:.2} ms p99.9 {:.2} ms max {:.1} ms; over 20 ms {:.1}/min, over 40 ms {:.1}/min{}",
        p.count,
        p.p50,
        p.p99,
        p.p999,
        p.max,
        over_20_per_min,
        over_40_per_min,
        match stalls.len() {
            0 => String::new(),
            n => format!(
                " ({}{})",
                stalls
                    .iter()
                    .take(SHOWN)
                    .map(|s| format!("{:.0} ms at {:.1} s", s.ms, s.at_s))
                    .collect::<Vec<_>>()
                    .join(", "),
                if n > SHOWN { format!(", and {} more in report.json", n - SHOWN) } else { String::new() }
            ),
        }
    ));
    Ok(json!({
        "seconds": duration.as_secs_f64(),
        "flush": p.json(),
        "stalls_over_20ms_per_min": over_20_per_min,
        "stalls_over_40ms_per_min": over_40_per_min,
        "stalls": stalls.iter().map(|s| json!({ "at_s": r3(s.at_s), "ms": r3(s.ms) })).collect::<Vec<_>>(),
    }))
}

/// What the probe measured.
struct Probe {
    /// Every flush's duration, in microseconds.
    flushes_us: Vec<u32>,
    /// The flushes over [`STALL`].
    stalls: Vec<Stall>,
}

struct Stall {
    /// When the flush began, in seconds from the probe's start.
    at_s: f64,
    ms: f64,
}

fn probe(dir: &Path, duration: Duration) -> anyhow::Result<Probe> {
    let path = dir.join(format!("disk-probe-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    let result = (|| -> std::io::Result<_> {
        // Allocate every block first, written and flushed, as a WAL segment is before its reuse.
        let zeros = vec![0u8; 1 << 20];
        for i in 0..FILE_BYTES / zeros.len() as u64 {
            file.write_all_at(&zeros, i * zeros.len() as u64)?;
        }
        file.sync_all()?;
        let block = [0x5au8; BLOCK];
        let blocks = FILE_BYTES / BLOCK as u64;
        let (mut flushes_us, mut stalls) = (Vec::new(), Vec::new());
        let start = Instant::now();
        let mut i = 0u64;
        while start.elapsed() < duration {
            file.write_all_at(&block, (i % blocks) * BLOCK as u64)?;
            let t = Instant::now();
            file.sync_data()?;
            let took = t.elapsed();
            if took > STALL {
                stalls.push(Stall {
                    at_s: t.duration_since(start).as_secs_f64(),
                    ms: took.as_secs_f64() * 1e3,
                });
            }
            flushes_us.push(took.as_micros().min(u32::MAX.into()) as u32);
            i += 1;
        }
        Ok(Probe { flushes_us, stalls })
    })();
    let _ = std::fs::remove_file(&path);
    result.with_context(|| format!("writing and flushing {}", path.display()))
}
