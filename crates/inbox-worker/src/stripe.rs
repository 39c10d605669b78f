//! A client for Stripe's API: the calls `reconcile` and `fetch` make, written to Stripe's
//! documented behaviour (the API reference's "Authentication", "Errors", "Pagination",
//! "Idempotent requests", "Connected accounts" and "Rate limits" pages) on the reqwest and rustls
//! the relay already uses — no OpenSSL, no second HTTP stack.
//!
//! * **The key** ([`ApiKey`]) is sent as a bearer token in a header reqwest marks sensitive, and is
//!   shown nowhere: its `Debug` is the key's kind and mode (`rk_live_…`), errors never carry it,
//!   and a message from Stripe that quotes it (Stripe masks all but the last four characters) is
//!   masked again in case it did not.
//! * **Pagination** ([`List`]): `limit`, `starting_after` (the last id of the page before),
//!   `has_more`. The cursor is public, so a caller that stores it can resume an interrupted walk.
//! * **Connected accounts**: [`RequestOptions::stripe_account`] (`Stripe-Account`, API v1) and
//!   [`RequestOptions::stripe_context`] (`Stripe-Context`, API v2 and thin events).
//! * **Writes** carry an `Idempotency-Key` (one is made when the caller gives none), so a write
//!   retried after a lost answer is applied once.
//! * **Retries**, as Stripe's own libraries do: a `Stripe-Should-Retry` header decides when
//!   present; otherwise 409 (a concurrent change), 429 (rate limited), 5xx, timeouts and lost
//!   connections are retried, up to [`Config::max_retries`] times, waiting 0.5 s × 2ⁿ (at most
//!   [`Config::max_backoff`]) with jitter (×0.5…1, so clients rate limited together do not retry
//!   together), and never sooner than a `Retry-After` asks. A 4xx other than those is final.
//! * **Errors** ([`Error`]) name what happened — 401 (the key is wrong or revoked), 403 (a
//!   restricted key without the permission), 404, 429 after every retry — with Stripe's message and
//!   the `Request-Id` Stripe's support asks for.
//! * **A timeout per request** ([`Config::timeout`]), retried like a lost connection.
//!
//! The client keeps bodies as Stripe sent them ([`serde_json::value::RawValue`]): the inbox stores
//! an event fetched from the API byte for byte as it would have stored its webhook.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, RETRY_AFTER};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Where Stripe's API is.
pub const DEFAULT_API_BASE: &str = "https://api.stripe.com";

/// The first retry's wait, as in Stripe's libraries; each further one doubles it.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// Longest part of a non-JSON error answer kept in an error message.
const ANSWER_EXCERPT: usize = 200;

/// A secret API key: `sk_…` or (better, for reconciling) a restricted `rk_…` key. Never shown.
#[derive(Clone)]
pub struct ApiKey(String);

impl ApiKey {
    /// Checks the shape of `key` (never echoing it): a secret or restricted key, not a publishable
    /// key or a webhook signing secret passed by mistake.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        let key = key.trim();
        if key.is_empty() {
            return Err("the Stripe API key is empty".into());
        }
        if key.starts_with("pk_") {
            return Err(
                "this is a publishable key (pk_…): the API needs a secret (sk_…) or restricted (rk_…) key"
                    .into(),
            );
        }
        if key.starts_with("whsec_") {
            return Err("this is a webhook signing secret (whsec_…), not an API key (sk_… or rk_…)".into());
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the Stripe API key holds spaces or characters a key never has".into());
        }
        if !(key.starts_with("sk_") || key.starts_with("rk_")) {
            return Err("a Stripe API key starts with sk_ (secret) or rk_ (restricted)".into());
        }
        Ok(ApiKey(key.to_owned()))
    }

    /// The key's kind and mode, which are not secret: `rk_live_…`, `sk_test_…`.
    pub fn shown(&self) -> String {
        let mut parts = self.0.splitn(3, '_');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(kind), Some(mode @ ("live" | "test")), Some(_)) => format!("{kind}_{mode}_…"),
            (Some(kind), _, _) => format!("{kind}_…"),
            _ => "…".into(),
        }
    }

    /// Whether the key is a live-mode key (`Some(true)`), a test-mode one (`Some(false)`), or its
    /// name does not say.
    pub fn livemode(&self) -> Option<bool> {
        match self.0.split('_').nth(1) {
            Some("live") => Some(true),
            Some("test") => Some(false),
            _ => None,
        }
    }

    /// `text` with the key, if it appears, replaced by [`ApiKey::shown`].
    fn scrub(&self, text: &str) -> String {
        text.replace(&self.0, &self.shown())
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKey({})", self.shown())
    }
}

