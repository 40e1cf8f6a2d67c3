//! The ids SQS takes from a row: deduplication and group ids.

use sha2::{Digest, Sha256};

/// Deduplication and group ids: 1 to 128 of `[A-Za-z0-9]` and ASCII punctuation.
pub(crate) fn is_sqs_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation())
}

/// `MessageDeduplicationId` for an event: its `event_id` when SQS accepts it
/// as one, otherwise the hex SHA-256 of it (64 characters, deterministic, so a
/// resend within SQS's 5-minute window is still absorbed).
pub fn dedup_id(event_id: &str) -> String {
    if is_sqs_token(event_id) {
        event_id.to_string()
    } else {
        hex::encode(Sha256::digest(event_id.as_bytes()))
    }
}
