//! `reconciliation`: the reconciliation items — what the handlers could not settle and a person
//! must (a payment on a voided invoice, an event Stripe failed to generate) — open ones by
//! default, every one with `--all`; and `reconciliation resolve`, which closes one item with what
//! was done, in one transaction with its audit record. The item stays, closed, as the record of
//! who settled it and how; the gauge `inbox_reconciliation_items_open` and its alert count the open
//! ones. docs/operations.md, "Reconciliation items", says what each reason asks of a person.

use clap::{Args as ClapArgs, Subcommand};
use inbox_domain::inbox::store::reconciliation::{self, ReconciliationItem};
use inbox_domain::inbox::store::set_limits;
use serde::Serialize;

use super::db_error;
use super::output::{emit, emit_json, one_line, plural, OutputArgs, Table};
use super::{refuse, Actor, ActorArgs, LIMITS};

/// Flags of `reconciliation`.
#[derive(Debug, ClapArgs)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub action: Option<Action>,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Also the resolved items (after the open ones, the most recently resolved first).
    #[arg(long)]
    pub all: bool,
    /// Most items listed.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

/// What `reconciliation` does besides listing.
#[derive(Debug, Subcommand)]
pub enum Action {
    /// Close one open item, saying what was done (kept with the item, audited).
    Resolve(ResolveArgs),
}

/// Flags of `reconciliation resolve`.
#[derive(Debug, ClapArgs)]
pub struct ResolveArgs {
    /// The item's id (the first column of the listing).
    #[arg(long)]
    pub id: i64,
    /// What was done: kept with the item (resolution_note) and in the audit record.
    #[arg(long, value_parser = non_empty_note)]
    pub note: String,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

impl Args {
    /// Whether JSON was asked for, of the listing or of `resolve`.
    pub fn json(&self) -> bool {
        match &self.action {
            Some(Action::Resolve(resolve)) => resolve.output.json,
            None => self.output.json,
        }
    }
}

/// A note is what the next person reads to know what was done: one that says nothing is a usage
/// error (exit 2), refused before anything is read or changed.
fn non_empty_note(note: &str) -> Result<String, String> {
    let note = note.trim();
    if note.is_empty() {
        return Err("the note must say what was done (it is kept with the item and audited)".to_owned());
    }
    Ok(note.to_owned())
}

/// The widest note shown in the table (JSON has it whole).
const TABLE_NOTE_WIDTH: usize = 60;

/// `reconciliation` and `reconciliation resolve`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    match &args.action {
        Some(Action::Resolve(resolve_args)) => present_resolve(client, resolve_args).await,
        None => list(&***client, args).await,
    }
}

/// What the item is about, for the table: its invoice, or the object to re-fetch.
fn about(item: &ReconciliationItem) -> String {
    match (&item.invoice_id, &item.object_type, &item.object_id) {
        (Some(invoice), _, _) => format!("invoice {invoice}"),
        (None, Some(object_type), Some(id)) => format!("{object_type} {id}"),
        (None, None, Some(id)) => id.clone(),
        _ => "-".to_owned(),
    }
}

/// Where to fetch it: the object's API path, else (an event that named no object) the event whose
/// details say what was lost.
fn fetch(item: &ReconciliationItem) -> String {
    item.object_url
        .clone()
        .or_else(|| item.detail.get("event_url").and_then(|u| u.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "-".to_owned())
}

/// `reconciliation [--all] [--limit N]`.
async fn list(client: &(impl tokio_postgres::GenericClient + Sync), args: &Args) -> anyhow::Result<()> {
    if args.limit < 1 {
        anyhow::bail!("--limit must be at least 1 (got {})", args.limit);
    }
    let items = reconciliation::list(client, args.all, args.limit)
        .await
        .map_err(db_error("listing the reconciliation items"))?;
    let open = items.iter().filter(|i| i.resolved_at.is_none()).count();
    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            items: &'a [ReconciliationItem],
            count: usize,
            open: usize,
        }
        return emit_json(&Report { items: &items, count: items.len(), open });
    }
    if items.is_empty() {
        return emit(if args.all { "no reconciliation items\n" } else { "no open reconciliation items\n" });
    }
    let mut columns = vec![
        ("id", true),
        ("created_at", false),
        ("reason", false),
        ("about", false),
        ("fetch", false),
        ("event_id", false),
        ("endpoint", false),
    ];
    if args.all {
        columns.extend([("resolved_at", false), ("resolved_by", false), ("note", false)]);
    }
    let mut table = Table::new(&columns);
    for item in &items {
        let mut row = vec![
            item.id.to_string(),
            item.created_at.clone(),
            item.reason.clone(),
            about(item),
            fetch(item),
            item.event_id.clone(),
            item.detail.get("endpoint").and_then(|e| e.as_str()).unwrap_or("-").to_owned(),
        ];
        if args.all {
            let dash = || "-".to_owned();
            row.extend([
                item.resolved_at.clone().unwrap_or_else(dash),
                item.resolved_by.clone().unwrap_or_else(dash),
                item.resolution_note.as_deref().map_or_else(dash, |n| one_line(n, TABLE_NOTE_WIDTH)),
            ]);
        }
        table.push(row);
    }
    let mut text = table.render();
    if args.all {
        text.push_str(&format!("{} item{} ({open} open)", items.len(), plural(items.len())));
    } else {
        text.push_str(&format!("{open} open item{}", plural(open)));
    }
    if items.len() as i64 == args.limit {
        text.push_str(&format!(" shown (the first {}; pass --limit for more)", args.limit));
    }
    text.push('\n');
    emit(&text)
}

