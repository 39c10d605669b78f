//! A stand-in for Stripe's API, which the tests cannot reach: a local HTTP server for the tests of
//! `inbox-worker reconcile` (which pages `GET /v1/events`) and of the thin-event fetcher (which
//! GETs a `related_object.url`). It answers as Stripe documents — list order and cursors, the
//! event filters, the error object and its status codes, `Request-Id` on every answer, objects
//! seen only in a connected account's context — and fails on cue (429, 500, 401, a stall) the way
//! the real API sometimes does.
//!
//! Checked against docs.stripe.com: "Pagination" (`api/pagination`), "List all events"
//! (`api/events/list`), "Errors" (`api/errors`), "Error codes" (`error-codes`), "Advanced error
//! handling" (`error-low-level`), "Rate limits" (`rate-limits`), "Request IDs"
//! (`api/request_ids`), "Connected accounts" (`api/connected-accounts`) and "Stripe-Context
//! header" (`context`). Where the docs quote no message the wording is ours; the status, `type`,
//! `code` and `param` are Stripe's. Not modelled: the 30-day window of the events list, `expand`
//! and `delivery_success` (accepted, ignored), writes (any method but GET is an unknown URL), and
//! v2's list pagination (`/v2/…` paths serve single objects only).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use serde_json::{json, Value};

/// The platform account a 403 names when the request is not made for a connected account.
const PLATFORM_ACCOUNT: &str = "acct_1InboxPlatform0";

/// An answer forced on a request in place of the normal one ([`StripeApi::fail_nth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// 429 with Stripe's rate-limit error (`invalid_request_error`, `code: rate_limit`, as in the
    /// "Error codes" list) and `Stripe-Rate-Limited-Reason: global-rate` (which "Rate limits" says
    /// every rate limiter's 429 carries), plus `Retry-After: <seconds>` when given.
    RateLimited { retry_after: Option<u64> },
    /// 500 with an `api_error` and `Stripe-Should-Retry: true` ("Advanced error handling": the
    /// API sets it when it knows a retry is safe).
    ServerError,
    /// 401 as for a wrong or revoked key, whatever key the request carried.
    Unauthorized,
    /// The normal answer, after this delay: a slow API, for the client's timeout.
    Stall(Duration),
}

/// One request the server got (never the key it carried).
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// `GET`, `POST`…: a reconcile or a fetch only reads.
    pub method: String,
    /// The path without the query (`/v1/events`): what prefixes are matched against.
    pub path: String,
    /// The raw query string (`limit=100&starting_after=evt_…`): shows how the client paged.
    pub query: String,
    /// `Stripe-Account`: the connected account a v1 request acts for.
    pub stripe_account: Option<String>,
    /// `Stripe-Context`: the same for v2 and for the objects thin events name.
    pub stripe_context: Option<String>,
    /// `Idempotency-Key`: a retried write must carry the key of its first attempt.
    pub idempotency_key: Option<String>,
    /// Whether an `Authorization` header came at all (its value is not kept).
    pub authorization_present: bool,
    /// The status answered (for a stall, the one answered after it, recorded on arrival).
    pub status: u16,
    /// The `Request-Id` answered: what a client's error must quote for Stripe's support.
    pub request_id: String,
}

/// A scripted fault: every request whose path starts with `prefix` counts, from when the rule is
/// set; the `n`-th (or every `n`-th) gets `fault`.
struct Rule {
    prefix: String,
    n: usize,
    every: bool,
    fault: Fault,
    seen: usize,
}

#[derive(Default)]
struct Inner {
    /// The events, in the order added: the tie-break among equal `created` (later first).
    events: Vec<Value>,
    /// Objects to retrieve, by (connected account or None for the platform, path).
    objects: HashMap<(Option<String>, String), Value>,
    /// Path prefixes the key may not use (a restricted key without the permission).
    forbidden: Vec<String>,
    /// Scripted faults, in the order set: the first that fires answers.
    rules: Vec<Rule>,
    /// Every request, in arrival order.
    requests: Vec<RecordedRequest>,
}

struct State {
    /// The one key accepted.
    api_key: String,
    /// Seeds the random part of the request ids.
    random: RandomState,
    /// Makes each request id distinct.
    next_request: AtomicU64,
    inner: Mutex<Inner>,
}

/// A running stand-in for `https://api.stripe.com`, stopped when dropped.
pub struct StripeApi {
    base_url: String,
    state: Arc<State>,
    handle: actix_web::dev::ServerHandle,
}

