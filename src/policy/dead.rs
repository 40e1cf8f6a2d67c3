//! Why a row is DEAD: one enum, the only source of the codes used as the
//! `reason` metric label and as the prefix of `outbox.last_error`.

/// The reasons a row is never sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadCode {
    /// `destination` is not in `[destinations]`.
    UnknownDestination,
    /// SQS refuses an empty body.
    EmptyBody,
    /// The body or an attribute has a character SQS refuses.
    InvalidCharacters,
    /// `attributes` is not what SQS accepts (shape, count, names, numbers).
    InvalidAttributes,
    /// Body and attributes over the queue's `MaximumMessageSize`.
    TooLarge,
    /// A FIFO destination and no `group_key`.
    FifoWithoutGroup,
    /// A `group_key` SQS refuses as a `MessageGroupId`.
    InvalidGroupKey,
    /// SQS refused the entry as the sender's fault (not throttling, not an
    /// operator-action code).
    SqsRejected,
    /// `deliver_at` is `infinity` (never due) or unreadable.
    InvalidDeliverAt,
    /// Routed by a queue-URL template to a queue that does not exist, or by
    /// a name no queue can have.
    QueueNotFound,
    /// SNS refused the entry as the sender's fault.
    SnsRejected,
    /// Routed by a topic-ARN template to a topic that does not exist, or by
    /// a name no topic can have.
    TopicNotFound,
    /// EventBridge refused the entry for good.
    BusRejected,
    /// An event bus that does not exist.
    BusNotFound,
    /// A body an event bus cannot take as its `Detail` (not a JSON object).
    InvalidDetail,
    /// A mapped table's row its mapping cannot read (no key, a column the
    /// mapping needs is gone, a value that is not text).
    UnreadableRow,
}

impl DeadCode {
    pub const ALL: [DeadCode; 16] = [
        DeadCode::UnknownDestination,
        DeadCode::EmptyBody,
        DeadCode::InvalidCharacters,
        DeadCode::InvalidAttributes,
        DeadCode::TooLarge,
        DeadCode::FifoWithoutGroup,
        DeadCode::InvalidGroupKey,
        DeadCode::SqsRejected,
        DeadCode::InvalidDeliverAt,
        DeadCode::QueueNotFound,
        DeadCode::SnsRejected,
        DeadCode::TopicNotFound,
        DeadCode::BusRejected,
        DeadCode::BusNotFound,
        DeadCode::InvalidDetail,
        DeadCode::UnreadableRow,
    ];

    /// The code as stored and labelled.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadCode::UnknownDestination => "unknown_destination",
            DeadCode::EmptyBody => "empty_body",
            DeadCode::InvalidCharacters => "invalid_characters",
            DeadCode::InvalidAttributes => "invalid_attributes",
            DeadCode::TooLarge => "too_large",
            DeadCode::FifoWithoutGroup => "fifo_without_group",
            DeadCode::InvalidGroupKey => "invalid_group_key",
            DeadCode::SqsRejected => "sqs_rejected",
            DeadCode::InvalidDeliverAt => "invalid_deliver_at",
            DeadCode::QueueNotFound => "queue_not_found",
            DeadCode::SnsRejected => "sns_rejected",
            DeadCode::TopicNotFound => "topic_not_found",
            DeadCode::BusRejected => "bus_rejected",
            DeadCode::BusNotFound => "bus_not_found",
            DeadCode::InvalidDetail => "invalid_detail",
            DeadCode::UnreadableRow => "unreadable_row",
        }
    }
}

impl std::fmt::Display for DeadCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A DEAD verdict: the code and what exactly was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadReason {
    pub code: DeadCode,
    pub detail: String,
}

impl DeadReason {
    pub fn new(code: DeadCode, detail: impl Into<String>) -> Self {
        Self { code, detail: detail.into() }
    }

    /// An event for a destination this relay does not know: the same text
    /// and label from the stream and from the table path.
    pub fn unknown_destination(destination: &str) -> Self {
        Self::new(
            DeadCode::UnknownDestination,
            format!("destination {destination:?} is not configured in [destinations]"),
        )
    }

    /// The text stored in `outbox.last_error`.
    pub fn last_error(&self) -> String {
        format!("{}: {}", self.code, self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for c in DeadCode::ALL {
            assert!(seen.insert(c.as_str()));
            assert!(c.as_str().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        }
        let r = DeadReason::unknown_destination("nowhere");
        assert_eq!(r.last_error(), "unknown_destination: destination \"nowhere\" is not configured in [destinations]");
    }
}
