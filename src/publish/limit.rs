//! The relay-wide cap of calls in flight to the destinations' service
//! (`max_concurrent_calls`). Each lane adapts its own calls in flight (up to
//! `max_in_flight_batches`); a thousand lanes at their limits would open a
//! connection per call, each with its buffers: thousands of sockets and
//! hundreds of MiB the byte budget does not see. Under the cap, a lane
//! waits for a call to end before it starts one.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Semaphore;

use super::entry::{Entry, QueueInfo};
use super::{CallError, EntryResult, Publisher};

/// A [`Publisher`] whose calls in flight, over every destination, are at
/// most its cap.
pub struct CallLimit {
    inner: Arc<dyn Publisher>,
    calls: Semaphore,
}

impl CallLimit {
    pub fn new(inner: Arc<dyn Publisher>, max_calls: usize) -> Self {
        CallLimit { inner, calls: Semaphore::new(max_calls.max(1)) }
    }
}

#[async_trait]
impl Publisher for CallLimit {
    async fn queue_info(&self, queue_url: &str) -> Result<QueueInfo, CallError> {
        let _call = self.calls.acquire().await.expect("never closed");
        self.inner.queue_info(queue_url).await
    }

    async fn send_batch(&self, queue_url: &str, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let _call = self.calls.acquire().await.expect("never closed");
        self.inner.send_batch(queue_url, entries).await
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
        let limited = Arc::new(CallLimit::new(Arc::new(p.clone()), 2));
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
        };
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let l = Arc::clone(&limited);
                tokio::spawn(async move { l.send_batch("q", &[entry(i)]).await })
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
