//! A runnable worker: long-polls a queue and runs jobs of kind "effect",
//! whose handler writes one row per job into `business_effects` in the same
//! transaction as the job's completion, so duplicate effects can be counted:
//!
//!     SELECT job_id, generation, count(*) FROM business_effects GROUP BY 1, 2 HAVING count(*) > 1;
//!
//!     cargo run --release --example worker -- --database-url URL --queue-url URL \
//!         [--dlq-url URL] [--endpoint-url http://127.0.0.1:4566] [--concurrency 16]
//!
//! Enqueue work from SQL: SELECT outbox_enqueue_job('effect', '{"n": 1}', 'jobs');
//! with the relay routing destination "jobs" to the same queue. Stops on SIGINT.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_consumer::sqs::SqsQueue;
use outbox_consumer::worker::Worker;
use outbox_consumer::{Consumer, ConsumerConfig, Handler, HandlerError, Job};
use outbox_relay::publish::aws::AwsPublisher;
use tokio_postgres::Transaction;

struct Effect;

#[async_trait]
impl Handler for Effect {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        tx.execute(
            "INSERT INTO business_effects (job_id, generation, attempt) VALUES ($1, $2, $3)",
            &[&job.job_id, &job.generation, &job.attempt],
        )
        .await
        .map_err(|e| HandlerError::Retry(e.to_string()))?;
        Ok(())
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let database_url = arg("--database-url").ok_or_else(|| anyhow::anyhow!("--database-url is required"))?;
    let queue_url = arg("--queue-url").ok_or_else(|| anyhow::anyhow!("--queue-url is required"))?;
    let concurrency: usize = arg("--concurrency").map(|s| s.parse()).transpose()?.unwrap_or(16);
    let sqs = AwsPublisher::new("us-east-1", arg("--endpoint-url").as_deref()).await;
    let pool = Consumer::pool(&database_url, concurrency * 2 + 2)?;
    pool.get()
        .await?
        .batch_execute("CREATE TABLE IF NOT EXISTS business_effects (job_id text, generation int, attempt int, at timestamptz DEFAULT now())")
        .await?;
    let consumer = Arc::new(Consumer::new(pool, ConsumerConfig::default()).handle("effect", Effect));
    let stop = || async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let main = Worker::new(Arc::clone(&consumer), Arc::new(SqsQueue::new(sqs.sqs().clone(), &queue_url)), concurrency);
    let metrics = Arc::clone(&main.metrics);
    let dlq = arg("--dlq-url").map(|url| {
        let mut w = Worker::new(Arc::clone(&consumer), Arc::new(SqsQueue::new(sqs.sqs().clone(), url)), 2);
        w.dlq = true;
        tokio::spawn(w.run(stop()))
    });
    main.run(stop()).await;
    if let Some(d) = dlq {
        let _ = d.await;
    }
    print!("{}", metrics.render());
    Ok(())
}
