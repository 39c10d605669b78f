//! The operator commands, one module each: `migrate`, `stats`, `needs-review`, `requeue`,
//! `replay`, `dismiss`, `purge`, `reindex`, `verify`, `reconcile`, `reconciliation`. Each holds its flags (`Args`) and a `run` that reads or changes rows through
//! the store (`inbox_domain::inbox::store::admin`) and presents the result with [`output`]: a table
//! on stdout, or one JSON document with `--json`. A refusal is an error saying why (the binary
//! prints `<name>: error: …` and exits 1).
//!
//! Every change an operator makes (requeue, replay, dismiss, purge, reconciliation resolve) is recorded in `operator_audit`, in
//! the same transaction as the change, so the audit and the change commit together or not at all:
//! one record for a change of one event; for a command that works in batches (`requeue --all`,
//! `purge`) a record when it starts, then one per batch (see `admin::INSERT_AUDIT_SQL`).
//! `--dry-run` changes nothing and writes no audit.
//!
//! The commands that change rows do it in library functions that return what they did —
//! `requeue::requeue_one`, `requeue::count_matching` and `requeue::requeue_matching`,
//! `replay::replay_one`, `dismiss::dismiss_one`, `reconciliation::resolve` — which `run` presents
//! and the web console's actions (`crate::console::actions`) call too, with the signed-in operator
//! as the [`Actor`]. A refusal is a [`Refused`] error, which the console shows as an answer.

pub mod dismiss;
pub mod migrate;
pub mod needs_review;
mod outbox;
pub mod output;
pub mod purge;
pub mod reconcile;
pub mod reconciliation;
pub mod reindex;
pub mod replay;
pub mod requeue;
pub mod stats;
pub mod verify;

use std::time::Duration;

use clap::Args;
use deadpool_postgres::Object;
use inbox_domain::db::{build_pool, describe_pool_error, DatabaseConfig, PoolOptions, Pooler};
use inbox_domain::handler::Registry;
use inbox_domain::inbox::schema::{self, SchemaState};
use inbox_domain::inbox::store::admin::{self, EventRow};
use inbox_domain::inbox::store::TransactionLimits;

use crate::cli::Command;

/// The `application_name` of an operator command's connection.
pub const APPLICATION_NAME: &str = "inbox-worker-ops";

/// How long an operator command waits to connect when `DATABASE_URL` sets no `connect_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Bounds of an operator transaction. A worker holds a row lock for at most its statement
/// timeout while processing; an operator command fails rather than hang behind something stuck
/// (lock_timeout), and replay runs handlers (statement_timeout).
pub const LIMITS: TransactionLimits = TransactionLimits {
    statement_timeout: Duration::from_secs(60),
    lock_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(60),
};

/// The one stored event a command works on (`replay`, `verify`).
#[derive(Debug, Args, Clone)]
pub struct EventArgs {
    /// The event's id (`evt_…`).
    #[arg(long)]
    pub event_id: String,
    /// Its endpoint (needed when the id is stored for several endpoints).
    #[arg(long)]
    pub endpoint: Option<String>,
}

/// A command's refusal: what it will not do, and why; nothing changed. The CLI prints it as any
/// error (`<name>: error: …`, exit 1); the console shows it to the operator as an answer (409),
/// not as a failure. Database and connection errors are not refusals.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Returns a [`Refused`] error with the formatted message (as `anyhow::bail!` does a plain one).
macro_rules! refuse {
    ($($arg:tt)*) => {
        return Err(anyhow::Error::from($crate::ops::Refused(format!($($arg)*))))
    };
}
pub(crate) use refuse;

/// Who acts, as `operator_audit` records it: the name (`actor`), and where the change came from
/// when not from the command line — `via` in the record's target (`"console"`).
#[derive(Debug, Clone, Copy)]
pub struct Actor<'a> {
    pub name: &'a str,
    pub via: Option<&'static str>,
}

