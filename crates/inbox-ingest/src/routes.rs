//! The HTTP handlers: the webhook receiver and the health, readiness and metrics endpoints.

use std::time::{Duration, Instant};

use actix_web::http::header::{HeaderMap, CONTENT_LENGTH};
use actix_web::web::{self, Bytes, BytesMut};
use actix_web::{HttpRequest, HttpResponse};
use futures_util::StreamExt as _;
use inbox_domain::budget::BytesHeld;
use inbox_domain::inbox::event::EventHead;
use inbox_domain::inbox::signature;
use inbox_domain::inbox::store::ingest::{Held, InsertOutcome};
use inbox_domain::PROVIDER_STRIPE;
use tracing::Instrument as _;

use crate::batcher::Verified;
use crate::error::IngestError;
use crate::metrics::UNKNOWN_ENDPOINT_LABEL;
use crate::readiness::Verdict;
use crate::startup::AppState;

/// Largest total size of a webhook request's headers. Stripe sends well under 1 KiB; the HTTP
/// layer accepts far more (128 KiB), which only serves to make verification work on junk.
pub const MAX_HEADER_BYTES: usize = 8 * 1024;

/// `POST /webhooks/stripe/{endpoint}`: verify, store, then answer.
pub async fn receive_webhook(
    state: web::Data<AppState>,
    endpoint: web::Path<String>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, IngestError> {
    let started = Instant::now();
    let endpoint = endpoint.into_inner();
    let span = tracing::info_span!(
        "webhook",
        provider = PROVIDER_STRIPE,
        endpoint = tracing::field::Empty,
        event_id = tracing::field::Empty,
        event_type = tracing::field::Empty,
    );
    let peer = request.peer_addr().map(|a| a.ip());
    let result = if state.sources.admits(peer, request.headers()) {
        receive(&state, &endpoint, request.headers(), payload).instrument(span.clone()).await
    } else {
        Err(IngestError::ForbiddenSource)
    };
    let known = state.endpoints.contains_key(&endpoint);
    let label = if known { endpoint.as_str() } else { UNKNOWN_ENDPOINT_LABEL };
    let elapsed = started.elapsed();
    let _entered = span.enter();
    match &result {
        Ok(stored) => {
            let outcome = stored.label();
            state.metrics.record(label, outcome, elapsed);
            if stored.outcome == InsertOutcome::Unstorable {
                state.metrics.unstorable(label);
            }
            if stored.outcome != InsertOutcome::Duplicate {
                state.metrics.stored(label);
            }
            tracing::info!(outcome, elapsed_ms = inbox_domain::telemetry::millis(elapsed), "webhook stored");
        }
        Err(e) => {
            // Every refusal is counted; at most a few a second are logged (see crate::log_limit).
            state.metrics.record(label, e.outcome(), elapsed);
            if let IngestError::BadSignature(reason) = e {
                state.metrics.signature_failure(label, reason.reason());
            }
            let left_out = match e {
                IngestError::UnknownEndpoint => state.unknown_endpoint_log.admit(),
                _ => state.refusal_log.admit(),
            };
            match (e, left_out) {
                (_, None) => {}
                // A misspelt endpoint in Stripe's dashboard (names are case-sensitive) loses every
                // event sent to it: said at warn, with the names that exist.
                (IngestError::UnknownEndpoint, Some(left_out)) => tracing::warn!(
                    outcome = e.outcome(),
                    requested = %endpoint.chars().take(64).collect::<String>(),
                    configured = %state.endpoint_names,
                    refusals_not_logged = left_out,
                    "webhook for an endpoint that is not configured (names are case-sensitive): 404"
                ),
                // Stripe retries a refused event for three days, then drops it: a limit too low
                // for real events loses them. Said at warn, with the limit and its setting.
                (IngestError::TooLarge, Some(left_out)) => tracing::warn!(
                    outcome = e.outcome(),
                    limit_bytes = state.max_body,
                    setting = "--max-body / INBOX_MAX_BODY",
                    refusals_not_logged = left_out,
                    "webhook refused: body larger than --max-body (INBOX_MAX_BODY); raise it if Stripe sends events this large"
                ),
                (IngestError::Unavailable(cause), Some(left_out)) => tracing::warn!(
                    outcome = e.outcome(),
                    cause = %cause,
                    refusals_not_logged = left_out,
                    "webhook not stored: database unavailable"
                ),
                (_, Some(left_out)) => tracing::info!(
                    outcome = e.outcome(),
                    error = %e,
                    refusals_not_logged = left_out,
                    "webhook refused"
                ),
            }
        }
    }
    result.map(|stored| HttpResponse::Ok().json(serde_json::json!({ "status": stored.status() })))
}

/// What became of a verified event.
struct Stored {
    outcome: InsertOutcome,
    /// Why the row was parked on arrival, when it was (and was new).
    held: Option<Held>,
}

impl Stored {
    /// The answer's `status`: whatever is kept is `accepted` to the sender.
    fn status(&self) -> &'static str {
        match self.outcome {
            InsertOutcome::Duplicate => "duplicate",
            InsertOutcome::Accepted | InsertOutcome::Unstorable => "accepted",
        }
    }

    /// The metric and log label: held rows are counted apart from the accepted ones.
    fn label(&self) -> &'static str {
        match (self.outcome, self.held) {
            (InsertOutcome::Accepted, Some(Held::Livemode)) => "held_livemode",
            (outcome, _) => outcome.as_str(),
        }
    }
}

