//! What operators read: the pages.
//!
//! * `GET /`: the overview — the queue's states (the gauges' figures, as `stats` and the worker's
//!   metrics count them), the outbox, the open reconciliation items, and two charts drawn here as
//!   inline SVG: rows processed per 10 minutes over the last 6 hours, and their p50/p95 latency
//!   from receipt to processing;
//! * `GET /needs-review`: the parked (and held) rows, filtered (`type`, `endpoint`, `held`,
//!   `error`, `older_than`, `account`) and paged (`page`, [`PAGE_SIZE`] rows), oldest first, with
//!   the form that requeues the filtered set;
//! * `GET /events/{endpoint}/{event_id}`: one event — its state, provenance, payload and audit
//!   history — with the forms of the actions that apply to it;
//! * `GET /outbox`, `GET /reconciliation` (`?all=1` for the resolved items too), `GET /audit`.
//!
//! Every page reads through the store (`inbox_domain::inbox::store`) in one read-only transaction
//! on one pooled connection, bounded by [`READ_LIMITS`]; a failure is a 500 page saying what failed
//! and the server's reason (never a connection parameter). Every value goes through askama's
//! escaping; the actions (`super::actions`) redirect back with a `notice` parameter, shown on top.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse, ResponseError};
use askama::Template;
use deadpool_postgres::Object;
use inbox_domain::config::parse_duration;
use inbox_domain::db::{describe_db_error, describe_pool_error};
use inbox_domain::inbox::store::console::{self as queries, HeldFilter, ReviewFilter, ThroughputInterval};
use inbox_domain::inbox::store::{self, admin, outbox, reconciliation, TransactionLimits};
use serde::Deserialize;
use tokio_postgres::IsolationLevel;

use super::auth::Operator;
use super::Console;

/// Rows per page of the needs-review list and of the audit log.
pub const PAGE_SIZE: i64 = 50;

/// Bounds of a page's read-only transaction: a page that would take longer is an error page, not
/// a request left hanging (the overview's charts read the processed history: see
/// `store::console::THROUGHPUT_SQL`).
pub const READ_LIMITS: TransactionLimits = TransactionLimits {
    statement_timeout: Duration::from_secs(20),
    lock_timeout: Duration::from_secs(5),
    idle_timeout: Duration::from_secs(30),
};

/// The charts: intervals of this many seconds…
const CHART_INTERVAL_SECONDS: f64 = 600.0;
/// …this many of them (6 hours).
const CHART_INTERVALS: i32 = 36;

/// Most parked outbox rows and reconciliation items listed.
const LIST_LIMIT: i64 = 500;

/// The routes of the pages.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(overview))
        .route("/needs-review", web::get().to(needs_review))
        .route("/events/{endpoint}/{event_id}", web::get().to(event))
        .route("/outbox", web::get().to(outbox_page))
        .route("/reconciliation", web::get().to(reconciliation_page))
        .route("/audit", web::get().to(audit));
}

// ------------------------------------------------------------------------------- plumbing

/// A page that could not be made: an error page with the operator's layout.
#[derive(Debug)]
pub struct PageError {
    operator: Operator,
    status: StatusCode,
    message: String,
}

impl PageError {
    fn new(operator: &Operator, status: StatusCode, message: impl Into<String>) -> Self {
        PageError { operator: operator.clone(), status, message: message.into() }
    }
}

impl fmt::Display for PageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

#[derive(Template)]
#[template(path = "console/_page_error.html")]
struct ErrorPage<'a> {
    operator: &'a Operator,
    status: u16,
    reason: &'static str,
    message: &'a str,
}

impl ResponseError for PageError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        if self.status.is_server_error() {
            tracing::error!(user = %self.operator.name, error = %self.message, "console page failed");
        }
        super::render(
            &ErrorPage {
                operator: &self.operator,
                status: self.status.as_u16(),
                reason: self.status.canonical_reason().unwrap_or("Error"),
                message: &self.message,
            },
            self.status,
        )
    }
}

/// What a page's reads return.
type Page = Result<HttpResponse, PageError>;

/// Maps a database error to a 500 saying what we were doing and the server's reason.
fn db<'a>(
    operator: &'a Operator,
    doing: &'static str,
) -> impl FnOnce(tokio_postgres::Error) -> PageError + 'a {
    move |e| {
        PageError::new(
            operator,
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{doing}: {}", describe_db_error(&e)),
        )
    }
}

/// One pooled connection for the request.
async fn connection(console: &Console, operator: &Operator) -> Result<Object, PageError> {
    console.pool.get().await.map_err(|e| {
        PageError::new(
            operator,
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot connect to the database: {}", describe_pool_error(&e)),
        )
    })
}

/// A read-only transaction (repeatable read: the figures of one page are of one moment) bounded by
/// [`READ_LIMITS`].
async fn begin<'a>(
    conn: &'a mut Object,
    operator: &Operator,
) -> Result<deadpool_postgres::Transaction<'a>, PageError> {
    let tx = conn
        .build_transaction()
        .read_only(true)
        .isolation_level(IsolationLevel::RepeatableRead)
        .start()
        .await
        .map_err(db(operator, "starting a read-only transaction"))?;
    store::set_limits(&tx, &READ_LIMITS).await.map_err(db(operator, "setting the statement timeout"))?;
    Ok(tx)
}

fn ok(template: &impl Template) -> Page {
    Ok(super::render(template, StatusCode::OK))
}

