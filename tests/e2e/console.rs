//! The operator console's pages (`inbox-worker console`, a process) over HTTP, against rows seeded
//! with SQL: the overview's cards count what is there and its charts are drawn; the needs-review
//! list's filters narrow the list and its count, and its pages walk every parked row once, oldest
//! first; an event's page shows its state, its payload escaped and its audit history, with the
//! forms of the actions that apply to it (none for a read-only user); the outbox, reconciliation
//! and audit pages list their rows; a database error is a 500 page saying what failed; and no
//! page is served without a session. The actions themselves are tested elsewhere.

use inbox_test_support::console::{console_command, http_client, sign_in, start_console, UsersFile};
use inbox_test_support::process::Proc;
use inbox_test_support::TestDb;
use serde_json::{json, Value};
use tokio_postgres::Client;

/// The console on `db`, with `alice` (who may act) and `rory` (read-only), signed in.
struct Console {
    _proc: Proc,
    _users: UsersFile,
    base: String,
    http: reqwest::Client,
    /// The `Cookie` header of alice's session, and of rory's.
    alice: String,
    rory: String,
}

impl Console {
    async fn start(db: &TestDb) -> Console {
        let users = UsersFile::new(&[("alice", false), ("rory", true)]);
        let cmd = console_command(&db.url(), &users);
        let (proc, base) = tokio::task::spawn_blocking(move || start_console(cmd)).await.unwrap();
        let http = http_client();
        let alice = sign_in(&http, &base, "alice").await.expect("alice signs in");
        let rory = sign_in(&http, &base, "rory").await.expect("rory signs in");
        Console { _proc: proc, _users: users, base, http, alice, rory }
    }

    /// GET `path` with `cookie` (None: without a session); (status, Location, body).
    async fn get_as(&self, cookie: Option<&str>, path: &str) -> (u16, Option<String>, String) {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(cookie) = cookie {
            request = request.header(reqwest::header::COOKIE, cookie);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let location =
            response.headers().get(reqwest::header::LOCATION).map(|v| v.to_str().unwrap().to_owned());
        (status, location, response.text().await.unwrap())
    }

    /// GET `path` as alice, which must answer 200; its HTML.
    async fn page(&self, path: &str) -> String {
        self.page_as(&self.alice.clone(), path).await
    }

    async fn page_as(&self, cookie: &str, path: &str) -> String {
        let (status, _, body) = self.get_as(Some(cookie), path).await;
        assert_eq!(status, 200, "GET {path}:\n{body}");
        body
    }
}

/// An inbox row to seed; times are seconds relative to now.
#[derive(Clone)]
struct Row {
    endpoint: &'static str,
    event_id: String,
    event_type: &'static str,
    attempts: i32,
    last_error: Option<&'static str>,
    received_ago: f64,
    available_in: f64,
    processed_ago: Option<f64>,
    parked_ago: Option<f64>,
    held: Option<&'static str>,
    /// None: an invoice event naming `account` when set.
    payload: Option<Value>,
    account: Option<&'static str>,
    /// Held as unstorable: no payload, these bytes in `raw_body`.
    raw_body: Option<&'static [u8]>,
}

fn row(event_id: &str) -> Row {
    Row {
        endpoint: "billing",
        event_id: event_id.to_owned(),
        event_type: "invoice.paid",
        attempts: 0,
        last_error: None,
        received_ago: 60.0,
        available_in: -60.0,
        processed_ago: None,
        parked_ago: None,
        held: None,
        payload: None,
        account: None,
        raw_body: None,
    }
}

/// A row a worker parked after 10 attempts with `error`, received `received_ago` seconds ago.
fn parked(event_id: &str, error: &'static str, received_ago: f64) -> Row {
    Row {
        attempts: 10,
        last_error: Some(error),
        received_ago,
        parked_ago: Some(received_ago / 2.0),
        ..row(event_id)
    }
}

async fn seed(client: &Client, rows: &[Row]) {
    for r in rows {
        let payload = match (&r.payload, r.raw_body) {
            (_, Some(_)) => None,
            (Some(p), None) => Some(p.clone()),
            (None, None) => {
                let mut event = json!({"id": r.event_id, "object": "event", "type": r.event_type, "livemode": false,
                    "api_version": "2025-06-30.basil",
                    "data": {"object": {"id": format!("in_{}", r.event_id), "object": "invoice",
                                        "customer": "cus_1", "amount_paid": 100}}});
                if let Some(account) = r.account {
                    event["account"] = json!(account);
                }
                Some(event)
            }
        };
        client
            .execute(
                "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, raw_body, held,
                                            received_at, available_at, attempts, last_error, processed_at,
                                            parked_at)
                 VALUES ('stripe', $1, $2, $3, $4, $5, $6, now() - make_interval(secs => $7),
                         now() + make_interval(secs => $8), $9, $10,
                         now() - make_interval(secs => $11::float8), now() - make_interval(secs => $12::float8))",
                &[
                    &r.endpoint,
                    &r.event_id,
                    &r.event_type,
                    &payload,
                    &r.raw_body,
                    &r.held,
                    &r.received_ago,
                    &r.available_in,
                    &r.attempts,
                    &r.last_error,
                    &r.processed_ago,
                    &r.parked_ago,
                ],
            )
            .await
            .unwrap();
    }
}