async fn receive(
    state: &AppState,
    endpoint: &str,
    headers: &HeaderMap,
    payload: web::Payload,
) -> Result<Stored, IngestError> {
    let config = state.endpoints.get(endpoint).ok_or(IngestError::UnknownEndpoint)?;
    tracing::Span::current().record("endpoint", endpoint);
    let header_bytes: usize = headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 4).sum();
    if header_bytes > MAX_HEADER_BYTES {
        return Err(IngestError::HeadersTooLarge);
    }

    // Before a byte of the body is read or held: its declared size, then everything the
    // signature header tells without the body (its shape, a usable v1, a fresh t).
    let declared = declared_length(headers, state.max_body)?;
    // Two Stripe-Signature headers are ambiguous: refuse rather than pick one.
    let mut signatures = headers.get_all(signature::HEADER_NAME);
    let header = signatures.next().map(|v| v.as_bytes());
    let precheck = if signatures.next().is_some() {
        Err(signature::SignatureError::Malformed("more than one Stripe-Signature header"))
    } else {
        config.verifier.precheck_now(header).map(|_| ())
    };
    if let Err(refused) = precheck {
        if declared.is_none() {
            // Chunked: the size is judged first all the same, on bytes read and thrown away.
            discard_body(payload, state.max_body, state.body_timeout).await?;
        }
        return Err(IngestError::BadSignature(refused));
    }

    let (body, held) = read_body(state, declared, payload).await?;
    let verified = config.verifier.verify_now(header, &body).map_err(IngestError::BadSignature)?;
    let fingerprint = config.fingerprints[verified.secret].clone();
    state.metrics.verified(endpoint, &fingerprint);

    // Only a verified body is parsed, and only a parsed one reaches the database.
    let head = EventHead::parse(&body).map_err(IngestError::BadPayload)?;
    let span = tracing::Span::current();
    span.record("event_id", head.id.as_ref());
    span.record("event_type", head.event_type.as_ref());

    let livemode_hold = config.mode.and_then(|mode| mode.hold_reason(endpoint, head.livemode));
    let held_kind = livemode_hold.as_ref().map(|_| Held::Livemode);
    let event = Verified {
        endpoint,
        event_id: &head.id,
        event_type: &head.event_type,
        livemode_hold,
        secret_position: i16::try_from(verified.secret).unwrap_or(i16::MAX),
        secret_fingerprint: fingerprint,
        signature_t: verified.timestamp,
        signature_v1: verified.signature,
    };
    let stored = state.batcher.insert(event, body.clone(), held);
    let outcome = match tokio::time::timeout(state.db_timeout, stored).await {
        Ok(result) => result?,
        Err(_) => return Err(IngestError::Unavailable("timed out".into())),
    };
    if outcome == InsertOutcome::Accepted && held_kind.is_none() {
        state.wake_workers.notify_one();
    }
    let held = match outcome {
        InsertOutcome::Accepted => held_kind,
        InsertOutcome::Unstorable => Some(Held::Unstorable),
        InsertOutcome::Duplicate => None,
    };
    Ok(Stored { outcome, held })
}

/// Requests that may wait for room in the bytes in flight at once; a request finding this many
/// waiting is answered 503 at once (its connection then closes, after [`crate::startup::LINGER`]).
/// A waiting request holds the chunk it could not store, and the HTTP layer buffers ~0.25 MiB
/// more of its body: this bounds that memory (~16 MiB), and it frees the connections of requests
/// that would most likely wait in vain for requests that may not.
pub const MAX_WAITING_FOR_ROOM: usize = 64;

