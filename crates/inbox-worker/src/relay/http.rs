//! The HTTP destination: a POST of the row's payload, signed as Standard Webhooks define it.
//!
//! Headers: `webhook-id` (the outbox id, the same on every attempt: a receiver dedupes on it),
//! `webhook-timestamp` (unix seconds, when this attempt was signed), `webhook-signature`
//! (`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per secret during a rotation,
//! separated by spaces), and `inbox-fencing-token` (see [`super`]), with the row's event and
//! aggregate for the receiver's routing. Every attempt is signed again when sent, as Svix does: a
//! retry hours later is not refused as too old by a receiver's timestamp tolerance.
//!
//! Outcomes: 2xx is delivered. 410 Gone parks the row (the receiver says it wants no more of it).
//! Anything else — another status (3xx is not followed), a timeout, a connection error — is
//! retried with backoff; a `Retry-After` on the answer is honoured (never sooner than the backoff).

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use inbox_domain::inbox::store::outbox::OutboxClaimed;
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE, RETRY_AFTER};

use super::{Failure, FENCING_TOKEN_HEADER};

/// Most of a 2xx answer read, so that its connection can serve the next delivery; a longer answer
/// costs its connection.
const DRAIN_AT_MOST: usize = 64 * 1024;

/// Longest part of a receiver's answer kept in `last_error`.
const ANSWER_EXCERPT: usize = 256;

/// The HTTP destination of `relay --to-url`.
pub struct Http {
    client: reqwest::Client,
    url: reqwest::Url,
    /// The URL as logs and errors show it: no user, password or query (which may carry a token).
    shown: String,
    keys: Vec<ring::hmac::Key>,
}

impl std::fmt::Debug for Http {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http").field("url", &self.shown).field("keys", &self.keys.len()).finish()
    }
}

