//! The consumer's state machine, as calls of the protocol's SQL functions:
//! a received message judged by the database, claimed, run, settled.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::watch;
use tracing::Instrument;

use crate::job::{Disposition, DlqDisposition, Handler, HandlerError, Job, JobMessage};
use crate::queue::{self, Queue, ReceivedMessage, MAX_VISIBILITY};
use crate::ConsumerError;

#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// This worker's name in `claimed_by`.
    pub worker_id: String,
    /// How long a claim holds before another worker may rescue it.
    pub lease: Duration,
    /// Retry backoff: `retry_base × 2^(attempt-1)`, capped, with full jitter
    /// over its upper half.
    pub retry_base: Duration,
    pub retry_max: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            worker_id: format!("worker-{}", std::process::id()),
            lease: Duration::from_secs(30),
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(3600),
        }
    }
}

/// Judges and runs received messages against the jobs table, through the
/// protocol's SQL functions (`outbox_claim_jobs`, `outbox_succeed_job`, ...):
/// the same statements a worker in any other language issues.
pub struct Consumer {
    pool: deadpool_postgres::Pool,
    handlers: HashMap<String, Arc<dyn Handler>>,
    pub config: ConsumerConfig,
    /// Statements sent to PostgreSQL (claims, transactions, transitions, lease renewals).
    round_trips: AtomicU64,
}

/// What the database said a received message does, before any handler runs.
pub enum Verdict {
    /// Claimed: run the handler.
    Run(Claimed),
    /// Decided without running: the disposition and what to do with the message.
    Decided(Disposition, QueueAction),
}

/// A claim this worker holds.
pub struct Claimed {
    message: JobMessage,
    handler: Arc<dyn Handler>,
    attempt: i32,
    payload: serde_json::Value,
    rescued: bool,
}

/// A message whose handler ran, for settling its job.
struct Ran<'a> {
    queue: &'a dyn Queue,
    msg: &'a ReceivedMessage,
    m: &'a JobMessage,
    attempt: i32,
    rescued: bool,
}

/// What becomes of a message that was not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueAction {
    Delete,
    /// Visible again after this long.
    Hide(Duration),
    /// Neither deleted nor hidden: SQS's redrive policy moves it to the DLQ.
    Leave,
}

fn secs(s: Option<f64>) -> Duration {
    Duration::from_secs_f64(s.unwrap_or(0.0).clamp(0.0, MAX_VISIBILITY.as_secs_f64()))
}

impl Consumer {
    pub fn new(pool: deadpool_postgres::Pool, config: ConsumerConfig) -> Self {
        Self { pool, handlers: HashMap::new(), config, round_trips: AtomicU64::new(0) }
    }

    /// A pool over `database_url` of `size` connections.
    pub fn pool(database_url: &str, size: usize) -> Result<deadpool_postgres::Pool, ConsumerError> {
        let t = outbox_pgconn::parse(database_url).map_err(ConsumerError::Pool)?;
        let tls = outbox_pgconn::connector(&t).map_err(ConsumerError::Pool)?;
        let mgr = deadpool_postgres::Manager::from_config(
            t.pg,
            tls,
            deadpool_postgres::ManagerConfig { recycling_method: deadpool_postgres::RecyclingMethod::Fast },
        );
        deadpool_postgres::Pool::builder(mgr).max_size(size).build().map_err(|e| ConsumerError::Pool(e.to_string()))
    }

    pub fn handle(mut self, kind: &str, handler: impl Handler) -> Self {
        self.handlers.insert(kind.to_string(), Arc::new(handler));
        self
    }

