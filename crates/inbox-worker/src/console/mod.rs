//! `inbox-worker console`: the operators' web page — the queue's overview, the needs-review list,
//! one event's detail, the outbox, the reconciliation items and the audit log — and the actions of
//! the operator commands (requeue, release, replay, dismiss, resolve), run through the same library
//! code as the CLI and recorded in `operator_audit` with the signed-in operator as actor.
//!
//! Server-side HTML (askama templates, checked at compile time, escaping every value), forms that
//! work without JavaScript, one vendored stylesheet, nothing loaded from another site. Nothing but
//! `/healthz`, the sign-in form and the stylesheet is served without a session ([`auth`] says how
//! users, sessions, CSRF tokens and sign-in limits work). Every answer carries security headers
//! (a CSP without inline script, `frame-ancestors 'none'`, `nosniff`, no caching).
//!
//! * [`pages`]: what operators read;
//! * [`actions`]: what they change (POST only, each behind its CSRF token and the read-only flag).

pub mod actions;
pub mod auth;
pub mod pages;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header;
use actix_web::middleware::DefaultHeaders;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use askama::Template;
use clap::{Args, Subcommand};
use deadpool_postgres::Pool;
use inbox_domain::config::parse_duration;
use inbox_domain::db::{build_pool, DatabaseConfig, PoolOptions};
use inbox_domain::handler::Registry;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use self::auth::{Auth, LoginLimiter, SessionKey, Users};

/// The `application_name` of the console's connections.
pub const APPLICATION_NAME: &str = "inbox-worker-console";

/// The stylesheet, vendored: the CSP allows styles from this origin only.
const STYLESHEET: &str = include_str!("../../templates/console/console.css");

/// The Content-Security-Policy of every answer: nothing inline, nothing from elsewhere, never framed.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                       frame-ancestors 'none'; base-uri 'none'";

/// Flags of `console`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ConsoleArgs {
    #[command(subcommand)]
    pub action: Option<ConsoleAction>,

    /// Where to serve the console.
    #[arg(long, env = "INBOX_CONSOLE_LISTEN", default_value = "127.0.0.1:9000")]
    pub listen: SocketAddr,

    /// The users: one `name:argon2id-hash` per line, `:read-only` after the hash for a user who
    /// may look but not act (`console hash-password` prints a line).
    #[arg(long, env = "INBOX_CONSOLE_USERS_FILE", value_name = "PATH")]
    pub users_file: Option<PathBuf>,

    /// At least 32 random bytes that sign the session cookies; the same file for every replica.
    /// Without it, a random key per process: a restart signs everyone out.
    #[arg(long, env = "INBOX_CONSOLE_SESSION_KEY_FILE", value_name = "PATH")]
    pub session_key_file: Option<PathBuf>,

    /// How long a sign-in lasts.
    #[arg(long, env = "INBOX_CONSOLE_SESSION_TTL", default_value = "8h", value_parser = parse_duration)]
    pub session_ttl: Duration,

    /// The URL operators open (behind a TLS proxy: its https:// URL). Cookies are Secure when it is
    /// https, and a form is taken only from its origin [default: http://LISTEN].
    #[arg(long, env = "INBOX_CONSOLE_PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<String>,
}

/// `console hash-password`.
#[derive(Debug, Subcommand)]
pub enum ConsoleAction {
    /// Read a password on stdin and print the users-file line for it (`name:argon2id-hash`).
    HashPassword(HashPasswordArgs),
}

#[derive(Debug, Args)]
pub struct HashPasswordArgs {
    /// The user's name.
    #[arg(long)]
    pub user: String,
    /// A user who may look but not act.
    #[arg(long)]
    pub read_only: bool,
}

/// Prints the users-file line of `args.user` with the password read from stdin (one line).
pub fn hash_password(args: &HashPasswordArgs) -> anyhow::Result<()> {
    let user = args.user.trim();
    anyhow::ensure!(
        !user.is_empty() && user.chars().all(|c| c.is_ascii_alphanumeric() || "._-@".contains(c)),
        "--user: letters, digits and . _ - @"
    );
    let mut password = String::new();
    std::io::stdin().read_line(&mut password).map_err(|e| anyhow::anyhow!("reading the password: {e}"))?;
    let password = password.trim_end_matches(['\r', '\n']);
    anyhow::ensure!(password.chars().count() >= 12, "the password must have at least 12 characters");
    let hash = auth::hash_password(password)?;
    println!("{user}:{hash}{}", if args.read_only { ":read-only" } else { "" });
    Ok(())
}

