//! Logs and metrics, as both binaries emit them: `tracing` to stderr (JSON lines in production,
//! text on a terminal), and Prometheus metrics rendered from an explicit registry (no global
//! state).

use std::io::IsTerminal;

use tracing_log::NormalizeEvent;
use tracing_subscriber::EnvFilter;

/// Log output format (`--log-format`, `LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
}

impl LogFormat {
    /// `text` on a terminal, else `json` (what a log collector wants).
    pub fn detect() -> Self {
        if std::io::stderr().is_terminal() {
            LogFormat::Text
        } else {
            LogFormat::Json
        }
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "json" => Ok(LogFormat::Json),
            "text" => Ok(LogFormat::Text),
            _ => Err("expected `json` or `text`".to_owned()),
        }
    }
}

/// Installs the `tracing` subscriber: `RUST_LOG` filters (default `info`), logs go to stderr.
pub fn init_tracing(format: Option<LogFormat>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = format.unwrap_or_else(LogFormat::detect) == LogFormat::Json;
    // JSON lines through json-subscriber rather than tracing-subscriber's own JSON format: the
    // same fields, but a span's fields are kept as values and serialised once per change, where
    // tracing-subscriber parses the span's JSON back at every `record` and again at every line.
    // The ingest records three fields of its span per webhook; the line per webhook costs it
    // ~3 µs less (docs/performance.md, "What the logs cost"). The event's span (a webhook's or an
    // event's key) once, under "span": the list of every span around it only repeated it.
    let json_lines = json.then(|| {
        let mut layer = json_subscriber::layer()
            .with_writer(std::io::stderr)
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false);
        // A line from a crate that logs through `log` (tokio-postgres, refinery) names that crate
        // as its target, as tracing-subscriber's format did; json-subscriber alone would say "log".
        layer.inner_layer_mut().add_dynamic_field("target", |event, _| {
            let normalized = event.normalized_metadata();
            Some(normalized.as_ref().unwrap_or_else(|| event.metadata()).target().to_owned())
        });
        layer
    });
    // Colour codes only for a person at a terminal: text logs sent to a file or a collector stay
    // plain.
    let text_lines = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
    });
    // try_init: a second call (tests building several apps in one process) keeps the first.
    let _ = tracing_subscriber::registry().with(filter).with(json_lines).with(text_lines).try_init();
}

/// A duration in milliseconds rounded to a tenth, for log fields: `elapsed_ms = 3.1`, not
/// `3.141592653`.
pub fn millis(duration: std::time::Duration) -> f64 {
    (duration.as_secs_f64() * 1e4).round() / 10.0
}

/// The content type of the `/metrics` answers: OpenMetrics text, which Prometheus scrapes
/// natively.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The exposition text of every metric in `registry`.
pub fn render_metrics(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}
