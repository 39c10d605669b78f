//! console: the operator console's pages against a large needs-review list. `--console-parked`
//! parked rows (invoice payloads of about 1 KB, seven event types and errors, two endpoints) and
//! `--console-history` rows processed over the last 6 hours (what the overview's charts read);
//! one `inbox-worker console` process; one signed-in session over keep-alive HTTP; then
//! `--console-requests` sequential GETs of each page, timed from the request to the last byte of
//! the body: the needs-review list's first page, a filtered page (`type` and `error contains`), and
//! the overview. Median, p95 and max per page, and the first request's time apart (the overview's
//! charts are computed then, and kept 30 s by the process); the target is p95 under 300 ms.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use inbox_test_support::console::{http_client, seed_parked, sign_in, UsersFile};
use inbox_test_support::process::Proc;
use serde_json::json;

use crate::services::stop;
use crate::util::{r3, Percentiles};
use crate::Ctx;

/// The target of every page: p95 under this many milliseconds.
pub const TARGET_P95_MS: f64 = 300.0;

/// The pages timed: (name, path).
const PAGES: [(&str, &str); 3] = [
    ("needs_review", "/needs-review"),
    ("needs_review_filtered", "/needs-review?type=invoice.paid&error=deadlock"),
    ("overview", "/"),
];

pub async fn run(ctx: &Ctx) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db("console").await?;
    let result = measure(ctx, &db).await;
    ctx.server.drop_db(&db).await;
    result
}

async fn measure(ctx: &Ctx, db: &crate::pg::BenchDb) -> anyhow::Result<serde_json::Value> {
    let (parked, history, requests) =
        (ctx.args.console_parked, ctx.args.console_history, ctx.args.console_requests.max(1));
    ctx.migrate(&db.url).await?;
    let client = crate::pg::connect(&db.url).await?;
    ctx.say(&format!("console: seeding {parked} parked rows and {history} processed in the last 6 hours"));
    seed_parked(&client, parked as i64).await;
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, processed_at)
             SELECT 'stripe', 'billing', 'evt_hist_' || i, 'invoice.paid',
                    jsonb_build_object('id', 'evt_hist_' || i, 'type', 'invoice.paid', 'data',
                        jsonb_build_object('object', jsonb_build_object('id', 'in_hist_' || i,
                            'customer', 'cus_' || (i % 997), 'amount_paid', 2000 + i % 5000))),
                    at - (20 + i % 200) * interval '1 ms', at - (20 + i % 200) * interval '1 ms', 1, at
               FROM generate_series(1, $1::int8) AS i,
                    LATERAL (SELECT now() - interval '6 hours' + (i::float8 / $1) * interval '6 hours'
                                    - interval '1 s' AS at) AS t",
            &[&(history as i64)],
        )
        .await
        .context("seeding the processed history")?;
    client.batch_execute("VACUUM ANALYZE webhook_inbox").await?;

    let users = UsersFile::new(&[("bench", false)]);
    let (mut console, addr) = start_console(ctx, &db.url, &users).await?;
    let outcome = time_pages(ctx, addr, requests).await;
    let rss = crate::util::rss_kib(console.child.id());
    stop(&mut console, Duration::from_secs(10)).await;
    let mut pages = outcome?;
    let counted: i64 =
        client.query_one("SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL", &[]).await?.get(0);
    ensure!(counted == parked as i64, "{counted} parked rows, not {parked}");
    pages.insert("parked_rows".into(), json!(parked));
    pages.insert("history_rows".into(), json!(history));
    pages.insert("requests_per_page".into(), json!(requests));
    pages.insert("target_p95_ms".into(), json!(TARGET_P95_MS));
    pages.insert("console_peak_rss_kib".into(), json!(rss.map(|(_, peak)| peak)));
    Ok(serde_json::Value::Object(pages))
}

/// `inbox-worker console` on a free port of 127.0.0.1, once `/healthz` answers.
async fn start_console(ctx: &Ctx, url: &str, users: &UsersFile) -> anyhow::Result<(Proc, SocketAddr)> {
    let port = inbox_test_support::port::free();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut cmd = std::process::Command::new(ctx.bins.dir.join("inbox-worker"));
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd.env("LOG_FORMAT", "json")
        .env("RUST_LOG", "warn")
        .env("DATABASE_URL", url)
        .env("INBOX_CONSOLE_USERS_FILE", &users.path)
        .args(["console", "--listen", &addr.to_string()]);
    let mut proc = Proc::spawn(cmd);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = proc.child.try_wait()? {
            bail!("inbox-worker console exited at start-up ({status}):\n{}", proc.output());
        }
        if matches!(crate::http::get_status(addr, "/healthz").await, Ok(200)) {
            return Ok((proc, addr));
        }
        if Instant::now() > deadline {
            bail!("inbox-worker console did not answer /healthz within 30 s:\n{}", proc.output());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Signs in, then times `requests` GETs of each page (after 3 untimed ones).
async fn time_pages(
    ctx: &Ctx,
    addr: SocketAddr,
    requests: usize,
) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let base = format!("http://{addr}");
    let http = http_client();
    let cookie = sign_in(&http, &base, "bench").await?;
    let mut out = serde_json::Map::new();
    for (name, path) in PAGES {
        let get = || async {
            let started = Instant::now();
            let response =
                http.get(format!("{base}{path}")).header(reqwest::header::COOKIE, &cookie).send().await?;
            let status = response.status();
            let body = response.text().await?;
            let took = started.elapsed();
            ensure!(
                status == 200,
                "GET {path} answered {status}: {}",
                body.chars().take(300).collect::<String>()
            );
            Ok::<_, anyhow::Error>((took, body))
        };
        // The first request: the overview computes its charts (then kept for 30 s by the process).
        let (first, mut body) = get().await?;
        for _ in 0..2 {
            body = get().await?.1;
        }
        let mut micros = Vec::with_capacity(requests);
        for _ in 0..requests {
            micros.push(get().await?.0.as_micros().min(u128::from(u32::MAX)) as u32);
        }
        let p = Percentiles::of(micros.clone());
        micros.sort_unstable();
        let p95 =
            micros[((0.95 * micros.len() as f64).ceil() as usize).clamp(1, micros.len()) - 1] as f64 / 1e3;
        let matching = match_count(&body);
        ctx.say(&format!(
            "console: GET {path}: first {:.1} ms; then median {:.1} ms, p95 {p95:.1} ms, max {:.1} ms ({} \
             requests{}, {} KiB)",
            first.as_secs_f64() * 1e3,
            p.p50,
            p.max,
            p.count,
            matching.map_or(String::new(), |n| format!(", {n} matching rows")),
            body.len() / 1024
        ));
        out.insert(
            name.into(),
            json!({
                "path": path, "requests": p.count, "first_ms": r3(first.as_secs_f64() * 1e3),
                "median_ms": r3(p.p50), "p95_ms": r3(p95),
                "max_ms": r3(p.max), "mean_ms": r3(p.mean), "body_bytes": body.len(),
                "matching_rows": matching, "ok": p95 < TARGET_P95_MS,
            }),
        );
    }
    Ok(out)
}

/// The needs-review page's `<span id="match-count">N</span>`.
fn match_count(html: &str) -> Option<i64> {
    let at = html.find("id=\"match-count\">")? + "id=\"match-count\">".len();
    html[at..].split('<').next()?.trim().parse().ok()
}
