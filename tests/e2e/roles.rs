//! deploy/roles.sql: each component runs under its own role, allowed what it does and refused the
//! rest; applying the file twice is harmless; operator_audit records the database role and the
//! client address the change came from, which an operator cannot forge.

use std::time::Duration;

use inbox_domain::handler::Registry;
use inbox_domain::health::EVENT_GENERATION_FAILURE_RESOLVED;
use inbox_test_support::db::scalar;
use inbox_test_support::events::invoice_paid;
use inbox_test_support::process::{command, run, Proc};
use inbox_test_support::receiver::Receiver;
use inbox_test_support::stripe_fixtures::{thin_event, Related};
use inbox_test_support::worker::{eventually, spawn_worker};
use inbox_test_support::{spawn_app_with, TestDb};
use tokio_postgres::error::SqlState;

const ROLES_SQL: &str = include_str!("../../deploy/roles.sql");

fn config_as(db: &TestDb, role: &str) -> tokio_postgres::Config {
    let mut config = db.config();
    config.user(role);
    config
}

/// `sql` run as `role` must be refused for lack of privilege.
async fn forbidden(db: &TestDb, role: &str, sql: &str) {
    let client = inbox_test_support::db::connect(&config_as(db, role)).await;
    let error = client.batch_execute(sql).await.expect_err(&format!("{role} must not run: {sql}"));
    assert_eq!(error.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{role}: {sql}: {error}");
}

#[tokio::test]
async fn each_component_runs_under_its_role_and_is_refused_what_it_does_not_do() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    admin.batch_execute(ROLES_SQL).await.expect("applying it again is harmless");

    // The ingest, as inbox_ingest, stores an event (and its /readyz reads the schema version).
    let ingest_config = config_as(&db, "inbox_ingest");
    let app = spawn_app_with(db, move |s| s.database = ingest_config.into()).await;
    let reply = app.post_signed(invoice_paid("evt_roles", "in_roles", 100)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // An event Stripe failed to generate: the worker records a reconciliation item, an operator
    // resolves it.
    let related =
        Related { id: "pi_roles", object_type: "payment_intent", url: "/v1/payment_intents/pi_roles" };
    let failure = thin_event(
        "evt_roles_health",
        EVENT_GENERATION_FAILURE_RESOLVED,
        related,
        None,
        "2026-10-30T16:05:44.000Z",
    );
    let reply = app.post_signed(serde_json::to_vec(&failure).unwrap()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(app.get("/readyz").await.status, 200);
    let db = &app.db;
    forbidden(db, "inbox_ingest", "UPDATE webhook_inbox SET attempts = 0").await;
    forbidden(db, "inbox_ingest", "SELECT payload FROM webhook_inbox").await;
    forbidden(
        db,
        "inbox_ingest",
        "INSERT INTO ledger_entries (invoice_id, kind, amount) VALUES ('x', 'payment', 1)",
    )
    .await;

    // The worker, as inbox_worker, processes it.
    let worker_config = config_as(db, "inbox_worker");
    let worker =
        spawn_worker(db, Registry::with_invoice_handlers(), move |s| s.database = worker_config.into()).await;
    assert!(
        eventually(Duration::from_secs(15), || async {
            scalar(&admin, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_roles'").await == 1
        })
        .await,
        "the worker processed the event as inbox_worker"
    );
    assert!(
        eventually(Duration::from_secs(15), || async {
            scalar(&admin, "SELECT count(*) FROM reconciliation_items WHERE object_id = 'pi_roles'").await
                == 1
        })
        .await,
        "the worker recorded the reconciliation item as inbox_worker"
    );
    worker.stop().await;
    forbidden(db, "inbox_worker", "DELETE FROM webhook_inbox").await;
    forbidden(
        db,
        "inbox_worker",
        "INSERT INTO operator_audit (actor, action, target, affected) VALUES ('w', 'x', '{}', 0)",
    )
    .await;
    forbidden(db, "inbox_worker", "DROP TABLE invoices").await;
    forbidden(db, "inbox_worker", "UPDATE reconciliation_items SET resolved_at = now()").await;

    // The relay, as inbox_relay, delivers the outbox row the handler wrote and marks it; it may
    // not write outbox rows, rewrite what a handler wrote, or read anything but the outbox.
    let receiver = Receiver::start(false).await;
    let mut relay = command("inbox-worker");
    relay
        .env("DATABASE_URL", db.url_as("inbox_relay"))
        .env("INBOX_RELAY_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
        .args(["relay", "--to-url", &receiver.url, "--poll-interval", "100ms"]);
    let relay = tokio::task::spawn_blocking(move || Proc::spawn(relay)).await.unwrap();
    let delivered = eventually(Duration::from_secs(15), || async {
        scalar(&admin, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 1
    })
    .await;
    assert!(delivered, "the relay delivered the outbox row as inbox_relay: {}", relay.output());
    assert_eq!(receiver.accepted().len(), 1);
    drop(relay);
    forbidden(db, "inbox_relay", "SELECT payload FROM webhook_inbox").await;
    forbidden(db, "inbox_relay", "SELECT * FROM invoices").await;
    forbidden(db, "inbox_relay", "DELETE FROM outbox").await;
    forbidden(db, "inbox_relay", "UPDATE outbox SET payload = '{}'").await;
    forbidden(
        db,
        "inbox_relay",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', 'b', 'c', '{}')",
    )
    .await;

    // Operators, as inbox_operator: commands work, the audit trail is insert-only and says who.
    let (code, output) = operator(db, &["replay", "--event-id", "evt_roles", "--actor", "alice"]).await;
    assert_eq!(code, 0, "{output}");
    let (code, output) = operator(db, &["stats"]).await;
    assert_eq!(code, 0, "{output}");
    let audit =
        admin.query_one("SELECT actor, db_user, host(client_addr) FROM operator_audit", &[]).await.unwrap();
    assert_eq!(
        (audit.get::<_, String>(0), audit.get::<_, String>(1), audit.get::<_, String>(2)),
        ("alice".to_owned(), "inbox_operator".to_owned(), "127.0.0.1".to_owned()),
        "the database records who the self-declared actor logged in as, and from where"
    );
    forbidden(db, "inbox_operator", "DELETE FROM operator_audit").await;
    forbidden(db, "inbox_operator", "UPDATE operator_audit SET actor = 'mallory'").await;
    forbidden(
        db,
        "inbox_operator",
        "INSERT INTO operator_audit (actor, action, target, affected, db_user) VALUES ('a', 'b', '{}', 0, 'someone')",
    )
    .await;

    // Reconciliation items: listed and resolved (audited) as inbox_operator, which may change
    // nothing of an item but its resolution.
    let (code, output) = operator(db, &["reconciliation"]).await;
    assert!(code == 0 && output.contains("payment_intent pi_roles"), "{output}");
    let item =
        scalar(&admin, "SELECT id FROM reconciliation_items WHERE object_id = 'pi_roles'").await.to_string();
    let (code, output) = operator(
        db,
        &["reconciliation", "resolve", "--id", &item, "--note", "refetched", "--actor", "alice"],
    )
    .await;
    assert_eq!(code, 0, "{output}");
    forbidden(db, "inbox_operator", "UPDATE reconciliation_items SET reason = reason").await;
    forbidden(db, "inbox_operator", "UPDATE reconciliation_items SET detail = '{}'").await;
    forbidden(db, "inbox_operator", "DELETE FROM reconciliation_items").await;

    // Metrics, as inbox_metrics: the KEDA count, not the payloads.
    let metrics = inbox_test_support::db::connect(&config_as(db, "inbox_metrics")).await;
    let ready: i64 = metrics
        .query_one(
            "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND parked_at IS NULL AND available_at <= now()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ready, 0);
    forbidden(db, "inbox_metrics", "SELECT payload FROM webhook_inbox").await;
    forbidden(db, "inbox_metrics", "UPDATE webhook_inbox SET attempts = 0").await;
    let pending: i64 = metrics
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL AND available_at <= now()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pending, 0, "the relay's KEDA count");
    forbidden(db, "inbox_metrics", "SELECT payload FROM outbox").await;
    forbidden(db, "inbox_metrics", "SELECT last_error FROM outbox").await;

    // The owner migrates.
    let mut migrate = command("inbox-worker");
    migrate.env("DATABASE_URL", db.url_as("inbox_owner")).arg("migrate");
    let (code, output) =
        tokio::task::spawn_blocking(move || run(migrate, Duration::from_secs(30))).await.unwrap();
    assert_eq!(code, 0, "migrate as inbox_owner: {output}");
}

async fn operator(db: &TestDb, args: &[&str]) -> (i32, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url_as("inbox_operator")).args(args);
    tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(30))).await.unwrap()
}

/// Every component role resolves names through a pinned search_path — the inbox's schema,
/// temporary objects last (pg_catalog is always searched first) — so a schema named after the role (first in PostgreSQL's default
/// "$user", public) cannot put its own webhook_inbox in front of the real one.
#[tokio::test]
async fn every_component_role_has_a_pinned_search_path_that_a_schema_named_after_it_cannot_shadow() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    admin
        .batch_execute(
            "CREATE SCHEMA inbox_worker;
             CREATE VIEW inbox_worker.webhook_inbox AS SELECT 'decoy'::text AS provider;
             GRANT USAGE ON SCHEMA inbox_worker TO inbox_worker;
             GRANT SELECT ON inbox_worker.webhook_inbox TO inbox_worker;",
        )
        .await
        .unwrap();
    for role in [
        "inbox_owner",
        "inbox_ingest",
        "inbox_worker",
        "inbox_relay",
        "inbox_operator",
        "inbox_metrics",
        "inbox_reconciler",
        "inbox_fetcher",
        "inbox_console",
    ] {
        let client = inbox_test_support::db::connect(&config_as(&db, role)).await;
        let path: String = client.query_one("SHOW search_path", &[]).await.unwrap().get(0);
        assert_eq!(path, "public, pg_temp", "{role}");
        let resolved: String =
            client.query_one("SELECT to_regclass('webhook_inbox')::text", &[]).await.unwrap().get(0);
        assert_eq!(resolved, "webhook_inbox", "{role} resolves the inbox's own table");
    }
}

/// On a database made before PostgreSQL 15, everyone may create objects in public. A function
/// planted there by an ordinary role — a better match for a call in deploy/roles.sql than
/// pg_catalog's own — must never run as the superuser applying the file, and the file takes that
/// right away from PUBLIC.
#[tokio::test]
async fn roles_sql_takes_create_on_public_from_everyone_and_never_calls_a_function_planted_there() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let mallory = format!("mallory_{}", db.name);
    admin
        .batch_execute(&format!(
            "GRANT CREATE ON SCHEMA public TO PUBLIC;
             CREATE ROLE {mallory} LOGIN;
             SET ROLE {mallory};
             CREATE FUNCTION public.format(text, text) RETURNS text LANGUAGE plpgsql AS $f$
             BEGIN
                 EXECUTE 'ALTER ROLE {mallory} SUPERUSER';
                 RETURN pg_catalog.format($1, $2);
             END $f$;
             RESET ROLE;"
        ))
        .await
        .unwrap();
    let applied = admin.batch_execute(ROLES_SQL).await;
    let superuser: bool = admin
        .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&mallory])
        .await
        .unwrap()
        .get(0);
    let may_create: bool = admin
        .query_one("SELECT has_schema_privilege($1, 'public', 'CREATE')", &[&mallory])
        .await
        .unwrap()
        .get(0);
    let path: String = admin.query_one("SHOW search_path", &[]).await.unwrap().get(0);
    admin.batch_execute(&format!("DROP OWNED BY {mallory}; DROP ROLE {mallory}")).await.unwrap();
    applied.expect("applying deploy/roles.sql");
    assert!(!superuser, "the planted function ran as the superuser applying roles.sql");
    assert!(!may_create, "PUBLIC may still create objects in public");
    assert_eq!(path, "\"$user\", public", "the file leaves the session's search_path as it found it");
}

