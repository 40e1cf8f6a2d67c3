//! What a lane's loop and its send tasks share: the lane's configuration,
//! its context (publisher, settler, metrics, state, the in-flight limit),
//! and how an entry's outcome leaves the lane (settled, or deferred to the
//! table).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::clock::now_unix_us;
use crate::metrics::Metrics;
use crate::pipeline::settings::LaneSettings;
use crate::pipeline::settle::{Due, Marking, Outcome, Settlement};
use crate::policy::concurrency::{Limiter, Signal, Ticket};
use crate::publish::kind::Target;
use crate::publish::Publisher;

use super::item::LaneItem;
use super::state::{Flow, LaneState};

/// What a lane does with an entry SQS did not take but may take later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Keep it and resend it after a backoff (the stream).
    InMemory,
    /// Defer it to the table with a time-based backoff (the table path).
    ToTable,
}

pub struct LaneConfig {
    pub name: Arc<str>,
    pub target: Target,
    /// Linger, adaptive sending and the cap of the batches in flight (the
    /// limit under it adapts: [`crate::policy::concurrency`]), as every
    /// lane has them.
    pub lanes: LaneSettings,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    pub retry: RetryPolicy,
}

impl LaneConfig {
    /// A streaming lane: entries SQS did not take are retried from memory;
    /// a lane stalled past `lane_stall_timeout` spools.
    pub fn streaming(name: &str, target: &Target, s: &LaneSettings) -> LaneConfig {
        LaneConfig {
            name: Arc::from(name),
            target: target.clone(),
            lanes: *s,
            retry_base: crate::policy::retry::IN_MEMORY_BASE,
            retry_cap: crate::policy::retry::IN_MEMORY_CAP,
            retry: RetryPolicy::InMemory,
        }
    }

    /// Spool when the oldest unsettled event is older than this: a lane
    /// that retries in memory (the stream's); a table lane never spools.
    pub fn stall_timeout(&self) -> Option<Duration> {
        (self.retry == RetryPolicy::InMemory).then_some(self.lanes.stall_timeout)
    }

    /// A lane of the table path: entries SQS did not take go back to the
    /// table with the marking's backoff; it never spools.
    pub fn table(name: Arc<str>, target: &Target, s: &LaneSettings, marking: &Marking) -> LaneConfig {
        LaneConfig {
            name,
            target: target.clone(),
            lanes: *s,
            retry_base: marking.base,
            retry_cap: marking.max,
            retry: RetryPolicy::ToTable,
        }
    }
}

pub(crate) struct Ctx {
    pub(crate) cfg: LaneConfig,
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) settle: mpsc::UnboundedSender<Settlement>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) state: Option<Arc<LaneState>>,
    /// When a failed send was last logged as a warning (at most every 5 s).
    pub(crate) last_warn: Mutex<Option<Instant>>,
    /// The lane's input closed: the session is stopping. Entries waiting to
    /// be retried in memory are abandoned (unsettled, so the slot replays
    /// them) instead of holding the shutdown.
    pub(crate) closing: watch::Sender<bool>,
    /// How many batches the lane may have in flight now.
    limiter: Mutex<Limiter>,
    /// Its batches in flight (sending, or waiting to be sent again): what
    /// the limit bounds.
    pub(super) batches: AtomicUsize,
}

impl Ctx {
    pub(super) fn new(
        cfg: LaneConfig,
        publisher: Arc<dyn Publisher>,
        settle: mpsc::UnboundedSender<Settlement>,
        metrics: Arc<Metrics>,
        state: Option<Arc<LaneState>>,
    ) -> Ctx {
        // A new session's lane goes on from the limit the last one found.
        let limiter = match state.as_ref().and_then(|s| s.in_flight_limit()) {
            Some(last) => Limiter::resume(cfg.lanes.max_in_flight, last),
            None => Limiter::new(cfg.lanes.max_in_flight),
        };
        let ctx = Ctx {
            cfg,
            publisher,
            settle,
            metrics,
            state,
            last_warn: Mutex::new(None),
            closing: watch::channel(false).0,
            limiter: Mutex::new(limiter),
            batches: AtomicUsize::new(0),
        };
        ctx.show_limit(ctx.limit());
        ctx
    }