/// How the client talks to Stripe.
#[derive(Debug, Clone)]
pub struct Config {
    /// `https://api.stripe.com`, or a local server in tests. Paths are appended to it.
    pub base: String,
    pub key: ApiKey,
    /// How long one request may take, connection included; a request that takes longer is retried.
    pub timeout: Duration,
    /// Retries after the first attempt (so `max_retries + 1` attempts at most).
    pub max_retries: u32,
    /// The longest wait between two attempts (a `Retry-After` may ask for longer; it is honoured
    /// up to a minute).
    pub max_backoff: Duration,
    /// `Stripe-Version` to send; `None` uses the account's default version. Events are rendered in
    /// the version they were created with whatever is sent; retrieved objects follow it.
    pub api_version: Option<String>,
}

impl Config {
    /// The defaults: Stripe's API, 30 s per request, 8 retries waiting at most 20 s each (about
    /// two minutes of 429s or 5xx before giving up).
    pub fn new(key: ApiKey) -> Config {
        Config {
            base: DEFAULT_API_BASE.into(),
            key,
            timeout: Duration::from_secs(30),
            max_retries: 8,
            max_backoff: Duration::from_secs(20),
            api_version: None,
        }
    }
}

/// Per-request headers beyond the key.
#[derive(Debug, Clone, Default)]
pub struct RequestOptions {
    /// `Stripe-Account: acct_…`: act on a connected account (API v1).
    pub stripe_account: Option<String>,
    /// `Stripe-Context: acct_…`: the same for API v2 and the objects thin events name.
    pub stripe_context: Option<String>,
    /// `Idempotency-Key` of a write; one is made when `None`.
    pub idempotency_key: Option<String>,
}

/// What went wrong with a call, after the retries it deserved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{call}: Stripe answered 401 Unauthorized: the API key is wrong, revoked or expired ({detail})")]
    Unauthorized { call: String, detail: Detail },
    #[error(
        "{call}: Stripe answered 403 Forbidden: the API key may not do this (a restricted key needs the \
         permission) ({detail})"
    )]
    Forbidden { call: String, detail: Detail },
    #[error("{call}: Stripe answered 404 Not Found ({detail})")]
    NotFound { call: String, detail: Detail },
    #[error("{call}: still rate limited (429) after {attempts} attempts ({detail})")]
    RateLimited { call: String, attempts: u32, detail: Detail },
    #[error("{call}: Stripe answered {status} ({detail})")]
    Refused { call: String, status: u16, detail: Detail },
    #[error("{call}: Stripe answered {status} on each of {attempts} attempts ({detail})")]
    Server { call: String, status: u16, attempts: u32, detail: Detail },
    #[error("{call}: no answer after {attempts} attempts: {cause}")]
    Transport { call: String, attempts: u32, cause: String },
    #[error("{call}: not an API path (it must start with a single /, and name no host)")]
    NotAPath { call: String },
    #[error("{call}: the answer is not what Stripe documents: {cause} (request {request_id})")]
    Decode { call: String, cause: String, request_id: String },
}

