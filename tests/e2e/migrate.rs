//! `inbox-worker migrate`: applies the schema, repeatably and concurrently.

use std::time::Duration;

use inbox_domain::inbox::schema::{self, expected_version, Migrations};
use inbox_test_support::db::column;
use inbox_test_support::process::{command, run, Proc};
use inbox_test_support::TestDb;

fn migrate(url: &str) -> std::process::Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", url).arg("migrate");
    cmd
}

#[tokio::test]
async fn migrate_applies_the_schema_once_even_when_two_run_at_once() {
    let db = TestDb::empty().await;
    let mut a = Proc::spawn(migrate(&db.url()));
    let mut b = Proc::spawn(migrate(&db.url()));
    let (sa, sb) = (a.wait(Duration::from_secs(60)), b.wait(Duration::from_secs(60)));
    assert!(sa.success(), "{}", a.output());
    assert!(sb.success(), "{}", b.output());
    let applied = [a.output(), b.output()].iter().filter(|o| o.contains("applied V1")).count();
    assert_eq!(applied, 1, "exactly one run applies V1:\n{}\n{}", a.output(), b.output());

    let client = db.client().await;
    let versions: Vec<i32> = column(&client, "SELECT version FROM refinery_schema_history ORDER BY 1").await;
    let expected: Vec<i32> = (1..=expected_version()).collect();
    assert_eq!(versions, expected);
    for table in
        ["webhook_inbox", "invoices", "outbox", "ledger_entries", "operator_audit", "reconciliation_items"]
    {
        assert_eq!(db.count(table).await, 0, "{table}");
    }
    // The queue tuning is in place.
    let options = reloptions(&client, "webhook_inbox").await;
    assert!(options.iter().any(|o| o == "fillfactor=30"), "{options:?}");
    assert!(options.iter().any(|o| o == "toast_tuple_target=256"), "{options:?}");

    let (code, output) = run(migrate(&db.url()), Duration::from_secs(60));
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("up to date"), "{output}");
}

#[test]
fn migrate_without_a_database_exits_1_and_says_why() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (code, output) =
        run(migrate(&format!("postgres://postgres@127.0.0.1:{closed}/x")), Duration::from_secs(30));
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("cannot connect to the database"), "{output}");
    let mut cmd = command("inbox-worker");
    cmd.arg("migrate");
    let (code, output) = run(cmd, Duration::from_secs(30));
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("DATABASE_URL"), "{output}");
}

/// What a migration leaves undone and says with RAISE NOTICE reaches the operator on stdout, with
/// the statement that finishes it: V22 run by a role that owns its tables but not the database.
/// PostgreSQL's "already exists, skipping" (refinery's history table, on every run) is not
/// repeated to them.
#[tokio::test]
async fn migrate_prints_what_a_migration_left_undone_and_the_statement_that_finishes_it() {
    let db = TestDb::empty().await;
    db.client()
        .await
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE inbox_test_migrator LOGIN; \
                   EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$; \
             GRANT CREATE ON SCHEMA public TO inbox_test_migrator",
        )
        .await
        .unwrap();
    let as_migrator = db.url_as("inbox_test_migrator");

    let (code, output) = run(migrate(&as_migrator), Duration::from_secs(60));
    assert_eq!(code, 0, "{output}");
    let name = &db.name;
    let applied = output.find("applied V22 database_write_back").expect(&output);
    let notice = output
        .find(&format!(
            "NOTICE:  backend_flush_after is left unset for database {name}: only its owner or a superuser may \
             set it. As one of them: ALTER DATABASE {name} SET backend_flush_after = '256kB'"
        ))
        .expect(&output);
    assert!(applied < notice, "after the versions applied: {output}");
    assert!(!output.contains("skipping"), "{output}");

    let (code, output) = run(migrate(&as_migrator), Duration::from_secs(60));
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("up to date") && !output.contains("NOTICE"), "{output}");
}