/// The worker and the operators change the queue's columns — attempts, the lease, the park, the
/// hold, the last error, the processed mark — and nothing of what Stripe sent or how it was
/// verified: a compromised worker cannot rewrite the evidence.
#[tokio::test]
async fn the_worker_and_operator_roles_update_only_the_queue_columns_never_the_evidence() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    for role in ["inbox_worker", "inbox_operator"] {
        for column in [
            "provider",
            "endpoint",
            "event_id",
            "event_type",
            "payload",
            "payload_bytes",
            "raw_body",
            "received_at",
            "secret_position",
            "secret_fingerprint",
            "signature_t",
            "signature_v1",
        ] {
            forbidden(&db, role, &format!("UPDATE webhook_inbox SET {column} = {column}")).await;
        }
        let client = inbox_test_support::db::connect(&config_as(&db, role)).await;
        client
            .batch_execute(
                "UPDATE webhook_inbox SET attempts = attempts, interruptions = interruptions,
                        available_at = available_at, parked_at = parked_at, held = held,
                        last_error = last_error, processed_at = processed_at",
            )
            .await
            .unwrap_or_else(|e| panic!("{role} updates the queue's columns: {e}"));
    }
}

/// The key the Stripe stand-in accepts in the tests below.
const STRIPE_KEY: &str = "rk_test_51InboxRolesKeyForTheReconcilerAndTheFetcher";

