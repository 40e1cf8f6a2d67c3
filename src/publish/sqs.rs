//! Amazon SQS through aws-sdk-sqs.

use async_trait::async_trait;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeNameForSends, MessageSystemAttributeValue, QueueAttributeName,
    SendMessageBatchRequestEntry,
};

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::operation::send_message_batch::SendMessageBatchOutput;

use super::{CallError, EntryResult, Publisher};
use crate::publish::entry::Entry;
use crate::publish::kind::{Kind, Target};

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
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        match kind {
            Kind::Queue => self.queue(address).await,
        }
    }

    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        match target.kind {
            Kind::Queue => self.send_message_batch(&target.address, entries).await,
        }
    }
}

impl SqsPublisher {
    /// A queue's `MaximumMessageSize` and `FifoQueue`.
    async fn queue(&self, queue_url: &str) -> Result<Target, CallError> {
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
        Ok(Target::queue(queue_url, fifo, max_message_size))
    }

    async fn send_message_batch(&self, queue_url: &str, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let mut req = self.client.send_message_batch().queue_url(queue_url);
        for (i, e) in entries.iter().enumerate() {
            req = req.entries(request_entry(i, e)?);
        }
        let out = req.send().await.map_err(call_error)?;
        Ok(entry_results(entries.len(), out))
    }
}

/// The request entry of `e`, the `i`th of its batch (its id).
fn request_entry(i: usize, e: &Entry) -> Result<SendMessageBatchRequestEntry, CallError> {
    let built = |err: aws_sdk_sqs::error::BuildError| CallError::transport(err.to_string());
    let mut b = SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(e.message_body());
    for a in &e.attributes {
        let v = MessageAttributeValue::builder()
            .data_type(a.data_type.clone())
            .string_value(a.value.clone())
            .build()
            .map_err(built)?;
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
            .map_err(built)?;
        b = b.message_system_attributes(MessageSystemAttributeNameForSends::AwsTraceHeader, v);
    }
    b.build().map_err(built)
}

/// Each of the batch's `n` entries' result, by the ids `request_entry` gave
/// them; an entry the response leaves out is unknown, so sent again.
fn entry_results(n: usize, out: SendMessageBatchOutput) -> Vec<EntryResult> {
    let mut results: Vec<Option<EntryResult>> = vec![None; n];
    let mut place = |id: &str, r: EntryResult| {
        if let Some(slot) = id.parse::<usize>().ok().and_then(|i| results.get_mut(i)) {
            // A failure reported beside a success for one id wins.
            if slot.is_none() || matches!(r, EntryResult::Failed { .. }) {
                *slot = Some(r);
            }
        }
    };
    for ok in out.successful {
        place(&ok.id, EntryResult::Sent);
    }
    for f in out.failed {
        let failed =
            EntryResult::Failed { code: f.code, sender_fault: f.sender_fault, message: f.message.unwrap_or_default() };
        place(&f.id, failed);
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or(EntryResult::Failed {
                code: "MissingFromResponse".into(),
                sender_fault: false,
                message: "entry absent from the SendMessageBatch response".into(),
            })
        })
        .collect()
}