/// `text` percent-encoded for a path segment or a query value: everything but the unreserved
/// characters of RFC 3986.
pub fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The detail page of one event.
pub fn event_href(endpoint: &str, event_id: &str) -> String {
    format!("/events/{}/{}", encode(endpoint), encode(event_id))
}

/// `path?name=value&…` with the pairs whose value is not empty.
fn href(path: &str, pairs: &[(&str, &str)]) -> String {
    let query: Vec<String> = pairs
        .iter()
        .filter(|(_, value)| !value.is_empty())
        .map(|(name, value)| format!("{name}={}", encode(value)))
        .collect();
    if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", query.join("&"))
    }
}

/// An age in its two largest units: `42s`, `12m 30s`, `5h 12m`, `3d 4h`.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// `value`, or an em dash.
fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "—".to_owned(), |v| v.to_string())
}

/// A page number from the query (1-based; anything else is 1).
fn page_number(text: Option<&str>) -> i64 {
    text.and_then(|t| t.trim().parse::<i64>().ok()).filter(|p| *p >= 1).unwrap_or(1).min(1_000_000)
}

/// The query parameters every page takes.
#[derive(Debug, Default, Deserialize)]
pub struct NoticeQuery {
    /// What an action did, shown on top (set by the action's redirect).
    #[serde(default)]
    pub notice: Option<String>,
}

impl NoticeQuery {
    fn notice(&self) -> Option<String> {
        self.notice.as_deref().map(str::trim).filter(|n| !n.is_empty()).map(|n| n.chars().take(500).collect())
    }
}

// ------------------------------------------------------------------------------- overview

/// One figure of the overview.
struct Card {
    /// `card-<name>`.
    name: &'static str,
    label: &'static str,
    /// The figure as a number (`data-value`): a count, or seconds.
    value: String,
    /// The figure as shown.
    display: String,
    /// Shown as a problem (not zero where zero is healthy).
    warn: bool,
    /// Where to look further.
    link: Option<&'static str>,
}

impl Card {
    fn count(name: &'static str, label: &'static str, n: i64, warn_above_zero: bool) -> Card {
        Card {
            name,
            label,
            value: n.to_string(),
            display: n.to_string(),
            warn: warn_above_zero && n > 0,
            link: None,
        }
    }

    fn link(mut self, to: &'static str) -> Card {
        self.link = Some(to);
        self
    }
}

#[derive(Template)]
#[template(path = "console/overview.html")]
struct Overview {
    operator: Operator,
    notice: Option<String>,
    cards: Vec<Card>,
    throughput: Chart,
    latency: Chart,
    /// Rows processed over the charts' window.
    processed_total: i64,
    /// When the charts' figures were read (RFC 3339, UTC; they are kept for [`CHARTS_KEPT`]).
    charts_as_of: String,
    /// Why there are no charts.
    charts_error: Option<String>,
}

async fn overview(operator: Operator, console: web::Data<Console>, query: web::Query<NoticeQuery>) -> Page {
    let mut conn = connection(&console, &operator).await?;
    // Its own short transaction (the store's gauge count), before the page's.
    let open_items = reconciliation::open_count(&conn, READ_LIMITS.statement_timeout)
        .await
        .map_err(db(&operator, "counting the open reconciliation items"))?;
    let tx = begin(&mut conn, &operator).await?;
    let gauges = admin::queue_gauges(&*tx).await.map_err(db(&operator, "counting the queue"))?;
    let split = queries::queue_split(&*tx).await.map_err(db(&operator, "counting the queue's states"))?;
    let outbox = outbox::stats(&*tx).await.map_err(db(&operator, "reading the outbox statistics"))?;
    // Last: the charts read the processed history (a scan of the table). A chart that fails (the
    // statement timeout on a huge table) is said in its place; the figures above stand.
    let charts = match cached_charts() {
        Some(charts) => Ok(charts),
        None => match queries::throughput(&*tx, CHART_INTERVAL_SECONDS, CHART_INTERVALS).await {
            Ok(intervals) => Ok(cache_charts(intervals)),
            Err(e) => {
                let message = format!("reading the throughput of the last hours: {}", describe_db_error(&e));
                tracing::error!(user = %operator.name, error = %message, "console overview: no charts");
                Err(message)
            }
        },
    };
    // Read only: nothing to keep (and after a failed chart, the transaction is aborted).
    let _ = tx.rollback().await;
    let (intervals, charts_as_of, charts_error) = match charts {
        Ok(Charts { intervals, as_of, .. }) => (intervals, as_of, None),
        Err(message) => (Vec::new(), String::new(), Some(message)),
    };

    let oldest = if gauges.unprocessed > 0 {
        Card {
            name: "oldest_unprocessed_age",
            label: "oldest unprocessed",
            value: format!("{:.0}", gauges.oldest_unprocessed_age_seconds),
            display: age(gauges.oldest_unprocessed_age_seconds),
            warn: gauges.oldest_unprocessed_age_seconds > 600.0,
            link: None,
        }
    } else {
        Card {
            name: "oldest_unprocessed_age",
            label: "oldest unprocessed",
            value: "0".into(),
            display: "—".into(),
            warn: false,
            link: None,
        }
    };
    let cards = vec![
        Card::count("unprocessed", "unprocessed", gauges.unprocessed, false),
        Card::count("ready", "ready", gauges.ready, false),
        Card::count("leased", "in flight (leased)", split.leased, false),
        Card::count("retry_wait", "waiting for a retry", split.retry_wait, true),
        Card::count("parked", "parked (needs review)", gauges.needs_review, true).link("/needs-review"),
        Card::count("held", "held on arrival", split.held, true).link("/needs-review?held=any"),
        Card::count("no_handler", "no handler (no live worker claims)", gauges.no_handler, true),
        oldest,
        Card::count("outbox_pending", "outbox pending", outbox.pending, false).link("/outbox"),
        Card::count("outbox_parked", "outbox parked", outbox.parked, true).link("/outbox"),
        Card::count("reconciliation_open", "open reconciliation items", open_items, true)
            .link("/reconciliation"),
    ];
    let (mut throughput, mut latency) = (throughput_chart(&intervals), latency_chart(&intervals));
    if charts_error.is_some() {
        throughput.empty = Some("unavailable: see the error above".to_owned());
        latency.empty = throughput.empty.clone();
        throughput.bars.clear();
    }
    ok(&Overview {
        notice: query.notice(),
        cards,
        throughput,
        latency,
        processed_total: intervals.iter().map(|i| i.processed).sum(),
        charts_as_of,
        charts_error,
        operator,
    })
}