impl<'a> Actor<'a> {
    /// An operator at the command line (the records say nothing more).
    pub fn cli(name: &'a str) -> Self {
        Actor { name, via: None }
    }

    /// An operator signed in to the web console.
    pub fn console(name: &'a str) -> Self {
        Actor { name, via: Some("console") }
    }

    /// Writes an audit record ([`admin::insert_audit`]) for this actor, `via` added to the target.
    pub async fn audit(
        &self,
        client: &(impl tokio_postgres::GenericClient + Sync),
        action: &str,
        target: &serde_json::Value,
        affected: u64,
    ) -> Result<i64, tokio_postgres::Error> {
        match (self.via, target) {
            (Some(via), serde_json::Value::Object(fields)) => {
                let mut fields = fields.clone();
                fields.insert("via".to_owned(), via.into());
                admin::insert_audit(client, self.name, action, &fields.into(), affected).await
            }
            _ => admin::insert_audit(client, self.name, action, target, affected).await,
        }
    }
}

/// Who is acting, for `operator_audit`.
#[derive(Debug, Args, Clone)]
pub struct ActorArgs {
    /// Recorded in operator_audit [default: $USER, else the operating system's name of the user
    /// running the command].
    #[arg(long, env = "USER", hide_env_values = false)]
    pub actor: Option<String>,
}

impl ActorArgs {
    /// The actor recorded (filled by [`execute`] before any command runs).
    pub fn name(&self) -> &str {
        self.actor.as_deref().unwrap_or("unknown")
    }

    /// The actor of a command-line run.
    pub fn actor(&self) -> Actor<'_> {
        Actor::cli(self.name())
    }

    /// Without --actor or $USER (a container, cron): the operating system's name of the user
    /// running the command, said on stderr so that nobody takes it for a person's name.
    fn fill(&mut self) {
        if self.actor.as_deref().is_some_and(|a| !a.trim().is_empty()) {
            return;
        }
        let name = os_user_name();
        eprintln!(
            "note: no --actor and no $USER: operator_audit records the operating system's user, {name}; \
             pass --actor NAME to record who you are"
        );
        self.actor = Some(name);
    }
}

/// The name of the user this process runs as, from `/etc/passwd` by the uid of `/proc/self`
/// (`uid:N` when it has no entry, as in many containers).
fn os_user_name() -> String {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return "unknown".to_owned() };
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| {
            passwd.lines().find_map(|line| {
                let mut fields = line.split(':');
                let name = fields.next()?;
                let entry_uid: u32 = fields.nth(1)?.parse().ok()?;
                (entry_uid == uid).then(|| name.to_owned())
            })
        })
        .unwrap_or_else(|| format!("uid:{uid}"))
}

