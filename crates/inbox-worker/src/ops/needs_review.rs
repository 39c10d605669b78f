//! `needs-review`: the parked rows, oldest first, with their last error, why the ingest held
//! them on arrival when it did, and what each event says of itself (livemode, the connected
//! account; JSON also has `api_version`).

use clap::Args as ClapArgs;
use inbox_domain::inbox::store::admin::{self, ParkedRow};
use serde::Serialize;

use super::db_error;
use super::output::{emit, emit_json, one_line, plural, OutputArgs, Table};

/// Flags of `needs-review`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Most rows listed.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
    /// The parked outbox rows instead (deliveries the relays gave up on), with the later rows of
    /// their aggregate each holds back.
    #[arg(long)]
    pub outbox: bool,
}

/// The widest `last_error` shown in the table (JSON has it whole).
const TABLE_ERROR_WIDTH: usize = 80;

/// `needs-review`.
pub async fn run(client: &(impl tokio_postgres::GenericClient + Sync), args: &Args) -> anyhow::Result<()> {
    if args.limit < 1 {
        anyhow::bail!("--limit must be at least 1 (got {})", args.limit);
    }
    if args.outbox {
        return super::outbox::needs_review(client, args.limit, args.output.json).await;
    }
    let rows = admin::parked_rows(client, args.limit).await.map_err(db_error("listing the parked rows"))?;
    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            rows: &'a [ParkedRow],
            count: usize,
        }
        return emit_json(&Report { rows: &rows, count: rows.len() });
    }
    if rows.is_empty() {
        return emit("no parked rows\n");
    }
    let mut table = Table::new(&[
        ("provider", false),
        ("endpoint", false),
        ("event_id", false),
        ("event_type", false),
        ("attempts", true),
        ("livemode", false),
        ("account", false),
        ("received_at", false),
        ("parked_at", false),
        ("held", false),
        ("last_error", false),
    ]);
    for r in &rows {
        table.push(vec![
            r.provider.clone(),
            r.endpoint.clone(),
            r.event_id.clone(),
            r.event_type.clone(),
            r.attempts.to_string(),
            r.livemode.map_or_else(|| "-".to_owned(), |live| live.to_string()),
            r.account.clone().unwrap_or_else(|| "-".to_owned()),
            r.received_at.clone(),
            r.parked_at.clone(),
            r.held.clone().unwrap_or_else(|| "-".to_owned()),
            r.last_error.as_deref().map_or_else(|| "-".to_owned(), |e| one_line(e, TABLE_ERROR_WIDTH)),
        ]);
    }
    let mut text = table.render();
    text.push_str(&format!("{} parked row{}", rows.len(), plural(rows.len())));
    if rows.len() as i64 == args.limit {
        text.push_str(&format!(" shown (the first {}; pass --limit for more)", args.limit));
    }
    text.push('\n');
    emit(&text)
}
