//! Bodies over a queue's limit through S3 (ministack serves S3 beside SQS):
//! read back by AWS's own extended client for Python, a FIFO queue's order
//! kept, S3 gone for 30 s with nothing lost and no pointer to a missing
//! object, and the start-up refusal for a bucket that does not answer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{Config, S3Config};
use outbox_relay::publish::offload::Threshold;
use sha2::{Digest, Sha256};
use testkit::proxy::Proxy;
use testkit::*;

/// A bucket of its own.
async fn create_bucket() -> String {
    testkit::create_bucket("bodies").await
}

fn through(bucket: &str, endpoint: &str) -> S3Config {
    S3Config {
        bucket: Some(bucket.to_string()),
        key_prefix: "it/".into(),
        endpoint_url: Some(endpoint.to_string()),
        threshold: Threshold::QueueLimit,
        max_body_bytes: 6 << 20,
        buckets: BTreeMap::new(),
    }
}

/// A row of the relay's table, its attributes `{"kind": "it"}`.
pub(crate) async fn insert(c: &tokio_postgres::Client, event_id: &str, dest: &str, body: &str, group: Option<&str>) {
    c.execute(
        "INSERT INTO outbox (event_id, destination, body, group_key, attributes) VALUES ($1, $2, $3, $4, '{\"kind\": \"it\"}')",
        &[&event_id, &dest, &body, &group],
    )
    .await
    .unwrap();
}

fn body(tag: &str, len: usize) -> String {
    let mut b = format!("{tag}:");
    b.push_str(&"x".repeat(len - b.len()));
    b
}

