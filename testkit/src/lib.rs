//! The integration-test harness: starts the local stack (scripts/dev-stack:
//! PostgreSQL 15 with wal_level=logical and ministack) once, gives each test its
//! own database, slot and queues, and removes them afterwards. Used by the
//! relay's and the consumer's integration tests (`tests/it/`), the examples
//! and the fault-injection measurement (the `measure` binary of this crate).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use outbox_relay::config::{Config, FileConfig, Overrides};
use outbox_relay::db;
use outbox_relay::metrics::Metrics;
use outbox_relay::publish::aws::AwsPublisher;
use outbox_relay::publish::Publisher;
use tokio::sync::oneshot;
use tokio_postgres::Client;

pub mod cluster;
pub mod faults;
pub mod jobs;
pub mod outage;
pub mod process;
pub mod proxy;
pub mod standin;
pub mod takeover;

pub struct Stack {
    pub pg_url: String,
    pub sqs_url: String,
    /// The throwaway CA (ca.crt), the unrelated CA (other-ca.crt); the server
    /// certificate names "localhost" only.
    pub tls_dir: String,
    /// The server binaries of the major under test (`PG_MAJOR`, default 15).
    pub pg_bin: String,
    /// The Python of the worker example's virtualenv (boto3, psycopg).
    pub python: String,
}

/// The shared stack, started by the project's own script on first use.
pub fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/dev-stack");
        let out = std::process::Command::new("bash").arg(script).arg("up").output().expect("run scripts/dev-stack");
        assert!(out.status.success(), "scripts/dev-stack up failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let get = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{k} missing from dev-stack output: {text}"))
                .to_string()
        };
        Stack {
            pg_url: get("OUTBOX_RELAY_TEST_PG_URL"),
            sqs_url: get("OUTBOX_RELAY_TEST_SQS_URL"),
            tls_dir: get("OUTBOX_RELAY_TEST_TLS_DIR"),
            pg_bin: get("OUTBOX_RELAY_TEST_PG_BIN"),
            python: get("OUTBOX_RELAY_TEST_PYTHON"),
        }
    })
}

pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}_{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), nanos % 100_000)
}

/// A database of its own, migrated, dropped (with its slots) on drop.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub slot: String,
    /// The server's maintenance database, for dropping this one.
    admin: String,
}

impl TestDb {
    /// On the shared stack's server.
    pub async fn new(test: &str) -> TestDb {
        TestDb::on(&stack().pg_url, test).await
    }

    /// On the server whose maintenance database `admin_url` names.
    pub async fn on(admin_url: &str, test: &str) -> TestDb {
        let name = unique(&format!("t_{test}"));
        let admin = db::connect(admin_url).await.unwrap();
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
        let mut c = db::connect(&url).await.unwrap();
        db::schema::migrate(&mut c).await.unwrap();
        TestDb { slot: format!("s_{name}"), name, url, admin: admin_url.to_string() }
    }

    pub async fn client(&self) -> Client {
        db::connect(&self.url).await.unwrap()
    }

    pub async fn confirmed_flush_lsn(&self) -> u64 {
        let c = self.client().await;
        let r = c
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap();
        // NULL while the slot is being created.
        r.and_then(|r| r.get::<_, Option<i64>>(0)).map(|v| v as u64).unwrap_or(0)
    }

    /// The end of the WAL inserted so far: at or past the end of every
    /// transaction committed before the call.
    pub async fn current_lsn(&self) -> u64 {
        let c = self.client().await;
        c.query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[]).await.unwrap().get::<_, i64>(0) as u64
    }

    /// Rows published: PUBLISHED rows kept, and the ids settlement deleted as
    /// recorded in runs. Runs are pruned once every slot confirmed past them
    /// (at most once a minute): a progress measure, not a final total.
    pub async fn published(&self) -> i64 {
        let c = self.client().await;
        c.query_one(
            "SELECT (SELECT count(*) FROM outbox WHERE status = 'PUBLISHED')
                  + (SELECT coalesce(sum(hi - lo + 1), 0) FROM outbox_published_runs)::bigint",
            &[],
        )
        .await
        .unwrap()
        .get(0)
    }

    /// Keep a copy of every row inserted into the outbox in `outbox_audit`
    /// (settlement deletes published rows; what was committed stays known).
    pub async fn audit_inserts(&self) {
        self.client()
            .await
            .batch_execute(
                "CREATE TABLE outbox_audit (event_id text, destination text, body text);
                 CREATE FUNCTION outbox_audit() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     INSERT INTO outbox_audit VALUES (NEW.event_id, NEW.destination, NEW.body);
                     RETURN NEW;
                 END $$;
                 CREATE TRIGGER outbox_audit AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_audit();",
            )
            .await
            .unwrap();
    }

    pub async fn count(&self, where_clause: &str) -> i64 {
        let c = self.client().await;
        c.query_one(&format!("SELECT count(*) FROM outbox WHERE {where_clause}"), &[]).await.unwrap().get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (name, pg) = (self.name.clone(), self.admin.clone());
        // Replication slots are cluster-wide: drop them, and terminate the
        // walsenders holding them, before the database.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let Ok(c) = db::connect(&pg).await else { return };
                for _ in 0..50 {
                    let _ = c
                        .execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL", &[&name])
                        .await;
                    let _ = c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active", &[&name]).await;
                    let left: i64 = c
                        .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = $1", &[&name])
                        .await
                        .map(|r| r.get(0))
                        .unwrap_or(0);
                    if left == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let _ = c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
            });
        })
        .join()
        .ok();
    }
}

