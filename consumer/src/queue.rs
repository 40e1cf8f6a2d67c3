//! Where the consumer's messages come from: a [`Queue`] — SQS
//! ([`crate::sqs::SqsQueue`], feature `sqs`), or an in-memory queue with SQS's
//! visibility, receive-count and redrive semantics
//! ([`crate::memory::MemoryQueue`], feature `test-utils`).

use std::time::Duration;

use async_trait::async_trait;

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

/// Seconds for SQS's visibility parameters: rounded up, at most 12 h.
pub fn visibility_secs(d: Duration) -> i32 {
    d.min(MAX_VISIBILITY).as_secs_f64().ceil() as i32
}
