//! Bodies over a queue's limit go through S3, in the Amazon SQS Extended
//! Client's format, so consumers using AWS's extended client libraries (Java,
//! Python) and `outbox_consumer` read them unchanged: the body is stored as
//! an object, and the message carries the pointer
//! `["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":…,"s3Key":…}]`
//! and the `ExtendedPayloadSize` attribute (the body's bytes).
//!
//! The object is written before its message is sent ([`write_objects`], the
//! send stage's first step): a failed write fails the call as a whole, which
//! the lane retries and, stalled, spools; no message ever points at an object
//! that was not written. An entry's key is chosen once, when it is prepared,
//! and its object written once: a retried call sends the same pointer.
//! Objects are never deleted by the relay (see docs/operations.md: a bucket
//! lifecycle rule removes them).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::CallError;
use crate::event::OutboxEvent;

/// The extended client's marker, first element of the pointer array.
pub const POINTER_CLASS: &str = "software.amazon.payloadoffloading.PayloadS3Pointer";

/// The message attribute carrying the offloaded body's size in bytes.
pub const SIZE_ATTRIBUTE: &str = "ExtendedPayloadSize";

/// The names AWS's extended clients take as "this message is a pointer"
/// (the current one and the legacy `SQSLargePayloadSize`): a row's own
/// attribute of either name would make every consumer of the queue read a
/// small inline message as a pointer and fail, so rows may not carry them,
/// whether or not their body goes through S3.
pub const RESERVED_ATTRIBUTES: [&str; 2] = [SIZE_ATTRIBUTE, "SQSLargePayloadSize"];

/// Where an object goes: S3, or memory in tests.
#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Write `body` as `bucket`/`key`.
    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<(), CallError>;

    /// Whether `bucket` exists and may be written (start-up).
    async fn check_bucket(&self, bucket: &str) -> Result<(), CallError>;

    /// Up to `max` keys under `prefix` after `after` (none: from the
    /// first), in order.
    async fn list(&self, bucket: &str, prefix: &str, after: Option<&str>, max: usize)
        -> Result<Vec<String>, CallError>;

    /// The folders right under `prefix` (common prefixes at the next `/`).
    async fn folders(&self, bucket: &str, prefix: &str) -> Result<Vec<String>, CallError>;

    /// The object `bucket`/`key`.
    async fn get(&self, bucket: &str, key: &str) -> Result<Bytes, CallError>;

    /// Delete these keys (at most 1,000).
    async fn delete(&self, bucket: &str, keys: &[String]) -> Result<(), CallError>;
}

/// When a body goes through S3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threshold {
    /// When body and attributes pass the queue's `MaximumMessageSize`.
    QueueLimit,
    /// Every body.
    Always,
    /// When body and attributes pass this many bytes (or the queue's limit).
    Bytes(usize),
}

impl Threshold {
    /// Whether a message of `size` bytes goes through S3 on a queue taking
    /// `queue_limit`.
    pub fn offloads(self, size: usize, queue_limit: usize) -> bool {
        match self {
            Threshold::QueueLimit => size > queue_limit,
            Threshold::Always => true,
            Threshold::Bytes(n) => size > n.min(queue_limit),
        }
    }
}

/// One destination's S3 settings.
pub struct OffloadTarget {
    pub store: Arc<dyn ObjectStore>,
    pub bucket: String,
    /// Prepended to every key (e.g. `outbox/orders/`).
    pub key_prefix: String,
    pub threshold: Threshold,
    /// Bodies over this many bytes are DEAD (`too_large`) even through S3.
    pub max_body: usize,
    /// The lane stall timeout the write deadline is derived from
    /// ([`crate::policy::retry::s3_write_deadline`]).
    pub stall_timeout: Duration,
}

impl fmt::Debug for OffloadTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffloadTarget")
            .field("bucket", &self.bucket)
            .field("key_prefix", &self.key_prefix)
            .field("threshold", &self.threshold)
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