/// An SQS client for the stack's ministack.
pub async fn sqs() -> AwsPublisher {
    AwsPublisher::new("us-east-1", Some(&stack().sqs_url)).await
}

/// Create a queue with a unique name; returns its URL.
/// An S3 client of the local stack (ministack serves S3 beside SQS).
pub async fn s3_client() -> aws_sdk_s3::Client {
    let sdk = outbox_relay::publish::sdk::sdk_config("us-east-1", Some(&stack().sqs_url), None).await;
    aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&sdk).force_path_style(true).build())
}

/// A bucket of its own on the local stack.
pub async fn create_bucket(prefix: &str) -> String {
    let name = unique(prefix).replace('_', "-").to_ascii_lowercase();
    s3_client().await.create_bucket().bucket(&name).send().await.unwrap();
    name
}

/// The body a received message stands for: itself, or, a pointer in the
/// SQS Extended Client's format, its object's content. Panics when the
/// pointer's object is not there (a dangling pointer).
pub async fn resolve_body(s3: &aws_sdk_s3::Client, raw: String) -> String {
    if !raw.starts_with("[\"software.amazon.payloadoffloading.PayloadS3Pointer\"") {
        return raw;
    }
    let p: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let (bucket, key) = (p[1]["s3BucketName"].as_str().unwrap(), p[1]["s3Key"].as_str().unwrap());
    let obj = s3.get_object().bucket(bucket).key(key).send().await.unwrap_or_else(|e| {
        panic!("a pointer to {bucket}/{key}, which is not there: {e:?}");
    });
    String::from_utf8(obj.body.collect().await.unwrap().to_vec()).unwrap()
}

pub async fn create_queue(sqs: &AwsPublisher, base: &str, fifo: bool, max_size: Option<usize>) -> String {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let name = if fifo { format!("{}.fifo", unique(base)) } else { unique(base) };
    let mut req = sqs.sqs().create_queue().queue_name(name);
    if fifo {
        req = req.attributes(A::FifoQueue, "true");
    }
    if let Some(m) = max_size {
        req = req.attributes(A::MaximumMessageSize, m.to_string());
    }
    req.send().await.unwrap().queue_url.unwrap()
}

/// A topic of its own (`base` and a unique suffix); its ARN.
pub async fn create_topic(sqs: &AwsPublisher, base: &str, fifo: bool) -> String {
    let name = if fifo { format!("{}.fifo", unique(base)) } else { unique(base) };
    let mut req = sqs.sns().create_topic().name(name);
    if fifo {
        req = req.attributes("FifoTopic", "true");
    }
    req.send().await.unwrap().topic_arn.unwrap()
}

/// A queue of its own subscribed to `topic_arn`, with raw message delivery
/// (the message as published) or not (SNS's JSON envelope); its URL.
pub async fn subscribed_queue(sqs: &AwsPublisher, topic_arn: &str, base: &str, raw: bool) -> String {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let fifo = topic_arn.ends_with(".fifo");
    let url = create_queue(sqs, base, fifo, None).await;
    let attrs = sqs.sqs().get_queue_attributes().queue_url(&url).attribute_names(A::QueueArn).send().await.unwrap();
    let queue_arn = attrs.attributes.unwrap()[&A::QueueArn].clone();
    let mut req = sqs.sns().subscribe().topic_arn(topic_arn).protocol("sqs").endpoint(queue_arn);
    if raw {
        req = req.attributes("RawMessageDelivery", "true");
    }
    req.send().await.unwrap();
    url
}