/// The charts' figures and when they were read.
#[derive(Clone)]
struct Charts {
    intervals: Vec<ThroughputInterval>,
    read_at: Instant,
    /// RFC 3339, UTC.
    as_of: String,
}

/// How long the charts' figures are kept: the query scans the table, and an overview reloaded by
/// several people should not scan it for each.
const CHARTS_KEPT: Duration = Duration::from_secs(30);

/// The last charts read by this process, shared by every request.
static CHARTS: Mutex<Option<Charts>> = Mutex::new(None);

fn cached_charts() -> Option<Charts> {
    let kept = CHARTS.lock().unwrap_or_else(|e| e.into_inner());
    kept.as_ref().filter(|c| c.read_at.elapsed() < CHARTS_KEPT).cloned()
}

fn cache_charts(intervals: Vec<ThroughputInterval>) -> Charts {
    let charts = Charts {
        intervals,
        read_at: Instant::now(),
        as_of: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
    };
    *CHARTS.lock().unwrap_or_else(|e| e.into_inner()) = Some(charts.clone());
    charts
}

// --------------------------------------------------------------------------------- charts

/// A chart drawn as inline SVG: shapes with classes (the stylesheet colours them; the CSP allows no
/// inline style), coordinates in the `viewBox`.
struct Chart {
    width: u32,
    height: u32,
    /// What it shows, for `<title>` (screen readers, hover).
    title: String,
    bars: Vec<Bar>,
    lines: Vec<Line>,
    dots: Vec<Dot>,
    /// Horizontal grid lines with their value.
    grid: Vec<Grid>,
    labels: Vec<Label>,
    /// Said in the middle when there is nothing to draw.
    empty: Option<String>,
}

struct Bar {
    x: String,
    y: String,
    width: String,
    height: String,
    title: String,
}

struct Line {
    class: &'static str,
    points: String,
}

struct Dot {
    class: &'static str,
    cx: String,
    cy: String,
    title: String,
}

struct Grid {
    y: String,
    x1: String,
    x2: String,
}

struct Label {
    class: &'static str,
    x: String,
    y: String,
    /// `start`, `middle`, `end` (the SVG attribute `text-anchor`).
    anchor: &'static str,
    text: String,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 200.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 12.0;
const TOP: f64 = 22.0;
const BOTTOM: f64 = 24.0;

fn n(v: f64) -> String {
    format!("{v:.1}")
}

/// The smallest of 1, 2, 5 × 10^k at least `v` (a round top for an axis).
fn round_up(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * magnitude).find(|top| *top >= v).unwrap_or(10.0 * magnitude)
}

