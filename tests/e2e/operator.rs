//! The operator commands of `inbox-worker` (`stats`, `needs-review`, `requeue`, `replay`, `purge`),
//! run as processes the way operators run them, against rows seeded directly with SQL.

use std::time::Duration;

use inbox_test_support::db::{audit, column, scalar, snapshot};
use inbox_test_support::process::{command, run, Proc};
use inbox_test_support::TestDb;
use serde_json::{json, Value};
use tokio_postgres::Client;

const TIMEOUT: Duration = Duration::from_secs(60);
const DAY: f64 = 24.0 * 3600.0;

/// `inbox-worker <args>` on `db`, with `USER=tester` (the default actor).
fn worker(db: &TestDb, args: &[&str]) -> std::process::Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).env("USER", "tester").args(args);
    cmd
}

/// Runs the command; returns (exit code, stdout + stderr).
async fn exec(db: &TestDb, args: &[&str]) -> (i32, String) {
    let cmd = worker(db, args);
    tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
}

/// Runs a command that must succeed; returns its output.
async fn ok(db: &TestDb, args: &[&str]) -> String {
    let (code, output) = exec(db, args).await;
    assert_eq!(code, 0, "inbox-worker {args:?} failed:\n{output}");
    output
}

/// Runs a command that must be refused (exit 1, `inbox-worker: error: …`); returns its output.
async fn refused(db: &TestDb, args: &[&str]) -> String {
    let (code, output) = exec(db, args).await;
    assert_eq!(code, 1, "inbox-worker {args:?} should be refused:\n{output}");
    assert!(output.contains("inbox-worker: error: "), "{output}");
    output
}

/// Runs `<args> --json`, which must succeed, and parses its stdout (only stdout: one document).
async fn json_of(db: &TestDb, args: &[&str]) -> Value {
    let mut cmd = worker(db, args);
    cmd.arg("--json");
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "inbox-worker {args:?} --json failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"))
}

/// The keys of a JSON object, sorted.
fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value.as_object().expect("a JSON object").keys().map(String::as_str).collect();
    keys.sort_unstable();
    keys
}

/// An inbox row to seed; times are relative to now, in seconds.
#[derive(Clone)]
struct Row {
    endpoint: &'static str,
    event_id: &'static str,
    event_type: &'static str,
    attempts: i32,
    last_error: Option<String>,
    received_ago: f64,
    available_in: f64,
    processed_ago: Option<f64>,
    /// Some: parked by a worker that long ago.
    parked_ago: Option<f64>,
    /// None: an invoice payload for `in_<event_id>`, customer `cus_1`, amount 100.
    payload: Option<Value>,
}

impl Default for Row {
    fn default() -> Self {
        Row {
            endpoint: "billing",
            event_id: "evt_1",
            event_type: "invoice.paid",
            attempts: 0,
            last_error: None,
            received_ago: 60.0,
            available_in: -60.0,
            processed_ago: None,
            parked_ago: None,
            payload: None,
        }
    }
}

/// A row a worker parked a minute ago at the default attempt limit (10), with an error.
fn parked(event_id: &'static str, error: &str) -> Row {
    Row {
        event_id,
        attempts: 10,
        last_error: Some(error.to_owned()),
        parked_ago: Some(60.0),
        ..Row::default()
    }
}

/// A row processed `ago` seconds ago.
fn processed(event_id: &'static str, ago: f64) -> Row {
    Row { event_id, attempts: 1, received_ago: ago + 1.0, processed_ago: Some(ago), ..Row::default() }
}

