//! The pipeline against the real PostgreSQL with the in-memory publisher,
//! which holds sends at a gate or fails chosen entries.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::PublishedRows;
use outbox_relay::publish::memory::{Fault, MemoryPublisher};
use testkit::*;

const Q: &str = "http://memory.invalid/orders";
const Q2: &str = "http://memory.invalid/billing";

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    p.add_queue(Q2, false, 262_144);
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_lsn_never_passes_an_event_whose_publish_is_blocked() {
    let db = TestDb::new("gate").await;
    let p = publisher();
    let relay = start(config(&db, &[("orders", Q), ("billing", Q2)]), Arc::new(p.clone()));
    let c = db.client().await;
    // Let the slot exist and settle an empty start.
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;

    p.close_gate();
    insert_rows(&c, "blocked", "orders", 3, None).await;
    let blocked_end = db.current_lsn().await; // the end of the blocked transaction
                                              // Later transactions, heartbeats and other tables keep the WAL moving.
    for i in 0..5 {
        insert_rows(&c, &format!("later{i}"), "billing", 10, None).await;
        c.batch_execute("CREATE TABLE IF NOT EXISTS noise (x int); INSERT INTO noise SELECT generate_series(1, 1000)")
            .await
            .unwrap();
    }
    // Several status intervals and heartbeats pass while the gate is closed.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let confirmed = db.confirmed_flush_lsn().await;
        assert!(confirmed < blocked_end, "confirmed {confirmed:X} passed the blocked event at {blocked_end:X}");
    }
    assert_eq!(db.published().await, 0);

    p.open_gate();
    let after = db.current_lsn().await;
    wait_for("everything published", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    wait_for("the slot moves on once settled", Duration::from_secs(30), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_publication_slot_advances_while_other_tables_are_written() {
    let db = TestDb::new("idle").await;
    let p = publisher();
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    c.batch_execute("CREATE TABLE busy (x int, pad text)").await.unwrap();
    for _ in 0..5 {
        c.batch_execute("INSERT INTO busy SELECT i, repeat('x', 200) FROM generate_series(1, 5000) i").await.unwrap();
    }
    let after = db.current_lsn().await;
    wait_for("slot follows the server with no outbox traffic", Duration::from_secs(30), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    assert_eq!(p.calls(), 0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partially_failed_batch_resends_only_the_failed_entries() {
    let db = TestDb::new("partial").await;
    let p = publisher();
    // First call: entries 1 and 3 are throttled (retryable), entry 5 is refused for good.
    p.push_fault(Fault::FailEntries { positions: vec![1, 3], code: "RequestThrottled".into(), sender_fault: true });
    // Second call (the two throttled entries, alone): fails whole, nothing sent.
    p.push_fault(Fault::FailCall(outbox_relay::publish::CallError::transport("connection reset")));
    // Third call (the same two again): the first is refused for good, the second sent.
    p.push_fault(Fault::FailEntries { positions: vec![0], code: "InvalidMessageContents".into(), sender_fault: true });
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.linger = Duration::from_millis(500); // the ten rows go out as one batch
    cfg.adaptive_linger = false;
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    insert_rows(&c, "p", "orders", 10, None).await;
    wait_for("all settled", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;

    assert_eq!(p.batch_sizes(), vec![10, 2, 2]);
    let sent = p.sent(Q);
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in &sent {
        *counts.entry(s.event_id.clone()).or_default() += 1;
    }
    assert_eq!(sent.len(), 9, "{counts:?}");
    assert!(counts.values().all(|&n| n == 1), "an entry was sent twice: {counts:?}");
    assert_eq!(db.count("status <> 'DEAD'").await, 0, "the 9 published rows are deleted");
    let dead: String = c.query_one("SELECT last_error FROM outbox WHERE status = 'DEAD'", &[]).await.unwrap().get(0);
    assert!(dead.starts_with("sqs_rejected: InvalidMessageContents"), "{dead}");
    assert!(relay
        .metrics
        .render()
        .contains("outbox_relay_sqs_entry_failures_total{code=\"RequestThrottled\",destination=\"orders\"} 2"));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_settled_before_a_crash_are_not_sent_again() {
    // Kept rows: marked PUBLISHED behind the relay's back.
    replay_filtered(
        PublishedRows::Keep,
        "UPDATE outbox SET status = 'PUBLISHED', published_at = now() WHERE event_id LIKE 'r:%' AND id % 2 = 0",
        25,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_deleted_by_settlement_before_a_crash_are_not_sent_again() {
    // Deleted rows with their runs, as settlement leaves them (covering the
    // rows' commit, written after it); and five rows
    // a later transaction deleted (no run): nothing says they were
    // published, so they are sent.
    replay_filtered(
        PublishedRows::Delete,
        "WITH d AS (DELETE FROM outbox WHERE event_id LIKE 'r:%' AND id % 2 = 0 RETURNING id)
         INSERT INTO outbox_published_runs (lo, hi, commit_lo, commit_hi)
         SELECT id, id, '0/0', pg_current_wal_lsn() FROM d;
         DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE event_id LIKE 'r:%' AND id % 2 = 1 ORDER BY id LIMIT 5)",
        25,
    )
    .await;
}

/// Rows read but not confirmed when the relay dies; `settle_sql` settles
/// some behind its back; after a restart only `resent` rows are sent.
async fn replay_filtered(published: PublishedRows, settle_sql: &str, resent: usize) {
    let db = TestDb::new("replay").await;
    let p = publisher();
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.published_rows = published;
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let confirmed_before = db.confirmed_flush_lsn().await;
    p.close_gate();
    let c = db.client().await;
    insert_rows(&c, "r", "orders", 50, None).await;
    wait_for("rows read", Duration::from_secs(10), || async {
        relay.metrics.render().contains("outbox_relay_in_flight_events{destination=\"orders\"} 50")
    })
    .await;
    relay.abort();
    c.batch_execute(settle_sql).await.unwrap();
    assert!(db.confirmed_flush_lsn().await <= confirmed_before + 1_000_000);

    let p2 = publisher();
    let relay = start(cfg, Arc::new(p2.clone()));
    wait_for("the rest published", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    wait_for("the resent rows", Duration::from_secs(10), || async { p2.sent(Q).len() >= resent }).await;
    let sent = p2.sent(Q);
    assert_eq!(sent.len(), resent, "only the rows not settled are sent after the restart");
    let filtered = format!("outbox_relay_replayed_events_filtered_total {}", 50 - resent);
    assert!(relay.metrics.render().contains(&filtered), "{filtered}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_killed_mid_stream_reconnect_and_lose_nothing() {
    let db = TestDb::new("reconnect").await;
    let p = publisher();
    let relay = start(config(&db, &[("orders", Q), ("billing", Q2)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    for round in 0..5 {
        insert_rows(&c, &format!("o{round}"), "orders", 400, None).await;
        insert_rows(&c, &format!("b{round}"), "billing", 400, None).await;
        // Every connection of the relay, walsender included, dies as in a
        // PostgreSQL restart.
        c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    }
    wait_for("every row published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    assert_eq!(db.count("true").await, 0, "the 4,000 rows were published and deleted");
    let mut ids: Vec<i64> = p.sent(Q).iter().chain(p.sent(Q2).iter()).map(|s| s.outbox_id.unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4_000, "every row reached its queue at least once");
    let m = relay.metrics.render();
    let restarts: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("outbox_relay_stream_restarts_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(restarts >= 1, "the relay noticed and restarted its session: {restarts}");
    relay.stop().await;
}