/// Seconds as a short latency: `850 ms`, `4.2 s`, `3.5 min`, `2.0 h`.
fn latency_text(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.0} ms", seconds * 1000.0)
    } else if seconds < 60.0 {
        format!("{seconds:.1} s")
    } else if seconds < 3600.0 {
        format!("{:.1} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

/// `HH:MM` of an RFC 3339 time.
fn clock(rfc3339: &str) -> &str {
    rfc3339.get(11..16).unwrap_or(rfc3339)
}

/// The frame common to both charts: the grid and its values (`top` the axis' top, `fmt` its
/// labels) and the time labels, one an hour.
fn frame(title: String, intervals: &[ThroughputInterval], top: f64, fmt: impl Fn(f64) -> String) -> Chart {
    let plot_height = HEIGHT - TOP - BOTTOM;
    let mut chart = Chart {
        width: WIDTH as u32,
        height: HEIGHT as u32,
        title,
        bars: Vec::new(),
        lines: Vec::new(),
        dots: Vec::new(),
        grid: Vec::new(),
        labels: Vec::new(),
        empty: None,
    };
    for step in 0..=2 {
        let value = top * f64::from(step) / 2.0;
        let y = TOP + plot_height * (1.0 - f64::from(step) / 2.0);
        chart.grid.push(Grid { y: n(y), x1: n(LEFT), x2: n(WIDTH - RIGHT) });
        chart.labels.push(Label {
            class: "axis",
            x: n(LEFT - 6.0),
            y: n(y + 3.0),
            anchor: "end",
            text: fmt(value),
        });
    }
    let slot = (WIDTH - LEFT - RIGHT) / intervals.len().max(1) as f64;
    for (i, interval) in intervals.iter().enumerate() {
        if i % 6 == 0 {
            chart.labels.push(Label {
                class: "axis",
                x: n(LEFT + slot * i as f64),
                y: n(HEIGHT - 8.0),
                anchor: "start",
                text: clock(&interval.start).to_owned(),
            });
        }
    }
    chart.labels.push(Label {
        class: "axis",
        x: n(WIDTH - RIGHT),
        y: n(HEIGHT - 8.0),
        anchor: "end",
        text: "UTC".to_owned(),
    });
    chart
}

/// Rows processed per interval, as bars.
fn throughput_chart(intervals: &[ThroughputInterval]) -> Chart {
    let most = intervals.iter().map(|i| i.processed).max().unwrap_or(0);
    let top = round_up(most as f64);
    let minutes = CHART_INTERVAL_SECONDS / 60.0;
    let mut chart = frame(
        format!("Rows processed per {minutes:.0} minutes over the last {} hours", hours()),
        intervals,
        top,
        |v| format!("{v:.0}"),
    );
    let plot_height = HEIGHT - TOP - BOTTOM;
    let slot = (WIDTH - LEFT - RIGHT) / intervals.len().max(1) as f64;
    for (i, interval) in intervals.iter().enumerate() {
        if interval.processed == 0 {
            continue;
        }
        let height = plot_height * interval.processed as f64 / top;
        chart.bars.push(Bar {
            x: n(LEFT + slot * i as f64 + 1.0),
            y: n(TOP + plot_height - height),
            width: n((slot - 2.0).max(1.0)),
            height: n(height),
            title: format!("{}: {} processed", interval.start, interval.processed),
        });
    }
    chart.labels.push(Label {
        class: "legend processed",
        x: n(LEFT),
        y: n(TOP - 8.0),
        anchor: "start",
        text: format!("processed per {minutes:.0} min"),
    });
    if most == 0 {
        chart.empty = Some("nothing processed in this window".to_owned());
    }
    chart
}

/// p50 and p95 of receipt → processed per interval, as two lines (broken where an interval has
/// no rows) with a dot per value.
fn latency_chart(intervals: &[ThroughputInterval]) -> Chart {
    let most = intervals.iter().filter_map(|i| i.p95_seconds.or(i.p50_seconds)).fold(0.0, f64::max);
    let top = round_up(most);
    let mut chart = frame(
        format!("Latency from receipt to processing (p50, p95) over the last {} hours", hours()),
        intervals,
        top,
        latency_text,
    );
    let plot_height = HEIGHT - TOP - BOTTOM;
    let slot = (WIDTH - LEFT - RIGHT) / intervals.len().max(1) as f64;
    for (class, value) in [
        ("p95", (|i: &ThroughputInterval| i.p95_seconds) as fn(&ThroughputInterval) -> Option<f64>),
        ("p50", |i: &ThroughputInterval| i.p50_seconds),
    ] {
        let mut run: Vec<String> = Vec::new();
        for (i, interval) in intervals.iter().enumerate() {
            match value(interval) {
                Some(v) => {
                    let (x, y) =
                        (LEFT + slot * (i as f64 + 0.5), TOP + plot_height * (1.0 - (v / top).min(1.0)));
                    run.push(format!("{},{}", n(x), n(y)));
                    chart.dots.push(Dot {
                        class,
                        cx: n(x),
                        cy: n(y),
                        title: format!("{}: {class} {}", interval.start, latency_text(v)),
                    });
                }
                None => {
                    if run.len() > 1 {
                        chart.lines.push(Line { class, points: run.join(" ") });
                    }
                    run.clear();
                }
            }
        }
        if run.len() > 1 {
            chart.lines.push(Line { class, points: run.join(" ") });
        }
    }
    chart.labels.push(Label {
        class: "legend p50",
        x: n(LEFT),
        y: n(TOP - 8.0),
        anchor: "start",
        text: "p50".into(),
    });
    chart.labels.push(Label {
        class: "legend p95",
        x: n(LEFT + 40.0),
        y: n(TOP - 8.0),
        anchor: "start",
        text: "p95".into(),
    });
    if chart.dots.is_empty() {
        chart.empty = Some("nothing processed in this window".to_owned());
    }
    chart
}

fn hours() -> f64 {
    CHART_INTERVAL_SECONDS * f64::from(CHART_INTERVALS) / 3600.0
}

// --------------------------------------------------------------------------- needs review

/// The filters of the needs-review list as the form sends them (query parameters of the page, and
/// the fields of the "requeue the filtered set" form); empty is "any".
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ReviewFilterForm {
    /// The event type, exactly.
    #[serde(rename = "type", default)]
    pub event_type: Option<String>,
    #[serde(default)]
    pub endpoint: Option<String>,
    /// `unstorable`, `livemode`, `any`, `none`; empty for all.
    #[serde(default)]
    pub held: Option<String>,
    /// Text the last error contains (any case).
    #[serde(default)]
    pub error: Option<String>,
    /// An age (`2h`, `30m`, `1d`): received longer ago than that.
    #[serde(default)]
    pub older_than: Option<String>,
    #[serde(default)]
    pub account: Option<String>,
}

/// A form field: trimmed, None when empty.
fn field(value: &Option<String>) -> Option<String> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned)
}

