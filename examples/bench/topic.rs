//! One SNS topic (ministack's, with one raw SQS subscription, as a fan-out
//! has) drained by the relay beside a raw `PublishBatch` client keeping
//! the relay's cap of calls in flight, side by side in one run, at each
//! body size: messages/s from the first call to the last, and CPU per
//! 100k messages of this process (the raw client, or the relay in it).
//! The stand-in is the same for both: the ratio says what the relay costs
//! over the calls themselves on this machine, not SNS's own rate.

use super::*;

#[derive(serde::Serialize)]
pub(super) struct TopicDrain {
    messages: usize,
    body_bytes: usize,
    rows_per_txn: usize,
    /// The raw client's calls in flight: the relay's `max_in_flight_batches`.
    concurrency: usize,
    raw_msgs_per_s: f64,
    relay_msgs_per_s: f64,
    /// relay / raw: the target is ≥ 0.9.
    pub(super) ratio: f64,
    raw_cpu_s_per_100k: f64,
    relay_cpu_s_per_100k: f64,
    /// relay / raw CPU per message: the target is ≤ 1.3.
    pub(super) cpu_ratio: f64,
    raw_machine_busy_pct: f64,
    relay_machine_busy_pct: f64,
    relay_calls: u64,
}

/// The comparison at each body size of `sizes`.
pub(super) async fn topic_drains(a: &Args, sqs: &AwsPublisher, n: usize, sizes: &[usize]) -> Vec<TopicDrain> {
    let mut out = Vec::new();
    for &size in sizes {
        let row = topic_drain(a, sqs, n, size).await;
        eprintln!("bench: topic, {size} B bodies: relay {:.0}/s, ratio {:.2}", row.relay_msgs_per_s, row.ratio);
        out.push(row);
    }
    out
}

async fn topic_drain(a: &Args, sqs: &AwsPublisher, n: usize, size: usize) -> TopicDrain {
    let raw_topic = testkit::create_topic(sqs, "bench_raw", false).await;
    let raw_sub = testkit::subscribed_queue(sqs, &raw_topic, "bench_raw_sub", true).await;
    let db = TestDb::new("bench_topic").await;
    let cap = config(&db, &[("d0", &raw_topic)]).max_in_flight_batches;
    let phase = Phase::start();
    let raw = raw_sns(sqs, &raw_topic, n, cap, size).await;
    let (raw_cpu, raw_busy) = phase.end();

    let topic = testkit::create_topic(sqs, "bench_relay", false).await;
    let sub = testkit::subscribed_queue(sqs, &topic, "bench_relay_sub", true).await;
    create_slot(&db, &db.slot).await;
    insert_backlog(&db, "t", n, 1, a.txn_size, size).await;
    let mut cfg = config(&db, &[("d0", &topic)]);
    cfg.metrics_addr = None;
    let clocked = Clocked::new(sqs);
    let phase = Phase::start();
    let relay = start(cfg, clocked.clone());
    let queues = [("d0".to_string(), topic.clone())];
    wait_for("relay drained to the topic", Duration::from_secs(900), || {
        let (m, queues) = (Arc::clone(&relay.metrics), queues.clone());
        async move { published(&m, &queues) >= n as u64 }
    })
    .await;
    let (relay_cpu, relay_busy) = phase.end();
    relay.stop().await;
    let sending_us = clocked.last_us.load(Ordering::Acquire) - clocked.first_us.load(Ordering::Acquire);
    let relay_rate = n as f64 / (sending_us.max(1) as f64 / 1e6);
    for (t, q) in [(&raw_topic, &raw_sub), (&topic, &sub)] {
        let _ = sqs.sns().delete_topic().topic_arn(t.as_str()).send().await;
        let _ = sqs.sqs().delete_queue().queue_url(q.as_str()).send().await;
    }
    let per_100k = |cpu: f64| (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0;
    TopicDrain {
        messages: n,
        body_bytes: size,
        rows_per_txn: a.txn_size,
        concurrency: cap,
        raw_msgs_per_s: raw.round(),
        relay_msgs_per_s: relay_rate.round(),
        ratio: r2(relay_rate / raw),
        raw_cpu_s_per_100k: per_100k(raw_cpu),
        relay_cpu_s_per_100k: per_100k(relay_cpu),
        cpu_ratio: r2(relay_cpu / raw_cpu.max(1e-9)),
        raw_machine_busy_pct: raw_busy,
        relay_machine_busy_pct: relay_busy,
        relay_calls: clocked.calls.load(Ordering::Relaxed),
    }
}

/// The raw client: `concurrency` workers, each sending `PublishBatch`es of
/// 10 bodies of `size` bytes until `n` are sent.
async fn raw_sns(sqs: &AwsPublisher, topic: &str, n: usize, concurrency: usize, size: usize) -> f64 {
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (sns, next, topic) = (sqs.sns().clone(), Arc::clone(&next), topic.to_string());
        tasks.push(tokio::spawn(async move {
            loop {
                let start = next.fetch_add(10, Ordering::Relaxed) as usize;
                if start >= n {
                    break;
                }
                let entries = (start..(start + 10).min(n)).map(|i| {
                    aws_sdk_sns::types::PublishBatchRequestEntry::builder()
                        .id((i - start).to_string())
                        .message(format!("{:x<size$}", format!("raw{i}:")))
                        .build()
                        .unwrap()
                });
                let req =
                    entries.fold(sns.publish_batch().topic_arn(&topic), |req, e| req.publish_batch_request_entries(e));
                req.send().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    n as f64 / t.elapsed().as_secs_f64()
}

pub(super) fn print_topics(rows: &[TopicDrain]) {
    println!("\n| one SNS topic (ministack, one raw subscription) | raw PublishBatch, cap {} | relay, no tuning | relay / raw (target ≥ 0.9) | CPU s/100k raw / relay (ratio, target ≤ 1.3) | machine busy raw / relay | relay calls |", rows.first().map_or(0, |r| r.concurrency));
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} msgs of {} B, {} per txn | {:.0}/s | {:.0}/s | {:.2} | {:.2} / {:.2} ({:.2}) | {:.0}% / {:.0}% | {} |",
            r.messages,
            r.body_bytes,
            r.rows_per_txn,
            r.raw_msgs_per_s,
            r.relay_msgs_per_s,
            r.ratio,
            r.raw_cpu_s_per_100k,
            r.relay_cpu_s_per_100k,
            r.cpu_ratio,
            r.raw_machine_busy_pct,
            r.relay_machine_busy_pct,
            r.relay_calls
        );
    }
}
