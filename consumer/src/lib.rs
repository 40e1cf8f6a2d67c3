//! The consumer library: makes the relay's at-least-once delivery harmless.
//!
//! - [`enqueue`] writes a job and its outbox event in the caller's
//!   transaction (the SQL function `outbox_enqueue_job` does the same for any
//!   language).
//! - [`Consumer::process`] judges a received message by the database, never
//!   by the message: terminal job → delete without running; retry not yet due
//!   → change visibility; PENDING (or due, or a lease expired) → CAS claim,
//!   run the handler *in a transaction*, then one CAS transition. The handler's
//!   writes commit in the same transaction as the transition to SUCCEEDED, so
//!   a fenced worker (its lease taken over, the job redriven) leaves no effect.
//! - [`redrive`] bumps the generation and emits a new event in one transaction;
//!   messages of older generations can no longer claim or close the job.
//! - [`Consumer::process_dlq`] marks jobs whose messages SQS gave up on DEAD,
//!   without touching a job whose lease is live.
//! - [`worker::Worker`] long-polls a queue and runs all this concurrently.

#[cfg(any(test, feature = "test-utils"))]
pub mod memory;
pub mod queue;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod worker;

/// The jobs table and the protocol's SQL functions (`outbox_enqueue_job`,
/// `outbox_redrive_job`, ...): run by [`migrate`], and by `outbox-relay
/// migrate` as its migration 4.
pub const JOBS_SQL: &str = include_str!("../migrations/jobs.sql");

/// Create or update the jobs table and its functions (idempotent), under the
/// same advisory lock and record as `outbox-relay migrate`, for a service
/// that only consumes. Returns whether it was applied now.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<bool, tokio_postgres::Error> {
    Ok(!apply_migrations(client, &[(JOBS_MIGRATION, "jobs", JOBS_SQL)]).await?.is_empty())
}

/// Apply the `(version, name, sql)` migrations not recorded yet in
/// `outbox_relay_migrations`, in order, in one transaction under an advisory
/// lock so concurrent deploys do not race. Returns the versions applied now.
/// `outbox-relay migrate` runs its own list through this too.
pub async fn apply_migrations(
    client: &mut tokio_postgres::Client,
    migrations: &[(i32, &str, &str)],
) -> Result<Vec<i32>, tokio_postgres::Error> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
                 version int PRIMARY KEY,
                 name text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock(hashtext('outbox_relay_migrations'))", &[]).await?;
    let mut applied = Vec::new();
    for (version, name, sql) in migrations {
        let done =
            tx.query_opt("SELECT 1 FROM outbox_relay_migrations WHERE version = $1", &[version]).await?.is_some();
        if done {
            continue;
        }
        tx.batch_execute(sql).await?;
        tx.execute("INSERT INTO outbox_relay_migrations (version, name) VALUES ($1, $2)", &[version, name]).await?;
        applied.push(*version);
    }
    tx.commit().await?;
    Ok(applied)
}

/// The jobs table's version in `outbox_relay_migrations`.
pub const JOBS_MIGRATION: i32 = 4;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use rand::Rng;
use tokio::sync::watch;
use tokio_postgres::{GenericClient, Transaction};

use queue::{Queue, ReceivedMessage, MAX_VISIBILITY};

#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("connection pool: {0}")]
    Pool(String),
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
}

/// What to enqueue.
#[derive(Debug, Clone)]
pub struct NewJob<'a> {
    pub kind: &'a str,
    pub payload: &'a serde_json::Value,
    /// The outbox destination (lane) its messages go to.
    pub destination: &'a str,
    /// FIFO MessageGroupId, for a FIFO queue.
    pub group_key: Option<&'a str>,
    /// Your own idempotency key; by default the hash of kind and payload.
    pub job_id: Option<&'a str>,
}

/// Enqueue a job with its outbox event in `client`'s transaction. Identical
/// work enqueued again is a no-op returning the same id; the same `job_id`
/// with a different kind or payload is an error (SQLSTATE 23505).
pub async fn enqueue<C: GenericClient>(client: &C, job: &NewJob<'_>) -> Result<String, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT outbox_enqueue_job($1, $2, $3, $4, $5)",
            &[&job.kind, &job.payload, &job.destination, &job.group_key, &job.job_id],
        )
        .await?;
    Ok(row.get(0))
}

/// The id `enqueue` gives this work (computed by the database, so every
/// language agrees).
pub async fn job_id<C: GenericClient>(
    client: &C,
    kind: &str,
    payload: &serde_json::Value,
) -> Result<String, tokio_postgres::Error> {
    Ok(client.query_one("SELECT outbox_job_id($1, $2)", &[&kind, payload]).await?.get(0))
}

