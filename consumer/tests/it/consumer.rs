//! The consumer library against the real PostgreSQL and ministack: duplicate
//! deliveries are harmless, stale generations are fenced, retries only move
//! visibility, poison ends in the DLQ, a killed worker's job is rescued.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer::memory::MemoryQueue;
use outbox_consumer::queue::Queue;
use outbox_consumer::sqs::SqsQueue;
use outbox_consumer::worker::Worker;
use outbox_consumer::{enqueue, redrive, Consumer, Disposition, DlqDisposition, Handler, HandlerError, Job, NewJob};
use testkit::jobs::{effects, effects_db, Effect, RunningWorker};
use testkit::*;
use tokio::sync::Notify;
use tokio_postgres::Transaction;

/// Writes its effect, then waits at a gate before returning.
struct Gated {
    gate: Arc<Notify>,
    started: Arc<Notify>,
}

#[async_trait]
impl Handler for Gated {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        Effect.handle(job, tx).await?;
        self.started.notify_one();
        self.gate.notified().await;
        Ok(())
    }
}

/// Asks for a retry `fails` times, then succeeds.
struct Flaky {
    fails: usize,
    runs: Arc<AtomicUsize>,
}

#[async_trait]
impl Handler for Flaky {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        if self.runs.fetch_add(1, Ordering::SeqCst) < self.fails {
            return Err(HandlerError::Retry("not yet".into()));
        }
        Effect.handle(job, tx).await
    }
}

/// Hangs forever on a job's first attempt (a worker about to be killed).
struct HangFirst;

#[async_trait]
impl Handler for HangFirst {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        if job.attempt == 1 {
            std::future::pending::<()>().await;
        }
        Effect.handle(job, tx).await
    }
}

async fn setup(test: &str) -> TestDb {
    effects_db(test).await
}

fn consumer(db: &TestDb, worker: &str, lease: Duration) -> Consumer {
    testkit::jobs::consumer(&db.url, worker, lease)
}

/// The body the relay would send for a job's generation.
async fn body(db: &TestDb, job_id: &str, generation: i32) -> String {
    db.client()
        .await
        .query_one(
            "SELECT body FROM outbox_audit WHERE event_id = (SELECT kind FROM jobs WHERE job_id = $1) || ':' || $1 || ':' || $2",
            &[&job_id, &generation.to_string()],
        )
        .await
        .unwrap()
        .get(0)
}

