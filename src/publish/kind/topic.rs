//! Amazon SNS topics: `PublishBatch` of up to 10 entries whose sizes
//! together stay within the topic's `MaximumMessageSize` (256 KiB unless
//! the topic is set higher, up to 1 MiB), each message within it too. A
//! message is made as an SQS queue's is ([`crate::publish::entry`]): its
//! attributes reach an SQS subscription with raw delivery as they would a
//! queue, so they keep SQS's rules (at most 10, SQS's names and numbers);
//! a body over the limit goes through S3 in the format of AWS's SNS
//! extended client, which is the SQS extended client's. FIFO topics order by
//! `MessageGroupId` and deduplicate by the event id; a standard topic
//! carries the group key as `MessageGroupId` for fair queues. A topic takes
//! no per-message delay: a row due later is held in the table until due.
//! The trace context goes as the row's `traceparent` attribute: an entry of
//! `PublishBatch` has no `AWSTraceHeader`.

use std::sync::Arc;

use super::{BatchLimits, Codes, Kind, Rules, Target};
use crate::event::OutboxEvent;
use crate::metrics::Service;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::entry::{prepare_message, Entry, MessageRules};

/// The rules of SNS topics.
#[derive(Debug, Clone, Copy, Default)]
pub struct SnsTopic;

/// A topic's `MaximumMessageSize` when it does not say (SNS's default).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 262_144;

/// The longest topic name SNS takes.
pub const MAX_NAME: usize = 256;

/// `PublishBatch`'s entries.
pub const MAX_BATCH_ENTRIES: usize = 10;

impl Rules for SnsTopic {
    fn kind(&self) -> Kind {
        Kind::Topic
    }

    fn prepare(&self, event: Arc<OutboxEvent>, target: &Target) -> Result<Entry, DeadReason> {
        let rules = MessageRules {
            service: "SNS",
            noun: "topic",
            fifo: target.fifo,
            fair: target.fair,
            max_message_size: target.max_message_size(),
            offload: target.offload.as_ref(),
        };
        let entry = prepare_message(event, &rules)?;
        Ok(Entry { trace_header: None, ..entry })
    }

    /// The batch's entries together within the topic's limit.
    fn batch_limits(&self, target: &Target) -> BatchLimits {
        BatchLimits { entries: MAX_BATCH_ENTRIES, bytes: target.max_message_size() }
    }

    fn codes(&self) -> &'static Codes {
        &CODES
    }

    fn delays(&self, _: &Target) -> bool {
        false
    }

    fn held(&self, _: &Target) -> &'static str {
        "held until deliver_at: an SNS topic takes no per-message delay"
    }

    fn rejected(&self) -> DeadCode {
        DeadCode::SnsRejected
    }

    fn missing(&self) -> DeadCode {
        DeadCode::TopicNotFound
    }

    fn service(&self) -> Service {
        Service::Sns
    }

    fn call_name(&self) -> &'static str {
        "PublishBatch"
    }

    fn describe_name(&self) -> &'static str {
        "GetTopicAttributes"
    }
}

/// Codes that mean "slow down" even when SNS marks them as the sender's fault.
const SLOW_DOWN: &[&str] = &["Throttled", "ThrottledException", "Throttling", "ThrottlingException", "KMSThrottling"];

/// Codes of a topic that does not exist.
const MISSING: &[&str] = &["NotFound", "NotFoundException"];

/// Codes of the service's own trouble, and of what an operator must mend
/// (the credentials, the topic's policy, a KMS key), whoever SNS says is at
/// fault.
const PASSING: &[&str] = &[
    "InternalError",
    "InternalErrorException",
    "InternalFailure",
    "ServiceUnavailable",
    "RequestTimeout",
    "AuthorizationError",
    "AuthorizationErrorException",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidSecurity",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "UnrecognizedClientException",
    "KMSAccessDenied",
    "KMSDisabled",
    "KMSInvalidState",
    "KMSNotFound",
    "KMSOptInRequired",
    "RequestCanceled",
];

/// Codes SNS refuses a message longer than the topic's limit with, and
/// what the message then says.
const TOO_LONG: &[&str] = &["InvalidParameter", "InvalidParameterException", "InvalidParameterValue"];
const TOO_LONG_TEXT: &str = "too long";