/// `inbox-worker reconcile --endpoint billing --json <flags>` as inbox_reconciler against `api`:
/// (exit code, the report or Null, all output).
async fn reconcile_as_reconciler(
    db: &TestDb,
    api: &inbox_test_support::stripe_api::StripeApi,
    flags: &[&str],
) -> (i32, serde_json::Value, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url_as("inbox_reconciler"))
        .env("STRIPE_API_KEY", STRIPE_KEY)
        .env("STRIPE_API_BASE", api.base_url())
        .args(["reconcile", "--endpoint", "billing", "--since", "2h", "--json", "--actor", "cron"])
        .args(flags);
    let (code, stdout, output) = tokio::task::spawn_blocking(move || {
        inbox_test_support::process::run_split(cmd, Duration::from_secs(60))
    })
    .await
    .unwrap();
    (code, serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null), output)
}

/// `reconcile` runs as inbox_reconciler: it reads the schema version, looks events up by key,
/// inserts the missing ones (source 'api'), keeps its runs in reconcile_runs — starts, releases on
/// an error, resumes, replaces, finishes them — and writes its audit record; and it may neither
/// change nor delete an inbox row, nor read a payload, nor touch a handler's table. inbox_operator
/// may read the runs, not write them.
#[tokio::test]
async fn reconcile_runs_as_inbox_reconciler_which_only_inserts_inbox_rows_and_keeps_its_runs() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    let api = inbox_test_support::stripe_api::StripeApi::start(STRIPE_KEY).await;
    // 120 events (two pages of Stripe's list): 60 invoices, each finalized then paid.
    let start = inbox_test_support::events::now() - 600;
    let events: Vec<serde_json::Value> = (0..120)
        .map(|i| {
            let mut invoice = inbox_test_support::stripe_fixtures::resource("invoice");
            invoice["id"] = serde_json::json!(format!("in_roles_rec{}", i / 2));
            let event_type = if i % 2 == 0 { "invoice.finalized" } else { "invoice.paid" };
            let id = format!("evt_roles_rec{i:03}");
            inbox_test_support::stripe_fixtures::snapshot_event(&id, event_type, invoice, start + i)
        })
        .collect();
    api.add_events(events.iter().cloned());
    // One arrived as a webhook; the others never did.
    let body = serde_json::to_vec(&events[0]).unwrap();
    inbox_test_support::worker::store_event(&admin, "billing", &body).await;
    let counts = |report: &serde_json::Value| {
        (report["already_present"].as_i64(), report["inserted"].as_i64(), report["resumed"].as_bool())
    };

    let (code, report, output) = reconcile_as_reconciler(&db, &api, &["--dry-run"]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(counts(&report), (Some(1), Some(119), Some(false)), "{report}");
    assert_eq!(db.count("reconcile_runs").await, 0, "a dry run writes nothing");
    // The second page of the next run and of the third one are refused (401: final).
    api.fail_nth("/v1/events", 2, inbox_test_support::stripe_api::Fault::Unauthorized);
    api.fail_nth("/v1/events", 5, inbox_test_support::stripe_api::Fault::Unauthorized);
    let (code, _, output) = reconcile_as_reconciler(&db, &api, &[]).await;
    assert_ne!(code, 0, "{output}");
    assert!(!output.contains("could not check the schema version"), "{output}");
    let (code, report, output) = reconcile_as_reconciler(&db, &api, &[]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(counts(&report), (Some(1), Some(119), Some(true)), "resumed at its cursor: {report}");
    assert_eq!(scalar(&admin, "SELECT count(*) FROM webhook_inbox WHERE source = 'api'").await, 119);
    // Interrupted again, then replaced by a run of other types, which finds everything there.
    let (code, _, output) = reconcile_as_reconciler(&db, &api, &[]).await;
    assert_ne!(code, 0, "{output}");
    let (code, report, output) = reconcile_as_reconciler(&db, &api, &["--types", "invoice.paid"]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(counts(&report), (Some(60), Some(0), Some(false)), "{report}");
    let outcomes = inbox_test_support::db::column::<String>(
        &admin,
        "SELECT outcome FROM reconcile_runs WHERE finished_at IS NOT NULL ORDER BY id",
    )
    .await;
    assert_eq!(outcomes, ["complete", "replaced", "complete"]);
    let audit = "SELECT count(*) FROM operator_audit
                  WHERE action = 'reconcile' AND actor = 'cron' AND db_user = 'inbox_reconciler'";
    assert_eq!(scalar(&admin, audit).await, 2, "one audit record per finished run, saying who logged in");

    for sql in [
        "UPDATE webhook_inbox SET attempts = 0",
        "UPDATE webhook_inbox SET processed_at = now()",
        "UPDATE webhook_inbox SET payload = payload",
        "DELETE FROM webhook_inbox",
        "SELECT payload FROM webhook_inbox",
        "SELECT * FROM invoices",
        "UPDATE invoices SET status = status",
        "INSERT INTO ledger_entries (invoice_id, kind, amount) VALUES ('x', 'payment', 1)",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', 'b', 'c', '{}')",
        "UPDATE reconciliation_items SET resolved_at = now()",
        "SELECT * FROM stripe_object_snapshots",
        "UPDATE reconcile_runs SET endpoint = 'elsewhere'",
        "UPDATE reconcile_runs SET actor = 'mallory'",
        "DELETE FROM reconcile_runs",
        "UPDATE operator_audit SET actor = 'mallory'",
        "DELETE FROM operator_audit",
        "INSERT INTO operator_audit (actor, action, target, affected, db_user) VALUES ('a', 'b', '{}', 0, 'x')",
    ] {
        forbidden(&db, "inbox_reconciler", sql).await;
    }
    // Operators read the runs (how far an interrupted one got); only reconcile writes them.
    let operator = inbox_test_support::db::connect(&config_as(&db, "inbox_operator")).await;
    let seen: i64 = operator.query_one("SELECT count(*) FROM reconcile_runs", &[]).await.unwrap().get(0);
    assert_eq!(seen, 3);
    forbidden(&db, "inbox_operator", "UPDATE reconcile_runs SET owner = owner").await;
    forbidden(&db, "inbox_operator", "DELETE FROM reconcile_runs").await;
}

/// A handler of a thin event type (`Registry::register_fetched`), as a team writes one: reads the
/// snapshot `fetch` kept and writes it to the team's own table.
fn record_account<'a>(
    tx: &'a deadpool_postgres::Transaction<'_>,
    event: &'a inbox_domain::inbox::event::InboxEvent,
) -> inbox_domain::handler::HandlerFuture<'a> {
    Box::pin(async move {
        let snapshot = inbox_worker::fetch::snapshot(tx, event).await?;
        let object = snapshot.object.as_ref().map(|o| o.get().to_owned());
        tx.execute(
            "INSERT INTO team_accounts (event_id, object) VALUES ($1, $2::text::jsonb)",
            &[&event.event_id, &object],
        )
        .await?;
        Ok(())
    })
}

