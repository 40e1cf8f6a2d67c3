//! The bound on the relay's memory: events read from the slot (or the
//! slot's snapshot) but not settled yet, counted twice, in events and in
//! bytes. Reading waits for room; settling gives it back.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What one unsettled event holds of the budget; returned when dropped.
#[derive(Debug)]
pub struct Permit {
    _event: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

/// `max_unsettled_events` and `max_unsettled_bytes`.
#[derive(Debug, Clone)]
pub struct Budget {
    events: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
}

impl Budget {
    pub fn new(max_events: usize, max_bytes: u64) -> Self {
        let max_bytes = max_bytes.clamp(1, u64::from(u32::MAX)) as u32;
        Self {
            events: Arc::new(Semaphore::new(max_events.max(1))),
            bytes: Arc::new(Semaphore::new(max_bytes as usize)),
            max_bytes,
        }
    }

    /// Wait for room for one event of `size` bytes ([`charge`]). An event
    /// larger than the whole byte budget takes all of it, so it still goes
    /// through, alone.
    pub async fn acquire(&self, size: usize) -> Permit {
        let want = self.want(size);
        let event = Arc::clone(&self.events).acquire_owned().await.expect("the budget is never closed");
        let bytes = Arc::clone(&self.bytes).acquire_many_owned(want).await.expect("the budget is never closed");
        Permit { _event: event, _bytes: bytes }
    }

    /// Room for one event of `size` bytes now, if there is ([`charge`]); an
    /// event larger than the whole budget needs all of it.
    pub fn try_acquire(&self, size: usize) -> Option<Permit> {
        let want = self.want(size);
        let event = Arc::clone(&self.events).try_acquire_owned().ok()?;
        let bytes = Arc::clone(&self.bytes).try_acquire_many_owned(want).ok()?;
        Some(Permit { _event: event, _bytes: bytes })
    }

    /// What an event of `size` bytes takes of the byte budget ([`charge`]),
    /// at most all of it.
    fn want(&self, size: usize) -> u32 {
        charge(size).clamp(1, self.max_bytes as usize) as u32
    }

    /// Bytes not held by any unsettled event.
    pub fn available_bytes(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Events the budget has room for.
    pub fn available_events(&self) -> usize {
        self.events.available_permits()
    }
}

/// What an event of `size` bytes takes of the byte budget: its size, and
/// twice that past 1 MiB (a body through S3, up to `s3.max_body_bytes`):
/// while such an event waits for room, the stream holds the next one it read
/// (the replication client reads ahead), outside any budget. Counted twice,
/// huge events go one or two at a time, and what is held stays within the
/// bound a container is sized by (`max_unsettled_bytes + 2 × the largest
/// body + 64 MiB`); events of 1 MiB or less, the most, count once.
pub fn charge(size: usize) -> usize {
    if is_huge(size) {
        size.saturating_mul(2)
    } else {
        size
    }
}

/// Events past this many bytes count twice ([`charge`]).
const HUGE: usize = 1 << 20;

/// Whether a body of `size` bytes is one of the huge ones ([`charge`]):
/// through S3, counted twice, handed on alone.
pub fn is_huge(size: usize) -> bool {
    size > HUGE
}

/// Bytes of batches in calls at once, over every lane: a sixteenth of the
/// byte budget, between 2 and 64 MiB (4 MiB at the default 64 MB). The
/// request a call builds and sends copies its entries (the SDK's input,
/// the serialized request): 256 calls of ten 5 KB rows held 25 MB the
/// budget did not count. A hot queue of small rows is not slowed by it
/// (256 calls of ten 200-byte rows are 0.5 MiB).
pub fn call_bytes(max_unsettled_bytes: u64) -> u64 {
    (max_unsettled_bytes / 16).clamp(2 << 20, 64 << 20)
}

/// The bounds on memory, from `max_unsettled_events` and
/// `max_unsettled_bytes`: every buffer that holds events is sized from them.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub max_events: usize,
    pub max_bytes: u64,
    /// The largest body an event may carry: 1 MiB (SQS's largest message),
    /// or `s3.max_body_bytes` when bodies may go through S3.
    pub max_event_bytes: u64,
}

impl Memory {
    /// The stream's budget of unsettled events.
    pub fn budget(&self) -> Budget {
        Budget::new(self.max_events, self.max_bytes)
    }

    /// Bytes of rows one table-path claim takes at most: a quarter of the
    /// byte budget, at least 1 MiB.
    pub fn table_claim_bytes(&self) -> u64 {
        (self.max_bytes / 4).max(1 << 20)
    }

    /// Events from the replication client's buffer sized so that, at the
    /// largest event ([`Memory::max_event_bytes`]), the buffer holds no more
    /// than the byte budget: between 1 and 1,024 events (16 at least when
    /// events are at most 1 MiB). Bodies through S3 (events over 1 MiB):
    /// one event, so that what is read and not yet counted in the budget
    /// (the client's read, its buffer, the event being routed) stays within
    /// a few bodies whatever the budget.
    pub fn replication_buffer_events(&self) -> usize {
        let largest = self.max_event_bytes.max(1 << 20);
        if largest > 1 << 20 {
            return 1;
        }
        (self.max_bytes / largest).clamp(16, 1_024) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_bound_events_and_a_huge_event_passes_alone() {
        let b = Budget::new(100, 1_000);
        let a = b.acquire(600).await;
        assert_eq!(b.available_bytes(), 400);
        // 500 bytes do not fit beside the 600 until those are settled.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), b.acquire(500)).await;
        assert!(waiting.is_err());
        drop(a);
        let big = b.acquire(1_000_000).await;
        assert_eq!(b.available_bytes(), 0);
        assert_eq!(b.available_events(), 99);
        drop(big);
        assert_eq!(b.available_bytes(), 1_000);
        // Past 1 MiB, twice: two events of 20 MiB do not fit 64 MiB at once.
        let b = Budget::new(100, 64 << 20);
        let first = b.acquire(20 << 20).await;
        assert_eq!(b.available_bytes(), 24 << 20);
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), b.acquire(20 << 20)).await.is_err());
        let small = b.acquire(1 << 20).await;
        assert_eq!(b.available_bytes(), 23 << 20, "1 MiB counts once");
        drop((first, small));
        let events =
            |max_bytes| Memory { max_events: 1, max_bytes, max_event_bytes: 1 << 20 }.replication_buffer_events();
        assert_eq!(events(64 << 20), 64);
        assert_eq!(events(1 << 20), 16);
        // 32 MiB bodies through S3: one in the buffer, whatever the budget.
        let s3 = |max_bytes| Memory { max_events: 1, max_bytes, max_event_bytes: 32 << 20 }.replication_buffer_events();
        assert_eq!(s3(64 << 20), 1);
        assert_eq!(s3(16 << 20), 1);
        assert_eq!(s3(1 << 30), 1);
    }
}
