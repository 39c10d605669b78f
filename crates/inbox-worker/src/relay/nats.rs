//! The NATS JetStream destination: each row published on `--subject` with `Nats-Msg-Id` = the
//! outbox id, delivered once the stream acknowledges it (an ack saying `duplicate` is a delivery
//! too: the stream already holds the row).
//!
//! The stream's duplicate window (2 minutes by default) is what turns a redelivery into one stored
//! message: a retry that lands after it is stored twice. So at start the relay reads the stream
//! that captures the subject and warns when its window is shorter than the longest retry gap
//! (`--max-backoff` plus the lease); consumers may still dedupe on `Nats-Msg-Id`.
//!
//! Retried with the same id (the message may be stored already): a publish or ack timeout, a
//! broken connection, no stream or no responders (during a leader election), too many acks
//! pending, a server error. Parked: a row larger than the server's `max_payload`, which no retry
//! changes.

use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::ServerAddr;
use inbox_domain::inbox::store::outbox::OutboxClaimed;

use super::{Failure, FENCING_TOKEN_HEADER};

/// The JetStream destination of `relay --to-nats`.
pub struct Nats {
    jetstream: async_nats::jetstream::Context,
    subject: String,
    /// The servers as logs show them: host:port, no credentials.
    shown: String,
}

impl std::fmt::Debug for Nats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nats").field("servers", &self.shown).field("subject", &self.subject).finish()
    }
}

impl Nats {
    /// Connects to `servers` (comma-separated URLs) and checks the stream that captures
    /// `subject`: a start-up refusal when no stream does.
    pub async fn connect(servers: &str, subject: &str, timeout: Duration) -> anyhow::Result<Nats> {
        let addrs: Vec<ServerAddr> = servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .enumerate()
            .map(|(i, s)| {
                s.parse::<ServerAddr>().map_err(|e| anyhow::anyhow!("--to-nats server #{}: {e}", i + 1))
            })
            .collect::<anyhow::Result<_>>()?;
        if addrs.is_empty() {
            anyhow::bail!("--to-nats names no server (nats://host:4222[,nats://host2:4222…])");
        }
        let shown = addrs.iter().map(|a| format!("{}:{}", a.host(), a.port())).collect::<Vec<_>>().join(",");
        let client = async_nats::ConnectOptions::new()
            .name("inbox-relay")
            .connection_timeout(timeout.min(Duration::from_secs(10)))
            .connect(addrs)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to NATS at {shown}: {e}"))?;
        let jetstream = async_nats::jetstream::context::ContextBuilder::new()
            .timeout(timeout)
            // As many acks outstanding as deliveries in flight; wait for room rather than fail.
            .max_ack_inflight(4096)
            .backpressure_on_inflight(true)
            .build(client);
        let nats = Nats { jetstream, subject: subject.to_owned(), shown };
        Ok(nats)
    }

    /// The stream capturing the subject, and its duplicate window; a start-up refusal when no
    /// stream captures it (every publish would fail).
    pub async fn stream(&self) -> anyhow::Result<(String, Duration)> {
        use async_nats::jetstream::context::GetStreamByNameErrorKind;
        let name = match self.jetstream.stream_by_subject(self.subject.clone()).await {
            Ok(name) => name,
            Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => anyhow::bail!(
                "no JetStream stream captures subject {} at {}: create one first (e.g. `nats stream add \
                 --subjects {}`), with a duplicate window covering --max-backoff",
                self.subject,
                self.shown,
                self.subject
            ),
            Err(e) => anyhow::bail!(
                "finding the JetStream stream of subject {} at {}: {e}",
                self.subject,
                self.shown
            ),
        };
        let stream = self
            .jetstream
            .get_stream(&name)
            .await
            .map_err(|e| anyhow::anyhow!("reading JetStream stream {name}: {e}"))?;
        Ok((name, stream.cached_info().config.duplicate_window))
    }

    /// Where rows go, as logs show it.
    pub fn describe(&self) -> String {
        format!("nats://{} subject {}", self.shown, self.subject)
    }

    /// Publishes `row` and waits for the stream's ack.
    pub async fn deliver(&self, row: &OutboxClaimed) -> Result<(), Failure> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", row.id.to_string().as_str());
        headers.insert(FENCING_TOKEN_HEADER, row.fencing_token.to_string().as_str());
        headers.insert("inbox-event-type", row.event_type.as_str());
        headers.insert("inbox-aggregate-type", row.aggregate_type.as_str());
        headers.insert("inbox-aggregate-id", row.aggregate_id.as_str());
        let payload = row.payload.clone();
        let ack = match self.jetstream.publish_with_headers(self.subject.clone(), headers, payload).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match ack {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded) => Err(Failure::park(format!(
                "publish to {} on {}: {e} (a larger row never fits: raise the server's max_payload or write smaller rows)",
                self.subject, self.shown
            ))),
            Err(e) => Err(Failure::retry(format!("publish to {} on {}: {e}", self.subject, self.shown))),
        }
    }
}