impl StripeApi {
    /// Starts a server on a free localhost port that takes `Authorization: Bearer {api_key}`.
    pub async fn start(api_key: &str) -> StripeApi {
        let state = Arc::new(State {
            api_key: api_key.to_owned(),
            random: RandomState::new(),
            next_request: AtomicU64::new(0),
            inner: Mutex::default(),
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let data = state.clone();
        let server = HttpServer::new(move || {
            App::new().app_data(web::Data::from(data.clone())).default_service(web::to(serve))
        })
        .workers(2)
        .disable_signals()
        .shutdown_timeout(1)
        .listen(listener)
        .unwrap()
        .run();
        let handle = server.handle();
        tokio::spawn(server);
        StripeApi { base_url: format!("http://127.0.0.1:{port}"), state, handle }
    }

    /// Where to point the client instead of `https://api.stripe.com` (no trailing slash).
    pub fn base_url(&self) -> String {
        self.base_url.clone()
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.state.inner.lock().unwrap()
    }

    /// Adds an event (needs a string `id` and an integer `created`). One with an `account`
    /// (a Connect event) is seen only with that account in `Stripe-Account`/`Stripe-Context`, as
    /// the platform's own list does not show its connected accounts' events.
    pub fn add_event(&self, event: Value) {
        let id = event["id"].as_str().expect("an event needs a string id").to_owned();
        assert!(event["created"].is_i64(), "event {id} needs an integer `created`");
        let mut inner = self.inner();
        assert!(inner.events.iter().all(|e| e["id"] != id.as_str()), "event {id} added twice");
        inner.events.push(event);
    }

    /// Adds events, in order (the later of two with the same `created` is listed first).
    pub fn add_events(&self, events: impl IntoIterator<Item = Value>) {
        events.into_iter().for_each(|event| self.add_event(event));
    }

    /// Serves `object` at `path` (`/v1/billing/meters/mtr_1`, `/v2/core/accounts/acct_1`); the path
    /// must be free.
    pub fn add_object(&self, path: &str, object: Value) {
        self.put(None, path, object, false);
    }

    /// Serves `object` at `path` from now on, replacing what was there (the object changed).
    pub fn set_object(&self, path: &str, object: Value) {
        self.put(None, path, object, true);
    }

    /// Serves `object` at `path` only to requests made for `account` (`Stripe-Account` or
    /// `Stripe-Context` naming it); the path must be free for that account.
    pub fn add_object_for_account(&self, account: &str, path: &str, object: Value) {
        self.put(Some(account), path, object, false);
    }

    /// [`StripeApi::set_object`] for a connected account's object.
    pub fn set_object_for_account(&self, account: &str, path: &str, object: Value) {
        self.put(Some(account), path, object, true);
    }

    fn put(&self, account: Option<&str>, path: &str, object: Value, replace: bool) {
        let key = (account.map(str::to_owned), path.to_owned());
        let old = self.inner().objects.insert(key, object);
        assert!(replace || old.is_none(), "{path} already holds an object (use set_object)");
    }

    /// Answers 403 to every request whose path starts with `path_prefix`, as to a restricted key
    /// without the permission.
    pub fn forbid(&self, path_prefix: &str) {
        self.inner().forbidden.push(path_prefix.to_owned());
    }

    /// Answers the `n`-th request (1-based) whose path starts with `path_prefix`, counted from now
    /// over all such requests, with `fault`.
    pub fn fail_nth(&self, path_prefix: &str, n: usize, fault: Fault) {
        self.rule(path_prefix, n, false, fault);
    }

    /// Answers every `k`-th request whose path starts with `path_prefix`, counted from now, with
    /// `fault` (a chaos-like background of failures).
    pub fn fail_every(&self, path_prefix: &str, k: usize, fault: Fault) {
        self.rule(path_prefix, k, true, fault);
    }

    fn rule(&self, prefix: &str, n: usize, every: bool, fault: Fault) {
        assert!(n >= 1, "requests are counted from 1");
        self.inner().rules.push(Rule { prefix: prefix.to_owned(), n, every, fault, seen: 0 });
    }

    /// Every request so far (since the last [`StripeApi::reset_requests`]), in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.inner().requests.clone()
    }

    /// Requests answered 2xx whose path starts with `path_prefix`.
    pub fn count(&self, path_prefix: &str) -> usize {
        let inner = self.inner();
        inner
            .requests
            .iter()
            .filter(|r| r.path.starts_with(path_prefix) && (200..300).contains(&r.status))
            .count()
    }

    /// Forgets the requests recorded (the fault rules keep counting).
    pub fn reset_requests(&self) {
        self.inner().requests.clear();
    }
}

impl Drop for StripeApi {
    fn drop(&mut self) {
        let handle = self.handle.clone();
        tokio::spawn(async move { handle.stop(false).await });
    }
}

/// A response before its `Request-Id`.
struct Answer {
    status: u16,
    body: Value,
    headers: Vec<(&'static str, String)>,
}

impl Answer {
    fn ok(body: Value) -> Answer {
        Answer { status: 200, body, headers: Vec::new() }
    }

