//! scale: does a table of `--scale-rows` processed rows slow the drain? The one-process drain of
//! (c), in a database holding the processed rows and in an empty one, alternated.
//!
//! The two drains of a pair differ by the processed rows alone: each runs in a fresh database
//! with the same `--scale-queued` rows queued the same way, the history's database a file copy of
//! a template seeded once (so its million rows are on disk and in the OS's cache, not in
//! shared_buffers: where rows processed days ago are in a running system). A shared 2-core VM's
//! speed drifts by ±15 % within a minute (the worker's own CPU per event, which the table cannot
//! change, moves with it), so single drains a minute apart compare the minutes more than the
//! tables: the rounds alternate the order (history, empty; empty, history; …: the first drain after
//! the template's seeding tends to be the slowest, and the history's takes it), which cancels a
//! drift that is linear over the phase, and the ratio is the history's total rate over the empty
//! table's.

use serde_json::json;

use crate::drain::{self, Plan};
use crate::{pg, util, Ctx};

pub async fn run(ctx: &Ctx) -> anyhow::Result<serde_json::Value> {
    let template = ctx.server.create_db("scale_history").await?;
    let result = match seed_history(ctx, &template).await {
        Ok(()) => rounds(ctx, &template).await,
        Err(e) => Err(e),
    };
    ctx.server.drop_db(&template).await;
    result
}

/// Migrates `db` and writes the processed rows, vacuumed (hint bits and visibility map set, as
/// old rows have them) and checkpointed; closes its session, so that `db` can be copied.
async fn seed_history(ctx: &Ctx, db: &pg::BenchDb) -> anyhow::Result<()> {
    ctx.migrate(&db.url).await?;
    let rows = ctx.args.scale_rows;
    let client = pg::connect(&db.url).await?;
    ctx.say(&format!("scale: inserting {rows} processed rows (~500 B payloads) into a template"));
    let small = crate::payload::small_template();
    pg::seed_processed(&client, &small, "h_", rows, |done| {
        ctx.say(&format!("scale:   {done} / {rows} processed rows"));
    })
    .await?;
    client.batch_execute("VACUUM ANALYZE webhook_inbox").await?;
    client.batch_execute("CHECKPOINT").await?;
    Ok(())
}

async fn rounds(ctx: &Ctx, template: &pg::BenchDb) -> anyhow::Result<serde_json::Value> {
    let queued = ctx.args.scale_queued.unwrap_or(ctx.args.drain_rows);
    let rounds = ctx.args.scale_rounds.max(1);
    let plan = |label: &'static str, history, last| Plan {
        label,
        db_suffix: label.replace('-', "_"),
        processes: 1,
        concurrency: Some(ctx.args.worker_concurrency),
        batch_size: ctx.args.worker_batch_size,
        queued,
        history,
        pgstattuple: last,
    };
    let mut per_round = Vec::new();
    let (mut history_runs, mut empty_runs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let last = round + 1 == rounds;
        let history_first = round % 2 == 0;
        let mut rates = [0.0; 2];
        let mut autovacuum = [0; 2];
        for history in [history_first, !history_first] {
            let v = if history {
                let plan = plan("scale", ctx.args.scale_rows, last);
                let db = ctx.server.create_db_from(&plan.db_suffix, template).await?;
                let v = drain::drain(ctx, &plan, &db).await;
                ctx.server.drop_db(&db).await;
                v?
            } else {
                drain::run(ctx, &plan("scale-empty", 0, last)).await?
            };
            rates[usize::from(history)] = v["events_per_s"].as_f64().unwrap_or(f64::NAN);
            autovacuum[usize::from(history)] = v["autovacuum_in_window"].as_array().map_or(0, Vec::len);
            if history {
                history_runs.push(v)
            } else {
                empty_runs.push(v)
            }
        }
        per_round.push(json!({
            "history_first": history_first,
            "empty_table_events_per_s": rates[0],
            "history_events_per_s": rates[1],
            "ratio": rates[1] / rates[0],
            "autovacuum_runs_empty_table": autovacuum[0],
            "autovacuum_runs_history": autovacuum[1],
        }));
    }
    // The figures of the last drain of each (sizes, plans, CPU), with the rate of all of them.
    let total = |runs| util::total_rate(runs, "queued_rows", "events_per_s").unwrap_or_else(|| json!({}));
    let (mut out, empty) = (total(history_runs), total(empty_runs));
    let rate = |v: &serde_json::Value| v["events_per_s"].as_f64().unwrap_or(f64::NAN);
    let (history_rate, empty_rate) = (rate(&out), rate(&empty));
    ctx.say(&format!(
        "scale: {history_rate:.0} events/s with {} processed rows, {empty_rate:.0} without, over {} rounds: {:.2} ×",
        ctx.args.scale_rows,
        per_round.len(),
        history_rate / empty_rate
    ));
    out["empty_table_events_per_s"] = json!(empty_rate);
    out["ratio_to_empty_table"] = json!(history_rate / empty_rate);
    out["rounds"] = json!(per_round);
    out["empty_table_last_drain"] = empty;
    Ok(out)
}