/// Redrive a job: new generation, reset, new outbox event, in `client`'s
/// transaction. Returns the new generation.
pub async fn redrive<C: GenericClient>(client: &C, job_id: &str) -> Result<i32, tokio_postgres::Error> {
    Ok(client.query_one("SELECT outbox_redrive_job($1)", &[&job_id]).await?.get(0))
}

/// Ask a job not to run (again). A claimed job's handler sees it through its
/// lease heartbeat; a rescue keeps it; the next claim ends the job DEAD
/// ('CANCELLED'). Returns false if the job is already terminal.
pub async fn request_cancel<C: GenericClient>(client: &C, job_id: &str) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "UPDATE jobs SET cancel_requested = true, updated_at = now()
              WHERE job_id = $1 AND status IN ('PENDING', 'CLAIMED')",
            &[&job_id],
        )
        .await?;
    Ok(n == 1)
}

/// A job's message, as the outbox event carries it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct JobMessage {
    pub job_id: String,
    pub kind: String,
    pub generation: i32,
}

impl JobMessage {
    pub fn parse(body: &str) -> Option<JobMessage> {
        let m: JobMessage = serde_json::from_str(body).ok()?;
        (!m.job_id.is_empty() && !m.kind.is_empty() && m.generation >= 0).then_some(m)
    }
}

/// The claimed job a handler runs.
#[derive(Debug, Clone)]
pub struct Job {
    pub job_id: String,
    pub kind: String,
    pub payload: serde_json::Value,
    /// 1 on the first claim.
    pub attempt: i32,
    pub generation: i32,
    /// True once the job's cancellation was requested, or its lease was lost:
    /// stop early; whatever the handler returns is then fenced or discarded.
    pub cancelled: watch::Receiver<bool>,
}

/// How a handler failed.
#[derive(Debug, Clone)]
pub enum HandlerError {
    /// Try again later (time-based exponential backoff with jitter).
    Retry(String),
    /// It will never work: the job ends DEAD with this reason.
    Permanent(String),
}

#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Run the job. Business writes go through `tx`: they commit together
    /// with the job's transition to SUCCEEDED, or not at all.
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError>;
}

/// What became of one received message.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Claimed, handled, SUCCEEDED; message deleted.
    Succeeded {
        rescued: bool,
    },
    /// Handler asked to retry: job PENDING until `after`; message hidden as long.
    Retried {
        after: Duration,
        rescued: bool,
    },
    /// Handler failed permanently (or the job was cancelled): DEAD; message deleted.
    Dead {
        reason: String,
    },
    /// Job already SUCCEEDED or DEAD: deleted without running.
    TerminalSkip,
    /// A retry not yet due: visibility changed to the remaining time.
    NotDue {
        after: Duration,
    },
    /// Another worker holds a live lease: message hidden until it expires.
    Busy {
        after: Duration,
    },
    /// A CAS found the job changed under us (claimed by another, redriven,
    /// rescued): nothing else was done.
    Fenced,
    /// A message of an older generation: rejected and deleted.
    Stale,
    /// Neither run nor deleted: SQS's redrive policy will move it to the DLQ.
    Unparseable,
    UnknownJob,
    WrongWiring(String),
}

impl Disposition {
    pub fn label(&self) -> &'static str {
        match self {
            Disposition::Succeeded { .. } => "succeeded",
            Disposition::Retried { .. } => "retried",
            Disposition::Dead { .. } => "dead",
            Disposition::TerminalSkip => "terminal_skip",
            Disposition::NotDue { .. } => "not_due",
            Disposition::Busy { .. } => "busy",
            Disposition::Fenced => "fenced",
            Disposition::Stale => "stale",
            Disposition::Unparseable => "unparseable",
            Disposition::UnknownJob => "unknown_job",
            Disposition::WrongWiring(_) => "wrong_wiring",
        }
    }
}

/// What a DLQ message did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DlqDisposition {
    /// The job was non-terminal and is now DEAD ('DLQ'); message deleted.
    MarkedDead,
    /// The job is terminal already; message deleted.
    AlreadyTerminal,
    /// A live lease: left alone (the message stays for a later look).
    LeaseLive,
    /// Not a job message or no such job: left in the DLQ for a human.
    Unrecognised,
}

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

/// Judges and runs received messages against the jobs table.
pub struct Consumer {
    pool: deadpool_postgres::Pool,
    handlers: HashMap<String, Arc<dyn Handler>>,
    pub config: ConsumerConfig,
}

