//! Wake-ups: a dedicated connection LISTENs for a (coalesced) NOTIFY — the ingest's for the
//! workers, the workers' for the relays — and wakes the producer, so an idle worker or relay picks
//! up new rows without waiting for its poll interval.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use inbox_domain::db::DatabaseConfig;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

/// What to listen on, and the connection's `application_name`.
#[derive(Debug, Clone, Copy)]
pub struct Channel {
    /// The `LISTEN …` statement (from the store).
    pub listen_sql: &'static str,
    pub application_name: &'static str,
}

/// The workers' channel: the ingest's wake-ups.
pub const INBOX: Channel = Channel {
    listen_sql: inbox_domain::inbox::store::queue::LISTEN_SQL,
    application_name: "inbox-worker-listener",
};

/// The relays' channel: the workers' wake-ups after batches that may have written outbox rows.
pub const OUTBOX: Channel = Channel {
    listen_sql: inbox_domain::inbox::store::outbox::LISTEN_SQL,
    application_name: "inbox-relay-listener",
};

/// Listens on `channel` until `shutdown`, reconnecting after failures; the poll interval covers
/// the gaps.
/// A producer's wake-up: [`run`] on `channel`, spawned until `shutdown` — or, behind a transaction
/// pooler, none, said once: a notification goes to the server connection that LISTENed, which the
/// pool hands to other clients, so new rows are found by polling every `poll_interval`.
pub fn spawn(
    database: &DatabaseConfig,
    channel: Channel,
    poll_interval: Duration,
    shutdown: CancellationToken,
) -> Arc<Notify> {
    let wake = Arc::new(Notify::new());
    if database.pooler == inbox_domain::db::Pooler::Transaction {
        tracing::info!(
            poll_interval_s = poll_interval.as_secs_f64(),
            "behind a transaction pooler: no LISTEN wake-ups, polling for new rows"
        );
    } else {
        tokio::spawn(run(database.clone(), channel, wake.clone(), shutdown));
    }
    wake
}

pub async fn run(database: DatabaseConfig, channel: Channel, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut delay = Duration::from_millis(200);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            result = listen(&database, channel, &wake) => {
                if let Err(e) = result {
                    tracing::debug!(
                        error = %inbox_domain::db::describe_db_error(&e),
                        "wake-up listener disconnected; reconnecting"
                    );
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => delay = (delay * 2).min(Duration::from_secs(5)),
        }
    }
}

async fn listen(
    database: &DatabaseConfig,
    channel: Channel,
    wake: &Notify,
) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = database.open(channel.application_name).await?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let subscribe = client.batch_execute(channel.listen_sql);
    tokio::pin!(subscribe);
    // The connection is driven by polling its message stream: do both until LISTEN is done.
    loop {
        tokio::select! {
            done = &mut subscribe => { done?; break }
            message = messages.next() => match message {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    }
    // Rows may have arrived while we were not listening.
    wake.notify_one();
    while let Some(message) = messages.next().await {
        if let AsyncMessage::Notification(_) = message? {
            wake.notify_one();
        }
    }
    Ok(())
}
