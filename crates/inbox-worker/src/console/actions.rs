//! What operators change: POST only, each behind the session's CSRF token and the read-only flag
//! ([`Auth::acting`]: a form from another site, without this session's token, or from a read-only
//! user is refused with a 403 before anything is read).
//!
//! Every action runs the operator command's own library function — the code `inbox-worker requeue`,
//! `replay`, `dismiss` and `reconciliation resolve` run, not a copy — with the signed-in operator as
//! the actor of its `operator_audit` records (their target says `"via": "console"`):
//!
//! * `POST /actions/requeue` (`endpoint`, `event_id`): `requeue --event-id`;
//! * `POST /actions/release` (the same): `requeue --event-id` of a row held for its livemode (a
//!   person decided it belongs here after all); refused for a row not held so;
//! * `POST /actions/dismiss` (the same, `reason`): `dismiss`;
//! * `POST /actions/replay`, `POST /actions/replay-dry-run` (the same): `replay --event-id`, with
//!   the binary's handlers; the dry run answers with what the replay would change per table
//!   (`replay --dry-run --json`'s `would_change`), nothing changed, the look audited;
//! * `POST /actions/requeue-filtered` (the needs-review filters `type`, `endpoint`, `held`, `error`,
//!   `older_than`, `account`; `confirm`): without `confirm`, a page with the count of parked rows
//!   the filters match and the form that confirms it; with `confirm=N`, `requeue --all`'s batches
//!   (audited as a run) over those rows, at most N and at most [`MAX_ROWS`] — what the operator
//!   confirmed, never more, whatever was parked since. Rows held on arrival are left, as
//!   `requeue --all` leaves them: each needs its own decision;
//! * `POST /actions/resolve` (`id`, `note`): `reconciliation resolve`.
//!
//! A success answers 303 to the page concerned with `?notice=…` (the replay dry run and the
//! confirmation are pages of their own). A refusal — the command's [`Refused`], with the text the
//! CLI prints — is a 409 page saying it; an invalid field a 400 page; a database failure a 500
//! page saying what failed.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use askama::Template;
use deadpool_postgres::Object;
use inbox_domain::db::describe_pool_error;
use inbox_domain::inbox::store::admin::TableChange;
use inbox_domain::inbox::store::console::like_literal;
use inbox_domain::PROVIDER_STRIPE;
use serde::Deserialize;

use super::auth::{Auth, Operator};
use super::pages::{encode, event_href, ReviewFilterForm};
use super::{render, Console};
use crate::ops::requeue::{self, Matching, Take};
use crate::ops::{dismiss, reconciliation, replay, Actor, Refused};

/// Most rows one `requeue-filtered` requeues, whatever was confirmed (more: run it again, or
/// `requeue --all` at the command line).
pub const MAX_ROWS: i64 = 1000;

/// Rows per transaction of `requeue-filtered`.
pub const BATCH_SIZE: i64 = 250;

/// The routes of the actions.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/actions/requeue", web::post().to(requeue_event))
        .route("/actions/release", web::post().to(release_event))
        .route("/actions/dismiss", web::post().to(dismiss_event))
        .route("/actions/replay", web::post().to(replay_event))
        .route("/actions/replay-dry-run", web::post().to(replay_dry_run))
        .route("/actions/requeue-filtered", web::post().to(requeue_filtered))
        .route("/actions/resolve", web::post().to(resolve_item));
}

// ----------------------------------------------------------------------------------- answers

/// The page of an action's outcome: a refusal, an invalid form, a failure, or the report of a
/// replay's dry run.
#[derive(Template)]
#[template(path = "console/action_result.html")]
struct ActionResult {
    operator: Operator,
    title: String,
    /// What happened, or why not.
    message: String,
    /// The message is a refusal or an error (shown as one).
    problem: bool,
    /// Where to go back to: (href, label).
    back: (String, String),
    dry_run: Option<DryRun>,
}

/// A replay's dry run, as the page shows it.
struct DryRun {
    endpoint: String,
    event_id: String,
    event_type: String,
    audit_id: i64,
    changes: Vec<Change>,
}