/// The value of `attribute` on the element whose `id` is `id`.
fn attribute_of(html: &str, id: &str, attribute: &str) -> String {
    let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in:\n{html}"));
    let tag_end = at + html[at..].find('>').unwrap();
    let tag = &html[html[..at].rfind('<').unwrap()..tag_end];
    let start = tag.find(&format!("{attribute}=\"")).unwrap_or_else(|| panic!("no {attribute} in {tag}"))
        + attribute.len()
        + 2;
    tag[start..start + tag[start..].find('"').unwrap()].to_owned()
}

/// The text of the element whose `id` is `id` (up to its first tag).
fn text_of(html: &str, id: &str) -> String {
    let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in:\n{html}"));
    let start = at + html[at..].find('>').unwrap() + 1;
    html[start..start + html[start..].find('<').unwrap()].to_owned()
}

/// The card `card-<name>`'s figure.
fn card(html: &str, name: &str) -> i64 {
    attribute_of(html, &format!("card-{name}"), "data-value").parse().unwrap()
}

/// The event ids of the needs-review table's rows, in order.
fn listed(html: &str) -> Vec<String> {
    html.split("<tr data-event-id=\"").skip(1).map(|s| s[..s.find('"').unwrap()].to_owned()).collect()
}

/// The `href` of the pager link `rel`, HTML entities decoded, if there is one.
fn pager(html: &str, rel: &str) -> Option<String> {
    let at = html.find(&format!("rel=\"{rel}\" href=\""))? + rel.len() + 13;
    Some(html[at..at + html[at..].find('"').unwrap()].replace("&#38;", "&").replace("&amp;", "&"))
}

