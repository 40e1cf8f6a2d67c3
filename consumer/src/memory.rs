//! An in-memory [`Queue`] with SQS's visibility, receive-count and redrive
//! semantics: for tests and for measuring the worker without a network.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::queue::{Queue, QueueError, ReceivedMessage, MAX_VISIBILITY};

struct Stored {
    id: u64,
    body: String,
    visible_at: Instant,
    receive_count: u32,
    /// The receipt of the latest delivery; older receipts no longer act.
    receipt: String,
}

#[derive(Default)]
struct MemInner {
    messages: VecDeque<Stored>,
    next_id: u64,
    deliveries: u64,
    deletes: u64,
    visibility_changes: u64,
}

/// An in-memory queue: visibility timeout, receive counts, and a redrive
/// policy moving a message to `dlq` once received `max_receive` times.
#[derive(Clone)]
pub struct MemoryQueue {
    inner: Arc<Mutex<MemInner>>,
    notify: Arc<Notify>,
    visibility: Duration,
    redrive: Option<(Box<MemoryQueue>, u32)>,
}

impl MemoryQueue {
    pub fn new(visibility: Duration) -> Self {
        Self { inner: Arc::default(), notify: Arc::new(Notify::new()), visibility, redrive: None }
    }

    pub fn with_dlq(mut self, dlq: MemoryQueue, max_receive: u32) -> Self {
        self.redrive = Some((Box::new(dlq), max_receive));
        self
    }

    pub fn send(&self, body: impl Into<String>) {
        let mut i = self.inner.lock().unwrap();
        let id = i.next_id;
        i.next_id += 1;
        i.messages.push_back(Stored {
            id,
            body: body.into(),
            visible_at: Instant::now(),
            receive_count: 0,
            receipt: String::new(),
        });
        drop(i);
        self.notify.notify_waiters();
    }

    /// Messages still in the queue (visible or not).
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (deliveries, deletes, visibility changes) so far.
    pub fn counters(&self) -> (u64, u64, u64) {
        let i = self.inner.lock().unwrap();
        (i.deliveries, i.deletes, i.visibility_changes)
    }

    fn take(&self, max: usize) -> Vec<ReceivedMessage> {
        let now = Instant::now();
        let mut i = self.inner.lock().unwrap();
        let mut out = Vec::new();
        let mut moved = Vec::new();
        for m in i.messages.iter_mut() {
            if out.len() >= max {
                break;
            }
            if m.visible_at > now {
                continue;
            }
            if let Some((_, max_receive)) = &self.redrive {
                if m.receive_count >= *max_receive {
                    moved.push(m.id);
                    continue;
                }
            }
            m.receive_count += 1;
            m.visible_at = now + self.visibility;
            m.receipt = format!("{}:{}", m.id, m.receive_count);
            out.push(ReceivedMessage {
                body: m.body.clone(),
                receipt: m.receipt.clone(),
                receive_count: m.receive_count,
                traceparent: None,
            });
        }
        i.deliveries += out.len() as u64;
        if !moved.is_empty() {
            let mut bodies = Vec::new();
            i.messages.retain(|m| {
                if moved.contains(&m.id) {
                    bodies.push(m.body.clone());
                    false
                } else {
                    true
                }
            });
            drop(i);
            if let Some((dlq, _)) = &self.redrive {
                for b in bodies {
                    dlq.send(b);
                }
            }
        }
        out
    }
}

#[async_trait]
impl Queue for MemoryQueue {
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
        let end = Instant::now() + wait;
        loop {
            let notified = self.notify.notified();
            let got = self.take(max.clamp(1, 10) as usize);
            if !got.is_empty() || Instant::now() >= end {
                return Ok(got);
            }
            // Wake on a send, or soon, for messages becoming visible again.
            let _ = tokio::time::timeout(Duration::from_millis(20).min(end - Instant::now()), notified).await;
        }
    }

    async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
        let mut i = self.inner.lock().unwrap();
        let before = i.messages.len();
        i.messages.retain(|m| m.receipt != receipt);
        if i.messages.len() < before {
            i.deletes += 1;
        }
        Ok(())
    }

    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError> {
        let mut i = self.inner.lock().unwrap();
        i.visibility_changes += 1;
        if let Some(m) = i.messages.iter_mut().find(|m| m.receipt == receipt) {
            m.visible_at = Instant::now() + after.min(MAX_VISIBILITY);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQS's redrive policy: a message received `max_receive` times and not
    /// deleted moves to the dead-letter queue on the next receive.
    #[tokio::test]
    async fn a_message_received_too_often_moves_to_the_dead_letter_queue() {
        let dlq = MemoryQueue::new(Duration::from_secs(30));
        let q = MemoryQueue::new(Duration::ZERO).with_dlq(dlq.clone(), 2);
        q.send("m");
        for n in 1..=2 {
            let got = q.receive(1, Duration::ZERO).await.unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].receive_count, n);
        }
        assert!(q.receive(1, Duration::ZERO).await.unwrap().is_empty());
        assert!(q.is_empty());
        let moved = dlq.receive(1, Duration::ZERO).await.unwrap();
        assert_eq!(moved.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), ["m"]);
    }
}
