//! A lane: one destination's queue. It batches entries (at most 10, at most
//! 1 MiB, a short linger), keeps several batches in flight, reconciles each
//! `SendMessageBatch` result entry by entry, and hands every event's outcome to
//! its settler. Successful entries are never resent; permanent failures are
//! DEAD; retryable failures are either resent from memory after a backoff (the
//! stream) or handed back to the table with a time-based backoff (the table
//! path: polling and spool drains).
//!
//! A streaming lane whose oldest unsettled event is older than its stall
//! timeout, or that is told to by the session (retained WAL over budget),
//! **spools**: everything it holds, and everything routed to it afterwards, is
//! deferred to the table (`next_attempt_at`) and counts as settled, so the
//! slot moves on. The spool drain ([`crate::source::table`]) sends those rows and
//! returns the lane to streaming when its spool is empty and sends succeed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::metrics::Metrics;
use crate::pipeline::batch::{full_batch_ready, take_batch};
use crate::pipeline::settle::{Due, Settlement};
use crate::policy::spool::{stalled, SpoolCause};
use crate::publish::limit::BatchSlot;
use crate::publish::Publisher;

mod ctx;
mod item;
mod send;
mod state;

use ctx::{catching_up, spooling, Ctx, Unsent};
pub use ctx::{LaneConfig, RetryPolicy};
pub(crate) use item::ordering_groups;
pub use item::LaneItem;
use send::send_until_settled;
pub use send::{reconcile, CallOutcome, Verdict};
pub use state::{Flow, LaneState};

/// How many entries a lane had taken from its input the last time it held
/// none (nothing pending, nothing in flight, no group waiting behind one in
/// the table): whoever feeds it may close an idle lane that has finished
/// all it was given, and nothing it holds is lost or overtaken.
#[derive(Debug, Default)]
pub struct Finished(AtomicU64);

impl Finished {
    /// Entries taken and finished, as of the lane's last idle moment.
    pub fn through(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// What a finished send task reports back to its lane.
pub(crate) struct Done {
    groups: Vec<String>,
    settled: Unsent,
}

/// What a lane sends through and reports to.
pub struct Wiring {
    pub publisher: Arc<dyn Publisher>,
    /// The settler: every entry's outcome goes there.
    pub settle: mpsc::UnboundedSender<Settlement>,
    pub metrics: Arc<Metrics>,
}

/// What a stream's lane has that a table lane has not: its state beside
/// the stream (spooling, its oldest unsettled entry, its in-flight limit
/// across sessions), and where it says how far it has finished its input
/// ([`Finished`]).
pub struct Streamed {
    pub state: Arc<LaneState>,
    pub finished: Option<Arc<Finished>>,
}

impl From<Arc<LaneState>> for Streamed {
    fn from(state: Arc<LaneState>) -> Streamed {
        Streamed { state, finished: None }
    }
}

/// Run a lane until its input `rx` closes and everything in it is settled
/// (or the task is aborted: what was not settled is read again from the
/// slot). `stream`: a stream's lane; `None`, a table lane.
pub async fn run_lane(cfg: LaneConfig, wiring: Wiring, mut rx: mpsc::Receiver<LaneItem>, stream: Option<Streamed>) {
    let (state, finished) = match stream {
        Some(Streamed { state, finished }) => (Some(state), finished),
        None => (None, None),
    };
    let spool_rx = state.as_ref().map(|s| s.subscribe());
    let ctx = Arc::new(Ctx::new(cfg, wiring.publisher, wiring.settle, wiring.metrics, state));
    let mut lane = Lane::new(ctx, spool_rx, finished);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        lane.defer_what_must_follow();
        lane.start_batches();
        if !lane.holds_work() {
            lane.show_idle();
        }
        if lane.closed && lane.pending.is_empty() && lane.in_flight.is_empty() {
            if let Some(s) = &lane.ctx.state {
                s.set_oldest(None);
            }
            return;
        }
        let linger_at = lane.linger_deadline();
        tokio::select! {
            item = rx.recv(), if !lane.closed => match item {
                Some(item) => lane.receive(item, &mut rx),
                None => {
                    lane.closed = true;
                    lane.ctx.closing.send_replace(true);
                }
            },
            Some(done) = lane.in_flight.join_next_with_id() => lane.finished(done),
            slot = async { lane.awaiting.as_mut().unwrap().await }, if lane.awaiting.is_some() => {
                lane.awaiting = None;
                lane.spare = Some(slot);
            }
            _ = async { lane.spool_rx.as_mut().unwrap().changed().await }, if lane.spool_rx.is_some() => lane.flow_changed(),
            // An idle lane does not wake: a thousand of them cost nothing.
            _ = tick.tick(), if lane.ctx.state.is_some() && lane.holds_work() => lane.check_stall(),
            _ = tokio::time::sleep_until(linger_at.unwrap_or_else(Instant::now).into()), if linger_at.is_some() => {}
        }
    }
}

/// A lane's working state between events of its loop.
struct Lane {
    ctx: Arc<Ctx>,
    spool_rx: Option<watch::Receiver<Flow>>,
    pending: VecDeque<LaneItem>,
    in_flight: JoinSet<Done>,
    /// When each batch in flight was first received (for the stall check).
    in_flight_since: HashMap<tokio::task::Id, Instant>,
    /// FIFO groups with a batch in flight: their next entry waits.
    busy: HashSet<String>,
    /// FIFO groups whose earlier entry went to the table: the rest follows.
    held: HashSet<String>,
    /// FIFO groups whose earlier entry was abandoned at shutdown: the rest
    /// is abandoned too, to be read again from the slot behind it.
    abandoned: HashSet<String>,
    /// When the oldest pending entry arrived (the linger runs from it).
    oldest: Option<Instant>,
    /// When the last batch finished: a lane that sent within the last linger
    /// is busy, and batches as if a call were still in flight.
    last_done: Option<Instant>,
    closed: bool,
    /// The lane's state shows an oldest unsettled entry.
    oldest_shown: bool,
    /// Entries taken from the input, and where to say how many are finished.
    received: u64,
    finished: Option<Arc<Finished>>,
    /// The relay-wide cap of batches formed ([`Publisher::batch_slots`]):
    /// a batch forms only with a slot, and the lane waits for one (in line
    /// with the other lanes) with its entries unformed.
    slots: Option<Arc<tokio::sync::Semaphore>>,
    awaiting: Option<std::pin::Pin<Box<dyn std::future::Future<Output = BatchSlot> + Send>>>,
    /// A slot the lane waited for, not used yet.
    spare: Option<BatchSlot>,
}

impl Lane {
    fn new(ctx: Arc<Ctx>, spool_rx: Option<watch::Receiver<Flow>>, finished: Option<Arc<Finished>>) -> Self {
        Lane {
            slots: ctx.publisher.batch_slots(),
            awaiting: None,
            spare: None,
            ctx,
            spool_rx,
            pending: VecDeque::new(),
            in_flight: JoinSet::new(),
            in_flight_since: HashMap::new(),
            busy: HashSet::new(),
            held: HashSet::new(),
            abandoned: HashSet::new(),
            oldest: None,
            last_done: None,
            closed: false,
            oldest_shown: false,
            received: 0,
            finished,
        }
    }