impl ReviewFilterForm {
    /// The store's filter, or what is wrong with a field.
    pub fn parse(&self) -> Result<ReviewFilter, String> {
        let held = match field(&self.held).as_deref() {
            None | Some("all") => None,
            Some(name) => Some(
                HeldFilter::parse(name)
                    .ok_or_else(|| format!("held: {name:?} is not one of unstorable, livemode, any, none"))?,
            ),
        };
        let older_than_seconds = match field(&self.older_than) {
            None => None,
            Some(text) => Some(
                parse_duration(&text)
                    .map_err(|e| format!("older than: {text:?} is not an age: {e}"))?
                    .as_secs_f64(),
            ),
        };
        Ok(ReviewFilter {
            event_type: field(&self.event_type),
            endpoint: field(&self.endpoint),
            held,
            error_contains: field(&self.error),
            older_than_seconds,
            account: field(&self.account),
        })
    }

    /// The fields as the form shows them again (trimmed; empty when not set).
    fn values(&self) -> FilterValues {
        let text = |v: &Option<String>| field(v).unwrap_or_default();
        FilterValues {
            event_type: text(&self.event_type),
            endpoint: text(&self.endpoint),
            held: text(&self.held),
            error: text(&self.error),
            older_than: text(&self.older_than),
            account: text(&self.account),
        }
    }
}

/// The filters as the page shows them (in the form, in the pager's links, in the requeue form).
struct FilterValues {
    event_type: String,
    endpoint: String,
    held: String,
    error: String,
    older_than: String,
    account: String,
}

impl FilterValues {
    /// The list's URL with these filters, at `page`.
    fn href(&self, page: i64) -> String {
        let page = if page > 1 { page.to_string() } else { String::new() };
        href(
            "/needs-review",
            &[
                ("type", &self.event_type),
                ("endpoint", &self.endpoint),
                ("held", &self.held),
                ("error", &self.error),
                ("older_than", &self.older_than),
                ("account", &self.account),
                ("page", &page),
            ],
        )
    }
}

/// An option of the `held` select.
struct Choice {
    value: &'static str,
    label: &'static str,
    selected: bool,
}

/// A parked row as the list shows it.
struct ReviewLine {
    endpoint: String,
    event_id: String,
    href: String,
    event_type: String,
    attempts: i32,
    held: String,
    last_error: String,
    received_at: String,
    account: String,
}