async fn seed(client: &Client, rows: &[Row]) {
    for r in rows {
        let payload = r.payload.clone().unwrap_or_else(|| {
            json!({"id": r.event_id, "type": r.event_type, "data": {"object": {
                "id": format!("in_{}", r.event_id), "customer": "cus_1", "amount_paid": 100}}})
        });
        client
            .execute(
                "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                            available_at, attempts, last_error, processed_at, parked_at)
                 VALUES ('stripe', $1, $2, $3, $4, now() - make_interval(secs => $5),
                         now() + make_interval(secs => $6), $7, $8,
                         now() - make_interval(secs => $9::float8), now() - make_interval(secs => $10::float8))",
                &[
                    &r.endpoint,
                    &r.event_id,
                    &r.event_type,
                    &payload,
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

/// (attempts, last_error, available now, processed) of one row.
async fn state(client: &Client, endpoint: &str, event_id: &str) -> (i32, Option<String>, bool, bool) {
    let r = client
        .query_one(
            "SELECT attempts, last_error, available_at <= now(), processed_at IS NOT NULL
               FROM webhook_inbox WHERE endpoint = $1 AND event_id = $2",
            &[&endpoint, &event_id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

/// The audit records of one operator command: a record without `target.run` starts a run (a
/// command on one event has only that one); the records of its batches, and purge's last one,
/// name it in `target.run`.
#[derive(Debug)]
struct AuditRun {
    id: i64,
    actor: String,
    action: String,
    /// The first record's target.
    target: Value,
    /// The first record's `affected`.
    first_affected: i32,
    /// The records after the first, in order: (target, affected).
    later: Vec<(Value, i32)>,
}

impl AuditRun {
    /// The rows the run changed, by its records.
    fn affected(&self) -> i64 {
        i64::from(self.first_affected) + self.later.iter().map(|(_, n)| i64::from(*n)).sum::<i64>()
    }

    /// `affected` of each batch record.
    fn batches(&self) -> Vec<i32> {
        self.later.iter().filter(|(t, _)| t.get("batch").is_some()).map(|(_, n)| *n).collect()
    }

    /// The record saying how the run ended (purge's last).
    fn end(&self) -> Option<&Value> {
        self.later.iter().map(|(t, _)| t).find(|t| t.get("outcome").is_some())
    }
}

/// The audit records grouped into runs, oldest first.
async fn audit_runs(client: &Client) -> Vec<AuditRun> {
    let mut runs: Vec<AuditRun> = Vec::new();
    for r in client
        .query("SELECT id, actor, action, target, affected FROM operator_audit ORDER BY id", &[])
        .await
        .unwrap()
    {
        let (id, target, affected): (i64, Value, i32) = (r.get(0), r.get(3), r.get(4));
        match target.get("run").and_then(Value::as_i64) {
            Some(run) => {
                let owner = runs.iter_mut().find(|r| r.id == run).expect("a record of an unknown run");
                owner.later.push((target, affected));
            }
            None => runs.push(AuditRun {
                id,
                actor: r.get(1),
                action: r.get(2),
                target,
                first_affected: affected,
                later: Vec::new(),
            }),
        }
    }
    runs
}

/// `n` rows a worker parked, `evt_0001` (received first) to `evt_<n>`, with the error `boom`.
async fn seed_parked(client: &Client, n: i32) {
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        attempts, last_error, parked_at)
             SELECT 'stripe', 'billing', 'evt_' || lpad(i::text, 4, '0'), 'invoice.paid',
                    jsonb_build_object('id', 'evt_' || i), now() - interval '1 day' + i * interval '1 s',
                    10, 'boom', now() - interval '1 minute'
               FROM generate_series(1, $1) AS i",
            &[&n],
        )
        .await
        .unwrap();
}

/// How many rows are parked.
async fn parked_count(client: &Client) -> i64 {
    scalar(client, "SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL").await
}

// ------------------------------------------------------------------------------------------ stats

#[tokio::test]
async fn stats_counts_every_state_as_json_and_as_a_table() {
    let db = TestDb::new().await;
    let client = db.client().await;

    let empty = json_of(&db, &["stats"]).await;
    assert_eq!(
        empty,
        json!({"unprocessed": 0, "ready": 0, "leased": 0, "retry_wait": 0, "needs_review": 0,
               "oldest_unprocessed_age_seconds": null, "processed_last_hour": 0, "no_handler": 0,
               "by_event_type": [], "by_secret": [], "workers": [],
               "outbox": {"pending": 0, "parked": 0, "oldest_pending_age_seconds": null,
                          "blocked_aggregates": 0, "blocked_rows": 0}})
    );

    seed(
        &client,
        &[
            Row { event_id: "evt_ready", received_ago: 600.0, ..Row::default() },
            Row { event_id: "evt_leased", attempts: 1, available_in: 120.0, ..Row::default() },
            Row {
                event_id: "evt_retry",
                event_type: "invoice.created",
                attempts: 2,
                available_in: 30.0,
                last_error: Some("boom".into()),
                ..Row::default()
            },
            Row { received_ago: 7200.0, ..parked("evt_parked", "database down") },
            Row { event_type: "invoice.created", ..processed("evt_recent", 600.0) },
            Row { event_type: "invoice.voided", ..processed("evt_old", 7200.0) },
        ],
    )
    .await;

    let stats = json_of(&db, &["stats"]).await;
    assert_eq!(
        keys(&stats),
        [
            "by_event_type",
            "by_secret",
            "leased",
            "needs_review",
            "no_handler",
            "oldest_unprocessed_age_seconds",
            "outbox",
            "processed_last_hour",
            "ready",
            "retry_wait",
            "unprocessed",
            "workers"
        ]
    );
    assert_eq!(stats["unprocessed"], 4);
    assert_eq!(stats["ready"], 1);
    assert_eq!(stats["leased"], 1);
    assert_eq!(stats["retry_wait"], 1);
    assert_eq!(stats["needs_review"], 1);
    assert_eq!(stats["processed_last_hour"], 1);
    let age = stats["oldest_unprocessed_age_seconds"].as_f64().expect("a number");
    assert!((7200.0..7260.0).contains(&age), "{age}");
    // A type shows when it has unprocessed rows or rows processed in the last hour; sorted.
    assert_eq!(
        stats["by_event_type"],
        json!([
            {"event_type": "invoice.created", "unprocessed": 1, "needs_review": 0, "no_handler": 0, "processed_last_hour": 1},
            {"event_type": "invoice.paid", "unprocessed": 3, "needs_review": 1, "no_handler": 0, "processed_last_hour": 0},
        ])
    );

    // Parked is the row's state, not the reader's limit: an operator's --max-attempts changes nothing.
    // The limit is `run`'s alone: the operator commands take no such flag, and its variable does
    // not change what they see.
    let (code, output) = exec(&db, &["stats", "--max-attempts", "2"]).await;
    assert_eq!(code, 2, "a usage error: {output}");
    let mut cmd = worker(&db, &["stats", "--json"]);
    cmd.env("INBOX_MAX_ATTEMPTS", "2");
    let out = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    let mut low: Value = serde_json::from_slice(&out.stdout).unwrap();
    low["oldest_unprocessed_age_seconds"] = stats["oldest_unprocessed_age_seconds"].clone();
    assert_eq!(low, stats, "stats with INBOX_MAX_ATTEMPTS=2");

    let table = ok(&db, &["stats"]).await;
    for needle in ["unprocessed", "ready", "leased", "retry_wait", "needs_review", "oldest_unprocessed_age"] {
        assert!(table.contains(needle), "{needle} missing:\n{table}");
    }
    assert!(table.contains("invoice.created") && table.contains("invoice.paid"), "{table}");
    assert!(!table.contains("invoice.voided"), "{table}");

    // The worker's gauges agree, from the unprocessed rows alone.
    let gauges = inbox_domain::inbox::store::admin::queue_gauges(&client).await.unwrap();
    assert_eq!((gauges.unprocessed, gauges.needs_review, gauges.ready), (4, 1, 1));
    assert!((7200.0..7260.0).contains(&gauges.oldest_unprocessed_age_seconds));
    client.execute("DELETE FROM webhook_inbox WHERE processed_at IS NULL", &[]).await.unwrap();
    let gauges = inbox_domain::inbox::store::admin::queue_gauges(&client).await.unwrap();
    assert_eq!(gauges.oldest_unprocessed_age_seconds, 0.0);
    assert_eq!(gauges.unprocessed, 0);
}

// ----------------------------------------------------------------------------------- needs-review

#[tokio::test]
async fn needs_review_lists_parked_rows_oldest_first() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let long_error = format!("payload: {}", "data.object.customer is missing; ".repeat(8));
    seed(
        &client,
        &[
            Row { received_ago: 300.0, ..parked("evt_newer", "statement timeout (57014)") },
            Row {
                endpoint: "analytics",
                event_type: "invoice.created",
                received_ago: 900.0,
                attempts: 12,
                ..parked("evt_older", &long_error)
            },
            Row { event_id: "evt_retrying", attempts: 3, last_error: Some("boom".into()), ..Row::default() },
            Row { attempts: 10, ..processed("evt_done", 60.0) },
        ],
    )
    .await;

    let listed = json_of(&db, &["needs-review"]).await;
    assert_eq!(keys(&listed), ["count", "rows"]);
    assert_eq!(listed["count"], 2);
    let rows = listed["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let older = &rows[0];
    assert_eq!(
        keys(older),
        [
            "account",
            "api_version",
            "attempts",
            "endpoint",
            "event_id",
            "event_type",
            "held",
            "last_error",
            "livemode",
            "parked_at",
            "provider",
            "received_at"
        ]
    );
    assert_eq!(older["provider"], "stripe");
    assert_eq!(older["endpoint"], "analytics");
    assert_eq!(older["event_id"], "evt_older");
    assert_eq!(older["event_type"], "invoice.created");
    assert_eq!(older["attempts"], 12);
    assert_eq!(older["last_error"], long_error.as_str(), "JSON has the whole error");
    assert_eq!(rows[1]["event_id"], "evt_newer");
    assert_eq!(rows[1]["last_error"], "statement timeout (57014)");
    // RFC 3339 in UTC, as the database has it.
    let expected: String = client
        .query_one(
            "SELECT to_char(received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
               FROM webhook_inbox WHERE event_id = 'evt_older'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(older["received_at"], expected.as_str());
    let text = older["received_at"].as_str().unwrap();
    assert!(text.len() == 24 && &text[10..11] == "T" && text.ends_with('Z'), "{text}");

    let first = json_of(&db, &["needs-review", "--limit", "1"]).await;
    assert_eq!(first["count"], 1);
    assert_eq!(first["rows"][0]["event_id"], "evt_older");

    let table = ok(&db, &["needs-review"]).await;
    let lines: Vec<&str> = table.lines().collect();
    let header = lines.iter().position(|l| l.contains("event_id") && l.contains("last_error")).unwrap();
    assert!(lines[header + 1].contains("evt_older") && lines[header + 2].contains("evt_newer"), "{table}");
    // Columns aligned: each row's event_type starts where the header's does.
    let column = lines[header].find("event_type").unwrap();
    assert_eq!(lines[header + 1].find("invoice.created"), Some(column), "{table}");
    assert_eq!(lines[header + 2].find("invoice.paid"), Some(column), "{table}");
    // The table cuts the long error; the beginning is there.
    assert!(!table.contains(&long_error), "{table}");
    assert!(table.contains(&long_error[..60]), "{table}");
    assert!(lines[header + 1].chars().count() < 250, "{table}");
    assert!(!table.contains("evt_retrying") && !table.contains("evt_done"), "{table}");
}

// ---------------------------------------------------------------------------------------- requeue

#[tokio::test]
async fn requeue_of_one_row_resets_attempts_keeps_the_error_and_is_audited() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            Row { available_in: 120.0, ..parked("evt_parked", "statement timeout (57014)") },
            Row {
                event_id: "evt_waiting",
                attempts: 3,
                available_in: 200.0,
                last_error: Some("boom".into()),
                ..Row::default()
            },
        ],
    )
    .await;

    let report = json_of(&db, &["requeue", "--event-id", "evt_parked", "--actor", "alice"]).await;
    assert_eq!(
        report,
        json!({"action": "requeue", "dry_run": false, "matched": 1, "requeued": 1, "rows": [
            {"endpoint": "billing", "event_id": "evt_parked", "event_type": "invoice.paid", "attempts": 10}
        ]})
    );
    assert_eq!(
        state(&client, "billing", "evt_parked").await,
        (0, Some("statement timeout (57014)".into()), true, false),
        "attempts 0, available now, last_error kept for history"
    );

    // A row waiting for its retry can be brought forward too.
    let output = ok(&db, &["requeue", "--event-id", "evt_waiting", "--endpoint", "billing"]).await;
    assert!(output.contains("requeued 1 row"), "{output}");
    assert_eq!(state(&client, "billing", "evt_waiting").await, (0, Some("boom".into()), true, false));

    assert_eq!(
        audit(&client).await,
        [
            (
                "alice".to_owned(),
                "requeue".to_owned(),
                json!({"provider": "stripe", "endpoint": "billing", "event_id": "evt_parked"}),
                1
            ),
            (
                "tester".to_owned(),
                "requeue".to_owned(),
                json!({"provider": "stripe", "endpoint": "billing", "event_id": "evt_waiting"}),
                1
            ),
        ]
    );
}

#[tokio::test]
async fn requeue_refuses_processed_unknown_and_ambiguous_ids() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            processed("evt_done", 60.0),
            parked("evt_dup", "boom"),
            Row { endpoint: "analytics", ..parked("evt_dup", "boom") },
        ],
    )
    .await;
    let before = snapshot(&client).await;

    let output = refused(&db, &["requeue", "--event-id", "evt_done"]).await;
    assert!(output.contains("was processed at"), "{output}");
    assert!(output.contains("use `replay`"), "the message points to replay: {output}");

    let output = refused(&db, &["requeue", "--event-id", "evt_nope"]).await;
    assert!(output.contains("no event evt_nope in the inbox"), "{output}");

    let output = refused(&db, &["requeue", "--event-id", "evt_dup"]).await;
    assert!(output.contains("analytics, billing") && output.contains("--endpoint"), "{output}");

    let output = refused(&db, &["requeue", "--event-id", "evt_dup", "--endpoint", "shipping"]).await;
    assert!(output.contains("no event evt_dup for endpoint shipping"), "{output}");

    assert_eq!(snapshot(&client).await, before, "refusals change nothing");
    assert!(audit(&client).await.is_empty(), "and audit nothing");

    ok(&db, &["requeue", "--event-id", "evt_dup", "--endpoint", "analytics"]).await;
    assert_eq!(state(&client, "analytics", "evt_dup").await.0, 0);
    assert_eq!(state(&client, "billing", "evt_dup").await.0, 10, "the other endpoint's row is untouched");
}