/// `fetch` runs as inbox_fetcher: a member of inbox_worker, it claims and marks rows and writes what
/// a team granted inbox_worker for its handlers, and it keeps the snapshots it fetched — which the
/// worker role may not write. It may not delete inbox rows, rewrite what Stripe sent, or write the
/// audit trail.
#[tokio::test]
async fn fetch_runs_as_inbox_fetcher_with_the_workers_rights_and_the_snapshots() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    // A team's own table, granted to inbox_worker in a file of its own (roles.sql's header).
    admin
        .batch_execute(
            "CREATE TABLE team_accounts (event_id text PRIMARY KEY, object jsonb);
             GRANT SELECT, INSERT, UPDATE ON team_accounts TO inbox_worker;",
        )
        .await
        .unwrap();
    let api = inbox_test_support::stripe_api::StripeApi::start(STRIPE_KEY).await;
    let url = "/v2/core/accounts/acct_roles";
    api.add_object(url, serde_json::json!({ "id": "acct_roles", "object": "v2.core.account" }));
    let related = Related { id: "acct_roles", object_type: "v2.core.account", url };
    let event =
        thin_event("evt_roles_thin", "v2.core.account.updated", related, None, "2026-10-30T16:05:44.000Z");
    inbox_test_support::worker::store_event(&admin, "billing", &serde_json::to_vec(&event).unwrap()).await;

    let mut registry = Registry::new();
    registry.register_fetched("v2.core.account.updated", record_account);
    let mut config =
        inbox_worker::stripe::Config::new(inbox_worker::stripe::ApiKey::new(STRIPE_KEY).unwrap());
    config.base = api.base_url();
    let fetcher = inbox_worker::fetch::Fetcher::new(
        inbox_worker::stripe::Client::new(config).unwrap(),
        4,
        Duration::from_secs(5),
        Duration::from_secs(60),
    );
    let fetcher_config = config_as(&db, "inbox_fetcher");
    let worker = spawn_worker(&db, registry.only_fetched(), move |s| {
        s.database = fetcher_config.into();
        s.fetcher = Some(std::sync::Arc::new(fetcher));
    })
    .await;
    let applied = eventually(Duration::from_secs(15), || async {
        scalar(&admin, "SELECT count(*) FROM team_accounts WHERE object ->> 'id' = 'acct_roles'").await == 1
    })
    .await;
    worker.stop().await;
    assert!(applied, "fetch applied the thin event as inbox_fetcher");
    assert_eq!(scalar(&admin, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await, 1);
    let kept = "SELECT count(*) FROM stripe_object_snapshots WHERE url = '/v2/core/accounts/acct_roles'";
    assert_eq!(scalar(&admin, kept).await, 1, "the snapshot fetch kept as inbox_fetcher");

    for sql in [
        "DELETE FROM webhook_inbox",
        "UPDATE webhook_inbox SET payload = payload",
        "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
         VALUES ('stripe', 'billing', 'evt_x', 'x', '{}')",
        "DELETE FROM stripe_object_snapshots",
        "INSERT INTO operator_audit (actor, action, target, affected) VALUES ('f', 'x', '{}', 0)",
        "SELECT * FROM reconcile_runs",
        "UPDATE reconciliation_items SET resolved_at = now()",
        "DROP TABLE stripe_object_snapshots",
    ] {
        forbidden(&db, "inbox_fetcher", sql).await;
    }
    // The snapshots are fetch's: `run` never writes one, a replay only reads them.
    let snapshot = "INSERT INTO stripe_object_snapshots (account, url, object_id, object_type, as_of)
                    VALUES ('', '/v1/x/1', '1', 'x', now())";
    forbidden(&db, "inbox_worker", snapshot).await;
    forbidden(&db, "inbox_worker", "SELECT * FROM stripe_object_snapshots").await;
    forbidden(&db, "inbox_operator", snapshot).await;
    let operator = inbox_test_support::db::connect(&config_as(&db, "inbox_operator")).await;
    let kept: i64 =
        operator.query_one("SELECT count(*) FROM stripe_object_snapshots", &[]).await.unwrap().get(0);
    assert_eq!(kept, 1, "inbox_operator reads the snapshots a replay re-applies");
}

