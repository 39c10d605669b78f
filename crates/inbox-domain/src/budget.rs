//! The memory a process may spend on payloads: a budget of bytes in flight, shared by whatever
//! holds payloads — the worker's claimed rows, the ingest's request bodies from their first byte
//! received until their batch is written. A count of events is no bound: 64 events of 2 KB and 64
//! of 1 MiB differ by 500×.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Payload bytes in flight, at most the budget (counted in KiB: a semaphore counts in u32).
/// Cloning shares the budget. Takers that wait are served first come, first served: bytes given
/// back go to the oldest waiter, so a small taker never overtakes a large one that waits.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
    /// Takers waiting in [`ByteBudget::take_within`] (and [`ByteBudget::grow_within`]) now.
    waiting: Arc<AtomicUsize>,
}

/// Bytes taken from a [`ByteBudget`], given back when dropped.
#[derive(Debug)]
pub struct BytesHeld(OwnedSemaphorePermit);

/// Why [`ByteBudget::take_within`] gave up: no bytes were taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoRoom {
    /// As many takers as allowed were already waiting: this one did not queue at all.
    #[error("too many requests already wait for room")]
    QueueFull,
    /// The bytes were not free within the patience given.
    #[error("no room within the time allowed")]
    TimedOut,
}

impl BytesHeld {
    /// The bytes held (a whole number of KiB).
    pub fn bytes(&self) -> u64 {
        self.0.num_permits() as u64 * 1024
    }

    /// Gives back what is held beyond `bytes` (rounded up to a KiB, at least 1 KiB kept); holds
    /// on to everything when that is no more than `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        let keep = kib(bytes) as usize;
        let held = self.0.num_permits();
        if held > keep {
            drop(self.0.split(held - keep));
        }
    }
}

impl ByteBudget {
    /// A budget of `bytes` (at least 1 KiB).
    pub fn new(bytes: u64) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX >> 3).max(1);
        ByteBudget {
            kib: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            waiting: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The whole budget, in bytes.
    pub fn total(&self) -> u64 {
        u64::from(self.total_kib) * 1024
    }

    /// Bytes free now.
    pub fn available(&self) -> u64 {
        self.kib.available_permits() as u64 * 1024
    }

    /// Nothing yet: a hold to grow with [`ByteBudget::grow_within`] as bytes arrive.
    pub fn nothing(&self) -> BytesHeld {
        BytesHeld(self.kib.clone().try_acquire_many_owned(0).expect("no permits are always free"))
    }

    /// Takes up to `bytes`, as much as is free now, at once: for a taker that chose how much to
    /// take from [`ByteBudget::available`] and may have gone over by one item.
    pub fn take_available(&self, bytes: u64) -> BytesHeld {
        let wanted = kib(bytes).min(self.kib.available_permits() as u32);
        let permit = self.kib.clone().try_acquire_many_owned(wanted).expect("no more than is free");
        BytesHeld(permit)
    }

    /// Takes `bytes`, waiting until they are free. An item larger than the whole budget takes the
    /// whole budget: it waits until nothing else is held, then goes alone.
    pub async fn take(&self, bytes: u64) -> BytesHeld {
        let wanted = kib(bytes).min(self.total_kib);
        let permit = self.kib.clone().acquire_many_owned(wanted).await.expect("the budget is never closed");
        BytesHeld(permit)
    }

    /// Takes `bytes` (as [`ByteBudget::take`]: at most the whole budget) at once when they are
    /// free; otherwise waits for them, in turn, for at most `patience` — unless `max_waiting`
    /// takers already wait, in which case it gives up at once without queueing. For a taker that
    /// has something to answer when there is no room (an HTTP server: 503) and that should not
    /// pile up waiters without end, each costing memory of its own while it waits.
    pub async fn take_within(
        &self,
        bytes: u64,
        patience: Duration,
        max_waiting: usize,
    ) -> Result<BytesHeld, NoRoom> {
        let wanted = kib(bytes).min(self.total_kib);
        if let Ok(permit) = self.kib.clone().try_acquire_many_owned(wanted) {
            return Ok(BytesHeld(permit));
        }
        let _in_line = Waiting::join(&self.waiting, max_waiting).ok_or(NoRoom::QueueFull)?;
        match tokio::time::timeout(patience, self.kib.clone().acquire_many_owned(wanted)).await {
            Ok(permit) => Ok(BytesHeld(permit.expect("the budget is never closed"))),
            Err(_) => Err(NoRoom::TimedOut),
        }
    }

    /// Makes `held` (taken from this budget) hold `bytes` in all (at most the whole budget),
    /// taking the difference as [`ByteBudget::take_within`] does; on `Err`, `held` is unchanged.
    /// For a taker whose size is known only as it arrives (a chunked request body).
    ///
    /// # Panics
    ///
    /// When `held` was taken from another budget.
    pub async fn grow_within(
        &self,
        held: &mut BytesHeld,
        bytes: u64,
        patience: Duration,
        max_waiting: usize,
    ) -> Result<(), NoRoom> {
        let wanted = kib(bytes).min(self.total_kib) as usize;
        let more = wanted.saturating_sub(held.0.num_permits());
        if more > 0 {
            let extra = self.take_within(more as u64 * 1024, patience, max_waiting).await?;
            held.0.merge(extra.0);
        }
        Ok(())
    }
}

