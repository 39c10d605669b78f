//! The `invoice.paid` bodies every phase uses (one template, ~2 KB as sent), and pre-signed
//! HTTP requests for the load generator.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use inbox_domain::inbox::signature::sign_header;

/// Placeholders in the template, replaced per event (also by SQL `replace()` when seeding).
pub const EVT: &str = "@EVT@";
pub const INV: &str = "@INV@";

/// The signing secret of the benchmark's `billing` endpoint.
pub const SECRET: &str = "whsec_bench_0123456789abcdefghijklmnopqrstuv";

/// Target size of an `invoice.paid` body as sent (pretty JSON, like Stripe's).
pub const BODY_BYTES: usize = 2048;

/// A Stripe-shaped `invoice.paid` event, pretty-printed, padded in
/// `metadata.note` to [`BODY_BYTES`] for ids of the length [`event_id`] makes.
pub fn invoice_paid_template() -> String {
    template_with_pad(BODY_BYTES, true)
}

/// The same `invoice.paid` event padded to about `bytes` (the memory phase's ~1 MiB bodies).
pub fn invoice_paid_template_of(bytes: usize) -> String {
    template_with_pad(bytes, true)
}

/// A smaller (~500 B) processed-event payload for the scale phase's history rows.
pub fn small_template() -> String {
    serde_json::to_string_pretty(&serde_json::json!({
        "id": EVT,
        "object": "event",
        "api_version": "2026-09-30.clover",
        "created": 1_790_000_200,
        "data": { "object": {
            "id": INV, "object": "invoice", "amount_paid": 4980, "currency": "jpy",
            "customer": "cus_Q8bench0001", "status": "paid", "number": "BENCH-0001",
            "subscription": "sub_1Q8bench0001", "billing_reason": "subscription_cycle",
            "status_transitions": { "finalized_at": 1_790_000_000, "paid_at": 1_790_000_100 }
        }},
        "livemode": false,
        "pending_webhooks": 1,
        "request": { "id": null, "idempotency_key": null },
        "type": "invoice.paid"
    }))
    .unwrap()
}

fn template_with_pad(target: usize, pad: bool) -> String {
    let note = if pad {
        let base = template_with_pad(target, false)
            .replace(EVT, &event_id("b32_", 0))
            .replace(INV, &invoice_id("b32_", 0));
        let filler = "Thank you for your business. ";
        let need = target.saturating_sub(base.len());
        filler.repeat(need / filler.len() + 1)[..need].to_owned()
    } else {
        String::new()
    };
    let line = |id: &str, amount: i64, desc: &str, price: &str| {
        serde_json::json!({
            "id": id, "object": "line_item", "amount": amount, "amount_excluding_tax": amount,
            "currency": "jpy", "description": desc, "discountable": true, "livemode": false,
            "metadata": {}, "period": { "end": 1_792_592_000, "start": 1_790_000_000 },
            "price": price,
            "proration": false, "quantity": 1, "type": "subscription"
        })
    };
    serde_json::to_string_pretty(&serde_json::json!({
        "id": EVT,
        "object": "event",
        "api_version": "2026-09-30.clover",
        "created": 1_790_000_200,
        "data": { "object": {
            "id": INV,
            "object": "invoice",
            "account_country": "JP",
            "amount_due": 4980,
            "amount_paid": 4980,
            "amount_remaining": 0,
            "attempted": true,
            "billing_reason": "subscription_cycle",
            "collection_method": "charge_automatically",
            "currency": "jpy",
            "customer": "cus_Q8bench0001",
            "customer_email": "billing@example.com",
            "hosted_invoice_url": "https://invoice.stripe.com/i/acct_1Q8bench/test_YWNjdF8xUThiZW5jaA",
            "lines": { "object": "list", "data": [
                line("il_1Q8bench0001", 4980, "1 x Pro plan (at ¥4,980 / month)", "price_1Q8benchPro"),
            ], "has_more": false, "total_count": 1 },
            "livemode": false,
            "metadata": { "note": note },
            "number": "BENCH-0001",
            "paid": true,
            "payment_intent": "pi_3Q8bench0001",
            "period_end": 1_792_592_000,
            "period_start": 1_790_000_000,
            "status": "paid",
            "status_transitions": { "finalized_at": 1_790_000_000, "paid_at": 1_790_000_100 },
            "subscription": "sub_1Q8bench0001",
            "subtotal": 4980,
            "tax": null,
            "total": 4980
        }},
        "livemode": false,
        "pending_webhooks": 1,
        "request": { "id": null, "idempotency_key": null },
        "type": "invoice.paid"
    }))
    .unwrap()
}

