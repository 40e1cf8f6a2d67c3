//! The worker: long-polls a queue (20 s, 10 messages), runs messages through
//! the [`Consumer`] concurrently up to a limit, stops gracefully, and counts
//! every outcome.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use super::queue::{Batched, Queue, ReceivedMessage, MAX_BATCH};
use super::{Consumer, ConsumerError, Disposition, DlqDisposition};

pub const OUTCOMES_TOTAL: &str = "outbox_consumer_messages_total";
pub const CLAIMED_TOTAL: &str = "outbox_consumer_claimed_total";
pub const RESCUED_TOTAL: &str = "outbox_consumer_rescued_total";
pub const ERRORS_TOTAL: &str = "outbox_consumer_errors_total";
pub const DLQ_TOTAL: &str = "outbox_consumer_dlq_messages_total";
pub const PROCESS_SECONDS: &str = "outbox_consumer_process_seconds";

pub struct WorkerMetrics {
    pub registry: Registry,
    /// Per outcome: succeeded, retried, dead, terminal_skip, not_due, busy,
    /// fenced, stale, unparseable, unknown_job, wrong_wiring.
    pub outcomes: IntCounterVec,
    pub claimed: IntCounter,
    pub rescued: IntCounter,
    pub errors: IntCounter,
    pub dlq: IntCounterVec,
    pub process_seconds: HistogramVec,
}

impl WorkerMetrics {
    pub fn new() -> Arc<Self> {
        let m = WorkerMetrics {
            outcomes: IntCounterVec::new(
                Opts::new(OUTCOMES_TOTAL, "Received messages, by what became of them"),
                &["outcome"],
            )
            .unwrap(),
            claimed: IntCounter::new(CLAIMED_TOTAL, "Jobs claimed (handler started)").unwrap(),
            rescued: IntCounter::new(RESCUED_TOTAL, "Claims that took over an expired lease").unwrap(),
            errors: IntCounter::new(ERRORS_TOTAL, "Messages left for redelivery after a database or queue error")
                .unwrap(),
            dlq: IntCounterVec::new(Opts::new(DLQ_TOTAL, "Dead-letter messages, by what became of them"), &["outcome"])
                .unwrap(),
            process_seconds: HistogramVec::new(
                HistogramOpts::new(PROCESS_SECONDS, "Receipt to disposition of one message"),
                &["outcome"],
            )
            .unwrap(),
            registry: Registry::new(),
        };
        m.registry.register(Box::new(m.outcomes.clone())).unwrap();
        m.registry.register(Box::new(m.claimed.clone())).unwrap();
        m.registry.register(Box::new(m.rescued.clone())).unwrap();
        m.registry.register(Box::new(m.errors.clone())).unwrap();
        m.registry.register(Box::new(m.dlq.clone())).unwrap();
        m.registry.register(Box::new(m.process_seconds.clone())).unwrap();
        Arc::new(m)
    }

    pub fn count(&self, outcome: &str) -> u64 {
        self.outcomes.with_label_values(&[outcome]).get()
    }

    /// What became of one message, and how long it took from receipt.
    pub fn record(&self, d: Result<Disposition, ConsumerError>, started: std::time::Instant) {
        match d {
            Ok(d) => {
                if matches!(d, Disposition::Succeeded { .. } | Disposition::Retried { .. } | Disposition::Dead { .. }) {
                    self.claimed.inc();
                }
                if matches!(d, Disposition::Succeeded { rescued: true } | Disposition::Retried { rescued: true, .. }) {
                    self.rescued.inc();
                }
                self.outcomes.with_label_values(&[d.label()]).inc();
                self.process_seconds.with_label_values(&[d.label()]).observe(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                tracing::warn!(error = %e, "message left for redelivery");
                self.errors.inc();
            }
        }
    }

    pub fn render(&self) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }
}

pub struct Worker {
    pub consumer: Arc<Consumer>,
    pub queue: Arc<dyn Queue>,
    /// Messages processed at once.
    pub concurrency: usize,
    /// Long-poll wait (SQS allows up to 20 s).
    pub wait: Duration,
    pub metrics: Arc<WorkerMetrics>,
    /// If set, this worker drains the dead-letter queue instead.
    pub dlq: bool,
    /// How long a delete or visibility change waits for others to share its
    /// batch call.
    pub batch_linger: Duration,
    /// Long-poll loops at once (default: one per 10 of `concurrency`).
    pub receivers: usize,
}

