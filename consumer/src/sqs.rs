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
    /// Reads the bodies the relay put in S3.
    #[cfg(feature = "s3")]
    s3: Option<aws_sdk_s3::Client>,
}

impl SqsQueue {
    pub fn new(client: aws_sdk_sqs::Client, url: impl Into<String>) -> Self {
        Self {
            client,
            url: url.into(),
            #[cfg(feature = "s3")]
            s3: None,
        }
    }

    /// Bodies over the queue's limit, which the relay wrote to S3 (the SQS
    /// Extended Client's pointer and `ExtendedPayloadSize`), are read from
    /// S3 with `s3` before the message is judged. The object is never
    /// deleted here: a duplicate delivery may still point at it (a bucket
    /// lifecycle rule removes it).
    #[cfg(feature = "s3")]
    pub fn with_s3(mut self, s3: aws_sdk_s3::Client) -> Self {
        self.s3 = Some(s3);
        self
    }
}

/// The message attributes that mark a body in S3: the extended clients'
/// current name and their legacy one.
pub const S3_SIZE_ATTRIBUTES: [&str; 2] = ["ExtendedPayloadSize", "SQSLargePayloadSize"];

/// The (bucket, key) of an extended client's pointer body
/// (`["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":…,"s3Key":…}]`).
pub fn s3_pointer(body: &str) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let [class, p] = v.as_array()?.as_slice() else { return None };
    if !class.as_str()?.ends_with("PayloadS3Pointer") {
        return None;
    }
    Some((p.get("s3BucketName")?.as_str()?.to_string(), p.get("s3Key")?.as_str()?.to_string()))
}

impl SqsQueue {
    /// A message whose body is in S3 with its body read from there; `None`
    /// when the read failed (the message is left to come back after its
    /// visibility timeout, and to the DLQ if it never can be read). Without
    /// an S3 client the pointer is handed on as the body (it is no job, so
    /// it is neither run nor deleted: SQS's redrive moves it to the DLQ).
    async fn resolved(&self, m: ReceivedMessage, in_s3: bool) -> Option<ReceivedMessage> {
        let Some((bucket, key)) = s3_pointer(&m.body).filter(|_| in_s3) else { return Some(m) };
        #[cfg(feature = "s3")]
        if let Some(s3) = &self.s3 {
            let read = async {
                let obj = s3
                    .get_object()
                    .bucket(&bucket)
                    .key(&key)
                    .send()
                    .await
                    .map_err(|e| aws_sdk_s3::error::DisplayErrorContext(e).to_string())?;
                let bytes = obj.body.collect().await.map_err(|e| e.to_string())?.into_bytes();
                String::from_utf8(bytes.to_vec()).map_err(|e| e.to_string())
            };
            return match read.await {
                Ok(body) => Some(ReceivedMessage { body, ..m }),
                Err(e) => {
                    tracing::warn!(bucket, key, error = %e, "a message's body in S3 could not be read; it comes back after its visibility timeout");
                    None
                }
            };
        }
        tracing::warn!(bucket, key, "a message's body is in S3 and this queue has no S3 client (SqsQueue::with_s3)");
        Some(m)
    }
}

/// The message attributes a receive asks for: the S3 pointer's size and the
/// trace context.
fn received_attributes() -> Vec<String> {
    S3_SIZE_ATTRIBUTES.iter().chain(&[TRACEPARENT]).map(|s| s.to_string()).collect()
}

/// The W3C trace-context attribute the relay carries.
pub const TRACEPARENT: &str = "traceparent";

/// The producer's trace context: the `traceparent` attribute, or the
/// `AWSTraceHeader` system attribute turned back into one.
fn traceparent_of(m: &aws_sdk_sqs::types::Message) -> Option<String> {
    let attr = m.message_attributes.as_ref().and_then(|a| a.get(TRACEPARENT)).and_then(|v| v.string_value.clone());
    attr.or_else(|| {
        let header = m.attributes.as_ref()?.get(&MessageSystemAttributeName::AwsTraceHeader)?;
        traceparent_from_xray(header)
    })
}

/// An X-Ray trace header (`Root=1-<8 hex>-<24 hex>;Parent=<16 hex>;Sampled=<0|1>`)
/// as a W3C `traceparent`; `None` without a root and a parent.
pub fn traceparent_from_xray(header: &str) -> Option<String> {
    let field = |name: &str| header.split(';').find_map(|kv| kv.trim().strip_prefix(name)?.strip_prefix('='));
    let root: Vec<&str> = field("Root")?.split('-').collect();
    let parent = field("Parent")?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let ["1", epoch, unique] = root[..] else { return None };
    if !hex(epoch, 8) || !hex(unique, 24) || !hex(parent, 16) {
        return None;
    }
    let sampled = if field("Sampled") == Some("1") { "01" } else { "00" };
    Some(format!("00-{epoch}{unique}-{parent}-{sampled}").to_ascii_lowercase())
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
            .message_system_attribute_names(MessageSystemAttributeName::AwsTraceHeader)
            .set_message_attribute_names(Some(received_attributes()))
            .send()
            .await
            .map_err(|e| err(aws_sdk_sqs::error::DisplayErrorContext(e)))?;
        let mut received = Vec::new();
        for m in out.messages.unwrap_or_default() {
            let in_s3 =
                m.message_attributes.as_ref().is_some_and(|a| S3_SIZE_ATTRIBUTES.iter().any(|n| a.contains_key(*n)));
            let message = ReceivedMessage {
                receive_count: m
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
                traceparent: traceparent_of(&m),
                body: m.body.unwrap_or_default(),
                receipt: m.receipt_handle.unwrap_or_default(),
            };
            match self.resolved(message, in_s3).await {
                Some(m) => received.push(m),
                None => continue,
            }
        }
        Ok(received)
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

#[cfg(test)]
mod tests {
    use super::{s3_pointer, traceparent_from_xray};

    #[test]
    fn an_xray_header_turns_back_into_the_producers_traceparent() {
        let header = "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1";
        assert_eq!(
            traceparent_from_xray(header).as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let unsampled = "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=0";
        assert!(traceparent_from_xray(unsampled).unwrap().ends_with("-00"));
        for bad in [
            "",
            "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736",
            "Root=2-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7",
        ] {
            assert_eq!(traceparent_from_xray(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_extended_clients_pointer_is_read_and_nothing_else() {
        let p = r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"b","s3Key":"outbox/k"}]"#;
        assert_eq!(s3_pointer(p), Some(("b".into(), "outbox/k".into())));
        let other_class = r#"["com.example.Pointer",{"s3BucketName":"b","s3Key":"k"}]"#;
        assert_eq!(s3_pointer(other_class), None);
        for other in [r#"{"job_id": "x"}"#, "not json", "[]", r#"["x.PayloadS3Pointer", {"s3Key": "k"}]"#] {
            assert_eq!(s3_pointer(other), None, "{other}");
        }
    }
}
