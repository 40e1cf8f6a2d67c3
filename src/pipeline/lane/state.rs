//! A destination's streaming state: streaming or spooling, its oldest
//! unsettled event, its last SQS error, its deferred rows not yet marked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::clock::now_unix_ms;
use crate::metrics::Metrics;
use crate::pipeline::settle::Unmarked;
use crate::policy::spool::SpoolCause;

/// Where a destination's events go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Through its lane, from the stream.
    Streaming,
    /// To the outbox table (the spool), whose drain sends them.
    Spooling,
    /// A FIFO lane back from spooling: its new events wait in its lane,
    /// neither sent nor spooled, while the drain sends what is left in the
    /// table; then it streams. Nothing is added to the spool meanwhile, so
    /// it empties under any load, and no group is overtaken.
    CatchingUp,
}

/// A destination's streaming state, shared by its lane (one per replication
/// session), the session's WAL watch, and its spool drain. It outlives
/// sessions, so a spooling lane stays spooling across a reconnect.
pub struct LaneState {
    pub name: Arc<str>,
    spool: watch::Sender<Flow>,
    /// Unix milliseconds of the lane's oldest unsettled event; 0 when none.
    oldest_unsettled_ms: AtomicU64,
    /// The last error SQS gave this lane, for the spooled rows' `last_error`.
    last_error: Mutex<String>,
    /// Why the lane spools (or last spooled), for rows spooled with no SQS
    /// error to show (sends only slow, or a hand-off).
    spool_cause: Mutex<Option<SpoolCause>>,
    /// Deferred rows handed to the settler and not marked yet; the drain does
    /// not return the lane to streaming while any are on their way.
    unmarked: Arc<Unmarked>,
    /// The server holds the stream back (or no session streams): the lane
    /// stays spooled whatever its drain achieves, until released.
    held: AtomicBool,
    /// A FIFO queue's lane.
    pub fifo: bool,
    /// The last batches-in-flight limit its lane found (0: none yet): the
    /// next session's lane starts there, not at the beginning.
    in_flight_limit: AtomicU64,
    metrics: Arc<Metrics>,
}

impl LaneState {
    pub fn new(name: &str, fifo: bool, metrics: Arc<Metrics>) -> Arc<Self> {
        metrics.lane_spooled.with_label_values(&[name]).set(0);
        Arc::new(Self {
            name: Arc::from(name),
            spool: watch::channel(Flow::Streaming).0,
            oldest_unsettled_ms: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
            spool_cause: Mutex::new(None),
            unmarked: Arc::default(),
            held: AtomicBool::new(false),
            fifo,
            in_flight_limit: AtomicU64::new(0),
            metrics,
        })
    }

    /// Whether this destination's NEW rows may be handed to the table while
    /// the stream is held: not a FIFO queue's. The WAL behind the slot may
    /// hold earlier rows of a group that the table lacks (rows their own
    /// transaction deleted, which a shard's insert-only publication cannot
    /// even tell apart); sent from the table, the later ones would overtake
    /// them. A FIFO queue's rows wait for the stream, the hold named.
    pub fn may_hand_over(&self) -> bool {
        !self.fifo
    }

    /// On the table path: spooling, or catching up with the spool.
    pub fn is_spooling(&self) -> bool {
        self.flow() != Flow::Streaming
    }

    pub fn flow(&self) -> Flow {
        *self.spool.borrow()
    }

    /// Spool from now on; logged once per switch, as a warning for a fault.
    pub fn start_spooling(&self, cause: SpoolCause) {
        match self.spool.send_replace(Flow::Spooling) {
            Flow::Streaming => {
                self.metrics.lane_spooled.with_label_values(&[&self.name]).set(1);
                self.metrics.lane_spool_switches.with_label_values(&[&self.name]).inc();
                let (reason, last_error) = (cause.to_string(), self.last_error());
                if cause.is_fault() {
                    tracing::warn!(destination = %self.name, %reason, %last_error, "lane spooling: its events go to the outbox table and the slot moves on");
                } else {
                    tracing::info!(destination = %self.name, %reason, "lane draining the outbox table first: its events go there until it is empty");
                }
                *self.spool_cause.lock().unwrap() = Some(cause);
            }
            Flow::CatchingUp => {
                tracing::warn!(destination = %self.name, reason = %cause, "lane catching up spools again: its events go to the outbox table");
                *self.spool_cause.lock().unwrap() = Some(cause);
            }
            Flow::Spooling => {}
        }
    }

