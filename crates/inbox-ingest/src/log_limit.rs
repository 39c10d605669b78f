//! A bound on the log lines of refused requests: whoever can reach the port can send thousands
//! of refused requests a second, and one line each would make the log the attack's amplifier
//! (disk, the log pipeline's bill, the lines that matter buried). The metrics still count every
//! request; the log keeps [`BURST`] lines per [`WINDOW`] and the next line logged says how many
//! were left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines logged at most per window.
pub const BURST: u32 = 20;
/// The window.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Refusal lines logged in the current window, and those left out since the last line.
#[derive(Debug)]
pub struct LogLimit {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    window_start: Instant,
    logged: u32,
    left_out: u64,
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit { state: Mutex::new(State { window_start: Instant::now(), logged: 0, left_out: 0 }) }
    }
}

impl LogLimit {
    /// Whether this line may be logged: `Some(n)`, `n` the lines left out before it (to log with
    /// it), or None to leave it out.
    pub fn admit(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.window_start.elapsed() >= WINDOW {
            state.window_start = Instant::now();
            state.logged = 0;
        }
        if state.logged >= BURST {
            state.left_out += 1;
            return None;
        }
        state.logged += 1;
        Some(std::mem::take(&mut state.left_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_logged_then_lines_are_left_out_and_counted() {
        let limit = LogLimit::default();
        for _ in 0..BURST {
            assert_eq!(limit.admit(), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(limit.admit(), None);
        }
        limit.state.lock().unwrap().window_start -= WINDOW;
        assert_eq!(limit.admit(), Some(5), "the first line of the next window says how many were left out");
        assert_eq!(limit.admit(), Some(0));
    }
}
