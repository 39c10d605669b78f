//! `purge`: deletes processed rows older than an age, in batches (each its own transaction),
//! then writes one audit record with the total. Refuses an age under Stripe's retry window unless
//! `--force`.

use std::time::Duration;

use clap::Args as ClapArgs;
use inbox_domain::config::parse_duration;
use inbox_domain::db::describe_db_error;
use inbox_domain::inbox::store::admin;
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, plural, OutputArgs};
use super::{db_error, ActorArgs};

/// Flags of `purge`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Delete processed rows older than this (processed_at), e.g. 30d.
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// Count what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Allow an age under Stripe's 3-day retry window (a redelivery could then be applied again).
    #[arg(long)]
    pub force: bool,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Stripe retries a delivery for up to 3 days: a row purged sooner would not stop a redelivery
/// of its event from being applied again.
pub const STRIPE_RETRY_WINDOW: Duration = Duration::from_secs(3 * 24 * 3600);

/// What `purge --json` prints.
#[derive(Serialize)]
struct Report<'a> {
    action: &'static str,
    dry_run: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    matched: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batches: Option<u64>,
    cutoff: &'a str,
    older_than_seconds: u64,
}

/// `purge`.
pub async fn run(client: &(impl tokio_postgres::GenericClient + Sync), args: &Args) -> anyhow::Result<()> {
    let older_than = humantime::format_duration(args.older_than).to_string();
    if args.older_than < STRIPE_RETRY_WINDOW && !args.force {
        anyhow::bail!(
            "--older-than {older_than} is under Stripe's 3-day retry window: a redelivery after the \
             purge would be applied again; pass --force to do it anyway"
        );
    }
    let (cutoff, cutoff_text) = admin::purge_cutoff(client, args.older_than.as_secs_f64())
        .await
        .map_err(db_error("computing the purge cutoff"))?;

    if args.dry_run {
        let matched =
            admin::purge_count(client, cutoff).await.map_err(db_error("counting the rows to purge"))?;
        if args.output.json {
            return emit_json(&Report {
                action: "purge",
                dry_run: true,
                matched: Some(matched),
                deleted: None,
                batches: None,
                cutoff: &cutoff_text,
                older_than_seconds: args.older_than.as_secs(),
            });
        }
        return emit(&format!(
            "dry run: {matched} processed row{} older than {older_than} (processed before {cutoff_text}) \
             would be deleted; nothing changed\n",
            plural(matched as usize)
        ));
    }

    let mut target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "older_than_seconds": args.older_than.as_secs(),
        "cutoff": cutoff_text,
        "batch_size": args.batch_size,
        "force": args.force,
    });
    let mut deleted = 0u64;
    let mut batches = 0u64;
    loop {
        match admin::purge_batch(client, cutoff, args.batch_size).await {
            Ok(0) => break,
            Ok(n) => {
                deleted += n;
                batches += 1;
            }
            Err(e) => {
                // The batches before this one are committed: record them if the database lets us.
                if deleted > 0 {
                    target["incomplete"] = serde_json::Value::Bool(true);
                    let _ = admin::insert_audit(client, &args.actor.actor, "purge", &target, deleted).await;
                }
                anyhow::bail!(
                    "purge stopped after deleting {deleted} row{} in {batches} batch{}: {}",
                    plural(deleted as usize),
                    if batches == 1 { "" } else { "es" },
                    describe_db_error(&e)
                );
            }
        }
    }
    let audit_id = admin::insert_audit(client, &args.actor.actor, "purge", &target, deleted)
        .await
        .map_err(db_error("writing the audit record"))?;
    if args.output.json {
        return emit_json(&Report {
            action: "purge",
            dry_run: false,
            matched: None,
            deleted: Some(deleted),
            batches: Some(batches),
            cutoff: &cutoff_text,
            older_than_seconds: args.older_than.as_secs(),
        });
    }
    emit(&format!(
        "deleted {deleted} processed row{} older than {older_than} (processed before {cutoff_text}) \
         in {batches} batch{}; audit record {audit_id}\n",
        plural(deleted as usize),
        if batches == 1 { "" } else { "es" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_window_is_three_days() {
        assert_eq!(STRIPE_RETRY_WINDOW, humantime::parse_duration("3d").unwrap());
    }
}