    /// A spooling lane's pending entries go to the table; so do the later
    /// entries of a FIFO group whose earlier one went there. A FIFO group
    /// with an entry in flight keeps its later entries here until that entry
    /// is settled: in the table before it, they could be sent before it. A
    /// group whose entry was abandoned at shutdown has the rest abandoned.
    fn defer_what_must_follow(&mut self) {
        if !self.abandoned.is_empty() && !self.pending.is_empty() {
            let gone = &self.abandoned;
            let before = self.pending.len();
            self.pending.retain(|i| i.entry.ordering_group().is_none_or(|g| !gone.contains(g)));
            let n = before - self.pending.len();
            if n > 0 {
                tracing::debug!(destination = %self.ctx.cfg.name, entries = n, "shutdown: entries behind an abandoned one of their group abandoned");
            }
        }
        if spooling(&self.spool_rx) && !self.pending.is_empty() {
            let busy = &self.busy;
            let (wait, go): (VecDeque<_>, VecDeque<_>) =
                self.pending.drain(..).partition(|i| i.entry.ordering_group().is_some_and(|g| busy.contains(g)));
            self.pending = wait;
            for item in go {
                self.ctx.defer(item, "spooled", Due::Now);
            }
            if self.pending.is_empty() {
                self.oldest = None;
            }
        }
        if !self.held.is_empty() && !self.pending.is_empty() && !catching_up(&self.spool_rx) {
            let held = &self.held;
            let (keep, follow): (VecDeque<_>, VecDeque<_>) =
                self.pending.drain(..).partition(|i| i.entry.ordering_group().is_none_or(|g| !held.contains(g)));
            self.pending = keep;
            for item in follow {
                self.ctx.defer(item, "held behind an earlier entry of its group", Due::Now);
            }
        }
    }

    /// Start batches while there is room in flight and a batch is due (full,
    /// lingered long enough, the input closed, or, adaptive, the lane is
    /// idle: nothing in flight, no batch finished within the last linger, and
    /// the chunk being received is whole. A lone row does not wait for rows
    /// that may not come, a transaction's rows are not split because the
    /// lane woke at its first, and a busy lane's next batch fills as before,
    /// so a steady load makes no more calls).
    fn start_batches(&mut self) {
        if catching_up(&self.spool_rx) {
            return;
        }
        let fifo = self.ctx.cfg.target.fifo;
        let limits = self.ctx.cfg.target.batch_limits();
        let linger = self.ctx.cfg.lanes.linger;
        let limit = self.ctx.limit();
        while self.in_flight.len() < limit && !self.pending.is_empty() {
            let idle = self.ctx.cfg.lanes.adaptive
                && self.in_flight.is_empty()
                && self.last_done.is_none_or(|t| t.elapsed() >= linger)
                && self.pending.back().is_some_and(|i| i.chunk_end);
            let due = idle || self.oldest.is_some_and(|t| t.elapsed() >= linger);
            if !(self.closed || due || full_batch_ready(&self.pending, fifo, limits)) {
                break;
            }
            let Some(slot) = self.slot() else { break };
            let batch = take_batch(&mut self.pending, &self.busy, limits);
            if batch.is_empty() {
                break; // every pending group is in flight
            }
            let groups = ordering_groups(&batch);
            self.busy.extend(groups.iter().cloned());
            let since = batch.iter().map(|i| i.arrived).min().unwrap_or_else(Instant::now);
            let ctx = Arc::clone(&self.ctx);
            let spool = self.spool_rx.clone();
            self.ctx.batches.store(self.in_flight.len() + 1, Ordering::Relaxed);
            let handle = self.in_flight.spawn(async move {
                let settled = send_until_settled(&ctx, batch, spool, slot).await;
                Done { groups, settled }
            });
            self.in_flight_since.insert(handle.id(), since);
            self.oldest = self.pending.front().map(|_| Instant::now());
        }
        // A slot waited for and not used goes back to the other lanes.
        self.spare = None;
    }

