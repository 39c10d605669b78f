//! The operator console (`inbox-worker console`) as a process, for its browser tests and the
//! bench: a users file, the console started on a free port, a session signed in over plain HTTP,
//! and rows worth looking at (a few parked rows with real errors, or ten thousand; a day of
//! processed events, an outbox, reconciliation items, an audit trail).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_postgres::Client;

use crate::process::{command, Proc};

/// The password of every user of [`UsersFile`] (at least 12 characters, as `hash-password` wants).
pub const PASSWORD: &str = "correct horse battery staple";

/// The name of the console's session cookie.
pub const SESSION_COOKIE: &str = "inbox_console";

static NEXT_FILE: AtomicUsize = AtomicUsize::new(0);

/// A users file of its own (`name:argon2id-hash[:read-only]` lines), removed when dropped.
pub struct UsersFile {
    pub path: PathBuf,
}

impl UsersFile {
    /// `users`: (name, read-only); each with [`PASSWORD`], hashed as `hash-password` hashes it.
    pub fn new(users: &[(&str, bool)]) -> UsersFile {
        let mut text = String::from("# written by inbox-test-support\n");
        for (name, read_only) in users {
            let hash = inbox_worker::console::auth::hash_password(PASSWORD).expect("hashing a password");
            text.push_str(&format!("{name}:{hash}{}\n", if *read_only { ":read-only" } else { "" }));
        }
        let path = std::env::temp_dir().join(format!(
            "inbox-console-users-{}-{}",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(&path, text).expect("writing the users file");
        UsersFile { path }
    }
}

impl Drop for UsersFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `inbox-worker console --listen 127.0.0.1:0` (the debug binary, a clean environment) on the
/// database `database_url` with `users`.
pub fn console_command(database_url: &str, users: &UsersFile) -> Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", database_url).env("INBOX_CONSOLE_USERS_FILE", &users.path).args([
        "console",
        "--listen",
        "127.0.0.1:0",
    ]);
    cmd
}

/// Starts a console command and returns it with its base URL (`http://127.0.0.1:PORT`), read from
/// its "inbox-worker console serving" log line (JSON logs).
pub fn start_console(cmd: Command) -> (Proc, String) {
    let proc = Proc::spawn(cmd);
    let line = proc.wait_for_line("inbox-worker console serving", Duration::from_secs(30));
    let log: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    let listen = log["listen"].as_str().expect("the listen field").to_owned();
    (proc, format!("http://{listen}"))
}

/// An HTTP client that does not follow redirects (a sign-in answers 303 with the cookie).
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}

/// Signs `user` in with [`PASSWORD`] and returns the `Cookie` header of the session
/// (`inbox_console=…`).
pub async fn sign_in(http: &reqwest::Client, base: &str, user: &str) -> anyhow::Result<String> {
    // The sign-in form first: its cookie and the CSRF field bound to it.
    let form = http.get(format!("{base}/login")).send().await?;
    let login_cookie = form
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|pair| pair.starts_with("inbox_console_login="))
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("the sign-in form set no inbox_console_login cookie"))?;
    let html = form.text().await?;
    let csrf = html
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .ok_or_else(|| anyhow::anyhow!("the sign-in form has no csrf field"))?
        .to_owned();
    let response = http
        .post(format!("{base}/login"))
        .header(reqwest::header::COOKIE, login_cookie)
        .form(&[("user", user), ("password", PASSWORD), ("csrf", csrf.as_str())])
        .send()
        .await?;
    anyhow::ensure!(response.status() == 303, "sign-in of {user} answered {}", response.status());
    response
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|pair| pair.starts_with(&format!("{SESSION_COOKIE}=")))
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("the sign-in of {user} set no {SESSION_COOKIE} cookie"))
}

/// Event types and the errors that parked them, as workers write them.
const PARKED: &[(&str, &str)] = &[
    ("invoice.paid", "payload: data.object.amount_paid is missing or not an integer"),
    ("invoice.paid", "database: deadlock detected (40P01)"),
    ("invoice.finalized", "payload: data.object.id is missing or not a string"),
    ("invoice.created", "database: canceling statement due to statement timeout (57014)"),
    ("invoice.paid", "handler panicked: called `Option::unwrap()` on a `None` value"),
    ("invoice.voided", "payload: data.object.customer is not a string"),
    ("invoice.marked_uncollectible", "database: could not serialize access due to concurrent update (40001)"),
];

