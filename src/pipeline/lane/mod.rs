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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::event::{Entry, QueueInfo};
use crate::metrics::Metrics;
use crate::pipeline::batch::{full_batch_ready, take_batch, Batchable};
use crate::pipeline::budget::Permit;
use crate::pipeline::settle::{Outcome, Settlement, Unmarked};
use crate::pipeline::watermark::TxnSeq;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::policy::retry::{backoff, classify_call, classify_entry, Disposition};
use crate::policy::spool::stalled;
use crate::publish::{EntryResult, Publisher};

/// An entry on its way through a lane.
pub struct LaneItem {
    pub entry: Entry,
    pub txn: Option<TxnSeq>,
    pub permit: Option<Permit>,
    pub arrived: Instant,
}

impl LaneItem {
    pub fn new(entry: Entry, txn: Option<TxnSeq>, permit: Option<Permit>) -> Self {
        Self { entry, txn, permit, arrived: Instant::now() }
    }
}

impl Batchable for LaneItem {
    fn size(&self) -> usize {
        self.entry.size
    }
    fn group(&self) -> Option<&str> {
        self.entry.group_id.as_deref()
    }
}

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
    pub queue: QueueInfo,
    pub linger: Duration,
    pub max_in_flight: usize,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    pub retry: RetryPolicy,
    /// Spool when the oldest unsettled event is older than this (stream only).
    pub stall_timeout: Option<Duration>,
}

/// A destination's streaming state, shared by its lane (one per replication
/// session), the session's WAL watch, and its spool drain. It outlives
/// sessions, so a spooling lane stays spooling across a reconnect.
pub struct LaneState {
    pub name: Arc<str>,
    spool: watch::Sender<bool>,
    /// Unix milliseconds of the lane's oldest unsettled event; 0 when none.
    oldest_unsettled_ms: AtomicU64,
    /// The last error SQS gave this lane, for the spooled rows' `last_error`.
    last_error: Mutex<String>,
    /// Deferred rows handed to the settler and not marked yet; the drain does
    /// not return the lane to streaming while any are on their way.
    unmarked: Arc<Unmarked>,
    metrics: Arc<Metrics>,
}

impl LaneState {
    pub fn new(name: &str, metrics: Arc<Metrics>) -> Arc<Self> {
        metrics.lane_spooled.with_label_values(&[name]).set(0);
        Arc::new(Self {
            name: Arc::from(name),
            spool: watch::channel(false).0,
            oldest_unsettled_ms: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
            unmarked: Arc::default(),
            metrics,
        })
    }

    pub fn is_spooling(&self) -> bool {
        *self.spool.borrow()
    }

    /// Spool from now on; logged once per switch.
    pub fn start_spooling(&self, why: &str) {
        if !self.spool.send_replace(true) {
            self.metrics.lane_spooled.with_label_values(&[&self.name]).set(1);
            self.metrics.lane_spool_switches.with_label_values(&[&self.name]).inc();
            tracing::warn!(destination = %self.name, reason = why, last_error = %self.last_error(), "lane spooling: its events go to the outbox table and the slot moves on");
        }
    }

    /// Stream again; logged once per switch.
    pub fn stop_spooling(&self) {
        if self.spool.send_replace(false) {
            self.metrics.lane_spooled.with_label_values(&[&self.name]).set(0);
            tracing::info!(destination = %self.name, "lane streaming again: its spool is drained and sends succeed");
        }
    }

    fn subscribe(&self) -> watch::Receiver<bool> {
        self.spool.subscribe()
    }