    /// Statements sent to PostgreSQL so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn trip(&self, n: u64) {
        self.round_trips.fetch_add(n, Ordering::Relaxed);
    }

    async fn conn(&self) -> Result<deadpool_postgres::Object, ConsumerError> {
        self.pool.get().await.map_err(|e| ConsumerError::Pool(e.to_string()))
    }

    /// Judge one message and act on it. Database errors are returned with
    /// nothing deleted: the message comes back after its visibility timeout.
    pub async fn process(&self, queue: &dyn Queue, msg: &ReceivedMessage) -> Result<Disposition, ConsumerError> {
        let verdict = self.claim(std::slice::from_ref(msg)).await?.pop().expect("one verdict per message");
        self.finish(queue, msg, verdict).await
    }

    /// Act on a message's verdict: apply its queue action, or run the job.
    pub async fn finish(
        &self,
        queue: &dyn Queue,
        msg: &ReceivedMessage,
        verdict: Verdict,
    ) -> Result<Disposition, ConsumerError> {
        match verdict {
            Verdict::Decided(d, action) => {
                act(queue, &msg.receipt, action).await?;
                Ok(d)
            }
            Verdict::Run(c) => self.run(queue, msg, c).await,
        }
    }

    /// Judge received messages (a receive's up to 10) in one statement:
    /// those that may run are claimed; one verdict per message, in order.
    pub async fn claim(&self, msgs: &[ReceivedMessage]) -> Result<Vec<Verdict>, ConsumerError> {
        let mut out: Vec<Option<Verdict>> = msgs.iter().map(|_| None).collect();
        let mut asked: Vec<(usize, JobMessage)> = Vec::new();
        for (i, msg) in msgs.iter().enumerate() {
            match JobMessage::parse(&msg.body) {
                None => {
                    tracing::warn!(receipt = %msg.receipt, "unparseable job message: left for the DLQ");
                    out[i] = Some(Verdict::Decided(Disposition::Unparseable, QueueAction::Leave));
                }
                Some(m) if !self.handlers.contains_key(&m.kind) => {
                    tracing::warn!(job_id = %m.job_id, kind = %m.kind, "no handler for this kind on this worker: left for the DLQ");
                    let why = format!("no handler for kind {:?}", m.kind);
                    out[i] = Some(Verdict::Decided(Disposition::WrongWiring(why), QueueAction::Leave));
                }
                Some(m) => asked.push((i, m)),
            }
        }
        if !asked.is_empty() {
            let ids: Vec<&str> = asked.iter().map(|(_, m)| m.job_id.as_str()).collect();
            let kinds: Vec<&str> = asked.iter().map(|(_, m)| m.kind.as_str()).collect();
            let generations: Vec<i32> = asked.iter().map(|(_, m)| m.generation).collect();
            let conn = self.conn().await?;
            self.trip(1);
            let rows = conn
                .query(
                    "SELECT ord, action, attempt, payload, rescued, delay_secs, reason
                       FROM outbox_claim_jobs($1, $2, $3, $4, $5)",
                    &[&ids, &kinds, &generations, &self.config.worker_id, &self.config.lease.as_secs_f64()],
                )
                .await?;
            drop(conn);
            let mut asked: Vec<Option<(usize, JobMessage)>> = asked.into_iter().map(Some).collect();
            for r in rows {
                let ord: i32 = r.get(0);
                let (i, m) = asked.get_mut((ord - 1) as usize).and_then(Option::take).ok_or_else(|| {
                    ConsumerError::Protocol(format!("outbox_claim_jobs returned ord {ord} twice or out of range"))
                })?;
                out[i] = Some(self.verdict(m, &r)?);
            }
        }
        out.into_iter()
            .map(|v| {
                v.ok_or_else(|| ConsumerError::Protocol("outbox_claim_jobs left a message without an answer".into()))
            })
            .collect()
    }

    /// One row of `outbox_claim_jobs` as a verdict.
    fn verdict(&self, m: JobMessage, r: &tokio_postgres::Row) -> Result<Verdict, ConsumerError> {
        let action: String = r.get(1);
        let action = ClaimAnswer::parse(&action)
            .ok_or_else(|| ConsumerError::Protocol(format!("outbox_claim_jobs answered {action:?}")))?;
        let delay = secs(r.get(5));
        let reason: Option<String> = r.get(6);
        let decided = |d, a| Ok(Verdict::Decided(d, a));
        match action {
            ClaimAnswer::Run => {
                let rescued: bool = r.get(4);
                if rescued {
                    tracing::info!(job_id = %m.job_id, "expired lease rescued");
                }
                let handler = Arc::clone(&self.handlers[&m.kind]);
                Ok(Verdict::Run(Claimed { attempt: r.get(2), payload: r.get(3), rescued, handler, message: m }))
            }
            ClaimAnswer::Skip => decided(Disposition::TerminalSkip, QueueAction::Delete),
            ClaimAnswer::NotDue => decided(Disposition::NotDue { after: delay }, QueueAction::Hide(delay)),
            ClaimAnswer::Busy => decided(Disposition::Busy { after: delay }, QueueAction::Hide(delay)),
            // Someone else got there: the message comes back after their lease.
            ClaimAnswer::Fenced => decided(Disposition::Fenced, QueueAction::Hide(self.config.lease)),
            ClaimAnswer::Stale => {
                tracing::info!(job_id = %m.job_id, generation = m.generation, "stale generation message rejected");
                decided(Disposition::Stale, QueueAction::Delete)
            }
            ClaimAnswer::Dead => decided(Disposition::Dead { reason: reason.unwrap_or_default() }, QueueAction::Delete),
            ClaimAnswer::UnknownJob => {
                tracing::warn!(job_id = %m.job_id, "message for a job the database does not have: left for the DLQ");
                decided(Disposition::UnknownJob, QueueAction::Leave)
            }
            ClaimAnswer::WrongWiring => {
                decided(Disposition::WrongWiring(reason.unwrap_or_default()), QueueAction::Leave)
            }
        }
    }

    /// Run a claimed job: the handler in a transaction with the lease
    /// heartbeat beside it, then one fenced transition and the message's
    /// deletion (or hiding, for a retry).
    pub async fn run(
        &self,
        queue: &dyn Queue,
        msg: &ReceivedMessage,
        c: Claimed,
    ) -> Result<Disposition, ConsumerError> {
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let m = &c.message;
        let job = Job {
            job_id: m.job_id.clone(),
            kind: m.kind.clone(),
            payload: c.payload,
            attempt: c.attempt,
            generation: m.generation,
            cancelled: cancel_rx,
            traceparent: msg.traceparent.clone(),
        };
        let span = tracing::info_span!(
            "outbox_job",
            job_id = %job.job_id,
            kind = %job.kind,
            attempt = job.attempt,
            traceparent = job.traceparent.as_deref().unwrap_or(""),
        );
        let mut conn = self.conn().await?;
        self.trip(1);
        let tx = conn.transaction().await?;
        let work = std::panic::AssertUnwindSafe(c.handler.handle(&job, &tx).instrument(span)).catch_unwind();
        let heartbeat = self.heartbeat(queue, msg, m, c.attempt, cancel_tx);
        tokio::pin!(heartbeat);
        let result = tokio::select! {
            r = work => r,
            _ = &mut heartbeat => unreachable!("the heartbeat never ends"),
        };
        let result = result.unwrap_or_else(|_| Err(HandlerError::Retry("handler panicked".into())));
        let run = Ran { queue, msg, m, attempt: c.attempt, rescued: c.rescued };
        match result {
            Ok(()) => self.succeed(tx, &run).await,
            Err(HandlerError::Retry(e)) => {
                tx.rollback().await?;
                self.retry(&conn, &run, e).await
            }
            Err(HandlerError::Permanent(e)) => {
                tx.rollback().await?;
                self.dead(&conn, &run, e).await
            }
        }
    }

    /// The handler succeeded: complete the job in its transaction (unless
    /// fenced: its effects roll back), then delete the message.
    async fn succeed(
        &self,
        tx: deadpool_postgres::Transaction<'_>,
        run: &Ran<'_>,
    ) -> Result<Disposition, ConsumerError> {
        let m = run.m;
        let fence: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&m.job_id, &self.config.worker_id, &run.attempt, &m.generation];
        self.trip(1);
        let held: bool = tx.query_one("SELECT outbox_succeed_job($1, $2, $3, $4)", &fence).await?.get(0);
        self.trip(1);
        if !held {
            tx.rollback().await?;
            tracing::info!(job_id = %m.job_id, attempt = run.attempt, "fenced at completion: effects rolled back");
            return Ok(Disposition::Fenced);
        }
        tx.commit().await?;
        run.queue.delete(&run.msg.receipt).await?;
        Ok(Disposition::Succeeded { rescued: run.rescued })
    }

    /// The handler asked to try again: the job waits its backoff, and the
    /// message stays hidden that long.
    async fn retry(
        &self,
        conn: &tokio_postgres::Client,
        run: &Ran<'_>,
        e: String,
    ) -> Result<Disposition, ConsumerError> {
        let m = run.m;
        self.trip(2);
        let (base, max) = (self.config.retry_base.as_secs_f64(), self.config.retry_max.as_secs_f64());
        let after: Option<f64> = conn
            .query_one(
                "SELECT outbox_retry_job($1, $2, $3, $4, $5, $6, $7)",
                &[&m.job_id, &self.config.worker_id, &run.attempt, &m.generation, &e, &base, &max],
            )
            .await?
            .get(0);
        let Some(after) = after.map(|s| secs(Some(s))) else { return Ok(Disposition::Fenced) };
        run.queue.change_visibility(&run.msg.receipt, after).await?;
        Ok(Disposition::Retried { after, rescued: run.rescued })
    }

    /// The handler failed for good: the job is DEAD with its reason, and the
    /// message deleted.
    async fn dead(
        &self,
        conn: &tokio_postgres::Client,
        run: &Ran<'_>,
        e: String,
    ) -> Result<Disposition, ConsumerError> {
        let m = run.m;
        self.trip(2);
        let held: bool = conn
            .query_one(
                "SELECT outbox_dead_job($1, $2, $3, $4, $5)",
                &[&m.job_id, &self.config.worker_id, &run.attempt, &m.generation, &e],
            )
            .await?
            .get(0);
        if !held {
            return Ok(Disposition::Fenced);
        }
        tracing::warn!(job_id = %m.job_id, reason = %e, "job DEAD");
        run.queue.delete(&run.msg.receipt).await?;
        Ok(Disposition::Dead { reason: e })
    }

    /// The lease heartbeat: every lease/3 extends the lease and the message's
    /// visibility together, and tells the handler when it was cancelled or
    /// fenced. Never ends.
    async fn heartbeat(
        &self,
        queue: &dyn Queue,
        msg: &ReceivedMessage,
        m: &JobMessage,
        attempt: i32,
        cancel: watch::Sender<bool>,
    ) {
        let lease = self.config.lease;
        loop {
            tokio::time::sleep(lease / 3).await;
            let Ok(c) = self.pool.get().await else { continue };
            self.trip(1);
            let r = c
                .query_one(
                    "SELECT outbox_renew_job_lease($1, $2, $3, $4, $5)",
                    &[&m.job_id, &self.config.worker_id, &attempt, &m.generation, &lease.as_secs_f64()],
                )
                .await;
            let Ok(row) = r else { continue };
            let state: String = row.get(0);
            if state != "fenced" {
                let _ = queue.change_visibility(&msg.receipt, lease + Duration::from_secs(5)).await;
            }
            if state != "held" {
                let _ = cancel.send(true);
            }
        }
    }

    /// A message SQS moved to the dead-letter queue: its job, if still
    /// PENDING or CLAIMED with an expired lease, ends DEAD('DLQ').
    pub async fn process_dlq(&self, queue: &dyn Queue, msg: &ReceivedMessage) -> Result<DlqDisposition, ConsumerError> {
        let Some(m) = JobMessage::parse(&msg.body) else { return Ok(DlqDisposition::Unrecognised) };
        let conn = self.conn().await?;
        self.trip(1);
        let answer: String = conn.query_one("SELECT outbox_dlq_job($1, $2)", &[&m.job_id, &m.generation]).await?.get(0);
        let d = DlqDisposition::parse(&answer)
            .ok_or_else(|| ConsumerError::Protocol(format!("outbox_dlq_job answered {answer:?}")))?;
        if d == DlqDisposition::MarkedDead {
            tracing::warn!(job_id = %m.job_id, "job DEAD: its message reached the DLQ");
        }
        if matches!(d, DlqDisposition::MarkedDead | DlqDisposition::AlreadyTerminal) {
            queue.delete(&msg.receipt).await?;
        }
        Ok(d)
    }
}