    /// Stripe's error object (`api/errors`): `type`, a `message`, and when given a `code` (with
    /// the `doc_url` the "Error codes" page says every code links to) and the `param` at fault.
    fn error(status: u16, kind: &str, code: Option<&str>, param: Option<&str>, message: String) -> Answer {
        let mut error = json!({ "type": kind, "message": message });
        if let Some(code) = code {
            error["code"] = json!(code);
            error["doc_url"] =
                json!(format!("https://stripe.com/docs/error-codes/{}", code.replace('_', "-")));
        }
        if let Some(param) = param {
            error["param"] = json!(param);
        }
        Answer { status, body: json!({ "error": error }), headers: Vec::new() }
    }

    /// 400 `invalid_request_error` about `param`.
    fn invalid(code: Option<&str>, param: &str, message: String) -> Answer {
        Answer::error(400, "invalid_request_error", code, Some(param), message)
    }
}

/// `sk_test_` and asterisks for all but the last `shown` characters, as Stripe quotes a key in an
/// error; a secret part shorter than 3 × `shown` is all asterisks (a test key must not leak).
fn masked(key: &str, shown: usize) -> String {
    let split = key.match_indices('_').nth(1).filter(|(i, _)| *i < 9).map_or(0, |(i, _)| i + 1);
    let (prefix, secret) = key.split_at(split);
    let shown = if secret.len() >= 3 * shown { shown } else { 0 };
    format!("{prefix}{}{}", "*".repeat(secret.len() - shown), &secret[secret.len() - shown..])
}

/// 401 (`api/errors`: "No valid API key provided"), with Stripe's two messages.
fn unauthorized(presented: Option<&str>) -> Answer {
    let message = match presented {
        None => "You did not provide an API key. You need to provide your API key in the Authorization header, \
                 using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY'). See \
                 https://stripe.com/docs/api#authentication for details, or we can help at https://support.stripe.com/."
            .to_owned(),
        Some(key) => format!("Invalid API Key provided: {}", masked(key, 4)),
    };
    Answer::error(401, "invalid_request_error", None, None, message)
}

/// 403 as Stripe answers a restricted key (`error-handling#permission-errors`), naming the key
/// (masked), the account and a permission guessed from the path (`/v1/events` → `rak_event_read`).
fn forbidden(key: &str, method: &str, path: &str, account: Option<&str>) -> Answer {
    let words: Vec<&str> = path
        .split('/')
        .skip(2)
        .filter(|w| !w.is_empty() && !w.contains(|c: char| c.is_ascii_digit()))
        .collect();
    let resource = words.join("_");
    let resource = resource.strip_suffix('s').unwrap_or(&resource);
    let access = if method == "GET" { "read" } else { "write" };
    let message = format!(
        "The provided key '{}' does not have the required permissions for this endpoint on account '{}'. \
         Having the 'rak_{resource}_{access}' permission would allow this request to continue.",
        masked(key, 6),
        account.unwrap_or(PLATFORM_ACCOUNT)
    );
    Answer::error(403, "invalid_request_error", None, None, message)
}

/// The injected answer for `fault` (a stall has none: it answers normally, later).
fn fault_answer(fault: &Fault, presented: Option<&str>) -> Option<Answer> {
    match fault {
        Fault::RateLimited { retry_after } => {
            let message = "Request rate limit exceeded. Learn more about rate limits here https://stripe.com/docs/rate-limits.";
            let mut answer =
                Answer::error(429, "invalid_request_error", Some("rate_limit"), None, message.into());
            answer.headers.push(("Stripe-Rate-Limited-Reason", "global-rate".into()));
            answer.headers.extend(retry_after.map(|s| ("Retry-After", s.to_string())));
            Some(answer)
        }
        Fault::ServerError => {
            let mut answer = Answer::error(500, "api_error", None, None, "An unknown error occurred".into());
            answer.headers.push(("Stripe-Should-Retry", "true".into()));
            Some(answer)
        }
        Fault::Unauthorized => Some(unauthorized(presented)),
        Fault::Stall(_) => None,
    }
}

/// Every request: record it, then answer — a scripted fault first, else 401 for a wrong key, 403
/// for a forbidden path, then the API itself. Every answer carries `Request-Id` (`api/request_ids`).
async fn serve(state: web::Data<State>, request: HttpRequest) -> HttpResponse {
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let authorization = header("authorization");
    let presented = authorization.as_deref().map(|v| match v.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
        _ => v,
    });
    let (stripe_account, stripe_context) = (header("stripe-account"), header("stripe-context"));
    // Stripe-Context supersedes Stripe-Account (the "Stripe-Context header" page).
    let account = stripe_context.clone().or(stripe_account.clone());
    let (method, path) = (request.method().as_str().to_owned(), request.path().to_owned());
    let request_id = state.request_id();
    let (answer, delay) = {
        let mut inner = state.inner.lock().unwrap();
        let fault = inner.fault_for(&path);
        let delay = match &fault {
            Some(Fault::Stall(delay)) => *delay,
            _ => Duration::ZERO,
        };
        let answer = match fault.as_ref().and_then(|fault| fault_answer(fault, presented)) {
            Some(answer) => answer,
            None if presented != Some(state.api_key.as_str()) => unauthorized(presented),
            None if inner.forbidden.iter().any(|p| path.starts_with(p.as_str())) => {
                forbidden(&state.api_key, &method, &path, account.as_deref())
            }
            // Stripe's answer to a route it does not have; this stand-in only reads.
            None if method != "GET" => {
                let message = format!("Unrecognized request URL ({method}: {path}). Please see https://stripe.com/docs or we can help at https://support.stripe.com/.");
                Answer::error(404, "invalid_request_error", None, None, message)
            }
            None => inner.get(&path, request.query_string(), account.as_deref()),
        };
        inner.requests.push(RecordedRequest {
            method,
            path,
            query: request.query_string().to_owned(),
            stripe_account,
            stripe_context,
            idempotency_key: header("idempotency-key"),
            authorization_present: authorization.is_some(),
            status: answer.status,
            request_id: request_id.clone(),
        });
        (answer, delay)
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut body = answer.body;
    if let Some(error) = body.get_mut("error") {
        error["request_log_url"] = json!(format!("https://dashboard.stripe.com/test/logs/{request_id}"));
    }
    let mut response = HttpResponse::build(actix_web::http::StatusCode::from_u16(answer.status).unwrap());
    response.insert_header(("Request-Id", request_id));
    for header in answer.headers {
        response.insert_header(header);
    }
    response.content_type("application/json").body(body.to_string())
}

impl State {
    /// `req_` and 14 random letters and digits, the shape of Stripe's request ids.
    fn request_id(&self) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        let mut random = 0;
        let id = (0..14u64).map(|i| {
            if i % 7 == 0 {
                random = self.random.hash_one((n, i));
            }
            let c = ALPHABET[(random % 62) as usize];
            random /= 62;
            char::from(c)
        });
        format!("req_{}", id.collect::<String>())
    }
}

impl Inner {
    /// Counts the request against every rule its path matches; the first rule that fires wins.
    fn fault_for(&mut self, path: &str) -> Option<Fault> {
        let mut chosen = None;
        for rule in self.rules.iter_mut().filter(|rule| path.starts_with(rule.prefix.as_str())) {
            rule.seen += 1;
            let fires = if rule.every { rule.seen % rule.n == 0 } else { rule.seen == rule.n };
            if fires && chosen.is_none() {
                chosen = Some(rule.fault.clone());
            }
        }
        chosen
    }