#[tokio::test]
async fn requeue_all_touches_only_the_matching_parked_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            Row { received_ago: 500.0, ..parked("evt_a", "statement timeout (57014)") },
            Row { received_ago: 400.0, ..parked("evt_b", "payload: data.object.customer is missing") },
            Row { event_type: "invoice.created", ..parked("evt_c", "statement timeout (57014)") },
            Row {
                event_id: "evt_d",
                attempts: 3,
                available_in: 60.0,
                last_error: Some("statement timeout (57014)".into()),
                ..Row::default()
            },
            Row { attempts: 10, ..processed("evt_e", 60.0) },
            parked("evt_f", "disk 100% full"),
            parked("evt_g", "disk 1000 full"),
        ],
    )
    .await;

    // Event type and error text (case-insensitive) narrow it.
    let report = json_of(
        &db,
        &[
            "requeue",
            "--all",
            "--event-type",
            "invoice.paid",
            "--error-contains",
            "STATEMENT timeout",
            "--actor",
            "bob",
        ],
    )
    .await;
    let audit_id = report["audit_id"].as_i64().expect("the run's first audit record");
    assert_eq!(
        report,
        json!({"action": "requeue", "dry_run": false, "matched": 1, "requeued": 1, "batches": 1,
               "audit_id": audit_id, "rows": [
            {"endpoint": "billing", "event_id": "evt_a", "event_type": "invoice.paid", "attempts": 10}
        ]})
    );
    assert_eq!(state(&client, "billing", "evt_a").await.0, 0);
    for (id, attempts) in [("evt_b", 10), ("evt_c", 10), ("evt_d", 3), ("evt_e", 10), ("evt_f", 10)] {
        assert_eq!(state(&client, "billing", id).await.0, attempts, "{id}");
    }
    assert!(!state(&client, "billing", "evt_d").await.2, "a row waiting for its retry is not parked");

    // % and _ in the text are literal: "100%" does not match "1000 full".
    let output = ok(&db, &["requeue", "--all", "--error-contains", "100%"]).await;
    let matched = output.find("1 parked row matches").expect(&output);
    assert!(matched < output.find("requeued 1 row").expect(&output), "the count comes first:\n{output}");
    assert!(output.contains("evt_f") && !output.contains("evt_g"), "{output}");
    assert_eq!(state(&client, "billing", "evt_f").await.0, 0);
    assert_eq!(state(&client, "billing", "evt_g").await.0, 10);

    // Everything still parked; never the processed row nor the retrying one.
    let output = ok(&db, &["requeue", "--all"]).await;
    assert!(output.contains("3 parked rows match"), "{output}");
    for id in ["evt_a", "evt_b", "evt_c", "evt_f", "evt_g"] {
        assert_eq!(state(&client, "billing", id).await.0, 0, "{id}");
    }
    assert_eq!(state(&client, "billing", "evt_d").await.0, 3);
    assert_eq!(state(&client, "billing", "evt_e").await, (10, None, true, true));

    // Nothing left: not an error, and the attempt is on record.
    let output = ok(&db, &["requeue", "--all", "--event-type", "invoice.voided"]).await;
    assert!(output.contains("0 parked rows match") && output.contains("requeued 0 rows"), "{output}");

    let runs = audit_runs(&client).await;
    let summary: Vec<(&str, &str, i64)> =
        runs.iter().map(|r| (r.actor.as_str(), r.action.as_str(), r.affected())).collect();
    assert_eq!(
        summary,
        [("bob", "requeue", 1), ("tester", "requeue", 1), ("tester", "requeue", 3), ("tester", "requeue", 0)]
    );
    // A run: what it is about to do, written before any change; then one record per batch.
    assert_eq!(runs[0].id, audit_id);
    assert_eq!(
        runs[0].target,
        json!({"provider": "stripe", "all": true,
               "event_type": "invoice.paid", "error_contains": "STATEMENT timeout",
               "matched": 1, "limit": null, "batch_size": 1000})
    );
    assert_eq!(runs[0].first_affected, 0);
    assert_eq!(runs[0].later, [(json!({"provider": "stripe", "run": audit_id, "batch": 1}), 1)]);
    assert_eq!(runs[3].target["event_type"], "invoice.voided");
    assert_eq!(runs[3].target["error_contains"], Value::Null);
    assert!(runs[3].later.is_empty(), "nothing matched: the attempt alone is on record");
}

