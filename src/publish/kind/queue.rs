//! Amazon SQS queues: `SendMessageBatch` of up to 10 entries and 1 MiB,
//! each message within the queue's `MaximumMessageSize`; FIFO queues order
//! by `MessageGroupId`; a standard queue delays a message by itself
//! (`DelaySeconds`). The entry's rules are [`crate::publish::entry`]'s (an
//! SNS message is made the same way); the error codes are here.

use std::sync::Arc;

use super::{BatchLimits, Failure, Kind, Rules, Target};
use crate::event::OutboxEvent;
use crate::metrics::Service;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::entry::{prepare_message, Entry, MessageRules};

/// The rules of SQS queues.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqsQueue;

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

    fn failure(&self, code: &str, sender_fault: bool, message: &str) -> Failure {
        failure(code, sender_fault, message)
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

/// What an SQS error means.
pub fn failure(code: &str, sender_fault: bool, message: &str) -> Failure {
    if SLOW_DOWN.contains(&code) {
        Failure::Throttled
    } else if MISSING.contains(&code) {
        Failure::Missing
    } else if PASSING.contains(&code) || !sender_fault {
        Failure::Passing
    } else if TOO_LONG.contains(&code) && message.contains(TOO_LONG_TEXT) {
        Failure::TooLong
    } else {
        Failure::Refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqs_codes() {
        assert_eq!(failure("InvalidMessageContents", true, ""), Failure::Refused);
        assert_eq!(failure("MissingParameter", true, ""), Failure::Refused);
        assert_eq!(failure("RequestThrottled", true, ""), Failure::Throttled);
        assert_eq!(failure("KMS.ThrottlingException", false, ""), Failure::Throttled);
        assert_eq!(failure("InternalError", false, ""), Failure::Passing);
        assert_eq!(failure("Anything", false, ""), Failure::Passing);
        assert_eq!(failure("AccessDenied", true, ""), Failure::Passing);
        assert_eq!(failure("transport", false, ""), Failure::Passing);
        assert_eq!(failure("AWS.SimpleQueueService.NonExistentQueue", true, ""), Failure::Missing);
        assert_eq!(failure("QueueDoesNotExist", false, ""), Failure::Missing);
        let too_long = "One or more parameters are invalid. Reason: Message must be shorter than 65536 bytes.";
        assert_eq!(failure("InvalidParameterValue", true, too_long), Failure::TooLong);
        assert_eq!(failure("InvalidParameterValue", true, "Reason: invalid attribute"), Failure::Refused);
        assert_eq!(failure("BatchRequestTooLong", true, ""), Failure::Refused);
    }
}