fn sha(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

/// AWS's extended client for Python reads `count` messages of `queue`:
/// one JSON object each (len, sha256, attributes, group), in arrival order.
fn read_with_extended_client(queue: &str, bucket: &str, count: usize) -> Vec<serde_json::Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/py/extended_client_read.py");
    let out = std::process::Command::new(&stack().python)
        .args([script, &stack().sqs_url, queue, bucket, &count.to_string(), "60"])
        .output()
        .expect("run the Python extended client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "extended client: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn config_with(db: &TestDb, dests: &[(&str, &str)], s3: S3Config) -> Config {
    let mut cfg = config(db, dests);
    cfg.s3 = Some(s3);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_arrive_through_s3_for_the_extended_client_in_order() {
    let db = TestDb::new("s3_e2e").await;
    let sqs = sqs().await;
    let std_q = create_queue(&sqs, "big", false, Some(1024)).await;
    let fifo_q = create_queue(&sqs, "bigf", true, Some(1024)).await;
    let bucket = create_bucket().await;
    let cfg = config_with(&db, &[("big", &std_q), ("bigf", &fifo_q)], through(&bucket, &stack().sqs_url));
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    // The attribute takes 4 + 6 + 2 = 12 bytes ("kind", "String", "it"):
    // 1,012 bytes of body fill the queue's 1,024; one more goes through S3.
    let bodies = [body("at-limit", 1012), body("one-over", 1013), body("five-mib", 5 << 20)];
    for (i, b) in bodies.iter().enumerate() {
        insert(&c, &format!("std:{i}"), "big", b, None).await;
    }
    let fifo: Vec<String> = (0..5).map(|i| body(&format!("fifo{i}"), 2000 + i)).collect();
    for (i, b) in fifo.iter().enumerate() {
        insert(&c, &format!("fifo:{i}"), "bigf", b, Some("g1")).await;
    }
    insert(&c, "too-big", "big", &body("too-big", (6 << 20) + 1), None).await;
    wait_for("every row settled", Duration::from_secs(120), || async { db.count("status = 'NEW'").await == 0 }).await;
    let dead = c.query("SELECT event_id, last_error FROM outbox WHERE status = 'DEAD'", &[]).await.unwrap();
    let dead: Vec<(String, String)> = dead.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "too-big");
    assert!(dead[0].1.starts_with("too_large") && dead[0].1.contains("s3.max_body_bytes"), "{dead:?}");

    let got = read_with_extended_client(&std_q, &bucket, 3);
    let mut want: Vec<(u64, String)> = bodies.iter().map(|b| (b.len() as u64, sha(b))).collect();
    let mut seen: Vec<(u64, String)> =
        got.iter().map(|m| (m["len"].as_u64().unwrap(), m["sha256"].as_str().unwrap().to_string())).collect();
    want.sort();
    seen.sort();
    assert_eq!(seen, want, "the extended client reads every body as written");
    assert!(got.iter().all(|m| m["attributes"]["kind"] == "it"), "the row's attributes go too: {got:?}");
    let in_order = read_with_extended_client(&fifo_q, &bucket, 5);
    let order: Vec<&str> = in_order.iter().map(|m| m["sha256"].as_str().unwrap()).collect();
    let fifo_shas: Vec<String> = fifo.iter().map(|b| sha(b)).collect();
    assert_eq!(order, fifo_shas.iter().map(String::as_str).collect::<Vec<_>>(), "the group's order is kept");
    assert!(in_order.iter().all(|m| m["group"] == "g1"));
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_offloaded_objects_total{destination=\"big\"} 2"), "{m}");
    assert!(m.contains("outbox_relay_offloaded_objects_total{destination=\"bigf\"} 5"), "{m}");
    relay.stop().await;
}

/// Every message of `queue` (raw, as SQS holds it); a pointer's object must
/// exist and hold the body the row had. Returns the bodies, resolved.
async fn receive_resolved(sqs: &outbox_relay::publish::aws::AwsPublisher, queue: &str, n: usize) -> Vec<String> {
    let s3 = s3_client().await;
    let mut out = Vec::new();
    for (raw, _) in receive_all(sqs, queue, n, Duration::from_secs(60)).await {
        out.push(resolve_body(&s3, raw).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_gone_for_30_s_loses_nothing_and_no_pointer_dangles() {
    let db = TestDb::new("s3_outage").await;
    let sqs = sqs().await;
    let queue = create_queue(&sqs, "bigo", false, Some(1024)).await;
    let bucket = create_bucket().await;
    let upstream = stack().sqs_url.trim_start_matches("http://").to_string();
    let proxy = Proxy::start(&upstream).await;
    let mut cfg = config_with(&db, &[("bigo", &queue)], through(&bucket, &proxy.url));
    cfg.lane_stall_timeout = Duration::from_secs(2);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(2);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    cfg.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let relay = start(cfg.clone(), Arc::new(sqs.clone()));
    let c = db.client().await;
    let first = body("before", 3000);
    insert(&c, "before", "bigo", &first, None).await;
    wait_for("the first body through S3", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    assert_eq!(receive_resolved(&sqs, &queue, 1).await, vec![first]);

    proxy.down();
    let mut want = Vec::new();
    for i in 0..40 {
        let b = if i % 2 == 0 { body(&format!("big{i}"), 2000 + i) } else { body(&format!("small{i}"), 50) };
        insert(&c, &format!("o:{i}"), "bigo", &b, None).await;
        want.push(b);
    }
    // The outage itself: S3 is gone this long whatever the relay does.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(db.count("status = 'DEAD'").await, 0, "an S3 outage never makes a row DEAD");
    assert!(db.count("next_attempt_at IS NOT NULL").await > 0, "the stalled lane spooled to the table");
    // Nothing orders a standard queue: the small rows did not wait for S3.
    assert_eq!(db.count("body LIKE 'small%'").await, 0, "the small rows went out while S3 was down");
    // `status` names the failure (S3, since when) from the running relay.
    let status = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    let d = status.destinations.iter().find(|d| d.destination == "bigo").unwrap();
    let reached = status.relay.as_ref().unwrap();
    assert!(reached.error.is_none(), "{reached:?}");
    assert!(
        d.failing.iter().any(|f| f.service == outbox_relay::metrics::Service::S3 && f.error.starts_with("S3.")),
        "{d:?}"
    );
    assert_eq!(d.offloaded_objects, Some(1), "the body written before the outage: {d:?}");
    let shown = outbox_relay::ops::format_status(&status);
    assert!(shown.contains("FAILING on S3 since"), "{shown}");
    proxy.up();
    wait_for("every row settled after S3 returned", Duration::from_secs(120), || async { db.count("true").await == 0 })
        .await;
    let mut got = receive_resolved(&sqs, &queue, want.len()).await;
    got.sort();
    got.dedup();
    want.sort();
    assert_eq!(got, want, "every row arrived, every pointer resolves");
    let m = relay.metrics.render();
    let s3_failures = m.lines().filter(|l| l.starts_with("outbox_relay_sqs_entry_failures_total") && l.contains("S3."));
    assert!(s3_failures.count() > 0, "the failed writes are counted by their S3 code: {m}");
    let status = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    let d = status.destinations.iter().find(|d| d.destination == "bigo").unwrap();
    assert!(d.failing.is_empty(), "S3 answers again: {d:?}");
    relay.stop().await;
}

/// S3 hangs (connections accepted, never answered) while small and big
/// rows of a standard queue keep coming: the small rows keep streaming (at
/// least 90% of those written during the hang are sent during it), the big
/// ones wait in the table (each write fails at its deadline, and while S3
/// fails the next ones go there without trying), the lane never spools, and
/// once S3 answers every row arrives with its object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_hang_holds_back_only_the_rows_that_need_it() {
    let db = TestDb::new("s3_hang").await;
    let sqs = sqs().await;
    let queue = create_queue(&sqs, "bigh", false, Some(1024)).await;
    let bucket = create_bucket().await;
    let upstream = stack().sqs_url.trim_start_matches("http://").to_string();
    let proxy = Proxy::start(&upstream).await;
    let mut cfg = config_with(&db, &[("bigh", &queue)], through(&bucket, &proxy.url));
    // Writes fail at half of it: 2 s.
    cfg.lane_stall_timeout = Duration::from_secs(4);
    let relay = start(cfg.clone(), Arc::new(sqs.clone()));
    let c = db.client().await;
    insert(&c, "before", "bigh", &body("before", 3000), None).await;
    wait_for("the first body through S3", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;

    let switches = || relay.metrics.lane_spool_switches.with_label_values(&["bigh"]).get();
    let before = switches();
    proxy.hang();
    let hang = std::time::Instant::now();
    let mut want = Vec::new();
    let mut small = Vec::new();
    for i in 0..120 {
        let b = if i % 2 == 0 { body(&format!("big{i}"), 2000 + i) } else { body(&format!("small{i}"), 50) };
        insert(&c, &format!("h:{i}"), "bigh", &b, None).await;
        if i % 2 == 1 {
            small.push(format!("h:{i}"));
        }
        want.push(b);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A moment for the last ones, S3 still hung.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let waiting: i64 =
        c.query_one("SELECT count(*) FROM outbox WHERE event_id = ANY($1)", &[&small]).await.unwrap().get(0);
    let hung_for = hang.elapsed();
    assert!(waiting * 10 <= small.len() as i64, "{waiting} of {} small rows waited on the hung S3", small.len());
    assert_eq!(switches(), before, "the lane never spooled for S3");
    assert_eq!(db.count("status = 'DEAD'").await, 0);
    proxy.up();
    wait_for("every row settled after S3 answered", Duration::from_secs(120), || async { db.count("true").await == 0 })
        .await;
    let mut got = receive_resolved(&sqs, &queue, want.len() + 1).await;
    got.retain(|b| !b.starts_with("before:"));
    got.sort();
    got.dedup();
    want.sort();
    assert_eq!(got, want, "every row arrived, every pointer resolves");
    eprintln!("S3 hung {hung_for:?}: {waiting} of {} small rows waited", small.len());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_that_does_not_answer_is_a_start_up_refusal_naming_it() {
    let db = TestDb::new("s3_refusal").await;
    let sqs = sqs().await;
    let queue = create_queue(&sqs, "bigr", false, None).await;
    let cfg = config_with(&db, &[("bigr", &queue)], through("no-such-bucket-here", &stack().sqs_url));
    let e = start_up_error(cfg, Arc::new(sqs)).await;
    assert!(e.contains("bucket \"no-such-bucket-here\" did not answer HeadBucket"), "{e}");
}
