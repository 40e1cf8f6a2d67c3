//! A lane: one destination's queue. It batches entries (at most 10, at most
//! 1 MiB, a short linger), keeps several batches in flight, reconciles each
//! `SendMessageBatch` result entry by entry, and hands every event's outcome to
//! the settler. Successful entries are never resent; retryable failures are
//! resent without them, after a backoff; permanent failures are DEAD.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::task::JoinSet;

use crate::batch::{full_batch_ready, take_batch, Batchable};
use crate::event::{DeadReason, Entry, QueueInfo};
use crate::metrics::Metrics;
use crate::publisher::{EntryResult, Publisher};
use crate::retry::{backoff, classify_call, classify_entry, Disposition};
use crate::settle::{Outcome, Settlement};
use crate::watermark::TxnSeq;

/// An entry on its way through a lane.
pub struct LaneItem {
    pub entry: Entry,
    pub txn: Option<TxnSeq>,
    pub permit: Option<OwnedSemaphorePermit>,
}

impl Batchable for LaneItem {
    fn size(&self) -> usize {
        self.entry.size
    }
    fn group(&self) -> Option<&str> {
        self.entry.group_id.as_deref()
    }
}

pub struct LaneConfig {
    pub name: Arc<str>,
    pub queue: QueueInfo,
    pub linger: Duration,
    pub max_in_flight: usize,
    pub retry_base: Duration,
    pub retry_cap: Duration,
}

struct Ctx {
    cfg: LaneConfig,
    publisher: Arc<dyn Publisher>,
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<Metrics>,
}

/// Run a lane until its input closes and everything in it is settled (or the
/// task is aborted: what was not settled is read again from the slot).
pub async fn run_lane(
    cfg: LaneConfig,
    publisher: Arc<dyn Publisher>,
    mut rx: mpsc::Receiver<LaneItem>,
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<Metrics>,
) {
    let fifo = cfg.queue.fifo;
    let ctx = Arc::new(Ctx { cfg, publisher, settle, metrics });
    let mut pending: VecDeque<LaneItem> = VecDeque::new();
    let mut in_flight: JoinSet<Vec<String>> = JoinSet::new();
    let mut busy: HashSet<String> = HashSet::new();
    let mut oldest: Option<Instant> = None;
    let mut closed = false;
    loop {
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
            let ctx = Arc::clone(&ctx);
            in_flight.spawn(async move {
                send_until_settled(&ctx, batch).await;
                groups
            });
            oldest = if pending.is_empty() { None } else { Some(Instant::now()) };
        }
        if closed && pending.is_empty() && in_flight.is_empty() {
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
                None => closed = true,
            },
            Some(done) = in_flight.join_next() => {
                if let Ok(groups) = done {
                    for g in groups {
                        busy.remove(&g);
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

fn settle(ctx: &Ctx, item: LaneItem, outcome: Outcome) {
    if matches!(outcome, Outcome::Published) {
        let lag = (now_unix_us() - item.entry.event.commit_time_us).max(0) as f64 / 1e6;
        ctx.metrics.commit_to_publish_seconds.observe(lag);
    }
    // The settler outlives the lanes; if it is gone the pipeline is stopping
    // and the row stays NEW, to be read again.
    let _ = ctx.settle.send(Settlement {
        id: item.entry.event.id,
        txn: item.txn,
        destination: Arc::clone(&ctx.cfg.name),
        outcome,
        permit: item.permit,
    });
}

/// Send `batch` until every entry is published or DEAD.
async fn send_until_settled(ctx: &Ctx, batch: Vec<LaneItem>) {
    let mut todo = batch;
    let mut attempt = 0u32;
    let mut split = false;
    while !todo.is_empty() {
        if split && todo.len() > 1 {
            // Find the entry the service objects to: each alone.
            for item in todo.drain(..) {
                Box::pin(send_until_settled(ctx, vec![item])).await;
            }
            return;
        }
        let entries: Vec<Entry> = todo.iter().map(|i| i.entry.clone()).collect();
        let started = Instant::now();
        let result = ctx.publisher.send_batch(&ctx.cfg.queue.url, &entries).await;
        ctx.metrics
            .publish_seconds
            .with_label_values(&[&ctx.cfg.name])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(results) => {
                let mut retry = Vec::new();
                for (item, r) in todo.drain(..).zip(results) {
                    match r {
                        EntryResult::Sent => settle(ctx, item, Outcome::Published),
                        EntryResult::Failed { code, sender_fault, message } => {
                            ctx.metrics.sqs_entry_failures.with_label_values(&[&*ctx.cfg.name, code.as_str()]).inc();
                            match classify_entry(&code, sender_fault) {
                                Disposition::Dead => settle(
                                    ctx,
                                    item,
                                    Outcome::Dead(DeadReason::new("sqs_rejected", format!("{code}: {message}"))),
                                ),
                                _ => {
                                    tracing::debug!(id = item.entry.event.id, %code, "entry failed, will retry");
                                    retry.push(item);
                                }
                            }
                        }
                    }
                }
                todo = retry;
            }
            Err(e) => {
                ctx.metrics.sqs_entry_failures.with_label_values(&[&*ctx.cfg.name, e.code.as_str()]).inc();
                match classify_call(&e, todo.len()) {
                    Disposition::Retry => {
                        tracing::warn!(destination = %ctx.cfg.name, error = %e, attempt, "SendMessageBatch failed, will retry");
                    }
                    Disposition::Split => {
                        split = true;
                        continue;
                    }
                    Disposition::Dead => {
                        for item in todo.drain(..) {
                            let reason = DeadReason::new("sqs_rejected", format!("{}: {}", e.code, e.message));
                            settle(ctx, item, Outcome::Dead(reason));
                        }
                    }
                }
            }
        }
        if !todo.is_empty() {
            tokio::time::sleep(backoff(attempt, ctx.cfg.retry_base, ctx.cfg.retry_cap)).await;
            attempt = attempt.saturating_add(1);
        }
    }
}
