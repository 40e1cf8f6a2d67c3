//! Amazon SQS queues: `SendMessageBatch` of up to 10 entries and 1 MiB,
//! each message within the queue's `MaximumMessageSize`; FIFO queues order
//! by `MessageGroupId`; a standard queue delays a message by itself
//! (`DelaySeconds`). The entry's rules are [`crate::publish::entry`]'s (an
//! SNS message is made the same way); the error codes are here.

use std::sync::Arc;

use super::{BatchLimits, Codes, Kind, Rules, Target};
use crate::event::OutboxEvent;
use crate::metrics::Service;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::entry::{prepare_message, Entry, MessageRules};

/// The rules of SQS queues.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqsQueue;

/// The longest queue name SQS takes.
pub const MAX_NAME: usize = 80;

/// `SendMessageBatch`'s limits.
pub const BATCH_LIMITS: BatchLimits = BatchLimits { entries: 10, bytes: 1_048_576 };

impl Rules for SqsQueue {
    fn kind(&self) -> Kind {
        Kind::Queue
    }

    fn prepare(&self, event: Arc<OutboxEvent>, target: &Target) -> Result<Entry, DeadReason> {
        let rules = MessageRules {
            service: "SQS",
            noun: "queue",
            fifo: target.fifo,
            fair: target.fair,
            max_message_size: target.max_message_size(),
            offload: target.offload.as_ref(),
        };
        prepare_message(event, &rules)
    }

    fn batch_limits(&self, _: &Target) -> BatchLimits {
        BATCH_LIMITS
    }

    fn codes(&self) -> &'static Codes {
        &CODES
    }

    fn delays(&self, target: &Target) -> bool {
        !target.fifo
    }

    fn held(&self, target: &Target) -> &'static str {
        if target.fifo {
            "held until deliver_at: a FIFO queue takes no per-message delay"
        } else {
            "held until deliver_at: more than the 15 minutes SQS can delay a message"
        }
    }

    fn rejected(&self) -> DeadCode {
        DeadCode::SqsRejected
    }

    fn missing(&self) -> DeadCode {
        DeadCode::QueueNotFound
    }

    fn service(&self) -> Service {
        Service::Sqs
    }

    fn call_name(&self) -> &'static str {
        "SendMessageBatch"
    }

    fn describe_name(&self) -> &'static str {
        "GetQueueAttributes"
    }
}

/// Codes that mean "slow down" even when SQS marks them as the sender's fault.
const SLOW_DOWN: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "TooManyRequestsException",
    "KmsThrottled",
    "KMS.ThrottlingException",
];

/// Codes of a queue that does not exist.
const MISSING: &[&str] = &["AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"];

/// Codes of the service's own trouble, and of what an operator must mend
/// (the credentials, a permission, a KMS key), whoever SQS says is at fault.
const PASSING: &[&str] = &[
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "UnrecognizedClientException",
    "KmsAccessDenied",
    "KmsDisabled",
    "KmsNotFound",
    "KmsInvalidState",
    "KmsInvalidKeyUsage",
    "KmsOptInRequired",
    "RequestCanceled",
];

/// Codes SQS refuses an entry longer than the queue's limit with (its own,
/// and the one compatible servers use), and what the message then says.
const TOO_LONG: &[&str] = &["InvalidParameterValue", "InvalidParameterValueException", "MessageTooLong"];
const TOO_LONG_TEXT: &str = "must be shorter than";

/// SQS's error codes.
pub const CODES: Codes = Codes {
    slow_down: SLOW_DOWN,
    missing: MISSING,
    passing: PASSING,
    too_long: |code, message| TOO_LONG.contains(&code) && message.contains(TOO_LONG_TEXT),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::kind::Failure;

    #[test]
    fn sqs_codes() {
        assert_eq!(CODES.failure("InvalidMessageContents", true, ""), Failure::Refused);
        assert_eq!(CODES.failure("MissingParameter", true, ""), Failure::Refused);
        assert_eq!(CODES.failure("RequestThrottled", true, ""), Failure::Throttled);
        assert_eq!(CODES.failure("KMS.ThrottlingException", false, ""), Failure::Throttled);
        assert_eq!(CODES.failure("InternalError", false, ""), Failure::Passing);
        assert_eq!(CODES.failure("Anything", false, ""), Failure::Passing);
        assert_eq!(CODES.failure("AccessDenied", true, ""), Failure::Passing);
        assert_eq!(CODES.failure("transport", false, ""), Failure::Passing);
        assert_eq!(CODES.failure("AWS.SimpleQueueService.NonExistentQueue", true, ""), Failure::Missing);
        assert_eq!(CODES.failure("QueueDoesNotExist", false, ""), Failure::Missing);
        let too_long = "One or more parameters are invalid. Reason: Message must be shorter than 65536 bytes.";
        assert_eq!(CODES.failure("InvalidParameterValue", true, too_long), Failure::TooLong);
        assert_eq!(CODES.failure("InvalidParameterValue", true, "Reason: invalid attribute"), Failure::Refused);
        assert_eq!(CODES.failure("BatchRequestTooLong", true, ""), Failure::Refused);
    }
}