#[tokio::test]
async fn dry_runs_change_nothing_and_write_no_audit() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            parked("evt_p1", "boom"),
            parked("evt_p2", "boom"),
            processed("evt_old1", 40.0 * DAY),
            processed("evt_old2", 40.0 * DAY),
        ],
    )
    .await;
    let before = snapshot(&client).await;

    let report = json_of(&db, &["requeue", "--all", "--dry-run"]).await;
    assert_eq!(keys(&report), ["action", "dry_run", "matched", "requeued", "rows"]);
    assert_eq!(report["action"], "requeue");
    assert_eq!(report["dry_run"], true);
    assert_eq!(report["matched"], 2);
    assert_eq!(report["requeued"], 0);
    assert_eq!(report["rows"].as_array().unwrap().len(), 2);

    let output = ok(&db, &["requeue", "--event-id", "evt_p1", "--dry-run"]).await;
    assert!(output.contains("dry run") && output.contains("evt_p1"), "{output}");
    // The refusals still apply in a dry run.
    let output = refused(&db, &["requeue", "--event-id", "evt_old1", "--dry-run"]).await;
    assert!(output.contains("replay"), "{output}");

    let report = json_of(&db, &["purge", "--older-than", "30d", "--dry-run"]).await;
    assert_eq!(report["action"], "purge");
    assert_eq!(report["dry_run"], true);
    assert_eq!(report["matched"], 2);
    assert!(report.get("deleted").is_none(), "{report}");
    let output = ok(&db, &["purge", "--older-than", "30d", "--dry-run"]).await;
    assert!(output.contains("dry run: 2 processed rows"), "{output}");

    assert_eq!(snapshot(&client).await, before);
    assert!(audit(&client).await.is_empty());
}

// ----------------------------------------------------------------------------------------- replay

/// `replay --event-id --dry-run` runs the handler in a transaction that is rolled back: a processed
/// `invoice.paid` whose booking is missing reports the booking (and the invoice, and the outbox row)
/// a replay would make, and nothing changes — no business row, not the event's processed mark; the
/// look is audited. With the booking there, it reports that a replay would book nothing.
#[tokio::test]
async fn replay_dry_run_reports_the_booking_it_would_make_and_changes_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[processed("evt_dry", 3600.0)]).await;
    async fn marked(client: &Client) -> String {
        client
            .query_one("SELECT processed_at::text FROM webhook_inbox WHERE event_id = 'evt_dry'", &[])
            .await
            .unwrap()
            .get(0)
    }
    let before = marked(&client).await;

    let report = json_of(&db, &["replay", "--event-id", "evt_dry", "--dry-run", "--actor", "dora"]).await;
    assert_eq!(report["action"], "replay-dry-run");
    assert_eq!(report["changed"], false);
    let changes = report["would_change"].as_array().expect("per table");
    let table = |name: &str| changes.iter().find(|c| c["table"] == name).cloned().unwrap_or(json!(null));
    assert_eq!(table("ledger_entries")["inserted"], 1, "{report}");
    assert_eq!(table("ledger_entries")["rows"][0]["invoice_id"], "in_evt_dry", "{report}");
    assert_eq!(table("ledger_entries")["rows"][0]["amount"], 100, "{report}");
    assert_eq!(table("outbox")["inserted"], 1, "{report}");
    assert_eq!(table("outbox")["rows"][0]["event_type"], "InvoicePaymentBooked", "{report}");
    assert_eq!(table("invoices")["inserted"], 1, "{report}");

    // Nothing changed.
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
    assert_eq!((records[0].0.as_str(), records[0].1.as_str(), records[0].3), ("dora", "replay-dry-run", 0));
    assert_eq!(records[0].2["would_change"]["ledger_entries"]["inserted"], 1, "{}", records[0].2);

    // Once replayed for real, a dry run says a replay would book nothing more.
    ok(&db, &["replay", "--event-id", "evt_dry"]).await;
    let output = ok(&db, &["replay", "--event-id", "evt_dry", "--dry-run"]).await;
    assert!(output.contains("nothing changed (rolled back)"), "{output}");
    assert!(!output.contains("ledger_entries"), "no booking: {output}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
}

#[tokio::test]
async fn replay_repairs_missing_business_rows_and_never_double_books() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[processed("evt_paid", 3600.0)]).await;
    /// (paid invoices, ledger bookings, outbox rows) of `in_evt_paid`.
    async fn business(client: &Client) -> (i64, i64, i64) {
        (
            scalar(client, "SELECT count(*) FROM invoices WHERE id = 'in_evt_paid' AND status = 'paid'")
                .await,
            scalar(client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_evt_paid'").await,
            scalar(client, "SELECT count(*) FROM outbox WHERE aggregate_id = 'in_evt_paid'").await,
        )
    }
    assert_eq!(business(&client).await, (0, 0, 0), "the business rows are missing");

    let report = json_of(&db, &["replay", "--event-id", "evt_paid", "--actor", "carol"]).await;
    let audit_id = report["audit_id"].as_i64().expect("the audit record's id");
    assert_eq!(
        report,
        json!({"action": "replay", "endpoint": "billing", "event_id": "evt_paid",
               "event_type": "invoice.paid", "audit_id": audit_id})
    );
    assert_eq!(business(&client).await, (1, 1, 1), "re-created");
    let amount = scalar(&client, "SELECT amount FROM ledger_entries WHERE invoice_id = 'in_evt_paid'").await;
    assert_eq!(amount, 100);
    let renewed = scalar(
        &client,
        "SELECT count(*) FROM webhook_inbox
          WHERE event_id = 'evt_paid' AND processed_at > now() - interval '1 minute' AND last_error IS NULL",
    )
    .await;
    assert_eq!(renewed, 1, "processed_at renewed");

    // Again, with the ledger row there: nothing is booked twice.
    let output = ok(&db, &["replay", "--event-id", "evt_paid", "--endpoint", "billing"]).await;
    assert!(output.contains("replayed event evt_paid") && output.contains("handler applied"), "{output}");
    assert_eq!(business(&client).await, (1, 1, 1));

    // Deleted business rows come back.
    client.batch_execute("DELETE FROM ledger_entries; DELETE FROM invoices;").await.unwrap();
    ok(&db, &["replay", "--event-id", "evt_paid"]).await;
    assert_eq!(business(&client).await.0, 1);
    assert_eq!(business(&client).await.1, 1);

    let records = audit(&client).await;
    let summary: Vec<(&str, &str, i32)> =
        records.iter().map(|(actor, action, _, n)| (actor.as_str(), action.as_str(), *n)).collect();
    assert_eq!(summary, [("carol", "replay", 1), ("tester", "replay", 1), ("tester", "replay", 1)]);
    assert_eq!(records[0].2["event_id"], "evt_paid");
    assert_eq!(records[0].2["endpoint"], "billing");
}

#[tokio::test]
async fn replay_of_a_type_this_binary_has_no_handler_for_is_refused_and_changes_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[Row { event_type: "customer.created", ..processed("evt_cus", 60.0) }]).await;
    let before = snapshot(&client).await;
    let output = refused(&db, &["replay", "--event-id", "evt_cus"]).await;
    assert!(
        output.contains("customer.created event, which this binary has no handler for")
            && output.contains("invoice.paid")
            && output.contains("nothing changed"),
        "{output}"
    );
    assert_eq!(snapshot(&client).await, before, "processed_at not renewed");
    assert!(audit(&client).await.is_empty(), "no audit record for a replay that did nothing");
}

#[tokio::test]
async fn replay_refuses_unprocessed_unknown_ambiguous_and_rolls_back_a_failing_handler() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            parked("evt_parked", "boom"),
            processed("evt_dup", 60.0),
            Row { endpoint: "analytics", ..processed("evt_dup", 60.0) },
            Row {
                payload: Some(json!({"id": "evt_bad", "type": "invoice.paid",
                                     "data": {"object": {"id": "in_bad", "customer": "cus_1"}}})),
                ..processed("evt_bad", 600.0)
            },
        ],
    )
    .await;
    let before = snapshot(&client).await;

    let output = refused(&db, &["replay", "--event-id", "evt_parked"]).await;
    assert!(output.contains("is not processed yet; requeue it instead"), "{output}");
    let output = refused(&db, &["replay", "--event-id", "evt_nope"]).await;
    assert!(output.contains("no event evt_nope in the inbox"), "{output}");
    let output = refused(&db, &["replay", "--event-id", "evt_dup"]).await;
    assert!(output.contains("analytics, billing") && output.contains("--endpoint"), "{output}");

    // The handler fails (no amount_paid): everything rolls back, the row stays as it was.
    let output = refused(&db, &["replay", "--event-id", "evt_bad"]).await;
    assert!(output.contains("nothing changed") && output.contains("amount_paid"), "{output}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices").await, 0);

    assert_eq!(snapshot(&client).await, before, "refusals change nothing");
    assert!(audit(&client).await.is_empty());

    ok(&db, &["replay", "--event-id", "evt_dup", "--endpoint", "analytics"]).await;
    assert_eq!(audit(&client).await.len(), 1);
}

