//! Where the consumer's messages come from: SQS, or an in-memory queue with
//! SQS's visibility, receive-count and redrive semantics (for tests and for
//! measuring the worker without a network).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use tokio::sync::Notify;

/// SQS's ceiling for a message's visibility timeout.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

#[derive(Debug, Clone)]
pub struct ReceivedMessage {
    pub body: String,
    pub receipt: String,
    /// `ApproximateReceiveCount`: 1 on the first delivery.
    pub receive_count: u32,
}

#[derive(Debug, thiserror::Error)]
#[error("queue: {0}")]
pub struct QueueError(pub String);

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// Up to `max` messages, waiting up to `wait` for the first.
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError>;
    async fn delete(&self, receipt: &str) -> Result<(), QueueError>;
    /// Make the message visible again `after` from now (capped at 12 h).
    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError>;
}

/// A queue of Amazon SQS (or a compatible server).
pub struct SqsQueue {
    client: aws_sdk_sqs::Client,
    url: String,
}

impl SqsQueue {
    pub fn new(client: aws_sdk_sqs::Client, url: impl Into<String>) -> Self {
        Self { client, url: url.into() }
    }
}

fn err<E: std::fmt::Display>(e: E) -> QueueError {
    QueueError(e.to_string())
}

fn secs(d: Duration) -> i32 {
    d.min(MAX_VISIBILITY).as_secs_f64().ceil() as i32
}

#[async_trait]
impl Queue for SqsQueue {
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, 10))
            .wait_time_seconds(wait.as_secs().min(20) as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map_err(|e| err(aws_sdk_sqs::error::DisplayErrorContext(e)))?;
        Ok(out
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(|m| ReceivedMessage {
                receive_count: m
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
                body: m.body.unwrap_or_default(),
                receipt: m.receipt_handle.unwrap_or_default(),
            })
            .collect())
    }

    async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
        self.client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| err(aws_sdk_sqs::error::DisplayErrorContext(e)))
    }

    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .visibility_timeout(secs(after))
            .send()
            .await
            .map(|_| ())
            .map_err(|e| err(aws_sdk_sqs::error::DisplayErrorContext(e)))
    }
}

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
