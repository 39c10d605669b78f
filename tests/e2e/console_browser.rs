//! The operator console (`inbox-worker console`, a process) driven by headless Chromium through
//! chromedriver, the way an operator uses it: sign in, find a parked row, requeue it and watch a
//! worker process it; what a read-only user sees and may not do; forms without their CSRF token;
//! a payload carrying HTML; and every page rendered (saved as PNGs when `CONSOLE_SCREENSHOTS=DIR`
//! is set: `make console-screenshots` writes docs/console/: login, overview, needs-review, event,
//! dry-run, outbox, reconciliation, confirm (a filtered requeue's confirmation) and audit).
//!
//! Without Chromium and chromedriver (`make deps` installs them) each test says so and returns; in
//! CI (`CI` set) it fails instead.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use inbox_test_support::browser::Browser;
use inbox_test_support::console::{
    console_command, http_client, seed_showcase, sign_in, start_console, UsersFile, PASSWORD, SESSION_COOKIE,
};
use inbox_test_support::db::column;
use inbox_test_support::process::{command, Proc};
use inbox_test_support::TestDb;
use serde_json::json;
use tokio_postgres::Client;

/// How long a worker has to process a requeued row.
const PROCESSED_WITHIN: Duration = Duration::from_secs(60);

/// The forms of the event page, none of which a read-only user may see.
const ACTION_FORMS: [&str; 5] =
    ["#requeue-form", "#release-form", "#replay-form", "#replay-dry-run-form", "#dismiss-form"];

/// An `invoice.paid` row a worker parked a minute ago after 10 attempts, with `error`; its invoice
/// object also carries `description`.
async fn seed_parked(client: &Client, event_id: &str, error: &str, description: &str) {
    let payload = json!({
        "id": event_id, "object": "event", "type": "invoice.paid", "livemode": true,
        "data": {"object": {
            "id": format!("in_{event_id}"), "object": "invoice", "customer": "cus_console",
            "amount_paid": 4900, "currency": "eur", "description": description,
        }},
    });
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, last_error, parked_at)
             VALUES ('stripe', 'billing', $1, 'invoice.paid', $2, now() - interval '2 hours',
                     now() - interval '1 minute', 10, $3, now() - interval '1 minute')",
            &[&event_id, &payload, &error],
        )
        .await
        .expect("seeding a parked row");
}

/// (attempts, parked, processed) of a row of `billing`.
async fn row_state(client: &Client, event_id: &str) -> (i32, bool, bool) {
    let row = client
        .query_one(
            "SELECT attempts, parked_at IS NOT NULL, processed_at IS NOT NULL
               FROM webhook_inbox WHERE endpoint = 'billing' AND event_id = $1",
            &[&event_id],
        )
        .await
        .expect("the row");
    (row.get(0), row.get(1), row.get(2))
}

async fn audit_count(client: &Client) -> i64 {
    client.query_one("SELECT count(*) FROM operator_audit", &[]).await.unwrap().get(0)
}

/// The console on `db` for `users`, started as a process; returns it with its base URL.
async fn console(db: &TestDb, users: &UsersFile) -> (Proc, String) {
    let cmd = console_command(&db.url(), users);
    tokio::task::spawn_blocking(move || start_console(cmd)).await.unwrap()
}

/// The event page of a `billing` row.
fn event_url(base: &str, event_id: &str) -> String {
    format!("{base}/events/billing/{event_id}")
}

/// The cells of each body row of the table `css`, as text.
async fn table_rows(browser: &Browser, css: &str) -> Vec<Vec<String>> {
    let rows = browser
        .execute(&format!(
            "return Array.from(document.querySelectorAll({:?})).map(tr =>
                 Array.from(tr.cells).map(td => td.textContent.trim()));",
            format!("{css} tbody tr")
        ))
        .await;
    serde_json::from_value(rows).expect("rows of cells")
}

/// The (name, value) of every input of the form `css`.
async fn form_fields(browser: &Browser, css: &str) -> Vec<(String, String)> {
    let fields = browser
        .execute(&format!(
            "return Array.from(document.querySelectorAll({:?})).map(i => [i.name, i.value]);",
            format!("{css} input")
        ))
        .await;
    serde_json::from_value(fields).expect("form fields")
}

