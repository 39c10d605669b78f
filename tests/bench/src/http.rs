//! A minimal keep-alive HTTP/1.1 client over raw TCP (cheap in CPU: the load generator shares
//! the machine with the services and PostgreSQL) and the two load shapes: closed loop (each
//! connection sends its next request when the previous one is answered) and open loop (requests
//! scheduled at a fixed rate, latency counted from the scheduled instant).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::payload::Requests;
use crate::util::Percentiles;

/// One keep-alive connection; reconnects after an error or a `Connection: close`.
pub struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    pub reconnects: u64,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Conn> {
        let mut c = Conn { addr, stream: None, buf: Vec::with_capacity(4096), reconnects: 0 };
        c.ensure().await?;
        c.reconnects = 0;
        Ok(c)
    }

    async fn ensure(&mut self) -> std::io::Result<&mut TcpStream> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
            self.reconnects += 1;
        }
        Ok(self.stream.as_mut().unwrap())
    }

    /// Sends one complete request and returns the response status (the body is discarded).
    pub async fn request(&mut self, req: &[u8]) -> anyhow::Result<u16> {
        match self.roundtrip(req).await {
            Ok((status, close)) => {
                if close {
                    self.stream = None;
                }
                Ok(status)
            }
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    async fn roundtrip(&mut self, req: &[u8]) -> anyhow::Result<(u16, bool)> {
        let mut buf = std::mem::take(&mut self.buf);
        let result = async {
            let stream = self.ensure().await?;
            stream.write_all(req).await?;
            buf.clear();
            let mut chunk = [0u8; 4096];
            let header_end = loop {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    bail!("connection closed before the response");
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break p + 4;
                }
                if buf.len() > 64 * 1024 {
                    bail!("response headers over 64 KiB");
                }
            };
            let head = std::str::from_utf8(&buf[..header_end]).context("response head not UTF-8")?;
            let mut lines = head.split("\r\n");
            let status_line = lines.next().unwrap_or_default();
            let status: u16 = status_line
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .with_context(|| format!("bad status line {status_line:?}"))?;
            let mut length = None;
            let mut close = status_line.starts_with("HTTP/1.0");
            for line in lines {
                let Some((name, value)) = line.split_once(':') else { continue };
                let (name, value) = (name.trim(), value.trim());
                if name.eq_ignore_ascii_case("content-length") {
                    length = Some(value.parse::<usize>().context("bad Content-Length")?);
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    bail!("Transfer-Encoding {value} not supported by the benchmark client");
                } else if name.eq_ignore_ascii_case("connection") {
                    close = value.eq_ignore_ascii_case("close");
                }
            }
            let length = length.context("response without Content-Length")?;
            let mut have = buf.len() - header_end;
            while have < length {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    bail!("connection closed inside the response body");
                }
                have += n;
            }
            Ok((status, close))
        }
        .await;
        self.buf = buf;
        result
    }
}

/// Answers of one part of a run.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    pub ok: u64,
    pub non_2xx: u64,
    /// Requests without an answer (connection error); their rows may or may not be stored.
    pub errors: u64,
    pub statuses: BTreeMap<u16, u64>,
}

impl Counts {
    fn record(&mut self, result: &anyhow::Result<u16>) {
        match result {
            Ok(s) => {
                *self.statuses.entry(*s).or_default() += 1;
                if (200..300).contains(s) {
                    self.ok += 1;
                } else {
                    self.non_2xx += 1;
                }
            }
            Err(_) => self.errors += 1,
        }
    }