    /// Age of the oldest unsettled event, if any.
    pub fn oldest_unsettled_age(&self) -> Option<Duration> {
        match self.oldest_unsettled_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(now_unix_ms().saturating_sub(ms))),
        }
    }

    fn set_oldest(&self, at: Option<Instant>) {
        let ms = at.map(|t| now_unix_ms().saturating_sub(t.elapsed().as_millis() as u64).max(1)).unwrap_or(0);
        self.oldest_unsettled_ms.store(ms, Ordering::Relaxed);
    }

    pub fn last_error(&self) -> String {
        self.last_error.lock().unwrap().clone()
    }

    fn set_last_error(&self, e: String) {
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

struct Ctx {
    cfg: LaneConfig,
    publisher: Arc<dyn Publisher>,
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<Metrics>,
    state: Option<Arc<LaneState>>,
    /// When a failed send was last logged as a warning (at most every 5 s).
    last_warn: Mutex<Option<Instant>>,
    /// The lane's input closed: the session is stopping. Entries waiting to
    /// be retried in memory are abandoned (unsettled, so the slot replays
    /// them) instead of holding the shutdown.
    closing: watch::Sender<bool>,
}

impl Ctx {
    fn warn_due(&self) -> bool {
        let mut last = self.last_warn.lock().unwrap();
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(5)) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

/// What a finished send task reports back to its lane.
struct Done {
    groups: Vec<String>,
    /// FIFO groups with an entry deferred to the table: their later entries
    /// must follow it there.
    deferred_groups: Vec<String>,
}

/// Run a lane until its input closes and everything in it is settled (or the
/// task is aborted: what was not settled is read again from the slot).
pub async fn run_lane(
    cfg: LaneConfig,
    publisher: Arc<dyn Publisher>,
    mut rx: mpsc::Receiver<LaneItem>,
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<Metrics>,
    state: Option<Arc<LaneState>>,
) {
    let fifo = cfg.queue.fifo;
    let stall_timeout = cfg.stall_timeout;
    let mut spool_rx = state.as_ref().map(|s| s.subscribe());
    let ctx = Arc::new(Ctx {
        cfg,
        publisher,
        settle,
        metrics,
        state,
        last_warn: Mutex::new(None),
        closing: watch::channel(false).0,
    });
    let mut pending: VecDeque<LaneItem> = VecDeque::new();
    let mut in_flight: JoinSet<Done> = JoinSet::new();
    let mut in_flight_since: HashMap<tokio::task::Id, Instant> = HashMap::new();
    let mut busy: HashSet<String> = HashSet::new();
    let mut held: HashSet<String> = HashSet::new();
    let mut oldest: Option<Instant> = None;
    let mut closed = false;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let spooling = spool_rx.as_ref().is_some_and(|r| *r.borrow());
        if spooling && !pending.is_empty() {
            for item in pending.drain(..) {
                defer(&ctx, item, "spooled");
            }
            oldest = None;
        }
        if !held.is_empty() && !pending.is_empty() {
            // A group's earlier entry went back to the table: so do its later ones.
            let (keep, follow): (VecDeque<_>, VecDeque<_>) =
                pending.drain(..).partition(|i| i.entry.group_id.as_ref().is_none_or(|g| !held.contains(g)));
            pending = keep;
            for item in follow {
                defer(&ctx, item, "held behind an earlier entry of its group");
            }
        }
        while in_flight.len() < ctx.cfg.max_in_flight && !pending.is_empty() {
            let due = oldest.is_some_and(|t| t.elapsed() >= ctx.cfg.linger);
            if !(closed || due || full_batch_ready(&pending, fifo)) {
                break;
            }
            let batch = take_batch(&mut pending, &busy);
            if batch.is_empty() {
                break; // every pending group is in flight
            }
            let groups: Vec<String> = batch.iter().filter_map(|i| i.entry.group_id.clone()).collect();
            busy.extend(groups.iter().cloned());
            let since = batch.iter().map(|i| i.arrived).min().unwrap_or_else(Instant::now);
            let ctx = Arc::clone(&ctx);
            let spool = spool_rx.clone();
            let handle = in_flight.spawn(async move {
                let deferred_groups = send_until_settled(&ctx, batch, spool).await;
                Done { groups, deferred_groups }
            });
            in_flight_since.insert(handle.id(), since);
            oldest = pending.front().map(|_| Instant::now());
        }
        if closed && pending.is_empty() && in_flight.is_empty() {
            if let Some(s) = &ctx.state {
                s.set_oldest(None);
            }
            return;
        }
        let linger_at = oldest
            .map(|t| t + ctx.cfg.linger)
            .filter(|at| *at > Instant::now() && in_flight.len() < ctx.cfg.max_in_flight);
        tokio::select! {
            item = rx.recv(), if !closed => match item {
                Some(item) => {
                    if pending.is_empty() {
                        oldest = Some(Instant::now());
                    }
                    pending.push_back(item);
                    while pending.len() < 10_000 {
                        match rx.try_recv() {
                            Ok(item) => pending.push_back(item),
                            Err(_) => break,
                        }
                    }
                }
                None => {
                    closed = true;
                    ctx.closing.send_replace(true);
                }
            },
            Some(done) = in_flight.join_next_with_id() => {
                let id = match &done {
                    Ok((id, _)) => *id,
                    Err(e) => e.id(),
                };
                in_flight_since.remove(&id);
                if let Ok((_, done)) = done {
                    for g in done.groups {
                        busy.remove(&g);
                    }
                    held.extend(done.deferred_groups);
                }
            }
            _ = async { spool_rx.as_mut().unwrap().changed().await }, if spool_rx.is_some() => {}
            _ = tick.tick(), if ctx.state.is_some() => {
                let oldest_unsettled = pending
                    .iter()
                    .map(|i| i.arrived)
                    .take(1)
                    .chain(in_flight_since.values().copied())
                    .min();
                let state = ctx.state.as_ref().unwrap();
                state.set_oldest(oldest_unsettled);
                if let (Some(limit), Some(t)) = (stall_timeout, oldest_unsettled) {
                    if stalled(t.elapsed(), limit) && !state.is_spooling() {
                        state.start_spooling(&format!("oldest unsettled event is {:.1}s old (lane_stall_timeout {limit:?})", t.elapsed().as_secs_f64()));
                    }
                }
            }
            _ = tokio::time::sleep_until(linger_at.unwrap_or_else(Instant::now).into()), if linger_at.is_some() => {}
        }
    }
}

fn now_unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

fn now_unix_ms() -> u64 {
    (now_unix_us() / 1000).max(0) as u64
}

fn settle(ctx: &Ctx, item: LaneItem, outcome: Outcome) {
    if matches!(outcome, Outcome::Published) {
        let lag = (now_unix_us() - item.entry.event.commit_time_us).max(0) as f64 / 1e6;
        ctx.metrics.commit_to_publish_seconds.observe(lag);
    }
    let unmarked = match (&outcome, &ctx.state) {
        (Outcome::Deferred(_), Some(s)) => Some(s.deferring()),
        _ => None,
    };
    // The settler outlives the lanes; if it is gone the pipeline is stopping
    // and the row stays NEW, to be read again.
    let sent = ctx.settle.send(Settlement {
        id: item.entry.event.id,
        xid: item.entry.event.xid,
        txn: item.txn,
        destination: Arc::clone(&ctx.cfg.name),
        outcome,
        permit: item.permit,
        unmarked,
    });
    if let Err(mpsc::error::SendError(s)) = sent {
        if let Some(u) = s.unmarked {
            u.marked();
        }
    }
}

fn defer(ctx: &Ctx, item: LaneItem, why: &str) {
    let last = ctx.state.as_ref().map(|s| s.last_error()).unwrap_or_default();
    let text = if last.is_empty() { why.to_string() } else { format!("{why}: {last}") };
    settle(ctx, item, Outcome::Deferred(text));
}

fn spooling(spool: &Option<watch::Receiver<bool>>) -> bool {
    spool.as_ref().is_some_and(|r| *r.borrow())
}

/// Send `batch` until every entry is published, DEAD or deferred. Returns the
/// FIFO groups of deferred entries.
async fn send_until_settled(ctx: &Ctx, batch: Vec<LaneItem>, mut spool: Option<watch::Receiver<bool>>) -> Vec<String> {
    let mut todo = batch;
    let mut attempt = 0u32;
    let mut split = false;
    let mut deferred_groups = Vec::new();
    while !todo.is_empty() {
        if spooling(&spool) {
            for item in todo.drain(..) {
                deferred_groups.extend(item.entry.group_id.clone());
                defer(ctx, item, "spooled");
            }
            break;
        }
        if split && todo.len() > 1 {
            // Find the entry the service objects to: each alone.
            for item in todo.drain(..) {
                let d = Box::pin(send_until_settled(ctx, vec![item], spool.clone())).await;
                deferred_groups.extend(d);
            }
            break;
        }
        let entries: Vec<Entry> = todo.iter().map(|i| i.entry.clone()).collect();
        ctx.metrics.batch_entries.with_label_values(&[&ctx.cfg.name]).observe(entries.len() as f64);
        ctx.metrics
            .batch_bytes
            .with_label_values(&[&ctx.cfg.name])
            .observe(entries.iter().map(|e| e.size).sum::<usize>() as f64);
        let started = Instant::now();
        // A call in flight finishes even if the lane starts spooling meanwhile
        // (the SQS client's timeouts bound it): what it published stays
        // published, and only what it did not is deferred to the table.
        let result = ctx.publisher.send_batch(&ctx.cfg.queue.url, &entries).await;
        ctx.metrics.publish_seconds.with_label_values(&[&ctx.cfg.name]).observe(started.elapsed().as_secs_f64());
        let mut retry = Vec::new();
        match result {
            Ok(results) => {
                crate::faults::crash_point("lane::after_send");
                for (item, r) in todo.drain(..).zip(results) {
                    match r {
                        EntryResult::Sent => settle(ctx, item, Outcome::Published),
                        EntryResult::Failed { code, sender_fault, message } => {
                            ctx.metrics.sqs_entry_failures.with_label_values(&[&*ctx.cfg.name, code.as_str()]).inc();
                            match classify_entry(&code, sender_fault) {
                                Disposition::Dead => settle(
                                    ctx,
                                    item,
                                    Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, format!("{code}: {message}"))),
                                ),
                                _ => {
                                    tracing::debug!(id = item.entry.event.id, %code, "entry failed, will retry");
                                    if let Some(s) = &ctx.state {
                                        s.set_last_error(format!("{code}: {message}"));
                                    }
                                    retry.push((item, format!("{code}: {message}")));
                                }
                            }
                        }
                    }
                }
            }
            Err(e) => {
                ctx.metrics.sqs_entry_failures.with_label_values(&[&*ctx.cfg.name, e.code.as_str()]).inc();
                match classify_call(&e.code, e.sender_fault, todo.len()) {
                    Disposition::Retry => {
                        if ctx.cfg.retry == RetryPolicy::InMemory && ctx.warn_due() {
                            tracing::warn!(destination = %ctx.cfg.name, error = %e, attempt, "SendMessageBatch failed, will retry");
                        } else {
                            tracing::debug!(destination = %ctx.cfg.name, error = %e, attempt, "SendMessageBatch failed, will retry");
                        }
                        if let Some(s) = &ctx.state {
                            s.set_last_error(e.to_string());
                        }
                        retry.extend(todo.drain(..).map(|i| (i, e.to_string())));
                    }
                    Disposition::Split => {
                        split = true;
                        continue;
                    }
                    Disposition::Dead => {
                        for item in todo.drain(..) {
                            let reason = DeadReason::new(DeadCode::SqsRejected, format!("{}: {}", e.code, e.message));
                            settle(ctx, item, Outcome::Dead(reason));
                        }
                    }
                }
            }
        }
        if retry.is_empty() {
            break;
        }
        if ctx.cfg.retry == RetryPolicy::ToTable {
            for (item, err) in retry {
                deferred_groups.extend(item.entry.group_id.clone());
                settle(ctx, item, Outcome::Deferred(err));
            }
            break;
        }
        if *ctx.closing.borrow() {
            // Stopping: these stay unsettled and are read again from the slot.
            tracing::debug!(destination = %ctx.cfg.name, entries = retry.len(), "shutdown: entries to retry abandoned");
            break;
        }
        todo = retry.into_iter().map(|(i, _)| i).collect();
        let wait = tokio::time::sleep(backoff(attempt, ctx.cfg.retry_base, ctx.cfg.retry_cap));
        let mut closing = ctx.closing.subscribe();
        match spool.as_mut() {
            Some(rx) => tokio::select! {
                _ = wait => {}
                _ = rx.wait_for(|s| *s) => {}
                _ = closing.wait_for(|c| *c) => {}
            },
            None => tokio::select! {
                _ = wait => {}
                _ = closing.wait_for(|c| *c) => {}
            },
        }
        if *ctx.closing.borrow() && !spooling(&spool) {
            tracing::debug!(destination = %ctx.cfg.name, entries = todo.len(), "shutdown: entries to retry abandoned");
            break;
        }
        attempt = attempt.saturating_add(1);
    }
    deferred_groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{prepare, OutboxEvent};
    use crate::publish::memory::MemoryPublisher;

    const Q: &str = "http://memory.invalid/orders";

    fn item(id: i64) -> LaneItem {
        let ev = OutboxEvent {
            id,
            event_id: format!("e:{id}"),
            destination: "orders".into(),
            body: format!("body {id}"),
            group_key: None,
            attributes: None,
            commit_time_us: 0,
            xid: None,
        };
        let queue = QueueInfo { url: Q.into(), fifo: false, max_message_size: 1 << 20 };
        LaneItem::new(prepare(Arc::new(ev), &queue).unwrap(), None, None)
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
        let state = LaneState::new("orders", Arc::clone(&metrics));
        let cfg = LaneConfig {
            name: Arc::from("orders"),
            queue: QueueInfo { url: Q.into(), fifo: false, max_message_size: 1 << 20 },
            linger: Duration::ZERO,
            max_in_flight: 1,
            retry_base: Duration::from_millis(10),
            retry_cap: Duration::from_millis(100),
            retry: RetryPolicy::InMemory,
            stall_timeout: None,
        };
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        p.close_gate();
        let lane = tokio::spawn(run_lane(cfg, Arc::new(p.clone()), rx, settle_tx, metrics, Some(Arc::clone(&state))));
        for id in 1..=3 {
            tx.send(item(id)).await.unwrap();
        }
        until("the batch's call to start", || p.calls_started() == 1).await;
        state.start_spooling("test: retained WAL over budget");
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

    /// A closing lane (its session is stopping) does not keep retrying a
    /// failing queue: it ends at once, its entries unsettled.
    #[tokio::test]
    async fn a_closing_lane_abandons_retries() {
        let p = MemoryPublisher::new();
        p.add_queue(Q, false, 1 << 20);
        p.break_queue(Q, crate::publish::CallError::transport("connection refused"));
        let metrics = Metrics::new();
        let cfg = LaneConfig {
            name: Arc::from("orders"),
            queue: QueueInfo { url: Q.into(), fifo: false, max_message_size: 1 << 20 },
            linger: Duration::ZERO,
            max_in_flight: 2,
            retry_base: Duration::from_secs(5),
            retry_cap: Duration::from_secs(10),
            retry: RetryPolicy::InMemory,
            stall_timeout: None,
        };
        let (tx, rx) = mpsc::channel(16);
        let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
        let lane = tokio::spawn(run_lane(cfg, Arc::new(p.clone()), rx, settle_tx, metrics, None));
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
