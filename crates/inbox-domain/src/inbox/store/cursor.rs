//! Where a claim starts reading its queue: the inbox's ([`super::queue::CLAIM_SQL`], in
//! `webhook_inbox_queue_by_type`) or the outbox's ([`super::outbox::CLAIM_SQL`], in
//! `outbox_ready`). Both indexes are in order of availability, and both claims return where the
//! next may start (`resume_from`).

use std::time::{Duration, Instant, SystemTime};

/// Where a worker's (or a relay's) claims start reading their queue: a little before where the
/// last claim left off, and from the front of the queue every few seconds.
///
/// A claim that starts at the front of its index steps over the dead entries that every claimed
/// and finished row leaves there. Vacuum and page pruning remove them in the steady state; while a
/// snapshot older than them is open (a reporting query held for minutes) nothing can, and each
/// claim reads all of them: the soak measured the workers falling from 1200 to ~600 events/s
/// under a 5-minute snapshot. Started from the oldest ready row the last claim left, a claim
/// reads only the entries of the last moments.
///
/// What a start later than the front can miss, and why the full scans are enough: a row whose
/// availability is older than the start when it becomes visible to claims. On the inbox: an
/// insert whose transaction committed more than [`ClaimCursor::SLACK`] after its `now()`, rows
/// another worker's claim had locked and then rolled back. On the outbox: a row written by a
/// process transaction that committed more than the slack after it began (its rows take the
/// transaction's `now()`), rows another relay's claim locked and rolled back. Nothing else becomes
/// ready in the past: a retry, a lease, a hold and a hand-back are set to a time after `now()`, a
/// requeue and a release to `now()` in a short transaction. Such a row waits for the next full
/// scan, at most [`ClaimCursor::FULL_SCAN_EVERY`]; no row is ever left behind.
#[derive(Debug)]
pub struct ClaimCursor {
    /// The start of the next claim; None: the next claim reads the whole queue.
    since: Option<SystemTime>,
    /// When the next claim reads the whole queue again.
    full_scan_at: Instant,
}

impl ClaimCursor {
    /// How far before where the last claim left off the next one starts: covers inserts that
    /// commit shortly after their `now()` (the ingest's group commits, a batch's process
    /// transaction: milliseconds).
    pub const SLACK: Duration = Duration::from_secs(2);
    /// How often a claim reads the whole queue: the longest a row ready before the start waits.
    pub const FULL_SCAN_EVERY: Duration = Duration::from_secs(5);

    /// A cursor whose first claim reads the whole queue.
    pub fn new() -> Self {
        ClaimCursor { since: None, full_scan_at: Instant::now() }
    }

    /// Where the next claim starts (its `$5`): None when a full scan is due.
    pub fn start(&mut self) -> Option<SystemTime> {
        let now = Instant::now();
        if now >= self.full_scan_at {
            self.full_scan_at = now + Self::FULL_SCAN_EVERY;
            return None;
        }
        self.since
    }

    /// After a claim that committed, given its `resume_from`: the next starts
    /// [`ClaimCursor::SLACK`] before it.
    pub fn advance(&mut self, resume_from: Option<SystemTime>) {
        if let Some(from) = resume_from {
            self.since = from.checked_sub(Self::SLACK);
        }
    }
}

impl Default for ClaimCursor {
    fn default() -> Self {
        Self::new()
    }
}