    /// A slot for the next batch: the one waited for, or one free now; else
    /// the lane starts waiting for one (once) and forms nothing meanwhile.
    fn slot(&mut self) -> Option<BatchSlot> {
        let Some(slots) = &self.slots else { return Some(BatchSlot::free()) };
        if let Some(slot) = self.spare.take() {
            return Some(slot);
        }
        if self.awaiting.is_some() {
            return None;
        }
        let slot = BatchSlot::try_take(slots);
        if slot.is_none() {
            self.awaiting = Some(Box::pin(BatchSlot::take(Arc::clone(slots))));
        }
        slot
    }

    /// When the linger of the pending entries ends (or, adaptive, the lane
    /// turns idle, if sooner), if a batch could start then.
    fn linger_deadline(&self) -> Option<Instant> {
        if self.in_flight.len() >= self.ctx.limit() || self.awaiting.is_some() {
            return None;
        }
        let idle_at = self.last_done.filter(|_| self.ctx.cfg.lanes.adaptive && self.in_flight.is_empty());
        next_deadline(Instant::now(), self.ctx.cfg.lanes.linger, self.oldest, idle_at)
    }

    /// An item arrived: take it and whatever else is waiting, up to 10,000.
    fn receive(&mut self, item: LaneItem, rx: &mut mpsc::Receiver<LaneItem>) {
        if self.pending.is_empty() {
            self.oldest = Some(Instant::now());
        }
        let before = self.pending.len();
        self.pending.push_back(item);
        while self.pending.len() < 10_000 {
            match rx.try_recv() {
                Ok(item) => self.pending.push_back(item),
                Err(_) => break,
            }
        }
        self.received += (self.pending.len() - before) as u64;
    }

    /// A batch finished: its groups are free; groups it deferred are held.
    fn finished(&mut self, done: Result<(tokio::task::Id, Done), tokio::task::JoinError>) {
        let id = match &done {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        self.in_flight_since.remove(&id);
        self.ctx.batches.store(self.in_flight.len(), Ordering::Relaxed);
        self.last_done = Some(Instant::now());
        if let Ok((_, done)) = done {
            for g in done.groups {
                self.busy.remove(&g);
            }
            self.held.extend(done.settled.deferred);
            self.abandoned.extend(done.settled.abandoned);
        }
    }

    /// Streaming again after a spool: a FIFO lane comes back only once its
    /// spool is drained, so the groups whose entries went to the table have
    /// nothing left there to wait for.
    fn flow_changed(&mut self) {
        let streaming = self.spool_rx.as_ref().is_some_and(|r| *r.borrow() == Flow::Streaming);
        if streaming && self.ctx.cfg.target.fifo {
            self.held.clear();
        }
    }

    /// Entries pending or in flight.
    fn holds_work(&self) -> bool {
        !self.pending.is_empty() || !self.in_flight.is_empty()
    }

    /// Nothing unsettled here any more: say so once (the stall tick, which
    /// says it otherwise, does not run while the lane is idle), and say how
    /// much is finished unless a FIFO group still waits behind an entry in
    /// the table or abandoned (a lane started in its place would not know).
    fn show_idle(&mut self) {
        if std::mem::take(&mut self.oldest_shown) {
            if let Some(state) = &self.ctx.state {
                state.set_oldest(None);
            }
        }
        if let Some(f) = self.finished.as_ref().filter(|_| self.held.is_empty() && self.abandoned.is_empty()) {
            f.0.store(self.received, Ordering::Release);
        }
    }

    /// Publish the age of the oldest unsettled entry; spool past the stall timeout.
    fn check_stall(&mut self) {
        let Some(state) = self.ctx.state.as_ref() else { return };
        let oldest = self.pending.iter().map(|i| i.arrived).take(1).chain(self.in_flight_since.values().copied()).min();
        state.set_oldest(oldest);
        self.oldest_shown = oldest.is_some();
        if let (Some(limit), Some(t)) = (self.ctx.cfg.stall_timeout(), oldest) {
            if stalled(t.elapsed(), limit) && state.flow() != Flow::Spooling {
                state.start_spooling(SpoolCause::Stalled { oldest: t.elapsed(), limit });
            }
        }
    }
}

/// The sooner of the future ones of: the end of the oldest pending entry's
/// linger, and the end of the linger after the last batch finished (an idle
/// lane). An idle lane waiting for the end of a chunk is past the second and
/// still has the first.
fn next_deadline(
    now: Instant,
    linger: Duration,
    oldest: Option<Instant>,
    last_done: Option<Instant>,
) -> Option<Instant> {
    let oldest = oldest?;
    [Some(oldest + linger), last_done.map(|t| t + linger)].into_iter().flatten().filter(|at| *at > now).min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::OutboxEvent;
    use crate::pipeline::settings::LaneSettings;
    use crate::pipeline::settle::Outcome;
    use crate::publish::kind::Target;
    use crate::publish::memory::{Fault, MemoryPublisher};
    use crate::publish::offload::{MemoryStore, OffloadTarget, Threshold};
    use crate::publish::CallError;

    const Q: &str = "http://memory.invalid/orders";

    fn item(id: i64) -> LaneItem {
        let ev = OutboxEvent::for_test(id, "orders", &format!("body {id}"));
        let queue = Target::queue(Q, false, 1 << 20);
        LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None)
    }