// ------------------------------------------------------------------------------------------ purge

#[tokio::test]
async fn purge_refuses_an_age_inside_the_retry_window_unless_forced() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            processed("evt_2d_a", 2.0 * DAY),
            processed("evt_2d_b", 2.0 * DAY),
            processed("evt_40d", 40.0 * DAY),
        ],
    )
    .await;

    let output = refused(&db, &["purge", "--older-than", "1d"]).await;
    assert!(output.contains("3-day retry window") && output.contains("--force"), "{output}");
    assert_eq!(db.count("webhook_inbox").await, 3, "nothing deleted");
    assert!(audit(&client).await.is_empty());

    // Exactly the window is allowed.
    let output = ok(&db, &["purge", "--older-than", "3d"]).await;
    assert!(output.contains("deleted 1 processed row"), "{output}");
    assert_eq!(db.count("webhook_inbox").await, 2);

    let report = json_of(&db, &["purge", "--older-than", "1d", "--force", "--actor", "erin"]).await;
    assert_eq!(report["action"], "purge");
    assert_eq!(report["dry_run"], false);
    assert_eq!(report["deleted"], 2);
    assert_eq!(db.count("webhook_inbox").await, 0);

    let runs = audit_runs(&client).await;
    assert_eq!(runs.len(), 2);
    assert_eq!((runs[1].actor.as_str(), runs[1].action.as_str(), runs[1].affected()), ("erin", "purge", 2));
    assert_eq!(runs[1].target["older_than_seconds"], 86_400);
    assert_eq!(runs[1].target["force"], true);
}

#[tokio::test]
async fn purge_deletes_in_batches_and_never_touches_unprocessed_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            processed("evt_old1", 40.0 * DAY),
            processed("evt_old2", 40.0 * DAY),
            processed("evt_old3", 35.0 * DAY),
            processed("evt_old4", 31.0 * DAY),
            processed("evt_old5", 50.0 * DAY),
            processed("evt_recent", DAY),
            // Received long ago but never processed: never purged, whatever their age.
            Row { received_ago: 60.0 * DAY, ..parked("evt_parked", "boom") },
            Row { event_id: "evt_queued", received_ago: 60.0 * DAY, ..Row::default() },
        ],
    )
    .await;

    let report =
        json_of(&db, &["purge", "--older-than", "30d", "--batch-size", "2", "--actor", "dave"]).await;
    assert_eq!(report["action"], "purge");
    assert_eq!(report["dry_run"], false);
    assert_eq!(report["deleted"], 5);
    assert_eq!(report["batches"], 3, "5 rows in batches of 2: {report}");
    assert!(report.get("matched").is_none(), "{report}");

    let left: Vec<String> = column(&client, "SELECT event_id FROM webhook_inbox ORDER BY event_id").await;
    assert_eq!(left, ["evt_parked", "evt_queued", "evt_recent"]);

    // The run: its first record (before the first delete), one per batch, how it ended.
    let runs = audit_runs(&client).await;
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert_eq!(report["audit_id"], run.id);
    assert_eq!((run.actor.as_str(), run.action.as_str(), run.affected()), ("dave", "purge", 5));
    assert_eq!(run.first_affected, 0);
    assert_eq!(run.target["older_than_seconds"], 30 * 86_400);
    assert_eq!(run.target["cutoff"], report["cutoff"]);
    assert!(run.target["cutoff"].as_str().is_some_and(|c| c.ends_with('Z')), "{}", run.target);
    assert_eq!(run.batches(), [2, 2, 1]);
    assert_eq!(
        run.end(),
        Some(
            &json!({"provider": "stripe", "run": run.id, "outcome": "completed", "deleted": 5, "batches": 3,
                    "outbox_deleted": 0})
        )
    );

    // Nothing more to purge: still fine, still on record.
    let output = ok(&db, &["purge", "--older-than", "30d"]).await;
    assert!(output.contains("deleted 0 processed rows"), "{output}");
    let runs = audit_runs(&client).await;
    assert_eq!(runs.len(), 2);
    assert_eq!((runs[1].affected(), runs[1].batches().len()), (0, 0));
    assert_eq!(runs[1].end().unwrap()["outcome"], "completed");
    assert_eq!(db.count("webhook_inbox").await, 3);
}

// ------------------------------------------------------------------- requeue --all and purge at scale

#[tokio::test]
async fn requeue_all_works_in_batches_each_its_own_transaction_with_its_audit_record() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, 7).await;
    // Held on arrival: --all leaves it, and says so.
    seed(&client, &[Row { received_ago: 10.0 * DAY, ..parked("evt_held", "declared live") }]).await;
    client
        .execute("UPDATE webhook_inbox SET held = 'livemode' WHERE event_id = 'evt_held'", &[])
        .await
        .unwrap();

    let output = ok(&db, &["requeue", "--all", "--batch-size", "3", "--actor", "frank"]).await;
    assert!(output.contains("7 parked rows match"), "{output}");
    assert!(output.contains("1 more held on arrival"), "{output}");
    assert!(output.contains("requeued 7 rows (attempts 0, available now) in 3 batches"), "{output}");
    assert_eq!(parked_count(&client).await, 1, "only the held row is still parked");
    assert_eq!(state(&client, "billing", "evt_0007").await, (0, Some("boom".into()), true, false));

    // Three transactions, oldest rows first: the rows each wrote share its transaction id.
    let writers: Vec<String> = column(
        &client,
        "SELECT xmin::text FROM webhook_inbox WHERE event_id <> 'evt_held' ORDER BY received_at",
    )
    .await;
    let batch_of = |i: usize| &writers[i];
    assert!(batch_of(0) == batch_of(1) && batch_of(1) == batch_of(2), "{writers:?}");
    assert!(batch_of(3) == batch_of(4) && batch_of(4) == batch_of(5), "{writers:?}");
    assert!(batch_of(2) != batch_of(3) && batch_of(5) != batch_of(6), "{writers:?}");

    // One run: its first record before any change, then one per batch.
    let runs = audit_runs(&client).await;
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert_eq!((run.actor.as_str(), run.action.as_str(), run.first_affected), ("frank", "requeue", 0));
    assert_eq!((run.target["matched"].as_i64(), run.target["batch_size"].as_i64()), (Some(7), Some(3)));
    assert_eq!(
        run.later,
        [1, 2, 3]
            .iter()
            .zip([3, 3, 1])
            .map(|(batch, n)| (json!({"provider": "stripe", "run": run.id, "batch": batch}), n))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn requeue_all_limit_takes_the_oldest_rows_and_a_dry_run_shows_them() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, 5).await;

    let report = json_of(&db, &["requeue", "--all", "--limit", "2", "--dry-run"]).await;
    assert_eq!((report["matched"].as_i64(), report["requeued"].as_i64()), (Some(5), Some(0)));
    let listed: Vec<&str> =
        report["rows"].as_array().unwrap().iter().map(|r| r["event_id"].as_str().unwrap()).collect();
    assert_eq!(listed, ["evt_0001", "evt_0002"]);
    assert_eq!(parked_count(&client).await, 5, "a dry run changes nothing");
    assert!(audit_runs(&client).await.is_empty());

    let output = ok(&db, &["requeue", "--all", "--limit", "2"]).await;
    assert!(output.contains("5 parked rows match (--limit: the oldest 2)"), "{output}");
    assert!(output.contains("requeued 2 rows"), "{output}");
    let parked: Vec<String> =
        column(&client, "SELECT event_id FROM webhook_inbox WHERE parked_at IS NOT NULL ORDER BY event_id")
            .await;
    assert_eq!(parked, ["evt_0003", "evt_0004", "evt_0005"]);
    let runs = audit_runs(&client).await;
    assert_eq!((runs.len(), runs[0].affected(), runs[0].target["limit"].as_i64()), (1, 2, Some(2)));
}

