//! `migrate`: applies the inbox's migrations, then this binary's own (see
//! `inbox_domain::inbox::schema`), and says what it did.

use inbox_domain::handler::Registry;
use inbox_domain::inbox::schema;

use super::output::emit;

/// `migrate`.
pub async fn run(client: &mut deadpool_postgres::Object, registry: &Registry) -> anyhow::Result<()> {
    let reports = schema::migrate(client, registry.app_migrations()).await?;
    let mut text = String::new();
    for report in &reports {
        // The inbox's set is "schema"; an application's is named by its history table.
        let (set, recorded_in) = match report.history_table.as_str() {
            schema::HISTORY_TABLE => ("schema".to_owned(), String::new()),
            table => (table.to_owned(), format!(" ({table})")),
        };
        for (version, name) in &report.applied {
            text.push_str(&format!("applied V{version} {name}{recorded_in}\n"));
        }
        let state = if report.applied.is_empty() { "is up to date at" } else { "is at" };
        text.push_str(&format!("{set} {state} version {}\n", report.version));
    }
    emit(&text)
}
