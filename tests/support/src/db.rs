//! A database per test, cloned from a template migrated once per migration set.
//!
//! The template's name carries a digest of the migrations compiled in, so editing one builds a new one.
//! Test databases are named `inbox_test_<pid>_<n>`: they are dropped when the [`TestDb`] is
//! dropped, and those of processes that no longer run (a crashed or killed test run) are dropped
//! the next time any test starts.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use tokio_postgres::{Client, Config, NoTls};

const TEST_DB_PREFIX: &str = "inbox_test_";
const TEMPLATE_PREFIX: &str = "inbox_tmpl_";
/// Serialises template creation and leftover cleanup across test processes.
const TEMPLATE_LOCK_KEY: i64 = 0x5354_5249_5045_5431;

static NEXT_DB: AtomicUsize = AtomicUsize::new(0);
static TEMPLATE: OnceLock<String> = OnceLock::new();

/// The server's `DATABASE_URL`, used to create and drop test databases.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .expect("DATABASE_URL is not set: run the tests with `make test`, which starts PostgreSQL")
}

/// `url` with its database replaced by `db`, everything else (user, password, host, options)
/// kept; URL or key=value form. For the `DATABASE_URL` of a binary started on another database of
/// the same server.
pub fn url_with_dbname(url: &str, db: &str) -> String {
    if let Some(scheme_end) = url.find("://").filter(|_| url.starts_with("postgres")) {
        let (base, query) = match url.find('?') {
            Some(q) => (&url[..q], &url[q..]),
            None => (url, ""),
        };
        let authority_end =
            base[scheme_end + 3..].find('/').map(|i| scheme_end + 3 + i).unwrap_or(base.len());
        format!("{}/{db}{query}", &base[..authority_end])
    } else {
        format!("{url} dbname={db}")
    }
}

pub fn admin_config() -> Config {
    admin_url().parse().expect("DATABASE_URL is not a valid connection string")
}

/// Connects with `config` and drives the connection on the current runtime.
pub async fn connect(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("connecting to PostgreSQL");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Connects with `config` and drives the connection, handing over what the server sends outside
/// any query's reply — notices, NOTIFYs — in order.
pub async fn connect_with_messages(
    config: &Config,
) -> (Client, tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::AsyncMessage>) {
    let (client, mut connection) = config.connect(NoTls).await.expect("connecting to PostgreSQL");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            let _ = tx.send(message);
        }
    });
    (client, rx)
}