fn match_count(html: &str) -> i64 {
    text_of(html, "match-count").parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_overview_counts_each_state_of_the_queue_the_outbox_and_the_open_items_and_draws_the_last_hours()
{
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut rows = vec![
        parked("evt_parked_1", "payload: bad", 3600.0),
        parked("evt_parked_2", "payload: bad", 1800.0),
        Row { held: Some("livemode"), ..parked("evt_held_live", "livemode false on a live endpoint", 600.0) },
        // Leased (in flight): available later, no failure recorded.
        Row { attempts: 1, available_in: 300.0, ..row("evt_leased") },
    ];
    for i in 0..2 {
        // Waiting for a retry after a failure.
        rows.push(Row {
            attempts: 2,
            available_in: 120.0,
            last_error: Some("database: deadlock detected (40P01)"),
            ..row(&format!("evt_retry_{i}"))
        });
    }
    for i in 0..4 {
        // Ready; the oldest received 2 hours ago.
        rows.push(Row { received_ago: 7200.0 - f64::from(i), ..row(&format!("evt_ready_{i}")) });
    }
    for i in 0..5 {
        // Processed in the last hour, 2 s after receipt.
        let ago = 600.0 + 300.0 * f64::from(i);
        rows.push(Row {
            attempts: 1,
            received_ago: ago + 2.0,
            processed_ago: Some(ago),
            ..row(&format!("evt_done_{i}"))
        });
    }
    seed(&client, &rows).await;
    client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('Invoice', 'in_a', 'InvoicePaymentBooked', '{}'), ('Invoice', 'in_b', 'InvoicePaymentBooked', '{}');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, parked_at)
             VALUES ('Invoice', 'in_c', 'InvoicePaymentBooked', '{}', 12, 'HTTP 410 Gone', now());
             INSERT INTO reconciliation_items (invoice_id, event_id, reason)
             VALUES ('in_v1', 'evt_v1', 'payment_on_void_invoice'), ('in_v2', 'evt_v2', 'payment_on_void_invoice');
             INSERT INTO reconciliation_items (invoice_id, event_id, reason, resolved_at, resolved_by, resolution_note)
             VALUES ('in_v3', 'evt_v3', 'payment_on_void_invoice', now(), 'alice', 'refunded');",
        )
        .await
        .unwrap();
    let console = Console::start(&db).await;

    let html = console.page("/").await;
    for (name, expected) in [
        ("unprocessed", 10),
        ("ready", 4),
        ("leased", 1),
        ("retry_wait", 2),
        ("parked", 3),
        ("held", 1),
        ("no_handler", 0),
        ("outbox_pending", 2),
        ("outbox_parked", 1),
        ("reconciliation_open", 2),
    ] {
        assert_eq!(card(&html, name), expected, "card-{name}");
    }
    let oldest = card(&html, "oldest_unprocessed_age");
    assert!((7195..7300).contains(&oldest), "the oldest unprocessed row is 2 hours old: {oldest}");
    assert!(html.contains("class=\"card warn\" id=\"card-parked\""), "parked rows are a problem");

    // The charts: drawn here, inline, with classes only (the CSP allows no inline style).
    for id in ["throughput-chart", "latency-chart"] {
        assert!(html.contains(&format!("<svg class=\"chart\" id=\"{id}\"")), "#{id}");
    }
    let throughput = &html[html.find("id=\"throughput-chart\"").unwrap()..];
    let throughput = &throughput[..throughput.find("</svg>").unwrap()];
    let bars = throughput.matches("<rect class=\"bar\"").count();
    assert!((1..=5).contains(&bars), "the 5 processed rows fall in 1 to 5 intervals: {bars} bars");
    assert_eq!(text_of(&html, "processed-total"), "5");
    let latency = &html[html.find("id=\"latency-chart\"").unwrap()..];
    let latency = &latency[..latency.find("</svg>").unwrap()];
    assert!(latency.contains("class=\"dot p50\"") && latency.contains("class=\"dot p95\""), "{latency}");
    assert!(latency.contains("p50 2.0 s"), "every row took 2 s: {latency}");
    assert!(!html.contains("style="), "no inline style: the CSP refuses it");
    assert!(!html.contains("<script"), "no script");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_needs_review_filters_narrow_the_list_and_its_count_and_the_form_keeps_them() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            parked("evt_paid_deadlock", "database: deadlock detected (40P01)", 4.0 * 3600.0),
            parked("evt_paid_missing", "payload: data.object.amount_paid is missing", 3.0 * 3600.0),
            Row {
                event_type: "invoice.voided",
                ..parked("evt_voided", "database: Deadlock detected", 600.0)
            },
            Row {
                endpoint: "analytics",
                event_type: "invoice.finalized",
                ..parked("evt_analytics", "handler panicked: 100% of _x_", 300.0)
            },
            Row { account: Some("acct_1Connected"), ..parked("evt_connected", "payload: bad", 200.0) },
            Row {
                held: Some("livemode"),
                ..parked("evt_held_live", "livemode false on a live endpoint", 100.0)
            },
            Row {
                held: Some("unstorable"),
                raw_body: Some(b"{\"id\":\"evt_held_raw\",\"x\":\"\\u0000\"}"),
                ..parked("evt_held_raw", "unstorable: unsupported Unicode escape sequence", 50.0)
            },
            // Neither parked nor held: never listed.
            row("evt_ready"),
            Row { processed_ago: Some(10.0), ..row("evt_processed") },
        ],
    )
    .await;
    let console = Console::start(&db).await;

    let all = console.page("/needs-review").await;
    assert_eq!(match_count(&all), 7);
    assert_eq!(
        listed(&all),
        [
            "evt_paid_deadlock",
            "evt_paid_missing",
            "evt_voided",
            "evt_analytics",
            "evt_connected",
            "evt_held_live",
            "evt_held_raw"
        ],
        "oldest first"
    );
    assert!(all.contains("<tr data-event-id=\"evt_analytics\" data-endpoint=\"analytics\">"));
    assert!(all.contains("href=\"/events/billing/evt_paid_deadlock\""));
    assert!(all.contains("<form class=\"filters\" method=\"get\""));

    for (query, expected) in [
        (
            "type=invoice.paid",
            vec!["evt_paid_deadlock", "evt_paid_missing", "evt_connected", "evt_held_live", "evt_held_raw"],
        ),
        ("endpoint=analytics", vec!["evt_analytics"]),
        ("error=deadlock", vec!["evt_paid_deadlock", "evt_voided"]),
        // Taken literally: % and _ are no wildcards.
        ("error=100%25%20of%20_x_", vec!["evt_analytics"]),
        ("error=x%25", vec![]),
        ("held=any", vec!["evt_held_live", "evt_held_raw"]),
        ("held=livemode", vec!["evt_held_live"]),
        ("held=unstorable", vec!["evt_held_raw"]),
        (
            "held=none",
            vec!["evt_paid_deadlock", "evt_paid_missing", "evt_voided", "evt_analytics", "evt_connected"],
        ),
        ("older_than=2h", vec!["evt_paid_deadlock", "evt_paid_missing"]),
        ("account=acct_1Connected", vec!["evt_connected"]),
        ("type=invoice.paid&error=deadlock&older_than=1h&held=none", vec!["evt_paid_deadlock"]),
        ("type=invoice.created", vec![]),
    ] {
        let html = console.page(&format!("/needs-review?{query}")).await;
        assert_eq!(listed(&html), expected, "{query}");
        assert_eq!(match_count(&html), expected.len() as i64, "{query}");
    }

    // The form shows the filters again, and the requeue form carries them under the same names.
    let html =
        console.page("/needs-review?type=invoice.paid&error=dead%20lock%3C&older_than=1h&held=none").await;
    assert!(html.contains("<input name=\"type\" value=\"invoice.paid\""), "{html}");
    assert!(html.contains("<input name=\"error\" value=\"dead lock&#60;\""), "escaped: {html}");
    assert!(html.contains("<input name=\"older_than\" value=\"1h\""));
    assert!(html.contains("<option value=\"none\" selected>"));
    let html = console.page("/needs-review?type=invoice.paid&held=none").await;
    let form = &html[html.find("<form id=\"requeue-filtered-form\" class=\"action\" method=\"post\" action=\"/actions/requeue-filtered\">").expect("the requeue form")..];
    let form = &form[..form.find("</form>").unwrap()];
    for (name, value) in [
        ("type", "invoice.paid"),
        ("held", "none"),
        ("endpoint", ""),
        ("error", ""),
        ("older_than", ""),
        ("account", ""),
    ] {
        assert!(
            form.contains(&format!("<input type=\"hidden\" name=\"{name}\" value=\"{value}\">")),
            "{name}: {form}"
        );
    }
    assert!(form.contains("name=\"csrf\" value=\""));
    assert!(form.contains("Requeue all 3 matching…"), "{form}");
    // Held rows are a person's decision each: a set of them only is not requeued in bulk.
    let html = console.page("/needs-review?held=any").await;
    assert!(!html.contains("requeue-filtered-form"), "nothing a requeue would take");
    let html = console.page("/needs-review").await;
    assert!(
        html.contains("Requeue all 5 matching…") && html.contains("2 held on arrival are left"),
        "{html}"
    );

    // A filter that cannot be read is said, and nothing is listed.
    let (status, _, html) = console.get_as(Some(&console.alice), "/needs-review?older_than=soon").await;
    assert_eq!(status, 400);
    assert!(text_of(&html, "filter-error").starts_with("older than: &#34;soon&#34; is not an age"), "{html}");
    assert!(listed(&html).is_empty());
    let (status, _, _) = console.get_as(Some(&console.alice), "/needs-review?held=maybe").await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_needs_review_pages_walk_120_parked_rows_once_oldest_first_fifty_at_a_time() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Received a minute apart, the oldest first; evt_051 at the same instant as evt_050, on
    // another endpoint (the tie is broken by endpoint, then event id), across the pages' border.
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at, attempts,
                                        last_error, parked_at)
             SELECT 'stripe', CASE WHEN i = 51 THEN 'analytics' ELSE 'billing' END,
                    'evt_' || lpad(i::text, 3, '0'), 'invoice.paid', jsonb_build_object('id', 'evt_' || i),
                    date_trunc('minute', now()) - interval '1 day'
                        + (CASE WHEN i = 51 THEN 50 ELSE i END) * interval '1 minute',
                    10, 'payload: bad', now()
               FROM generate_series(1, 120) AS i",
            &[],
        )
        .await
        .unwrap();
    let console = Console::start(&db).await;

    let mut seen = Vec::new();
    let mut path = "/needs-review".to_owned();
    let mut pages = 0;
    loop {
        let html = console.page(&path).await;
        pages += 1;
        assert_eq!(match_count(&html), 120, "{path}");
        let rows = listed(&html);
        assert_eq!(rows.len(), if pages < 3 { 50 } else { 20 }, "{path}");
        assert_eq!(pager(&html, "prev").is_some(), pages > 1, "{path}");
        seen.extend(rows);
        match pager(&html, "next") {
            Some(next) => path = next,
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let mut expected: Vec<String> = (1..=120).map(|i| format!("evt_{i:03}")).collect();
    expected.swap(49, 50);
    assert_eq!(seen[49], "evt_051", "analytics before billing at the same instant");
    assert_eq!(seen, expected, "every row once, oldest first");
    assert_eq!(pager(&console.page("/needs-review?page=2").await, "prev").as_deref(), Some("/needs-review"));
    let past = console.page("/needs-review?page=9").await;
    assert!(listed(&past).is_empty() && pager(&past, "next").is_none());
    assert_eq!(pager(&past, "prev").as_deref(), Some("/needs-review?page=3"), "back to the last page");

    // Whoever may act gets the form that requeues the filtered set; a read-only user does not.
    assert!(console.page("/needs-review").await.contains("Requeue all 120 matching…"));
    let rory = console.rory.clone();
    let html = console.page_as(&rory, "/needs-review").await;
    assert_eq!(listed(&html).len(), 50);
    assert!(!html.contains("requeue-filtered-form") && !html.contains("action=\"/actions/"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_event_page_shows_its_state_its_payload_escaped_its_audit_history_and_the_forms_that_apply() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let script = "<script>alert(1)</script>";
    let payload = json!({"id": "evt_xss", "object": "event", "type": "invoice.paid", "livemode": true,
        "account": "acct_1Connected", "api_version": "2025-06-30.basil",
        "data": {"object": {"id": "in_xss", "object": "invoice", "description": script}}});
    seed(
        &client,
        &[
            Row { payload: Some(payload), ..parked("evt_xss", "payload: <b>bold</b> error", 600.0) },
            Row { attempts: 1, processed_ago: Some(30.0), received_ago: 31.0, ..row("evt_done") },
            Row { held: Some("livemode"), ..parked("evt_live", "livemode false on a live endpoint", 60.0) },
            Row {
                held: Some("unstorable"),
                raw_body: Some(b"{\"id\":\"evt_raw\",\"x\":\"\\u0000<i>\"}"),
                ..parked("evt_raw", "unstorable", 60.0)
            },
            Row { endpoint: "eu billing", ..parked("evt_spaced", "payload: bad", 60.0) },
        ],
    )
    .await;
    client
        .execute(
            "UPDATE webhook_inbox SET secret_position = 1, secret_fingerprint = '9f86d081', signature_t = 1767225600
              WHERE event_id = 'evt_xss'",
            &[],
        )
        .await
        .unwrap();
    client
        .batch_execute(
            r#"INSERT INTO operator_audit (actor, action, target, affected) VALUES
               ('bob', 'requeue', '{"provider": "stripe", "endpoint": "billing", "event_id": "evt_xss"}', 1),
               ('carol', 'replay', '{"provider": "stripe", "endpoint": "other", "event_id": "evt_xss"}', 1),
               ('dave', 'requeue', '{"provider": "stripe", "all": true, "event_type": "invoice.paid"}', 0);"#,
        )
        .await
        .unwrap();
    let console = Console::start(&db).await;

    let html = console.page("/events/billing/evt_xss").await;
    assert!(
        html.contains("&#60;script&#62;alert(1)&#60;/script&#62;") || html.contains("&lt;script&gt;"),
        "{html}"
    );
    assert!(!html.contains(script), "the description is escaped");
    assert!(!html.contains("<b>bold</b>"), "the error is escaped");
    let payload = &html[html.find("<pre id=\"payload\">").expect("the payload")..];
    let payload = &payload[..payload.find("</pre>").unwrap()];
    assert!(payload.starts_with("<pre id=\"payload\">{\n  &#34;"), "pretty-printed: {payload}");
    assert!(payload.contains("\n  &#34;account&#34;: &#34;acct_1Connected&#34;"), "{payload}");
    assert!(payload.contains("\n      &#34;description&#34;: &#34;&#60;script&#62;"), "{payload}");
    assert_eq!(text_of(&html, "processed-at"), "—");
    assert_eq!(text_of(&html, "event-type"), "invoice.paid");
    assert_eq!(text_of(&html, "attempts"), "10");
    assert_eq!(text_of(&html, "account"), "acct_1Connected");
    assert_eq!(text_of(&html, "livemode"), "true");
    assert_eq!(text_of(&html, "api-version"), "2025-06-30.basil");
    let provenance = text_of(&html, "provenance");
    assert!(
        provenance.contains("source webhook")
            && provenance.contains("secret #1 (fingerprint 9f86d081)")
            && provenance.contains("t=1767225600 (2026-01-01T00:00:00.000Z)"),
        "{provenance}"
    );
    assert!(text_of(&html, "received-at").ends_with('Z'), "UTC, RFC 3339");
    assert!(html.contains("<dl class=\"detail\">"));
    // Its audit history: the record of this endpoint's event, not another endpoint's nor a bulk run.
    let history = &html[html.find("<table id=\"audit-history\">").unwrap()..];
    let history = &history[..history.find("</table>").unwrap()];
    assert!(history.contains("<td>bob</td><td>requeue</td>"), "{history}");
    assert!(!history.contains("carol") && !history.contains("dave"), "{history}");
    // A parked row: requeue and dismiss, with the session's token and the row's key.
    for (id, action) in [("requeue-form", "/actions/requeue"), ("dismiss-form", "/actions/dismiss")] {
        let form = &html[html.find(&format!("<form id=\"{id}\"")).unwrap_or_else(|| panic!("#{id}"))..];
        let form = &form[..form.find("</form>").unwrap()];
        assert!(form.contains(&format!("method=\"post\" action=\"{action}\"")), "{form}");
        assert!(form.contains("<input type=\"hidden\" name=\"endpoint\" value=\"billing\">"), "{form}");
        assert!(form.contains("<input type=\"hidden\" name=\"event_id\" value=\"evt_xss\">"), "{form}");
        assert!(form.contains("<input type=\"hidden\" name=\"csrf\" value=\""), "{form}");
    }
    assert!(html.contains("name=\"reason\" required"));
    for absent in ["release-form", "replay-form", "replay-dry-run-form"] {
        assert!(!html.contains(absent), "{absent} on a parked row");
    }

    // A processed row: replay, dry run or not; a livemode hold: release (and requeue, dismiss).
    let html = console.page("/events/billing/evt_done").await;
    assert!(text_of(&html, "processed-at").ends_with('Z'));
    for id in ["replay-form", "replay-dry-run-form"] {
        assert!(html.contains(&format!("<form id=\"{id}\"")), "{id}");
    }
    for absent in ["requeue-form", "release-form", "dismiss-form"] {
        assert!(!html.contains(absent), "{absent} on a processed row");
    }
    let html = console.page("/events/billing/evt_live").await;
    assert_eq!(text_of(&html, "held"), "livemode");
    for id in ["release-form", "requeue-form", "dismiss-form"] {
        assert!(html.contains(&format!("<form id=\"{id}\"")), "{id}");
    }
    // Unstorable: its bytes as text, escaped, and why; nothing to requeue.
    let html = console.page("/events/billing/evt_raw").await;
    assert!(text_of(&html, "raw-body-note").starts_with("Held as unstorable"));
    assert!(html.contains("\\u0000&#60;i&#62;") || html.contains("\\u0000&lt;i&gt;"), "{html}");
    assert!(html.contains("<form id=\"dismiss-form\"") && !html.contains("requeue-form"));

    // A read-only user sees the event, not one form.
    let rory = console.rory.clone();
    let html = console.page_as(&rory, "/events/billing/evt_xss").await;
    assert!(html.contains("<pre id=\"payload\">") && !html.contains("action=\"/actions/"), "{html}");

    // Path segments are percent-encoded in the links, and decoded by the route.
    let list = console.page("/needs-review?endpoint=eu%20billing").await;
    assert!(list.contains("href=\"/events/eu%20billing/evt_spaced\""), "{list}");
    assert_eq!(text_of(&console.page("/events/eu%20billing/evt_spaced").await, "endpoint"), "eu billing");

    // An action's redirect says what it did.
    let html = console.page("/events/billing/evt_xss?notice=requeued%20%3Cnow%3E").await;
    assert_eq!(text_of(&html, "notice"), "requeued &#60;now&#62;");

    let (status, _, html) = console.get_as(Some(&console.alice), "/events/billing/evt_nowhere").await;
    assert_eq!(status, 404);
    assert!(html.contains("no event evt_nowhere for endpoint billing"), "{html}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_outbox_reconciliation_and_audit_pages_list_their_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            r#"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, parked_at)
               VALUES ('Invoice', 'in_gone', 'InvoicePaymentBooked', '{}', 12, 'HTTP 410 <Gone>', now());
               INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('Invoice', 'in_gone', 'InvoiceVoided', '{}'), ('Invoice', 'in_ok', 'InvoicePaymentBooked', '{}');
               INSERT INTO reconciliation_items (invoice_id, event_id, reason, detail)
               VALUES ('in_v1', 'evt_v1', 'payment_on_void_invoice', '{"endpoint": "billing", "amount_paid": 4900}');
               INSERT INTO reconciliation_items (invoice_id, event_id, reason, resolved_at, resolved_by, resolution_note)
               VALUES ('in_v2', 'evt_v2', 'payment_on_void_invoice', now(), 'alice', 'refunded <re_1>');
               INSERT INTO operator_audit (at, actor, action, target, affected)
               SELECT now() - (60 - i) * interval '1 minute', 'op' || i, 'requeue',
                      jsonb_build_object('provider', 'stripe', 'event_id', 'evt_' || i, 'note', '<b>' || i || '</b>'), 1
                 FROM generate_series(1, 55) AS i;"#,
        )
        .await
        .unwrap();
    let console = Console::start(&db).await;

    let html = console.page("/outbox").await;
    assert_eq!(attribute_of(&html, "outbox-pending", "data-value"), "2");
    assert_eq!(attribute_of(&html, "outbox-parked", "data-value"), "1");
    assert_eq!(attribute_of(&html, "outbox-blocked-aggregates", "data-value"), "1");
    assert_eq!(attribute_of(&html, "outbox-blocked-rows", "data-value"), "1");
    let parked = &html[html.find("<tr data-outbox-id=").expect("the parked row")..];
    assert!(parked.contains("Invoice in_gone") && parked.contains("HTTP 410 &#60;Gone&#62;"), "{parked}");

    let html = console.page("/reconciliation").await;
    let open: i64 = client
        .query_one("SELECT id FROM reconciliation_items WHERE resolved_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    let closed: i64 = client
        .query_one("SELECT id FROM reconciliation_items WHERE resolved_at IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        html.contains(&format!("<tr data-item-id=\"{open}\""))
            && !html.contains(&format!("data-item-id=\"{closed}\""))
    );
    let form = &html[html.find(&format!("<form id=\"resolve-form-{open}\"")).expect("the resolve form")..];
    let form = &form[..form.find("</form>").unwrap()];
    assert!(form.contains("method=\"post\" action=\"/actions/resolve\""), "{form}");
    assert!(form.contains(&format!("<input type=\"hidden\" name=\"id\" value=\"{open}\">")), "{form}");
    assert!(form.contains("name=\"csrf\"") && form.contains("<input name=\"note\" required"), "{form}");
    assert!(
        html.contains("href=\"/events/billing/evt_v1\""),
        "the item's event, by the endpoint of its detail"
    );
    let html = console.page("/reconciliation?all=1").await;
    assert!(html.contains(&format!("data-item-id=\"{closed}\"")) && html.contains("refunded &#60;re_1&#62;"));
    assert!(!html.contains(&format!("resolve-form-{closed}")), "a resolved item is not resolved again");
    let rory = console.rory.clone();
    assert!(!console.page_as(&rory, "/reconciliation").await.contains("resolve-form"));

    let html = console.page("/audit").await;
    assert_eq!(text_of(&html, "audit-count"), "55");
    let actors: Vec<&str> = html.split("</td><td>").filter(|c| c.starts_with("op")).collect();
    assert_eq!(actors.len(), 50);
    assert_eq!(actors[0], "op55", "newest first");
    assert!(html.contains("<table id=\"audit-log\">"));
    let target = &html[html.find("<td class=\"json\">").unwrap()..];
    let target = &target[..target.find("</td>").unwrap()];
    assert!(
        target.contains("&#34;event_id&#34;:&#34;evt_55&#34;")
            && target.contains("&#34;note&#34;:&#34;&#60;b&#62;55&#60;/b&#62;&#34;")
            && !target.contains(": "),
        "compact JSON, escaped: {target}"
    );
    let next = pager(&html, "next").expect("an older page");
    let html = console.page(&next).await;
    assert_eq!(html.split("</td><td>").filter(|c| c.starts_with("op")).count(), 5);
    assert!(pager(&html, "next").is_none() && pager(&html, "prev").is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_error_is_a_500_page_saying_what_failed() {
    let db = TestDb::new().await;
    let console = Console::start(&db).await;
    db.client().await.batch_execute("DROP TABLE operator_audit").await.unwrap();
    let (status, _, html) = console.get_as(Some(&console.alice), "/audit").await;
    assert_eq!(status, 500);
    let error = text_of(&html, "error");
    assert!(error.contains("operator_audit") && error.contains("does not exist"), "{error}");
    assert!(html.contains("<span class=\"who\">alice</span>"), "in the operator's layout");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_page_redirects_to_the_sign_in_form_without_a_session() {
    let db = TestDb::new().await;
    seed(&db.client().await, &[parked("evt_1", "payload: bad", 60.0)]).await;
    let console = Console::start(&db).await;
    let forged = "inbox_console=alice|rw|nonce|99999999999|AAAA";
    for path in [
        "/",
        "/needs-review",
        "/needs-review?type=invoice.paid&page=2",
        "/events/billing/evt_1",
        "/outbox",
        "/reconciliation",
        "/reconciliation?all=1",
        "/audit",
    ] {
        for cookie in [None, Some(forged)] {
            let (status, location, body) = console.get_as(cookie, path).await;
            assert_eq!((status, location.as_deref()), (303, Some("/login")), "{path} with {cookie:?}");
            assert!(!body.contains("evt_1"), "{path}: {body}");
        }
    }
}

#[tokio::test]
async fn the_sign_in_form_carries_a_csrf_token_and_a_sign_in_without_it_is_refused() {
    let db = TestDb::new().await;
    let console = Console::start(&db).await;
    let password = inbox_test_support::console::PASSWORD;
    // No token and no sign-in cookie (a page of another site posting the form): refused, no session.
    let bare = console
        .http
        .post(format!("{}/login", console.base))
        .form(&[("user", "alice"), ("password", password)])
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status().as_u16(), 403);
    let cookies: Vec<String> = bare
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert!(
        !cookies.iter().any(|c| c.starts_with("inbox_console=") && !c.starts_with("inbox_console=;")),
        "{cookies:?}"
    );
    // A token of one form with another form's cookie: refused too.
    let (_, _, form) = console.get_as(None, "/login").await;
    assert!(form.contains("name=\"csrf\""), "{form}");
    let token = form.split("name=\"csrf\" value=\"").nth(1).unwrap().split('"').next().unwrap().to_owned();
    let other = console.http.get(format!("{}/login", console.base)).send().await.unwrap();
    let other_cookie = other
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok()?.split(';').next().map(str::to_owned))
        .find(|c| c.starts_with("inbox_console_login="))
        .unwrap();
    let mixed = console
        .http
        .post(format!("{}/login", console.base))
        .header(reqwest::header::COOKIE, other_cookie)
        .form(&[("user", "alice"), ("password", password), ("csrf", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(mixed.status().as_u16(), 403);
    // The form as served signs in (Console::start did, through the same helper).
    assert!(console.alice.starts_with("inbox_console="));
}