impl Worker {
    pub fn new(consumer: Arc<Consumer>, queue: Arc<dyn Queue>, concurrency: usize) -> Self {
        Self {
            consumer,
            queue,
            concurrency: concurrency.max(1),
            wait: Duration::from_secs(20),
            metrics: WorkerMetrics::new(),
            dlq: false,
            batch_linger: Duration::from_millis(5),
            receivers: concurrency.max(1).div_ceil(MAX_BATCH),
        }
    }

    /// Receive and process until `shutdown` resolves, then finish the
    /// messages in hand (an unfinished claim is rescued after its lease).
    /// `receivers` loops long-poll at once; each receive's messages are
    /// claimed in one statement; deletes and visibility changes go out in
    /// batch calls, detached from the message's slot.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let slots = Arc::new(Semaphore::new(self.concurrency));
        let batched = Arc::new(Batched::new(Arc::clone(&self.queue), self.batch_linger, true));
        let (stop_tx, stop_rx) = watch::channel(false);
        {
            let loops = futures::future::join_all(
                (0..self.receivers.max(1)).map(|_| self.receive_loop(&slots, &batched, stop_rx.clone())),
            );
            tokio::pin!(loops, shutdown);
            tokio::select! {
                _ = &mut loops => {}
                _ = &mut shutdown => {
                    let _ = stop_tx.send(true);
                    loops.await;
                }
            }
        }
        if let Ok(b) = Arc::try_unwrap(batched) {
            b.close().await;
        }
    }

    /// One long-poll loop: receive as many as there is room for, claim them,
    /// run each in a task of its own; on stop, wait for those tasks.
    async fn receive_loop(&self, slots: &Arc<Semaphore>, batched: &Arc<Batched>, mut stop: watch::Receiver<bool>) {
        let queue: Arc<dyn Queue> = Arc::clone(batched) as Arc<dyn Queue>;
        let mut tasks = JoinSet::new();
        loop {
            let permits = tokio::select! {
                p = Arc::clone(slots).acquire_many_owned(1) => p.expect("semaphore never closed"),
                _ = stop.wait_for(|s| *s) => break,
            };
            drop(permits);
            let room = slots.available_permits().clamp(1, MAX_BATCH) as i32;
            let got = tokio::select! {
                r = queue.receive(room, self.wait) => r,
                _ = stop.wait_for(|s| *s) => break,
            };
            let msgs = match got {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "receive failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if self.dlq {
                for msg in msgs {
                    let permit = Arc::clone(slots).acquire_owned().await.expect("semaphore never closed");
                    let (consumer, queue, metrics) =
                        (Arc::clone(&self.consumer), Arc::clone(&queue), Arc::clone(&self.metrics));
                    tasks.spawn(async move {
                        dead_letter(&consumer, &*queue, &msg, &metrics).await;
                        drop(permit);
                    });
                }
            } else if !msgs.is_empty() {
                let verdicts = match self.consumer.claim(&msgs).await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!(error = %e, messages = msgs.len(), "claim failed: messages left for redelivery");
                        self.metrics.errors.inc_by(msgs.len() as u64);
                        continue;
                    }
                };
                for (msg, verdict) in msgs.into_iter().zip(verdicts) {
                    let permit = Arc::clone(slots).acquire_owned().await.expect("semaphore never closed");
                    let (consumer, queue, metrics) =
                        (Arc::clone(&self.consumer), Arc::clone(&queue), Arc::clone(&self.metrics));
                    tasks.spawn(async move {
                        let started = std::time::Instant::now();
                        let d = consumer.finish(&*queue, &msg, verdict).await;
                        metrics.record(d, started);
                        drop(permit);
                    });
                }
            }
            while tasks.try_join_next().is_some() {}
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// One dead-letter message, counted.
async fn dead_letter(consumer: &Consumer, queue: &dyn Queue, msg: &ReceivedMessage, metrics: &WorkerMetrics) {
    match consumer.process_dlq(queue, msg).await {
        Ok(d) => metrics
            .dlq
            .with_label_values(&[match d {
                DlqDisposition::MarkedDead => "marked_dead",
                DlqDisposition::AlreadyTerminal => "already_terminal",
                DlqDisposition::LeaseLive => "lease_live",
                DlqDisposition::Unrecognised => "unrecognised",
            }])
            .inc(),
        Err(e) => {
            tracing::warn!(error = %e, "DLQ message left for later");
            metrics.errors.inc();
        }
    }
}