impl Error {
    /// The HTTP status Stripe answered, when it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Unauthorized { .. } => Some(401),
            Error::Forbidden { .. } => Some(403),
            Error::NotFound { .. } => Some(404),
            Error::RateLimited { .. } => Some(429),
            Error::Refused { status, .. } | Error::Server { status, .. } => Some(*status),
            Error::Transport { .. } | Error::Decode { .. } | Error::NotAPath { .. } => None,
        }
    }
}

/// Stripe's side of an error: its message, type and code, and the request id.
#[derive(Debug, Clone, Default)]
pub struct Detail {
    /// `error.message`, or the first bytes of an answer that was not Stripe's error JSON.
    pub message: String,
    /// `error.type` (`invalid_request_error`, `api_error`, …) and `error.code` when given.
    pub kind: Option<String>,
    pub code: Option<String>,
    /// `Request-Id`: what Stripe's support asks for.
    pub request_id: String,
}

impl std::fmt::Display for Detail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let request = if self.request_id.is_empty() { "no Request-Id" } else { &self.request_id };
        write!(f, "request {request}")?;
        if let Some(kind) = &self.kind {
            write!(f, ", {kind}")?;
        }
        if let Some(code) = &self.code {
            write!(f, " {code}")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// A successful answer: its body as sent, and its request id.
#[derive(Debug)]
pub struct Answer {
    pub body: bytes::Bytes,
    pub request_id: String,
}

/// Stripe's API, for one key.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    config: Config,
    random: std::sync::Arc<ring::rand::SystemRandom>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("base", &self.base).field("key", &self.config.key).finish()
    }
}