/// What the replay would change in one table.
struct Change {
    table: String,
    inserted: i64,
    updated: i64,
    deleted: i64,
    /// The rows it would write, as JSON.
    rows: Vec<String>,
}

impl Change {
    fn of(change: &TableChange) -> Change {
        Change {
            table: change.table.clone(),
            inserted: change.inserted,
            updated: change.updated,
            deleted: change.deleted,
            rows: change.rows.iter().map(|row| row.to_string()).collect(),
        }
    }
}

/// The page saying an action did not happen: `status` (409 refused, 400 invalid, 500 failed).
fn problem(operator: Operator, status: StatusCode, message: String, back: (String, String)) -> HttpResponse {
    let title = match status {
        StatusCode::CONFLICT => "Refused",
        StatusCode::BAD_REQUEST => "Invalid form",
        _ => "Failed",
    };
    let page =
        ActionResult { operator, title: title.to_owned(), message, problem: true, back, dry_run: None };
    render(&page, status)
}

/// The answer to an action's error: its refusal (409), else a failure (500, logged).
fn failed(operator: Operator, action: &str, error: &anyhow::Error, back: (String, String)) -> HttpResponse {
    if let Some(refused) = error.downcast_ref::<Refused>() {
        tracing::info!(actor = %operator.name, action, refusal = %refused, "console action refused");
        return problem(operator, StatusCode::CONFLICT, refused.to_string(), back);
    }
    tracing::error!(actor = %operator.name, action, error = format!("{error:#}"), "console action failed");
    problem(operator, StatusCode::INTERNAL_SERVER_ERROR, format!("{action} failed: {error:#}"), back)
}

/// 303 to `path` with `notice`.
fn see_other(path: &str, notice: &str) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, format!("{path}?notice={}", encode(notice))))
        .finish()
}

/// An answer that ends an action before it is done (a refusal of the auth layer, an invalid form,
/// no connection), boxed: an `HttpResponse` is large.
type Early = Box<HttpResponse>;

/// An action's answer.
type Answer = Result<HttpResponse, Early>;

/// The answer, however the action ended.
fn answer(result: Answer) -> HttpResponse {
    result.unwrap_or_else(|early| *early)
}

/// A pooled connection, or the 500 page saying why not.
async fn connection(
    console: &Console,
    operator: &Operator,
    back: &(String, String),
) -> Result<Object, Early> {
    console.pool.get().await.map_err(|e| {
        tracing::error!(error = describe_pool_error(&e), "console action: no database connection");
        Box::new(problem(
            operator.clone(),
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot connect to the database: {}", describe_pool_error(&e)),
            back.clone(),
        ))
    })
}

/// A form field: trimmed, None when empty.
fn field(value: &str) -> Option<&str> {
    Some(value.trim()).filter(|v| !v.is_empty())
}

// ------------------------------------------------------------------------------ one event

/// The form of an action on one event.
#[derive(Debug, Deserialize)]
struct EventForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    event_id: String,
    /// `dismiss` only.
    #[serde(default)]
    reason: String,
}

impl EventForm {
    /// The event page, to go back to (the list when the form names no event).
    fn back(&self) -> (String, String) {
        match (field(&self.endpoint), field(&self.event_id)) {
            (Some(endpoint), Some(event_id)) => {
                (event_href(endpoint, event_id), format!("Back to {event_id}"))
            }
            _ => ("/needs-review".to_owned(), "Back to the rows that need review".to_owned()),
        }
    }

    /// The event id, or the 400 page.
    fn event_id(&self, operator: &Operator) -> Result<&str, Early> {
        field(&self.event_id).ok_or_else(|| {
            Box::new(problem(
                operator.clone(),
                StatusCode::BAD_REQUEST,
                "the form names no event (event_id)".into(),
                self.back(),
            ))
        })
    }
}

/// The operator who may act on `req` with `csrf`, or the refusal (403, or 303 to sign in).
fn acting(req: &HttpRequest, auth: &Auth, csrf: &str) -> Result<Operator, Early> {
    auth.acting(req, csrf).map_err(|refused| Box::new(refused.error_response()))
}