    fn add(&mut self, o: &Counts) {
        self.ok += o.ok;
        self.non_2xx += o.non_2xx;
        self.errors += o.errors;
        for (s, n) in &o.statuses {
            *self.statuses.entry(*s).or_default() += n;
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok_2xx": self.ok, "non_2xx": self.non_2xx, "errors": self.errors,
            "statuses": self.statuses.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// What a load run measured.
#[derive(Debug, Default)]
pub struct LoadResult {
    pub warmup: Counts,
    /// Requests started inside the measured window (or, open loop, all of them).
    pub measured: Counts,
    pub latency: Percentiles,
    /// Every measured request's latency in µs, sorted: what rounds of one figure are merged from.
    pub micros: Vec<u32>,
    pub seconds: f64,
    pub first_error: Option<String>,
    pub reconnects: u64,
}

impl LoadResult {
    pub fn total_ok(&self) -> u64 {
        self.warmup.ok + self.measured.ok
    }

    pub fn total_unanswered(&self) -> u64 {
        self.warmup.errors + self.measured.errors
    }

    pub fn rate(&self) -> f64 {
        (self.measured.ok + self.measured.non_2xx) as f64 / self.seconds
    }
}

#[derive(Default)]
struct TaskResult {
    warmup: Counts,
    measured: Counts,
    latencies: Vec<u32>,
    first_error: Option<String>,
    reconnects: u64,
}

fn merge(parts: Vec<TaskResult>, seconds: f64) -> LoadResult {
    let mut r = LoadResult { seconds, ..Default::default() };
    let mut lat = Vec::with_capacity(parts.iter().map(|p| p.latencies.len()).sum());
    for p in parts {
        r.warmup.add(&p.warmup);
        r.measured.add(&p.measured);
        lat.extend_from_slice(&p.latencies);
        r.first_error = r.first_error.or(p.first_error);
        r.reconnects += p.reconnects;
    }
    lat.sort_unstable();
    r.latency = Percentiles::of_sorted(&lat);
    r.micros = lat;
    r
}

/// Opens `n` connections (before any clock starts).
pub async fn connect_all(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<Conn>> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Conn::connect(addr).await.with_context(|| format!("connecting to {addr}"))?);
    }
    Ok(conns)
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u32::MAX as u128) as u32
}

/// Closed loop from `t0`: warm-up, then the measured window, on every connection at once.
pub async fn closed_loop(
    conns: Vec<Conn>,
    requests: Arc<Requests>,
    t0: Instant,
    warmup: Duration,
    duration: Duration,
) -> LoadResult {
    let measure_from = t0 + warmup;
    let end = measure_from + duration;
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let requests = requests.clone();
            tokio::spawn(async move {
                let mut r = TaskResult { latencies: Vec::with_capacity(16 * 1024), ..Default::default() };
                loop {
                    let started = Instant::now();
                    if started >= end {
                        break;
                    }
                    let req = requests.take();
                    let result = conn.request(&req).await;
                    let done = Instant::now();
                    if let Err(e) = &result {
                        r.first_error.get_or_insert_with(|| format!("{e:#}"));
                        // Do not spin on a refused connection.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    // A request started inside the window counts there even when answered after
                    // its end (the rate is requests sent per second of the window).
                    if started < measure_from {
                        r.warmup.record(&result);
                    } else {
                        r.measured.record(&result);
                        if result.is_ok() {
                            r.latencies.push(micros(done - started));
                        }
                    }
                }
                r.reconnects = conn.reconnects;
                r
            })
        })
        .collect();
    let mut parts = Vec::new();
    for t in tasks {
        parts.push(t.await.unwrap_or_default());
    }
    merge(parts, duration.as_secs_f64())
}

/// Open loop: request `i` is due at `t0 + i / rate`, for `duration`; connection `k` sends the
/// requests `k, k + n, k + 2n, …`. Latency is measured from the due instant, so a connection
/// that falls behind shows as latency instead of silently lowering the rate.
pub async fn open_loop(
    conns: Vec<Conn>,
    requests: Arc<Requests>,
    t0: Instant,
    rate: f64,
    duration: Duration,
) -> LoadResult {
    let n = conns.len();
    let total = (rate * duration.as_secs_f64()).round() as usize;
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(k, mut conn)| {
            let requests = requests.clone();
            tokio::spawn(async move {
                let mut r = TaskResult::default();
                let mut i = k;
                while i < total {
                    let due = t0 + Duration::from_secs_f64(i as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                    let req = requests.take();
                    let result = conn.request(&req).await;
                    if let Err(e) = &result {
                        r.first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                    r.measured.record(&result);
                    if result.is_ok() {
                        r.latencies.push(micros(due.elapsed()));
                    }
                    i += n;
                }
                r.reconnects = conn.reconnects;
                r
            })
        })
        .collect();
    let mut parts = Vec::new();
    for t in tasks {
        parts.push(t.await.unwrap_or_default());
    }
    let seconds = t0.elapsed().as_secs_f64().max(duration.as_secs_f64());
    merge(parts, seconds)
}

/// `GET path` on a fresh connection: the status, or an error.
pub async fn get_status(addr: SocketAddr, path: &str) -> anyhow::Result<u16> {
    let mut c = Conn::connect(addr).await?;
    c.request(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await
}
