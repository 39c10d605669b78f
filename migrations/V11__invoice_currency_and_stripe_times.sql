-- stripe-inbox schema, version 11: what the invoice handlers keep, as Stripe says it.
--
-- A ledger entry without its currency is a number without meaning: 1000 is ten euros or a
-- thousand yen. invoices.paid_at was the time the worker processed the payment, not when Stripe
-- says the invoice was paid (status_transitions.paid_at): a redelivery days later, or a replay,
-- showed the wrong day. And invoice.created kept only the invoice's id and payer, not the amounts
-- it carries. Now:
--   invoices.currency, amount_due, total   from the events (amount_paid already was);
--   invoices.paid_at                        Stripe's status_transitions.paid_at (the processing
--                                           time only when the event does not say);
--   ledger_entries.currency                 the invoice's currency; the outbox payload says it too.
-- Nullable: an invoice created by an event without them (or before this version, where nothing
-- below finds them) has none.
ALTER TABLE invoices ADD COLUMN currency text, ADD COLUMN amount_due bigint, ADD COLUMN total bigint;
ALTER TABLE ledger_entries ADD COLUMN currency text;

-- Filled for existing rows from the events still in the inbox (processed rows are kept until the
-- purge: about 30 days): for each invoice, its latest invoice event that carries the field. One
-- pass over the inbox's invoice events; invoices whose events were purged keep NULLs.
WITH latest AS (
    SELECT DISTINCT ON (payload #>> '{data,object,id}')
           payload #>> '{data,object,id}' AS invoice_id,
           payload #>> '{data,object,currency}' AS currency,
           CASE jsonb_typeof(payload #> '{data,object,amount_due}')
                WHEN 'number' THEN (payload #>> '{data,object,amount_due}')::bigint END AS amount_due,
           CASE jsonb_typeof(payload #> '{data,object,total}')
                WHEN 'number' THEN (payload #>> '{data,object,total}')::bigint END AS total
      FROM webhook_inbox
     WHERE event_type LIKE 'invoice.%'
       AND payload #>> '{data,object,object}' = 'invoice'
       AND jsonb_typeof(payload #> '{data,object,currency}') = 'string'
     ORDER BY payload #>> '{data,object,id}', received_at DESC
)
UPDATE invoices AS i
   SET currency = latest.currency,
       amount_due = COALESCE(i.amount_due, latest.amount_due),
       total = COALESCE(i.total, latest.total)
  FROM latest
 WHERE i.id = latest.invoice_id AND i.currency IS NULL;

-- The time Stripe says each paid invoice was paid, from its invoice.paid event still in the inbox.
WITH paid AS (
    SELECT DISTINCT ON (payload #>> '{data,object,id}')
           payload #>> '{data,object,id}' AS invoice_id,
           to_timestamp((payload #>> '{data,object,status_transitions,paid_at}')::bigint) AS paid_at
      FROM webhook_inbox
     WHERE event_type = 'invoice.paid'
       AND jsonb_typeof(payload #> '{data,object,status_transitions,paid_at}') = 'number'
     ORDER BY payload #>> '{data,object,id}', received_at
)
UPDATE invoices AS i
   SET paid_at = paid.paid_at
  FROM paid
 WHERE i.id = paid.invoice_id AND i.status = 'paid';

UPDATE ledger_entries AS l
   SET currency = i.currency
  FROM invoices AS i
 WHERE l.invoice_id = i.id AND l.currency IS NULL AND i.currency IS NOT NULL;
