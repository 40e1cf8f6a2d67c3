//! Worker throughput with a no-op handler, side by side in one run on the
//! project's own stack: the worker through an in-memory queue (the
//! database's share), through ministack, and the ceiling there — a raw SQS
//! client doing ReceiveMessage(10) + DeleteMessageBatch with as many
//! messages in flight (concurrency / 10 loops) — with the database round
//! trips per job.
//!
//!     cargo run --release --example worker_bench -- [--jobs 5000] [--concurrency 16]

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
async fn jobs(db: &testkit::TestDb, tag: &str, n: usize) -> Vec<String> {
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

/// Jobs/s and database round trips per job.
async fn drain(db: &testkit::TestDb, queue: Arc<dyn Queue>, n: usize, concurrency: usize) -> (f64, f64) {
    let consumer = Arc::new(
        Consumer::new(Consumer::pool(&db.url, concurrency * 2 + 2).unwrap(), ConsumerConfig::default())
            .handle("noop", Noop),
    );
    let started = Instant::now();
    let w = testkit::jobs::RunningWorker::start(
        Worker::new(Arc::clone(&consumer), queue, concurrency),
        Duration::from_secs(1),
    );
    while (w.metrics.count("succeeded") as usize) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let trips = consumer.round_trips() as f64 / n as f64;
    w.stop().await;
    (n as f64 / secs, trips)
}

/// Send `bodies` to `url`, 10 a call.
async fn fill(sqs: &outbox_relay::publish::aws::AwsPublisher, url: &str, bodies: &[String]) {
    for chunk in bodies.chunks(10) {
        let mut req = sqs.sqs().send_message_batch().queue_url(url);
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
}

/// The ceiling: `loops` tasks each receiving 10 and deleting them in one
/// DeleteMessageBatch, until `n` are deleted. Messages/s.
async fn raw_ceiling(client: &aws_sdk_sqs::Client, url: &str, n: usize, loops: usize) -> f64 {
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..loops {
        let (client, url, done) = (client.clone(), url.to_string(), Arc::clone(&done));
        tasks.spawn(async move {
            while done.load(std::sync::atomic::Ordering::Relaxed) < n {
                let got = client
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .send()
                    .await
                    .unwrap();
                let msgs = got.messages.unwrap_or_default();
                if msgs.is_empty() {
                    continue;
                }
                let mut del = client.delete_message_batch().queue_url(&url);
                for (i, m) in msgs.iter().enumerate() {
                    del = del.entries(
                        aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .receipt_handle(m.receipt_handle.clone().unwrap_or_default())
                            .build()
                            .unwrap(),
                    );
                }
                del.send().await.unwrap();
                done.fetch_add(msgs.len(), std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    n as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let n = arg("--jobs", 5_000);
    let concurrency = arg("--concurrency", 16);
    let db = testkit::TestDb::new("workerbench").await;
    let c = db.client().await;

    // In memory: the database's share of the cost.
    let bodies = jobs(&db, "mem", n).await;
    c.batch_execute("UPDATE outbox SET status = 'PUBLISHED'").await.unwrap();
    let mem = MemoryQueue::new(Duration::from_secs(60));
    for b in &bodies {
        mem.send(b.clone());
    }
    let (mem_rate, mem_trips) = drain(&db, Arc::new(mem), n, concurrency).await;

    // ministack: the same work through SQS's API, and the raw ceiling.
    let sqs = testkit::sqs().await;
    let url = testkit::create_queue(&sqs, "workerbench", false, None).await;
    let bodies = jobs(&db, "sqs", n).await;
    fill(&sqs, &url, &bodies).await;
    let (sqs_rate, sqs_trips) = drain(&db, Arc::new(SqsQueue::new(sqs.sqs().clone(), &url)), n, concurrency).await;
    let raw_url = testkit::create_queue(&sqs, "workerbench-raw", false, None).await;
    fill(&sqs, &raw_url, &bodies).await;
    let loops = concurrency.div_ceil(10);
    let raw_rate = raw_ceiling(sqs.sqs(), &raw_url, n, loops).await;
    println!("worker, in-memory queue: {mem_rate:.0} jobs/s ({mem_trips:.2} database round trips per job)");
    println!("worker, ministack:       {sqs_rate:.0} jobs/s ({sqs_trips:.2} database round trips per job)");
    println!("raw client, ministack:   {raw_rate:.0} messages/s (receive 10 + DeleteMessageBatch, {loops} loops)");
    println!("worker vs raw ceiling:   {:.2}", sqs_rate / raw_rate);
    println!(
        "{}",
        serde_json::json!({
            "jobs": n,
            "concurrency": concurrency,
            "memory_queue_jobs_per_s": mem_rate.round(),
            "ministack_jobs_per_s": sqs_rate.round(),
            "ministack_vs_memory": (sqs_rate / mem_rate * 100.0).round() / 100.0,
            "raw_receive_delete_batch_msgs_per_s": raw_rate.round(),
            "raw_loops": loops,
            "worker_vs_raw": (sqs_rate / raw_rate * 100.0).round() / 100.0,
            "db_round_trips_per_job": (sqs_trips * 100.0).round() / 100.0,
            "db_round_trips_per_job_memory": (mem_trips * 100.0).round() / 100.0,
        })
    );
}
