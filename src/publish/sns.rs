//! Amazon SNS through aws-sdk-sns: a topic's description and
//! `PublishBatch`.

use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};

use super::entry::Entry;
use super::kind::topic::DEFAULT_MAX_MESSAGE_SIZE;
use super::kind::{Kind, Target};
use super::sdk::{call_error, entry_results};
use super::{CallError, EntryResult};

/// A topic's `FifoTopic` and `MaximumMessageSize` (SNS's default when the
/// topic does not set one).
pub(super) async fn describe(client: &aws_sdk_sns::Client, topic_arn: &str) -> Result<Target, CallError> {
    let out = client.get_topic_attributes().topic_arn(topic_arn).send().await.map_err(call_error)?;
    let attrs = out.attributes.unwrap_or_default();
    let fifo = attrs.get("FifoTopic").is_some_and(|v| v == "true") || topic_arn.ends_with(".fifo");
    let max_message_size =
        attrs.get("MaximumMessageSize").and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_MAX_MESSAGE_SIZE);
    Ok(Target::new(Kind::Topic, topic_arn, fifo, max_message_size))
}

/// One `PublishBatch`.
pub(super) async fn send(
    client: &aws_sdk_sns::Client,
    topic_arn: &str,
    entries: &[Entry],
) -> Result<Vec<EntryResult>, CallError> {
    let mut req = client.publish_batch().topic_arn(topic_arn);
    for (i, e) in entries.iter().enumerate() {
        req = req.publish_batch_request_entries(request_entry(i, e)?);
    }
    let out = req.send().await.map_err(call_error)?;
    let successful = out.successful.iter().flatten().filter_map(|ok| ok.id.as_deref());
    let failed = out
        .failed
        .iter()
        .flatten()
        .map(|f| (f.id.as_str(), f.code.clone(), f.sender_fault, f.message.clone().unwrap_or_default()));
    Ok(entry_results(entries.len(), successful, failed, "PublishBatch"))
}

/// The request entry of `e`, the `i`th of its batch (its id).
fn request_entry(i: usize, e: &Entry) -> Result<PublishBatchRequestEntry, CallError> {
    let built = |err: aws_sdk_sns::error::BuildError| CallError::transport(err.to_string());
    let mut b = PublishBatchRequestEntry::builder().id(i.to_string()).message(e.message_body());
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
    b.build().map_err(built)
}
