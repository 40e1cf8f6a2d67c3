//! The send stage: a destination's [`kind::Target`] (its [`kind`] and
//! what it enforces), the [`entry::Entry`] made from a row for it, and the
//! network call, one batch to one destination. [`aws::AwsPublisher`] talks
//! to AWS (its SDK retries are off: [`crate::policy::retry`] is the only
//! place that retries); [`memory::MemoryPublisher`] keeps messages in
//! memory and injects faults, for tests.

pub mod aws;
pub mod entry;
pub mod events;
pub mod kind;
pub mod limit;
#[cfg(any(test, feature = "test-utils"))]
pub mod memory;
pub mod offload;
pub mod sdk;
pub mod sns;
pub mod sqs;
pub mod template;

use async_trait::async_trait;

use crate::publish::entry::Entry;
use crate::publish::kind::{Kind, Target};

/// The outcome of one entry of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryResult {
    Sent,
    Failed { code: String, sender_fault: bool, message: String },
}

/// A call that failed as a whole: nothing is known to have been accepted.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct CallError {
    /// The service's error code, or `transport` / `timeout` when no answer came.
    pub code: String,
    pub message: String,
    /// The service blamed the request (4xx), not itself or the network.
    pub sender_fault: bool,
}

impl CallError {
    pub fn transport(message: impl Into<String>) -> Self {
        Self { code: "transport".into(), message: message.into(), sender_fault: false }
    }
}

#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// The destination of `kind` at `address` as its service describes it
    /// (a queue's `MaximumMessageSize` and `FifoQueue`); fails when it does
    /// not answer.
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError>;

    /// Send a batch within `target`'s [`Target::batch_limits`]; one result
    /// per entry, in the same order.
    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError>;

    /// The relay-wide cap of batches formed and not settled, if there is
    /// one ([`limit::CallLimit`]): a lane takes a slot before it forms a
    /// batch, so batches do not wait for a call in memory of their own.
    fn batch_slots(&self) -> Option<std::sync::Arc<tokio::sync::Semaphore>> {
        None
    }
}

/// A read of a destination's attributes that has not answered in this long
/// is a failure that may pass.
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Read `target`'s `MaximumMessageSize` again (destination `name`'s); a
/// changed one holds from then on for every copy of its description (the
/// router's, every lane's). The limit read, or why it could not be.
pub async fn reread_limit(publisher: &dyn Publisher, name: &str, target: &Target) -> Result<usize, String> {
    let now = match tokio::time::timeout(READ_TIMEOUT, publisher.describe(target.kind, &target.address)).await {
        Ok(Ok(info)) => info.max_message_size(),
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no answer within {READ_TIMEOUT:?}")),
    };
    let was = target.max_message_size();
    if now != was {
        tracing::warn!(destination = %name, was, now, kind = %target.kind, "the destination's MaximumMessageSize changed: its rows are judged by the new one");
        target.resize(now);
    }
    Ok(now)
}
