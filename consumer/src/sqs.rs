//! Amazon SQS (or a compatible server) as the consumer's [`Queue`].

use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, MessageSystemAttributeName,
};

use crate::queue::{visibility_secs as secs, Queue, QueueError, ReceivedMessage};

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

    /// One `DeleteMessageBatch`; an entry that failed (or every entry, if
    /// the call did) is retried alone.
    async fn delete_batch(&self, receipts: &[String]) -> Vec<Result<(), QueueError>> {
        let entries: Vec<DeleteMessageBatchRequestEntry> = receipts
            .iter()
            .enumerate()
            .map(|(i, r)| DeleteMessageBatchRequestEntry::builder().id(i.to_string()).receipt_handle(r).build())
            .collect::<Result<_, _>>()
            .unwrap_or_default();
        let answered =
            match self.client.delete_message_batch().queue_url(&self.url).set_entries(Some(entries)).send().await {
                Ok(out) => failed_ids(out.failed.iter().map(|f| (f.id.as_str(), f.message.as_deref()))),
                Err(e) => Err(err(aws_sdk_sqs::error::DisplayErrorContext(e))),
            };
        let mut results = Vec::with_capacity(receipts.len());
        for (i, r) in receipts.iter().enumerate() {
            results.push(match &answered {
                Ok(failed) if !failed.contains(&i) => Ok(()),
                _ => self.delete(r).await,
            });
        }
        results
    }

    /// One `ChangeMessageVisibilityBatch`; failed entries retried alone.
    async fn change_visibility_batch(&self, entries: &[(String, Duration)]) -> Vec<Result<(), QueueError>> {
        let batch: Vec<ChangeMessageVisibilityBatchRequestEntry> = entries
            .iter()
            .enumerate()
            .map(|(i, (r, after))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(r)
                    .visibility_timeout(secs(*after))
                    .build()
            })
            .collect::<Result<_, _>>()
            .unwrap_or_default();
        let answered = match self
            .client
            .change_message_visibility_batch()
            .queue_url(&self.url)
            .set_entries(Some(batch))
            .send()
            .await
        {
            Ok(out) => failed_ids(out.failed.iter().map(|f| (f.id.as_str(), f.message.as_deref()))),
            Err(e) => Err(err(aws_sdk_sqs::error::DisplayErrorContext(e))),
        };
        let mut results = Vec::with_capacity(entries.len());
        for (i, (r, after)) in entries.iter().enumerate() {
            results.push(match &answered {
                Ok(failed) if !failed.contains(&i) => Ok(()),
                _ => self.change_visibility(r, *after).await,
            });
        }
        results
    }
}

/// Positions of a batch call's failed entries (their ids are positions).
fn failed_ids<'a>(failed: impl Iterator<Item = (&'a str, Option<&'a str>)>) -> Result<Vec<usize>, QueueError> {
    let mut out = Vec::new();
    for (id, message) in failed {
        let i = id.parse().map_err(|_| QueueError(format!("batch entry id {id:?} is not ours")))?;
        tracing::debug!(entry = i, message = message.unwrap_or(""), "batch entry failed; retrying it alone");
        out.push(i);
    }
    Ok(out)
}
