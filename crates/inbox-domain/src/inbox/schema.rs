//! The schema: the inbox's migrations, embedded from `migrations/`, and an application's own
//! ([`Migrations`]), both applied by `migrate` (refinery runs them and keeps each set's history).
//!
//! Order: the inbox's migrations first, then the application's, in one run under one advisory
//! lock; each set has its own history table, so their version numbers never collide and either
//! can grow without the other. An application's migrations may therefore refer to the inbox's
//! tables (a foreign key to `invoices`, a view over `outbox`), but never change them: the inbox's
//! tables belong to its migrations.

use crate::db::{db_error, describe_db_error};

mod embedded {
    refinery::embed_migrations!("../../migrations");
}

/// Key of the session advisory lock that serialises concurrent `migrate` runs (refinery itself
/// does not lock): the second runner waits, then finds every version applied and does nothing.
pub const MIGRATION_LOCK_KEY: i64 = 0x5354_5249_5045_4d31; // "STRIPEM1"

/// The table refinery records the inbox's applied versions in.
pub const HISTORY_TABLE: &str = "refinery_schema_history";

/// The schema version this build expects: the highest embedded migration.
pub fn expected_version() -> i32 {
    embedded::migrations::runner().get_migrations().iter().map(|m| m.version()).max().unwrap_or(0)
}

/// A digest of the embedded migrations (versions, names and refinery's checksums of their SQL):
/// what this build would create. Test support names its template databases by it, so a template
/// always matches the migrations compiled into the binaries that use it.
pub fn embedded_digest() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for m in embedded::migrations::runner().get_migrations() {
        (m.version(), m.name(), m.checksum()).hash(&mut hasher);
    }
    hasher.finish()
}

/// An application's own migrations: its tables, beside the inbox's, with a history table of its
/// own. Built in the application's binary from SQL files embedded at compile time:
/// ```
/// use inbox_domain::inbox::schema::Migrations;
/// let migrations = Migrations::new("billing_app_schema_history")
///     .add("V1__customers", "CREATE TABLE customers (id text PRIMARY KEY)")
///     // .add("V2__…", include_str!("../migrations/V2__….sql"))
///     ;
/// assert_eq!(migrations.history_table(), "billing_app_schema_history");
/// ```
/// Names follow refinery's `V{version}__{name}`; versions only ever grow, and an applied migration
/// is never edited (`migrate` refuses when one was).
#[derive(Debug, Clone)]
pub struct Migrations {
    history_table: String,
    files: Vec<(String, String)>,
}

impl Migrations {
    /// No migrations yet, recorded in `history_table` (a plain lower-case SQL name, not the
    /// inbox's `refinery_schema_history`).
    pub fn new(history_table: &str) -> Self {
        Migrations { history_table: history_table.to_owned(), files: Vec::new() }
    }

    /// Adds the migration `name` (`V{version}__{name}`) with its SQL.
    pub fn add(mut self, name: &str, sql: &str) -> Self {
        self.files.push((name.to_owned(), sql.to_owned()));
        self
    }

    /// Where these migrations' applied versions are recorded.
    pub fn history_table(&self) -> &str {
        &self.history_table
    }

    /// A refinery runner for these migrations, or why they cannot run.
    fn runner(&self) -> anyhow::Result<refinery::Runner> {
        let table = &self.history_table;
        let plain = !table.is_empty()
            && table.len() <= 63
            && table.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && table.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        anyhow::ensure!(plain, "the migration history table {table:?} is not a plain lower-case SQL name");
        anyhow::ensure!(
            table != HISTORY_TABLE,
            "the application's migrations need a history table of their own, not the inbox's {HISTORY_TABLE}"
        );
        let mut migrations = Vec::with_capacity(self.files.len());
        for (name, sql) in &self.files {
            let migration = refinery::Migration::unapplied(name, sql).map_err(|e| {
                anyhow::anyhow!("migration {name:?} is not named V{{version}}__{{name}}: {e}")
            })?;
            if let Some(twin) =
                migrations.iter().find(|m: &&refinery::Migration| m.version() == migration.version())
            {
                anyhow::bail!(
                    "migrations {name:?} and V{}__{} have the same version",
                    twin.version(),
                    twin.name()
                );
            }
            migrations.push(migration);
        }
        let mut runner = refinery::Runner::new(&migrations);
        runner.set_migration_table_name(table);
        Ok(runner)
    }
}

