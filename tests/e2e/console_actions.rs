//! The console's actions over HTTP (`inbox-worker console`, a process): each runs the operator
//! command's library code with the signed-in operator as the actor of its audit record; a form
//! without this session's CSRF token, from another site, or from a read-only user changes nothing;
//! a refusal is the command's own message (409), never a 500.

use inbox_test_support::console::{console_command, http_client, sign_in, start_console, UsersFile};
use inbox_test_support::db::{audit, scalar, snapshot};
use inbox_test_support::process::Proc;
use inbox_test_support::TestDb;
use serde_json::json;
use tokio_postgres::Client;

/// A console on `db` with `alice` (who may act) and `viewer` (read-only), `alice` signed in.
struct Console {
    _proc: Proc,
    _users: UsersFile,
    base: String,
    http: reqwest::Client,
    /// alice's session cookie and CSRF token.
    cookie: String,
    csrf: String,
}

impl Console {
    async fn start(db: &TestDb) -> Console {
        let users = UsersFile::new(&[("alice", false), ("viewer", true)]);
        let (proc, base) = start_console(console_command(&db.url(), &users));
        let http = http_client();
        let cookie = sign_in(&http, &base, "alice").await.expect("alice signs in");
        let csrf = csrf_of(&http, &base, &cookie).await;
        Console { _proc: proc, _users: users, base, http, cookie, csrf }
    }

    /// POSTs `fields` to `path` with `cookie` (and nothing else): (status, Location, body).
    async fn post_as(&self, cookie: &str, path: &str, fields: &[(&str, &str)]) -> (u16, String, String) {
        self.post_with(self.http.post(format!("{}{path}", self.base)).header("cookie", cookie), fields).await
    }

    async fn post_with(
        &self,
        request: reqwest::RequestBuilder,
        fields: &[(&str, &str)],
    ) -> (u16, String, String) {
        let response = request.form(fields).send().await.expect("the console answers");
        let status = response.status().as_u16();
        let location =
            response.headers().get("location").map(|l| l.to_str().unwrap().to_owned()).unwrap_or_default();
        (status, location, response.text().await.unwrap())
    }

    /// POSTs `fields` and alice's CSRF token to `path` as alice.
    async fn act(&self, path: &str, fields: &[(&str, &str)]) -> (u16, String, String) {
        let mut fields = fields.to_vec();
        fields.push(("csrf", self.csrf.as_str()));
        self.post_as(&self.cookie, path, &fields).await
    }
}

/// The CSRF token of the session `cookie`, from the sign-out form of a page.
async fn csrf_of(http: &reqwest::Client, base: &str, cookie: &str) -> String {
    let response = http.get(format!("{base}/audit")).header("cookie", cookie).send().await.unwrap();
    let page = response.text().await.unwrap();
    let after =
        page.split(r#"name="csrf" value=""#).nth(1).unwrap_or_else(|| panic!("no CSRF token in:\n{page}"));
    after.split('"').next().unwrap().to_owned()
}

/// A row of `billing`; `parked`: a worker parked it after 10 attempts (else processed an hour ago).
async fn seed(client: &Client, event_id: &str, event_type: &str, parked: bool, received_minutes_ago: i32) {
    let payload = json!({
        "id": event_id, "type": event_type, "livemode": true, "account": "acct_console",
        "data": {"object": {"id": format!("in_{event_id}"), "customer": "cus_1", "amount_paid": 100}},
    });
    let (attempts, error, parked_at, processed_at) = if parked {
        (10, Some("boom: statement timeout (57014)"), Some(60.0f64), None)
    } else {
        (1, None, None, Some(3600.0f64))
    };
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, last_error, parked_at, processed_at)
             VALUES ('stripe', 'billing', $1, $2, $3, now() - make_interval(mins => $4),
                     now() - interval '1 minute', $5, $6, now() - make_interval(secs => $7::float8),
                     now() - make_interval(secs => $8::float8))",
            &[
                &event_id,
                &event_type,
                &payload,
                &received_minutes_ago,
                &attempts,
                &error,
                &parked_at,
                &processed_at,
            ],
        )
        .await
        .unwrap();
}