/// `requeue --event-id` or a release, for `/actions/requeue` and `/actions/release`.
async fn requeue_action(
    req: &HttpRequest,
    console: &Console,
    auth: &Auth,
    form: &EventForm,
    take: Take,
) -> Answer {
    let operator = acting(req, auth, &form.csrf)?;
    let (action, notice) = match take {
        Take::Unprocessed => ("requeue", "Requeued"),
        Take::HeldForLivemode => ("release", "Released"),
    };
    let back = form.back();
    let event_id = form.event_id(&operator)?;
    let mut conn = connection(console, &operator, &back).await?;
    let actor = Actor::console(&operator.name);
    match requeue::requeue_one(&mut conn, event_id, field(&form.endpoint), take, actor, false).await {
        Ok(done) => {
            tracing::info!(
                actor = %operator.name, action, endpoint = %done.row.endpoint, event_id,
                released_hold = done.released_hold.as_deref(), audit_id = done.audit_id, "console action"
            );
            Ok(see_other(&event_href(&done.row.endpoint, event_id), notice))
        }
        Err(e) => Ok(failed(operator, action, &e, back)),
    }
}

async fn requeue_event(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<EventForm>,
) -> HttpResponse {
    answer(requeue_action(&req, &console, &auth, &form, Take::Unprocessed).await)
}

async fn release_event(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<EventForm>,
) -> HttpResponse {
    answer(requeue_action(&req, &console, &auth, &form, Take::HeldForLivemode).await)
}

/// `/actions/dismiss`: `dismiss`.
async fn dismiss_event(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<EventForm>,
) -> HttpResponse {
    answer(dismiss_action(&req, &console, &auth, &form).await)
}

async fn dismiss_action(req: &HttpRequest, console: &Console, auth: &Auth, form: &EventForm) -> Answer {
    let operator = acting(req, auth, &form.csrf)?;
    let back = form.back();
    let event_id = form.event_id(&operator)?;
    let mut conn = connection(console, &operator, &back).await?;
    let actor = Actor::console(&operator.name);
    match dismiss::dismiss_one(&mut conn, event_id, field(&form.endpoint), &form.reason, actor).await {
        Ok(done) => {
            tracing::info!(
                actor = %operator.name, action = "dismiss", endpoint = %done.endpoint, event_id,
                audit_id = done.audit_id, "console action"
            );
            Ok(see_other(&event_href(&done.endpoint, event_id), "Dismissed"))
        }
        Err(e) => Ok(failed(operator, "dismiss", &e, back)),
    }
}

/// `/actions/replay` and `/actions/replay-dry-run`: `replay --event-id [--dry-run]`.
async fn replay_action(
    req: &HttpRequest,
    console: &Console,
    auth: &Auth,
    form: &EventForm,
    dry_run: bool,
) -> Answer {
    let operator = acting(req, auth, &form.csrf)?;
    let action = if dry_run { "replay-dry-run" } else { "replay" };
    let back = form.back();
    let event_id = form.event_id(&operator)?;
    let mut conn = connection(console, &operator, &back).await?;
    let actor = Actor::console(&operator.name);
    let pooler = console.database.pooler;
    let report = replay::replay_one(
        &mut conn,
        &console.registry,
        pooler,
        event_id,
        field(&form.endpoint),
        actor,
        dry_run,
    )
    .await;
    let report = match report {
        Ok(report) => report,
        Err(e) => return Ok(failed(operator, action, &e, back)),
    };
    tracing::info!(
        actor = %operator.name, action, endpoint = %report.endpoint, event_id,
        audit_id = report.audit_id, "console action"
    );
    let Some(changes) = &report.would_change else {
        return Ok(see_other(&event_href(&report.endpoint, event_id), "Replayed"));
    };
    let message = if changes.is_empty() {
        "Nothing changed (rolled back). A replay would change no row, besides renewing the event's \
         processed mark."
    } else {
        "Nothing changed (rolled back). A replay would make these changes, besides renewing the \
         event's processed mark:"
    };
    let page = ActionResult {
        title: format!("Replay dry run of {event_id}"),
        message: message.to_owned(),
        problem: false,
        back: (event_href(&report.endpoint, event_id), format!("Back to {event_id}")),
        dry_run: Some(DryRun {
            endpoint: report.endpoint.clone(),
            event_id: report.event_id.clone(),
            event_type: report.event_type.clone(),
            audit_id: report.audit_id,
            changes: changes.iter().map(Change::of).collect(),
        }),
        operator,
    };
    Ok(render(&page, StatusCode::OK))
}