/// What `reconciliation resolve --json` prints.
#[derive(Serialize)]
struct Resolved<'a> {
    action: &'static str,
    id: i64,
    reason: &'a str,
    resolved_at: &'a str,
    resolved_by: &'a str,
    note: &'a str,
    audit_id: i64,
}

/// The audit record's action.
const AUDIT_ACTION: &str = "resolve-reconciliation";

/// What [`resolve`] did.
#[derive(Debug, Clone)]
pub struct Resolution {
    /// The item as it was before (open).
    pub item: ReconciliationItem,
    /// What the item is about (its invoice, or the object to re-fetch), as the listing says.
    pub about: String,
    /// RFC 3339, UTC.
    pub resolved_at: String,
    pub resolved_by: String,
    /// The note kept (trimmed).
    pub note: String,
    pub audit_id: i64,
}

/// `reconciliation resolve --id N --note TEXT`: [`resolve`], presented.
async fn present_resolve(client: &mut deadpool_postgres::Object, args: &ResolveArgs) -> anyhow::Result<()> {
    let done = resolve(client, args.id, &args.note, args.actor.actor()).await?;
    if args.output.json {
        return emit_json(&Resolved {
            action: AUDIT_ACTION,
            id: done.item.id,
            reason: &done.item.reason,
            resolved_at: &done.resolved_at,
            resolved_by: &done.resolved_by,
            note: &done.note,
            audit_id: done.audit_id,
        });
    }
    emit(&format!(
        "resolved reconciliation item {} ({}, {}): closed at {}; audit record {}\n",
        done.item.id, done.item.reason, done.about, done.resolved_at, done.audit_id
    ))
}

/// Closes the open reconciliation item `id` with `note` (what was done; trimmed, required) and the
/// audit record, in one transaction: lock the item, refuse an unknown or closed one, close it.
pub async fn resolve(
    client: &mut deadpool_postgres::Object,
    id: i64,
    note: &str,
    actor: Actor<'_>,
) -> anyhow::Result<Resolution> {
    let note = match non_empty_note(note) {
        Ok(note) => note,
        Err(why) => refuse!("{why}"),
    };
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let Some(item) =
        reconciliation::lock_item(&*tx, id).await.map_err(db_error("looking up the reconciliation item"))?
    else {
        refuse!("no reconciliation item {id}: `inbox-worker reconciliation --all` lists them");
    };
    if let Some(at) = &item.resolved_at {
        refuse!(
            "reconciliation item {id} ({}) was already resolved at {at} by {}: {}",
            item.reason,
            item.resolved_by.as_deref().unwrap_or("?"),
            item.resolution_note.as_deref().unwrap_or("")
        );
    }
    let who = actor.name;
    let Some(resolved_at) = reconciliation::resolve(&*tx, id, who, &note)
        .await
        .map_err(db_error("resolving the reconciliation item"))?
    else {
        refuse!("reconciliation item {id} changed meanwhile: nothing resolved");
    };
    let target = serde_json::json!({
        "table": "reconciliation_items",
        "id": id,
        "reason": item.reason,
        "event_id": item.event_id,
        "note": note,
    });
    let audit_id =
        actor.audit(&*tx, AUDIT_ACTION, &target, 1).await.map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the resolution"))?;
    Ok(Resolution { about: about(&item), item, resolved_at, resolved_by: who.to_owned(), note, audit_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_that_says_nothing_is_refused_and_a_note_is_kept_trimmed() {
        for empty in ["", "   ", "\n\t"] {
            assert!(non_empty_note(empty).unwrap_err().contains("must say what was done"), "{empty:?}");
        }
        assert_eq!(non_empty_note("  refetched pi_1, no action  ").unwrap(), "refetched pi_1, no action");
    }
}
