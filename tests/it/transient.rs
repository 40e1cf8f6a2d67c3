//! Transient rows: inserted and deleted by the same transaction, so the
//! outbox table stays empty. The relay publishes them from the stream and
//! records them only in its watermark.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::Mode;
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::CallError;
use testkit::process::RelayConfig;
use testkit::*;

const Q: &str = "http://memory.invalid/orders";

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    p
}

/// One transaction inserting `n` rows for `destination`, each deleted right
/// after its insert (the convention Debezium's outbox users follow).
async fn insert_transient(c: &tokio_postgres::Client, prefix: &str, destination: &str, n: usize) {
    c.batch_execute(&format!(
        "DO $$
         DECLARE rid bigint;
         BEGIN
             FOR i IN 1..{n} LOOP
                 INSERT INTO outbox (event_id, destination, body) VALUES ('{prefix}:' || i, '{destination}', '{prefix}:' || i)
                 RETURNING id INTO rid;
                 DELETE FROM outbox WHERE id = rid;
             END LOOP;
         END $$"
    ))
    .await
    .unwrap();
}

fn counter(metrics: &str, series: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

/// Every event of each kind of transaction arrives once; the transient ones
/// are settled without a write (no run recorded, no wait for the visibility
/// deadline), the persistent ones are deleted with their runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_rows_are_published_and_need_no_settlement() {
    let db = TestDb::new("transient").await;
    let p = publisher();
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    for k in 0..20 {
        insert_transient(&c, &format!("t{k}"), "orders", 100).await;
    }
    // One transaction inserts ten rows and deletes four of them.
    c.batch_execute(
        "BEGIN;
         INSERT INTO outbox (event_id, destination, body) SELECT 'mixed:' || i, 'orders', 'mixed:' || i FROM generate_series(1, 10) i;
         DELETE FROM outbox WHERE event_id IN ('mixed:2', 'mixed:4', 'mixed:6', 'mixed:8');
         COMMIT;",
    )
    .await
    .unwrap();
    let after = db.current_lsn().await;
    let started = std::time::Instant::now();
    wait_for("the slot confirmed past every transaction", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    let took = started.elapsed();
    let sent = p.sent(Q);
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in &sent {
        *counts.entry(s.body.clone()).or_default() += 1;
    }
    assert_eq!(counts.len(), 2_010, "every event arrives");
    assert!(counts.values().all(|&n| n == 1), "no event was sent twice");
    assert_eq!(db.count("true").await, 0, "the six persistent rows were deleted when published");
    let run_ids: i64 = c
        .query_one("SELECT coalesce(sum(hi - lo + 1), 0)::bigint FROM outbox_published_runs", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(run_ids, 6, "only the persistent rows needed a settlement write");
    let m = relay.metrics.render();
    assert_eq!(counter(&m, "outbox_relay_transient_events_total{destination=\"orders\"}"), 2_004.0, "{m}");
    assert!(took < Duration::from_secs(10), "settling waited out the visibility deadline: {took:?}");
    relay.stop().await;
}

/// A row deleted by a later transaction before the relay sent it: it was
/// committed, so it is published (from the stream), and settling it finds
/// nothing to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_deleted_by_a_later_transaction_is_still_published() {
    let db = TestDb::new("later_delete").await;
    let p = publisher();
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    p.close_gate();
    let c = db.client().await;
    insert_rows(&c, "later", "orders", 20, None).await;
    c.batch_execute("DELETE FROM outbox WHERE event_id LIKE 'later:%'").await.unwrap();
    let after = db.current_lsn().await;
    p.open_gate();
    wait_for("the slot confirmed past both transactions", Duration::from_secs(30), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    let bodies: HashSet<String> = p.sent(Q).into_iter().map(|s| s.body).collect();
    assert_eq!(bodies.len(), 20);
    relay.stop().await;
}

/// A transient row that ends DEAD is written back to the table with its
/// reason; one whose lane spools is written back as NEW and the spool drain
/// sends it once the queue is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_rows_ending_dead_or_spooled_are_written_back() {
    let db = TestDb::new("transient_back").await;
    let p = publisher();
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    insert_transient(&c, "ghost", "nowhere", 3).await;
    wait_for("the unknown destination's rows DEAD", Duration::from_secs(30), || async {
        db.count("status = 'DEAD' AND last_error LIKE 'unknown_destination%'").await == 3
    })
    .await;

    p.break_queue(Q, CallError::transport("connection refused"));
    insert_transient(&c, "sick", "orders", 50).await;
    wait_for("the lane spools its transient rows to the table", Duration::from_secs(30), || async {
        db.count("status = 'NEW' AND next_attempt_at IS NOT NULL AND event_id LIKE 'sick:%'").await == 50
    })
    .await;
    assert_eq!(p.sent(Q).len(), 0);
    p.fix_queue(Q);
    wait_for("the spool drain sends them", Duration::from_secs(60), || async {
        db.count("event_id LIKE 'sick:%'").await == 0
    })
    .await;
    let bodies: HashSet<String> = p.sent(Q).into_iter().map(|s| s.body).collect();
    assert_eq!(bodies.len(), 50, "every spooled transient row arrives");
    relay.stop().await;
}

/// Killed after sending and settling transient rows, before confirming:
/// nothing says they were sent, so the restart sends them again. Nothing is
/// lost; duplicates are at most what was not confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_rows_survive_a_crash_between_send_and_confirm() {
    let db = TestDb::new("transient_crash").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "transient", false, None).await;
    let cfg = RelayConfig::new(&db, "cdc", &[("orders", &q)], "");
    let relay = cfg.spawn();
    wait_for("slot created", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await > 0 }).await;
    relay.terminate(Duration::from_secs(15)).await.expect("relay stops on SIGTERM");
    let c = db.client().await;
    for k in 0..5 {
        insert_transient(&c, &format!("c{k}"), "orders", 40).await;
    }
    let after = db.current_lsn().await;
    let mut crashing = cfg.spawn_with(&[("FAILPOINTS", "cdc::before_confirm=return")]);
    let status = crashing.wait_exit(Duration::from_secs(60)).await.expect("the relay dies at the fail point");
    assert!(!status.success());
    assert!(db.confirmed_flush_lsn().await < after, "the crash came before the confirmation");
    let relay = cfg.spawn();
    wait_for("confirmed after the restart", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    // Duplicates are expected: receive until every event was seen once.
    let (mut received, mut unique) = (0, HashSet::new());
    let end = std::time::Instant::now() + Duration::from_secs(60);
    while unique.len() < 200 && std::time::Instant::now() < end {
        let got = receive_all(&sqs, &q, 200 - unique.len(), Duration::from_secs(5)).await;
        received += got.len();
        unique.extend(got.into_iter().map(|(b, _)| b));
    }
    assert_eq!(unique.len(), 200, "every transient event arrives");
    eprintln!("transient crash: {received} received, {} unique", unique.len());
    relay.terminate(Duration::from_secs(15)).await;
}

/// Polling reads the table: it delivers persistent rows written next to
/// transient ones, and never sees the transient ones (the README says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_delivers_persistent_rows_next_to_transient_ones() {
    let db = TestDb::new("transient_poll").await;
    let p = publisher();
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.mode = Mode::Polling;
    let relay = start(cfg, Arc::new(p.clone()));
    let c = db.client().await;
    for k in 0..5 {
        insert_transient(&c, &format!("tp{k}"), "orders", 20).await;
        insert_rows(&c, &format!("pp{k}"), "orders", 20, None).await;
    }
    wait_for("persistent rows published", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    let bodies: HashSet<String> = p.sent(Q).into_iter().map(|s| s.body).collect();
    assert_eq!(bodies.len(), 100);
    assert!(bodies.iter().all(|b| b.starts_with("pp")), "polling cannot see transient rows");
    relay.stop().await;
}
