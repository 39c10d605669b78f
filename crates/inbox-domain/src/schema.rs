//! The schema: migrations embedded from `migrations/` and applied by `inbox-worker migrate`.

use anyhow::Context as _;

mod embedded {
    refinery::embed_migrations!("../../migrations");
}

/// Key of the session advisory lock that serialises concurrent `migrate` runs (refinery itself
/// does not lock): the second runner waits, then finds every version applied and does nothing.
pub const MIGRATION_LOCK_KEY: i64 = 0x5354_5249_5045_4d31; // "STRIPEM1"

/// The table refinery records applied versions in.
pub const HISTORY_TABLE: &str = "refinery_schema_history";

/// The schema version this build expects: the highest embedded migration.
pub fn expected_version() -> i32 {
    embedded::migrations::runner().get_migrations().iter().map(|m| m.version() as i32).max().unwrap_or(0)
}

/// What a `migrate` run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// Versions this run applied, in order (empty when the schema was already current).
    pub applied: Vec<(i32, String)>,
    /// The version the database is at afterwards.
    pub version: i32,
}

/// Applies every pending migration under a session advisory lock. Repeatable, and safe when two
/// run at once. Refuses (refinery's divergence check) when an applied migration was edited.
pub async fn migrate(client: &mut tokio_postgres::Client) -> anyhow::Result<MigrateReport> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await
        .context("taking the migration lock")?;
    let result = embedded::migrations::runner()
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .run_async(client)
        .await;
    // Unlock even when the run failed; a lost connection releases the lock by itself.
    let _ = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY]).await;
    let report = result.context("applying migrations")?;
    let applied =
        report.applied_migrations().iter().map(|m| (m.version() as i32, m.name().to_owned())).collect();
    let version = current_version(client).await?.unwrap_or(0);
    Ok(MigrateReport { applied, version })
}

/// Statement reading the applied schema version; fails with 42P01 before the first migration.
pub const CURRENT_VERSION_SQL: &str = "SELECT max(version) FROM refinery_schema_history";

/// The version the database is at, or `None` when no migration was ever applied.
pub async fn current_version(client: &tokio_postgres::Client) -> anyhow::Result<Option<i32>> {
    match client.query_one(CURRENT_VERSION_SQL, &[]).await {
        Ok(row) => Ok(row.get::<_, Option<i32>>(0)),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Ok(None),
        Err(e) => Err(e).context("reading the schema version"),
    }
}
