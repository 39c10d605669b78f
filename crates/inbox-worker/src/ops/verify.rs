//! `verify`: audit evidence that a stored event is what Stripe signed. With the exact bytes and
//! the `v1` signature the ingest kept (`inbox-ingest --keep-raw`, and always for an unstorable
//! body), it recomputes the HMAC of `"{t}.{raw body}"` with the endpoint's configured secrets,
//! names the secret that made it (position and fingerprint, beside the one the ingest recorded),
//! and checks that the payload handlers were given is the raw body as `jsonb` reads it.
//!
//! Read-only: no transaction, no audit row. Exit 0 when the signature verifies (and the payload
//! matches), 1 otherwise, with the report printed either way.

use clap::Args as ClapArgs;
use inbox_domain::config::load_endpoints;
use inbox_domain::inbox::event::EventHead;
use inbox_domain::inbox::signature::Verifier;
use inbox_domain::inbox::store::admin::{self, Evidence};
use serde::Serialize;

use super::output::{emit, emit_json, AfterReport, OutputArgs};
use super::{db_error, EventArgs};

/// Flags of `verify`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub event: EventArgs,
    /// The endpoints' signing secrets, as the ingest takes them: NAME=SECRET[,SECRET…]
    /// (repeatable; the environment form separates endpoints with `;`).
    #[arg(
        long = "secrets",
        value_name = "NAME=SECRET[,SECRET…]",
        env = "INBOX_ENDPOINTS",
        value_delimiter = ';',
        hide_env_values = true
    )]
    pub secrets: Vec<String>,
    /// File with the endpoints' secrets in the INBOX_ENDPOINTS format.
    #[arg(long, env = "INBOX_ENDPOINTS_FILE", value_name = "PATH")]
    pub secrets_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `verify` found (its JSON document).
#[derive(Debug, Serialize)]
struct Report {
    event_id: String,
    endpoint: String,
    event_type: String,
    /// The signature's `t`, and as RFC 3339.
    signature_t: i64,
    signed_at: Option<String>,
    /// Whether a configured secret of the endpoint made the kept signature over the kept bytes.
    verified: bool,
    /// That secret's position in the configured list, and its fingerprint.
    secret_position: Option<usize>,
    secret_fingerprint: Option<String>,
    /// What the ingest recorded when it stored the row.
    recorded_secret_position: Option<i16>,
    recorded_secret_fingerprint: Option<String>,
    /// Whether the stored payload is the raw body read as jsonb; None for an unstorable body
    /// (there is no payload).
    payload_matches: Option<bool>,
    /// Whether the signed body's `id` and `type` are the row's `event_id` and `event_type`.
    identity_matches: bool,
    /// The `id` and `type` the signed body carries (None when it is not an event).
    signed_event_id: Option<String>,
    signed_event_type: Option<String>,
    raw_bytes: usize,
}

/// `verify`.
pub async fn run(client: &(impl tokio_postgres::GenericClient + Sync), args: &Args) -> anyhow::Result<()> {
    let event_id = args.event.event_id.as_str();
    let mut rows = admin::evidence(client, event_id, args.event.endpoint.as_deref())
        .await
        .map_err(db_error("reading the event"))?;
    let row: Evidence = match rows.len() {
        0 => {
            anyhow::bail!("no event {event_id} in the inbox{}", for_endpoint(args.event.endpoint.as_deref()))
        }
        1 => rows.remove(0),
        _ => {
            let names: Vec<&str> = rows.iter().map(|r| r.endpoint.as_str()).collect();
            anyhow::bail!(
                "event {event_id} is stored for several endpoints ({}): pass --endpoint to choose one",
                names.join(", ")
            )
        }
    };
    let (Some(raw), Some(signature), Some(t)) = (&row.raw_body, &row.signature_v1, row.signature_t) else {
        anyhow::bail!(
            "event {event_id} (endpoint {}) was stored without its raw body and signature: the ingest \
             keeps them only with --keep-raw (INBOX_KEEP_RAW=true); nothing to verify",
            row.endpoint
        );
    };
    let verifier = verifier_for(args, &row.endpoint)?;
    let position = verifier.matching_secret(t, raw, signature);
    // The signed body must be this row's event: kept bytes of another event (signed, so valid)
    // next to a rewritten event_id or event_type would otherwise pass.
    let (signed_id, signed_type) = match EventHead::parse(raw) {
        Ok(head) => (Some(head.id.into_owned()), Some(head.event_type.into_owned())),
        Err(_) => (None, None),
    };
    let identity_matches =
        signed_id.as_deref() == Some(event_id) && signed_type.as_deref() == Some(row.event_type.as_str());
    let payload_matches = if row.has_payload {
        match admin::payload_matches(client, raw, &row.endpoint, event_id).await {
            Ok(matches) => Some(matches),
            // Bytes that are not UTF-8 JSON (class 22), on a row that has a payload, were altered:
            // not a match. Any other error is the database's, and says nothing of the payload.
            Err(e) if e.code().is_some_and(|c| c.code().starts_with("22")) => Some(false),
            Err(e) => {
                return Err(inbox_domain::db::db_error("comparing the payload with the signed body", &e))
            }
        }
    } else {
        None
    };
    let report = Report {
        event_id: event_id.to_owned(),
        endpoint: row.endpoint.clone(),
        event_type: row.event_type.clone(),
        signature_t: t,
        signed_at: row.signed_at.clone(),
        verified: position.is_some(),
        secret_position: position,
        secret_fingerprint: position.map(|p| verifier.fingerprints()[p].clone()),
        recorded_secret_position: row.secret_position,
        recorded_secret_fingerprint: row.secret_fingerprint.clone(),
        payload_matches,
        identity_matches,
        signed_event_id: signed_id,
        signed_event_type: signed_type,
        raw_bytes: raw.len(),
    };
    if args.output.json {
        emit_json(&report)?;
    } else {
        emit(&render(&report, verifier.fingerprints()))?;
    }
    match (report.verified, report.identity_matches, report.payload_matches) {
        (false, _, _) => Err(AfterReport(format!(
            "the kept signature of event {event_id} does not verify with any secret configured for endpoint {}",
            report.endpoint
        ))
        .into()),
        (true, false, _) => Err(AfterReport(format!(
            "the signed body is event {} ({}), not the row's event {event_id} ({}): the row was altered",
            report.signed_event_id.as_deref().unwrap_or("?"),
            report.signed_event_type.as_deref().unwrap_or("?"),
            report.event_type
        ))
        .into()),
        (true, true, Some(false)) => Err(AfterReport(format!(
            "the stored payload of event {event_id} is not the signed body read as JSON"
        ))
        .into()),
        _ => Ok(()),
    }
}