#[derive(Template)]
#[template(path = "console/needs_review.html")]
struct NeedsReview {
    operator: Operator,
    notice: Option<String>,
    filters: FilterValues,
    held_choices: Vec<Choice>,
    /// A filter that could not be read: nothing is listed.
    invalid: Option<String>,
    rows: Vec<ReviewLine>,
    /// Rows matching the filters, and those of them not held on arrival (what a requeue takes).
    matching: i64,
    not_held: i64,
    page: i64,
    pages: i64,
    /// Positions (1-based) of the first and last row shown.
    first: i64,
    last: i64,
    prev: Option<String>,
    next: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct PageQuery {
    #[serde(default)]
    page: Option<String>,
}

async fn needs_review(
    operator: Operator,
    console: web::Data<Console>,
    form: web::Query<ReviewFilterForm>,
    paging: web::Query<PageQuery>,
    query: web::Query<NoticeQuery>,
) -> Page {
    let filters = form.values();
    let held_choices = [
        ("", "all"),
        ("none", "not held (parked by a worker)"),
        ("any", "held, any reason"),
        ("livemode", "held: livemode"),
        ("unstorable", "held: unstorable"),
    ]
    .into_iter()
    .map(|(value, label)| Choice { value, label, selected: filters.held == value })
    .collect();
    let mut page = NeedsReview {
        operator: operator.clone(),
        notice: query.notice(),
        filters,
        held_choices,
        invalid: None,
        rows: Vec::new(),
        matching: 0,
        not_held: 0,
        page: page_number(paging.page.as_deref()),
        pages: 1,
        first: 0,
        last: 0,
        prev: None,
        next: None,
    };
    let filter = match form.parse() {
        Ok(filter) => filter,
        Err(why) => {
            page.invalid = Some(why);
            return Ok(super::render(&page, StatusCode::BAD_REQUEST));
        }
    };
    let mut conn = connection(&console, &operator).await?;
    let tx = begin(&mut conn, &operator).await?;
    let offset = (page.page - 1) * PAGE_SIZE;
    // Both on the one connection, sent together.
    let (count, rows) = tokio::join!(
        queries::review_count(&*tx, &filter),
        queries::review_page(&*tx, &filter, PAGE_SIZE, offset)
    );
    let count = count.map_err(db(&operator, "counting the parked rows"))?;
    let rows = rows.map_err(db(&operator, "listing the parked rows"))?;
    tx.commit().await.map_err(db(&operator, "ending the read"))?;

    page.matching = count.matching;
    page.not_held = count.not_held;
    page.pages = ((count.matching + PAGE_SIZE - 1) / PAGE_SIZE).max(1);
    if !rows.is_empty() {
        page.first = offset + 1;
        page.last = offset + rows.len() as i64;
    }
    if page.page > 1 {
        page.prev = Some(page.filters.href((page.page - 1).min(page.pages)));
    }
    if offset + (rows.len() as i64) < count.matching {
        page.next = Some(page.filters.href(page.page + 1));
    }
    page.rows = rows
        .into_iter()
        .map(|r| ReviewLine {
            href: event_href(&r.endpoint, &r.event_id),
            held: or_dash(r.held),
            last_error: or_dash(r.last_error),
            account: or_dash(r.account),
            endpoint: r.endpoint,
            event_id: r.event_id,
            event_type: r.event_type,
            attempts: r.attempts,
            received_at: r.received_at,
        })
        .collect();
    ok(&page)
}

// ------------------------------------------------------------------------------ one event

/// A line of the detail list.
struct Fact {
    /// The `<dd>`'s id, when the page has one for it.
    id: &'static str,
    label: &'static str,
    value: String,
}

/// An audit record as the pages show it.
struct AuditLine {
    id: i64,
    at: String,
    actor: String,
    action: String,
    /// The target as compact JSON text.
    target: String,
    affected: i32,
}

impl From<queries::AuditRecord> for AuditLine {
    fn from(r: queries::AuditRecord) -> Self {
        AuditLine {
            id: r.id,
            at: r.at,
            actor: r.actor,
            action: r.action,
            target: serde_json::to_string(&r.target).unwrap_or_default(),
            affected: r.affected,
        }
    }
}

/// The raw body shown of an unstorable row, at most.
const RAW_BODY_SHOWN: usize = 64 * 1024;

#[derive(Template)]
#[template(path = "console/event.html")]
struct EventPage {
    operator: Operator,
    notice: Option<String>,
    endpoint: String,
    event_id: String,
    event_type: String,
    facts: Vec<Fact>,
    /// The payload, pretty-printed; for an unstorable row, the bytes as received (lossy UTF-8).
    payload: String,
    /// Said above the payload of an unstorable row.
    raw_note: Option<String>,
    audit: Vec<AuditLine>,
    can_requeue: bool,
    can_release: bool,
    can_replay: bool,
    can_dismiss: bool,
}

async fn event(
    operator: Operator,
    console: web::Data<Console>,
    path: web::Path<(String, String)>,
    query: web::Query<NoticeQuery>,
) -> Page {
    let (endpoint, event_id) = path.into_inner();
    let mut conn = connection(&console, &operator).await?;
    let tx = begin(&mut conn, &operator).await?;
    let row = queries::event(&*tx, &endpoint, &event_id).await.map_err(db(&operator, "reading the event"))?;
    let audit = queries::event_audit(&*tx, &endpoint, &event_id)
        .await
        .map_err(db(&operator, "reading the event's audit records"))?;
    tx.commit().await.map_err(db(&operator, "ending the read"))?;
    let Some(e) = row else {
        return Err(PageError::new(
            &operator,
            StatusCode::NOT_FOUND,
            format!("no event {event_id} for endpoint {endpoint} in the inbox (purged, or never received)"),
        ));
    };

    let processed = e.processed_at.is_some();
    let parked = e.parked_at.is_some();
    let held = e.held.as_deref();
    let (payload, raw_note) = match (&e.payload, &e.raw_body) {
        (Some(payload), _) => (serde_json::to_string_pretty(payload).unwrap_or_default(), None),
        (None, raw) => {
            let bytes = raw.as_deref().unwrap_or_default();
            let shown = &bytes[..bytes.len().min(RAW_BODY_SHOWN)];
            let mut note = format!(
                "Held as unstorable: PostgreSQL's jsonb refused this body, so the row has no payload and \
                 no worker can apply it. The bytes as received are kept ({} bytes); shown below as text{}. \
                 `inbox-worker verify --event-id {event_id} --endpoint {endpoint}` checks their signature.",
                bytes.len(),
                if shown.len() < bytes.len() { ", the first 64 KiB" } else { "" },
            );
            if raw.is_none() {
                note = "The row has no payload and no raw body.".to_owned();
            }
            (String::from_utf8_lossy(shown).into_owned(), Some(note))
        }
    };
    let provenance = {
        let mut parts = vec![format!("source {}", e.source)];
        match (e.secret_position, &e.secret_fingerprint) {
            (Some(position), Some(fingerprint)) => {
                parts.push(format!("verified by secret #{position} (fingerprint {fingerprint})"))
            }
            _ => parts.push("no signing secret recorded".to_owned()),
        }
        if let Some(t) = e.signature_t {
            parts.push(format!("signature t={t} ({})", e.signed_at.clone().unwrap_or_default()));
        }
        if let Some(bytes) = e.raw_body_bytes {
            parts.push(format!("raw body kept ({bytes} bytes)"));
        }
        parts.join("; ")
    };
    let facts = vec![
        Fact { id: "provider", label: "provider", value: e.provider.clone() },
        Fact { id: "endpoint", label: "endpoint", value: e.endpoint.clone() },
        Fact { id: "event-id", label: "event id", value: e.event_id.clone() },
        Fact { id: "event-type", label: "type", value: e.event_type.clone() },
        Fact { id: "received-at", label: "received at", value: e.received_at.clone() },
        Fact { id: "available-at", label: "available at", value: e.available_at.clone() },
        Fact {
            id: "attempts",
            label: "attempts",
            value: if e.interruptions > 0 {
                format!("{} ({} interrupted in a row)", e.attempts, e.interruptions)
            } else {
                e.attempts.to_string()
            },
        },
        Fact { id: "processed-at", label: "processed at", value: or_dash(e.processed_at.clone()) },
        Fact { id: "parked-at", label: "parked at", value: or_dash(e.parked_at.clone()) },
        Fact { id: "held", label: "held", value: or_dash(e.held.clone()) },
        Fact { id: "dismissed-at", label: "dismissed", value: or_dash(e.dismissed_at.clone()) },
        Fact { id: "last-error", label: "last error", value: or_dash(e.last_error.clone()) },
        Fact { id: "provenance", label: "provenance", value: provenance },
        Fact { id: "livemode", label: "livemode", value: or_dash(e.livemode) },
        Fact { id: "account", label: "account", value: or_dash(e.account.clone()) },
        Fact { id: "api-version", label: "api_version", value: or_dash(e.api_version.clone()) },
    ];
    ok(&EventPage {
        notice: query.notice(),
        facts,
        payload,
        raw_note,
        audit: audit.into_iter().map(AuditLine::from).collect(),
        can_requeue: !processed && parked && held != Some("unstorable"),
        can_release: !processed && held == Some("livemode"),
        can_replay: processed && e.payload.is_some(),
        can_dismiss: !processed && (parked || held.is_some()),
        endpoint: e.endpoint,
        event_id: e.event_id,
        event_type: e.event_type,
        operator,
    })
}

// ---------------------------------------------------------------------------------- outbox

/// A parked outbox row as the page shows it.
struct OutboxLine {
    id: i64,
    aggregate: String,
    event_type: String,
    attempts: i32,
    last_error: String,
    held_behind: i64,
    created_at: String,
    parked_at: String,
}

#[derive(Template)]
#[template(path = "console/outbox.html")]
struct OutboxPage {
    operator: Operator,
    notice: Option<String>,
    pending: i64,
    parked: i64,
    blocked_aggregates: i64,
    blocked_rows: i64,
    oldest_pending: String,
    rows: Vec<OutboxLine>,
    /// The list stopped at [`LIST_LIMIT`].
    cut: bool,
}

async fn outbox_page(
    operator: Operator,
    console: web::Data<Console>,
    query: web::Query<NoticeQuery>,
) -> Page {
    let mut conn = connection(&console, &operator).await?;
    let tx = begin(&mut conn, &operator).await?;
    let stats = outbox::stats(&*tx).await.map_err(db(&operator, "reading the outbox statistics"))?;
    let rows = outbox::parked_rows(&*tx, LIST_LIMIT)
        .await
        .map_err(db(&operator, "listing the parked outbox rows"))?;
    tx.commit().await.map_err(db(&operator, "ending the read"))?;
    ok(&OutboxPage {
        notice: query.notice(),
        pending: stats.pending,
        parked: stats.parked,
        blocked_aggregates: stats.blocked_aggregates,
        blocked_rows: stats.blocked_rows,
        oldest_pending: stats.oldest_pending_age_seconds.map_or_else(|| "—".to_owned(), age),
        cut: rows.len() as i64 == LIST_LIMIT,
        rows: rows
            .into_iter()
            .map(|r| OutboxLine {
                id: r.id,
                aggregate: format!("{} {}", r.aggregate_type, r.aggregate_id),
                event_type: r.event_type,
                attempts: r.attempts,
                last_error: or_dash(r.last_error),
                held_behind: r.held_behind,
                created_at: r.created_at,
                parked_at: r.parked_at,
            })
            .collect(),
        operator,
    })
}

// -------------------------------------------------------------------------- reconciliation

/// A reconciliation item as the page shows it.
struct ItemLine {
    id: i64,
    created_at: String,
    reason: String,
    invoice_id: String,
    object: String,
    event_id: String,
    /// The event's page, when the item's detail names its endpoint.
    event_href: Option<String>,
    /// The detail as compact JSON text.
    detail: String,
    open: bool,
    resolution: String,
}

#[derive(Template)]
#[template(path = "console/reconciliation.html")]
struct ReconciliationPage {
    operator: Operator,
    notice: Option<String>,
    all: bool,
    items: Vec<ItemLine>,
    cut: bool,
}

#[derive(Debug, Default, Deserialize)]
struct AllQuery {
    #[serde(default)]
    all: Option<String>,
}

async fn reconciliation_page(
    operator: Operator,
    console: web::Data<Console>,
    all: web::Query<AllQuery>,
    query: web::Query<NoticeQuery>,
) -> Page {
    let all = all.all.as_deref().is_some_and(|a| matches!(a.trim(), "1" | "true" | "yes" | "on"));
    let mut conn = connection(&console, &operator).await?;
    let tx = begin(&mut conn, &operator).await?;
    let items = reconciliation::list(&*tx, all, LIST_LIMIT)
        .await
        .map_err(db(&operator, "listing the reconciliation items"))?;
    tx.commit().await.map_err(db(&operator, "ending the read"))?;
    ok(&ReconciliationPage {
        notice: query.notice(),
        all,
        cut: items.len() as i64 == LIST_LIMIT,
        items: items
            .into_iter()
            .map(|item| ItemLine {
                event_href: item
                    .detail
                    .get("endpoint")
                    .and_then(|v| v.as_str())
                    .map(|e| event_href(e, &item.event_id)),
                id: item.id,
                created_at: item.created_at,
                reason: item.reason,
                invoice_id: or_dash(item.invoice_id),
                object: match (&item.object_type, &item.object_id) {
                    (Some(t), Some(id)) => format!("{t} {id}"),
                    (None, Some(id)) => id.clone(),
                    _ => "—".to_owned(),
                },
                event_id: item.event_id,
                detail: serde_json::to_string(&item.detail).unwrap_or_default(),
                open: item.resolved_at.is_none(),
                resolution: match (&item.resolved_at, &item.resolved_by, &item.resolution_note) {
                    (Some(at), by, note) => format!(
                        "resolved {at} by {}: {}",
                        by.as_deref().unwrap_or("?"),
                        note.as_deref().unwrap_or("")
                    ),
                    _ => "open".to_owned(),
                },
            })
            .collect(),
        operator,
    })
}

// ----------------------------------------------------------------------------------- audit

#[derive(Template)]
#[template(path = "console/audit.html")]
struct AuditPage {
    operator: Operator,
    notice: Option<String>,
    records: Vec<AuditLine>,
    total: i64,
    page: i64,
    pages: i64,
    prev: Option<String>,
    next: Option<String>,
}

async fn audit(
    operator: Operator,
    console: web::Data<Console>,
    paging: web::Query<PageQuery>,
    query: web::Query<NoticeQuery>,
) -> Page {
    let page = page_number(paging.page.as_deref());
    let offset = (page - 1) * PAGE_SIZE;
    let mut conn = connection(&console, &operator).await?;
    let tx = begin(&mut conn, &operator).await?;
    let (total, records) =
        tokio::join!(queries::audit_count(&*tx), queries::audit_page(&*tx, PAGE_SIZE, offset));
    let total = total.map_err(db(&operator, "counting the audit records"))?;
    let records = records.map_err(db(&operator, "reading the audit log"))?;
    tx.commit().await.map_err(db(&operator, "ending the read"))?;
    let pages = ((total + PAGE_SIZE - 1) / PAGE_SIZE).max(1);
    let at = |p: i64| href("/audit", &[("page", &if p > 1 { p.to_string() } else { String::new() })]);
    ok(&AuditPage {
        notice: query.notice(),
        prev: (page > 1).then(|| at((page - 1).min(pages))),
        next: (offset + (records.len() as i64) < total).then(|| at(page + 1)),
        records: records.into_iter().map(AuditLine::from).collect(),
        total,
        page,
        pages,
        operator,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_and_query_values_are_percent_encoded() {
        assert_eq!(event_href("billing", "evt_1"), "/events/billing/evt_1");
        assert_eq!(event_href("a/b c", "evt_é?#"), "/events/a%2Fb%20c/evt_%C3%A9%3F%23");
        assert_eq!(
            href("/needs-review", &[("type", "invoice.paid"), ("error", ""), ("page", "2")]),
            "/needs-review?type=invoice.paid&page=2"
        );
        assert_eq!(href("/audit", &[("page", "")]), "/audit");
    }

    #[test]
    fn the_filters_read_empty_fields_as_any_and_refuse_what_they_cannot_read() {
        let form = ReviewFilterForm {
            event_type: Some(" invoice.paid ".into()),
            held: Some("".into()),
            older_than: Some("2h".into()),
            error: Some("   ".into()),
            ..ReviewFilterForm::default()
        };
        let filter = form.parse().unwrap();
        assert_eq!(filter.event_type.as_deref(), Some("invoice.paid"));
        assert_eq!(filter.held, None);
        assert_eq!(filter.error_contains, None);
        assert_eq!(filter.older_than_seconds, Some(7200.0));
        let bad = ReviewFilterForm { older_than: Some("soon".into()), ..ReviewFilterForm::default() };
        assert!(bad.parse().unwrap_err().starts_with("older than"));
        let bad = ReviewFilterForm { held: Some("maybe".into()), ..ReviewFilterForm::default() };
        assert!(bad.parse().unwrap_err().starts_with("held"));
        let any = ReviewFilterForm { held: Some("any".into()), ..ReviewFilterForm::default() };
        assert_eq!(any.parse().unwrap().held, Some(HeldFilter::Any));
    }

    #[test]
    fn page_numbers_start_at_one_whatever_the_query_says() {
        assert_eq!(page_number(None), 1);
        assert_eq!(page_number(Some("3")), 3);
        assert_eq!(page_number(Some("0")), 1);
        assert_eq!(page_number(Some("-2")), 1);
        assert_eq!(page_number(Some("x")), 1);
    }

    #[test]
    fn ages_show_their_two_largest_units() {
        assert_eq!(age(-1.0), "0s");
        assert_eq!(age(42.9), "42s");
        assert_eq!(age(750.0), "12m 30s");
        assert_eq!(age(5.0 * 3600.0 + 720.0), "5h 12m");
        assert_eq!(age(3.0 * 86400.0 + 4.0 * 3600.0 + 59.0), "3d 4h");
    }

    #[test]
    fn axis_tops_are_round() {
        assert_eq!(round_up(0.0), 1.0);
        assert_eq!(round_up(3.0), 5.0);
        assert_eq!(round_up(10.0), 10.0);
        assert_eq!(round_up(11.0), 20.0);
        assert_eq!(round_up(0.3), 0.5);
    }

    #[test]
    fn the_charts_draw_a_bar_per_busy_interval_and_break_the_lines_at_empty_ones() {
        let at = |i: usize, processed: i64, p: Option<f64>| ThroughputInterval {
            start: format!("2024-01-01T{:02}:{:02}:00.000Z", i / 6, (i % 6) * 10),
            processed,
            p50_seconds: p,
            p95_seconds: p.map(|v| v * 2.0),
        };
        let intervals = vec![
            at(0, 3, Some(1.0)),
            at(1, 5, Some(2.0)),
            at(2, 0, None),
            at(3, 1, Some(0.5)),
            at(4, 2, Some(1.0)),
        ];
        let throughput = throughput_chart(&intervals);
        assert_eq!(throughput.bars.len(), 4);
        assert!(throughput.empty.is_none());
        let latency = latency_chart(&intervals);
        assert_eq!(latency.lines.len(), 4, "two runs for each of p50 and p95");
        assert_eq!(latency.dots.len(), 8);
        let nothing = latency_chart(&[at(0, 0, None)]);
        assert!(nothing.empty.is_some() && nothing.lines.is_empty());
    }
}