/// Room taken for a body's first bytes, before they are read: it grows by doubling (up to the
/// declared length, or `--max-body` for a chunked body) as the body arrives. A Stripe event fits
/// in it whole. Headers that declare a body and send none hold this much at most each: 16 MiB
/// with every one of the default 256 connections, half of the default budget, so they can never
/// keep a real delivery out.
pub const FIRST_ROOM: usize = 64 * 1024;

/// Chunks smaller than this are copied together rather than kept one by one.
const SMALL_CHUNK: usize = 4 * 1024;

/// A body's first second is free of the minimum rate (`--min-body-rate`): a connection's first
/// bytes may wait on a handshake or a window.
pub const MIN_RATE_GRACE: Duration = Duration::from_secs(1);

/// The body's size from Content-Length: 413 over `limit` (before a byte is read), 400 when it is
/// not a number; `None` for a chunked body.
fn declared_length(headers: &HeaderMap, limit: usize) -> Result<Option<usize>, IngestError> {
    let Some(length) = headers.get(CONTENT_LENGTH) else { return Ok(None) };
    match length.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(n) if n > limit as u64 => Err(IngestError::TooLarge),
        Some(n) => Ok(Some(n as usize)),
        None => Err(IngestError::BodyRead),
    }
}

/// Reads the body, taking room from the bytes in flight as its bytes arrive — never for bytes
/// only declared: a header that announces a megabyte holds [`FIRST_ROOM`] until the megabyte
/// comes. Room is taken one step ahead of the bytes, before they are read (so that a request
/// waiting for room holds no chunk it could not store): [`FIRST_ROOM`], then doubling — never
/// more than twice what arrived (or `FIRST_ROOM`), never past the declared length (a chunked
/// body: `--max-body`). Without room for its first bytes the request waits up to `--db-timeout`
/// (503 past it, or at once when [`MAX_WAITING_FOR_ROOM`] requests already wait); without room
/// to grow, 503 at once (see [`grow`]). The body must arrive within `--body-timeout`, and after
/// [`MIN_RATE_GRACE`] at `--min-body-rate` on average (the time spent waiting for room not
/// counted), else 408; at most `--max-body` (413). The room is returned with the body, shrunk to
/// its size, and goes with it to the batch; on any refusal it is given back on the spot
/// (dropped). A body in several chunks is joined once whole: for that moment it is held twice.
async fn read_body(
    state: &AppState,
    declared: Option<usize>,
    mut payload: web::Payload,
) -> Result<(Bytes, BytesHeld), IngestError> {
    let limit = state.max_body;
    let cap = declared.unwrap_or(limit) as u64;
    let mut held = state.bodies.nothing();
    let started = tokio::time::Instant::now();
    let hard_deadline = started + state.body_timeout;
    let rate = state.min_body_rate.max(1);
    // Time spent waiting for room: the sender is not to blame for it.
    let mut waited = Duration::ZERO;
    // The chunks as the HTTP layer hands them over (no copy; small ones copied together in
    // `small`), joined once the body is whole: a body held in one buffer grown as it arrives
    // leaves the allocator holes that the budget does not count.
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut small = BytesMut::new();
    let mut received = 0usize;
    loop {
        // Room for the next bytes before they are read.
        if held.bytes() <= received as u64 && (received as u64) < cap {
            let step = (held.bytes() * 2).max(FIRST_ROOM as u64).min(cap);
            grow(state, &mut held, step, hard_deadline, &mut waited).await?;
        }
        let allowed = MIN_RATE_GRACE + waited + Duration::from_secs_f64(received as f64 / rate as f64);
        let deadline = hard_deadline.min(started + allowed);
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Err(_) => return Err(IngestError::BodyTimeout),
            Ok(None) => break,
            Ok(Some(Err(_read_error))) => return Err(IngestError::BodyRead),
            Ok(Some(Ok(chunk))) => chunk,
        };
        let size = received + chunk.len();
        if size > limit {
            return Err(IngestError::TooLarge);
        }
        if size as u64 > held.bytes() {
            // A chunk larger than the step taken ahead of it.
            let step = (held.bytes() * 2).max(size as u64).min(cap.max(size as u64));
            grow(state, &mut held, step, hard_deadline, &mut waited).await?;
        }
        received += chunk.len();
        if chunk.len() < SMALL_CHUNK {
            // A trickle of small chunks is copied together: one handle per byte or two of a body
            // would cost more memory than the bytes the budget counts.
            small.extend_from_slice(&chunk);
            if small.len() >= FIRST_ROOM {
                chunks.push(small.split().freeze());
            }
        } else {
            if !small.is_empty() {
                chunks.push(small.split().freeze());
            }
            chunks.push(chunk);
        }
    }
    if !small.is_empty() {
        chunks.push(small.freeze());
    }
    held.shrink_to(received as u64);
    let body = match chunks.len() {
        1 => chunks.pop().expect("one chunk"),
        _ => {
            let mut body = BytesMut::with_capacity(received);
            for chunk in chunks {
                body.extend_from_slice(&chunk);
            }
            body.freeze()
        }
    };
    Ok((body, held))
}