impl Client {
    pub fn new(config: Config) -> anyhow::Result<Client> {
        let base = config.base.trim().trim_end_matches('/').to_owned();
        let parsed = reqwest::Url::parse(&base)
            .map_err(|e| anyhow::anyhow!("--api-base / STRIPE_API_BASE is not a URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            anyhow::bail!("--api-base / STRIPE_API_BASE must be an http:// or https:// URL with a host");
        }
        if !parsed.username().is_empty() || parsed.password().is_some() || parsed.query().is_some() {
            anyhow::bail!(
                "--api-base / STRIPE_API_BASE takes no user, password or query: the key is --api-key"
            );
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", config.key.0))
            .map_err(|_| anyhow::anyhow!("the Stripe API key cannot be sent in a header"))?;
        auth.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, auth);
        if let Some(version) = &config.api_version {
            let value = HeaderValue::from_str(version.trim())
                .map_err(|_| anyhow::anyhow!("--api-version is not a Stripe-Version header value"))?;
            headers.insert("Stripe-Version", value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            // The key goes with every request: never to wherever a redirect points.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("stripe-inbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| anyhow::anyhow!("building the HTTP client: {e}"))?;
        Ok(Client { http, base, config, random: std::sync::Arc::new(ring::rand::SystemRandom::new()) })
    }

    /// The key's kind and mode, for messages (`rk_live_…`).
    pub fn key_shown(&self) -> String {
        self.config.key.shown()
    }

    /// Whether the key is a live-mode key, when its name says.
    pub fn livemode(&self) -> Option<bool> {
        self.config.key.livemode()
    }

    /// `GET {base}{path}?{query}`: `path` is an API path (`/v1/events`, a thin event's
    /// `related_object.url`), never a whole URL, so the key only ever goes to the configured base.
    pub async fn get(
        &self,
        path: &str,
        query: &[(&str, String)],
        options: &RequestOptions,
    ) -> Result<Answer, Error> {
        self.send(reqwest::Method::GET, path, query, None, options).await
    }

    /// `POST {base}{path}` with a form body, under an `Idempotency-Key` (the caller's, else a new
    /// one kept for every retry of this call).
    pub async fn post_form(
        &self,
        path: &str,
        form: &[(&str, String)],
        options: &RequestOptions,
    ) -> Result<Answer, Error> {
        let mut options = options.clone();
        if options.idempotency_key.is_none() {
            options.idempotency_key = Some(self.new_idempotency_key());
        }
        let body =
            form.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect::<Vec<_>>().join("&");
        self.send(reqwest::Method::POST, path, &[], Some(body), &options).await
    }

    /// A JSON object of `path` (a retrieve), as Stripe sent it.
    pub async fn retrieve(&self, path: &str, options: &RequestOptions) -> Result<Box<RawValue>, Error> {
        let answer = self.get(path, &[], options).await?;
        serde_json::from_slice(&answer.body).map_err(|e| Error::Decode {
            call: format!("GET {path}"),
            cause: e.to_string(),
            request_id: answer.request_id,
        })
    }

    /// A walk through the list at `path` (`/v1/events`), `query` its filters, `limit` items per
    /// page (1 to 100).
    pub fn list(&self, path: &str, query: Vec<(&'static str, String)>, limit: u8) -> List {
        List {
            client: self.clone(),
            path: path.to_owned(),
            query,
            limit: limit.clamp(1, 100),
            starting_after: None,
            done: false,
            options: RequestOptions::default(),
        }
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<String>,
        options: &RequestOptions,
    ) -> Result<Answer, Error> {
        let call = format!("{method} {}", shown_path(path));
        if !path.starts_with('/') || path.starts_with("//") || path.contains("://") {
            return Err(Error::NotAPath { call });
        }
        let url = format!("{}{path}", self.base);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let mut request = self.http.request(method.clone(), &url).query(query);
            if let Some(account) = &options.stripe_account {
                request = request.header("Stripe-Account", account);
            }
            if let Some(context) = &options.stripe_context {
                request = request.header("Stripe-Context", context);
            }
            if let Some(key) = &options.idempotency_key {
                request = request.header("Idempotency-Key", key);
            }
            if let Some(body) = &body {
                request = request
                    .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .body(body.clone());
            }
            let (retry, wait, error) = match request.send().await {
                Err(e) => (
                    true,
                    None,
                    Error::Transport { call: call.clone(), attempts: attempt, cause: transport_cause(&e) },
                ),
                Ok(response) => {
                    let status = response.status();
                    let headers = response.headers().clone();
                    let request_id = headers
                        .get("request-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let read = response.bytes().await;
                    if status.is_success() {
                        match read {
                            Ok(body) => return Ok(Answer { body, request_id }),
                            Err(e) => (
                                true,
                                None,
                                Error::Transport {
                                    call: call.clone(),
                                    attempts: attempt,
                                    cause: transport_cause(&e),
                                },
                            ),
                        }
                    } else {
                        let detail = self.detail(read.as_deref().unwrap_or_default(), request_id);
                        let should_retry = headers
                            .get("stripe-should-retry")
                            .and_then(|v| v.to_str().ok())
                            .map(|v| v.eq_ignore_ascii_case("true"));
                        let wait = headers.get(RETRY_AFTER).and_then(crate::relay::http::parse_retry_after);
                        let code = status.as_u16();
                        let retry =
                            should_retry.unwrap_or(code == 409 || code == 429 || status.is_server_error());
                        let call = call.clone();
                        let error = match code {
                            401 => Error::Unauthorized { call, detail },
                            403 => Error::Forbidden { call, detail },
                            404 => Error::NotFound { call, detail },
                            429 => Error::RateLimited { call, attempts: attempt, detail },
                            _ if status.is_server_error() => {
                                Error::Server { call, status: code, attempts: attempt, detail }
                            }
                            _ => Error::Refused { call, status: code, detail },
                        };
                        (retry, wait, error)
                    }
                }
            };
            if !retry || attempt > self.config.max_retries {
                return Err(error);
            }
            let wait = self.backoff(attempt, wait);
            tracing::warn!(
                call = %call,
                attempt,
                wait_ms = wait.as_millis() as u64,
                error = %error,
                "Stripe call failed; retrying"
            );
            tokio::time::sleep(wait).await;
        }
    }

    /// The wait before attempt `attempt + 1`: 0.5 s × 2^(attempt-1), at most `max_backoff`, times
    /// a random factor in [0.5, 1]; never shorter than `retry_after` (itself at most a minute).
    fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exponential =
            FIRST_BACKOFF.saturating_mul(1 << (attempt - 1).min(16)).min(self.config.max_backoff);
        let mut byte = [0u8; 1];
        let _ = ring::rand::SecureRandom::fill(&*self.random, &mut byte);
        let jittered = exponential.mul_f64(0.5 + f64::from(byte[0]) / 510.0);
        jittered.max(retry_after.unwrap_or_default().min(Duration::from_secs(60)))
    }

    /// A new idempotency key: 128 random bits, as hex (a UUID's worth).
    fn new_idempotency_key(&self) -> String {
        let mut bytes = [0u8; 16];
        let _ = ring::rand::SecureRandom::fill(&*self.random, &mut bytes);
        format!("stripe-inbox-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }

    /// Stripe's error object (`{"error": {"message", "type", "code"}}`) from an answer's body, or
    /// the first bytes of a body that is not one (a proxy's page); never the key.
    fn detail(&self, body: &[u8], request_id: String) -> Detail {
        #[derive(Deserialize)]
        struct Envelope {
            error: StripeError,
        }
        #[derive(Deserialize)]
        struct StripeError {
            #[serde(default)]
            message: Option<String>,
            #[serde(default, rename = "type")]
            kind: Option<String>,
            #[serde(default)]
            code: Option<String>,
        }
        match serde_json::from_slice::<Envelope>(body) {
            Ok(Envelope { error }) => Detail {
                message: self.config.key.scrub(&error.message.unwrap_or_default()),
                kind: error.kind,
                code: error.code,
                request_id,
            },
            Err(_) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(ANSWER_EXCERPT)]);
                let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
                Detail { message: self.config.key.scrub(&text), kind: None, code: None, request_id }
            }
        }
    }
}

/// One page of a list: its items as Stripe sent them.
#[derive(Debug)]
pub struct Page {
    pub data: Vec<Box<RawValue>>,
    pub has_more: bool,
    pub request_id: String,
}

/// A walk through a Stripe list, newest first, one page per [`List::next_page`].
#[derive(Debug)]
pub struct List {
    client: Client,
    path: String,
    query: Vec<(&'static str, String)>,
    limit: u8,
    starting_after: Option<String>,
    done: bool,
    options: RequestOptions,
}

impl List {
    /// Starts after `id` (the last item a previous walk saw): resumes that walk.
    pub fn starting_after(mut self, id: Option<String>) -> List {
        self.starting_after = id;
        self
    }

    /// Lists a connected account's objects (`Stripe-Account`).
    pub fn on_account(mut self, account: Option<String>) -> List {
        self.options.stripe_account = account;
        self
    }

    /// The cursor: the id of the last item returned so far.
    pub fn cursor(&self) -> Option<&str> {
        self.starting_after.as_deref()
    }

    /// The next page, or `None` after the last one (`has_more: false`).
    pub async fn next_page(&mut self) -> Result<Option<Page>, Error> {
        if self.done {
            return Ok(None);
        }
        let mut query = self.query.clone();
        query.push(("limit", self.limit.to_string()));
        if let Some(after) = &self.starting_after {
            query.push(("starting_after", after.clone()));
        }
        let answer = self.client.get(&self.path, &query, &self.options).await?;
        #[derive(Deserialize)]
        struct Envelope {
            data: Vec<Box<RawValue>>,
            has_more: bool,
        }
        #[derive(Deserialize)]
        struct Id {
            id: String,
        }
        let call = format!("GET {}", self.path);
        let decode = |cause: String| Error::Decode {
            call: call.clone(),
            cause,
            request_id: answer.request_id.clone(),
        };
        let page: Envelope = serde_json::from_slice(&answer.body).map_err(|e| decode(e.to_string()))?;
        if let Some(last) = page.data.last() {
            let Id { id } =
                serde_json::from_str(last.get()).map_err(|e| decode(format!("an item has no id: {e}")))?;
            self.starting_after = Some(id);
        } else if page.has_more {
            return Err(decode("an empty page says it has more".into()));
        }
        self.done = !page.has_more;
        Ok(Some(Page { data: page.data, has_more: page.has_more, request_id: answer.request_id }))
    }
}

/// What went wrong with a request that got no answer, from reqwest's error chain (refused, reset,
/// DNS, TLS; "no answer in time" for a timeout), never the URL. The relay says it the same way.
pub(crate) fn transport_cause(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        return "no answer in time".into();
    }
    let mut cause = String::new();
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = source {
        let text = err.to_string();
        if !text.is_empty() && !cause.contains(&text) {
            if !cause.is_empty() {
                cause.push_str(": ");
            }
            cause.push_str(&text);
        }
        source = err.source();
    }
    cause
}

/// A path as errors show it: no query string.
fn shown_path(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

/// `application/x-www-form-urlencoded` encoding of one key or value.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'[' | b']' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "rk_live_51AbCdEfGhIjKlMnOpQrStUvWxYz";

    #[test]
    fn a_key_is_shown_by_kind_and_mode_only() {
        let key = ApiKey::new(KEY).unwrap();
        assert_eq!(key.shown(), "rk_live_…");
        assert_eq!(format!("{key:?}"), "ApiKey(rk_live_…)");
        assert_eq!(key.livemode(), Some(true));
        assert_eq!(ApiKey::new("sk_test_abc").unwrap().livemode(), Some(false));
        assert_eq!(
            key.scrub(&format!("Invalid API Key provided: {KEY}")),
            "Invalid API Key provided: rk_live_…"
        );
    }

    #[test]
    fn keys_of_the_wrong_kind_are_refused_without_being_echoed() {
        for (key, says) in [
            ("", "empty"),
            ("pk_live_abcdef", "publishable"),
            ("whsec_abcdef", "webhook signing secret"),
            ("sk_live_ab cd", "spaces"),
            ("abcdef123", "starts with sk_"),
        ] {
            let error = ApiKey::new(key).unwrap_err();
            assert!(error.contains(says), "{key}: {error}");
            assert!(key.len() < 4 || !error.contains(key), "{error}");
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap_and_honours_retry_after() {
        let client = Client::new(Config::new(ApiKey::new(KEY).unwrap())).unwrap();
        for attempt in 1..=10 {
            let wait = client.backoff(attempt, None);
            let full = FIRST_BACKOFF.saturating_mul(1 << (attempt - 1)).min(client.config.max_backoff);
            assert!(wait >= full / 2 && wait <= full, "attempt {attempt}: {wait:?} of {full:?}");
        }
        assert!(client.backoff(1, Some(Duration::from_secs(7))) >= Duration::from_secs(7));
        assert_eq!(client.backoff(1, Some(Duration::from_secs(3600))), Duration::from_secs(60));
    }

    #[test]
    fn a_base_with_credentials_or_a_query_is_refused() {
        for base in
            ["ftp://api.stripe.com", "https://user:pw@api.stripe.com", "https://api.stripe.com/?k=1", "nope"]
        {
            let mut config = Config::new(ApiKey::new(KEY).unwrap());
            config.base = base.into();
            assert!(Client::new(config).is_err(), "{base}");
        }
    }

    #[test]
    fn forms_are_encoded_with_stripe_brackets_kept() {
        assert_eq!(encode("metadata[order id]"), "metadata[order+id]");
        assert_eq!(encode("a&b=c/é"), "a%26b%3Dc%2F%C3%A9");
    }
}