impl PartialEq for OffloadTarget {
    fn eq(&self, o: &Self) -> bool {
        (&self.bucket, &self.key_prefix, self.threshold, self.max_body)
            == (&o.bucket, &o.key_prefix, o.threshold, o.max_body)
    }
}
impl Eq for OffloadTarget {}

/// An entry's body in S3: where, the pointer the message carries, and
/// whether the object is written yet (shared by the entry's clones, so a
/// retried call does not write it again).
#[derive(Debug)]
pub struct Offload {
    pub target: Arc<OffloadTarget>,
    pub key: String,
    pub pointer: String,
    written: AtomicBool,
}

impl Offload {
    /// A new object under `target`'s prefix, with a random (UUID v4) key, as
    /// the extended client names its objects: a resend after a restart
    /// writes a new object, so a consumer that deleted the first one still
    /// reads the second.
    pub fn new(target: &Arc<OffloadTarget>) -> Offload {
        let key = format!("{}{}", target.key_prefix, uuid_v4(rand::random()));
        Offload {
            pointer: pointer(&target.bucket, &key),
            target: Arc::clone(target),
            key,
            written: AtomicBool::new(false),
        }
    }

    pub fn is_written(&self) -> bool {
        self.written.load(Ordering::Acquire)
    }
}

/// The message body pointing at `bucket`/`key`, in the extended client's
/// format.
pub fn pointer(bucket: &str, key: &str) -> String {
    serde_json::json!([POINTER_CLASS, {"s3BucketName": bucket, "s3Key": key}]).to_string()
}

