//! Spooling decisions: when a lane's events go to the table so the slot
//! moves on. A lane spools when its oldest unsettled event is older than
//! `lane_stall_timeout` ([`stalled`]), or when the slot holds more than half
//! of `max_retained_wal` and it is the lane holding the watermark back
//! ([`lane_to_spool`]). The table path returns it to streaming when sends
//! succeed, and for a FIFO queue once its spool is drained too
//! ([`may_stream_again`]).

use std::time::Duration;

/// Why a lane spools. A fault (the lane stalled, or holds the slot's WAL
/// over budget) is logged as a warning; rows already waiting in the table
/// (a new slot's hand-off, an earlier spool) are how the table path takes
/// over in order, logged as information.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpoolCause {
    /// The oldest unsettled event is older than `lane_stall_timeout`.
    Stalled { oldest: Duration, limit: Duration },
    /// The slot holds over half of `max_retained_wal` and this lane is the
    /// one holding it.
    WalBudget { held: u64, max: u64, oldest: Duration },
    /// Rows of this destination wait in the table: they go first.
    RowsInTable,
    /// The server holds the replication stream back (the cause, named).
    StreamHeld(String),
}

impl SpoolCause {
    pub fn is_fault(&self) -> bool {
        !matches!(self, SpoolCause::RowsInTable)
    }
}

impl std::fmt::Display for SpoolCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpoolCause::Stalled { oldest, limit } => write!(
                f,
                "oldest unsettled event is {:.1}s old (lane_stall_timeout {limit:?}): sends are failing or too slow",
                oldest.as_secs_f64()
            ),
            SpoolCause::WalBudget { held, max, oldest } => write!(
                f,
                "slot holds {held} bytes of WAL, over half of max_retained_wal ({max}); this lane's oldest unsettled event is {:.1}s old",
                oldest.as_secs_f64()
            ),
            SpoolCause::RowsInTable => f.write_str("rows of this destination are waiting in the outbox table"),
            SpoolCause::StreamHeld(cause) => write!(f, "the server holds the replication stream back: {cause}"),
        }
    }
}

/// A stream that has brought nothing for this long while the session waits
/// on it gets a probe (a logical message the server must send back).
pub const STREAM_QUIET: Duration = Duration::from_secs(3);

/// A probe not sent back after this long means the server holds the stream:
/// `lane_stall_timeout`, at most 10 s (a held stream holds every lane).
pub fn stream_held_after(lane_stall_timeout: Duration) -> Duration {
    lane_stall_timeout.min(Duration::from_secs(10))
}

/// Events younger than this are in normal flight, not holding the slot.
pub const MIN_HOLDING_AGE: Duration = Duration::from_secs(1);

/// A streaming lane whose oldest unsettled event is `oldest` old spools past
/// `lane_stall_timeout`.
pub fn stalled(oldest: Duration, lane_stall_timeout: Duration) -> bool {
    oldest >= lane_stall_timeout
}

/// The slot holds `held` bytes of WAL past its confirmed position. Over half
/// of `max_retained_wal` (leaving room for the WAL written while the spool
/// takes effect, so the slot stays under the budget itself), spool the
/// streaming lane whose oldest unsettled event is the oldest: it is the one
/// holding the watermark back. `ages[i]`: lane i's oldest unsettled event,
/// `None` when it has none or spools already.
pub fn lane_to_spool(held: u64, max_retained_wal: u64, ages: &[Option<Duration>]) -> Option<usize> {
    if held <= max_retained_wal / 2 {
        return None;
    }
    ages.iter()
        .enumerate()
        .filter_map(|(i, a)| a.filter(|a| *a >= MIN_HOLDING_AGE).map(|a| (a, i)))
        .max_by_key(|(a, _)| *a)
        .map(|(_, i)| i)
}

/// Whether a spooling lane streams again, after a table-path round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Not yet: its sends fail (or nothing was tried), or the stream is held.
    No,
    /// A standard queue whose drain just sent rows: at once. Order does not
    /// matter there, so the spool drains beside the stream; waiting for an
    /// empty spool would never end under a steady load, every row going
    /// through the table.
    Now,
    /// A FIFO queue whose drain sends and is within one claim of the end of
    /// its spool: the lane stops adding to the spool and holds its new
    /// events while the drain finishes ([`crate::pipeline::lane::Flow::CatchingUp`]),
    /// so the spool empties under any load and no group is overtaken.
    CatchUp,
    /// Nothing sent to judge by (a standard queue), or a FIFO queue catching
    /// up: once one query finds nothing of it waiting in the table.
    IfSpoolEmpty,
}