    /// A streaming lane of queue `Q`, no linger, retried in memory.
    fn streaming_lane(max_in_flight: usize, retry_base: Duration, retry_cap: Duration) -> LaneConfig {
        let lanes = LaneSettings {
            linger: Duration::ZERO,
            adaptive: true,
            max_in_flight,
            // Never spools here.
            stall_timeout: Duration::MAX,
            idle_timeout: Duration::MAX,
        };
        LaneConfig {
            name: Arc::from("orders"),
            target: Target::queue(Q, false, 1 << 20),
            lanes,
            retry_base,
            retry_cap,
            retry: RetryPolicy::InMemory,
        }
    }

    async fn until(what: &str, cond: impl Fn() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A lane told to spool while a call is in flight lets the call finish:
    /// what SQS accepted stays published instead of being deferred and sent
    /// again from the table.
    #[tokio::test]
    async fn spooling_lets_the_call_in_flight_finish() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        let metrics = Metrics::new();
        let state = LaneState::new("orders", false, Arc::clone(&metrics));
        let cfg = streaming_lane(1, Duration::from_millis(10), Duration::from_millis(100));
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        p.close_gate();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics },
            rx,
            Some(Arc::clone(&state).into()),
        ));
        for id in 1..=3 {
            tx.send(item(id)).await.unwrap();
        }
        until("the batch's call to start", || p.calls_started() == 1).await;
        state.start_spooling(SpoolCause::WalBudget { held: 2, max: 3, oldest: Duration::from_secs(2) });
        tokio::task::yield_now().await;
        p.open_gate();
        let mut outcomes = Vec::new();
        for _ in 0..3 {
            outcomes.push(settle_rx.recv().await.unwrap().outcome);
        }
        assert!(outcomes.iter().all(|o| matches!(o, Outcome::Published)), "{outcomes:?}");
        assert_eq!(p.sent(Q).len(), 3);
        drop(tx);
        lane.await.unwrap();
    }

    /// The same outage of each kind of destination, in its service's words
    /// (a permission refused, the destination deleted, throttled): every
    /// entry is retried and published once the destination answers, none
    /// DEAD; and what each service refuses for good is DEAD with its kind's
    /// code.
    #[tokio::test]
    async fn every_kind_retries_its_outages_and_kills_its_refusals() {
        use crate::policy::dead::DeadCode;
        use crate::publish::kind::Kind;
        let kinds = [
            (
                Kind::Queue,
                Q,
                ["AccessDenied", "AWS.SimpleQueueService.NonExistentQueue", "RequestThrottled"],
                "InvalidMessageContents",
                DeadCode::SqsRejected,
            ),
            (
                Kind::Topic,
                "arn:aws:sns:r:1:orders",
                ["AuthorizationError", "NotFound", "Throttled"],
                "InvalidParameter",
                DeadCode::SnsRejected,
            ),
            (
                Kind::Bus,
                "arn:aws:events:r:1:event-bus/orders",
                ["AccessDeniedException", "ResourceNotFoundException", "ThrottlingException"],
                "MalformedDetail",
                DeadCode::BusRejected,
            ),
        ];
        for (kind, address, outages, refusal, dead) in kinds {
            let p = MemoryPublisher::new();
            let target = Target::new(kind, address, false, 1 << 20);
            let metrics = Metrics::new();
            let mut cfg = streaming_lane(4, Duration::from_millis(5), Duration::from_millis(20));
            cfg.target = target.clone();
            let (tx, rx) = mpsc::channel(16);
            let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
            let lane = tokio::spawn(run_lane(
                cfg,
                Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics },
                rx,
                None,
            ));
            for code in outages {
                p.push_fault(Fault::FailCall(CallError { code: code.into(), message: "m".into(), sender_fault: true }));
            }
            p.push_fault(Fault::FailEntries { positions: vec![0], code: refusal.into(), sender_fault: true });
            let ev = |id: i64| Arc::new(OutboxEvent::for_test(id, "orders", &format!("{{\"n\": {id}}}")));
            tx.send(LaneItem::new(target.prepare(ev(1)).unwrap(), None, None)).await.unwrap();
            tx.send(LaneItem::new(target.prepare(ev(2)).unwrap(), None, None)).await.unwrap();
            let mut outcomes = Vec::new();
            for _ in 0..2 {
                let s = settle_rx.recv().await.unwrap();
                outcomes.push((s.event.row_id().unwrap(), s.outcome));
            }
            outcomes.sort_by_key(|(id, _)| *id);
            let dead_ones: Vec<&DeadCode> = outcomes
                .iter()
                .filter_map(|(_, o)| if let Outcome::Dead(r) = o { Some(&r.code) } else { None })
                .collect();
            assert_eq!(dead_ones, [&dead], "{kind}: only the refused entry, with its kind's code: {outcomes:?}");
            assert!(outcomes.iter().any(|(_, o)| matches!(o, Outcome::Published)), "{kind}: {outcomes:?}");
            assert_eq!(p.sent(address).len(), 1, "{kind}");
            drop(tx);
            lane.await.unwrap();
        }
    }

    /// An idle adaptive lane sends a chunk whole once its end arrives, even
    /// if it wakes at the chunk's first entry (the linger here never ends).
    #[tokio::test]
    async fn an_idle_lane_waits_for_the_end_of_the_chunk() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        let mut cfg = streaming_lane(8, Duration::from_millis(10), Duration::from_millis(100));
        cfg.lanes.linger = Duration::from_secs(3600);
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Metrics::new() },
            rx,
            None,
        ));
        for id in 1..=2 {
            tx.send(item(id).ending_chunk(false)).await.unwrap();
            for _ in 0..10 {
                tokio::task::yield_now().await; // the lane takes what has arrived
            }
        }
        assert_eq!(p.calls_started(), 0, "a chunk's first entries wait for its end");
        tx.send(item(3)).await.unwrap();
        for _ in 0..3 {
            assert!(matches!(settle_rx.recv().await.unwrap().outcome, Outcome::Published));
        }
        assert_eq!(p.batch_sizes(), vec![3]);
        drop(tx);
        lane.await.unwrap();
    }

    /// A busy lane grows its limit from 8 to its cap while calls come back
    /// at a steady round trip; a throttled call lowers it (shown on the
    /// metric), and the throttled entry is sent after its backoff, not DEAD.
    #[tokio::test]
    async fn a_busy_lane_finds_its_limit_and_a_throttle_lowers_it() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        p.set_latency(Duration::from_millis(20));
        let metrics = Metrics::new();
        let limit = || metrics.lane_in_flight_limit.with_label_values(&["orders", "stream"]).get();
        let (tx, rx) = mpsc::channel(8192);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let cfg = streaming_lane(64, Duration::from_millis(10), Duration::from_millis(20));
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Arc::clone(&metrics) },
            rx,
            None,
        ));
        until("the lane's limit shown", || limit() > 0).await;
        assert_eq!(limit(), 8, "a lane starts at 8");
        for id in 0..4000 {
            tx.send(item(id)).await.unwrap();
        }
        for _ in 0..4000 {
            assert!(matches!(settle_rx.recv().await.unwrap().outcome, Outcome::Published));
        }
        assert_eq!((p.peak_in_flight(), limit()), (64, 64), "grown to the cap");
        p.push_fault(crate::publish::memory::Fault::FailCall(CallError {
            code: "RequestThrottled".into(),
            message: "slow down".into(),
            sender_fault: true,
        }));
        tx.send(item(4000)).await.unwrap();
        let s = settle_rx.recv().await.unwrap();
        assert_eq!((s.id(), matches!(s.outcome, Outcome::Published)), (Some(4000), true), "retried, not DEAD");
        assert_eq!(limit(), 63, "half a call off; a lone call does not grow it back");
        drop(tx);
        lane.await.unwrap();
    }

    /// A destination's lane in a new session starts from the limit the last
    /// one found (kept in the destination's state), not from 8.
    #[tokio::test]
    async fn a_new_sessions_lane_starts_from_the_last_limit() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        let metrics = Metrics::new();
        let state = LaneState::new("orders", false, Arc::clone(&metrics));
        state.set_in_flight_limit(40);
        let (tx, rx) = mpsc::channel(8);
        let (settle_tx, _settle_rx) = mpsc::unbounded_channel();
        let cfg = streaming_lane(64, Duration::from_millis(10), Duration::from_millis(20));
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p), settle: settle_tx, metrics: Arc::clone(&metrics) },
            rx,
            Some(state.into()),
        ));
        let limit = || metrics.lane_in_flight_limit.with_label_values(&["orders", "stream"]).get();
        until("the lane's limit shown", || limit() > 0).await;
        assert_eq!(limit(), 40);
        drop(tx);
        lane.await.unwrap();
    }

    /// A chunk whose end never comes (its router waits for budget, say) is
    /// sent when its linger ends, also by a lane that turned idle meanwhile.
    #[test]
    fn the_linger_still_ends_for_an_idle_lane_waiting_for_a_chunk() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let linger = ms(200);
        let oldest = Some(now - ms(100));
        // Idle since 50 ms ago; the chunk's first entry is still within its linger.
        assert_eq!(next_deadline(now, linger, oldest, Some(now - ms(250))), Some(now + ms(100)));
        // Turning idle first.
        assert_eq!(next_deadline(now, linger, oldest, Some(now - ms(150))), Some(now + ms(50)));
        assert_eq!(next_deadline(now, linger, oldest, None), Some(now + ms(100)));
        assert_eq!(next_deadline(now, linger, None, Some(now)), None, "nothing pending");
        assert_eq!(next_deadline(now, linger, Some(now - ms(300)), None), None, "due now: no wait");
    }

    /// Bodies through S3: the object is written before its message is sent.
    /// A standard queue's stream lane hands an entry whose object cannot be
    /// written to the table (with its backoff, the error named), and while
    /// S3 fails for the destination hands the next ones there without
    /// trying: no pointer without its object, and nothing else waits. Once
    /// S3 answers again (the table path's write succeeds), the stream writes
    /// them itself, once.
    #[tokio::test]
    async fn an_s3_outage_hands_its_entries_to_the_table_and_no_pointer_dangles() {
        use std::sync::atomic::Ordering;
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        let (store, queue) = down_s3(Q, false);
        let mut cfg = streaming_lane(2, Duration::from_millis(5), Duration::from_millis(20));
        cfg.target = queue.clone();
        let metrics = Metrics::new();
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Arc::clone(&metrics) },
            rx,
            None,
        ));
        let big = "b".repeat(5000);
        let big_item = |id| {
            let ev = OutboxEvent::for_test(id, "orders", &big);
            LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None)
        };
        tx.send(big_item(1)).await.unwrap();
        tx.send(item(2)).await.unwrap();
        let mut settled = [settle_rx.recv().await.unwrap(), settle_rx.recv().await.unwrap()];
        settled.sort_by_key(Settlement::id);
        assert!(matches!(settled[1].outcome, Outcome::Published), "the small entry does not wait");
        assert!(
            matches!(&settled[0].outcome, Outcome::Deferred(e, Due::Backoff) if e.starts_with("S3.ServiceUnavailable")),
            "{:?}",
            settled[0].outcome
        );
        let attempts = store.attempts.load(Ordering::Acquire);
        tx.send(big_item(3)).await.unwrap();
        let third = settle_rx.recv().await.unwrap();
        assert!(matches!(&third.outcome, Outcome::Deferred(e, Due::Backoff) if e.contains("S3 failing")));
        assert_eq!(store.attempts.load(Ordering::Acquire), attempts, "not tried while S3 fails");
        assert!(p.sent(Q).iter().all(|m| !m.body.contains("PayloadS3Pointer")), "no pointer without its object");

        store.down.store(false, Ordering::Release);
        metrics.succeeded("orders", crate::metrics::Service::S3);
        tx.send(big_item(4)).await.unwrap();
        let fourth = settle_rx.recv().await.unwrap();
        assert_eq!((fourth.id(), matches!(fourth.outcome, Outcome::Published)), (Some(4), true));
        let sent = p.sent(Q);
        let pointer = sent.iter().find(|m| m.outbox_id == Some(4)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&pointer.body).unwrap();
        let key = v[1]["s3Key"].as_str().unwrap();
        assert_eq!(store.get("bodies", key).as_deref(), Some(big.as_bytes()), "the pointer's object holds the body");
        assert_eq!(store.len(), 1, "written once");
        assert!(pointer.attributes.iter().any(|(n, t, v)| n == "ExtendedPayloadSize" && t == "Number" && v == "5000"));
        assert_eq!(metrics.offloaded_objects.with_label_values(&["orders"]).get(), 1);
        assert_eq!(metrics.offloaded_bytes.with_label_values(&["orders"]).get(), 5000);
        drop(tx);
        lane.await.unwrap();
    }

    /// A standard queue: while S3 hangs, the batch's entries that need no
    /// object go out at once; the write fails at its own deadline (half the
    /// stall timeout), not the SDK's 20 s, and its entry goes to the table;
    /// the big entries after it go there at once, and the small ones keep
    /// streaming: nothing stays unsettled long enough to spool the lane.
    #[tokio::test]
    async fn a_hung_s3_write_holds_no_small_message_of_a_standard_queue() {
        use std::sync::atomic::Ordering;
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        let (store, queue) = memory_s3(Q, false, Duration::from_secs(2));
        store.hung.store(true, Ordering::Release);
        let mut cfg = streaming_lane(2, Duration::from_millis(5), Duration::from_millis(20));
        cfg.target = queue.clone();
        let metrics = Metrics::new();
        let (tx, rx) = mpsc::channel(64);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Arc::clone(&metrics) },
            rx,
            None,
        ));
        let started = Instant::now();
        let big = |id| {
            let ev = OutboxEvent::for_test(id, "orders", &"b".repeat(5000));
            LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None).ending_chunk(false)
        };
        let small = |id, end| {
            let ev = OutboxEvent::for_test(id, "orders", "small");
            LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None).ending_chunk(end)
        };
        tx.send(big(1)).await.unwrap();
        for id in 2..=4 {
            tx.send(small(id, id == 4)).await.unwrap();
        }
        for _ in 2..=4 {
            let s = settle_rx.recv().await.unwrap();
            assert!(s.id() != Some(1) && matches!(s.outcome, Outcome::Published), "{:?}", s.outcome);
        }
        assert!(started.elapsed() < Duration::from_millis(900), "the small ones did not wait: {:?}", started.elapsed());
        let first = settle_rx.recv().await.unwrap();
        assert!(started.elapsed() >= Duration::from_secs(1), "the deadline is half the stall timeout");
        assert!(
            matches!(&first.outcome, Outcome::Deferred(e, Due::Backoff) if e.starts_with("S3.timeout")),
            "{:?}",
            first.outcome
        );
        // S3 still hung: big entries to the table at once, small ones sent.
        let again = Instant::now();
        for id in 5..=14 {
            tx.send(if id % 2 == 0 { big(id) } else { small(id, id == 13) }).await.unwrap();
        }
        let mut outcomes = Vec::new();
        for _ in 5..=14 {
            let s = settle_rx.recv().await.unwrap();
            outcomes.push((s.id().unwrap(), matches!(s.outcome, Outcome::Published)));
        }
        assert!(again.elapsed() < Duration::from_millis(900), "nothing waited on the hung S3: {:?}", again.elapsed());
        outcomes.sort_unstable();
        assert!(outcomes.iter().all(|(id, published)| *published == (id % 2 == 1)), "{outcomes:?}");
        assert_eq!(store.len(), 0);
        drop(tx);
        lane.await.unwrap();
    }

    /// The queue's `MaximumMessageSize` lowered under a running lane: the
    /// entries SQS refuses as too long are judged by the limit read again,
    /// which every copy of the queue's description now holds: through S3
    /// where there is S3 (published), DEAD `too_large` where there is not;
    /// an entry refused as too long that fits the limit read is DEAD
    /// `sqs_rejected`, not retried forever.
    #[tokio::test]
    async fn a_lowered_size_limit_is_read_again_and_its_entries_judged_anew() {
        use crate::policy::dead::DeadCode;
        let p = MemoryPublisher::new();
        let (store, with_s3) = memory_s3(Q, false, Duration::from_secs(30));
        let without_s3 = Target::queue("http://memory.invalid/plain", false, 1000);
        for (queue, expected) in [(with_s3, None), (without_s3, Some(DeadCode::TooLarge))] {
            p.add_queue(&queue.address, false, 1000);
            let mut cfg = streaming_lane(2, Duration::from_millis(5), Duration::from_millis(20));
            cfg.target = queue.clone();
            let (tx, rx) = mpsc::channel(16);
            let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
            let lane = tokio::spawn(run_lane(
                cfg,
                Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Metrics::new() },
                rx,
                None,
            ));
            // Judged for 1,000 bytes; the queue takes 600 by the time it is sent.
            let ev = OutboxEvent::for_test(1, "orders", &"b".repeat(800));
            let entry = queue.prepare(Arc::new(ev)).unwrap();
            assert!(entry.offload.is_none());
            p.add_queue(&queue.address, false, 600);
            tx.send(LaneItem::new(entry, None, None)).await.unwrap();
            let s = settle_rx.recv().await.unwrap();
            match expected {
                None => assert!(matches!(s.outcome, Outcome::Published), "{:?}", s.outcome),
                Some(code) => assert!(matches!(&s.outcome, Outcome::Dead(r) if r.code == code), "{:?}", s.outcome),
            }
            assert_eq!(queue.max_message_size(), 600, "the description the router judges by was read again");
            drop(tx);
            lane.await.unwrap();
        }
        assert_eq!(store.len(), 1, "the body went through S3");
        let sent = p.sent(Q);
        assert!(sent.len() == 1 && sent[0].body.contains("PayloadS3Pointer"), "sent once, as a pointer");
        assert!(p.sent("http://memory.invalid/plain").is_empty());
        // Refused as too long by a queue whose limit it fits: DEAD, once.
        p.add_queue(Q, false, 1 << 20);
        p.push_fault(Fault::TooLong { positions: vec![0] });
        let before = p.calls();
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let cfg = streaming_lane(2, Duration::from_millis(5), Duration::from_millis(20));
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Metrics::new() },
            rx,
            None,
        ));
        tx.send(item(2)).await.unwrap();
        let s = settle_rx.recv().await.unwrap();
        assert!(matches!(&s.outcome, Outcome::Dead(r) if r.code == DeadCode::SqsRejected), "{:?}", s.outcome);
        assert_eq!(p.calls() - before, 1, "not sent again");
        drop(tx);
        lane.await.unwrap();
    }

    /// A queue of 1,000 bytes whose larger bodies go through a memory store,
    /// its writes' deadline derived from `stall_timeout`.
    fn memory_s3(url: &str, fifo: bool, stall_timeout: Duration) -> (Arc<MemoryStore>, Target) {
        let store = Arc::new(MemoryStore::default());
        let target = Arc::new(OffloadTarget {
            store: Arc::clone(&store) as _,
            bucket: "bodies".into(),
            key_prefix: String::new(),
            threshold: Threshold::QueueLimit,
            max_body: 32 << 20,
            stall_timeout,
        });
        let mut queue = Target::queue(url, fifo, 1000);
        queue.offload = Some(target);
        (store, queue)
    }

    /// [`memory_s3`] with the store down, to be brought up with `store.down`.
    fn down_s3(url: &str, fifo: bool) -> (Arc<MemoryStore>, Target) {
        let (store, queue) = memory_s3(url, fifo, Duration::from_secs(30));
        store.down.store(true, std::sync::atomic::Ordering::Release);
        (store, queue)
    }

    /// FIFO: an object that cannot be written holds back its own group's
    /// entries of the batch, in order, and no other group's.
    #[tokio::test]
    async fn an_s3_failure_holds_back_only_its_fifo_group() {
        use std::sync::atomic::Ordering;
        const F: &str = "http://memory.invalid/orders.fifo";
        let p = MemoryPublisher::new();
        p.add_queue(F, true, 1 << 20);
        let (store, queue) = down_s3(F, true);
        let mut cfg = streaming_lane(2, Duration::from_millis(20), Duration::from_millis(20));
        cfg.target = queue.clone();
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Metrics::new() },
            rx,
            None,
        ));
        for (id, group, body) in [(1, "a", "b".repeat(5000)), (2, "a", "small".into()), (3, "b", "small".into())] {
            let mut ev = OutboxEvent::for_test(id, "orders", &body);
            ev.group_key = Some(group.into());
            tx.send(LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None)).await.unwrap();
        }
        let first = settle_rx.recv().await.unwrap();
        assert_eq!(first.id(), Some(3), "the other group goes on");
        assert!(settle_rx.try_recv().is_err(), "group a waits for its object");
        store.down.store(false, Ordering::Release);
        let (a1, a2) = (settle_rx.recv().await.unwrap(), settle_rx.recv().await.unwrap());
        assert!(matches!((&a1.outcome, &a2.outcome), (Outcome::Published, Outcome::Published)));
        let order: Vec<i64> = p.sent(F).iter().map(|m| m.outbox_id.unwrap()).collect();
        assert_eq!(order, [3, 1, 2], "group a in order, after its object");
        drop(tx);
        lane.await.unwrap();
    }

    /// A FIFO entry of group `g`, `n` bytes of body.
    fn fifo_item(id: i64, g: &str, queue: &Target) -> LaneItem {
        let mut ev = OutboxEvent::for_test(id, "orders", &format!("body {id}"));
        ev.group_key = Some(g.into());
        LaneItem::new(queue.prepare(Arc::new(ev)).unwrap(), None, None)
    }

    /// A FIFO lane told to spool while a group's entry is in flight keeps
    /// that group's later entries until the earlier one is settled: deferred
    /// to the table at once, the table path could send them first. Other
    /// groups go to the table at once.
    #[tokio::test]
    async fn spooling_keeps_a_fifo_group_behind_its_entry_in_flight() {
        const F: &str = "http://memory.invalid/orders.fifo";
        let p = MemoryPublisher::new();
        p.add_queue(F, true, 1 << 20);
        let queue = Target::queue(F, true, 1 << 20);
        let metrics = Metrics::new();
        let state = LaneState::new("orders", true, Arc::clone(&metrics));
        let mut cfg = streaming_lane(1, Duration::from_millis(10), Duration::from_millis(100));
        cfg.target = queue.clone();
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        p.close_gate();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics },
            rx,
            Some(Arc::clone(&state).into()),
        ));
        tx.send(fifo_item(1, "g", &queue)).await.unwrap();
        until("g's first entry in flight", || p.calls_started() == 1).await;
        tx.send(fifo_item(2, "g", &queue)).await.unwrap();
        tx.send(fifo_item(3, "h", &queue)).await.unwrap();
        state.start_spooling(SpoolCause::WalBudget { held: 2, max: 3, oldest: Duration::from_secs(2) });
        let other = settle_rx.recv().await.unwrap();
        assert_eq!(
            (other.id(), matches!(other.outcome, Outcome::Deferred(..))),
            (Some(3), true),
            "h goes to the table"
        );
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(settle_rx.try_recv().is_err(), "g's later entry waits for its earlier one, in flight");
        p.open_gate();
        let (first, second) = (settle_rx.recv().await.unwrap(), settle_rx.recv().await.unwrap());
        assert_eq!((first.id(), matches!(first.outcome, Outcome::Published)), (Some(1), true));
        assert_eq!((second.id(), matches!(second.outcome, Outcome::Deferred(..))), (Some(2), true));
        drop(tx);
        lane.await.unwrap();
    }

    /// A FIFO entry abandoned at shutdown (read again from the slot) takes
    /// its group's later entries with it: sent now, they would reach the
    /// queue before it.
    #[tokio::test]
    async fn a_group_behind_an_abandoned_entry_is_abandoned_too() {
        const F: &str = "http://memory.invalid/orders.fifo";
        let p = MemoryPublisher::new();
        p.add_queue(F, true, 1 << 20);
        let queue = Target::queue(F, true, 1 << 20);
        p.push_fault(crate::publish::memory::Fault::FailCall(crate::publish::CallError::transport("reset")));
        let mut cfg = streaming_lane(1, Duration::from_secs(5), Duration::from_secs(10));
        cfg.target = queue.clone();
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics: Metrics::new() },
            rx,
            None,
        ));
        tx.send(fifo_item(1, "g", &queue)).await.unwrap();
        until("g's first call failed", || p.calls() == 1).await;
        tx.send(fifo_item(2, "g", &queue)).await.unwrap();
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        drop(tx);
        tokio::time::timeout(Duration::from_secs(2), lane).await.expect("the lane ends").unwrap();
        assert!(p.sent(F).is_empty(), "nothing of g overtakes its abandoned entry: {:?}", p.sent(F));
        assert!(settle_rx.try_recv().is_err(), "nothing settled: both are read again from the slot");
    }

    /// A closing lane (its session is stopping) does not keep retrying a
    /// failing queue: it ends at once, its entries unsettled.
    #[tokio::test]
    async fn a_closing_lane_abandons_retries() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        p.break_queue(Q, crate::publish::CallError::transport("connection refused"));
        let metrics = Metrics::new();
        let cfg = streaming_lane(2, Duration::from_secs(5), Duration::from_secs(10));
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(
            cfg,
            Wiring { publisher: Arc::new(p.clone()), settle: settle_tx, metrics },
            rx,
            None,
        ));
        tx.send(item(1)).await.unwrap();
        until("a failed call", || p.calls() >= 1).await;
        drop(tx);
        tokio::time::timeout(Duration::from_secs(2), lane)
            .await
            .expect("the lane ends without waiting out its backoff")
            .unwrap();
        assert!(settle_rx.try_recv().is_err(), "nothing was settled: the entry is read again from the slot");
    }
}
