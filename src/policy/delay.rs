//! Delayed delivery: when a row's `deliver_at` lets its message go, and how.
//!
//! - Due (or no `deliver_at`): sent now.
//! - Due within [`MAX_DELAY_SECONDS`] on a standard queue: sent now with
//!   `DelaySeconds`, rounded up to the whole second (never early, at most a
//!   second late).
//! - Due later, or on a destination that takes no per-message delay (a
//!   FIFO queue: SQS refuses one there; see [`crate::publish::kind::Rules::delays`]):
//!   held in the table. The row stays NEW with `next_attempt_at` set, its
//!   `deliver_at` keeps the table path off it until it is due (FIFO) or due
//!   within the SQS limit (standard), and the slot never waits for it.
//! - `infinity`, or a value the relay cannot read: DEAD with its reason.
//!
//! The stream judges with the relay's clock; the table path with the
//! database's (`now()` of its claim), the clock its claim filtered with.

use crate::event::DeliverAt;
use crate::policy::dead::{DeadCode, DeadReason};

/// SQS's limit on `DelaySeconds` (15 minutes).
pub const MAX_DELAY_SECONDS: i64 = 900;

/// How a row's message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Sent now, no delay.
    Now,
    /// Sent now with this `DelaySeconds` (1 to [`MAX_DELAY_SECONDS`]).
    Delay(u32),
    /// Held in the table until due.
    Hold,
}

/// The timing of a row due at `deliver_at`, judged at `now_us` (both
/// microseconds since the Unix epoch), for a destination that `delays` a
/// message by itself (a standard queue) or not (a FIFO queue).
pub fn timing(deliver_at: DeliverAt, now_us: i64, delays: bool) -> Result<Timing, DeadReason> {
    let due = match deliver_at {
        DeliverAt::Unset => return Ok(Timing::Now),
        DeliverAt::Unreadable => {
            return Err(DeadReason::new(
                DeadCode::InvalidDeliverAt,
                "deliver_at is not an ISO timestamptz the relay reads (the stream is asked for DateStyle ISO)",
            ))
        }
        DeliverAt::At(DeliverAt::NEVER) => {
            return Err(DeadReason::new(DeadCode::InvalidDeliverAt, "deliver_at is infinity: never due"))
        }
        DeliverAt::At(us) => us,
    };
    let wait_us = due.saturating_sub(now_us);
    if wait_us <= 0 {
        return Ok(Timing::Now);
    }
    let seconds = wait_us.saturating_add(999_999) / 1_000_000;
    Ok(if !delays || seconds > MAX_DELAY_SECONDS { Timing::Hold } else { Timing::Delay(seconds as u32) })
}

/// The SQL condition the table path claims with (`$h`: seconds of delay
/// the destination may carry: [`MAX_DELAY_SECONDS`] where it `delays` (a
/// standard queue), 0 otherwise (a FIFO queue)):
/// rows held longer stay out of the claim, and out of a FIFO window (a held
/// row does not hold its group back). `infinity` is claimed, to end DEAD.
pub fn claimable_sql(delays: bool) -> String {
    let horizon = if delays { MAX_DELAY_SECONDS } else { 0 };
    format!("(deliver_at IS NULL OR deliver_at <= now() + make_interval(secs => {horizon}) OR deliver_at = 'infinity')")
}

/// The SQL condition of a row held in the table and not due yet.
/// (False, not NULL, for a row without one: `NOT` it safely.)
pub const HELD_SQL: &str =
    "(status = 'NEW' AND deliver_at IS NOT NULL AND deliver_at > now() AND deliver_at <> 'infinity')";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: i64 = 1_000_000;

    #[test]
    fn the_rules_at_their_edges() {
        let now = 1_700_000_000 * S;
        let t = |at: i64, fifo: bool| timing(DeliverAt::at(at), now, !fifo).unwrap();
        assert_eq!(timing(DeliverAt::Unset, now, true).unwrap(), Timing::Now);
        assert_eq!(t(now, false), Timing::Now);
        assert_eq!(t(now - 5 * S, true), Timing::Now);
        assert_eq!(t(now + 1, false), Timing::Delay(1), "rounded up: never early");
        assert_eq!(t(now + 5 * S, false), Timing::Delay(5));
        assert_eq!(t(now + 900 * S, false), Timing::Delay(900));
        assert_eq!(t(now + 900 * S + 1, false), Timing::Hold);
        assert_eq!(t(now + 1, true), Timing::Hold, "FIFO queues take no per-message delay");
        let never = timing(DeliverAt::at(i64::MAX), now, false).unwrap_err();
        assert_eq!(never.code, DeadCode::InvalidDeliverAt);
        assert_eq!(t(DeliverAt::LATEST, false), Timing::Hold, "far is not never");
        assert_eq!(t(i64::MAX - 1, true), Timing::Hold);
        assert_eq!(timing(DeliverAt::Unreadable, now, false).unwrap_err().code, DeadCode::InvalidDeliverAt);
    }

    proptest! {
        /// A message is never delivered before its time, and a delay never
        /// exceeds what SQS takes nor comes more than a second late.
        #[test]
        fn never_early_never_over_the_limit(now in -S * 100_000_000..S * 100_000_000, wait in -S * 10_000..S * 10_000, fifo: bool) {
            match timing(DeliverAt::at(now + wait), now, !fifo).unwrap() {
                Timing::Now => prop_assert!(wait <= 0),
                Timing::Delay(s) => {
                    prop_assert!(!fifo);
                    prop_assert!((1..=MAX_DELAY_SECONDS).contains(&i64::from(s)));
                    prop_assert!(i64::from(s) * S >= wait && i64::from(s) * S - wait < S);
                }
                Timing::Hold => prop_assert!(wait > 0 && (fifo || wait > MAX_DELAY_SECONDS * S)),
            }
        }
    }
}