impl Http {
    /// A destination POSTing to `url`, signing with `secrets` (each `whsec_<base64>`), each request
    /// given `timeout` to answer.
    pub fn new(url: &str, secrets: &[String], timeout: Duration) -> anyhow::Result<Http> {
        let url = reqwest::Url::parse(url.trim())
            .map_err(|e| anyhow::anyhow!("--to-url / INBOX_RELAY_URL is not a URL: {e}"))?;
        let shown = shown_url(&url);
        if !matches!(url.scheme(), "http" | "https") {
            anyhow::bail!("--to-url / INBOX_RELAY_URL must be an http:// or https:// URL, not {shown}");
        }
        if secrets.is_empty() {
            anyhow::bail!(
                "--to-url needs a signing secret: set INBOX_RELAY_SECRET (whsec_<base64>, comma-separated \
                 during a rotation) or --signing-secret-file"
            );
        }
        let keys = secrets
            .iter()
            .enumerate()
            .map(|(i, s)| signing_key(s).map_err(|e| anyhow::anyhow!("signing secret #{}: {e}", i + 1)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            // A redirect is a failure (Standard Webhooks: only 2xx succeeds), never followed with
            // the signed body to somewhere else.
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .user_agent(concat!("stripe-inbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| anyhow::anyhow!("building the HTTP client: {e}"))?;
        Ok(Http { client, url, shown, keys })
    }

    /// Where deliveries go, as logs show it.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// POSTs `row`; Ok when the receiver answered 2xx.
    pub async fn deliver(&self, row: &OutboxClaimed) -> Result<(), Failure> {
        let id = row.id.to_string();
        let timestamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let signature = sign(&self.keys, &id, timestamp, &row.payload);
        let mut headers = HeaderMap::with_capacity(8);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert("webhook-id", header_value(&id));
        headers.insert("webhook-timestamp", header_value(&timestamp.to_string()));
        headers.insert("webhook-signature", header_value(&signature));
        headers.insert(FENCING_TOKEN_HEADER, header_value(&row.fencing_token.to_string()));
        headers.insert("inbox-event-type", header_value(&row.event_type));
        headers.insert("inbox-aggregate-type", header_value(&row.aggregate_type));
        headers.insert("inbox-aggregate-id", header_value(&row.aggregate_id));
        let sent = self.client.post(self.url.clone()).headers(headers).body(row.payload.clone()).send().await;
        let mut response = match sent {
            Ok(response) => response,
            Err(e) => return Err(Failure::retry(self.transport_error(&e))),
        };
        let status = response.status();
        if status.is_success() {
            // Read what the receiver answered (a bounded amount): a connection whose answer is
            // left unread is closed instead of kept for the next delivery.
            let mut read = 0;
            while read < DRAIN_AT_MOST {
                match response.chunk().await {
                    Ok(Some(chunk)) => read += chunk.len(),
                    _ => break,
                }
            }
            return Ok(());
        }
        let retry_after = response.headers().get(RETRY_AFTER).and_then(parse_retry_after);
        // A few hundred bytes of the answer say why; never read more (a receiver may answer huge).
        let mut excerpt = Vec::new();
        while excerpt.len() < ANSWER_EXCERPT {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    excerpt.extend_from_slice(&chunk[..chunk.len().min(ANSWER_EXCERPT - excerpt.len())])
                }
                _ => break,
            }
        }
        let excerpt = String::from_utf8_lossy(&excerpt).split_whitespace().collect::<Vec<_>>().join(" ");
        let error = if excerpt.is_empty() {
            format!("{} answered {status}", self.shown)
        } else {
            format!("{} answered {status}: {excerpt}", self.shown)
        };
        if status == reqwest::StatusCode::GONE {
            return Err(Failure::park(format!("{error} (410: the receiver wants no more of this row)")));
        }
        Err(Failure { error, retry_after, park: false })
    }

    fn transport_error(&self, e: &reqwest::Error) -> String {
        format!("POST {} failed: {}", self.shown, crate::stripe::transport_cause(e))
    }
}

/// The HMAC key of a Standard Webhooks secret: `whsec_` and the base64 of the key's bytes.
fn signing_key(secret: &str) -> Result<ring::hmac::Key, String> {
    let secret = secret.trim();
    let Some(encoded) = secret.strip_prefix("whsec_") else {
        return Err(
            "must be whsec_ followed by the base64 of 24 to 64 random bytes (Standard Webhooks)".into()
        );
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| "the part after whsec_ is not base64 (Standard Webhooks: whsec_<base64>)".to_owned())?;
    if bytes.len() < 24 {
        return Err(format!(
            "{} bytes after decoding: too short, Standard Webhooks asks for 24 to 64 random bytes",
            bytes.len()
        ));
    }
    Ok(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes))
}

/// The `webhook-signature` value: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` per key,
/// separated by spaces.
pub fn sign(keys: &[ring::hmac::Key], id: &str, timestamp: u64, body: &[u8]) -> String {
    let timestamp = timestamp.to_string();
    keys.iter()
        .map(|key| {
            let mut ctx = ring::hmac::Context::with_key(key);
            ctx.update(id.as_bytes());
            ctx.update(b".");
            ctx.update(timestamp.as_bytes());
            ctx.update(b".");
            ctx.update(body);
            format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(ctx.sign().as_ref()))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A header value from text the relay wrote or read from its own table: invisible characters a
/// header cannot carry are replaced.
fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| {
        let clean: String =
            text.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
        HeaderValue::from_str(&clean).unwrap_or_else(|_| HeaderValue::from_static("?"))
    })
}

/// `Retry-After`: seconds, or an HTTP date.
pub(crate) fn parse_retry_after(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

/// `url` without what may be secret: user, password, query and fragment.
fn shown_url(url: &reqwest::Url) -> String {
    let mut shown = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
    if let Some(port) = url.port() {
        shown.push_str(&format!(":{port}"));
    }
    shown.push_str(url.path());
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    // The Standard Webhooks specification's own example (its README): the secret, id, timestamp
    // and body below sign to this value.
    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SPEC_TIMESTAMP: u64 = 1614265330;
    const SPEC_BODY: &str = r#"{"test": 2432232314}"#;
    const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn signs_the_specifications_example_to_its_signature() {
        let key = signing_key(SPEC_SECRET).unwrap();
        assert_eq!(sign(&[key], SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY.as_bytes()), SPEC_SIGNATURE);
    }

    #[test]
    fn secrets_that_are_not_whsec_base64_are_refused_without_being_echoed() {
        for bad in ["sk_live_abcdef", "whsec_not*base64!", "whsec_c2hvcnQ="] {
            let error = signing_key(bad).expect_err(bad);
            assert!(!error.contains(bad) && !error.contains(&bad[6..]), "{error}");
        }
        let good = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([7u8; 32]));
        assert!(signing_key(&good).is_ok());
    }

    #[test]
    fn a_rotation_signs_once_per_secret() {
        let keys: Vec<_> =
            [[1u8; 32], [2u8; 32]].iter().map(|b| ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b)).collect();
        let signature = sign(&keys, "1", 1, b"{}");
        let parts: Vec<&str> = signature.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert!(parts.iter().all(|p| p.starts_with("v1,") && p.len() == 3 + 44), "{signature}");
        assert_ne!(parts[0], parts[1]);
    }

    #[test]
    fn the_url_shown_keeps_no_credentials_or_query() {
        let url = reqwest::Url::parse("https://user:pw@example.com:8443/hooks/in?token=abc#x").unwrap();
        assert_eq!(shown_url(&url), "https://example.com:8443/hooks/in");
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(parse_retry_after(&HeaderValue::from_static("120")), Some(Duration::from_secs(120)));
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
        let parsed = parse_retry_after(&HeaderValue::from_str(&later).unwrap()).unwrap();
        assert!(parsed > Duration::from_secs(3500) && parsed <= Duration::from_secs(3600), "{parsed:?}");
        assert_eq!(parse_retry_after(&HeaderValue::from_static("soon")), None);
    }
}