/// What a `migrate` run did to one set of migrations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// The history table of the set.
    pub history_table: String,
    /// Versions this run applied, in order (empty when the schema was already current).
    pub applied: Vec<(i32, String)>,
    /// The version the set is at afterwards.
    pub version: i32,
}

/// Applies every pending migration — the inbox's, then `app`'s — under a session advisory lock.
/// Repeatable, and safe when two run at once. Refuses (refinery's divergence check) when an
/// applied migration was edited or is missing from this build; `app`'s are checked before any
/// migration runs. Returns one report per set, the inbox's first.
pub async fn migrate(
    client: &mut tokio_postgres::Client,
    app: Option<&Migrations>,
) -> anyhow::Result<Vec<MigrateReport>> {
    let app_runner = app.map(Migrations::runner).transpose()?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await
        .map_err(|e| db_error("taking the migration lock", &e))?;
    let mut sets = vec![(HISTORY_TABLE.to_owned(), embedded::migrations::runner())];
    if let (Some(runner), Some(app)) = (app_runner, app) {
        sets.push((app.history_table.clone(), runner));
    }
    let mut reports = Vec::new();
    let mut result = Ok(());
    for (table, runner) in sets {
        let run = runner.set_abort_divergent(true).set_abort_missing(true).run_async(client).await;
        match run {
            Ok(report) => reports.push(MigrateReport {
                applied: report
                    .applied_migrations()
                    .iter()
                    .map(|m| (m.version(), m.name().to_owned()))
                    .collect(),
                version: 0,
                history_table: table,
            }),
            Err(e) => {
                result = Err(anyhow::anyhow!(
                    "applying the migrations recorded in {table}: {}",
                    describe_refinery_error(&e)
                ));
                break;
            }
        }
    }
    // Unlock even when a run failed; a lost connection releases the lock by itself.
    let _ = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY]).await;
    result?;
    for report in &mut reports {
        report.version = current_version_in(client, &report.history_table).await?.unwrap_or(0);
    }
    Ok(reports)
}

/// refinery's error says which migration failed; the server's reason, with its SQLSTATE, is the
/// tokio-postgres error underneath it.
fn describe_refinery_error(e: &refinery::Error) -> String {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(db) = cause.downcast_ref::<tokio_postgres::Error>() {
            return format!("{}: {}", e.kind(), describe_db_error(db));
        }
        source = cause.source();
    }
    e.to_string()
}

/// Statement reading the inbox's applied schema version; fails with 42P01 before the first
/// migration.
pub const CURRENT_VERSION_SQL: &str = "SELECT max(version) FROM refinery_schema_history";

/// The version the inbox's schema is at, or `None` when no migration was ever applied.
pub async fn current_version(client: &tokio_postgres::Client) -> anyhow::Result<Option<i32>> {
    current_version_in(client, HISTORY_TABLE).await
}

/// Where the database's schema stands against this build's ([`expected_version`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaState {
    /// At the version this build expects.
    Current,
    /// Older (0: never migrated): this build's statements would fail on missing tables and
    /// columns. The message says to run `migrate`.
    Older { found: i32, expected: i32 },
    /// Newer: migrated by a later build. Its migrations only add, so this build works, but an
    /// operator should know.
    Newer { found: i32, expected: i32 },
}

impl SchemaState {
    /// What to tell an operator, when anything.
    pub fn message(self) -> Option<String> {
        match self {
            SchemaState::Current => None,
            SchemaState::Older { found: 0, expected } => Some(format!(
                "the database has no inbox schema (version 0), this binary needs version {expected}: run \
                 `inbox-worker migrate` (your own worker binary: its `migrate`) against it first"
            )),
            SchemaState::Older { found, expected } => Some(format!(
                "the schema is at version {found}, this binary needs version {expected}: run \
                 `inbox-worker migrate` (your own worker binary: its `migrate`) first"
            )),
            SchemaState::Newer { found, expected } => Some(format!(
                "the schema is at version {found}, newer than this binary's {expected}: a later release \
                 migrated it; this one works on it, but upgrade it to match"
            )),
        }
    }
}