    /// A spooling FIFO lane whose drain is about to empty the spool: its new
    /// events wait in the lane until the drain is done ([`Flow::CatchingUp`]).
    pub fn catch_up(&self) {
        let switched = self.spool.send_if_modified(|f| {
            let spooling = *f == Flow::Spooling;
            if spooling {
                *f = Flow::CatchingUp;
            }
            spooling
        });
        if switched {
            tracing::info!(destination = %self.name, "lane catching up: new events wait in the lane while the drain sends the rest of its spool");
        }
    }

    /// The stream is held back (`cause`): spool, and stay spooled until
    /// [`LaneState::release`], however well the drain sends.
    pub fn hold(&self, cause: SpoolCause) {
        self.held.store(true, Ordering::Relaxed);
        if self.flow() == Flow::Spooling {
            *self.spool_cause.lock().unwrap() = Some(cause);
        } else {
            self.start_spooling(cause);
        }
    }

    /// The stream moves again: the drain's usual rules decide when the lane
    /// streams (the rows handed to the table are waiting there).
    pub fn release(&self) {
        if self.held.swap(false, Ordering::Relaxed) && self.is_spooling() {
            *self.spool_cause.lock().unwrap() = Some(SpoolCause::RowsInTable);
        }
    }

    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Relaxed)
    }

    /// Stream again; logged once per switch.
    pub fn stop_spooling(&self) {
        if self.spool.send_replace(Flow::Streaming) != Flow::Streaming {
            self.metrics.lane_spooled.with_label_values(&[&self.name]).set(0);
            tracing::info!(destination = %self.name, "lane streaming again: sends succeed (a FIFO queue: and its spool is drained)");
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Flow> {
        self.spool.subscribe()
    }

    /// The limit the lane last found, if any.
    pub(crate) fn in_flight_limit(&self) -> Option<usize> {
        Some(self.in_flight_limit.load(Ordering::Relaxed) as usize).filter(|l| *l > 0)
    }

    pub(crate) fn set_in_flight_limit(&self, limit: usize) {
        self.in_flight_limit.store(limit as u64, Ordering::Relaxed);
    }

    /// Age of the oldest unsettled event, if any.
    pub fn oldest_unsettled_age(&self) -> Option<Duration> {
        match self.oldest_unsettled_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(now_unix_ms().saturating_sub(ms))),
        }
    }

    pub(crate) fn set_oldest(&self, at: Option<Instant>) {
        let ms = at.map(|t| now_unix_ms().saturating_sub(t.elapsed().as_millis() as u64).max(1)).unwrap_or(0);
        self.oldest_unsettled_ms.store(ms, Ordering::Relaxed);
    }

    /// The `last_error` of a row of this lane deferred to the table for
    /// `why`: the reason, and the last error SQS gave the lane or, with none,
    /// why the lane spools.
    pub fn deferral(&self, why: &str) -> String {
        let last = self.last_error();
        if !last.is_empty() {
            return format!("{why}: {last}");
        }
        match self.spool_cause.lock().unwrap().as_ref() {
            Some(cause) => format!("{why}: {cause}"),
            None => why.to_string(),
        }
    }

    pub fn last_error(&self) -> String {
        self.last_error.lock().unwrap().clone()
    }

    pub(crate) fn set_last_error(&self, e: String) {
        *self.last_error.lock().unwrap() = e;
    }

    /// Deferred rows not marked in the table yet.
    pub fn deferred_unmarked(&self) -> usize {
        self.unmarked.count()
    }

    /// A new session starts with no settler holding anything of this lane.
    pub fn reset_deferred(&self) {
        self.unmarked.reset();
    }

    /// A deferred row of this lane is on its way to the settler.
    /// Counted until the settler marks it.
    pub fn deferring(&self) -> Arc<Unmarked> {
        self.unmarked.add();
        Arc::clone(&self.unmarked)
    }
}

impl std::fmt::Debug for LaneState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneState").field("name", &self.name).field("spooling", &self.is_spooling()).finish()
    }
}
