//! Amazon SQS through aws-sdk-sqs: a queue's description and
//! `SendMessageBatch`.

use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeNameForSends, MessageSystemAttributeValue, QueueAttributeName,
    SendMessageBatchRequestEntry,
};

use super::entry::Entry;
use super::kind::Target;
use super::sdk::{call_error, entry_results};
use super::{CallError, EntryResult};

/// A queue's `MaximumMessageSize` and `FifoQueue`.
pub(super) async fn describe(client: &aws_sdk_sqs::Client, queue_url: &str) -> Result<Target, CallError> {
    let out = client
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
    let fifo =
        attrs.get(&QueueAttributeName::FifoQueue).map(|v| v == "true").unwrap_or(false) || queue_url.ends_with(".fifo");
    Ok(Target::queue(queue_url, fifo, max_message_size))
}

/// One `SendMessageBatch`.
pub(super) async fn send(
    client: &aws_sdk_sqs::Client,
    queue_url: &str,
    entries: &[Entry],
) -> Result<Vec<EntryResult>, CallError> {
    let mut req = client.send_message_batch().queue_url(queue_url);
    for (i, e) in entries.iter().enumerate() {
        req = req.entries(request_entry(i, e)?);
    }
    let out = req.send().await.map_err(call_error)?;
    let successful = out.successful.iter().map(|ok| ok.id.as_str());
    let failed = out
        .failed
        .iter()
        .map(|f| (f.id.as_str(), f.code.clone(), f.sender_fault, f.message.clone().unwrap_or_default()));
    Ok(entry_results(entries.len(), successful, failed, "SendMessageBatch"))
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