/// What every handler shares.
pub struct Console {
    pub pool: Pool,
    /// The binary's handlers: `replay` from the console runs them, as the CLI's does.
    pub registry: Arc<Registry>,
    pub database: DatabaseConfig,
}

/// A console ready to serve: its listener is bound (tests read its port).
pub struct Application {
    listener: TcpListener,
    console: web::Data<Console>,
    auth: web::Data<Auth>,
}

impl Application {
    /// Checks the flags, reads the users and the session key, binds the listener.
    pub fn build(
        args: &ConsoleArgs,
        database: DatabaseConfig,
        registry: Registry,
    ) -> anyhow::Result<Application> {
        let users_file = args.users_file.as_deref().ok_or_else(|| {
            anyhow::anyhow!(
                "no users: set INBOX_CONSOLE_USERS_FILE to a file of name:argon2-hash lines \
                 (`inbox-worker console hash-password --user NAME` prints one)"
            )
        })?;
        let users = Users::load(users_file)?;
        let key = SessionKey::load(args.session_key_file.as_deref())?;
        if args.session_key_file.is_none() {
            tracing::warn!(
                "no INBOX_CONSOLE_SESSION_KEY_FILE: sessions are signed with a random key of this process \
                 (a restart signs everyone out; replicas do not share sessions)"
            );
        }
        let listener = TcpListener::bind(args.listen)
            .map_err(|e| anyhow::anyhow!("listening on {}: {e}", args.listen))?;
        let bound = listener.local_addr()?;
        let public = args.public_url.clone().unwrap_or_else(|| format!("http://{bound}"));
        let url = reqwest::Url::parse(public.trim())
            .map_err(|e| anyhow::anyhow!("--public-url / INBOX_CONSOLE_PUBLIC_URL is not a URL: {e}"))?;
        anyhow::ensure!(
            matches!(url.scheme(), "http" | "https") && url.host_str().is_some(),
            "--public-url / INBOX_CONSOLE_PUBLIC_URL must be an http:// or https:// URL"
        );
        let origin = url.origin().ascii_serialization();
        let pool = build_pool(
            &database,
            &PoolOptions {
                max_size: 4,
                timeout: Duration::from_secs(10),
                application_name: APPLICATION_NAME,
                session_statement_timeout: None,
                session_write_back: false,
                verify_on_checkout: true,
            },
        )?;
        Ok(Application {
            listener,
            console: web::Data::new(Console { pool, registry: Arc::new(registry), database }),
            auth: web::Data::new(Auth {
                users,
                key,
                ttl: args.session_ttl,
                secure: url.scheme() == "https",
                origin,
                limiter: LoginLimiter::default(),
            }),
        })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or_default()
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let address = self.listener.local_addr()?;
        let (console, auth) = (self.console, self.auth);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(console.clone())
                .app_data(auth.clone())
                .app_data(web::FormConfig::default().limit(64 * 1024))
                .wrap(
                    DefaultHeaders::new()
                        .add((header::CONTENT_SECURITY_POLICY, CSP))
                        .add((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
                        .add((header::X_FRAME_OPTIONS, "DENY"))
                        .add((header::REFERRER_POLICY, "same-origin"))
                        .add((header::CACHE_CONTROL, "no-store")),
                )
                .route(
                    "/healthz",
                    web::get().to(|| async { HttpResponse::Ok().json(serde_json::json!({"status": "ok"})) }),
                )
                .route("/static/console.css", web::get().to(stylesheet))
                .route("/login", web::get().to(login_form))
                .route("/login", web::post().to(login))
                .route("/logout", web::post().to(logout))
                .configure(pages::configure)
                .configure(actions::configure)
        })
        .workers(2)
        .disable_signals()
        .listen(self.listener)?
        .run();
        tracing::info!(listen = %address, "inbox-worker console serving");
        let handle = server.handle();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            handle.stop(true).await;
        });
        server.await?;
        Ok(())
    }
}

/// `console`: serves until SIGTERM/SIGINT.
pub async fn run(args: ConsoleArgs, database: DatabaseConfig, registry: Registry) -> anyhow::Result<()> {
    if let Some(ConsoleAction::HashPassword(hash)) = &args.action {
        return hash_password(hash);
    }
    let app = Application::build(&args, database, registry)?;
    app.run(crate::runner::os_signals()).await
}

