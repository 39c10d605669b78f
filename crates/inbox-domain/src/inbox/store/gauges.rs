//! The queue gauges every worker exports, counted by one worker per interval (migration V7): the
//! first whose refresh finds the shared row stale takes it and counts
//! ([`super::admin::QUEUE_GAUGES_SQL`]); the others read what it wrote. A worker that reads the
//! figures adds the time since they were counted to the oldest age, so that gauge keeps growing
//! between counts as it would if every worker counted.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::admin::QueueGauges;
use super::{set_limits, TransactionLimits};

/// The shared figures as a select list over `queue_gauges`, the oldest age brought up to now (a
/// string literal, for `concat!`).
macro_rules! shared_figures {
    () => {
        "unprocessed, ready, needs_review, no_handler,
       CASE WHEN unprocessed > 0
            THEN oldest_unprocessed_age_seconds + extract(epoch FROM now() - refreshed_at)::float8
            ELSE 0 END AS oldest_unprocessed_age_seconds
  FROM queue_gauges"
    };
}

/// Takes the shared row when it is older than `$1` seconds and nobody else is refreshing it
/// (SKIP LOCKED: a worker never waits for another's count). No row: another worker is counting
/// right now. `stale` false: fresh enough, here are the figures.
pub const TAKE_STALE_SQL: &str = concat!(
    "SELECT refreshed_at <= now() - make_interval(secs => $1) AS stale,\n       ",
    shared_figures!(),
    "\n   FOR UPDATE SKIP LOCKED"
);

/// The shared figures, without waiting for a refresh in progress.
pub const READ_SQL: &str = concat!("SELECT false AS stale, ", shared_figures!());

/// Writes a fresh count (`$1..$5`), on the row [`TAKE_STALE_SQL`] locked.
pub const WRITE_SQL: &str = "\
UPDATE queue_gauges
   SET refreshed_at = now(), unprocessed = $1, ready = $2, needs_review = $3,
       oldest_unprocessed_age_seconds = $4, no_handler = $5";

/// The queue gauges, counted here if the shared figures are older than `interval` and no other
/// worker is counting, else read as another worker wrote them. Returns the gauges and whether
/// this call counted them. One transaction whose statements the server stops at `interval`
/// (a count slower than that is abandoned, not left running); on error the caller discards the
/// connection.
pub async fn refresh(
    client: &mut Client,
    interval: Duration,
) -> Result<(QueueGauges, bool), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let limits =
        TransactionLimits { statement_timeout: interval, lock_timeout: interval / 2, idle_timeout: interval };
    set_limits(&tx, &limits).await?;
    let age = interval.as_secs_f64();
    let taken = tx.query_typed(TAKE_STALE_SQL, &[(&age, Type::FLOAT8)]).await?;
    let (gauges, counted) = match taken.first() {
        Some(row) if row.get::<_, bool>("stale") => {
            let gauges = super::admin::queue_gauges(&tx).await?;
            let params: [(&(dyn ToSql + Sync), Type); 5] = [
                (&gauges.unprocessed, Type::INT8),
                (&gauges.ready, Type::INT8),
                (&gauges.needs_review, Type::INT8),
                (&gauges.oldest_unprocessed_age_seconds, Type::FLOAT8),
                (&gauges.no_handler, Type::INT8),
            ];
            tx.execute_typed(WRITE_SQL, &params).await?;
            (gauges, true)
        }
        Some(row) => (QueueGauges::from_row(row), false),
        None => (QueueGauges::from_row(&tx.query_typed_one(READ_SQL, &[]).await?), false),
    };
    tx.commit().await?;
    Ok((gauges, counted))
}
