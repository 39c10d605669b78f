//! The two orderings an inbox must not use — mark processed then apply (an effect lost on a crash
//! between the two), apply then mark (an effect doubled) — as small test-only functions, fail the
//! very assertion the real path passes: proof that the suite can see a lost and a doubled effect.
//!
//! The effect here is deliberately *not* idempotent (one `outbox` row per application), as
//! business effects often are: the inbox alone must make it happen exactly once.

use std::time::Duration;

use inbox_domain::handler::{HandlerFuture, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_test_support::db::scalar;
use inbox_test_support::events::invoice_paid;
use inbox_test_support::worker::{claim, execute, pool, store_event, test_limits};
use inbox_test_support::TestDb;
use inbox_worker::executor::Outcome;

const EFFECT_SQL: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                          VALUES ('Invoice', $1, 'PaymentReceived', '{}')";

/// The non-idempotent effect, as a registered handler for the real path.
fn effect<'a>(tx: &'a deadpool_postgres::Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async move {
        tx.execute(EFFECT_SQL, &[&event.object_str("id")?]).await?;
        Ok(())
    })
}

/// The first application of the effect fails (a trigger raises on the first outbox insert; the
/// sequence is not transactional, so only the first one fails).
async fn fail_first_application(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "CREATE SEQUENCE applications;
             CREATE FUNCTION fail_first() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN IF nextval('applications') = 1 THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$;
             CREATE TRIGGER fail_first BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION fail_first();",
        )
        .await
        .unwrap();
}

/// The assertion every strategy is held to: the effect happened exactly once.
async fn effects(client: &tokio_postgres::Client) -> i64 {
    scalar(client, "SELECT count(*) FROM outbox WHERE event_type = 'PaymentReceived'").await
}

const INSERT_MARK_SQL: &str =
    "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, processed_at)
     VALUES ('stripe', 'billing', $1, 'invoice.paid', '{}', now()) ON CONFLICT DO NOTHING RETURNING 1";

/// Case A: commit "processed" first, then apply in another transaction.
async fn receive_mark_first_broken(
    client: &mut tokio_postgres::Client,
    event_id: &str,
    invoice: &str,
) -> &'static str {
    if client.query_opt(INSERT_MARK_SQL, &[&event_id]).await.unwrap().is_none() {
        return "duplicate";
    }
    let tx = client.transaction().await.unwrap();
    match tx.execute(EFFECT_SQL, &[&invoice]).await {
        Ok(_) => {
            tx.commit().await.unwrap();
            "processed"
        }
        Err(_) => "error", // 500 to Stripe, which redelivers
    }
}

/// Case B: apply and commit, then record; `crash` stops between the two.
async fn receive_mark_after_broken(
    client: &mut tokio_postgres::Client,
    event_id: &str,
    invoice: &str,
    crash: bool,
) -> &'static str {
    let seen = client
        .query_opt("SELECT 1 FROM webhook_inbox WHERE provider = 'stripe' AND endpoint = 'billing' AND event_id = $1", &[&event_id])
        .await
        .unwrap();
    if seen.is_some() {
        return "duplicate";
    }
    let tx = client.transaction().await.unwrap();
    tx.execute(EFFECT_SQL, &[&invoice]).await.unwrap();
    tx.commit().await.unwrap();
    if crash {
        return "crashed"; // deploy, OOM, timeout: no 2xx, Stripe redelivers
    }
    client.query_opt(INSERT_MARK_SQL, &[&event_id]).await.unwrap();
    "processed"
}

#[tokio::test]
async fn case_a_mark_first_loses_the_event_that_the_inbox_keeps() {
    // Broken: the first delivery's application fails, the redelivery is taken for a duplicate.
    let db = TestDb::new().await;
    let mut client = db.client().await;
    fail_first_application(&client).await;
    assert_eq!(receive_mark_first_broken(&mut client, "evt_1", "in_1").await, "error");
    assert_eq!(receive_mark_first_broken(&mut client, "evt_1", "in_1").await, "duplicate");
    assert_eq!(effects(&client).await, 0, "Case A loses the payment");

    // The real path under the same fault: the failed attempt is retried, exactly one effect.
    let db = TestDb::new().await;
    let client = db.client().await;
    fail_first_application(&client).await;
    let pool = pool(&db, 2);
    let mut registry = Registry::new();
    registry.register("invoice.paid", effect);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let first = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    assert!(matches!(
        execute(&pool, &registry, &first, &test_limits(Duration::from_secs(5))).await,
        Outcome::Failed(_)
    ));
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await; // the redelivery
    client.execute("UPDATE webhook_inbox SET available_at = now()", &[]).await.unwrap(); // skip the backoff
    let retry = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    assert_eq!(
        execute(&pool, &registry, &retry, &test_limits(Duration::from_secs(5))).await,
        Outcome::Processed
    );
    assert_eq!(effects(&client).await, 1);
}

#[tokio::test]
async fn case_b_mark_after_doubles_the_effect_that_the_inbox_applies_once() {
    // Broken: the first delivery applies, then "crashes" before recording; the redelivery applies again.
    let db = TestDb::new().await;
    let mut client = db.client().await;
    assert_eq!(receive_mark_after_broken(&mut client, "evt_1", "in_1", true).await, "crashed");
    assert_eq!(receive_mark_after_broken(&mut client, "evt_1", "in_1", false).await, "processed");
    assert_eq!(effects(&client).await, 2, "Case B applies the payment twice");

    // The real path: the effect and processed_at commit together, so a crash anywhere either
    // kept both or neither, and the redelivery is deduplicated.
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    let mut registry = Registry::new();
    registry.register("invoice.paid", effect);
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let row = claim(&pool, 1, Duration::from_secs(30), 10).await.remove(0);
    assert_eq!(
        execute(&pool, &registry, &row, &test_limits(Duration::from_secs(5))).await,
        Outcome::Processed
    );
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await; // the redelivery
    assert!(claim(&pool, 1, Duration::from_secs(30), 10).await.is_empty());
    assert_eq!(effects(&client).await, 1);
}