async fn replay_event(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<EventForm>,
) -> HttpResponse {
    answer(replay_action(&req, &console, &auth, &form, false).await)
}

async fn replay_dry_run(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<EventForm>,
) -> HttpResponse {
    answer(replay_action(&req, &console, &auth, &form, true).await)
}

// ------------------------------------------------------------------------- requeue filtered

/// The form of `/actions/requeue-filtered`: the needs-review filters, and the count confirmed.
#[derive(Debug, Deserialize)]
struct FilteredForm {
    #[serde(default)]
    csrf: String,
    #[serde(rename = "type", default)]
    event_type: String,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    held: String,
    #[serde(default)]
    error: String,
    #[serde(default)]
    older_than: String,
    #[serde(default)]
    account: String,
    /// The count the operator saw and confirmed; absent: show it first.
    #[serde(default)]
    confirm: String,
}

impl FilteredForm {
    /// The filters as the needs-review page reads them.
    fn filters(&self) -> ReviewFilterForm {
        let some = |v: &str| Some(v.to_owned());
        ReviewFilterForm {
            event_type: some(&self.event_type),
            endpoint: some(&self.endpoint),
            held: some(&self.held),
            error: some(&self.error),
            older_than: some(&self.older_than),
            account: some(&self.account),
        }
    }

    /// The filters as given (trimmed), in the form's order: (name, label, value).
    fn values(&self) -> [(&'static str, &'static str, String); 6] {
        let t = |v: &str| v.trim().to_owned();
        [
            ("type", "Type", t(&self.event_type)),
            ("endpoint", "Endpoint", t(&self.endpoint)),
            ("held", "Held", t(&self.held)),
            ("error", "Error contains", t(&self.error)),
            ("older_than", "Older than", t(&self.older_than)),
            ("account", "Account", t(&self.account)),
        ]
    }

    /// The needs-review list with these filters.
    fn back(&self) -> (String, String) {
        let query: Vec<String> = self
            .values()
            .iter()
            .filter(|(_, _, value)| !value.is_empty())
            .map(|(name, _, value)| format!("{name}={}", encode(value)))
            .collect();
        let href = if query.is_empty() {
            "/needs-review".to_owned()
        } else {
            format!("/needs-review?{}", query.join("&"))
        };
        (href, "Back to the rows that need review".to_owned())
    }
}

/// The confirmation of `requeue-filtered`.
#[derive(Template)]
#[template(path = "console/action_confirm.html")]
struct Confirm {
    operator: Operator,
    /// Parked rows the filters match that a requeue takes.
    count: i64,
    /// Rows that match but were held on arrival: left.
    held: i64,
    /// Rows one action requeues at most.
    max_rows: i64,
    /// (name, label, value) of each filter.
    filters: Vec<(&'static str, &'static str, String)>,
    back: (String, String),
}

impl Confirm {
    /// The filters that are set, for the summary.
    fn set_filters(&self) -> Vec<&(&'static str, &'static str, String)> {
        self.filters.iter().filter(|(_, _, value)| !value.is_empty()).collect()
    }
}

/// `/actions/requeue-filtered`: the count and its confirmation, then `requeue --all`'s batches.
async fn requeue_filtered(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<FilteredForm>,
) -> HttpResponse {
    answer(requeue_filtered_action(&req, &console, &auth, &form).await)
}