async fn job_state(db: &TestDb, job_id: &str) -> (String, i32, i32, Option<String>) {
    let r = db
        .client()
        .await
        .query_one(
            "SELECT status, attempt_count, redrive_generation, dead_reason FROM jobs WHERE job_id = $1",
            &[&job_id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_and_refuses_a_different_payload_under_the_same_id() {
    let db = setup("enqueue").await;
    let mut c = db.client().await;
    let payload = serde_json::json!({"order": 42, "items": [1, 2]});
    let tx = c.transaction().await.unwrap();
    let job = NewJob {
        kind: "ship",
        payload: &payload,
        destination: "jobs",
        group_key: None,
        job_id: None,
        traceparent: None,
    };
    let id = enqueue(&tx, &job).await.unwrap();
    tx.commit().await.unwrap();
    // Same work, keys in another order: same id, no second row or event.
    let reordered = serde_json::json!({"items": [1, 2], "order": 42});
    let again = enqueue(&c, &NewJob { payload: &reordered, ..job.clone() }).await.unwrap();
    assert_eq!(id, again);
    assert_eq!(id.len(), 64);
    assert_eq!(db.count("true").await, 1);
    assert_eq!(db.count(&format!("event_id = 'ship:{id}:0'")).await, 1);
    // An explicit id reused for other work is an error.
    let other = serde_json::json!({"order": 43});
    let mine = NewJob {
        kind: "ship",
        payload: &payload,
        destination: "jobs",
        group_key: None,
        job_id: Some("order-42"),
        traceparent: None,
    };
    enqueue(&c, &mine).await.unwrap();
    let err = enqueue(&c, &NewJob { payload: &other, ..mine.clone() }).await.unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION), "{err}");
    // The job and its event commit together or not at all.
    let tx = c.transaction().await.unwrap();
    let p = serde_json::json!({"order": 44});
    enqueue(
        &tx,
        &NewJob { kind: "ship", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(db.count("true").await, 2);
    let n: i64 = c.query_one("SELECT count(*) FROM jobs", &[]).await.unwrap().get(0);
    assert_eq!(n, 2);
    // Any language: the SQL function is the API.
    let from_sql: String = c
        .query_one("SELECT outbox_enqueue_job('ship', '{\"order\": 42, \"items\": [1, 2]}'::jsonb, 'jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(from_sql, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_twice_sequentially_and_from_8_tasks_runs_the_handler_once() {
    let db = setup("dup").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "dup", false, None).await;
    let queue = SqsQueue::new(sqs.sqs().clone(), &q);
    let c = db.client().await;
    let cons = Arc::new(consumer(&db, "w1", Duration::from_secs(30)).handle("effect", Effect));

    // Sequentially: the second delivery finds the job terminal.
    let p = serde_json::json!({"n": 1});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let b = body(&db, &id, 0).await;
    for _ in 0..2 {
        sqs.sqs().send_message().queue_url(&q).message_body(&b).send().await.unwrap();
    }
    let msgs = queue.receive(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(msgs.len(), 2);
    assert_eq!(cons.process(&queue, &msgs[0]).await.unwrap(), Disposition::Succeeded { rescued: false });
    assert_eq!(cons.process(&queue, &msgs[1]).await.unwrap(), Disposition::TerminalSkip);
    assert_eq!(effects(&db, &format!("job_id = '{id}'")).await, 1);

    // Concurrently: 8 copies processed at once.
    let p = serde_json::json!({"n": 2});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let b = body(&db, &id, 0).await;
    for _ in 0..8 {
        sqs.sqs().send_message().queue_url(&q).message_body(&b).send().await.unwrap();
    }
    let mut msgs = Vec::new();
    while msgs.len() < 8 {
        msgs.extend(queue.receive(10, Duration::from_secs(2)).await.unwrap());
    }
    let queue = Arc::new(queue);
    let tasks: Vec<_> = msgs
        .into_iter()
        .map(|m| {
            let (cons, queue) = (Arc::clone(&cons), Arc::clone(&queue));
            tokio::spawn(async move { cons.process(&*queue, &m).await.unwrap() })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    let wins = outcomes.iter().filter(|d| matches!(d, Disposition::Succeeded { .. })).count();
    assert_eq!(wins, 1, "{outcomes:?}");
    assert!(
        outcomes.iter().all(|d| matches!(
            d,
            Disposition::Succeeded { .. } | Disposition::TerminalSkip | Disposition::Busy { .. } | Disposition::Fenced
        )),
        "{outcomes:?}"
    );
    assert_eq!(effects(&db, &format!("job_id = '{id}'")).await, 1);
    assert_eq!(job_state(&db, &id).await.0, "SUCCEEDED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_jobs_each_delivered_twice_through_the_relay_and_a_worker() {
    let db = setup("hundred").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "hundred", false, None).await;
    let c = db.client().await;
    // The relay publishes the jobs' events; each is then delivered a second
    // time, as a relay crash or SQS itself may do.
    let relay = start(config(&db, &[("jobs", &q)]), Arc::new(sqs.clone()));
    let mut ids = Vec::new();
    for n in 0..100 {
        let p = serde_json::json!({"n": n});
        ids.push(
            enqueue(
                &c,
                &NewJob {
                    kind: "effect",
                    payload: &p,
                    destination: "jobs",
                    group_key: None,
                    job_id: None,
                    traceparent: None,
                },
            )
            .await
            .unwrap(),
        );
    }
    wait_for("events published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    for id in &ids {
        let b = body(&db, id, 0).await;
        sqs.sqs().send_message().queue_url(&q).message_body(b).send().await.unwrap();
    }
    let cons = Arc::new(consumer(&db, "w1", Duration::from_secs(2)).handle("effect", Effect));
    let worker = RunningWorker::start(
        Worker::new(cons, Arc::new(SqsQueue::new(sqs.sqs().clone(), &q)), 8),
        Duration::from_secs(1),
    );
    let metrics = Arc::clone(&worker.metrics);
    wait_for("200 deliveries disposed of", Duration::from_secs(90), || async {
        metrics.count("succeeded") + metrics.count("terminal_skip") >= 200
    })
    .await;
    worker.stop().await;
    eprintln!("{}", metrics.render());
    assert_eq!(effects(&db, "true").await, 100);
    assert_eq!(
        effects(&db, "true").await,
        db.client()
            .await
            .query_one("SELECT count(DISTINCT job_id) FROM business_effects", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    );
    assert_eq!(metrics.count("succeeded"), 100);
    assert_eq!(metrics.count("terminal_skip"), 100);
    let deletes = metrics.count("succeeded") + metrics.count("terminal_skip");
    assert_eq!(deletes, 200);
    let left = receive_all(&sqs, &q, usize::MAX, Duration::from_secs(1)).await;
    assert!(left.is_empty(), "every message deleted: {left:?}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_generation_cannot_close_a_redriven_job() {
    let db = setup("stale").await;
    let c = db.client().await;
    let gate = Arc::new(Notify::new());
    let started = Arc::new(Notify::new());
    let queue = MemoryQueue::new(Duration::from_secs(30));
    let old = Arc::new(
        consumer(&db, "old", Duration::from_secs(30))
            .handle("effect", Gated { gate: Arc::clone(&gate), started: Arc::clone(&started) }),
    );
    let p = serde_json::json!({"n": 1});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let gen0 = body(&db, &id, 0).await;
    queue.send(&gen0);
    let m0 = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let running = {
        let (old, queue) = (Arc::clone(&old), queue.clone());
        tokio::spawn(async move { old.process(&queue, &m0).await.unwrap() })
    };
    started.notified().await;
    // The operator redrives while generation 0 is still running.
    assert_eq!(redrive(&c, &id).await.unwrap(), 1);
    gate.notify_one();
    assert_eq!(running.await.unwrap(), Disposition::Fenced, "generation 0 cannot close the redriven job");
    assert_eq!(effects(&db, "true").await, 0, "the fenced run's writes rolled back");
    // A late generation-0 message is rejected and deleted.
    queue.send(&gen0);
    let late = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let fresh = consumer(&db, "new", Duration::from_secs(30)).handle("effect", Effect);
    assert_eq!(fresh.process(&queue, &late).await.unwrap(), Disposition::Stale);
    assert_eq!(job_state(&db, &id).await.0, "PENDING");
    // Generation 1 runs and closes it.
    queue.send(body(&db, &id, 1).await);
    let m1 = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(fresh.process(&queue, &m1).await.unwrap(), Disposition::Succeeded { rescued: false });
    assert_eq!(effects(&db, "generation = 1").await, 1);
    assert_eq!(effects(&db, "true").await, 1);
    // Only the fenced generation-0 delivery is left: hidden for a lease, then
    // it too is rejected as stale.
    assert_eq!(queue.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_retry_only_changes_visibility() {
    let db = setup("early").await;
    let c = db.client().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let mut cons =
        consumer(&db, "w", Duration::from_secs(30)).handle("effect", Flaky { fails: 1, runs: Arc::clone(&runs) });
    cons.config.retry_base = Duration::from_secs(60);
    cons.config.retry_max = Duration::from_secs(60);
    let queue = MemoryQueue::new(Duration::from_secs(30));
    let p = serde_json::json!({"n": 1});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let b = body(&db, &id, 0).await;
    queue.send(&b);
    let m = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let Disposition::Retried { after, .. } = cons.process(&queue, &m).await.unwrap() else {
        panic!("expected a retry")
    };
    assert!(after >= Duration::from_secs(30) && after <= Duration::from_secs(60), "{after:?}");
    // A copy arriving before the retry is due: visibility only.
    queue.send(&b);
    let early = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let (_, _, changes_before) = queue.counters();
    match cons.process(&queue, &early).await.unwrap() {
        Disposition::NotDue { after: remaining } => {
            assert!(remaining <= after && remaining > Duration::from_secs(25), "{remaining:?}")
        }
        other => panic!("expected NotDue, got {other:?}"),
    }
    assert_eq!(queue.counters().2, changes_before + 1, "one visibility change");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler did not run again");
    let (status, attempts, _, _) = job_state(&db, &id).await;
    assert_eq!((status.as_str(), attempts), ("PENDING", 1));
    assert_eq!(queue.len(), 2, "nothing deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_ends_in_the_dlq_and_its_job_dead() {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let db = setup("poison").await;
    let sqs = sqs().await;
    let dlq = create_queue(&sqs, "poison_dlq", false, None).await;
    let dlq_arn = sqs
        .sqs()
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(A::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()[&A::QueueArn]
        .clone();
    let q = create_queue(&sqs, "poison", false, None).await;
    sqs.sqs()
        .set_queue_attributes()
        .queue_url(&q)
        .attributes(A::RedrivePolicy, format!("{{\"deadLetterTargetArn\":\"{dlq_arn}\",\"maxReceiveCount\":\"2\"}}"))
        .attributes(A::VisibilityTimeout, "1")
        .send()
        .await
        .unwrap();
    let c = db.client().await;
    let p = serde_json::json!({"poison": true});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    sqs.sqs().send_message().queue_url(&q).message_body(body(&db, &id, 0).await).send().await.unwrap();
    sqs.sqs().send_message().queue_url(&q).message_body("not a job message").send().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let cons = Arc::new(
        consumer(&db, "w", Duration::from_secs(1))
            .handle("effect", Flaky { fails: usize::MAX, runs: Arc::clone(&runs) }),
    );
    let main = SqsQueue::new(sqs.sqs().clone(), &q);
    let dead_letters = SqsQueue::new(sqs.sqs().clone(), &dlq);
    let mut in_dlq = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while in_dlq.len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "messages never reached the DLQ; handler ran {} times",
            runs.load(Ordering::SeqCst)
        );
        for m in main.receive(10, Duration::from_secs(1)).await.unwrap() {
            cons.process(&main, &m).await.unwrap();
        }
        in_dlq.extend(dead_letters.receive(10, Duration::ZERO).await.unwrap());
    }
    assert!(runs.load(Ordering::SeqCst) >= 1);
    assert_eq!(effects(&db, "true").await, 0);
    let mut outcomes = Vec::new();
    for m in &in_dlq {
        outcomes.push(cons.process_dlq(&dead_letters, m).await.unwrap());
    }
    outcomes.sort_by_key(|d| format!("{d:?}"));
    assert_eq!(outcomes, vec![DlqDisposition::MarkedDead, DlqDisposition::Unrecognised]);
    let (status, _, _, reason) = job_state(&db, &id).await;
    assert_eq!((status.as_str(), reason.as_deref()), ("DEAD", Some("DLQ")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_handler_has_its_job_rescued_and_completed_once() {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let db = setup("rescue").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "rescue", false, None).await;
    sqs.sqs().set_queue_attributes().queue_url(&q).attributes(A::VisibilityTimeout, "2").send().await.unwrap();
    let c = db.client().await;
    let p = serde_json::json!({"n": 1});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    sqs.sqs().send_message().queue_url(&q).message_body(body(&db, &id, 0).await).send().await.unwrap();

    // Worker 1 claims and hangs; then it is killed (its task and connections go).
    let w1 = Worker::new(
        Arc::new(consumer(&db, "w1", Duration::from_secs(1)).handle("effect", HangFirst)),
        Arc::new(SqsQueue::new(sqs.sqs().clone(), &q)),
        4,
    );
    let killed = tokio::spawn(w1.run(std::future::pending()));
    wait_for("worker 1 claimed", Duration::from_secs(30), || async { job_state(&db, &id).await.0 == "CLAIMED" }).await;
    killed.abort();
    let _ = killed.await;

    let w2 = Worker::new(
        Arc::new(consumer(&db, "w2", Duration::from_secs(1)).handle("effect", HangFirst)),
        Arc::new(SqsQueue::new(sqs.sqs().clone(), &q)),
        4,
    );
    let w2 = RunningWorker::start(w2, Duration::from_secs(1));
    let metrics = Arc::clone(&w2.metrics);
    wait_for("job completed after the lease expired", Duration::from_secs(60), || async {
        job_state(&db, &id).await.0 == "SUCCEEDED"
    })
    .await;
    w2.stop().await;
    assert_eq!(effects(&db, "true").await, 1, "completed exactly once");
    assert_eq!(metrics.rescued.get(), 1);
    let (_, attempts, _, _) = job_state(&db, &id).await;
    assert_eq!(attempts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_requested_while_claimed_survives_a_rescue() {
    let db = setup("cancel").await;
    let c = db.client().await;
    let queue = MemoryQueue::new(Duration::from_secs(30));
    let p = serde_json::json!({"n": 1});
    let id = enqueue(
        &c,
        &NewJob { kind: "effect", payload: &p, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let b = body(&db, &id, 0).await;
    // A worker claims and dies mid-handler.
    queue.send(&b);
    let m = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let dying = consumer(&db, "dying", Duration::from_secs(1)).handle("effect", HangFirst);
    assert!(tokio::time::timeout(Duration::from_millis(300), dying.process(&queue, &m)).await.is_err());
    assert_eq!(job_state(&db, &id).await.0, "CLAIMED");
    // Cancellation is requested while it is claimed; then the lease expires.
    assert!(outbox_consumer::request_cancel(&c, &id).await.unwrap());
    wait_for("the lease expired", Duration::from_secs(10), || async {
        c.query_one("SELECT lease_expires_at < now() FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0)
    })
    .await;
    queue.send(&b);
    let m = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
    let rescuer = consumer(&db, "rescuer", Duration::from_secs(1)).handle("effect", Effect);
    assert_eq!(rescuer.process(&queue, &m).await.unwrap(), Disposition::Dead { reason: "CANCELLED".into() });
    let (status, attempts, _, reason) = job_state(&db, &id).await;
    assert_eq!((status.as_str(), attempts, reason.as_deref()), ("DEAD", 2, Some("CANCELLED")));
    assert_eq!(effects(&db, "true").await, 0, "the cancelled job never ran to completion");
}

/// Records each job's payload `blob` length, then writes its effect.
struct BlobSize(Arc<std::sync::Mutex<Vec<usize>>>);

#[async_trait]
impl Handler for BlobSize {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(job.payload["blob"].as_str().map_or(0, str::len));
        Effect.handle(job, tx).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_the_queues_limit_goes_through_s3_and_the_worker_reads_it_back() {
    use outbox_relay::config::S3Config;
    let db = setup("s3_job").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "s3jobs", false, Some(1024)).await;
    let sdk = outbox_relay::publish::sdk::sdk_config("us-east-1", Some(&stack().sqs_url), None).await;
    let s3 = aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&sdk).force_path_style(true).build());
    let bucket = unique("jobbodies").replace('_', "-").to_ascii_lowercase();
    s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let mut cfg = config(&db, &[("jobs", &q)]);
    cfg.s3 = Some(S3Config {
        bucket: Some(bucket),
        key_prefix: String::new(),
        endpoint_url: Some(stack().sqs_url.clone()),
        threshold: outbox_relay::publish::offload::Threshold::QueueLimit,
        max_body_bytes: 32 << 20,
        buckets: Default::default(),
    });
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    let small = serde_json::json!({"blob": "s".repeat(10)});
    let big = serde_json::json!({"blob": "b".repeat(300_000)});
    for p in [&small, &big] {
        enqueue(
            &c,
            &NewJob {
                kind: "effect",
                payload: p,
                destination: "jobs",
                group_key: None,
                job_id: None,
                traceparent: None,
            },
        )
        .await
        .unwrap();
    }
    wait_for("events published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let cons = Arc::new(consumer(&db, "w1", Duration::from_secs(5)).handle("effect", BlobSize(Arc::clone(&sizes))));
    let queue = SqsQueue::new(sqs.sqs().clone(), &q).with_s3(s3);
    let worker = RunningWorker::start(Worker::new(cons, Arc::new(queue), 4), Duration::from_secs(1));
    let metrics = Arc::clone(&worker.metrics);
    wait_for("both jobs run", Duration::from_secs(60), || async { metrics.count("succeeded") >= 2 }).await;
    worker.stop().await;
    let mut seen = sizes.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![10, 300_000], "the handler saw the whole payload of the job that went through S3");
    assert_eq!(effects(&db, "true").await, 2);
    relay.stop().await;
}

/// Records each job's trace context, then writes its effect.
struct Traced(Arc<std::sync::Mutex<Vec<Option<String>>>>);

#[async_trait]
impl Handler for Traced {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(job.traceparent.clone());
        Effect.handle(job, tx).await
    }
}

/// The producer's trace goes with its job: `enqueue`'s traceparent is the
/// message's attribute (and its AWSTraceHeader), and the handler gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producers_trace_context_reaches_the_handler() {
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let db = setup("trace_job").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "tracejobs", false, None).await;
    let relay = start(config(&db, &[("jobs", &q)]), Arc::new(sqs.clone()));
    let c = db.client().await;
    for (n, tp) in [(1, Some(TP)), (2, None)] {
        let payload = serde_json::json!({ "n": n });
        let job = NewJob {
            kind: "effect",
            payload: &payload,
            destination: "jobs",
            group_key: None,
            job_id: None,
            traceparent: tp,
        };
        enqueue(&c, &job).await.unwrap();
    }
    wait_for("events published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let cons = Arc::new(consumer(&db, "w1", Duration::from_secs(5)).handle("effect", Traced(Arc::clone(&seen))));
    let queue = SqsQueue::new(sqs.sqs().clone(), &q);
    let worker = RunningWorker::start(Worker::new(cons, Arc::new(queue), 4), Duration::from_secs(1));
    let metrics = Arc::clone(&worker.metrics);
    wait_for("both jobs run", Duration::from_secs(60), || async { metrics.count("succeeded") >= 2 }).await;
    worker.stop().await;
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![None, Some(TP.to_string())]);
    relay.stop().await;
}
