//! Worker throughput with a no-op handler: jobs/s through ministack versus
//! an in-memory queue, side by side in one run, on the project's own stack.
//!
//!     cargo run --release --example worker_bench -- [--jobs 5000] [--concurrency 16]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_consumer::memory::MemoryQueue;
use outbox_consumer::queue::Queue;
use outbox_consumer::sqs::SqsQueue;
use outbox_consumer::worker::Worker;
use outbox_consumer::{Consumer, ConsumerConfig, Handler, HandlerError, Job};
use tokio_postgres::Transaction;

struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(&self, _job: &Job, _tx: &Transaction<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Enqueue `n` jobs; returns their message bodies.
async fn jobs(db: &common::TestDb, tag: &str, n: usize) -> Vec<String> {
    let c = db.client().await;
    c.execute(
        "SELECT outbox_enqueue_job('noop', jsonb_build_object('tag', $1::text, 'n', i), 'jobs') FROM generate_series(1, $2::int) i",
        &[&tag, &(n as i32)],
    )
    .await
    .unwrap();
    c.query("SELECT body FROM outbox WHERE event_id LIKE 'noop:%' AND status = 'NEW'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn drain(db: &common::TestDb, queue: Arc<dyn Queue>, n: usize, concurrency: usize) -> f64 {
    let consumer = Arc::new(
        Consumer::new(Consumer::pool(&db.url, concurrency * 2 + 2).unwrap(), ConsumerConfig::default())
            .handle("noop", Noop),
    );
    let started = Instant::now();
    let w = common::jobs::RunningWorker::start(Worker::new(consumer, queue, concurrency), Duration::from_secs(1));
    while (w.metrics.count("succeeded") as usize) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    w.stop().await;
    n as f64 / secs
}

#[tokio::main]
async fn main() {
    let n = arg("--jobs", 5_000);
    let concurrency = arg("--concurrency", 16);
    let db = common::TestDb::new("workerbench").await;
    let c = db.client().await;

    // In memory: the database's share of the cost.
    let bodies = jobs(&db, "mem", n).await;
    c.batch_execute("UPDATE outbox SET status = 'PUBLISHED'").await.unwrap();
    let mem = MemoryQueue::new(Duration::from_secs(60));
    for b in &bodies {
        mem.send(b.clone());
    }
    let mem_rate = drain(&db, Arc::new(mem), n, concurrency).await;

    // ministack: the same work through SQS's API.
    let sqs = common::sqs().await;
    let url = common::create_queue(&sqs, "workerbench", false, None).await;
    let bodies = jobs(&db, "sqs", n).await;
    for chunk in bodies.chunks(10) {
        let mut req = sqs.client().send_message_batch().queue_url(&url);
        for (i, b) in chunk.iter().enumerate() {
            req = req.entries(
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(b)
                    .build()
                    .unwrap(),
            );
        }
        req.send().await.unwrap();
    }
    let sqs_rate = drain(&db, Arc::new(SqsQueue::new(sqs.client().clone(), &url)), n, concurrency).await;
    println!(
        "{}",
        serde_json::json!({
            "jobs": n,
            "concurrency": concurrency,
            "memory_queue_jobs_per_s": mem_rate.round(),
            "ministack_jobs_per_s": sqs_rate.round(),
            "ministack_vs_memory": (sqs_rate / mem_rate * 100.0).round() / 100.0,
        })
    );
}
