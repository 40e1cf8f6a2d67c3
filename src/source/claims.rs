//! The one supervision of a claim loop (a table lane's, a mapped table's
//! poller): what it waits after each round, until it is stopped.

use std::time::Duration;

use tokio::sync::watch;

use crate::policy::retry::Reconnect;

/// What a round of claims says to the loop that runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// It claimed all it could: claim again at once.
    Again,
    /// It claimed less than it could: claim again after the poll interval.
    Poll,
    /// It failed (logged where it failed): claim again after the reconnect
    /// backoff, on a new connection.
    Failed,
}

/// The waits between a loop's rounds: the poll interval, or the reconnect
/// backoff after a failure (reset by a round that did not fail).
pub struct ClaimLoop {
    reconnect: Reconnect,
    poll: Duration,
}

impl ClaimLoop {
    pub fn new(poll: Duration) -> ClaimLoop {
        ClaimLoop { reconnect: Reconnect::default(), poll }
    }

    /// Wait as `next` says; true when `stop` turned true (before or while
    /// waiting): the loop ends.
    pub async fn wait(&mut self, next: Next, stop: &mut watch::Receiver<bool>) -> bool {
        let wait = match next {
            Next::Again => Duration::ZERO,
            Next::Poll => self.poll,
            Next::Failed => self.reconnect.failed(),
        };
        if next != Next::Failed {
            self.reconnect.succeeded();
        }
        sleep_or_stop(wait, stop).await
    }
}

/// Sleep `d` unless `stop` turns true first; true when it has.
pub async fn sleep_or_stop(d: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if d.is_zero() {
        return *stop.borrow();
    }
    let slept = tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    slept || *stop.borrow()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_loop_waits_by_what_its_round_said_and_ends_at_stop() {
        let poll = Duration::from_millis(50);
        let (tx, mut stop) = watch::channel(false);
        let mut l = ClaimLoop::new(poll);
        let t = std::time::Instant::now();
        assert!(!l.wait(Next::Again, &mut stop).await);
        assert!(t.elapsed() < poll, "a full round claims again at once");
        assert!(!l.wait(Next::Poll, &mut stop).await);
        assert!(t.elapsed() >= poll, "a short round waits the poll interval");
        let t = std::time::Instant::now();
        assert!(!l.wait(Next::Failed, &mut stop).await);
        assert!(t.elapsed() > Duration::ZERO, "a failure backs off");
        tx.send(true).unwrap();
        let t = std::time::Instant::now();
        assert!(l.wait(Next::Failed, &mut stop).await, "stopped");
        assert!(l.wait(Next::Again, &mut stop).await, "stopped, even at once");
        assert!(t.elapsed() < Duration::from_secs(1), "a stopped loop does not wait out its backoff");
    }
}