/// What `outbox_claim_jobs` answers for a message (migrations/0006_job_protocol.sql).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimAnswer {
    Run,
    Skip,
    NotDue,
    Busy,
    Fenced,
    Stale,
    Dead,
    UnknownJob,
    WrongWiring,
}

impl ClaimAnswer {
    fn parse(s: &str) -> Option<ClaimAnswer> {
        Some(match s {
            "run" => ClaimAnswer::Run,
            "skip" => ClaimAnswer::Skip,
            "not_due" => ClaimAnswer::NotDue,
            "busy" => ClaimAnswer::Busy,
            "fenced" => ClaimAnswer::Fenced,
            "stale" => ClaimAnswer::Stale,
            "dead" => ClaimAnswer::Dead,
            "unknown_job" => ClaimAnswer::UnknownJob,
            "wrong_wiring" => ClaimAnswer::WrongWiring,
            _ => return None,
        })
    }
}

/// Apply a verdict's queue action to one message.
async fn act(queue: &dyn Queue, receipt: &str, action: QueueAction) -> Result<(), queue::QueueError> {
    match action {
        QueueAction::Delete => queue.delete(receipt).await,
        QueueAction::Hide(after) => queue.change_visibility(receipt, after).await,
        QueueAction::Leave => Ok(()),
    }
}
