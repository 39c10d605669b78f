//! The memory a process may spend on payloads: a budget of bytes in flight, shared by whatever
//! holds payloads — the worker's claimed rows, the ingest's verified bodies waiting for their
//! commit. A count of events is no bound: 64 events of 2 KB and 64 of 1 MiB differ by 500×.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Payload bytes in flight, at most the budget (counted in KiB: a semaphore counts in u32).
/// Cloning shares the budget.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
}

/// Bytes taken from a [`ByteBudget`], given back when dropped.
#[derive(Debug)]
pub struct BytesHeld(#[allow(dead_code)] OwnedSemaphorePermit);

impl ByteBudget {
    /// A budget of `bytes` (at least 1 KiB).
    pub fn new(bytes: u64) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX >> 3).max(1);
        ByteBudget { kib: Arc::new(Semaphore::new(total_kib as usize)), total_kib }
    }

    /// Bytes free now.
    pub fn available(&self) -> u64 {
        self.kib.available_permits() as u64 * 1024
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
}