/// What one round of a spooling lane's drain saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct DrainRound {
    /// The server holds the stream back: the stream would bring nothing.
    pub held: bool,
    pub fifo: bool,
    /// The lane catches up already (FIFO).
    pub catching_up: bool,
    /// Rows claimed, and whether the claim was full (more may wait).
    pub claimed: usize,
    pub full: bool,
    /// Rows sent.
    pub published: usize,
    /// Whether the lane's last sends succeeded.
    pub sends_ok: bool,
    /// Deferred rows still on their way to the table.
    pub deferred_unmarked: usize,
}

/// After a round of a spooling lane's drain: does the lane stream again?
pub fn may_stream_again(r: DrainRound) -> Resume {
    let empty = r.claimed == 0 && r.deferred_unmarked == 0;
    if r.held || !r.sends_ok {
        Resume::No
    } else if !r.fifo {
        if r.published > 0 {
            Resume::Now
        } else if empty {
            Resume::IfSpoolEmpty
        } else {
            Resume::No
        }
    } else if r.catching_up {
        if empty {
            Resume::IfSpoolEmpty
        } else {
            Resume::No
        }
    } else if !r.full && (r.published > 0 || empty) {
        Resume::CatchUp
    } else {
        Resume::No
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Option<Duration> = |s| Some(Duration::from_secs(s));

    #[test]
    fn the_oldest_lane_spools_over_half_the_budget() {
        assert_eq!(lane_to_spool(100, 256, &[S(5), S(9)]), None);
        assert_eq!(lane_to_spool(200, 256, &[S(5), S(9), None]), Some(1));
        // Young events hold nothing.
        assert_eq!(lane_to_spool(200, 256, &[Some(Duration::from_millis(500)), None]), None);
        assert!(stalled(Duration::from_secs(30), Duration::from_secs(30)));
        assert!(!stalled(Duration::from_secs(29), Duration::from_secs(30)));
    }

    fn round(fifo: bool, claimed: usize, published: usize, sends_ok: bool, unmarked: usize) -> DrainRound {
        DrainRound {
            fifo,
            claimed,
            full: claimed >= 500,
            published,
            sends_ok,
            deferred_unmarked: unmarked,
            ..Default::default()
        }
    }

    #[test]
    fn a_standard_lane_streams_again_once_sends_succeed() {
        // Sends succeeding is enough, whatever is left in the table.
        assert_eq!(may_stream_again(round(false, 100, 100, true, 5)), Resume::Now);
        assert_eq!(may_stream_again(round(false, 500, 500, true, 0)), Resume::Now);
        // Nothing claimed: no evidence that sends succeed, only an empty spool.
        assert_eq!(may_stream_again(round(false, 0, 0, true, 0)), Resume::IfSpoolEmpty);
        assert_eq!(may_stream_again(round(false, 0, 0, true, 2)), Resume::No);
        assert_eq!(may_stream_again(round(false, 100, 100, false, 0)), Resume::No);
        // Claimed rows none of which went out (all DEAD, say): no proof yet.
        assert_eq!(may_stream_again(round(false, 10, 0, true, 0)), Resume::No);
    }

    #[test]
    fn a_fifo_lane_catches_up_within_a_claim_of_the_end_then_streams_once_its_spool_is_empty() {
        // Sending, and the claim was not full: catch up (whatever the load).
        assert_eq!(may_stream_again(round(true, 3, 3, true, 0)), Resume::CatchUp);
        assert_eq!(may_stream_again(round(true, 0, 0, true, 0)), Resume::CatchUp);
        // A full claim: more waits in the table.
        assert_eq!(may_stream_again(round(true, 500, 500, true, 0)), Resume::No);
        assert_eq!(may_stream_again(round(true, 0, 0, true, 1)), Resume::No);
        assert_eq!(may_stream_again(round(true, 0, 0, false, 0)), Resume::No);
        // Catching up: only an empty spool, checked by one query.
        let catching = |r: DrainRound| DrainRound { catching_up: true, ..r };
        assert_eq!(may_stream_again(catching(round(true, 0, 0, true, 0))), Resume::IfSpoolEmpty);
        assert_eq!(may_stream_again(catching(round(true, 3, 3, true, 0))), Resume::No);
        assert_eq!(may_stream_again(catching(round(true, 0, 0, true, 1))), Resume::No);
    }

    #[test]
    fn a_held_stream_keeps_every_lane_spooled() {
        for fifo in [false, true] {
            let r = DrainRound { held: true, ..round(fifo, 100, 100, true, 0) };
            assert_eq!(may_stream_again(r), Resume::No);
            let r = DrainRound { held: true, ..round(fifo, 0, 0, true, 0) };
            assert_eq!(may_stream_again(r), Resume::No);
        }
    }
}
