//! The wall clock, in the units the pipeline compares with the database's
//! (commit times, `deliver_at`): microseconds and milliseconds since the Unix
//! epoch.

use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn now_unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    (now_unix_us() / 1000).max(0) as u64
}