/// One taker counted as waiting for room until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    /// Counts one more waiter, unless `max` already wait.
    fn join(waiting: &'a AtomicUsize, max: usize) -> Option<Self> {
        waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).ok()?;
        Some(Waiting(waiting))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `bytes` in KiB, rounded up, at least 1 (every item costs something).
fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_budget_holds_bytes_until_they_are_given_back_and_lets_a_large_item_go_alone() {
        let budget = ByteBudget::new(10 * 1024);
        let first = budget.take(6 * 1024).await;
        assert_eq!(budget.available(), 4 * 1024);
        let over = budget.take_available(8 * 1024);
        assert_eq!(budget.available(), 0, "took what was free, no more");
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.take(64 * 1024).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "a large item waits for everything to be given back");
        drop((first, over));
        let alone = waiting.await.unwrap();
        assert_eq!(budget.available(), 0, "and then takes the whole budget");
        drop(alone);
        assert_eq!(budget.available(), 10 * 1024);
    }

    #[tokio::test]
    async fn take_within_waits_in_turn_up_to_its_patience_and_no_more_than_the_queue_allows() {
        let budget = ByteBudget::new(8 * 1024);
        let patience = Duration::from_secs(5);
        let first = budget.take_within(6 * 1024, patience, 1).await.unwrap();
        assert_eq!(first.bytes(), 6 * 1024);
        // A waiter for 4 KiB is in line; a later one for 1 KiB does not overtake it, and a third
        // taker finds the queue (of at most two) full.
        let large = tokio::spawn({
            let budget = budget.clone();
            async move { budget.take_within(4 * 1024, patience, 2).await }
        });
        tokio::task::yield_now().await;
        let small = tokio::spawn({
            let budget = budget.clone();
            async move { budget.take_within(1024, patience, 2).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(budget.take_within(1, patience, 2).await.unwrap_err(), NoRoom::QueueFull);
        assert!(!small.is_finished(), "2 KiB are free, but the 4 KiB taker waits first");
        drop(first);
        let large = large.await.unwrap().unwrap();
        let small = small.await.unwrap().unwrap();
        assert_eq!((large.bytes(), small.bytes(), budget.available()), (4 * 1024, 1024, 3 * 1024));
        // Nobody waits any more: the queue is free again; the patience runs out in time.
        let short = Duration::from_millis(50);
        let started = std::time::Instant::now();
        assert_eq!(budget.take_within(8 * 1024, short, 1).await.unwrap_err(), NoRoom::TimedOut);
        assert!(started.elapsed() >= short && started.elapsed() < patience, "{:?}", started.elapsed());
        assert_eq!(budget.available(), 3 * 1024, "a taker that gave up holds nothing");
    }

    #[tokio::test]
    async fn held_bytes_grow_as_room_is_given_and_shrink_to_what_was_used() {
        let budget = ByteBudget::new(8 * 1024);
        let patience = Duration::from_millis(50);
        let mut held = budget.take_within(1024, patience, 4).await.unwrap();
        budget.grow_within(&mut held, 4 * 1024, patience, 4).await.unwrap();
        assert_eq!((held.bytes(), budget.available()), (4 * 1024, 4 * 1024));
        budget.grow_within(&mut held, 2 * 1024, patience, 4).await.unwrap();
        assert_eq!(held.bytes(), 4 * 1024, "growing to less keeps what is held");
        let other = budget.take(3 * 1024).await;
        assert_eq!(budget.grow_within(&mut held, 6 * 1024, patience, 4).await.unwrap_err(), NoRoom::TimedOut);
        assert_eq!((held.bytes(), budget.available()), (4 * 1024, 1024), "unchanged when refused");
        held.shrink_to(1500);
        assert_eq!((held.bytes(), budget.available()), (2 * 1024, 3 * 1024));
        held.shrink_to(0);
        assert_eq!(held.bytes(), 1024, "every holder holds 1 KiB at least");
        drop((held, other));
        assert_eq!(budget.available(), budget.total());
    }
}