/// The job row as a message finds it.
struct Seen {
    kind: String,
    status: String,
    attempts: i32,
    generation: i32,
    /// Seconds until next_attempt_at (positive: not due).
    due_in: Option<f64>,
    /// Seconds until the lease expires (positive: live).
    lease_in: Option<f64>,
}

const FENCE: &str =
    "job_id = $1 AND claimed_by = $2 AND status = 'CLAIMED' AND attempt_count = $3 AND redrive_generation = $4";

impl Consumer {
    pub fn new(pool: deadpool_postgres::Pool, config: ConsumerConfig) -> Self {
        Self { pool, handlers: HashMap::new(), config }
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

    async fn conn(&self) -> Result<deadpool_postgres::Object, ConsumerError> {
        self.pool.get().await.map_err(|e| ConsumerError::Pool(e.to_string()))
    }

    async fn seen(&self, c: &impl GenericClient, job_id: &str) -> Result<Option<Seen>, ConsumerError> {
        let row = c
            .query_opt(
                "SELECT kind, status, attempt_count, redrive_generation,
                        extract(epoch FROM next_attempt_at - now())::float8,
                        extract(epoch FROM lease_expires_at - now())::float8
                   FROM jobs WHERE job_id = $1",
                &[&job_id],
            )
            .await?;
        Ok(row.map(|r| Seen {
            kind: r.get(0),
            status: r.get(1),
            attempts: r.get(2),
            generation: r.get(3),
            due_in: r.get(4),
            lease_in: r.get(5),
        }))
    }

    /// Judge one message and act on it. Database errors are returned with
    /// nothing deleted: the message comes back after its visibility timeout.
    pub async fn process(&self, queue: &dyn Queue, msg: &ReceivedMessage) -> Result<Disposition, ConsumerError> {
        let Some(m) = JobMessage::parse(&msg.body) else {
            tracing::warn!(receipt = %msg.receipt, "unparseable job message: left for the DLQ");
            return Ok(Disposition::Unparseable);
        };
        let Some(handler) = self.handlers.get(&m.kind).cloned() else {
            tracing::warn!(job_id = %m.job_id, kind = %m.kind, "no handler for this kind on this worker: left for the DLQ");
            return Ok(Disposition::WrongWiring(format!("no handler for kind {:?}", m.kind)));
        };
        let conn = self.conn().await?;
        let Some(job) = self.seen(&**conn, &m.job_id).await? else {
            tracing::warn!(job_id = %m.job_id, "message for a job the database does not have: left for the DLQ");
            return Ok(Disposition::UnknownJob);
        };
        if job.kind != m.kind {
            return Ok(Disposition::WrongWiring(format!("message kind {:?}, job kind {:?}", m.kind, job.kind)));
        }
        if m.generation > job.generation {
            return Ok(Disposition::WrongWiring(format!(
                "message generation {} is newer than the job's {}",
                m.generation, job.generation
            )));
        }
        if m.generation < job.generation {
            drop(conn);
            self.reject_stale(&m).await?;
            queue.delete(&msg.receipt).await?;
            return Ok(Disposition::Stale);
        }
        match job.status.as_str() {
            "SUCCEEDED" | "DEAD" => {
                queue.delete(&msg.receipt).await?;
                return Ok(Disposition::TerminalSkip);
            }
            "PENDING" if job.due_in.is_some_and(|s| s > 0.0) => {
                let after = Duration::from_secs_f64(job.due_in.unwrap_or(0.0));
                queue.change_visibility(&msg.receipt, after).await?;
                return Ok(Disposition::NotDue { after: after.min(MAX_VISIBILITY) });
            }
            "CLAIMED" if job.lease_in.is_some_and(|s| s > 0.0) => {
                let after = Duration::from_secs_f64(job.lease_in.unwrap_or(0.0)) + Duration::from_secs(1);
                queue.change_visibility(&msg.receipt, after).await?;
                return Ok(Disposition::Busy { after });
            }
            _ => {}
        }
        let rescued = job.status == "CLAIMED";
        // The claim: status, attempt_count and generation as seen, and still claimable.
        let claimed = conn
            .query_opt(
                "UPDATE jobs
                    SET status = 'CLAIMED', claimed_by = $2, attempt_count = attempt_count + 1,
                        lease_expires_at = now() + make_interval(secs => $6), next_attempt_at = NULL, updated_at = now()
                  WHERE job_id = $1 AND status = $3 AND attempt_count = $4 AND redrive_generation = $5
                    AND ((status = 'PENDING' AND (next_attempt_at IS NULL OR next_attempt_at <= now()))
                      OR (status = 'CLAIMED' AND lease_expires_at <= now()))
              RETURNING attempt_count, payload, cancel_requested",
                &[
                    &m.job_id,
                    &self.config.worker_id,
                    &job.status,
                    &job.attempts,
                    &m.generation,
                    &self.config.lease.as_secs_f64(),
                ],
            )
            .await?;
        let Some(row) = claimed else {
            // Someone else got there: let the message come back after their lease.
            queue.change_visibility(&msg.receipt, self.config.lease).await?;
            return Ok(Disposition::Fenced);
        };
        let attempt: i32 = row.get(0);
        let payload: serde_json::Value = row.get(1);
        let cancel: bool = row.get(2);
        if rescued {
            tracing::info!(job_id = %m.job_id, attempt, "expired lease rescued");
        }
        drop(conn);
        if cancel {
            return self.finish_dead(queue, msg, &m, attempt, "CANCELLED").await;
        }
        self.run(queue, msg, &m, handler, attempt, payload, rescued).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        queue: &dyn Queue,
        msg: &ReceivedMessage,
        m: &JobMessage,
        handler: Arc<dyn Handler>,
        attempt: i32,
        payload: serde_json::Value,
        rescued: bool,
    ) -> Result<Disposition, ConsumerError> {
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let job = Job {
            job_id: m.job_id.clone(),
            kind: m.kind.clone(),
            payload,
            attempt,
            generation: m.generation,
            cancelled: cancel_rx,
        };
        // The lease heartbeat: extends the lease and the message's visibility
        // together, and tells the handler when it was cancelled or fenced.
        let heartbeat = {
            let pool = self.pool.clone();
            let cfg = self.config.clone();
            let (job_id, generation) = (m.job_id.clone(), m.generation);
            let receipt = msg.receipt.clone();
            let queue_ref: &dyn Queue = queue;
            async move {
                let every = cfg.lease / 3;
                loop {
                    tokio::time::sleep(every).await;
                    let Ok(c) = pool.get().await else { continue };
                    let r = c
                        .query_opt(
                            &format!(
                                "UPDATE jobs SET lease_expires_at = now() + make_interval(secs => $5), updated_at = now()
                                  WHERE {FENCE} RETURNING cancel_requested"
                            ),
                            &[&job_id, &cfg.worker_id, &attempt, &generation, &cfg.lease.as_secs_f64()],
                        )
                        .await;
                    match r {
                        Ok(Some(row)) => {
                            let _ = queue_ref.change_visibility(&receipt, cfg.lease + Duration::from_secs(5)).await;
                            if row.get::<_, bool>(0) {
                                let _ = cancel_tx.send(true);
                            }
                        }
                        Ok(None) => {
                            let _ = cancel_tx.send(true); // fenced: the lease is gone
                        }
                        Err(_) => {}
                    }
                }
            }
        };
        let mut conn = self.conn().await?;
        let tx = conn.transaction().await?;
        let work = std::panic::AssertUnwindSafe(handler.handle(&job, &tx)).catch_unwind();
        tokio::pin!(heartbeat);
        let result = tokio::select! {
            r = work => r,
            _ = &mut heartbeat => unreachable!("the heartbeat never ends"),
        };
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(HandlerError::Retry("handler panicked".into())),
        };
        let fence: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&m.job_id, &self.config.worker_id, &attempt, &m.generation];
        match result {
            Ok(()) => {
                let n = tx
                    .execute(
                        &format!(
                            "UPDATE jobs SET status = 'SUCCEEDED', finished_at = now(), lease_expires_at = NULL,
                                    last_error = NULL, updated_at = now() WHERE {FENCE}"
                        ),
                        &fence,
                    )
                    .await?;
                if n == 0 {
                    tx.rollback().await?;
                    tracing::info!(job_id = %m.job_id, attempt, "fenced at completion: effects rolled back");
                    return Ok(Disposition::Fenced);
                }
                tx.commit().await?;
                queue.delete(&msg.receipt).await?;
                Ok(Disposition::Succeeded { rescued })
            }
            Err(HandlerError::Retry(e)) => {
                tx.rollback().await?;
                let after = self.backoff(attempt);
                let n = conn
                    .execute(
                        &format!(
                            "UPDATE jobs SET status = 'PENDING', next_attempt_at = now() + make_interval(secs => $5),
                                    lease_expires_at = NULL, last_error = $6, updated_at = now() WHERE {FENCE}"
                        ),
                        &[&m.job_id, &self.config.worker_id, &attempt, &m.generation, &after.as_secs_f64(), &e],
                    )
                    .await?;
                if n == 0 {
                    return Ok(Disposition::Fenced);
                }
                queue.change_visibility(&msg.receipt, after).await?;
                Ok(Disposition::Retried { after, rescued })
            }
            Err(HandlerError::Permanent(e)) => {
                tx.rollback().await?;
                drop(conn);
                self.finish_dead(queue, msg, m, attempt, &e).await
            }
        }
    }

    async fn finish_dead(
        &self,
        queue: &dyn Queue,
        msg: &ReceivedMessage,
        m: &JobMessage,
        attempt: i32,
        reason: &str,
    ) -> Result<Disposition, ConsumerError> {
        let conn = self.conn().await?;
        let n = conn
            .execute(
                &format!(
                    "UPDATE jobs SET status = 'DEAD', dead_reason = $5, last_error = $5, finished_at = now(),
                            lease_expires_at = NULL, updated_at = now() WHERE {FENCE}"
                ),
                &[&m.job_id, &self.config.worker_id, &attempt, &m.generation, &reason],
            )
            .await?;
        if n == 0 {
            return Ok(Disposition::Fenced);
        }
        tracing::warn!(job_id = %m.job_id, reason, "job DEAD");
        queue.delete(&msg.receipt).await?;
        Ok(Disposition::Dead { reason: reason.to_string() })
    }

    /// A message older than the job's generation: under `FOR UPDATE`, mark
    /// the job DEAD('STALE') only if it is still on that generation (it is
    /// not, unless the redrive that made it stale rolled back).
    async fn reject_stale(&self, m: &JobMessage) -> Result<(), ConsumerError> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await?;
        let row =
            tx.query_opt("SELECT redrive_generation FROM jobs WHERE job_id = $1 FOR UPDATE", &[&m.job_id]).await?;
        if let Some(r) = row {
            if r.get::<_, i32>(0) == m.generation {
                tx.execute(
                    "UPDATE jobs SET status = 'DEAD', dead_reason = 'STALE', finished_at = now(), updated_at = now()
                      WHERE job_id = $1 AND redrive_generation = $2 AND status IN ('PENDING', 'CLAIMED')",
                    &[&m.job_id, &m.generation],
                )
                .await?;
            }
        }
        tx.commit().await?;
        tracing::info!(job_id = %m.job_id, generation = m.generation, "stale generation message rejected");
        Ok(())
    }

    /// `retry_base × 2^(attempt-1)`, capped at `retry_max`, jittered over its
    /// upper half so retries of many jobs spread out.
    pub fn backoff(&self, attempt: i32) -> Duration {
        let doublings = (attempt - 1).clamp(0, 20) as u32;
        let exp = self.config.retry_base.saturating_mul(1u32 << doublings).min(self.config.retry_max);
        let half = exp / 2;
        half + Duration::from_secs_f64(rand::rng().random::<f64>() * half.as_secs_f64())
    }

    /// A message SQS moved to the dead-letter queue: its job, if still
    /// PENDING or CLAIMED with an expired lease, ends DEAD('DLQ').
    pub async fn process_dlq(&self, queue: &dyn Queue, msg: &ReceivedMessage) -> Result<DlqDisposition, ConsumerError> {
        let Some(m) = JobMessage::parse(&msg.body) else { return Ok(DlqDisposition::Unrecognised) };
        let conn = self.conn().await?;
        let Some(job) = self.seen(&**conn, &m.job_id).await? else { return Ok(DlqDisposition::Unrecognised) };
        if job.status == "SUCCEEDED" || job.status == "DEAD" || m.generation < job.generation {
            queue.delete(&msg.receipt).await?;
            return Ok(DlqDisposition::AlreadyTerminal);
        }
        let n = conn
            .execute(
                "UPDATE jobs SET status = 'DEAD', dead_reason = 'DLQ', last_error = coalesce(last_error, 'moved to the DLQ'),
                        finished_at = now(), lease_expires_at = NULL, updated_at = now()
                  WHERE job_id = $1 AND redrive_generation = $2
                    AND (status = 'PENDING' OR (status = 'CLAIMED' AND lease_expires_at <= now()))",
                &[&m.job_id, &m.generation],
            )
            .await?;
        if n == 1 {
            tracing::warn!(job_id = %m.job_id, "job DEAD: its message reached the DLQ");
            queue.delete(&msg.receipt).await?;
            Ok(DlqDisposition::MarkedDead)
        } else {
            Ok(DlqDisposition::LeaseLive)
        }
    }
}