/// Runs an operator command over one connection. `registry` is the binary's: `replay` runs its
/// handlers and `migrate` applies its migrations.
pub async fn execute(command: Command, database: DatabaseConfig, registry: &Registry) -> anyhow::Result<()> {
    let pooler = database.pooler;
    if matches!(command, Command::Migrate) && pooler == Pooler::Transaction {
        anyhow::bail!(
            "migrate holds a session-level lock (so that two migrations never run at once), which a \
             transaction pooler does not keep: run it against the server or a session-mode pool, \
             with INBOX_DB_POOLER=none"
        );
    }
    if matches!(command, Command::Reindex(_)) && pooler == Pooler::Transaction {
        anyhow::bail!(
            "reindex sets its timeouts for the session and rebuilds outside any transaction, which a \
             transaction pooler does not keep to one server connection: run it against the server or \
             a session-mode pool, with INBOX_DB_POOLER=none"
        );
    }
    if matches!(command, Command::Migrate) {
        // Over a connection of its own, whose server notices it prints (see `migrate`).
        return migrate::run(database, registry).await;
    }
    let mut command = command;
    match &mut command {
        Command::Requeue(args) => args.actor.fill(),
        Command::Replay(args) => args.actor.fill(),
        Command::Dismiss(args) => args.actor.fill(),
        Command::Purge(args) => args.actor.fill(),
        Command::Reconciliation(args) => {
            if let Some(reconciliation::Action::Resolve(resolve)) = &mut args.action {
                resolve.actor.fill()
            }
        }
        Command::Reconcile(args) if !args.dry_run => args.actor.fill(),
        _ => {}
    }
    let mut conn = connect(database).await?;
    match schema::state(&conn).await {
        Ok(state @ SchemaState::Older { .. }) => anyhow::bail!("{}", state.message().unwrap_or_default()),
        Ok(state) => {
            if let Some(message) = state.message() {
                tracing::warn!("{message}");
            }
        }
        // A role that may not read the version table can still do its work: the command goes on.
        Err(e) => tracing::warn!(error = format!("{e:#}"), "could not check the schema version"),
    }
    match command {
        Command::Stats(args) => stats::run(&**conn, &args).await,
        Command::NeedsReview(args) => needs_review::run(&**conn, &args).await,
        Command::Requeue(args) => requeue::run(&mut conn, &args).await,
        Command::Replay(args) => replay::run(&mut conn, registry, pooler, &args).await,
        Command::Dismiss(args) => dismiss::run(&mut conn, &args).await,
        Command::Purge(args) => purge::run(&mut conn, &args).await,
        Command::Reindex(args) => reindex::run(&conn, &args).await,
        Command::Verify(args) => verify::run(&**conn, &args).await,
        Command::Reconciliation(args) => reconciliation::run(&mut conn, &args).await,
        Command::Reconcile(args) => reconcile::run(&mut conn, registry, &args).await,
        Command::Migrate => unreachable!("`migrate` opens its own connection, above"),
        Command::Run(_) | Command::Relay(_) | Command::Fetch(_) | Command::Console(_) => {
            unreachable!("`run`, `relay`, `fetch` and `console` are not operator commands")
        }
    }
}

/// One pooled connection (handlers take a pooled transaction, and the pool is where connection
/// settings are applied for every binary).
async fn connect(database: DatabaseConfig) -> anyhow::Result<Object> {
    let pool = build_pool(
        &database,
        &PoolOptions {
            max_size: 1,
            timeout: CONNECT_TIMEOUT,
            application_name: APPLICATION_NAME,
            session_statement_timeout: None,
            session_write_back: false,
            verify_on_checkout: true,
        },
    )?;
    pool.get().await.map_err(|e| database.unreachable(describe_pool_error(&e)))
}

/// Maps a database error to a message naming what we were doing and the server's reason.
fn db_error(doing: &'static str) -> impl FnOnce(tokio_postgres::Error) -> anyhow::Error {
    move |e| inbox_domain::db::db_error(doing, &e)
}

/// Locks the rows of `event_id` (of `endpoint`, when given) and returns the one it designates,
/// or refuses: no such event, or the id is stored for several endpoints and none was named.
async fn lock_one_event(
    tx: &(impl tokio_postgres::GenericClient + Sync),
    event_id: &str,
    endpoint: Option<&str>,
) -> anyhow::Result<EventRow> {
    let mut rows =
        admin::lock_event(tx, event_id, endpoint).await.map_err(db_error("looking up the event"))?;
    match rows.len() {
        0 => match endpoint {
            Some(endpoint) => refuse!("no event {event_id} for endpoint {endpoint} in the inbox"),
            None => refuse!("no event {event_id} in the inbox"),
        },
        1 => Ok(rows.remove(0)),
        _ => {
            let endpoints: Vec<&str> = rows.iter().map(|r| r.endpoint.as_str()).collect();
            refuse!(
                "event {event_id} is stored for several endpoints ({}): pass --endpoint to choose one",
                endpoints.join(", ")
            )
        }
    }
}