    /// The events `account` sees (None: the platform's own, without an `account` field).
    fn visible<'a>(&'a self, account: Option<&'a str>) -> impl Iterator<Item = (usize, &'a Value)> + 'a {
        self.events.iter().enumerate().filter(move |(_, e)| e["account"].as_str() == account)
    }

    /// `GET path`: the events list, an object added, an event, else 404 `resource_missing`.
    fn get(&self, path: &str, query: &str, account: Option<&str>) -> Answer {
        if path == "/v1/events" {
            return self.list_events(query, account).unwrap_or_else(|error| error);
        }
        if let Some(object) = self.objects.get(&(account.map(str::to_owned), path.to_owned())) {
            return Answer::ok(object.clone());
        }
        let (collection, id) = path.trim_end_matches('/').rsplit_once('/').unwrap_or(("", path));
        if collection == "/v1/events" {
            if let Some((_, event)) = self.visible(account).find(|(_, e)| e["id"] == id) {
                return Answer::ok(event.clone());
            }
        }
        let noun = collection.rsplit('/').next().unwrap_or_default();
        let noun = noun.strip_suffix('s').filter(|n| !n.is_empty()).unwrap_or("object");
        Answer::error(
            404,
            "invalid_request_error",
            Some("resource_missing"),
            Some("id"),
            format!("No such {noun}: '{id}'"),
        )
    }

    /// `GET /v1/events` ("List all events", "Pagination"): newest first by `created` (later added
    /// first among equals); `limit` 1..=100 (10 by default); `starting_after` an id: the items
    /// after it in that order (older); `ending_before` an id: the `limit` items just before it
    /// (newer), still newest first, `has_more` telling whether even newer ones remain; `created`
    /// as an integer or with `gt`/`gte`/`lt`/`lte`; `type` exact or with `*` as a wildcard;
    /// `types[]` up to 20 exact names, not with `type`. Unknown parameters are refused, as Stripe
    /// does.
    fn list_events(&self, query: &str, account: Option<&str>) -> Result<Answer, Answer> {
        let pairs = web::Query::<Vec<(String, String)>>::from_query(query)
            .map_err(|e| {
                Answer::error(400, "invalid_request_error", None, None, format!("Invalid query string: {e}"))
            })?
            .into_inner();
        let integer = |param: &str, value: &str| {
            value.parse::<i64>().map_err(|_| {
                Answer::invalid(Some("parameter_invalid_integer"), param, format!("Invalid integer: {value}"))
            })
        };
        let (mut limit, mut after, mut before, mut type_, mut types) = (10, None, None, None, Vec::new());
        let mut created: Vec<(String, i64)> = Vec::new();
        for (key, value) in pairs {
            let indexed = |name: &str| {
                key.strip_prefix(name)
                    .and_then(|k| k.strip_prefix('['))
                    .and_then(|k| k.strip_suffix(']'))
                    .map(str::to_owned)
            };
            match key.as_str() {
                "limit" => limit = integer("limit", &value)?,
                "starting_after" => after = Some(value),
                "ending_before" => before = Some(value),
                "type" => type_ = Some(value),
                "created" => created.push(("eq".into(), integer("created", &value)?)),
                "delivery_success" => {}
                _ if indexed("expand").is_some() => {}
                _ if indexed("types").is_some_and(|i| i.chars().all(|c| c.is_ascii_digit())) => {
                    types.push(value)
                }
                _ if indexed("created")
                    .is_some_and(|op| ["gt", "gte", "lt", "lte"].contains(&op.as_str())) =>
                {
                    created.push((indexed("created").unwrap(), integer(&key, &value)?));
                }
                _ => {
                    return Err(Answer::invalid(
                        Some("parameter_unknown"),
                        &key,
                        format!("Received unknown parameter: {key}"),
                    ));
                }
            }
        }
        if !(1..=100).contains(&limit) {
            let bound = if limit > 100 { "less than or equal to 100" } else { "greater than or equal to 1" };
            let message = format!("This value must be {bound} (it currently is '{limit}').");
            return Err(Answer::invalid(None, "limit", message));
        }
        if after.is_some() && before.is_some() {
            let message =
                "Received both starting_after and ending_before parameters. Please pass in only one.";
            return Err(Answer::invalid(Some("parameters_exclusive"), "ending_before", message.into()));
        }
        if type_.is_some() && !types.is_empty() {
            let message = "You may pass either `type` or `types`, but not both.";
            return Err(Answer::invalid(Some("parameters_exclusive"), "types", message.into()));
        }
        if types.len() > 20 {
            return Err(Answer::invalid(
                None,
                "types",
                format!("`types` holds at most 20 event names; {} were given.", types.len()),
            ));
        }
        // The order of the list: (created, order added), greatest first.
        let mut order: Vec<(i64, usize)> =
            self.visible(account).map(|(i, e)| (e["created"].as_i64().unwrap(), i)).collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        let position = |param: &str, id: &str| {
            order.iter().copied().find(|(_, i)| self.events[*i]["id"] == id).ok_or_else(|| {
                Answer::invalid(Some("resource_missing"), param, format!("No such event: '{id}'"))
            })
        };
        let after = after.map(|id| position("starting_after", &id)).transpose()?;
        let before = before.map(|id| position("ending_before", &id)).transpose()?;
        let matching: Vec<(i64, usize)> = order
            .iter()
            .copied()
            .filter(|&(at, i)| {
                let kind = self.events[i]["type"].as_str().unwrap_or_default();
                created.iter().all(|(op, t)| match op.as_str() {
                    "gt" => at > *t,
                    "gte" => at >= *t,
                    "lt" => at < *t,
                    "lte" => at <= *t,
                    _ => at == *t,
                }) && type_.as_deref().is_none_or(|pattern| glob(pattern, kind))
                    && (types.is_empty() || types.iter().any(|t| t == kind))
                    && after.is_none_or(|cursor| (at, i) < cursor)
                    && before.is_none_or(|cursor| (at, i) > cursor)
            })
            .collect();
        let limit = limit as usize;
        let has_more = matching.len() > limit;
        // Before a cursor, the page is the items nearest to it: the end of the newer ones.
        let page = if before.is_some() {
            &matching[matching.len().saturating_sub(limit)..]
        } else {
            &matching[..limit.min(matching.len())]
        };
        let data: Vec<&Value> = page.iter().map(|(_, i)| &self.events[*i]).collect();
        Ok(Answer::ok(json!({ "object": "list", "data": data, "has_more": has_more, "url": "/v1/events" })))
    }
}

