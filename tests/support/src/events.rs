//! Realistic Stripe events, signed like Stripe signs them.

use inbox_domain::inbox::signature::sign_header;

/// The secrets the test endpoints use (two on `billing`: a secret roll in progress).
pub const SECRET_A: &str = "whsec_test_SecretAaaaaaaaaaaaaaaaaaaaaa";
pub const SECRET_B: &str = "whsec_test_SecretBbbbbbbbbbbbbbbbbbbbbbb";
pub const SECRET_C: &str = "whsec_test_SecretCccccccccccccccccccccccc";

pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// An `invoice.*` event body (~1.5 KB, shaped like Stripe's).
pub fn invoice_event(
    event_id: &str,
    event_type: &str,
    invoice_id: &str,
    status: &str,
    amount_paid: i64,
) -> Vec<u8> {
    serde_json::to_vec_pretty(&serde_json::json!({
        "id": event_id,
        "object": "event",
        "api_version": "2026-09-30.clover",
        "created": 1_790_000_200,
        "data": { "object": {
            "id": invoice_id,
            "object": "invoice",
            "account_country": "JP",
            "amount_due": amount_paid,
            "amount_paid": amount_paid,
            "amount_remaining": 0,
            "billing_reason": "subscription_cycle",
            "collection_method": "charge_automatically",
            "currency": "jpy",
            "customer": "cus_TEST0001",
            "customer_email": "billing@example.com",
            "lines": { "object": "list", "data": [ {
                "id": "il_1", "object": "line_item", "amount": amount_paid, "currency": "jpy",
                "description": "1 x Pro plan", "quantity": 1,
                "period": { "end": 1_792_592_000, "start": 1_790_000_000 }
            } ], "has_more": false, "total_count": 1 },
            "livemode": false,
            "metadata": {},
            "number": "ABCD-0001",
            "status": status,
            "status_transitions": { "finalized_at": 1_790_000_000, "paid_at": 1_790_000_100 },
            "subscription": "sub_TEST0001",
            "total": amount_paid
        }},
        "livemode": false,
        "pending_webhooks": 1,
        "request": { "id": null, "idempotency_key": null },
        "type": event_type
    }))
    .unwrap()
}

/// An `invoice.paid` event.
pub fn invoice_paid(event_id: &str, invoice_id: &str, amount: i64) -> Vec<u8> {
    invoice_event(event_id, "invoice.paid", invoice_id, "paid", amount)
}

/// A `Stripe-Signature` header for `body`, signed now with `secret`.
pub fn sign(secret: &str, body: &[u8]) -> String {
    sign_header(secret, now(), body)
}
