//! Consumer-side helpers shared by consumer/tests/it/consumer.rs and the fault-injection
//! measurement: a handler whose business effect is one row per run that
//! commits, so duplicate effects can be counted.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer::worker::{Worker, WorkerMetrics};
use outbox_consumer::{Consumer, ConsumerConfig, Handler, HandlerError, Job};
use tokio::sync::Notify;
use tokio_postgres::Transaction;

use crate::*;

pub const EFFECTS_DDL: &str =
    "CREATE TABLE IF NOT EXISTS business_effects (job_id text, generation int, attempt int, at timestamptz DEFAULT now())";

/// Writes one `business_effects` row in the job's transaction. The fail point
/// `consumer::in_handler` (measurement builds only) ends the process after the
/// write and before the commit.
pub struct Effect;

#[async_trait]
impl Handler for Effect {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        tx.execute(
            "INSERT INTO business_effects (job_id, generation, attempt) VALUES ($1, $2, $3)",
            &[&job.job_id, &job.generation, &job.attempt],
        )
        .await
        .map_err(|e| HandlerError::Retry(e.to_string()))?;
        outbox_relay::faults::crash_point("consumer::in_handler");
        Ok(())
    }
}

/// A database with the `business_effects` table.
pub async fn effects_db(test: &str) -> TestDb {
    let db = TestDb::new(test).await;
    db.client().await.batch_execute(EFFECTS_DDL).await.unwrap();
    db.audit_inserts().await;
    db
}

pub fn consumer(url: &str, worker: &str, lease: Duration) -> Consumer {
    Consumer::new(
        Consumer::pool(url, 16).unwrap(),
        ConsumerConfig {
            worker_id: worker.into(),
            lease,
            retry_base: Duration::from_millis(200),
            retry_max: Duration::from_secs(2),
        },
    )
}

pub async fn effects(db: &TestDb, where_clause: &str) -> i64 {
    db.client()
        .await
        .query_one(&format!("SELECT count(*) FROM business_effects WHERE {where_clause}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// A [`Worker`] running in a task until [`RunningWorker::stop`].
pub struct RunningWorker {
    pub metrics: Arc<WorkerMetrics>,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningWorker {
    /// Start `worker`, long-polling `wait` at a time (short, so it stops quickly).
    pub fn start(mut worker: Worker, wait: Duration) -> RunningWorker {
        worker.wait = wait;
        let metrics = Arc::clone(&worker.metrics);
        let stop = Arc::new(Notify::new());
        let task = {
            let stop = Arc::clone(&stop);
            tokio::spawn(worker.run(async move { stop.notified().await }))
        };
        RunningWorker { metrics, stop, task }
    }

    /// Graceful stop: the worker finishes what it holds.
    pub async fn stop(self) {
        self.stop.notify_one();
        self.task.await.unwrap();
    }
}