async fn stylesheet() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/css; charset=utf-8")
        .insert_header((header::CACHE_CONTROL, "max-age=3600"))
        .body(STYLESHEET)
}

/// The sign-in form.
#[derive(Template)]
#[template(path = "console/login.html")]
pub struct LoginPage {
    pub error: Option<String>,
    /// The form's CSRF token, bound to the sign-in cookie set with the form.
    pub csrf: String,
}

/// The sign-in form with `error` and `status`, and a fresh sign-in token (its cookie and the form's
/// field): the form carries a CSRF token like every other, so a page of another site cannot sign a
/// browser in to someone else's account.
fn login_page(auth: &Auth, error: Option<String>, status: actix_web::http::StatusCode) -> HttpResponse {
    let (cookie, csrf) = auth.login_token();
    let mut response = render(&LoginPage { error, csrf }, status);
    let _ = response.add_cookie(&cookie);
    response
}

async fn login_form(req: HttpRequest, auth: web::Data<Auth>) -> HttpResponse {
    if auth.operator(&req).is_some() {
        return HttpResponse::SeeOther().insert_header((header::LOCATION, "/")).finish();
    }
    login_page(&auth, None, actix_web::http::StatusCode::OK)
}

#[derive(Deserialize)]
struct Credentials {
    user: String,
    password: String,
    #[serde(default)]
    csrf: String,
}

/// Sign-in: the form's token first, then limited per user and per address; the same answer for an
/// unknown user and a wrong password.
async fn login(req: HttpRequest, auth: web::Data<Auth>, form: web::Form<Credentials>) -> HttpResponse {
    if let Err(refused) = auth.same_site(&req) {
        return actix_web::ResponseError::error_response(&refused);
    }
    if !auth.login_csrf_ok(&req, &form.csrf) {
        return login_page(
            &auth,
            Some("The sign-in form expired or came from elsewhere: sign in again here.".into()),
            actix_web::http::StatusCode::FORBIDDEN,
        );
    }
    let address = req.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
    let keys = vec![format!("user:{}", form.user.trim()), format!("addr:{address}")];
    if !auth.limiter.allowed(&keys) {
        tracing::warn!(user = %form.user.trim(), address, "console sign-in refused: too many failures");
        return login_page(
            &auth,
            Some("Too many failed sign-ins: wait 15 minutes.".into()),
            actix_web::http::StatusCode::TOO_MANY_REQUESTS,
        );
    }
    match auth.users.verify(form.user.trim(), &form.password).await {
        Some(user) => {
            auth.limiter.succeeded(&keys);
            tracing::info!(user = %user.name, read_only = user.read_only, address, "console sign-in");
            HttpResponse::SeeOther()
                .insert_header((header::LOCATION, "/"))
                .cookie(auth.session_cookie(&user))
                .cookie(auth.login_token_spent())
                .finish()
        }
        None => {
            auth.limiter.failed(&keys);
            tracing::warn!(user = %form.user.trim(), address, "console sign-in failed");
            login_page(
                &auth,
                Some("Unknown user or wrong password.".into()),
                actix_web::http::StatusCode::UNAUTHORIZED,
            )
        }
    }
}

#[derive(Deserialize)]
struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

async fn logout(req: HttpRequest, auth: web::Data<Auth>, form: web::Form<CsrfOnly>) -> HttpResponse {
    if let Err(refused) = auth.same_site(&req) {
        return actix_web::ResponseError::error_response(&refused);
    }
    if let Some(operator) = auth.operator(&req) {
        if !operator.csrf_ok(&auth.key, &form.csrf) {
            return actix_web::ResponseError::error_response(&auth::AuthError::Forbidden(
                "the form's CSRF token is missing or not this session's".into(),
            ));
        }
    }
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, "/login"))
        .cookie(auth.signed_out_cookie())
        .finish()
}

/// `template` as an HTML answer with `status`.
pub fn render(template: &impl Template, status: actix_web::http::StatusCode) -> HttpResponse {
    match template.render() {
        Ok(html) => HttpResponse::build(status).content_type("text/html; charset=utf-8").body(html),
        Err(e) => {
            tracing::error!(error = %e, "rendering a console page failed");
            HttpResponse::InternalServerError().content_type("text/plain").body("rendering failed\n")
        }
    }
}