/// `n` parked rows `evt_parked_00001`…: endpoint `billing` (every seventh on `analytics`),
/// the event types and errors of [`PARKED`] in turn, received over the last three days (the
/// oldest first), parked after 10 attempts, each an invoice payload of about 1 KB.
pub async fn seed_parked(client: &Client, n: i64) {
    let types: Vec<&str> = PARKED.iter().map(|(t, _)| *t).collect();
    let errors: Vec<&str> = PARKED.iter().map(|(_, e)| *e).collect();
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, last_error, parked_at)
             SELECT 'stripe', CASE WHEN i % 7 = 0 THEN 'analytics' ELSE 'billing' END,
                    'evt_parked_' || lpad(i::text, 5, '0'), t.type,
                    jsonb_build_object(
                        'id', 'evt_parked_' || lpad(i::text, 5, '0'), 'object', 'event', 'type', t.type,
                        'api_version', '2025-06-30.basil', 'created', 1767225600 + i, 'livemode', true,
                        'pending_webhooks', 1,
                        'request', jsonb_build_object('id', 'req_' || md5(i::text), 'idempotency_key', null),
                        'data', jsonb_build_object('object', jsonb_build_object(
                            'id', 'in_' || substr(md5('in' || i), 1, 24), 'object', 'invoice',
                            'customer', 'cus_' || substr(md5('cus' || (i % 211)), 1, 14),
                            'amount_due', 1000 + i % 9000, 'amount_paid', 1000 + i % 9000,
                            'amount_remaining', 0, 'currency', 'eur', 'status', 'paid',
                            'collection_method', 'charge_automatically', 'billing_reason', 'subscription_cycle',
                            'description', 'Subscription renewal #' || i,
                            'hosted_invoice_url', 'https://invoice.stripe.com/i/acct_1/test_' || md5(i::text),
                            'lines', jsonb_build_object('object', 'list', 'has_more', false, 'data',
                                jsonb_build_array(jsonb_build_object('id', 'il_' || md5(i::text),
                                    'amount', 1000 + i % 9000, 'description', '1 × Pro plan (at €'
                                    || (10 + i % 90) || '.00 / month)'))),
                            'status_transitions', jsonb_build_object('paid_at', 1767225600 + i)))),
                    now() - interval '3 days' + (i::float8 / $1 * interval '3 days' - interval '10 minutes'),
                    now() - interval '1 minute', 10, t.error,
                    now() - interval '3 days' + (i::float8 / $1 * interval '3 days')
               FROM generate_series(1, $1::int8) AS i,
                    LATERAL (SELECT ($2::text[])[1 + i % array_length($2, 1)] AS type,
                                    ($3::text[])[1 + i % array_length($3, 1)] AS error) AS t",
            &[&n, &types, &errors],
        )
        .await
        .expect("seeding parked rows");
}