/// `bits` as a version 4, variant 1 UUID in its 8-4-4-4-12 form.
fn uuid_v4(bits: u128) -> String {
    let b = (bits & !(0xF << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{b:032x}");
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// The body's bytes, shared with the event (no copy of a large body).
struct BodyOf(Arc<OutboxEvent>);

impl AsRef<[u8]> for BodyOf {
    fn as_ref(&self) -> &[u8] {
        self.0.body.as_bytes()
    }
}

/// Write the objects of `bodies` (each offload with the event whose body it
/// stores) not written yet, side by side. Any failure fails them all as one
/// call: the caller sends none of the messages (the written objects stay
/// written and are not written again).
pub async fn write_objects<'a>(
    bodies: impl IntoIterator<Item = (&'a Arc<Offload>, &'a Arc<OutboxEvent>)>,
) -> Result<(), CallError> {
    let mut writes = tokio::task::JoinSet::new();
    for (o, event) in bodies {
        if o.is_written() {
            continue;
        }
        let (o, body) = (Arc::clone(o), Bytes::from_owner(BodyOf(Arc::clone(event))));
        let deadline = crate::policy::retry::s3_write_deadline(o.target.stall_timeout, body.len());
        writes.spawn(async move {
            let put = o.target.store.put(&o.target.bucket, &o.key, body);
            tokio::time::timeout(deadline, put).await.map_err(|_| CallError {
                code: "S3.timeout".into(),
                message: format!("PutObject did not answer within {deadline:?}"),
                sender_fault: false,
            })??;
            o.written.store(true, Ordering::Release);
            Ok::<(), CallError>(())
        });
    }
    let mut first_error = None;
    while let Some(done) = writes.join_next().await {
        let failed = match done {
            Ok(r) => r.err(),
            Err(e) => Some(CallError::transport(format!("S3 write task: {e}"))),
        };
        first_error = first_error.or(failed);
    }
    first_error.map_or(Ok(()), Err)
}

/// Amazon S3 (or a compatible server) through aws-sdk-s3.
#[derive(Clone, Debug)]
pub struct S3Store {
    client: aws_sdk_s3::Client,
}

impl S3Store {
    /// A client on the relay's AWS configuration ([`super::sdk::sdk_config`]);
    /// `endpoint_url` (a local server) also turns on path-style addressing.
    pub async fn new(region: &str, endpoint_url: Option<&str>, role_arn: Option<&str>) -> S3Store {
        let sdk = super::sdk::sdk_config(region, endpoint_url, role_arn).await;
        let b = aws_sdk_s3::config::Builder::from(&sdk).force_path_style(endpoint_url.is_some());
        S3Store { client: aws_sdk_s3::Client::from_conf(b.build()) }
    }
}

/// An S3 failure as a failed call: never the sender's fault, so the lane
/// retries it (and spools when it lasts), never makes rows DEAD.
fn s3_error<E>(e: aws_sdk_s3::error::SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> CallError
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let code = e.as_service_error().and_then(|s| s.code()).unwrap_or("transport");
    let message = aws_smithy_types::error::display::DisplayErrorContext(&e).to_string();
    CallError { code: format!("S3.{code}"), message, sender_fault: false }
}

#[async_trait]
impl ObjectStore for S3Store {
    /// The body is not hashed into the request's signature (SHA-256 over
    /// every byte was a sixth of the relay's CPU on 2 MiB bodies): the
    /// checksum the SDK sends with it (CRC32) keeps the object faithful,
    /// and TLS the request.
    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<(), CallError> {
        let put = self.client.put_object().bucket(bucket).key(key).body(body.into());
        put.customize().disable_payload_signing().send().await.map_err(s3_error)?;
        Ok(())
    }

    async fn check_bucket(&self, bucket: &str) -> Result<(), CallError> {
        self.client.head_bucket().bucket(bucket).send().await.map_err(s3_error)?;
        Ok(())
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, CallError> {
        let mut keys = Vec::new();
        let mut token = None;
        while keys.len() < max {
            let page = (max - keys.len()).min(1_000) as i32;
            let mut req = self.client.list_objects_v2().bucket(bucket).prefix(prefix).max_keys(page);
            req = match (&token, after) {
                (Some(t), _) => req.continuation_token(t),
                (None, Some(a)) => req.start_after(a),
                (None, None) => req,
            };
            let out = req.send().await.map_err(s3_error)?;
            keys.extend(out.contents().iter().filter_map(|o| o.key().map(str::to_string)));
            token = out.next_continuation_token().map(str::to_string);
            if token.is_none() || out.contents().is_empty() {
                break;
            }
        }
        keys.truncate(max);
        Ok(keys)
    }

    async fn folders(&self, bucket: &str, prefix: &str) -> Result<Vec<String>, CallError> {
        let mut folders = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut req = self.client.list_objects_v2().bucket(bucket).prefix(prefix).delimiter("/");
            if let Some(t) = &token {
                req = req.continuation_token(t);
            }
            let out = req.send().await.map_err(s3_error)?;
            folders.extend(out.common_prefixes().iter().filter_map(|p| p.prefix().map(str::to_string)));
            token = out.next_continuation_token().map(str::to_string);
            if token.is_none() {
                return Ok(folders);
            }
        }
    }

    async fn get(&self, bucket: &str, key: &str) -> Result<Bytes, CallError> {
        let out = self.client.get_object().bucket(bucket).key(key).send().await.map_err(s3_error)?;
        let body = out.body.collect().await.map_err(|e| CallError::transport(format!("S3 read of {key}: {e}")))?;
        Ok(body.into_bytes())
    }

    async fn delete(&self, bucket: &str, keys: &[String]) -> Result<(), CallError> {
        use aws_sdk_s3::types::{Delete, ObjectIdentifier};
        if keys.is_empty() {
            return Ok(());
        }
        let objects = keys
            .iter()
            .map(|k| ObjectIdentifier::builder().key(k).build())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CallError::transport(format!("S3 delete: {e}")))?;
        let delete = Delete::builder()
            .set_objects(Some(objects))
            .quiet(true)
            .build()
            .map_err(|e| CallError::transport(format!("S3 delete: {e}")))?;
        let out = self.client.delete_objects().bucket(bucket).delete(delete).send().await.map_err(s3_error)?;
        match out.errors().first() {
            Some(e) => Err(CallError {
                code: format!("S3.{}", e.code().unwrap_or("delete")),
                message: format!("{}: {}", e.key().unwrap_or("?"), e.message().unwrap_or("not deleted")),
                sender_fault: false,
            }),
            None => Ok(()),
        }
    }
}

/// Objects in memory, with an outage switch: for tests.
#[cfg(any(test, feature = "test-utils"))]
#[derive(Debug, Default)]
pub struct MemoryStore {
    objects: std::sync::Mutex<std::collections::BTreeMap<(String, String), Bytes>>,
    /// While set, every write fails (`S3.ServiceUnavailable`).
    pub down: AtomicBool,
    /// While set, every write waits without answering (a hung endpoint).
    pub hung: AtomicBool,
    /// Writes tried, answered or not.
    pub attempts: std::sync::atomic::AtomicUsize,
}

#[cfg(any(test, feature = "test-utils"))]
impl MemoryStore {
    /// The object `bucket`/`key`, if written.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Bytes> {
        self.objects.lock().unwrap().get(&(bucket.to_string(), key.to_string())).cloned()
    }

    /// Objects written.
    pub fn len(&self) -> usize {
        self.objects.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(any(test, feature = "test-utils"))]
#[async_trait]
impl ObjectStore for MemoryStore {
    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<(), CallError> {
        self.attempts.fetch_add(1, Ordering::AcqRel);
        if self.hung.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
        if self.down.load(Ordering::Acquire) {
            return Err(CallError {
                code: "S3.ServiceUnavailable".into(),
                message: "the memory store is down".into(),
                sender_fault: false,
            });
        }
        self.objects.lock().unwrap().insert((bucket.to_string(), key.to_string()), body);
        Ok(())
    }

    async fn check_bucket(&self, _bucket: &str) -> Result<(), CallError> {
        Ok(())
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        after: Option<&str>,
        max: usize,
    ) -> Result<Vec<String>, CallError> {
        let objects = self.objects.lock().unwrap();
        Ok(objects
            .keys()
            .filter(|(b, k)| b == bucket && k.starts_with(prefix) && after.is_none_or(|a| k.as_str() > a))
            .take(max)
            .map(|(_, k)| k.clone())
            .collect())
    }

    async fn folders(&self, bucket: &str, prefix: &str) -> Result<Vec<String>, CallError> {
        let objects = self.objects.lock().unwrap();
        let mut folders: Vec<String> = objects
            .keys()
            .filter(|(b, k)| b == bucket && k.starts_with(prefix))
            .filter_map(|(_, k)| k[prefix.len()..].find('/').map(|i| k[..prefix.len() + i + 1].to_string()))
            .collect();
        folders.dedup();
        Ok(folders)
    }

    async fn get(&self, bucket: &str, key: &str) -> Result<Bytes, CallError> {
        MemoryStore::get(self, bucket, key).ok_or_else(|| CallError {
            code: "S3.NoSuchKey".into(),
            message: format!("no object {key}"),
            sender_fault: false,
        })
    }

    async fn delete(&self, bucket: &str, keys: &[String]) -> Result<(), CallError> {
        let mut objects = self.objects.lock().unwrap();
        for k in keys {
            objects.remove(&(bucket.to_string(), k.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pointer_is_the_extended_clients() {
        assert_eq!(
            pointer("b", "k/1"),
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"b","s3Key":"k/1"}]"#
        );
        assert!(pointer("b", "quote\"d").contains(r#""s3Key":"quote\"d""#));
    }

    #[test]
    fn keys_are_version_4_uuids() {
        for bits in [0u128, u128::MAX, 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef] {
            let u = uuid_v4(bits);
            assert_eq!(u.len(), 36, "{u}");
            assert_eq!(&u[14..15], "4", "{u}");
            assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"), "{u}");
        }
        assert_ne!(uuid_v4(rand::random()), uuid_v4(rand::random()));
    }

    #[test]
    fn thresholds() {
        assert!(!Threshold::QueueLimit.offloads(1000, 1000));
        assert!(Threshold::QueueLimit.offloads(1001, 1000));
        assert!(Threshold::Always.offloads(1, 1000));
        assert!(Threshold::Bytes(10).offloads(11, 1000));
        assert!(!Threshold::Bytes(10).offloads(10, 1000));
        assert!(Threshold::Bytes(5000).offloads(1001, 1000), "never over the queue's limit");
    }
}