/// One `SELECT count(*) …` (or any single bigint) query, on a client or inside a transaction.
pub async fn scalar(client: &(impl tokio_postgres::GenericClient + Sync), sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Inbox rows not yet processed (waiting, leased or parked).
pub async fn unprocessed(client: &Client) -> i64 {
    scalar(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await
}

/// The first column of every row of `sql`, on a client or inside a transaction (an `EXPLAIN`'s
/// lines, a list of ids).
pub async fn column<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    client: &(impl tokio_postgres::GenericClient + Sync),
    sql: &str,
) -> Vec<T> {
    client.query(sql, &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// A session holding a `REPEATABLE READ` snapshot taken by a read of `table`, as a report left
/// open does: while it is open no row version that dies can be removed. Commit it to let go.
pub async fn hold_snapshot(db: &TestDb, table: &str) -> Client {
    let reporting = db.client().await;
    reporting
        .batch_execute(&format!("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM {table};"))
        .await
        .unwrap();
    reporting
}

/// Runs `statements` in turn for each batch of 64 of the numbers 1..=`n`, with the batch's first
/// and last as `$1` and `$2`, each statement committed on its own: rows written, claimed and
/// finished a batch at a time, as the ingest, a claim and a mark (or a relay's) do — each leaving its
/// dead versions and index entries, which a held snapshot keeps.
pub async fn in_batches_of_64(client: &Client, n: i32, statements: &[&str]) {
    for first in (1..=n).step_by(64) {
        let last = (first + 63).min(n);
        for statement in statements {
            client.execute(*statement, &[&first, &last]).await.unwrap();
        }
    }
}

/// Buffers read so far from `table` — its heap and its indexes, hits and reads — by every session,
/// this one's included: its pending statistics are reported first (PostgreSQL reports a session's
/// at most once a second otherwise). The difference between two readings is what the statements
/// run between them read, when nothing else touches the table.
pub async fn buffers_read(client: &Client, table: &str) -> i64 {
    client.batch_execute("SELECT pg_stat_force_next_flush()").await.unwrap();
    scalar(
        client,
        &format!(
            "SELECT (heap_blks_hit + heap_blks_read + coalesce(idx_blks_hit + idx_blks_read, 0))::int8
               FROM pg_statio_user_tables WHERE relname = '{table}'"
        ),
    )
    .await
}

/// `at` as a quoted `timestamptz` literal, as the server prints it (microseconds kept), for a
/// statement written out in full (`EXPLAIN … EXECUTE`).
pub async fn timestamptz_literal(client: &Client, at: std::time::SystemTime) -> String {
    let text: String = client.query_one("SELECT $1::timestamptz::text", &[&at]).await.unwrap().get(0);
    format!("'{text}'")
}

/// The two plans a claim runs with (`queue::run_claim`), as session settings for a test that
/// prepares the claim itself: its generic plan under `CLAIM_GENERIC_PLANNER_SQL`, as a worker or
/// relay runs it directly, and a plan for its arguments under `CLAIM_PLANNER_SQL`, as behind a
/// transaction pooler (where it is sent unnamed).
pub fn claim_planners() -> [String; 2] {
    use inbox_domain::inbox::store::queue::{CLAIM_GENERIC_PLANNER_SQL, CLAIM_PLANNER_SQL};
    [
        CLAIM_GENERIC_PLANNER_SQL.replace("SET LOCAL", "SET"),
        format!("SET plan_cache_mode = force_custom_plan; {}", CLAIM_PLANNER_SQL.replace("SET LOCAL", "SET")),
    ]
}

/// Sets `planner` (one of [`claim_planners`]) on the session, left set, and prepares the claim
/// `sql` as `name` with the parameter types `types`.
pub async fn prepare_claim(client: &Client, planner: &str, name: &str, types: &str, sql: &str) {
    client.batch_execute(planner).await.unwrap();
    client.batch_execute(&format!("PREPARE {name}({types}) AS {sql}")).await.unwrap();
}

/// [`prepare_claim`] under the generic plan's settings, then one run with `args` in a transaction
/// rolled back: the generic plan is made then, on the tables as they are, and cached.
pub async fn prepare_generic_claim(client: &Client, name: &str, types: &str, sql: &str, args: &str) {
    let [generic, _] = claim_planners();
    prepare_claim(client, &generic, name, types, sql).await;
    client.batch_execute(&format!("BEGIN; EXECUTE {name}{args}; ROLLBACK")).await.unwrap();
}

/// The lines of `plan` (EXPLAIN's text) that scan a relation whose name starts with `on` (e.g.
/// `" on outbox"`) by an access none of `allowed` names: what a plan reads beyond the paths
/// written for it.
pub fn other_scans<'p>(plan: &'p str, on: &str, allowed: &[&str]) -> Vec<&'p str> {
    plan.lines()
        .filter(|l| l.contains("Scan") && l.contains(on))
        .filter(|l| !allowed.iter().any(|a| l.contains(a)))
        .collect()
}

/// `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)` of `statement` in a transaction that is then rolled
/// back, with the first column of `read_back`'s rows read in it before the rollback: what a claim
/// would take and how it would read the tables, leaving them as they were.
pub async fn explain_rolled_back(
    client: &mut Client,
    statement: &str,
    read_back: &str,
) -> (String, Vec<String>) {
    let tx = client.transaction().await.unwrap();
    let plan: Vec<String> = column(&tx, &format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {statement}")).await;
    let rows = column(&tx, read_back).await;
    tx.rollback().await.unwrap();
    (plan.join("\n"), rows)
}

/// A fault injected for real: every row written to `table` sleeps `seconds` in a trigger named
/// `slow`, fired `when` (`BEFORE INSERT`, `AFTER INSERT`, `BEFORE UPDATE`, …). `DROP TRIGGER slow ON
/// <table>` lifts it.
pub async fn slow_writes(client: &Client, table: &str, when: &str, seconds: f64) {
    client
        .batch_execute(&format!(
            "CREATE FUNCTION slow_{table}() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep({seconds}); RETURN NEW; END $$;
             CREATE TRIGGER slow {when} ON {table} FOR EACH ROW EXECUTE FUNCTION slow_{table}();"
        ))
        .await
        .unwrap();
}

fn template_name() -> String {
    // The migrations compiled in, not the files on disk: a test binary built before a migration
    // was edited must not create (or use) a template under the new files' name.
    format!("{TEMPLATE_PREFIX}{:016x}", inbox_domain::inbox::schema::embedded_digest())
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

async fn ensure_template(admin: &Client) -> String {
    let name = template_name();
    admin.execute("SELECT pg_advisory_lock($1)", &[&TEMPLATE_LOCK_KEY]).await.unwrap();
    let databases: Vec<String> =
        column(admin, "SELECT datname FROM pg_database WHERE datname LIKE 'inbox\\_%'").await;
    for db in &databases {
        let stale_template = db.starts_with(TEMPLATE_PREFIX) && *db != name;
        let dead_test = db
            .strip_prefix(TEST_DB_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !pid_alive(pid));
        if stale_template || dead_test {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)")).await;
        }
    }
    if !databases.contains(&name) {
        let wip = format!("{name}_wip");
        admin.batch_execute(&format!("CREATE DATABASE \"{wip}\"")).await.unwrap();
        let mut config = admin_config();
        config.dbname(&wip);
        let (mut client, connection) = config.connect(NoTls).await.unwrap();
        let conn = tokio::spawn(connection);
        inbox_domain::inbox::schema::migrate(&mut client, None).await.expect("migrating the template");
        drop(client);
        let _ = conn.await;
        admin.batch_execute(&format!("ALTER DATABASE \"{wip}\" RENAME TO \"{name}\"")).await.unwrap();
    }
    admin.execute("SELECT pg_advisory_unlock($1)", &[&TEMPLATE_LOCK_KEY]).await.unwrap();
    name
}

/// A database of its own for one test, dropped at the end.
pub struct TestDb {
    pub name: String,
    config: Config,
}

impl TestDb {
    /// A migrated database (cloned from the template).
    pub async fn new() -> TestDb {
        Self::create(true).await
    }

    /// An empty database: no schema at all.
    pub async fn empty() -> TestDb {
        Self::create(false).await
    }

    async fn create(migrated: bool) -> TestDb {
        let admin = connect(&admin_config()).await;
        let template = match TEMPLATE.get() {
            Some(t) => t.clone(),
            None => {
                let t = ensure_template(&admin).await;
                let _ = TEMPLATE.set(t.clone());
                t
            }
        };
        let name =
            format!("{TEST_DB_PREFIX}{}_{}", std::process::id(), NEXT_DB.fetch_add(1, Ordering::SeqCst));
        let sql = if migrated {
            format!("CREATE DATABASE \"{name}\" TEMPLATE \"{template}\"")
        } else {
            format!("CREATE DATABASE \"{name}\"")
        };
        admin.batch_execute(&sql).await.expect("creating the test database");
        let mut config = admin_config();
        config.dbname(&name);
        TestDb { name, config }
    }

    /// Connection settings of this database.
    pub fn config(&self) -> Config {
        self.config.clone()
    }

    /// Connection settings of this database through another port of 127.0.0.1 (a proxy).
    pub fn config_via_port(&self, port: u16) -> Config {
        let mut config = Config::new();
        config.host("127.0.0.1").port(port).dbname(&self.name);
        if let Some(user) = self.config.get_user() {
            config.user(user);
        }
        config
    }

    /// This database's URL (for the binaries' `DATABASE_URL`): the server's, with this database.
    pub fn url(&self) -> String {
        url_with_dbname(&admin_url(), &self.name)
    }

    /// This database's URL for `role` instead of the server's user (the local cluster trusts
    /// 127.0.0.1: no password).
    pub fn url_as(&self, role: &str) -> String {
        let url = self.url();
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let host = rest.split_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{role}@{host}")
    }

    /// A new connection to this database.
    pub async fn client(&self) -> Client {
        connect(&self.config).await
    }

    /// `SELECT count(*)` of a table.
    pub async fn count(&self, table: &str) -> i64 {
        self.client().await.query_one(&format!("SELECT count(*) FROM {table}"), &[]).await.unwrap().get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any async context we can rely on: use a thread with its own runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok((client, connection)) = admin_config().connect(NoTls).await {
                    tokio::spawn(connection);
                    let _ = client
                        .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// Every inbox row as text, to compare before and after an operation that must change nothing.
pub async fn snapshot(client: &Client) -> Vec<String> {
    column(client, "SELECT w::text FROM webhook_inbox AS w ORDER BY endpoint, event_id").await
}

/// The audit records, oldest first: (actor, action, target, affected).
pub async fn audit(client: &Client) -> Vec<(String, String, serde_json::Value, i32)> {
    client
        .query("SELECT actor, action, target, affected FROM operator_audit ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}