/// (attempts, parked, held, processed, dismissed) of a row of `billing`.
async fn state(client: &Client, event_id: &str) -> (i32, bool, Option<String>, bool, bool) {
    let r = client
        .query_one(
            "SELECT attempts, parked_at IS NOT NULL, held, processed_at IS NOT NULL, dismissed_at IS NOT NULL
               FROM webhook_inbox WHERE endpoint = 'billing' AND event_id = $1",
            &[&event_id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
}

#[tokio::test]
async fn requeue_release_and_dismiss_run_the_commands_with_the_signed_in_operator_as_actor() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, "evt_parked", "invoice.paid", true, 30).await;
    seed(&client, "evt_held", "invoice.paid", true, 20).await;
    seed(&client, "evt_test", "invoice.paid", true, 10).await;
    seed(&client, "evt_done", "invoice.paid", false, 90).await;
    client
        .batch_execute("UPDATE webhook_inbox SET held = 'livemode' WHERE event_id = 'evt_held'")
        .await
        .unwrap();
    let console = Console::start(&db).await;

    // Requeue: the row is back in the queue, the audit names alice.
    let (status, location, _) =
        console.act("/actions/requeue", &[("endpoint", "billing"), ("event_id", "evt_parked")]).await;
    assert_eq!((status, location.as_str()), (303, "/events/billing/evt_parked?notice=Requeued"));
    assert_eq!(state(&client, "evt_parked").await, (0, false, None, false, false));
    let records = audit(&client).await;
    assert_eq!(
        records,
        [(
            "alice".to_owned(),
            "requeue".to_owned(),
            json!({"provider": "stripe", "endpoint": "billing", "event_id": "evt_parked", "via": "console"}),
            1
        )]
    );

    // Release takes only a row held for its livemode; a refusal is the command's message, a 409.
    let (status, _, page) =
        console.act("/actions/release", &[("endpoint", "billing"), ("event_id", "evt_test")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("is not held for its livemode"), "{page}");
    let (status, location, _) =
        console.act("/actions/release", &[("endpoint", "billing"), ("event_id", "evt_held")]).await;
    assert_eq!((status, location.as_str()), (303, "/events/billing/evt_held?notice=Released"));
    assert_eq!(state(&client, "evt_held").await, (0, false, None, false, false));
    assert_eq!(audit(&client).await[1].2["released_hold"], "livemode");

    // A processed row is refused with the CLI's words; an unknown one too; nothing changes.
    let before = snapshot(&client).await;
    let (status, _, page) =
        console.act("/actions/requeue", &[("endpoint", "billing"), ("event_id", "evt_done")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("use `replay` to run it again"), "{page}");
    let (status, _, page) = console.act("/actions/requeue", &[("event_id", "evt_nope")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("no event evt_nope in the inbox"), "{page}");

    // Dismiss needs a reason, then closes the row with it.
    let (status, _, page) = console
        .act("/actions/dismiss", &[("endpoint", "billing"), ("event_id", "evt_test"), ("reason", "  ")])
        .await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("must say why the row must not run"), "{page}");
    assert_eq!(snapshot(&client).await, before, "refusals change nothing");
    assert_eq!(audit(&client).await.len(), 2, "and audit nothing");

    let (status, location, _) = console
        .act(
            "/actions/dismiss",
            &[("endpoint", "billing"), ("event_id", "evt_test"), ("reason", "a test event sent to live")],
        )
        .await;
    assert_eq!((status, location.as_str()), (303, "/events/billing/evt_test?notice=Dismissed"));
    assert_eq!(state(&client, "evt_test").await, (10, true, None, true, true));
    let last_error: String = client
        .query_one("SELECT last_error FROM webhook_inbox WHERE event_id = 'evt_test'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(last_error, "dismissed by alice: a test event sent to live");
    let (actor, action, target, affected) = audit(&client).await.pop().unwrap();
    assert_eq!((actor.as_str(), action.as_str(), affected), ("alice", "dismiss", 1));
    assert_eq!(
        (target["reason"].as_str(), target["via"].as_str()),
        (Some("a test event sent to live"), Some("console"))
    );
}

#[tokio::test]
async fn a_form_without_the_token_from_another_site_or_from_a_read_only_user_changes_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, "evt_parked", "invoice.paid", true, 30).await;
    let console = Console::start(&db).await;
    let before = snapshot(&client).await;
    let event = [("endpoint", "billing"), ("event_id", "evt_parked")];

    // No CSRF token, or another session's.
    let (status, _, page) = console.post_as(&console.cookie, "/actions/requeue", &event).await;
    assert_eq!(status, 403, "{page}");
    let viewer = sign_in(&console.http, &console.base, "viewer").await.unwrap();
    let viewer_csrf = csrf_of(&console.http, &console.base, &viewer).await;
    let mut forged = event.to_vec();
    forged.push(("csrf", viewer_csrf.as_str()));
    let (status, _, page) = console.post_as(&console.cookie, "/actions/requeue", &forged).await;
    assert_eq!(status, 403, "another session's token: {page}");

    // A read-only user, with the valid token of their own session.
    let (status, _, page) = console.post_as(&viewer, "/actions/requeue", &forged).await;
    assert_eq!(status, 403, "{page}");
    assert!(page.contains("read-only"), "{page}");
    let (status, _, page) =
        console.post_as(&viewer, "/actions/requeue-filtered", &[("csrf", viewer_csrf.as_str())]).await;
    assert_eq!(status, 403, "not even the count: {page}");

    // alice's session and token, but posted from another site.
    let mut fields = event.to_vec();
    fields.push(("csrf", console.csrf.as_str()));
    let request = console
        .http
        .post(format!("{}/actions/requeue", console.base))
        .header("cookie", &console.cookie)
        .header("origin", "https://evil.example");
    let (status, _, page) = console.post_with(request, &fields).await;
    assert_eq!(status, 403, "{page}");
    let request = console
        .http
        .post(format!("{}/actions/requeue", console.base))
        .header("cookie", &console.cookie)
        .header("sec-fetch-site", "cross-site");
    let (status, _, _) = console.post_with(request, &fields).await;
    assert_eq!(status, 403);

    // Without a session: to the sign-in form.
    let (status, location, _) = console.post_as("", "/actions/requeue", &fields).await;
    assert_eq!((status, location.as_str()), (303, "/login"));

    assert_eq!(snapshot(&client).await, before, "nothing changed");
    assert!(audit(&client).await.is_empty(), "and nothing was audited");

    // The same form with everything right does it.
    let (status, _, _) = console.act("/actions/requeue", &event).await;
    assert_eq!(status, 303);
    assert_eq!(state(&client, "evt_parked").await.0, 0);
}

#[tokio::test]
async fn requeue_filtered_shows_the_count_first_and_requeues_at_most_what_was_confirmed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for (i, id) in ["evt_p1", "evt_p2", "evt_p3"].iter().enumerate() {
        seed(&client, id, "invoice.paid", true, 300 - 10 * i as i32).await;
    }
    seed(&client, "evt_created", "invoice.created", true, 200).await;
    seed(&client, "evt_recent", "invoice.paid", true, 5).await;
    seed(&client, "evt_held", "invoice.paid", true, 400).await;
    client
        .batch_execute("UPDATE webhook_inbox SET held = 'livemode' WHERE event_id = 'evt_held'")
        .await
        .unwrap();
    let console = Console::start(&db).await;
    let before = snapshot(&client).await;
    let filters = [
        ("type", "invoice.paid"),
        ("endpoint", "billing"),
        ("held", ""),
        ("error", "STATEMENT TIMEOUT"),
        ("older_than", "1h"),
        ("account", "acct_console"),
    ];

    // First the count, and the form that confirms it; nothing changes.
    let (status, _, page) = console.act("/actions/requeue-filtered", &filters).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(r#"<span id="confirm-count">3</span>"#), "{page}");
    assert!(
        page.contains(r#"<form id="confirm-form" method="post" action="/actions/requeue-filtered""#),
        "{page}"
    );
    let csrf_field = format!(r#"name="csrf" value="{}""#, console.csrf);
    for hidden in [
        r#"name="confirm" value="3""#,
        r#"name="type" value="invoice.paid""#,
        r#"name="older_than" value="1h""#,
        r#"name="account" value="acct_console""#,
        csrf_field.as_str(),
    ] {
        assert!(page.contains(hidden), "{hidden} in {page}");
    }
    assert!(page.contains("1 more matches but was held on arrival"), "{page}");
    assert_eq!(snapshot(&client).await, before, "counting changes nothing");
    assert!(audit(&client).await.is_empty());

    // Nothing matches: nothing to confirm.
    let (status, _, page) = console.act("/actions/requeue-filtered", &[("type", "invoice.voided")]).await;
    assert_eq!(status, 200);
    assert!(
        page.contains(r#"<span id="confirm-count">0</span>"#) && !page.contains("confirm-form"),
        "{page}"
    );

    // An invalid filter is a 400 saying which.
    let (status, _, page) = console.act("/actions/requeue-filtered", &[("older_than", "soon")]).await;
    assert_eq!(status, 400, "{page}");
    assert!(page.contains("older than"), "{page}");

    // Confirmed for 2 of the 3: the oldest 2, no more; audited as a run of alice's.
    let mut confirmed = filters.to_vec();
    confirmed.push(("confirm", "2"));
    let (status, location, _) = console.act("/actions/requeue-filtered", &confirmed).await;
    assert_eq!((status, location.as_str()), (303, "/needs-review?notice=Requeued%202%20rows"));
    for (id, attempts) in [
        ("evt_p1", 0),
        ("evt_p2", 0),
        ("evt_p3", 10),
        ("evt_created", 10),
        ("evt_recent", 10),
        ("evt_held", 10),
    ] {
        assert_eq!(state(&client, id).await.0, attempts, "{id}");
    }
    let records = audit(&client).await;
    assert_eq!(records.len(), 2, "{records:?}");
    let (actor, action, target, affected) = &records[0];
    assert_eq!((actor.as_str(), action.as_str(), *affected), ("alice", "requeue", 0));
    assert_eq!(
        (
            &target["matched"],
            &target["confirmed"],
            &target["event_type"],
            &target["older_than_seconds"],
            &target["via"]
        ),
        (&json!(3), &json!(2), &json!("invoice.paid"), &json!(3600.0), &json!("console"))
    );
    let run: i64 = scalar(&client, "SELECT min(id) FROM operator_audit").await;
    assert_eq!((records[1].0.as_str(), &records[1].2["run"], records[1].3), ("alice", &json!(run), 2));
}

#[tokio::test]
async fn replay_dry_run_shows_the_booking_and_changes_nothing_then_replay_books_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, "evt_dry", "invoice.paid", false, 90).await;
    async fn marked(client: &Client) -> String {
        client
            .query_one("SELECT processed_at::text FROM webhook_inbox WHERE event_id = 'evt_dry'", &[])
            .await
            .unwrap()
            .get(0)
    }
    let before = marked(&client).await;
    let console = Console::start(&db).await;
    let event = [("endpoint", "billing"), ("event_id", "evt_dry")];

    let (status, _, page) = console.act("/actions/replay-dry-run", &event).await;
    assert_eq!(status, 200, "{page}");
    let changes = page.split(r#"<table id="dry-run-changes">"#).nth(1).expect(&page);
    assert!(changes.contains(r#"<tr data-table="ledger_entries">"#), "{page}");
    assert!(changes.contains("in_evt_dry"), "the booking's invoice: {page}");
    assert!(changes.contains(r#"<tr data-table="outbox">"#), "{page}");
    for sql in [
        "SELECT count(*) FROM ledger_entries",
        "SELECT count(*) FROM outbox",
        "SELECT count(*) FROM invoices",
    ] {
        assert_eq!(scalar(&client, sql).await, 0, "{sql}");
    }
    assert_eq!(marked(&client).await, before, "the processed mark is not renewed");
    let records = audit(&client).await;
    assert_eq!(records.len(), 1);
    assert_eq!((records[0].0.as_str(), records[0].1.as_str(), records[0].3), ("alice", "replay-dry-run", 0));
    assert_eq!(records[0].2["would_change"]["ledger_entries"]["inserted"], 1, "{}", records[0].2);

    // For real: booked once, audited.
    let (status, location, _) = console.act("/actions/replay", &event).await;
    assert_eq!((status, location.as_str()), (303, "/events/billing/evt_dry?notice=Replayed"));
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_ne!(marked(&client).await, before, "the processed mark is renewed");
    let (actor, action, target, affected) = audit(&client).await.pop().unwrap();
    assert_eq!(
        (actor.as_str(), action.as_str(), affected, &target["via"]),
        ("alice", "replay", 1, &json!("console"))
    );

    // An unprocessed event is refused as the CLI refuses it.
    seed(&client, "evt_parked", "invoice.paid", true, 30).await;
    let (status, _, page) =
        console.act("/actions/replay", &[("endpoint", "billing"), ("event_id", "evt_parked")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("is not processed yet; requeue it instead"), "{page}");
}

#[tokio::test]
async fn resolve_closes_the_item_once_with_the_operator_as_actor_and_its_audit_record() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id: i64 = client
        .query_one(
            "INSERT INTO reconciliation_items (invoice_id, event_id, reason, detail)
             VALUES ('in_void', 'evt_paid_void', 'payment_on_void_invoice', '{\"endpoint\": \"billing\"}')
             RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let console = Console::start(&db).await;
    let id_text = id.to_string();
    let id_text = id_text.as_str();

    // A note that says nothing is refused.
    let (status, _, page) = console.act("/actions/resolve", &[("id", id_text), ("note", " ")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("the note must say what was done"), "{page}");
    let (status, _, _) = console.act("/actions/resolve", &[("id", "x"), ("note", "n")]).await;
    assert_eq!(status, 400);
    assert!(audit(&client).await.is_empty());

    let (status, location, _) =
        console.act("/actions/resolve", &[("id", id_text), ("note", "refunded in the dashboard")]).await;
    assert_eq!(status, 303);
    assert!(location.starts_with("/reconciliation?notice=Resolved%20item%20"), "{location}");
    let r = client
        .query_one("SELECT resolved_by, resolution_note FROM reconciliation_items WHERE id = $1", &[&id])
        .await
        .unwrap();
    assert_eq!(
        (r.get::<_, String>(0), r.get::<_, String>(1)),
        ("alice".into(), "refunded in the dashboard".into())
    );
    assert_eq!(
        audit(&client).await,
        [(
            "alice".to_owned(),
            "resolve-reconciliation".to_owned(),
            json!({"table": "reconciliation_items", "id": id, "reason": "payment_on_void_invoice",
                   "event_id": "evt_paid_void", "note": "refunded in the dashboard", "via": "console"}),
            1
        )]
    );

    // Once only.
    let (status, _, page) = console.act("/actions/resolve", &[("id", id_text), ("note", "again")]).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("was already resolved at"), "{page}");
    assert_eq!(audit(&client).await.len(), 1);
}