#[tokio::test]
async fn requeue_all_of_more_than_100_rows_needs_yes_and_a_dry_run_does_not() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, 250).await;
    let before = snapshot(&client).await;

    let output = refused(&db, &["requeue", "--all"]).await;
    assert!(output.contains("250 parked rows match"), "the count comes first: {output}");
    assert!(output.contains("250 rows would be requeued") && output.contains("--yes"), "{output}");
    assert!(output.contains("nothing changed"), "{output}");
    assert_eq!(snapshot(&client).await, before, "refused: nothing changed");
    assert!(audit(&client).await.is_empty(), "and nothing audited");

    let report = json_of(&db, &["requeue", "--all", "--dry-run"]).await;
    assert_eq!(report["rows"].as_array().unwrap().len(), 250, "a dry run lists them without --yes");
    assert_eq!(snapshot(&client).await, before);

    // 100 at once is fine without --yes.
    let output = ok(&db, &["requeue", "--all", "--limit", "100"]).await;
    assert!(output.contains("requeued 100 rows"), "{output}");
    assert_eq!(parked_count(&client).await, 150);

    let output = refused(&db, &["requeue", "--all"]).await;
    assert!(output.contains("150 rows would be requeued"), "{output}");
    assert_eq!(parked_count(&client).await, 150);

    let output = ok(&db, &["requeue", "--all", "--yes"]).await;
    assert!(output.contains("requeued 150 rows"), "{output}");
    assert_eq!(parked_count(&client).await, 0);
    let sums: Vec<i64> = audit_runs(&client).await.iter().map(AuditRun::affected).collect();
    assert_eq!(sums, [100, 150]);
}

#[tokio::test]
async fn requeue_all_leaves_a_row_another_session_holds_instead_of_waiting_for_it() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    seed_parked(&client, 3).await;
    // Another session holds the oldest row (a replay or a requeue of that event, say).
    let holder = client.transaction().await.unwrap();
    holder.execute("SELECT 1 FROM webhook_inbox WHERE event_id = 'evt_0001' FOR UPDATE", &[]).await.unwrap();

    let started = std::time::Instant::now();
    let output = ok(&db, &["requeue", "--all"]).await;
    assert!(started.elapsed() < Duration::from_secs(5), "it did not wait for the lock: {output}");
    assert!(output.contains("requeued 2 rows"), "{output}");
    assert!(output.contains("1 of the 3 counted was not requeued"), "{output}");
    holder.rollback().await.unwrap();
    let parked: Vec<String> =
        column(&client, "SELECT event_id FROM webhook_inbox WHERE parked_at IS NOT NULL").await;
    assert_eq!(parked, ["evt_0001"]);
}

#[tokio::test]
async fn requeue_all_stopped_by_sigterm_ends_after_its_batch_and_says_how_far_it_got() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_parked(&client, 60).await;
    client
        .batch_execute(
            "-- Each requeued row takes 50 ms: a batch of 2, 100 ms; the whole run, 3 s.
             CREATE FUNCTION slow_update() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.05); RETURN NEW; END $$;
             CREATE TRIGGER slow_update BEFORE UPDATE ON webhook_inbox
                 FOR EACH ROW EXECUTE FUNCTION slow_update();",
        )
        .await
        .unwrap();

    let mut requeue = Proc::spawn(worker(&db, &["requeue", "--all", "--batch-size", "2"]));
    let deadline = std::time::Instant::now() + TIMEOUT;
    while parked_count(&client).await > 56 {
        let running = requeue.child.try_wait().unwrap().is_none();
        assert!(running && std::time::Instant::now() < deadline, "no batch done:\n{}", requeue.output());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    requeue.signal(libc::SIGTERM);
    let (status, output) = tokio::task::spawn_blocking(move || {
        let status = requeue.wait(TIMEOUT);
        (status, requeue.output())
    })
    .await
    .unwrap();

    assert_eq!(status.code(), Some(1), "{output}");
    let requeued = 60 - parked_count(&client).await;
    assert!((4..50).contains(&requeued), "stopped early, between batches: {requeued} requeued\n{output}");
    assert!(
        output.contains(&format!("interrupted by SIGTERM after requeuing {requeued} of 60 rows")),
        "{output}"
    );
    let runs = audit_runs(&client).await;
    assert_eq!((runs.len(), runs[0].affected()), (1, requeued), "{runs:?}");
}

/// A purge beside live traffic rests between its batches: at `--duty-cycle 25` it rests three
/// times as long as each batch took, at 100 never. Each deleted row takes 50 ms here (a trigger
/// that sleeps), so 10 batches of 2 work for ≥ 1 s, and rest ≥ 3 s more at 25 %: only lower bounds
/// are asserted (a sleep is never shorter), the rates themselves are the soak's. The duty cycle is
/// on record in the run's first audit record; one outside 1..=100 is refused before anything.
#[tokio::test]
async fn purge_rests_between_batches_for_the_share_of_time_its_duty_cycle_leaves() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let seed = |from: i32| {
        format!(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        attempts, processed_at)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', jsonb_build_object('id', 'evt_' || i),
                    now() - interval '41 days', 1, now() - interval '40 days'
               FROM generate_series({from}, {from} + 19) AS i"
        )
    };
    client
        .batch_execute(&format!(
            "{};
             CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.05); RETURN OLD; END $$;
             CREATE TRIGGER slow_delete BEFORE DELETE ON webhook_inbox
                 FOR EACH ROW EXECUTE FUNCTION slow_delete();",
            seed(1)
        ))
        .await
        .unwrap();

    let refused =
        run(worker(&db, &["purge", "--older-than", "30d", "--duty-cycle", "0", "--actor", "hal"]), TIMEOUT);
    assert_eq!(refused.0, 2, "{}", refused.1);
    assert!(refused.1.contains("--duty-cycle"), "{}", refused.1);
    assert_eq!(db.count("webhook_inbox").await, 20, "nothing deleted");

    let timed = |duty: &'static str| {
        let db = &db;
        async move {
            let started = std::time::Instant::now();
            let report = json_of(
                db,
                &[
                    "purge",
                    "--older-than",
                    "30d",
                    "--batch-size",
                    "2",
                    "--duty-cycle",
                    duty,
                    "--actor",
                    "hal",
                ],
            )
            .await;
            assert_eq!(report["deleted"], 20, "{report}");
            started.elapsed()
        }
    };
    let full = timed("100").await;
    assert!(full >= Duration::from_secs(1), "10 batches of 2 rows at 50 ms each: {full:?}");
    client.batch_execute(&seed(101)).await.unwrap();
    let quarter = timed("25").await;
    assert!(quarter >= Duration::from_secs(4), "1 s of deleting and three times that resting: {quarter:?}");

    let runs = audit_runs(&client).await;
    let cycles: Vec<i64> = runs.iter().filter_map(|r| r.target["duty_cycle"].as_i64()).collect();
    assert_eq!(cycles, [100, 25], "{runs:?}");
}