async fn requeue_filtered_action(
    req: &HttpRequest,
    console: &Console,
    auth: &Auth,
    form: &FilteredForm,
) -> Answer {
    let operator = acting(req, auth, &form.csrf)?;
    let back = form.back();
    let filter = match form.filters().parse() {
        Ok(filter) => filter,
        Err(invalid) => return Ok(problem(operator, StatusCode::BAD_REQUEST, invalid, back)),
    };
    let confirmed = match field(&form.confirm).map(str::parse::<i64>) {
        None => None,
        Some(Ok(n)) if n >= 0 => Some(n),
        Some(_) => {
            let message = format!("confirm: {:?} is not a count of rows", form.confirm.trim());
            return Ok(problem(operator, StatusCode::BAD_REQUEST, message, back));
        }
    };
    let pattern = filter.error_contains.as_deref().map(like_literal);
    let parked = filter.parked(pattern.as_deref());
    let mut conn = connection(console, &operator, &back).await?;
    let count = match requeue::count_matching(&**conn, &parked).await {
        Ok(count) => count,
        Err(e) => return Ok(failed(operator, "requeue", &e, back)),
    };
    let Some(confirmed) = confirmed else {
        let page = Confirm {
            operator,
            count: count.takes,
            held: count.held,
            max_rows: MAX_ROWS,
            filters: form.values().to_vec(),
            back,
        };
        return Ok(render(&page, StatusCode::OK));
    };

    // What the operator confirmed, never more (rows parked since wait for the next requeue), and
    // at most MAX_ROWS.
    let takes = count.takes.min(confirmed).min(MAX_ROWS);
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "all": true,
        "event_type": filter.event_type,
        "error_contains": filter.error_contains,
        "endpoint": filter.endpoint,
        "held": filter.held.map(|h| h.as_str()),
        "older_than_seconds": filter.older_than_seconds,
        "account": filter.account,
        "matched": count.takes,
        "confirmed": confirmed,
        "limit": MAX_ROWS,
        "batch_size": BATCH_SIZE,
    });
    let matching = Matching { count, takes, batch_size: BATCH_SIZE };
    let actor = Actor::console(&operator.name);
    let done = match requeue::requeue_matching(&mut conn, &parked, &matching, &target, actor, None).await {
        Ok(done) => done,
        Err(e) => return Ok(failed(operator, "requeue", &e, back)),
    };
    tracing::info!(
        actor = %operator.name, action = "requeue-filtered", matched = count.takes, confirmed,
        requeued = done.requeued, batches = done.batches, audit_id = done.audit_id, "console action"
    );
    let mut notice = format!("Requeued {} row{}", done.requeued, if done.requeued == 1 { "" } else { "s" });
    if confirmed > MAX_ROWS && count.takes > MAX_ROWS {
        notice.push_str(&format!(" (at most {MAX_ROWS} at once: requeue again for the others)"));
    }
    let left = takes - done.requeued as i64;
    if left > 0 {
        notice.push_str(&format!(
            "; {left} of the {takes} counted {} no longer parked, or locked by another session",
            if left == 1 { "was" } else { "were" }
        ));
    }
    Ok(see_other("/needs-review", &notice))
}

// ----------------------------------------------------------------------------------- resolve

/// The form of `/actions/resolve`.
#[derive(Debug, Deserialize)]
struct ResolveForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    id: String,
    #[serde(default)]
    note: String,
}

/// `/actions/resolve`: `reconciliation resolve`.
async fn resolve_item(
    req: HttpRequest,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
    form: web::Form<ResolveForm>,
) -> HttpResponse {
    answer(resolve_action(&req, &console, &auth, &form).await)
}

async fn resolve_action(req: &HttpRequest, console: &Console, auth: &Auth, form: &ResolveForm) -> Answer {
    let operator = acting(req, auth, &form.csrf)?;
    let back = ("/reconciliation".to_owned(), "Back to the reconciliation items".to_owned());
    let Ok(id) = form.id.trim().parse::<i64>() else {
        let message = format!("id: {:?} is not a reconciliation item's id", form.id.trim());
        return Ok(problem(operator, StatusCode::BAD_REQUEST, message, back));
    };
    let mut conn = connection(console, &operator, &back).await?;
    let actor = Actor::console(&operator.name);
    match reconciliation::resolve(&mut conn, id, &form.note, actor).await {
        Ok(done) => {
            tracing::info!(
                actor = %operator.name, action = "resolve-reconciliation", id, audit_id = done.audit_id,
                "console action"
            );
            Ok(see_other("/reconciliation", &format!("Resolved item {id} ({})", done.item.reason)))
        }
        Err(e) => Ok(failed(operator, "resolve", &e, back)),
    }
}