/// One `ReceiveMessage` round (up to 10 messages, waiting up to `wait_s`).
pub struct Round {
    /// Body and `MessageGroupId` of each message received.
    pub messages: Vec<(String, Option<String>)>,
    /// Why the `DeleteMessageBatch` of those messages failed, if it did.
    pub delete_error: Option<String>,
}

/// Receive one round from `url` and delete what came; `Err` when the receive
/// itself failed.
pub async fn receive_round(sqs: &AwsPublisher, url: &str, wait_s: i32) -> Result<Round, String> {
    use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, MessageSystemAttributeName as Attr};
    let r = sqs
        .sqs()
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(wait_s)
        .message_system_attribute_names(Attr::MessageGroupId)
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let msgs = r.messages.unwrap_or_default();
    if msgs.is_empty() {
        return Ok(Round { messages: Vec::new(), delete_error: None });
    }
    let mut del = sqs.sqs().delete_message_batch().queue_url(url);
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.into_iter().enumerate() {
        let group = m.attributes.as_ref().and_then(|a| a.get(&Attr::MessageGroupId).cloned());
        del = del.entries(
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(m.receipt_handle.clone().expect("a received message has a receipt handle"))
                .build()
                .unwrap(),
        );
        messages.push((m.body.unwrap_or_default(), group));
    }
    let delete_error = del.send().await.err().map(|e| format!("{e:?}"));
    Ok(Round { messages, delete_error })
}

/// Receive (and delete) until `expect` messages came or `deadline` passed:
/// body and `MessageGroupId` of each; bodies carry the event id in tests.
pub async fn receive_all(
    sqs: &AwsPublisher,
    url: &str,
    expect: usize,
    deadline: Duration,
) -> Vec<(String, Option<String>)> {
    let end = Instant::now() + deadline;
    let mut out = Vec::new();
    while out.len() < expect && Instant::now() < end {
        let round = receive_round(sqs, url, 1).await.unwrap();
        assert!(round.delete_error.is_none(), "DeleteMessageBatch failed: {:?}", round.delete_error);
        out.extend(round.messages);
    }
    out
}

pub fn config(db: &TestDb, destinations: &[(&str, &str)]) -> Config {
    let mut file = FileConfig::default();
    let keys = [
        ("database_url", db.url.as_str()),
        ("slot", &db.slot),
        ("heartbeat_interval", "200ms"),
        ("sqs.endpoint_url", &stack().sqs_url),
    ];
    for (key, value) in keys {
        file.set(key, value).unwrap();
    }
    file.destinations = destinations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap()
}

/// A relay running in this process.
pub struct Running {
    pub metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), outbox_relay::runtime::RelayError>>,
}

impl Running {
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(15), &mut self.task)
            .await
            .expect("relay stops within 15 s")
            .unwrap()
            .unwrap();
    }

    /// How the relay ended, if it did (a start-up refusal, a panic).
    pub async fn ended(&mut self) -> Option<String> {
        if !self.task.is_finished() {
            return None;
        }
        Some(match (&mut self.task).await {
            Ok(Ok(())) => "stopped".into(),
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        })
    }

    /// Abandon the relay without a graceful stop.
    pub fn abort(self) {
        self.task.abort();
    }
}

pub fn start(config: Config, publisher: Arc<dyn Publisher>) -> Running {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
    let metrics = Metrics::new();
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(outbox_relay::run(config, publisher, Arc::clone(&metrics), async move {
        let _ = rx.await;
    }));
    Running { metrics, stop: Some(tx), task }
}

/// Run a relay that must refuse to start; the error it gives, as text.
pub async fn start_up_error(config: Config, publisher: Arc<dyn Publisher>) -> String {
    outbox_relay::run(config, publisher, Metrics::new(), std::future::pending()).await.unwrap_err().to_string()
}

/// Wait until `cond` holds, polling; panic with `what` at the deadline.
pub async fn wait_for<F, Fut>(what: &str, deadline: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + deadline;
    loop {
        if cond().await {
            return;
        }
        assert!(Instant::now() < end, "timed out after {deadline:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Insert `n` rows for `destination` in one transaction; bodies are the event ids.
pub async fn insert_rows(c: &Client, prefix: &str, destination: &str, n: usize, group_mod: Option<usize>) {
    c.execute(
        "INSERT INTO outbox (event_id, destination, body, group_key)
         SELECT $1 || ':' || i, $2, $1 || ':' || i,
                CASE WHEN $4::int IS NULL THEN NULL ELSE 'g' || (i % $4::int) END
           FROM generate_series(1, $3::int) i",
        &[&prefix, &destination, &(n as i32), &group_mod.map(|g| g as i32)],
    )
    .await
    .unwrap();
}