    /// Batches the lane may have in flight now.
    pub(crate) fn limit(&self) -> usize {
        self.limiter.lock().unwrap().limit()
    }

    fn show_limit(&self, limit: usize) {
        let path = match self.cfg.retry {
            RetryPolicy::InMemory => "stream",
            RetryPolicy::ToTable => "table",
        };
        self.metrics.lane_in_flight_limit.with_label_values(&[&self.cfg.name, path]).set(limit as i64);
        if let Some(s) = &self.state {
            s.set_in_flight_limit(limit);
        }
    }

    /// A `SendMessageBatch` call of one of the lane's batches starts.
    pub(crate) fn call_starts(&self) -> Ticket {
        let others = self.batches.load(Ordering::Relaxed).saturating_sub(1);
        self.limiter.lock().unwrap().start(others)
    }

    /// The call `ticket` started ended, saying `signal` about the far end.
    pub(crate) fn call_ended(&self, ticket: Ticket, signal: Signal) {
        let mut limiter = self.limiter.lock().unwrap();
        if limiter.on(ticket, signal) {
            self.show_limit(limiter.limit());
        }
    }

    pub(crate) fn warn_due(&self) -> bool {
        let mut last = self.last_warn.lock().unwrap();
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(5)) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Hand `item`'s outcome to the settler, with what it holds (its
    /// budget permit; deferred by a stream lane, its count of unmarked rows).
    pub(crate) fn settle(&self, item: LaneItem, outcome: Outcome) {
        if matches!(outcome, Outcome::Published) {
            let lag = (now_unix_us() - item.entry.event.commit_time_us).max(0) as f64 / 1e6;
            self.metrics.commit_to_publish_seconds.observe(lag);
        }
        let unmarked = match (&outcome, &self.state) {
            (Outcome::Deferred(..), Some(s)) => Some(s.deferring()),
            _ => None,
        };
        // The settler outlives the lanes; if it is gone the pipeline is stopping
        // and the row stays NEW, to be read again.
        let settlement = Settlement::new(Arc::clone(&item.entry.event), item.txn, Arc::clone(&self.cfg.name), outcome);
        let sent = self.settle.send(settlement.holding(item.permit, unmarked));
        if let Err(mpsc::error::SendError(s)) = sent {
            if let Some(u) = s.unmarked {
                u.marked();
            }
        }
    }

    /// Defer `item` to the table, `why` said as the lane's state says it.
    pub(crate) fn defer(&self, item: LaneItem, why: &str, due: Due) {
        let text = self.state.as_ref().map(|s| s.deferral(why)).unwrap_or_else(|| why.to_string());
        self.settle(item, Outcome::Deferred(text, due));
    }
}

/// The FIFO groups of a batch's entries that did not end published or DEAD.
#[derive(Default)]
pub(crate) struct Unsent {
    /// Groups with an entry deferred to the table: their later entries must
    /// follow it there.
    pub(crate) deferred: Vec<String>,
    /// Groups with an entry abandoned unsettled (the lane is closing): it is
    /// read again from the slot, so its group's later entries must not go
    /// anywhere before it (the table path would send them first).
    pub(crate) abandoned: Vec<String>,
}

impl Unsent {
    pub(super) fn extend(&mut self, other: Unsent) {
        self.deferred.extend(other.deferred);
        self.abandoned.extend(other.abandoned);
    }
}

/// The lane defers what it holds to the table.
pub(crate) fn spooling(spool: &Option<watch::Receiver<Flow>>) -> bool {
    spool.as_ref().is_some_and(|r| *r.borrow() == Flow::Spooling)
}

/// The lane holds what it has, sending nothing, until its spool is drained.
pub(crate) fn catching_up(spool: &Option<watch::Receiver<Flow>>) -> bool {
    spool.as_ref().is_some_and(|r| *r.borrow() == Flow::CatchingUp)
}
