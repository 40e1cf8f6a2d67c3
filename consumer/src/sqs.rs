//! Amazon SQS (or a compatible server) as the consumer's [`Queue`].

use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;

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
}
