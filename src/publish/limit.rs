//! The relay-wide cap of calls in flight to the destinations' service
//! (`max_concurrent_calls`). Each lane adapts its own calls in flight (up to
//! `max_in_flight_batches`); a thousand lanes at their limits would open a
//! connection per call, each with its buffers: thousands of sockets and
//! hundreds of MiB the byte budget does not see. Under the cap, a lane
//! waits for a call to end before it starts one.
//!
//! The same number caps the batches formed: a lane takes a [`BatchSlot`]
//! before it takes a batch from what it holds. A batch formed and waiting
//! for a call holds a task and its entries' copies; a thousand lanes each
//! forming batches that wait held 20 MB of them, and sent batches of one
//! entry where, waiting unformed, ten accumulate.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::entry::Entry;
use super::kind::{Kind, Target};
use super::{CallError, EntryResult, Publisher};

/// A [`Publisher`] whose calls in flight, over every destination, are at
/// most its cap in number and in bytes, and whose lanes form at most that
/// many batches at once.
pub struct CallLimit {
    inner: Arc<dyn Publisher>,
    calls: Semaphore,
    /// Bytes of the batches in calls: the request the client builds and
    /// sends is a copy of its entries, which the byte budget counts once.
    bytes: Semaphore,
    max_bytes: u32,
    batches: Arc<Semaphore>,
}

impl CallLimit {
    /// At most `max_calls` calls and `max_bytes` of batches in them (one
    /// batch larger than that goes alone).
    pub fn new(inner: Arc<dyn Publisher>, max_calls: usize, max_bytes: u64) -> Self {
        let max = max_calls.max(1);
        let max_bytes = max_bytes.clamp(1, u64::from(u32::MAX >> 3)) as u32;
        CallLimit {
            inner,
            calls: Semaphore::new(max),
            bytes: Semaphore::new(max_bytes as usize),
            max_bytes,
            batches: Arc::new(Semaphore::new(max)),
        }
    }
}

#[async_trait]
impl Publisher for CallLimit {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        let _call = self.calls.acquire().await.expect("never closed");
        self.inner.describe(kind, address).await
    }

    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let size = entries.iter().map(|e| e.size).sum::<usize>().clamp(1, self.max_bytes as usize) as u32;
        let _bytes = self.bytes.acquire_many(size).await.expect("never closed");
        let _call = self.calls.acquire().await.expect("never closed");
        self.inner.send_batch(target, entries).await
    }

    fn batch_slots(&self) -> Option<Arc<Semaphore>> {
        Some(Arc::clone(&self.batches))
    }
}

/// A batch's place under the cap of batches formed ([`Publisher::batch_slots`]),
/// held from its forming until it is settled, but for its waits to retry: a
/// destination that fails does not keep the others' batches from forming.
pub struct BatchSlot {
    slots: Option<Arc<Semaphore>>,
    held: Option<OwnedSemaphorePermit>,
}

impl BatchSlot {
    /// A slot under no cap.
    pub fn free() -> Self {
        BatchSlot { slots: None, held: None }
    }

    /// One of `slots`, if one is free now.
    pub fn try_take(slots: &Arc<Semaphore>) -> Option<Self> {
        let held = Arc::clone(slots).try_acquire_owned().ok()?;
        Some(BatchSlot { slots: Some(Arc::clone(slots)), held: Some(held) })
    }

    /// One of `slots`, once one is free (in the order asked).
    pub async fn take(slots: Arc<Semaphore>) -> Self {
        let held = Arc::clone(&slots).acquire_owned().await.expect("never closed");
        BatchSlot { slots: Some(slots), held: Some(held) }
    }

    /// Give the slot back while the batch waits to retry.
    pub fn release(&mut self) {
        self.held = None;
    }

    /// Take a slot again after [`BatchSlot::release`].
    pub async fn retake(&mut self) {
        if let (Some(slots), None) = (&self.slots, &self.held) {
            self.held = Some(Arc::clone(slots).acquire_owned().await.expect("never closed"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::memory::MemoryPublisher;
    use std::time::Duration;

    #[tokio::test]
    async fn calls_beyond_the_cap_wait_for_one_to_end() {
        let p = MemoryPublisher::new();
        p.add_queue("q", false, 262_144);
        p.close_gate();
        let limited = Arc::new(CallLimit::new(Arc::new(p.clone()), 2, 1 << 20));
        let entry = |i: usize| Entry {
            event: Arc::new(crate::event::OutboxEvent::for_test(i as i64, "d", "x")),
            attributes: vec![],
            size: 1,
            group_id: None,
            ordered: false,
            trace_header: None,
            dedup_id: None,
            offload: None,
            delay_seconds: None,
            bus: None,
        };
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let l = Arc::clone(&limited);
                tokio::spawn(async move { l.send_batch(&Target::queue("q", false, 262_144), &[entry(i)]).await })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while p.calls_started() < 2 {
            assert!(tokio::time::Instant::now() < deadline, "two calls never started");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(limited.calls.available_permits(), 0);
        assert_eq!(p.calls_started(), 2, "the third waits for a permit");
        p.open_gate();
        for c in calls {
            assert!(c.await.unwrap().is_ok());
        }
        assert_eq!(p.sent("q").len(), 3);
        assert_eq!(p.peak_in_flight(), 2);
    }
}