/// What an operator sees on a day with some trouble: `processed` invoice events processed over the
/// last 6 hours (busier lately, with a burst; most within 200 ms of receipt, a few seconds late),
/// 12 parked rows with real errors, 3 rows waiting for a retry and 4 queued; an outbox with
/// delivered rows, one pending, one parked with a row held behind it; reconciliation items (a
/// payment on a voided invoice and an event Stripe failed to generate open, one resolved) and the
/// audit records of a few past operator commands.
pub async fn seed_showcase(client: &Client, processed: i64) {
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, processed_at, source, secret_position,
                                        secret_fingerprint, signature_t)
             SELECT 'stripe', CASE WHEN i % 9 = 0 THEN 'analytics' ELSE 'billing' END,
                    'evt_1Q' || upper(substr(md5('e' || i), 1, 22)), t.type,
                    jsonb_build_object('id', 'evt_1Q' || upper(substr(md5('e' || i), 1, 22)), 'object', 'event',
                        'type', t.type, 'livemode', true, 'api_version', '2025-06-30.basil',
                        'data', jsonb_build_object('object', jsonb_build_object(
                            'id', 'in_1Q' || upper(substr(md5('i' || i), 1, 22)), 'object', 'invoice',
                            'customer', 'cus_' || upper(substr(md5('c' || (i % 97)), 1, 14)),
                            'amount_paid', 500 * (1 + i % 40), 'currency', 'eur'))),
                    at.at - (20 + i % 180 + CASE WHEN i % 29 = 0 THEN 2500 ELSE 0 END) * interval '1 ms',
                    at.at, 1, at.at,
                    'webhook', 0, '9f86d081', extract(epoch FROM at.at)::bigint
               FROM generate_series(1, $1::int8) AS i,
                    LATERAL (SELECT (ARRAY['invoice.created', 'invoice.finalized', 'invoice.paid',
                                           'invoice.paid', 'invoice.voided'])[1 + i % 5] AS type) AS t,
                    -- Over the last 6 hours (the overview's charts), busier lately, and a burst
                    -- two hours ago.
                    LATERAL (SELECT CASE WHEN i % 6 = 0
                                     THEN now() - interval '2 hours' + ((i * 37) % 900) * interval '1 s'
                                     ELSE now() - interval '6 hours'
                                          * power(((i * 7919) % $1)::float8 / $1, 1.4) END AS at) AS at
              WHERE at.at < now()",
            &[&processed],
        )
        .await
        .expect("seeding processed rows");
    seed_parked_showcase(client).await;
    client
        .batch_execute(
            "-- Waiting for a retry, and queued.
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                        available_at, attempts, last_error)
             SELECT 'stripe', 'billing', 'evt_1QRetry' || i, 'invoice.paid',
                    jsonb_build_object('id', 'evt_1QRetry' || i, 'type', 'invoice.paid', 'data',
                        jsonb_build_object('object', jsonb_build_object('id', 'in_1QRetry' || i,
                            'customer', 'cus_R' || i, 'amount_paid', 4900, 'currency', 'eur'))),
                    now() - interval '4 minutes', now() + i * interval '1 minute', 2 + i,
                    'database: canceling statement due to lock timeout (55P03)'
               FROM generate_series(1, 3) AS i;
             INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at)
             SELECT 'stripe', 'billing', 'evt_1QQueued' || i, 'invoice.created',
                    jsonb_build_object('id', 'evt_1QQueued' || i, 'type', 'invoice.created', 'data',
                        jsonb_build_object('object', jsonb_build_object('id', 'in_1QQueued' || i,
                            'customer', 'cus_Q' || i, 'amount_paid', 0, 'status', 'draft'))),
                    now() - i * interval '2 s'
               FROM generate_series(1, 4) AS i;

             -- The outbox: delivered, one pending, one parked by the relay.
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, published_at,
                                 attempts, fencing_token)
             SELECT 'Invoice', 'in_1Q' || upper(substr(md5('o' || i), 1, 22)), 'InvoicePaymentBooked',
                    jsonb_build_object('invoice_id', 'in_1Q' || upper(substr(md5('o' || i), 1, 22)),
                                       'amount', 500 * (1 + i % 40), 'currency', 'eur'),
                    now() - (i * 5) * interval '1 minute', now() - (i * 5) * interval '1 minute' + interval '80 ms',
                    1, 1
               FROM generate_series(1, 40) AS i;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, attempts,
                                 available_at, fencing_token, last_error)
             VALUES ('Invoice', 'in_1QPendingA4B2', 'InvoicePaymentBooked',
                     '{\"invoice_id\": \"in_1QPendingA4B2\", \"amount\": 12900, \"currency\": \"eur\"}',
                     now() - interval '30 s', 2, now() + interval '20 s', 2,
                     'HTTP 503 from the destination: upstream unavailable');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, attempts,
                                 fencing_token, last_error, parked_at)
             VALUES ('Invoice', 'in_1QGoneZ9X7', 'InvoicePaymentBooked',
                     '{\"invoice_id\": \"in_1QGoneZ9X7\", \"amount\": 2500, \"currency\": \"eur\"}',
                     now() - interval '2 hours', 12, 12,
                     'HTTP 410 Gone from the destination: the receiver no longer takes this aggregate',
                     now() - interval '1 hour');
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ('Invoice', 'in_1QGoneZ9X7', 'InvoiceVoided',
                     '{\"invoice_id\": \"in_1QGoneZ9X7\"}', now() - interval '40 minutes');

             -- Reconciliation: two open items, one resolved.
             INSERT INTO reconciliation_items (created_at, invoice_id, event_id, reason, detail)
             VALUES (now() - interval '3 hours', 'in_1QVoidedK2M8', 'evt_1QVoidPaidR5T1', 'payment_on_void_invoice',
                     '{\"amount_paid\": 4900, \"endpoint\": \"billing\"}');
             INSERT INTO reconciliation_items (created_at, event_id, reason, object_id, object_type, object_url,
                                               detail)
             VALUES (now() - interval '50 minutes', 'evt_1QHealthG7H2', 'event_generation_failure',
                     'pi_3QFailedGen8K1', 'payment_intent', '/v1/payment_intents/pi_3QFailedGen8K1',
                     '{\"type\": \"payment_intent.succeeded\"}');
             INSERT INTO reconciliation_items (created_at, invoice_id, event_id, reason, detail, resolved_at,
                                               resolved_by, resolution_note)
             VALUES (now() - interval '2 days', 'in_1QOldVoidP4Q', 'evt_1QOldVoidE2', 'payment_on_void_invoice',
                     '{\"amount_paid\": 1900, \"endpoint\": \"billing\"}', now() - interval '1 day', 'alice',
                     'refunded in the dashboard (re_3QRefund1)');

             -- Past operator commands.
             INSERT INTO operator_audit (at, actor, action, target, affected)
             VALUES (now() - interval '1 day 2 hours', 'alice', 'requeue',
                     '{\"provider\": \"stripe\", \"endpoint\": \"billing\", \"event_id\": \"evt_1QOldParkedA1\"}', 1),
                    (now() - interval '1 day', 'alice', 'resolve-reconciliation',
                     '{\"table\": \"reconciliation_items\", \"id\": 3, \"reason\": \"payment_on_void_invoice\",
                       \"event_id\": \"evt_1QOldVoidE2\", \"note\": \"refunded in the dashboard (re_3QRefund1)\"}', 1),
                    (now() - interval '5 hours', 'bob', 'dismiss',
                     '{\"provider\": \"stripe\", \"endpoint\": \"billing\", \"event_id\": \"evt_1QTestModeX1\",
                       \"event_type\": \"invoice.paid\", \"held\": \"livemode\",
                       \"reason\": \"a test-mode event sent to the live endpoint\"}', 1);",
        )
        .await
        .expect("seeding the showcase");
}

