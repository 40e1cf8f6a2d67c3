//! What settlement speaks of: how an event ended ([`Outcome`]), when a
//! deferred row is due ([`Due`]), one event's settlement, and the marking's
//! settings.

use std::sync::Arc;
use std::time::Duration;

use crate::config::PublishedRows;
use crate::db::schema::RowStatus;
use crate::event::{Origin, OutboxEvent};
use crate::pipeline::watermark::TxnSeq;
use crate::policy::dead::DeadReason;

/// How one event ended, as far as this relay is concerned.
#[derive(Debug, Clone)]
pub enum Outcome {
    Published,
    Dead(DeadReason),
    /// Not sent now: the row stays NEW with `next_attempt_at` set and the
    /// table path sends it. The text becomes `last_error`.
    Deferred(String, Due),
}

/// When a deferred row is due in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Its send failed: after the retry policy's backoff on its attempts.
    Backoff,
    /// It was never tried (its lane spools because it is behind, or it
    /// follows an earlier entry of its group): at once.
    Now,
    /// Its `deliver_at` is later than SQS can delay it: at once as far as
    /// `next_attempt_at` goes, and the table path claims it when its
    /// `deliver_at` allows ([`crate::policy::delay`]).
    Held,
}

impl Due {
    /// The code the marking statements take (`u.defer`): 0 not deferred.
    pub(super) fn code(self) -> i16 {
        match self {
            Due::Backoff => 1,
            Due::Now | Due::Held => 2,
        }
    }
}

/// One event's settlement, on its way to the settler.
#[derive(Debug)]
pub struct Settlement {
    /// The row as it was read (stream or table): its id and event id say
    /// which row to mark; if that row is gone from the table and the event
    /// was not published, it is written back from here.
    pub event: Arc<OutboxEvent>,
    /// `None`: not tied to the stream's watermark (table path).
    pub txn: Option<TxnSeq>,
    pub destination: Arc<str>,
    pub outcome: Outcome,
    /// Returned to the pipeline's budget of unsettled events when dropped.
    pub permit: Option<crate::pipeline::budget::Permit>,
    /// A deferred event of a streaming lane: its lane's count of deferred
    /// rows not yet marked, decremented once it is.
    pub unmarked: Option<Arc<Unmarked>>,
}

impl Settlement {
    /// A settlement with no budget permit and no lane count attached.
    pub fn new(event: Arc<OutboxEvent>, txn: Option<TxnSeq>, destination: Arc<str>, outcome: Outcome) -> Self {
        Settlement { event, txn, destination, outcome, permit: None, unmarked: None }
    }

    /// The same, holding its event's budget permit and (a deferred event
    /// of a streaming lane) its lane's count of unmarked rows.
    pub fn holding(self, permit: Option<crate::pipeline::budget::Permit>, unmarked: Option<Arc<Unmarked>>) -> Self {
        Settlement { permit, unmarked, ..self }
    }

    /// Its row's id in the relay's table (a mapped row has none).
    pub fn id(&self) -> Option<i64> {
        self.event.row_id()
    }

    /// Its row is in the relay's table, marked there by its id
    /// ([`Origin::Own`]); any other is settled without a row of it there,
    /// or written there if it did not go out.
    pub fn has_row(&self) -> bool {
        matches!(self.event.origin, Origin::Own { .. })
    }

    /// What tells settlements of one flush apart: the event id (unique),
    /// not the row id (a reused id can stand for two rows in one flush).
    pub fn key(&self) -> &str {
        &self.event.event_id
    }
}

/// Deferred rows of one lane handed to the settler and not marked yet: the
/// spool drain does not return the lane to streaming while any are on their
/// way (their rows are not in the table yet).
#[derive(Debug, Default)]
pub struct Unmarked(std::sync::atomic::AtomicUsize);

impl Unmarked {
    pub fn add(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn marked(&self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn reset(&self) {
        self.0.store(0, std::sync::atomic::Ordering::Release);
    }
}

/// How rows are recorded: the backoff of deferred rows (`base * 2^attempts`,
/// capped, as time) and what becomes of published ones.
#[derive(Debug, Clone, Copy)]
pub struct Marking {
    pub base: Duration,
    pub max: Duration,
    pub published: PublishedRows,
    /// CDC mode: a row written back without a commit position (a mapped
    /// table's claim) gets the WAL's insert position, so rows of its group
    /// the stream hands over later, which committed later, follow it. In
    /// polling mode it stays without one, and follows every row that has
    /// one (as rows the poller has not claimed yet do).
    pub bound_unpositioned: bool,
}

/// A settlement's status, `last_error` and deferral code ([`Due::code`]),
/// as the marking statements take them.
pub(super) fn columns(outcome: &Outcome) -> (&'static str, Option<String>, i16) {
    let (status, error, due) = match outcome {
        Outcome::Published => (RowStatus::Published, None, 0),
        Outcome::Dead(r) => (RowStatus::Dead, Some(r.last_error()), 0),
        Outcome::Deferred(e, due) => (RowStatus::New, Some(e.clone()), due.code()),
    };
    (status.as_str(), error, due)
}

/// An event's place in its transaction as the `commit_seq` column takes it.
pub(crate) fn seq_param(ev: &OutboxEvent) -> Option<i32> {
    ev.commit().map(|c| i32::try_from(c.seq).unwrap_or(i32::MAX))
}
