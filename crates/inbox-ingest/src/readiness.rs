//! `/readyz`'s answer: checked against the database at most once per [`CACHE_FOR`] whatever the
//! number of probes, and turned to 503 for good by a misconfiguration the writers meet.
//!
//! The check borrows a connection from the pool the group-commit writers use; probes from a
//! load balancer, a kubelet and a dashboard at once must not take them from the writers. So one
//! probe at a time runs the check, the others wait for its answer, and the answer serves every
//! probe for a second.

use std::future::Future;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long one check's answer serves the probes that follow it.
pub const CACHE_FOR: Duration = Duration::from_secs(1);

/// One answer of `/readyz`.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub ready: bool,
    /// The JSON body: `{"status": "ready", …}` or `{"status": "not_ready", "error": …}`.
    pub body: serde_json::Value,
}

/// What the readiness probes share.
#[derive(Debug, Default)]
pub struct Readiness {
    /// A misconfiguration the writers met (the fix, see `inbox_domain::db::misconfiguration`):
    /// every later answer is 503 with it. Only a restart with other settings clears it.
    misconfigured: OnceLock<&'static str>,
    /// The last check's answer and when it was made.
    last: Mutex<Option<(Instant, Verdict)>>,
    /// Held by the probe running the check: the others wait, then take its answer.
    checking: tokio::sync::Mutex<()>,
}

impl Readiness {
    /// Records a misconfiguration; true the first time (the caller logs it then).
    pub fn misconfigured(&self, fix: &'static str) -> bool {
        self.misconfigured.set(fix).is_ok()
    }

    /// The answer: the misconfiguration if one was met; else the last check's when it is fresh;
    /// else `check`'s, run by one probe at a time.
    pub async fn verdict<F, Fut>(&self, check: F) -> Verdict
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Verdict>,
    {
        if let Some(verdict) = self.answer_without_checking() {
            return verdict;
        }
        let _turn = self.checking.lock().await;
        // Another probe may have checked while this one waited.
        if let Some(verdict) = self.answer_without_checking() {
            return verdict;
        }
        let verdict = check().await;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), verdict.clone()));
        verdict
    }

    fn answer_without_checking(&self) -> Option<Verdict> {
        if let Some(fix) = self.misconfigured.get() {
            return Some(Verdict {
                ready: false,
                body: serde_json::json!({ "status": "not_ready", "error": fix }),
            });
        }
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref().filter(|(at, _)| at.elapsed() < CACHE_FOR).map(|(_, verdict)| verdict.clone())
    }
}