/// SNS's error codes.
pub const CODES: Codes = Codes {
    slow_down: SLOW_DOWN,
    missing: MISSING,
    passing: PASSING,
    too_long: |code, message| TOO_LONG.contains(&code) && message.to_ascii_lowercase().contains(TOO_LONG_TEXT),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::kind::Failure;

    fn topic(fifo: bool) -> Target {
        let arn = if fifo { "arn:aws:sns:eu-west-1:1:t.fifo" } else { "arn:aws:sns:eu-west-1:1:t" };
        Target::new(Kind::Topic, arn, fifo, DEFAULT_MAX_MESSAGE_SIZE)
    }

    #[test]
    fn sns_codes() {
        assert_eq!(CODES.failure("Throttled", true, ""), Failure::Throttled);
        assert_eq!(CODES.failure("KMSThrottling", true, ""), Failure::Throttled);
        assert_eq!(CODES.failure("NotFound", true, "Topic does not exist"), Failure::Missing);
        assert_eq!(CODES.failure("AuthorizationError", true, ""), Failure::Passing);
        assert_eq!(CODES.failure("InternalError", false, ""), Failure::Passing);
        assert_eq!(CODES.failure("transport", false, ""), Failure::Passing);
        assert_eq!(
            CODES.failure(
                "InvalidParameter",
                true,
                "Invalid parameter: Message too long. Maximum size is 262144 bytes."
            ),
            Failure::TooLong
        );
        assert_eq!(CODES.failure("InvalidParameter", true, "Invalid parameter: MessageGroupId"), Failure::Refused);
        assert_eq!(CODES.failure("BatchRequestTooLong", true, ""), Failure::Refused);
    }

    #[test]
    fn names_and_arns() {
        assert_eq!(Kind::of_address("arn:aws:sns:eu-west-1:123456789012:orders"), Ok(Kind::Topic));
        assert_eq!(Kind::of_address("arn:aws-cn:sns:cn-north-1:123456789012:orders.fifo"), Ok(Kind::Topic));
        assert_eq!(Kind::of_address("https://sqs.eu-west-1.amazonaws.com/1/q"), Ok(Kind::Queue));
        for bad in ["arn:aws:sns:eu-west-1:1:", "arn:aws:sns:eu-west-1:1:a b", "arn:aws:sns:eu-west-1:1:.fifo"] {
            assert!(Kind::of_address(bad).unwrap_err().contains("cannot name a topic"), "{bad}");
        }
        assert!(Kind::of_address("arn:aws:sqs:eu-west-1:1:q").unwrap_err().contains("an ARN of \"sqs\""));
        assert!(Kind::of_address("orders").is_err());
        assert!(Kind::of_address("arn:aws:sns").is_err());
    }

    #[test]
    fn a_topic_batches_within_its_limit_holds_rows_due_later_and_has_no_trace_header() {
        let t = topic(false);
        assert_eq!(t.batch_limits(), BatchLimits { entries: 10, bytes: 262_144 });
        t.resize(1 << 20);
        assert_eq!(t.batch_limits().bytes, 1 << 20, "a topic set higher batches up to its limit");
        assert!(!t.delays());
        let mut e = OutboxEvent::for_test(1, "orders", "{}");
        e.attributes = Some(r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#.into());
        e.group_key = Some("tenant-7".into());
        let entry = t.prepare(Arc::new(e.clone())).unwrap();
        assert_eq!(entry.trace_header, None);
        assert_eq!(entry.attributes[0].name, "traceparent", "the trace context goes as the attribute");
        assert_eq!((entry.group_id.as_deref(), entry.ordered), (Some("tenant-7"), false), "fair-queue tenant");
        let fifo = topic(true).prepare(Arc::new(e.clone())).unwrap();
        assert_eq!(
            (fifo.group_id.as_deref(), fifo.ordered, fifo.dedup_id.as_deref()),
            (Some("tenant-7"), true, Some("e:1"))
        );
        e.group_key = None;
        let dead = topic(true).prepare(Arc::new(e)).unwrap_err();
        assert_eq!(dead.code, DeadCode::FifoWithoutGroup);
        assert!(dead.detail.contains("FIFO topic"), "{dead:?}");
    }
}