/// V23: autovacuum's analyse samples 300 rows per unit of the largest statistics target among a
/// table's columns, and at the inbox's fillfactor reads a page for nearly every row it samples.
/// Every column of webhook_inbox at 10 keeps that at 3,000 rows instead of 30,000; a column added
/// without a target would put the default (100) back, and fails this.
#[tokio::test]
async fn every_column_of_the_inbox_has_a_statistics_target_of_10_so_its_analyse_samples_3000_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    assert_every_column_has_statistics_target_10(&client, "webhook_inbox").await;

    // What the analyse then keeps: a histogram of at most 11 bounds (10 buckets) where the default
    // kept 101, over rows with 5,000 distinct times.
    client
        .batch_execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', '{}', now() - i * interval '1 s'
               FROM generate_series(1, 5000) AS i;
             ANALYZE webhook_inbox",
        )
        .await
        .unwrap();
    let bounds: Vec<i32> = column(
        &client,
        "SELECT array_length(histogram_bounds::text::text[], 1) FROM pg_stats
          WHERE tablename = 'webhook_inbox' AND attname = 'received_at'",
    )
    .await;
    assert!(matches!(bounds.as_slice(), [n] if (2..=11).contains(n)), "{bounds:?}");
}

/// V24: the outbox, changed as often as the inbox and analysed as often, samples 3,000 rows too.
#[tokio::test]
async fn every_column_of_the_outbox_has_a_statistics_target_of_10_so_its_analyse_samples_3000_rows() {
    let db = TestDb::new().await;
    assert_every_column_has_statistics_target_10(&db.client().await, "outbox").await;
}

/// V25: the three tables whose rows every event changes are vacuumed after 1 % of them changed,
/// the outbox too (PostgreSQL's default is 20 %); the outbox's vacuum after new rows follows the
/// queue table's.
#[tokio::test]
async fn the_inbox_its_queue_and_the_outbox_are_vacuumed_after_1_percent_of_them_changed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for table in ["webhook_inbox", "webhook_inbox_queue", "outbox"] {
        let options = reloptions(&client, table).await;
        assert!(options.iter().any(|o| o == "autovacuum_vacuum_scale_factor=0.01"), "{table}: {options:?}");
    }
    let outbox = reloptions(&client, "outbox").await;
    for option in ["autovacuum_vacuum_insert_scale_factor=0.01", "autovacuum_analyze_scale_factor=0.02"] {
        assert!(outbox.iter().any(|o| o == option), "outbox: {option} not in {outbox:?}");
    }
}

/// A table's storage parameters as PostgreSQL lists them (`fillfactor=30`, …; none: empty).
async fn reloptions(client: &tokio_postgres::Client, table: &str) -> Vec<String> {
    client
        .query_one(
            "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = $1::text::regclass",
            &[&table],
        )
        .await
        .unwrap()
        .get(0)
}

async fn assert_every_column_has_statistics_target_10(client: &tokio_postgres::Client, table: &str) {
    let targets: Vec<(String, i32)> = client
        .query(
            "SELECT attname::text, attstattarget::int4 FROM pg_attribute
              WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped",
            &[&table],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert!(targets.len() > 5, "{table}: {targets:?}");
    let other: Vec<_> = targets.iter().filter(|(_, target)| *target != 10).collect();
    assert!(other.is_empty(), "{table}: columns whose statistics target is not 10: {other:?}");
}

#[tokio::test]
async fn a_failing_application_migration_names_itself_and_the_servers_reason_and_keeps_the_inbox_schema() {
    let db = TestDb::empty().await;
    let mut client = db.client().await;
    let broken = Migrations::new("app_schema_history").add("V1__broken_table", "CREATE TABLE broken (");
    let error = schema::migrate(&mut client, Some(&broken)).await.unwrap_err().to_string();
    assert!(
        error.contains("app_schema_history")
            && error.contains("V1__broken_table")
            && error.contains("(42601)"),
        "the set, the migration and the SQLSTATE: {error}"
    );
    let inbox = column::<i32>(&client, "SELECT version FROM refinery_schema_history ORDER BY 1").await;
    assert_eq!(inbox.len() as i32, expected_version(), "the inbox's migrations ran first and stay");
    let app = column::<i32>(&client, "SELECT version FROM app_schema_history").await;
    assert!(app.is_empty(), "the broken migration is not recorded");
}

/// Against a database never migrated, or one migration behind, `run` and the operator commands
/// stop at once with what to do, and the ingest says it at start — instead of failing every claim
/// and query on a missing table (42P01) over and over.
#[tokio::test]
async fn every_binary_names_a_schema_behind_it_and_what_to_run() {
    let empty = TestDb::empty().await;
    let behind = TestDb::new().await;
    behind
        .client()
        .await
        .batch_execute(&format!("DELETE FROM refinery_schema_history WHERE version = {}", expected_version()))
        .await
        .unwrap();
    let expected = expected_version();
    for (db, says) in [
        (&empty, format!("no inbox schema (version 0), this binary needs version {expected}")),
        (&behind, format!("schema is at version {}, this binary needs version {expected}", expected - 1)),
    ] {
        for args in [&["run"][..], &["stats"], &["needs-review"]] {
            let mut cmd = command("inbox-worker");
            cmd.env("DATABASE_URL", db.url()).args(args);
            let (code, output) =
                tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(20))).await.unwrap();
            assert_eq!(code, 1, "{args:?}: {output}");
            assert!(output.contains(&says) && output.contains("inbox-worker migrate"), "{args:?}: {output}");
            assert!(!output.contains("42P01"), "{args:?}: {output}");
        }
    }
    let mut ingest = command("inbox-ingest");
    ingest
        .env("DATABASE_URL", empty.url())
        .env("INBOX_ENDPOINTS", format!("billing={}", inbox_test_support::events::SECRET_A))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) =
        tokio::task::spawn_blocking(move || inbox_test_support::process::start_ingest(ingest)).await.unwrap();
    let logs = ingest.output();
    assert!(logs.contains("no inbox schema (version 0)") && logs.contains("\"level\":\"ERROR\""), "{logs}");
    let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
}

