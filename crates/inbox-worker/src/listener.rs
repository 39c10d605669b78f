//! Wake-ups: a dedicated connection LISTENs for the ingest's (coalesced) NOTIFY and wakes the
//! producer, so an idle worker picks up new rows without waiting for its poll interval.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use inbox_domain::db::DatabaseConfig;
use inbox_domain::inbox::store::queue::LISTEN_SQL;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

/// Listens until `shutdown`, reconnecting after failures; the poll interval covers the gaps.
pub async fn run(database: DatabaseConfig, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut delay = Duration::from_millis(200);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            result = listen(&database, &wake) => {
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

async fn listen(database: &DatabaseConfig, wake: &Notify) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = database.open("inbox-worker-listener").await?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let subscribe = client.batch_execute(LISTEN_SQL);
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
