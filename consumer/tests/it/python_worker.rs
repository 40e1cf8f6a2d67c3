//! The job protocol from another language: examples/python_worker/worker.py
//! (boto3 + psycopg, in the stack's own virtualenv) consumes what the relay
//! publishes, with the black-box check the Rust worker passes: every message
//! delivered three times, a worker killed with SIGKILL mid-run, and a
//! redrive with stale copies of the old generation's messages. One effect per
//! job and generation.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;
use testkit::jobs::*;
use testkit::*;

const JOBS: i64 = 300;

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python_worker(db: &TestDb, queue: &str, id: &str, handler_sleep: &str) -> Worker {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/python_worker/worker.py");
    let child = Command::new(&stack().python)
        .arg(script)
        .args(["--database-url", &db.url, "--queue-url", queue, "--endpoint-url", &stack().sqs_url])
        .args(["--worker-id", id, "--lease", "2", "--retry-base", "0.2", "--retry-max", "2"])
        .args(["--handler-sleep", handler_sleep])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .stdin(Stdio::null())
        .spawn()
        .expect("start the Python worker");
    Worker(child)
}

async fn queue_empty(sqs: &outbox_relay::publish::aws::AwsPublisher, url: &str) -> bool {
    let a = sqs
        .sqs()
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap();
    let attrs = a.attributes.unwrap_or_default();
    let n = |k: QueueAttributeName| attrs.get(&k).and_then(|v| v.parse::<i64>().ok()).unwrap_or(1);
    n(QueueAttributeName::ApproximateNumberOfMessages) + n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        == 0
}

/// Send each body of the outbox audit copy matching `like` to the queue again.
async fn send_again(db: &TestDb, sqs: &outbox_relay::publish::aws::AwsPublisher, url: &str, like: &str) -> usize {
    let c = db.client().await;
    let bodies: Vec<String> = c
        .query("SELECT body FROM outbox_audit WHERE event_id LIKE $1", &[&like])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for b in &bodies {
        sqs.sqs().send_message().queue_url(url).message_body(b).send().await.unwrap();
    }
    bodies.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_worker_gets_the_same_guarantees_through_the_sql_protocol() {
    let db = effects_db("py_worker").await;
    let sqs = sqs().await;
    let q = sqs
        .sqs()
        .create_queue()
        .queue_name(unique("py-jobs"))
        .attributes(QueueAttributeName::VisibilityTimeout, "3")
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let c = db.client().await;
    let relay = start(config(&db, &[("jobs", &q)]), Arc::new(sqs.clone()));
    c.execute(
        "SELECT outbox_enqueue_job('effect', jsonb_build_object('n', i), 'jobs') FROM generate_series(1, $1::int) i",
        &[&(JOBS as i32)],
    )
    .await
    .unwrap();
    wait_for("the jobs' events published", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    // Every message twice more: three deliveries of each.
    assert_eq!(send_again(&db, &sqs, &q, "effect:%").await as i64, JOBS);
    assert_eq!(send_again(&db, &sqs, &q, "effect:%").await as i64, JOBS);

    // One worker killed with SIGKILL mid-run: its claims are rescued after their lease.
    let mut first = python_worker(&db, &q, "py-1", "0.01");
    wait_for("the first worker's effects", Duration::from_secs(60), || async { effects(&db, "true").await >= 50 })
        .await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _second = python_worker(&db, &q, "py-2", "0");
    let _third = python_worker(&db, &q, "py-3", "0");
    let succeeded = || async {
        c.query_one("SELECT count(*) FROM jobs WHERE status = 'SUCCEEDED'", &[]).await.unwrap().get::<_, i64>(0)
    };
    wait_for("every job SUCCEEDED", Duration::from_secs(120), || async { succeeded().await == JOBS }).await;

    // A redrive of 10 jobs, with stale copies of their old messages.
    let redriven: Vec<String> = c
        .query("SELECT job_id FROM jobs ORDER BY job_id LIMIT 10", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for id in &redriven {
        c.execute("SELECT outbox_redrive_job($1)", &[id]).await.unwrap();
    }
    for id in &redriven {
        send_again(&db, &sqs, &q, &format!("effect:{id}:0")).await;
    }
    wait_for("the redriven jobs SUCCEEDED again", Duration::from_secs(90), || async {
        effects(&db, "generation = 1").await == 10 && succeeded().await == JOBS
    })
    .await;
    wait_for("every message deleted", Duration::from_secs(90), || queue_empty(&sqs, &q)).await;

    assert_eq!(effects(&db, "generation = 0").await, JOBS, "one effect per job");
    assert_eq!(effects(&db, "generation = 1").await, 10, "one effect per redriven job");
    let distinct: i64 =
        c.query_one("SELECT count(DISTINCT (job_id, generation)) FROM business_effects", &[]).await.unwrap().get(0);
    assert_eq!(distinct, JOBS + 10, "no job and generation has two effects");
    let rescued: i64 =
        c.query_one("SELECT count(*) FROM business_effects WHERE attempt > 1", &[]).await.unwrap().get(0);
    println!(
        "{JOBS} jobs, 3 deliveries each, a worker killed mid-run, 10 redriven: {rescued} effects from a second attempt"
    );
    relay.stop().await;
}

/// A job over the queue's limit goes through S3; the Python worker reads its
/// body back from there (the extended client's pointer) and runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_worker_reads_a_job_whose_body_went_through_s3() {
    use outbox_relay::config::S3Config;
    let db = effects_db("py_s3").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "py-s3", false, Some(1024)).await;
    let sdk = outbox_relay::publish::sdk::sdk_config("us-east-1", Some(&stack().sqs_url), None).await;
    let s3 = aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&sdk).force_path_style(true).build());
    let bucket = unique("pybodies").replace('_', "-").to_ascii_lowercase();
    s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let mut cfg = config(&db, &[("jobs", &q)]);
    cfg.s3 = Some(S3Config {
        bucket: Some(bucket),
        key_prefix: "py/".into(),
        endpoint_url: Some(stack().sqs_url.clone()),
        threshold: outbox_relay::publish::offload::Threshold::QueueLimit,
        max_body_bytes: 32 << 20,
        buckets: Default::default(),
    });
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    c.execute("SELECT outbox_enqueue_job('effect', jsonb_build_object('blob', repeat('b', 200000)), 'jobs')", &[])
        .await
        .unwrap();
    c.execute("SELECT outbox_enqueue_job('effect', jsonb_build_object('n', 1), 'jobs')", &[]).await.unwrap();
    wait_for("the jobs' events published", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    let _worker = python_worker(&db, &q, "py1", "0");
    wait_for("both jobs run once", Duration::from_secs(60), || async { effects(&db, "true").await == 2 }).await;
    let succeeded: i64 = c.query_one("SELECT count(*) FROM jobs WHERE status = 'SUCCEEDED'", &[]).await.unwrap().get(0);
    assert_eq!(succeeded, 2);
    relay.stop().await;
}