/// 12 parked rows of the showcase, each with the error that parked it.
async fn seed_parked_showcase(client: &Client) {
    let rows: &[(&str, &str, &str, i32, &str)] = &[
        ("evt_1QPk7ZL2eZvKYlo2C8d1yV3s", "invoice.paid", "billing", 10, PARKED[0].1),
        ("evt_1QPk8AL2eZvKYlo2x0Qm4R7t", "invoice.paid", "billing", 10, PARKED[1].1),
        ("evt_1QPk9BL2eZvKYlo2Ub6nT2wq", "invoice.finalized", "billing", 10, PARKED[2].1),
        ("evt_1QPkACL2eZvKYlo2Hs5pX9yr", "invoice.created", "billing", 10, PARKED[3].1),
        ("evt_1QPkBDL2eZvKYlo2Ji3kV8zs", "invoice.paid", "billing", 10, PARKED[4].1),
        ("evt_1QPkCEL2eZvKYlo2Lm2jW7at", "invoice.voided", "analytics", 10, PARKED[5].1),
        ("evt_1QPkDFL2eZvKYlo2Nn1hY6bu", "invoice.marked_uncollectible", "billing", 10, PARKED[6].1),
        ("evt_1QPkEGL2eZvKYlo2Pq0gZ5cv", "invoice.paid", "billing", 10, PARKED[0].1),
        ("evt_1QPkFHL2eZvKYlo2Rr9fA4dw", "invoice.paid", "billing", 10, PARKED[1].1),
        ("evt_1QPkGIL2eZvKYlo2Ts8eB3ex", "invoice.paid", "billing", 10, PARKED[1].1),
        ("evt_1QPkHJL2eZvKYlo2Vu7dC2fy", "invoice.created", "analytics", 10, PARKED[3].1),
        ("evt_1QPkIKL2eZvKYlo2Xw6cD1gz", "invoice.paid", "billing", 10, PARKED[0].1),
    ];
    for (i, (event_id, event_type, endpoint, attempts, error)) in rows.iter().enumerate() {
        let payload = serde_json::json!({
            "id": event_id, "object": "event", "type": event_type, "livemode": true,
            "api_version": "2025-06-30.basil", "created": 1_767_225_600 + i as i64,
            "data": {"object": {
                "id": format!("in_1QParked{i:02}"), "object": "invoice",
                "customer": format!("cus_RpK{i:02}x8Lm"), "amount_paid": 2900 + 100 * i as i64,
                "currency": "eur", "status": "paid", "description": "Pro plan, monthly",
            }},
        });
        // Received from 7 hours to 90 minutes ago, parked 50 minutes after.
        let ago = 3600.0 * (12 - i) as f64 / 2.0 + 3600.0;
        client
            .execute(
                "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at,
                                            available_at, attempts, last_error, parked_at)
                 VALUES ('stripe', $1, $2, $3, $4, now() - make_interval(secs => $5),
                         now() - make_interval(secs => $5) + interval '50 minutes', $6, $7,
                         now() - make_interval(secs => $5) + interval '50 minutes')",
                &[endpoint, event_id, event_type, &payload, &ago, attempts, error],
            )
            .await
            .expect("seeding a parked row");
    }
}