/// `inbox-worker console` as inbox_console: every page reads, a requeue and a replay (the handlers'
/// writes, through its membership of inbox_operator) work and are audited under its own db_user; it
/// reads the audit log but, like the operators, can neither change nor delete a record, nor rewrite
/// an event.
#[tokio::test(flavor = "multi_thread")]
async fn the_console_runs_as_inbox_console_with_the_operators_rights_and_reads_the_audit_log() {
    use inbox_test_support::console::{console_command, http_client, sign_in, start_console, UsersFile};

    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    admin.batch_execute(ROLES_SQL).await.expect("applying it again is harmless");
    admin
        .batch_execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, attempts, last_error,
                                        parked_at)
             VALUES ('stripe', 'billing', 'evt_parked', 'invoice.paid',
                     '{\"id\": \"evt_parked\", \"type\": \"invoice.paid\", \"data\": {\"object\":
                       {\"id\": \"in_parked\", \"customer\": \"cus_1\", \"amount_paid\": 100}}}', 10, 'boom', now());
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, attempts, processed_at)
             VALUES ('stripe', 'billing', 'evt_done', 'invoice.paid',
                     '{\"id\": \"evt_done\", \"type\": \"invoice.paid\", \"data\": {\"object\":
                       {\"id\": \"in_done\", \"customer\": \"cus_1\", \"amount_paid\": 250}}}', 1, now());",
        )
        .await
        .unwrap();
    let users = UsersFile::new(&[("alice", false)]);
    let cmd = console_command(&db.url_as("inbox_console"), &users);
    let (_console, base) = tokio::task::spawn_blocking(move || start_console(cmd)).await.unwrap();
    let http = http_client();
    let cookie = sign_in(&http, &base, "alice").await.expect("signing in");
    let get = |path: String| {
        let (http, cookie) = (http.clone(), cookie.clone());
        async move {
            let response = http.get(path).header(reqwest::header::COOKIE, cookie).send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let post = |path: &str, form: Vec<(&'static str, String)>| {
        let (http, cookie) = (http.clone(), cookie.clone());
        let url = format!("{base}{path}");
        async move {
            let response =
                http.post(url).header(reqwest::header::COOKIE, cookie).form(&form).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        }
    };

    let (status, page) = get(format!("{base}/events/billing/evt_parked")).await;
    assert_eq!(status, 200, "{page}");
    let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + "name=\"csrf\" value=\"".len();
    let csrf = page[at..at + page[at..].find('"').unwrap()].to_owned();
    for path in ["/", "/needs-review", "/needs-review?error=boom", "/outbox", "/reconciliation", "/audit"] {
        let (status, page) = get(format!("{base}{path}")).await;
        assert_eq!(status, 200, "GET {path} as inbox_console: {page}");
    }

    let event =
        |id: &str| vec![("csrf", csrf.clone()), ("endpoint", "billing".into()), ("event_id", id.into())];
    let (status, page) = post("/actions/requeue", event("evt_parked")).await;
    assert_eq!(status, 303, "requeue as inbox_console: {page}");
    let (status, page) = post("/actions/replay", event("evt_done")).await;
    assert_eq!(status, 303, "replay as inbox_console: {page}");
    assert_eq!(scalar(&admin, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_done'").await, 1);
    assert_eq!(scalar(&admin, "SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL").await, 0);
    let who: Vec<(String, String, String)> = admin
        .query("SELECT actor, action, db_user FROM operator_audit ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        who,
        [
            ("alice".to_owned(), "requeue".to_owned(), "inbox_console".to_owned()),
            ("alice".to_owned(), "replay".to_owned(), "inbox_console".to_owned())
        ]
    );
    let (status, page) = get(format!("{base}/audit")).await;
    assert!(status == 200 && page.contains("replay"), "the audit log, read as inbox_console: {page}");

    forbidden(&db, "inbox_console", "DELETE FROM operator_audit").await;
    forbidden(&db, "inbox_console", "UPDATE operator_audit SET actor = 'mallory'").await;
    forbidden(&db, "inbox_console", "UPDATE webhook_inbox SET payload = '{}'").await;
    forbidden(&db, "inbox_console", "UPDATE inbox_workers SET seen_at = now()").await;
    forbidden(
        &db,
        "inbox_console",
        "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload) VALUES ('s', 'e', 'i', 't', '{}')",
    )
    .await;
}

/// Only the tables' owner may rebuild or drop their indexes: `reindex` as `inbox_operator` finds
/// the copy an interrupted rebuild left, refuses (exit 1, naming the owner's role) and changes
/// nothing; as `inbox_owner`, the deploy files' role for it, it drops the copy.
#[tokio::test]
async fn reindex_runs_as_inbox_owner_and_is_refused_to_other_roles() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying deploy/roles.sql");
    let invalid =
        "SELECT count(*) FROM pg_index WHERE indrelid = 'webhook_inbox_queue'::regclass AND NOT indisvalid";
    // A rebuild interrupted by its lock timeout while a snapshot is held leaves its copy.
    let reporting = inbox_test_support::db::hold_snapshot(&db, "webhook_inbox").await;
    let other = db.client().await;
    other.batch_execute("SET lock_timeout = '200ms'").await.unwrap();
    assert!(other.batch_execute("REINDEX INDEX CONCURRENTLY webhook_inbox_queue_pkey").await.is_err());
    reporting.batch_execute("COMMIT").await.unwrap();
    assert_eq!(scalar(&admin, invalid).await, 1);

    let (code, output) = operator(&db, &["reindex"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("run reindex as the tables' owner (inbox_owner)"), "{output}");
    assert_eq!(scalar(&admin, invalid).await, 1, "refused, nothing changed");

    let mut owner = command("inbox-worker");
    owner.env("DATABASE_URL", db.url_as("inbox_owner")).arg("reindex");
    let (code, output) =
        tokio::task::spawn_blocking(move || run(owner, Duration::from_secs(30))).await.unwrap();
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("dropped"), "{output}");
    assert_eq!(scalar(&admin, invalid).await, 0);
}