/// The database's own `backend_flush_after`, as `ALTER DATABASE … SET` left it (None: unset).
async fn database_flush_after(db: &TestDb) -> Option<String> {
    let settings: Vec<Vec<String>> = column(
        &db.client().await,
        "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase \
          WHERE d.datname = current_database() AND s.setrole = 0",
    )
    .await;
    settings.concat().iter().find_map(|s| s.strip_prefix("backend_flush_after=").map(str::to_owned))
}

/// V22: where nobody chose `backend_flush_after`, `migrate` gives the database the pipeline's
/// write-back, which every later session of the database starts with (autovacuum's workers too:
/// they read the database's settings as any session does). A value chosen for the database is
/// kept, and a migrating role that may not change the database's settings (a table owner such as
/// deploy/roles.sql's inbox_owner) still migrates the whole schema, the setting then left to
/// deploy/roles.sql.
#[tokio::test]
async fn migrate_gives_the_database_write_back_where_nobody_chose_a_value_and_keeps_a_chosen_one() {
    use inbox_domain::inbox::store::WRITE_BACK;

    let unset = TestDb::empty().await;
    schema::migrate(&mut unset.client().await, None).await.unwrap();
    assert_eq!(database_flush_after(&unset).await.as_deref(), Some(WRITE_BACK));
    let client = unset.client().await;
    let session: Vec<String> = column(&client, "SELECT current_setting('backend_flush_after')").await;
    assert_eq!(session, [WRITE_BACK], "a new session of the database starts with it");

    let chosen = TestDb::empty().await;
    let client = chosen.client().await;
    client
        .batch_execute(&format!("ALTER DATABASE \"{}\" SET backend_flush_after = '1MB'", chosen.name))
        .await
        .unwrap();
    schema::migrate(&mut chosen.client().await, None).await.unwrap();
    assert_eq!(database_flush_after(&chosen).await.as_deref(), Some("1MB"));

    let not_owner = TestDb::empty().await;
    let mut client = not_owner.client().await;
    client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE inbox_test_table_owner; \
                   EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$; \
             GRANT CREATE ON SCHEMA public TO inbox_test_table_owner; \
             SET ROLE inbox_test_table_owner",
        )
        .await
        .unwrap();
    let reports = schema::migrate(&mut client, None).await.unwrap();
    assert_eq!(reports[0].version, expected_version());
    assert_eq!(database_flush_after(&not_owner).await, None);
    // deploy/roles.sql, which a superuser applies after such a migration, sets it there.
    let admin = not_owner.client().await;
    admin.batch_execute(include_str!("../../deploy/roles.sql")).await.expect("applying deploy/roles.sql");
    assert_eq!(database_flush_after(&not_owner).await.as_deref(), Some(WRITE_BACK));
}