/// An `invoice.paid` event whose invoice is Stripe's own fixture (tests/fixtures/stripe-openapi:
/// every field an invoice has, ~5 KB pretty-printed as Stripe sends it), paid, with the
/// placeholders [`EVT`] and [`INV`]: the size and shape of what the inbox stores in production,
/// for the soak. Past PostgreSQL's TOAST threshold (~2 KB), so the row keeps its payload out of
/// line, unlike [`invoice_paid_template`]'s.
pub fn stripe_invoice_paid_template() -> String {
    use inbox_test_support::stripe_fixtures::{resource, snapshot_event};
    let mut invoice = resource("invoice");
    invoice["id"] = serde_json::json!(INV);
    invoice["status"] = serde_json::json!("paid");
    invoice["amount_paid"] = serde_json::json!(4980);
    invoice["amount_due"] = serde_json::json!(4980);
    invoice["amount_remaining"] = serde_json::json!(0);
    invoice["currency"] = serde_json::json!("jpy");
    invoice["customer"] = serde_json::json!("cus_Q8bench0001");
    serde_json::to_string_pretty(&snapshot_event(EVT, "invoice.paid", invoice, 1_790_000_200)).unwrap()
}

pub fn event_id(tag: &str, index: usize) -> String {
    format!("evt_{tag}{index:010}")
}

pub fn invoice_id(tag: &str, index: usize) -> String {
    format!("in_{tag}{index:010}")
}

/// Signed `POST /webhooks/stripe/billing` requests with unique event (and invoice) ids, built
/// before the clock starts; [`Requests::take`] signs more on the fly if the budget runs out.
pub struct Requests {
    template: String,
    head: String,
    tag: String,
    timestamp: i64,
    prebuilt: Vec<Vec<u8>>,
    next: AtomicUsize,
}

impl Requests {
    /// `count` requests signed now (a signature stays valid for the ingest's tolerance, 5 min).
    pub fn new(template: &str, host: &str, tag: &str, count: usize) -> Requests {
        let mut r = Requests {
            template: template.to_owned(),
            head: format!(
                "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: {host}\r\n\
                 User-Agent: Stripe/1.0 (+https://stripe.com/docs/webhooks)\r\n\
                 Content-Type: application/json; charset=utf-8\r\nAccept: */*\r\n"
            ),
            tag: tag.to_owned(),
            timestamp: inbox_test_support::events::now(),
            prebuilt: Vec::new(),
            next: AtomicUsize::new(0),
        };
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8);
        let per = count.div_ceil(threads).max(1);
        let r_ref = &r;
        let parts: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || (t * per..((t + 1) * per).min(count)).map(|i| r_ref.build(i)).collect())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        r.prebuilt = parts.into_iter().flatten().collect();
        r
    }

    /// The request with index `i`: head, signature, body.
    pub fn build(&self, i: usize) -> Vec<u8> {
        let body =
            self.template.replace(EVT, &event_id(&self.tag, i)).replace(INV, &invoice_id(&self.tag, i));
        let signature = sign_header(SECRET, self.timestamp, body.as_bytes());
        let mut req = Vec::with_capacity(self.head.len() + 160 + body.len());
        req.extend_from_slice(self.head.as_bytes());
        req.extend_from_slice(
            format!("Stripe-Signature: {signature}\r\nContent-Length: {}\r\n\r\n", body.len()).as_bytes(),
        );
        req.extend_from_slice(body.as_bytes());
        req
    }

    /// The next unused request (pre-signed while the budget lasts).
    pub fn take(&self) -> Cow<'_, [u8]> {
        let i = self.next.fetch_add(1, Relaxed);
        match self.prebuilt.get(i) {
            Some(r) => Cow::Borrowed(r.as_slice()),
            None => Cow::Owned(self.build(i)),
        }
    }

    /// How many requests were taken, and how many of them had to be signed during the run.
    pub fn taken(&self) -> (usize, usize) {
        let n = self.next.load(Relaxed);
        (n, n.saturating_sub(self.prebuilt.len()))
    }
}
