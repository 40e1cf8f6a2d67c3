//! Amazon SQS through aws-sdk-sqs.

use std::collections::HashMap;

use async_trait::async_trait;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeNameForSends, MessageSystemAttributeValue, QueueAttributeName,
    SendMessageBatchRequestEntry,
};

use aws_sdk_sqs::config::http::HttpResponse;

use super::{CallError, EntryResult, Publisher};
use crate::publish::entry::{Entry, QueueInfo};

#[derive(Clone, Debug)]
pub struct SqsPublisher {
    client: aws_sdk_sqs::Client,
}

impl SqsPublisher {
    /// A client from the standard AWS configuration chain, with `region` and an
    /// optional endpoint override. The SDK's own retries are off. A local
    /// endpoint without credentials in the environment gets dummy ones, which
    /// SQS-compatible servers accept.
    pub async fn new(region: &str, endpoint_url: Option<&str>) -> Self {
        Self::with_role(region, endpoint_url, None).await
    }

    /// As [`new`](Self::new); with `role_arn`, assume that role through STS
    /// with the chain's credentials (refreshed before they expire).
    pub async fn with_role(region: &str, endpoint_url: Option<&str>, role_arn: Option<&str>) -> Self {
        Self { client: aws_sdk_sqs::Client::new(&super::aws::sdk_config(region, endpoint_url, role_arn).await) }
    }

    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.client
    }
}

fn call_error<E>(e: SdkError<E, HttpResponse>) -> CallError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match &e {
        SdkError::ServiceError(se) => {
            let sender_fault = se.raw().status().is_client_error();
            CallError {
                code: se.err().code().unwrap_or("unknown").to_string(),
                message: se.err().message().unwrap_or("").to_string(),
                sender_fault,
            }
        }
        SdkError::TimeoutError(_) => {
            CallError { code: "timeout".into(), message: format!("{e:?}"), sender_fault: false }
        }
        _ => CallError::transport(format!("{}", aws_smithy_types::error::display::DisplayErrorContext(&e))),
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    async fn queue_info(&self, queue_url: &str) -> Result<QueueInfo, CallError> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(queue_url)
            .attribute_names(QueueAttributeName::MaximumMessageSize)
            .attribute_names(QueueAttributeName::FifoQueue)
            .send()
            .await
            .map_err(call_error)?;
        let attrs = out.attributes.unwrap_or_default();
        let max_message_size =
            attrs.get(&QueueAttributeName::MaximumMessageSize).and_then(|v| v.parse().ok()).unwrap_or(262_144);
        let fifo = attrs.get(&QueueAttributeName::FifoQueue).map(|v| v == "true").unwrap_or(false)
            || queue_url.ends_with(".fifo");
        Ok(QueueInfo::new(queue_url, fifo, max_message_size))
    }

    async fn send_batch(&self, queue_url: &str, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let mut req = self.client.send_message_batch().queue_url(queue_url);
        for (i, e) in entries.iter().enumerate() {
            let mut b = SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(e.message_body());
            for a in &e.attributes {
                let v = MessageAttributeValue::builder()
                    .data_type(a.data_type.clone())
                    .string_value(a.value.clone())
                    .build()
                    .map_err(|err| CallError::transport(err.to_string()))?;
                b = b.message_attributes(a.name.clone(), v);
            }
            if let Some(g) = &e.group_id {
                b = b.message_group_id(g.clone());
            }
            if let Some(d) = &e.dedup_id {
                b = b.message_deduplication_id(d.clone());
            }
            if let Some(d) = e.delay_seconds {
                b = b.delay_seconds(d as i32);
            }
            if let Some(t) = &e.trace_header {
                let v = MessageSystemAttributeValue::builder()
                    .data_type("String")
                    .string_value(t.clone())
                    .build()
                    .map_err(|err| CallError::transport(err.to_string()))?;
                b = b.message_system_attributes(MessageSystemAttributeNameForSends::AwsTraceHeader, v);
            }
            req = req.entries(b.build().map_err(|err| CallError::transport(err.to_string()))?);
        }
        let out = req.send().await.map_err(call_error)?;
        let mut results: Vec<Option<EntryResult>> = vec![None; entries.len()];
        for ok in out.successful {
            if let Ok(i) = ok.id.parse::<usize>() {
                if i < results.len() {
                    results[i] = Some(EntryResult::Sent);
                }
            }
        }
        let mut failed: HashMap<usize, EntryResult> = HashMap::new();
        for f in out.failed {
            if let Ok(i) = f.id.parse::<usize>() {
                failed.insert(
                    i,
                    EntryResult::Failed {
                        code: f.code,
                        sender_fault: f.sender_fault,
                        message: f.message.unwrap_or_default(),
                    },
                );
            }
        }
        Ok(results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                failed.remove(&i).or(r).unwrap_or(EntryResult::Failed {
                    // Neither successful nor failed: unknown, so send it again.
                    code: "MissingFromResponse".into(),
                    sender_fault: false,
                    message: "entry absent from the SendMessageBatch response".into(),
                })
            })
            .collect())
    }
}