/// Reads the schema version and compares it with this build's.
pub async fn state(client: &tokio_postgres::Client) -> anyhow::Result<SchemaState> {
    let expected = expected_version();
    Ok(match current_version(client).await?.unwrap_or(0) {
        found if found < expected => SchemaState::Older { found, expected },
        found if found > expected => SchemaState::Newer { found, expected },
        _ => SchemaState::Current,
    })
}

/// The highest version recorded in `history_table` (a name [`Migrations`] accepted), or `None`
/// when the table does not exist yet.
async fn current_version_in(
    client: &tokio_postgres::Client,
    history_table: &str,
) -> anyhow::Result<Option<i32>> {
    let sql = if history_table == HISTORY_TABLE {
        CURRENT_VERSION_SQL.to_owned()
    } else {
        format!("SELECT max(version) FROM {history_table}")
    };
    match client.query_typed_one(&sql, &[]).await {
        Ok(row) => Ok(row.get::<_, Option<i32>>(0)),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Ok(None),
        Err(e) => Err(db_error(&format!("reading the schema version from {history_table}"), &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What deployed databases hold in `refinery_schema_history`, as refinery 0.8 wrote it. `migrate`
    /// refuses a history whose checksum differs from the embedded migration's ("divergent"), so a
    /// refinery upgrade that hashed differently, or an edit of an applied migration, would stop
    /// every existing deployment from starting. A migration adds its line once released.
    #[test]
    fn the_embedded_migrations_keep_the_checksums_deployed_histories_hold() {
        let deployed: &[(i32, &str, u64)] = &[
            (1, "inbox_schema", 12544170904423351062),
            (2, "inbox_fillfactor_50", 5818911000470392866),
            (3, "inbox_parked_at", 5660748479962578293),
            (4, "inbox_payload_bytes", 17591272859250902483),
            (5, "operator_audit_session", 11429132488373390987),
            (6, "inbox_provenance_and_held_rows", 9183079698664329205),
            (7, "queue_gauges_cache", 14607355921645953392),
            (8, "inbox_interruptions", 9869500264458217759),
            (9, "worker_registrations_and_queue_by_type", 7513714480168600191),
            (10, "inbox_dismissed_at", 13882276969103330017),
            (11, "invoice_currency_and_stripe_times", 10565891834455737459),
            (12, "outbox_relay", 15890025913934915424),
            (13, "reconciliation_items_resolution", 4245904561795868907),
            (14, "reconcile", 988516894815199966),
            (15, "stripe_object_snapshots", 11270528153003073134),
            (16, "analyze_after_stats_reset", 8623717898060047614),
            (17, "inbox_queue_table", 11624598636625724212),
            (18, "inbox_room_for_hot_updates", 4733957785008689081),
            (19, "inbox_queue_follows_per_statement", 817117817138637429),
            (20, "inbox_queue_follow_probes_each_key", 2435015933228605797),
            (21, "inbox_queue_triggers_without_jit", 9438453503264544456),
            (22, "database_write_back", 15064868090143961815),
            (23, "inbox_analyse_samples_3000_rows", 904442299757763777),
            (24, "outbox_analyse_samples_3000_rows", 11905502597410761509),
            (25, "outbox_vacuumed_after_1_percent", 13704291160646896757),
            (26, "inbox_queue_probes_mark_dead_entries", 11639964413584498386),
        ];
        let embedded: Vec<(i32, String, u64)> = embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| (m.version(), m.name().to_owned(), m.checksum()))
            .collect();
        for &(version, name, checksum) in deployed {
            assert!(
                embedded.contains(&(version, name.to_owned(), checksum)),
                "V{version}__{name} no longer has the checksum deployed histories hold ({checksum})"
            );
        }
    }

    #[test]
    fn application_migrations_are_refused_before_anything_runs_when_they_cannot_run() {
        let error = |m: Migrations| m.runner().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error(Migrations::new(HISTORY_TABLE)).contains("history table of their own"));
        assert!(error(Migrations::new("App History")).contains("not a plain lower-case SQL name"));
        assert!(error(Migrations::new("app_history").add("create_things", "SELECT 1"))
            .contains("V{version}__{name}"));
        let twice = Migrations::new("app_history").add("V1__a", "SELECT 1").add("V1__b", "SELECT 2");
        assert!(error(twice).contains("same version"));
        let fine = Migrations::new("app_history").add("V1__a", "SELECT 1").add("V2__b", "SELECT 2");
        assert_eq!(fine.runner().unwrap().get_migrations().len(), 2);
    }
}