fn for_endpoint(endpoint: Option<&str>) -> String {
    endpoint.map(|e| format!(" for endpoint {e}")).unwrap_or_default()
}

/// The configured secrets of `endpoint`, from --secrets / INBOX_ENDPOINTS and the file.
fn verifier_for(args: &Args, endpoint: &str) -> anyhow::Result<Verifier> {
    if args.secrets.iter().all(|e| e.trim().is_empty()) && args.secrets_file.is_none() {
        anyhow::bail!(
            "no signing secrets given: pass --secrets {endpoint}=whsec_… or set INBOX_ENDPOINTS / \
             INBOX_ENDPOINTS_FILE as for the ingest"
        );
    }
    let specs = load_endpoints(&args.secrets, args.secrets_file.as_deref())?;
    let spec = specs
        .iter()
        .find(|s| s.name == endpoint)
        .ok_or_else(|| anyhow::anyhow!("no secrets given for endpoint {endpoint}, which stored the event"))?;
    // The tolerance is irrelevant to a kept delivery (matching_secret ignores it).
    Verifier::new(&spec.secrets, std::time::Duration::from_secs(1))
        .map_err(|e| anyhow::anyhow!("endpoint {endpoint}: {e}"))
}

fn render(r: &Report, configured: &[String]) -> String {
    let mut text = format!(
        "event {} (endpoint {}, {}): {} raw bytes signed at {} (t={})\n",
        r.event_id,
        r.endpoint,
        r.event_type,
        r.raw_bytes,
        r.signed_at.as_deref().unwrap_or("?"),
        r.signature_t
    );
    // Secrets are named by fingerprint, and their position counted from 0 as `stats` lists them.
    let recorded = match (r.recorded_secret_position, &r.recorded_secret_fingerprint) {
        (Some(p), Some(f)) => format!("secret {f} (position {p})"),
        _ => "no secret".to_owned(),
    };
    match (r.secret_position, &r.secret_fingerprint) {
        (Some(p), Some(f)) => text.push_str(&format!(
            "signature: valid, made by secret {f} (position {p} of the {} configured, from 0 as in `stats`); \
             the ingest recorded {recorded}\n",
            configured.len()
        )),
        _ => text.push_str(&format!(
            "signature: NOT VALID with any of the {} configured secret(s) ({}); the ingest recorded {recorded}\n",
            configured.len(),
            configured.join(", ")
        )),
    }
    if !r.identity_matches {
        text.push_str(&format!(
            "identity: DIFFERS: the signed body is event {} ({})\n",
            r.signed_event_id.as_deref().unwrap_or("?"),
            r.signed_event_type.as_deref().unwrap_or("?")
        ));
    }
    text.push_str(match r.payload_matches {
        Some(true) => "payload: the stored payload is the signed body\n",
        Some(false) => "payload: DIFFERS from the signed body\n",
        None => "payload: none (the body was unstorable as jsonb; the raw bytes are the only copy)\n",
    });
    text
}