/// Whether `text` matches `pattern`, where `*` stands for any run of characters (`invoice.*`).
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stripe_fixtures::{object_for, on_connected_account, snapshot_event};

    const KEY: &str = "sk_test_51InboxTestKeyForTheStandIn0000";
    const T0: i64 = 1_760_000_000;

    fn event(n: usize, event_type: &str, created: i64) -> Value {
        snapshot_event(&format!("evt_{n:04}"), event_type, object_for(event_type).0, created)
    }

    /// GETs `path_and_query` with `key` (None: no Authorization) and `headers`; status, the
    /// response's headers and its JSON.
    async fn get_with(
        api: &StripeApi,
        path_and_query: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let mut request = reqwest::Client::new().get(format!("{}{path_and_query}", api.base_url()));
        if let Some(key) = key {
            request = request.header("Authorization", format!("Bearer {key}"));
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        (status, headers, serde_json::from_str(&response.text().await.unwrap()).unwrap())
    }

    async fn get(api: &StripeApi, path_and_query: &str) -> (u16, Value) {
        let (status, _, body) = get_with(api, path_and_query, Some(KEY), &[]).await;
        (status, body)
    }

    fn ids(list: &Value) -> Vec<String> {
        list["data"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect()
    }

    /// 250 events, `evt_0000` the oldest, types cycling through three.
    async fn with_250_events() -> StripeApi {
        let api = StripeApi::start(KEY).await;
        let types = ["invoice.paid", "customer.created", "charge.succeeded"];
        api.add_events((0..250).map(|n| event(n, types[n % 3], T0 + n as i64)));
        api
    }

    #[tokio::test]
    async fn pages_all_events_newest_first() {
        let api = with_250_events().await;
        let (mut seen, mut cursor, mut pages) = (Vec::new(), None::<String>, Vec::new());
        loop {
            let after = cursor.as_ref().map(|c| format!("&starting_after={c}")).unwrap_or_default();
            let (status, page) = get(&api, &format!("/v1/events?limit=100{after}")).await;
            assert_eq!(status, 200, "{page}");
            assert_eq!((page["object"].as_str(), page["url"].as_str()), (Some("list"), Some("/v1/events")));
            pages.push((ids(&page).len(), page["has_more"].as_bool().unwrap()));
            seen.extend(ids(&page));
            cursor = seen.last().cloned();
            if page["has_more"] == false {
                break;
            }
        }
        assert_eq!(pages, [(100, true), (100, true), (50, false)]);
        assert_eq!(seen, (0..250).rev().map(|n| format!("evt_{n:04}")).collect::<Vec<_>>());
        // ending_before the second page's first event gives back the first page.
        let (_, previous) = get(&api, &format!("/v1/events?limit=100&ending_before={}", seen[100])).await;
        assert_eq!((ids(&previous), previous["has_more"].as_bool()), (seen[..100].to_vec(), Some(false)));
        let (_, nearest) = get(&api, &format!("/v1/events?limit=2&ending_before={}", seen[100])).await;
        assert_eq!((ids(&nearest), nearest["has_more"].as_bool()), (seen[98..100].to_vec(), Some(true)));
        let (_, default) = get(&api, "/v1/events").await;
        assert_eq!(ids(&default), seen[..10]);
        let requests = api.requests();
        assert!(requests.iter().all(|r| r.request_id.len() == 18
            && r.request_id.starts_with("req_")
            && r.authorization_present));
        assert_eq!(api.count("/v1/events"), requests.len());
    }

    #[tokio::test]
    async fn filters_by_created_and_type() {
        let api = with_250_events().await;
        api.add_events([
            event(900, "invoice.created", T0 + 1000),
            event(901, "invoiceitem.created", T0 + 1001),
        ]);
        let (_, since) = get(&api, &format!("/v1/events?limit=100&created[gte]={}", T0 + 200)).await;
        assert_eq!(ids(&since).len(), 52);
        assert!(since["data"].as_array().unwrap().iter().all(|e| e["created"].as_i64().unwrap() >= T0 + 200));
        let (_, window) =
            get(&api, &format!("/v1/events?created[gt]={}&created[lte]={}", T0 + 10, T0 + 12)).await;
        assert_eq!(ids(&window), ["evt_0012", "evt_0011"]);
        let (_, exact) = get(&api, &format!("/v1/events?created={}", T0 + 5)).await;
        assert_eq!(ids(&exact), ["evt_0005"]);

        let (_, two) =
            get(&api, "/v1/events?limit=100&types[]=customer.created&types[]=invoiceitem.created").await;
        let kinds: Vec<&str> =
            two["data"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds.len(), 84);
        assert!(kinds.iter().all(|k| ["customer.created", "invoiceitem.created"].contains(k)));
        let (_, indexed) =
            get(&api, "/v1/events?limit=100&types[0]=customer.created&types[1]=invoiceitem.created").await;
        assert_eq!(ids(&indexed), ids(&two));

        let (_, invoices) = get(&api, "/v1/events?limit=100&type=invoice.*").await;
        let kinds: Vec<&str> =
            invoices["data"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!((kinds.len(), kinds[0]), (85, "invoice.created"), "invoiceitem.* is not invoice.*");
        assert!(glob("*.created", "invoice.created") && !glob("invoice.*", "invoiceitem.created"));
    }

    #[tokio::test]
    async fn refuses_bad_parameters_as_stripe_does() {
        let api = with_250_events().await;
        for (query, param, code) in [
            ("limit=101", "limit", None),
            ("limit=0", "limit", None),
            ("limit=ten", "limit", Some("parameter_invalid_integer")),
            ("starting_after=evt_0001&ending_before=evt_0002", "ending_before", Some("parameters_exclusive")),
            ("starting_after=evt_nope", "starting_after", Some("resource_missing")),
            ("type=invoice.paid&types[]=invoice.paid", "types", Some("parameters_exclusive")),
            ("created[since]=1", "created[since]", Some("parameter_unknown")),
        ] {
            let (status, body) = get(&api, &format!("/v1/events?{query}")).await;
            assert_eq!(
                (status, body["error"]["param"].as_str(), body["error"]["code"].as_str()),
                (400, Some(param), code),
                "{query}: {body}"
            );
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
        let too_many: String = (0..21).map(|n| format!("types[]=t.{n}&")).collect();
        assert_eq!(get(&api, &format!("/v1/events?{too_many}")).await.0, 400);
        let (status, missing) = get(&api, "/v1/events/evt_nope").await;
        assert_eq!((status, missing["error"]["code"].as_str()), (404, Some("resource_missing")));
        assert_eq!(missing["error"]["message"], "No such event: 'evt_nope'");
        assert_eq!(get(&api, "/v1/events/evt_0007").await.1["id"], "evt_0007");
        assert_eq!(api.count("/v1/events"), 1);
    }

    #[tokio::test]
    async fn needs_the_key_and_never_echoes_it() {
        let api = StripeApi::start(KEY).await;
        let (status, headers, body) = get_with(&api, "/v1/events", None, &[]).await;
        assert_eq!(status, 401);
        assert!(body["error"]["message"].as_str().unwrap().starts_with("You did not provide an API key."));
        assert!(headers.get("Request-Id").is_some());
        let wrong = "sk_test_51SomebodyElsesKeyWXYZ";
        let (status, _, body) = get_with(&api, "/v1/events", Some(wrong), &[]).await;
        let message = body["error"]["message"].as_str().unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (401, Some("invalid_request_error")));
        assert!(
            message.starts_with("Invalid API Key provided: sk_test_***")
                && message.ends_with("WXYZ")
                && !message.contains(wrong)
        );
        api.forbid("/v1/events");
        let (status, body) = get(&api, "/v1/events").await;
        let message = body["error"]["message"].as_str().unwrap();
        assert_eq!(status, 403);
        assert!(
            message.contains("does not have the required permissions")
                && message.contains("rak_event_read")
                && !message.contains(KEY)
        );
        let presence: Vec<bool> = api.requests().iter().map(|r| r.authorization_present).collect();
        assert_eq!(presence, [false, true, true]);
    }

    #[tokio::test]
    async fn scripted_faults() {
        let api = with_250_events().await;
        api.fail_nth("/v1/events", 1, Fault::RateLimited { retry_after: Some(2) });
        let (status, headers, body) = get_with(&api, "/v1/events", Some(KEY), &[]).await;
        assert_eq!((status, body["error"]["code"].as_str()), (429, Some("rate_limit")));
        assert_eq!(headers["Retry-After"], "2");
        assert_eq!(headers["Stripe-Rate-Limited-Reason"], "global-rate");
        assert_eq!(get(&api, "/v1/events").await.0, 200);
        assert_eq!(api.count("/v1/events"), 1);

        api.fail_every("/v1/events/", 2, Fault::ServerError);
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let (status, headers, body) = get_with(&api, "/v1/events/evt_0001", Some(KEY), &[]).await;
            if status == 500 {
                assert_eq!(
                    (headers["Stripe-Should-Retry"].to_str().unwrap(), body["error"]["type"].as_str()),
                    ("true", Some("api_error"))
                );
            }
            statuses.push(status);
        }
        assert_eq!(statuses, [200, 500, 200, 500]);

        api.fail_nth("/v1/events", 1, Fault::Stall(Duration::from_millis(500)));
        let client = reqwest::Client::builder().timeout(Duration::from_millis(100)).build().unwrap();
        let stalled = client.get(format!("{}/v1/events", api.base_url())).bearer_auth(KEY).send().await;
        assert!(stalled.unwrap_err().is_timeout());
        api.fail_nth("/v1/events", 1, Fault::Unauthorized);
        assert_eq!(get(&api, "/v1/events").await.0, 401);
        api.reset_requests();
        assert_eq!(get(&api, "/v1/events").await.0, 200);
        assert_eq!(api.requests().len(), 1);
    }

    #[tokio::test]
    async fn objects_in_a_connected_accounts_context() {
        let api = StripeApi::start(KEY).await;
        let account = json!({ "id": "acct_1Connected", "object": "v2.core.account" });
        api.add_object_for_account("acct_1Connected", "/v2/core/accounts/acct_1Connected", account.clone());
        let (status, _, body) = get_with(
            &api,
            "/v2/core/accounts/acct_1Connected",
            Some(KEY),
            &[("Stripe-Context", "acct_1Connected")],
        )
        .await;
        assert_eq!((status, body), (200, account));
        let (status, body) = get(&api, "/v2/core/accounts/acct_1Connected").await;
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("resource_missing")));
        assert_eq!(body["error"]["message"], "No such account: 'acct_1Connected'");

        let (meter, _) = object_for("billing.meter.created");
        api.add_object("/v1/billing/meters/mtr_1", meter.clone());
        assert_eq!(get(&api, "/v1/billing/meters/mtr_1").await, (200, meter));
        api.set_object("/v1/billing/meters/mtr_1", json!({ "id": "mtr_1", "status": "inactive" }));
        assert_eq!(get(&api, "/v1/billing/meters/mtr_1").await.1["status"], "inactive");

        api.add_event(on_connected_account(event(1, "invoice.paid", T0), "acct_1Connected"));
        assert_eq!(
            ids(&get(&api, "/v1/events").await.1).len(),
            0,
            "the platform's list has no Connect events"
        );
        let (_, _, list) =
            get_with(&api, "/v1/events", Some(KEY), &[("Stripe-Account", "acct_1Connected")]).await;
        assert_eq!(ids(&list), ["evt_0001"]);
        let recorded = api.requests();
        assert_eq!(recorded[0].stripe_context.as_deref(), Some("acct_1Connected"));
        assert_eq!(recorded.last().unwrap().stripe_account.as_deref(), Some("acct_1Connected"));
    }
}