#[tokio::test]
async fn purge_stopped_by_sigterm_ends_after_its_batch_and_is_on_record() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        attempts, processed_at)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', jsonb_build_object('id', 'evt_' || i),
                    now() - interval '41 days', 1, now() - interval '40 days'
               FROM generate_series(1, 200) AS i;
             -- Each deleted row takes 50 ms: a batch of 2, 100 ms; the whole purge, 10 s.
             CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.05); RETURN OLD; END $$;
             CREATE TRIGGER slow_delete BEFORE DELETE ON webhook_inbox
                 FOR EACH ROW EXECUTE FUNCTION slow_delete();",
        )
        .await
        .unwrap();

    let mut purge = Proc::spawn(worker(
        &db,
        &["purge", "--older-than", "30d", "--batch-size", "2", "--json", "--actor", "gina"],
    ));
    // Some batches committed, most rows still there: stop it.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while db.count("webhook_inbox").await > 190 {
        let running = purge.child.try_wait().unwrap().is_none();
        assert!(running && std::time::Instant::now() < deadline, "no batch done:\n{}", purge.output());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    purge.signal(libc::SIGTERM);
    let (status, stdout, output) = tokio::task::spawn_blocking(move || {
        let status = purge.wait(TIMEOUT);
        (status, purge.stdout(), purge.output())
    })
    .await
    .unwrap();

    // It finished the batch in flight, started no other, and said so: exit 1 (not done).
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(output.contains("interrupted by SIGTERM") && output.contains("run it again"), "{output}");
    let deleted = 200 - db.count("webhook_inbox").await;
    assert!((10..150).contains(&deleted), "stopped early, between batches: {deleted} deleted\n{output}");
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(report["deleted"], deleted, "{report}");
    assert_eq!(report["interrupted_by"], "SIGTERM", "{report}");

    // On record: the first record (written before the first delete), every committed batch, the end.
    let runs = audit_runs(&client).await;
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    assert_eq!((run.actor.as_str(), run.action.as_str(), run.first_affected), ("gina", "purge", 0));
    assert_eq!(run.target["batch_size"], 2);
    assert_eq!(run.affected(), deleted, "the batch records add up to what was deleted");
    assert!(run.batches().iter().all(|n| *n == 2), "{run:?}");
    let end = run.end().expect("the record of how it ended");
    assert_eq!((end["outcome"].as_str(), end["deleted"].as_i64()), (Some("interrupted"), Some(deleted)));
}

#[tokio::test]
async fn purge_never_goes_under_twice_the_ingests_signature_tolerance_even_with_force() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[processed("evt_2m", 120.0), processed("evt_8m", 480.0), processed("evt_15m", 900.0)])
        .await;

    // The default tolerance is 5m: a signature up to 5m in the future is accepted until 5m after
    // it, 10m after the row arrived.
    for age in ["9m", "599s", "5m", "0"] {
        let output = refused(&db, &["purge", "--older-than", age, "--force"]).await;
        assert!(output.contains("twice the ingest's signature tolerance (5m × 2 = 10m"), "{output}");
        assert!(output.contains("--force"), "{output}");
    }
    // The ingest's own tolerance, from the variable it reads: 1h keeps rows younger than 2h.
    let mut cmd = worker(&db, &["purge", "--older-than", "1h", "--force"]);
    cmd.env("INBOX_SIGNATURE_TOLERANCE", "1h");
    let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("(1h × 2 = 2h"), "{output}");
    assert_eq!(db.count("webhook_inbox").await, 3, "nothing deleted");
    assert!(audit(&client).await.is_empty());

    let output = ok(&db, &["purge", "--older-than", "10m", "--force"]).await;
    assert!(output.contains("deleted 1 processed row "), "{output}");
    let left: Vec<String> = column(&client, "SELECT event_id FROM webhook_inbox ORDER BY event_id").await;
    assert_eq!(left, ["evt_2m", "evt_8m"]);
}

#[tokio::test]
async fn purge_batches_do_not_read_again_the_pages_of_rows_deleted_before_them() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // 10,000 rows of ~450 bytes: ~1,400 pages. No autovacuum, so that the page reads counted are
    // the purge's alone.
    client
        .batch_execute(
            "ALTER TABLE webhook_inbox SET (autovacuum_enabled = false);
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        attempts, processed_at)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid',
                    jsonb_build_object('id', 'evt_' || i, 'pad', repeat(md5(i::text), 12)),
                    now() - interval '41 days', 1, now() - interval '40 days'
               FROM generate_series(1, 10000) AS i;
             SELECT pg_stat_reset_single_table_counters('webhook_inbox'::regclass);",
        )
        .await
        .unwrap();

    let report =
        json_of(&db, &["purge", "--older-than", "30d", "--batch-size", "10", "--duty-cycle", "100"]).await;
    assert_eq!((report["deleted"].as_i64(), report["batches"].as_i64()), (Some(10_000), Some(1000)));
    // A backend flushes its counters when it exits: wait for the purge's to be gone, then read.
    let deadline = std::time::Instant::now() + TIMEOUT;
    let sessions = "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND application_name = 'inbox-worker-ops'";
    while scalar(&client, sessions).await > 0 {
        assert!(std::time::Instant::now() < deadline, "the purge's session is still there");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.execute("SELECT pg_stat_clear_snapshot()", &[]).await.unwrap();
    let pages = scalar(
        &client,
        "SELECT heap_blks_read + heap_blks_hit FROM pg_statio_user_tables WHERE relname = 'webhook_inbox'",
    )
    .await;
    // Measured: about 5.8 page reads per row deleted (lock, delete, and each page about once). The
    // scan from the start at every batch read about 76: the 1000th batch read the 1,400 pages of the
    // rows deleted before it.
    assert!(pages > 0, "no page reads counted");
    assert!(pages < 15 * 10_000, "{pages} page reads to delete 10,000 rows");
}

#[tokio::test]
async fn batched_requeue_and_purge_run_under_the_operator_role_with_an_insert_only_audit() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(include_str!("../../deploy/roles.sql")).await.expect("applying deploy/roles.sql");
    seed_parked(&client, 3).await;
    seed(&client, &[processed("evt_old1", 40.0 * DAY), processed("evt_old2", 40.0 * DAY)]).await;

    let as_operator = |args: &[&str]| {
        let mut cmd = command("inbox-worker");
        cmd.env("DATABASE_URL", db.url_as("inbox_operator")).env("USER", "tester").args(args);
        cmd
    };
    let requeue = as_operator(&["requeue", "--all", "--batch-size", "2"]);
    let purge = as_operator(&["purge", "--older-than", "30d", "--batch-size", "1"]);
    for cmd in [requeue, purge] {
        let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
        assert_eq!(code, 0, "{output}");
    }
    assert_eq!(parked_count(&client).await, 0);
    assert_eq!(db.count("webhook_inbox").await, 3);
    let runs = audit_runs(&client).await;
    let shape: Vec<(&str, Vec<i32>)> = runs.iter().map(|r| (r.action.as_str(), r.batches())).collect();
    assert_eq!(shape, [("requeue", vec![2, 1]), ("purge", vec![1, 1])]);
    let who = column::<String>(&client, "SELECT DISTINCT db_user FROM operator_audit").await;
    assert_eq!(who, ["inbox_operator"]);
}

// ---------------------------------------------------------------------------------------- dismiss