/// POSTs `fields` to `base` + `path` with the session cookie `cookie` (no browser, no Origin: a
/// forger's script); returns the status and the body.
async fn post(base: &str, path: &str, cookie: &str, fields: &[(String, String)]) -> (u16, String) {
    let response = http_client()
        .post(format!("{base}{path}"))
        .header(reqwest::header::COOKIE, format!("{SESSION_COOKIE}={cookie}"))
        .form(fields)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_signs_in_requeues_a_parked_row_a_worker_processes_it_and_the_audit_names_her() {
    let Some(browser) = Browser::start().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, "evt_console_requeue", "database: deadlock detected (40P01)", "Pro plan").await;
    let users = UsersFile::new(&[("alice", false)]);
    let (_console, base) = console(&db, &users).await;

    browser.sign_in(&base, "alice", PASSWORD).await;
    assert_eq!(browser.path().await, "/");
    browser.goto(&format!("{base}/needs-review")).await;
    let row = "#needs-review tr[data-event-id='evt_console_requeue'][data-endpoint='billing']";
    assert!(browser.text(row).await.contains("deadlock detected"), "the parked row and its error");
    assert_eq!(browser.text("#match-count").await, "1");
    browser.click(&format!("{row} a[href='/events/billing/evt_console_requeue']")).await;
    browser.wait_for_path("/events/billing/evt_console_requeue", Duration::from_secs(15)).await;
    assert_eq!(browser.text("#processed-at").await, "—", "not processed yet");
    assert!(browser.text("#payload").await.contains("\"in_evt_console_requeue\""));

    browser.click("#requeue-form button[type=submit]").await;
    let notice = browser.wait_for("#notice", Duration::from_secs(15)).await.text().await.unwrap();
    assert!(notice.to_lowercase().contains("requeue"), "{notice}");
    assert_eq!(row_state(&client, "evt_console_requeue").await, (0, false, false), "requeued, not processed");

    // A worker, as operators run it, picks the row up.
    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms"]);
    let _worker = Proc::spawn(worker);
    let deadline = Instant::now() + PROCESSED_WITHIN;
    let processed_at = loop {
        browser.goto(&event_url(&base, "evt_console_requeue")).await;
        let shown = browser.text("#processed-at").await;
        if shown != "—" {
            break shown;
        }
        assert!(Instant::now() < deadline, "not processed within {PROCESSED_WITHIN:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(processed_at.chars().any(|c| c.is_ascii_digit()), "a time: {processed_at}");
    assert!(row_state(&client, "evt_console_requeue").await.2, "processed in the database too");

    let history = table_rows(&browser, "#audit-history").await;
    assert!(
        history.iter().any(|cells| cells.get(1..4) == Some(&["alice".into(), "requeue".into(), "1".into()])),
        "the audit history names alice's requeue: {history:?}"
    );
    let actor: String = client
        .query_one("SELECT actor FROM operator_audit WHERE action = 'requeue'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(actor, "alice");
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_user_sees_no_action_and_a_post_forged_from_their_session_is_refused() {
    let Some(browser) = Browser::start().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, "evt_console_ro", "database: deadlock detected (40P01)", "Pro plan").await;
    client
        .batch_execute(
            "INSERT INTO reconciliation_items (invoice_id, event_id, reason, detail)
             VALUES ('in_void', 'evt_void_paid', 'payment_on_void_invoice', '{\"amount_paid\": 100}')",
        )
        .await
        .unwrap();
    let users = UsersFile::new(&[("alice", false), ("bob", true)]);
    let (_console, base) = console(&db, &users).await;

    // What a forger would send: the fields of the requeue form as an operator who may act sees it.
    browser.sign_in(&base, "alice", PASSWORD).await;
    browser.goto(&event_url(&base, "evt_console_ro")).await;
    let requeue = form_fields(&browser, "#requeue-form").await;
    assert!(requeue.iter().any(|(name, _)| name == "csrf"), "{requeue:?}");
    browser.click("form.signout button[type=submit]").await;
    browser.wait_for_path("/login", Duration::from_secs(15)).await;

    browser.sign_in(&base, "bob", PASSWORD).await;
    browser.goto(&event_url(&base, "evt_console_ro")).await;
    assert!(browser.page_text().await.contains("bob (read-only)"));
    for form in ACTION_FORMS {
        assert!(!browser.exists(form).await, "{form} is shown to a read-only user");
    }
    assert!(!browser.exists("form[action^='/actions/']").await, "no action form at all");
    assert_eq!(browser.text("#processed-at").await, "—");
    browser.goto(&format!("{base}/needs-review")).await;
    assert!(browser.exists("#needs-review tr[data-event-id='evt_console_ro']").await);
    assert!(!browser.exists("#requeue-filtered-form").await);
    browser.goto(&format!("{base}/reconciliation")).await;
    assert!(!browser.exists("form[id^='resolve-form-']").await);

    // bob's own session and token on alice's form: refused for who he is.
    let csrf = browser.find("form.signout input[name=csrf]").await.attr("value").await.unwrap().unwrap();
    let cookie = browser.cookie(SESSION_COOKIE).await;
    let forged: Vec<(String, String)> = requeue
        .iter()
        .map(|(name, value)| (name.clone(), if name == "csrf" { csrf.clone() } else { value.clone() }))
        .collect();
    let (status, body) = post(&base, "/actions/requeue", &cookie, &forged).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("read-only"), "{body}");
    // Every other action too, each with the fields it takes.
    let with = |extra: &[(&str, &str)]| -> Vec<(String, String)> {
        let mut fields = vec![
            ("csrf".to_owned(), csrf.clone()),
            ("endpoint".to_owned(), "billing".to_owned()),
            ("event_id".to_owned(), "evt_console_ro".to_owned()),
        ];
        fields.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        fields
    };
    for (path, fields) in [
        ("/actions/release", with(&[])),
        ("/actions/dismiss", with(&[("reason", "forged")])),
        ("/actions/replay", with(&[])),
        ("/actions/replay-dry-run", with(&[])),
        ("/actions/requeue-filtered", with(&[("type", ""), ("held", ""), ("error", ""), ("confirm", "1")])),
        ("/actions/resolve", with(&[("id", "1"), ("note", "forged")])),
    ] {
        let (status, body) = post(&base, path, &cookie, &fields).await;
        assert_eq!(status, 403, "POST {path} by a read-only user: {body}");
    }
    assert_eq!(row_state(&client, "evt_console_ro").await, (10, true, false), "the row is untouched");
    let open: i64 = client
        .query_one("SELECT count(*) FROM reconciliation_items WHERE resolved_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, 1, "the item is still open");
    assert_eq!(audit_count(&client).await, 0, "nothing on record: nothing was done");
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_post_without_the_sessions_csrf_token_is_refused() {
    let Some(browser) = Browser::start().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, "evt_console_csrf", "database: deadlock detected (40P01)", "Pro plan").await;
    let users = UsersFile::new(&[("alice", false)]);
    let (_console, base) = console(&db, &users).await;
    browser.sign_in(&base, "alice", PASSWORD).await;
    browser.goto(&event_url(&base, "evt_console_csrf")).await;
    let fields = form_fields(&browser, "#requeue-form").await;
    let cookie = browser.cookie(SESSION_COOKIE).await;

    // Outside the browser, with alice's cookie: no token, an empty one, a made-up one, another
    // session's.
    let without: Vec<(String, String)> = fields.iter().filter(|(name, _)| name != "csrf").cloned().collect();
    let other_session = sign_in(&http_client(), &base, "alice").await.unwrap();
    let other_token = {
        let page = http_client()
            .get(event_url(&base, "evt_console_csrf"))
            .header(reqwest::header::COOKIE, &other_session)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + "name=\"csrf\" value=\"".len();
        page[at..at + page[at..].find('"').unwrap()].to_owned()
    };
    for token in [None, Some(String::new()), Some("bm90LWEtdG9rZW4".to_owned()), Some(other_token)] {
        let mut forged = without.clone();
        if let Some(token) = &token {
            forged.push(("csrf".into(), token.clone()));
        }
        let (status, body) = post(&base, "/actions/requeue", &cookie, &forged).await;
        assert_eq!(status, 403, "token {token:?}: {body}");
        assert!(body.contains("CSRF"), "{body}");
    }

    // In the browser: the page's own form, its token removed, submitted by a script.
    browser
        .execute(
            "const form = document.querySelector('#requeue-form');
             form.querySelector('input[name=csrf]').remove();
             form.submit();",
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = browser.page_text().await;
        if text.contains("403 Forbidden") {
            assert!(text.contains("CSRF"), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "no refusal shown:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(row_state(&client, "evt_console_csrf").await, (10, true, false), "the row is untouched");
    assert_eq!(audit_count(&client).await, 0);
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn html_in_a_payload_or_an_error_is_shown_as_text_and_never_runs() {
    let Some(browser) = Browser::start().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    let script = "<script>document.title='pwned';window.__injected=1;alert('xss')</script>";
    let description = format!("{script}<img src=x onerror=\"window.__injected=2\">");
    seed_parked(&client, "evt_console_xss", &format!("payload: bad {script}"), &description).await;
    let users = UsersFile::new(&[("alice", false)]);
    let (_console, base) = console(&db, &users).await;
    browser.sign_in(&base, "alice", PASSWORD).await;

    let injected = "return [document.querySelectorAll('script').length, document.querySelectorAll('pre script').length,
                            document.querySelectorAll('main img').length, typeof window.__injected, document.title];";
    for url in [format!("{base}/needs-review"), event_url(&base, "evt_console_xss")] {
        browser.goto(&url).await;
        assert!(browser.client.get_alert_text().await.is_err(), "an alert is open on {url}");
        let found = browser.execute(injected).await;
        let found = found.as_array().expect("an array");
        assert_eq!(found[..4], [json!(0), json!(0), json!(0), json!("undefined")], "{url}: {found:?}");
        assert_ne!(found[4], "pwned", "{url}");
        assert!(browser.page_text().await.contains(script), "{url} shows the markup as text");
    }
    let payload = browser.text("#payload").await;
    assert!(payload.contains("<script>document.title='pwned'"), "{payload}");
    assert!(payload.contains("<img src=x onerror="), "{payload}");
    browser.close().await;
}

/// Where `CONSOLE_SCREENSHOTS` says to save the pages' PNGs (relative to the workspace), if set.
fn screenshot_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("CONSOLE_SCREENSHOTS").filter(|d| !d.is_empty())?);
    Some(if dir.is_absolute() { dir } else { PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(dir) })
}

#[tokio::test(flavor = "multi_thread")]
async fn every_page_renders_with_a_days_data_and_a_filtered_requeue_asks_before_it_acts() {
    let shots = screenshot_dir();
    let Some(browser) = Browser::start().await else {
        assert!(shots.is_none(), "CONSOLE_SCREENSHOTS is set, but there is no browser to take them");
        return;
    };
    let shoot = |name: &'static str| {
        let shots = shots.clone();
        let browser = &browser;
        async move {
            if let Some(dir) = shots {
                browser.screenshot(&dir, name).await;
            }
        }
    };
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_showcase(&client, 600).await;
    let users = UsersFile::new(&[("alice", false)]);
    let (_console, base) = console(&db, &users).await;
    // A worker, as in production: it processes the queued rows, keeps the gauges and is listed.
    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "200ms"]);
    let _worker = Proc::spawn(worker);

    browser.goto(&format!("{base}/login")).await;
    assert!(browser.exists("input[name=user]").await && browser.exists("input[name=password]").await);
    shoot("login.png").await;
    browser.sign_in(&base, "alice", PASSWORD).await;

    // Overview: its cards and its chart, once the worker has counted the queue.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        browser.goto(&format!("{base}/")).await;
        let counted =
            browser.execute("return document.querySelector('#card-parked')?.dataset.value ?? null").await;
        let bars = browser.all("#throughput-chart rect").await.len();
        if counted == "12" && bars > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the overview never showed 12 parked rows ({counted}) and the chart's bars ({bars})"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(browser.exists("svg.chart#throughput-chart").await);
    shoot("overview.png").await;

    browser.goto(&format!("{base}/needs-review")).await;
    assert_eq!(browser.text("#match-count").await, "12");
    assert_eq!(browser.all("#needs-review tbody tr[data-event-id]").await.len(), 12);
    shoot("needs-review.png").await;

    let parked = "evt_1QPk8AL2eZvKYlo2x0Qm4R7t";
    browser.click(&format!("#needs-review tr[data-event-id='{parked}'] a")).await;
    browser.wait_for_path(&format!("/events/billing/{parked}"), Duration::from_secs(15)).await;
    assert_eq!(browser.text("#processed-at").await, "—");
    for form in ["#requeue-form", "#dismiss-form"] {
        assert!(browser.exists(form).await, "{form} on a parked row's page");
    }
    assert!(browser.exists("#audit-history").await);
    shoot("event.png").await;

    // A dry-run replay of a processed event: what the handler would change, nothing changed.
    let processed: String = client
        .query_one(
            "SELECT event_id FROM webhook_inbox WHERE endpoint = 'billing' AND event_type = 'invoice.paid'
                AND processed_at IS NOT NULL ORDER BY processed_at DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    browser.goto(&event_url(&base, &processed)).await;
    if browser.exists("#replay-dry-run-form").await {
        browser.click("#replay-dry-run-form button[type=submit]").await;
        browser.wait_for("main", Duration::from_secs(15)).await;
        assert!(!browser.page_text().await.contains("403 Forbidden"));
        shoot("dry-run.png").await;
    } else {
        eprintln!("no #replay-dry-run-form on {processed}'s page: no dry-run.png");
    }

    browser.goto(&format!("{base}/outbox")).await;
    assert!(browser.text("#outbox-parked-rows").await.contains("in_1QGoneZ9X7"));
    shoot("outbox.png").await;

    browser.goto(&format!("{base}/reconciliation")).await;
    let open: Vec<i64> =
        column(&client, "SELECT id FROM reconciliation_items WHERE resolved_at IS NULL ORDER BY id").await;
    assert_eq!(open.len(), 2);
    for id in &open {
        assert!(browser.exists(&format!("#resolve-form-{id}")).await, "#resolve-form-{id}");
    }
    shoot("reconciliation.png").await;
    // Resolving one, with a note.
    let form = format!("#resolve-form-{}", open[0]);
    browser
        .find(&format!("{form} input[name=note]"))
        .await
        .send_keys("refunded (re_3QBrowser)")
        .await
        .unwrap();
    browser.click(&format!("{form} button[type=submit]")).await;
    browser.wait_for("#notice", Duration::from_secs(15)).await;
    let resolved_by: Option<String> = client
        .query_one("SELECT resolved_by FROM reconciliation_items WHERE id = $1", &[&open[0]])
        .await
        .unwrap()
        .get(0);
    assert_eq!(resolved_by.as_deref(), Some("alice"));

    // A filtered requeue: the list, the confirmation with its count, then the requeue.
    browser.goto(&format!("{base}/needs-review?error=deadlock")).await;
    let matching = browser.text("#match-count").await;
    assert_eq!(matching, "3", "three rows parked on a deadlock");
    browser.click("#requeue-filtered-form button[type=submit]").await;
    assert_eq!(
        browser.wait_for("#confirm-count", Duration::from_secs(15)).await.text().await.unwrap(),
        matching
    );
    assert!(browser.exists("#confirm-form").await);
    shoot("confirm.png").await;
    let before: i64 = client
        .query_one("SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(before, 12, "nothing requeued before the confirmation");
    browser.click("#confirm-form button[type=submit]").await;
    browser.wait_for("#notice", Duration::from_secs(15)).await;
    let still_parked: i64 = client
        .query_one("SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(still_parked, 9);

    browser.goto(&format!("{base}/audit")).await;
    let log = table_rows(&browser, "#audit-log").await;
    let actions: Vec<(&str, &str)> =
        log.iter().filter_map(|cells| Some((cells.get(1)?.as_str(), cells.get(2)?.as_str()))).collect();
    assert!(actions.contains(&("alice", "requeue")), "{actions:?}");
    assert!(log.len() >= 5, "the seeded records and today's: {log:?}");
    shoot("audit.png").await;
    browser.close().await;
}