/// Makes `held` hold `bytes`. A body that holds nothing yet waits for room up to `--db-timeout`
/// (never past its deadline), in turn; one that holds some already and finds no more free is
/// refused at once, giving back what it holds: requests that each hold part of the budget while
/// waiting for the rest would fill it with bodies none of which can finish (and each connection
/// with the unread rest of its body buffered by the HTTP layer). Adds the time waited to `waited`.
async fn grow(
    state: &AppState,
    held: &mut BytesHeld,
    bytes: u64,
    deadline: tokio::time::Instant,
    waited: &mut Duration,
) -> Result<(), IngestError> {
    let asked = tokio::time::Instant::now();
    let patience = if held.bytes() == 0 {
        state.db_timeout.min(deadline.saturating_duration_since(asked))
    } else {
        Duration::ZERO
    };
    let grown = state.bodies.grow_within(held, bytes, patience, MAX_WAITING_FOR_ROOM).await;
    *waited += asked.elapsed();
    grown.map_err(IngestError::Busy)
}

/// Reads a chunked body the request is refused for anyway, keeping none of it, to answer 413
/// rather than 400 when it is over `limit` (as a declared length is judged). Gives up quietly at
/// `deadline` or on a read error: the refusal stands.
async fn discard_body(
    mut payload: web::Payload,
    limit: usize,
    deadline: Duration,
) -> Result<(), IngestError> {
    let mut seen = 0usize;
    let read = async {
        while let Some(Ok(chunk)) = payload.next().await {
            seen += chunk.len();
            if seen > limit {
                return Err(IngestError::TooLarge);
            }
        }
        Ok(())
    };
    tokio::time::timeout(deadline, read).await.unwrap_or(Ok(()))
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "status": "ok" }))
}

/// `GET /readyz`: the database answers and its schema is at least the version this build expects,
/// and no misconfiguration was met (see [`crate::readiness`]: checked at most once a second).
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let verdict = state.readiness.verdict(|| check_ready(&state)).await;
    if verdict.ready {
        HttpResponse::Ok().json(verdict.body)
    } else {
        HttpResponse::ServiceUnavailable().json(verdict.body)
    }
}

/// One readiness check against the database.
async fn check_ready(state: &AppState) -> Verdict {
    let expected = inbox_domain::inbox::schema::expected_version();
    let deadline = tokio::time::Instant::now() + state.db_timeout.min(Duration::from_secs(2));
    let check = async {
        let client = match tokio::time::timeout_at(deadline, state.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Some(Err(inbox_domain::db::describe_pool_error(&e))),
            Err(_) => return None,
        };
        // Never hand the pool a connection whose query still runs: `within` cancels and drops it.
        let read = async |client: &mut deadpool_postgres::Object| {
            inbox_domain::inbox::schema::current_version(client).await
        };
        let (_, version) = inbox_domain::db::within(client, deadline, &state.database, read).await?;
        Some(version.map_err(|e| format!("{e:#}")))
    };
    let not_ready = |error: String| Verdict {
        ready: false,
        body: serde_json::json!({ "status": "not_ready", "error": error }),
    };
    match check.await {
        Some(Ok(Some(version))) if version >= expected => {
            Verdict { ready: true, body: serde_json::json!({ "status": "ready", "schema_version": version }) }
        }
        Some(Ok(version)) => not_ready(format!(
            "schema version {} is older than the {expected} this binary expects: run `inbox-worker migrate`",
            version.unwrap_or(0)
        )),
        Some(Err(cause)) => {
            // The cause goes to the log only: this port faces the internet.
            tracing::warn!(error = cause, "readiness check failed");
            not_ready("database unavailable".to_owned())
        }
        None => not_ready("database timed out".to_owned()),
    }
}

/// `GET /metrics`: Prometheus exposition.
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    state.metrics.body_bytes_held(state.bodies.total() - state.bodies.available());
    HttpResponse::Ok()
        .content_type(inbox_domain::telemetry::METRICS_CONTENT_TYPE)
        .body(state.metrics.render())
}