#[tokio::test]
async fn dismiss_closes_a_parked_or_held_row_unprocessed_keeps_it_audits_why_and_replay_undoes_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(
        &client,
        &[
            parked("evt_parked", "payload: no amount_paid"),
            Row { event_id: "evt_ready", ..Row::default() },
            processed("evt_done", 60.0),
        ],
    )
    .await;
    // A row the ingest held: a test-mode event on the live endpoint.
    seed(&client, &[Row { event_id: "evt_held", ..parked("evt_held", "livemode: …") }]).await;
    client
        .batch_execute("UPDATE webhook_inbox SET held = 'livemode' WHERE event_id = 'evt_held'")
        .await
        .unwrap();
    let before = snapshot(&client).await;

    // Refusals change nothing: no reason, a row in the queue, a processed row, an unknown id.
    let (code, output) = exec(&db, &["dismiss", "--event-id", "evt_parked", "--reason", "  "]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("--reason must say why"), "{output}");
    let output = refused(&db, &["dismiss", "--event-id", "evt_ready", "--reason", "test"]).await;
    assert!(output.contains("in the queue, not parked or held"), "{output}");
    let output = refused(&db, &["dismiss", "--event-id", "evt_done", "--reason", "test"]).await;
    assert!(output.contains("already processed"), "{output}");
    let output = refused(&db, &["dismiss", "--event-id", "evt_nope", "--reason", "test"]).await;
    assert!(output.contains("no event evt_nope"), "{output}");
    assert_eq!(snapshot(&client).await, before, "refusals change nothing");
    assert!(audit(&client).await.is_empty());

    // A held and a parked row closed, each with its reason and an audit record.
    let output = ok(&db, &["dismiss", "--event-id", "evt_held", "--reason", "test event sent to live"]).await;
    assert!(output.contains("dismissed event evt_held"), "{output}");
    ok(&db, &["dismiss", "--event-id", "evt_parked", "--reason", "refunded by hand"]).await;
    let closed = client
        .query(
            "SELECT event_id, processed_at IS NOT NULL, dismissed_at IS NOT NULL, last_error
               FROM webhook_inbox WHERE dismissed_at IS NOT NULL ORDER BY event_id",
            &[],
        )
        .await
        .unwrap();
    let closed: Vec<(String, bool, bool, String)> =
        closed.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(
        closed,
        [
            ("evt_held".into(), true, true, "dismissed by tester: test event sent to live".into()),
            ("evt_parked".into(), true, true, "dismissed by tester: refunded by hand".into()),
        ]
    );
    assert_eq!(db.count("webhook_inbox").await, 4, "the rows are kept");
    let review = json_of(&db, &["needs-review"]).await;
    assert_eq!(review["count"], 0, "nothing left for review: {review}");
    let records = audit(&client).await;
    assert_eq!(records.len(), 2);
    let (actor, action, target, affected) = &records[0];
    assert_eq!((actor.as_str(), action.as_str(), *affected), ("tester", "dismiss", 1));
    assert_eq!(target["event_id"], "evt_held");
    assert_eq!(target["held"], "livemode");
    assert_eq!(target["reason"], "test event sent to live");
    // Dismissed twice: refused.
    let output = refused(&db, &["dismiss", "--event-id", "evt_parked", "--reason", "again"]).await;
    assert!(output.contains("already processed"), "{output}");

    // The person changes their mind: replay applies it after all, and it is no longer dismissed.
    ok(&db, &["replay", "--event-id", "evt_held"]).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE dismissed_at IS NOT NULL").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1, "applied once");
}

// ------------------------------------------------------------------------------------ bulk replay

#[tokio::test]
async fn replay_of_a_type_counts_first_needs_yes_past_100_works_in_audited_batches_and_names_failures() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // 120 payments processed by a worker that did not book them (a handler since fixed), received
    // over the last two hours; one of them a payment whose handler fails (no amount_paid).
    let mut rows = Vec::new();
    for i in 0..120 {
        let id: &'static str = Box::leak(format!("evt_pay_{i:03}").into_boxed_str());
        rows.push(Row {
            event_id: id,
            attempts: 1,
            received_ago: 60.0 * f64::from(i),
            processed_ago: Some(30.0),
            ..Row::default()
        });
    }
    rows.push(Row {
        event_id: "evt_broken",
        attempts: 1,
        received_ago: 30.0,
        processed_ago: Some(20.0),
        payload: Some(
            json!({"id": "evt_broken", "type": "invoice.paid", "data": {"object": {"id": "in_broken"}}}),
        ),
        ..Row::default()
    });
    rows.push(Row {
        event_id: "evt_created",
        event_type: "invoice.created",
        ..processed("evt_created", 10.0)
    });
    seed(&client, &rows).await;
    let before = snapshot(&client).await;

    // The count first; a dry run lists and never needs --yes; more than 100 needs --yes.
    let dry = json_of(&db, &["replay", "--event-type", "invoice.paid", "--dry-run"]).await;
    assert_eq!(dry["matched"], 121, "{dry}");
    assert_eq!(dry["events"][0]["event_id"], "evt_pay_119", "oldest first: {dry}");
    let output = refused(&db, &["replay", "--event-type", "invoice.paid"]).await;
    assert!(
        output.contains("121 processed invoice.paid events match") && output.contains("--yes"),
        "{output}"
    );
    // A span: received in the last 30 minutes (30 payments at 0..29 minutes, and the broken one).
    let recent =
        json_of(&db, &["replay", "--event-type", "invoice.paid", "--since", "29m 30s", "--dry-run"]).await;
    assert_eq!(recent["matched"], 31, "{recent}");
    assert_eq!(snapshot(&client).await, before, "counting changes nothing");
    assert!(audit(&client).await.is_empty());

    // The run: batches of 50, each booked and audited; the broken event named, the rest applied.
    let (code, output) = exec(
        &db,
        &["replay", "--event-type", "invoice.paid", "--yes", "--batch-size", "50", "--actor", "alice"],
    )
    .await;
    assert_eq!(code, 1, "a failed event makes the run exit 1: {output}");
    assert!(output.contains("120 replayed in 3 batches, 1 failed"), "{output}");
    assert!(output.contains("evt_broken") && output.contains("amount_paid"), "{output}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 120, "each booked once");
    let records = audit(&client).await;
    assert_eq!(records.len(), 4, "a start record and one per batch: {records:?}");
    assert_eq!(records[0].3, 0);
    assert_eq!(records[0].2["matched"], 121);
    let batches: Vec<i32> = records[1..].iter().map(|r| r.3).collect();
    assert_eq!(batches.iter().sum::<i32>(), 120, "{batches:?}");
    assert!(records[1..].iter().all(|r| r.0 == "alice" && r.1 == "replay"));
    assert!(records.iter().any(|r| r.2["failed"] == json!(["evt_broken"])), "{records:?}");

    // Again: idempotent handlers book nothing twice.
    let (_, output) = exec(&db, &["replay", "--event-type", "invoice.paid", "--yes"]).await;
    assert!(output.contains("121 processed invoice.paid events matched: 120 replayed"), "{output}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 120);
    // A type without a handler in this binary is refused, changing nothing.
    let output = refused(&db, &["replay", "--event-type", "customer.created", "--dry-run"]).await;
    assert!(output.contains("no handler for customer.created"), "{output}");
}

#[tokio::test]
async fn without_actor_or_user_the_audit_records_the_os_user_and_says_so() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[parked("evt_p", "boom")]).await;
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(["requeue", "--event-id", "evt_p"]);
    let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 0, "{output}");
    let records = audit(&client).await;
    let os_user = records[0].0.clone();
    assert!(!os_user.is_empty() && os_user != "unknown", "{records:?}");
    assert!(
        output.contains(&format!("operator_audit records the operating system's user, {os_user}")),
        "{output}"
    );
}

#[tokio::test]
async fn with_json_a_refusal_or_an_unreachable_database_is_one_json_document_on_stdout() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed(&client, &[processed("evt_done", 60.0)]).await;
    let json_error = |mut cmd: std::process::Command| async move {
        let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
        assert!(stderr.contains("inbox-worker: error: "), "stderr keeps the error for people: {stderr}");
        let value: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"));
        assert_eq!(keys(&value), ["error"], "{value}");
        value["error"].as_str().unwrap().to_owned()
    };

    let error = json_error(worker(&db, &["requeue", "--event-id", "evt_done", "--json"])).await;
    assert!(error.contains("was processed at") && error.contains("use `replay`"), "{error}");

    let error =
        json_error(worker(&db, &["dismiss", "--event-id", "evt_nope", "--reason", "test", "--json"])).await;
    assert!(error.contains("no event evt_nope in the inbox"), "{error}");

    // Nothing listens on port 1: the connection error, named by host and port, without the password.
    let mut cmd = worker(&db, &["stats", "--json"]);
    cmd.env("DATABASE_URL", "postgres://inbox:hunter2@127.0.0.1:1/inbox?connect_timeout=2");
    let error = json_error(cmd).await;
    assert!(error.contains("127.0.0.1:1") && !error.contains("hunter2"), "{error}");
}
