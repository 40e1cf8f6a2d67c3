//! Scenarios 9-10: the consumer.

use super::*;

/// A queue that counts deletes.
struct Counting {
    inner: SqsQueue,
    deletes: AtomicU64,
}

#[async_trait]
impl Queue for Counting {
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
        self.inner.receive(max, wait).await
    }
    async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
        self.inner.delete(receipt).await?;
        self.deletes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError> {
        self.inner.change_visibility(receipt, after).await
    }
}

async fn duplicate_effects(db: &TestDb) -> u64 {
    count_where(db, "SELECT coalesce(sum(n - 1), 0)::bigint FROM (SELECT count(*) n FROM business_effects GROUP BY job_id, generation) x").await
        as u64
}

pub(super) async fn consumer_duplicate_delivery(p: &Params) -> Counters {
    let n = p.repetitions;
    let db = effects_db("dupdeliver").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "dup", false, None).await;
    let cfg = RelayConfig::new(&db, "cdc", &[("jobs", &q)], "");
    create_slot(&db, &cfg).await;
    let relay = cfg.spawn();
    let w = db.client().await;
    for i in 0..n {
        let payload = serde_json::json!({ "dup": i });
        enqueue(
            &w,
            &NewJob {
                kind: "effect",
                payload: &payload,
                destination: "jobs",
                group_key: None,
                job_id: None,
                traceparent: None,
            },
        )
        .await
        .unwrap();
    }
    let lsn = db.current_lsn().await;
    settled(&db, "true", lsn, Duration::from_secs(120)).await;
    relay.terminate(Duration::from_secs(15)).await;
    send_every_message_again(&db, &sqs, &q).await;
    let queue = Arc::new(Counting { inner: SqsQueue::new(sqs.sqs().clone(), &q), deletes: AtomicU64::new(0) });
    let worker = Worker::new(
        Arc::new(consumer(&db.url, "w", Duration::from_secs(5)).handle("effect", Effect)),
        queue.clone(),
        8,
    );
    let worker = RunningWorker::start(worker, Duration::from_secs(1));
    let metrics = Arc::clone(&worker.metrics);
    let end = Instant::now() + Duration::from_secs(120);
    while queue.deletes.load(Ordering::Relaxed) < 2 * n as u64 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    worker.stop().await;
    let succeeded = count_where(&db, "SELECT count(*) FROM jobs WHERE status = 'SUCCEEDED'").await as u64;
    Counters {
        repetitions: n as u64,
        killed: n as u64, // every job delivered twice: the fault is the second copy
        committed: n as u64,
        missing_messages: (n as u64).saturating_sub(succeeded),
        duplicate_messages: n as u64,
        duplicate_business_effects: duplicate_effects(&db).await,
        duplicate_terminal_skips: metrics.count("terminal_skip"),
        message_deletes: queue.deletes.load(Ordering::Relaxed),
        extra: BTreeMap::from([
            ("jobs_succeeded".into(), succeeded as f64),
            ("deliveries_busy_or_fenced".into(), (metrics.count("busy") + metrics.count("fenced")) as f64),
        ]),
        ..Default::default()
    }
}

pub(super) async fn consumer_killed_mid_handler(p: &Params) -> Counters {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let db = effects_db("killedworker").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "killed", false, None).await;
    sqs.sqs().set_queue_attributes().queue_url(&q).attributes(A::VisibilityTimeout, "1").send().await.unwrap();
    let queue = Arc::new(Counting { inner: SqsQueue::new(sqs.sqs().clone(), &q), deletes: AtomicU64::new(0) });
    let rescuer = Arc::new(consumer(&db.url, "rescuer", Duration::from_secs(5)).handle("effect", Effect));
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut once = 0u64;
    let mut rescue_ms = Vec::new();
    let w = db.client().await;
    for rep in 0..p.repetitions {
        let payload = serde_json::json!({ "killed": rep });
        let id = enqueue(
            &w,
            &NewJob {
                kind: "effect",
                payload: &payload,
                destination: "jobs",
                group_key: None,
                job_id: None,
                traceparent: None,
            },
        )
        .await
        .unwrap();
        c.committed += 1;
        let body: String = w.query_one("SELECT outbox_job_message($1, 'effect', 0)", &[&id]).await.unwrap().get(0);
        sqs.sqs().send_message().queue_url(&q).message_body(body).send().await.unwrap();
        // A worker process claims it and dies inside the handler.
        if spawn_child(p, &["worker", &db.url, &stack().sqs_url, &q], "consumer::in_handler=return").await {
            c.killed += 1;
        }
        let died = Instant::now();
        // Another worker finds it after the lease expires.
        let worker = RunningWorker::start(Worker::new(Arc::clone(&rescuer), queue.clone(), 2), Duration::from_secs(1));
        let metrics = Arc::clone(&worker.metrics);
        let state = job_state_within(&w, &id, "SUCCEEDED", Duration::from_secs(60)).await;
        rescue_ms.push(died.elapsed().as_secs_f64() * 1000.0);
        worker.stop().await;
        let n_effects = effects(&db, &format!("job_id = '{id}'")).await;
        let attempts: i32 =
            w.query_one("SELECT attempt_count FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0);
        if state == "SUCCEEDED" && n_effects == 1 && attempts == 2 && metrics.rescued.get() == 1 {
            once += 1;
        } else {
            eprintln!(
                "measure: consumer_killed_mid_handler: job {id}: {state}, {n_effects} effects, {attempts} attempts"
            );
        }
        if state != "SUCCEEDED" {
            c.missing_messages += 1;
        }
    }
    c.duplicate_business_effects = duplicate_effects(&db).await;
    c.message_deletes = queue.deletes.load(Ordering::Relaxed);
    c.extra.insert("completed_exactly_once".into(), once as f64);
    c.extra.insert("rescue_ms_p50".into(), round1(percentile(&mut rescue_ms.clone(), 0.5)));
    c.extra.insert("rescue_ms_max".into(), round1(percentile(&mut rescue_ms, 1.0)));
    c
}

/// The state of job `id` once it is `want`, or the last seen when `within`
/// has passed.
async fn job_state_within(w: &Client, id: &str, want: &str, within: Duration) -> String {
    let end = Instant::now() + within;
    let mut state = String::new();
    while Instant::now() < end {
        state = w.query_one("SELECT status FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0);
        if state == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state
}

/// Every message a second time, as a relay crash or SQS itself may do.
async fn send_every_message_again(db: &TestDb, sqs: &AwsPublisher, q: &str) {
    let all: Vec<String> = bodies(db, "true").await.into_iter().collect();
    for chunk in all.chunks(10) {
        let mut req = sqs.sqs().send_message_batch().queue_url(q);
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
