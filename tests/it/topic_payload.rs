//! The minimal polling outbox of the second seed article (`id bigserial,
//! topic, payload jsonb, published_at`), with the `topic-payload` preset:
//! rows whose `published_at` is NULL are sent (from the slot, and from the
//! table for those written before the slot or left by a polling relay),
//! `published_at` is set once they are, and rows published already are
//! never sent again. Producers' SQL unchanged.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_relay::config::Mode;
use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::*;

const Q: &str = "http://memory.invalid/events";

/// The seed article's table (and the index its claims use); in the relay's
/// publication if `in_publication`.
pub(crate) async fn topic_payload_table(db: &TestDb, in_publication: bool) {
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE outbox_messages (
             id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL, published_at timestamptz);
         CREATE INDEX ON outbox_messages (id) WHERE published_at IS NULL;",
    )
    .await
    .unwrap();
    if in_publication {
        c.batch_execute("ALTER PUBLICATION outbox_relay ADD TABLE outbox_messages").await.unwrap();
    }
}

/// The producer's SQL: `n` rows for `topic`, payload `{"e": "<prefix>:<i>"}`,
/// in one transaction.
async fn produce(c: &tokio_postgres::Client, prefix: &str, topic: &str, n: usize) {
    c.batch_execute(&format!(
        "INSERT INTO outbox_messages (topic, payload)
         SELECT '{topic}', jsonb_build_object('e', '{prefix}:' || i) FROM generate_series(1, {n}) i"
    ))
    .await
    .unwrap();
}

fn tp_config(db: &TestDb, mode: Mode) -> outbox_relay::config::Config {
    let mut cfg = config(db, &[("events", Q)]);
    cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "outbox_messages")];
    cfg.mode = mode;
    cfg.poll_interval = Duration::from_millis(100);
    cfg
}

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    p
}

/// How many times each payload tag (`prefix:i`) arrived.
fn arrivals(p: &MemoryPublisher) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for s in p.sent(Q) {
        let v: serde_json::Value = serde_json::from_str(&s.body).unwrap();
        *n.entry(v["e"].as_str().unwrap().to_string()).or_default() += 1;
    }
    n
}

/// Each of `prefix:1..=n` arrived exactly once.
fn once_each(arrived: &HashMap<String, usize>, prefix: &str, n: usize) {
    for i in 1..=n {
        assert_eq!(arrived.get(&format!("{prefix}:{i}")).copied(), Some(1), "{prefix}:{i}");
    }
}

async fn unpublished(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM outbox_messages WHERE published_at IS NULL", &[]).await.unwrap().get(0)
}

async fn all_published(db: &TestDb) {
    let left = left_unpublished(db).await;
    assert!(left.is_empty(), "rows left with published_at NULL, e.g. {left:?}");
}

/// Waits (60 s at most) for every row's `published_at`; the rows (payload
/// tags) still without one.
async fn left_unpublished(db: &TestDb) -> Vec<String> {
    let c = db.client().await;
    let end = std::time::Instant::now() + Duration::from_secs(60);
    while unpublished(&c).await > 0 && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sql = "SELECT payload->>'e' FROM outbox_messages WHERE published_at IS NULL ORDER BY id LIMIT 10";
    c.query(sql, &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// Rows written before the relay's slot existed and rows written while it
/// runs are sent once each; rows already published are not; a topic with
/// no queue is DEAD in the relay's table; a restart sends nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_payload_rows_are_caught_up_streamed_and_marked() {
    let db = TestDb::new("tp_stream").await;
    topic_payload_table(&db, true).await;
    let c = db.client().await;
    produce(&c, "before", "events", 120).await;
    produce(&c, "old", "events", 30).await;
    c.batch_execute("UPDATE outbox_messages SET published_at = now() WHERE payload->>'e' LIKE 'old:%'").await.unwrap();
    let p = publisher();
    let relay = start(tp_config(&db, Mode::Cdc), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    for k in 0..4 {
        produce(&c, &format!("live{k}"), "events", 50).await;
    }
    produce(&c, "nowhere", "billing", 2).await;
    // Inserted as published already (copied in): not sent.
    c.batch_execute(
        "INSERT INTO outbox_messages (topic, payload, published_at) VALUES ('events', '{\"e\": \"copied:1\"}', now())",
    )
    .await
    .unwrap();
    all_published(&db).await;
    let after = db.current_lsn().await;
    wait_for("the slot confirmed", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await >= after }).await;
    let arrived = arrivals(&p);
    once_each(&arrived, "before", 120);
    for k in 0..4 {
        once_each(&arrived, &format!("live{k}"), 50);
    }
    assert!(!arrived.keys().any(|k| k.starts_with("old:") || k.starts_with("copied:")), "published rows are not sent");
    assert_eq!(arrived.len(), 320);
    assert_eq!(db.count("status = 'DEAD' AND last_error LIKE 'unknown_destination%'").await, 2);
    let status = outbox_relay::ops::status(&c, &tp_config(&db, Mode::Cdc)).await.unwrap();
    let t = &status.tables[0];
    assert_eq!((t.table.as_str(), t.unpublished, t.in_relay_table, t.dead), ("public.outbox_messages", Some(0), 0, 2));
    assert!(outbox_relay::ops::format_status(&status).contains("public.outbox_messages"));
    let table = outbox_relay::ops::DeadFilter { table: Some("outbox_messages"), ..Default::default() };
    let dead = outbox_relay::ops::dead_list(&c, table, 100).await.unwrap();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead.iter().all(|d| d.event_id.starts_with("public.outbox_messages:")));
    let other = outbox_relay::ops::DeadFilter { table: Some("app.outboxevent"), ..Default::default() };
    assert!(outbox_relay::ops::dead_list(&c, other, 100).await.unwrap().is_empty());
    relay.stop().await;

    // A restart: the replay filter and the catch-up both find every row
    // published; only new rows go.
    let relay = start(tp_config(&db, Mode::Cdc), Arc::new(p.clone()));
    produce(&c, "again", "events", 10).await;
    all_published(&db).await;
    let after = db.current_lsn().await;
    wait_for("the slot confirmed", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await >= after }).await;
    let arrived = arrivals(&p);
    once_each(&arrived, "before", 120);
    once_each(&arrived, "again", 10);
    assert_eq!(arrived.len(), 330, "nothing sent twice across the restart");
    relay.stop().await;
}

/// Polling mode: the table is not in any publication; its rows are claimed
/// by `published_at IS NULL`, sent, and marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_payload_rows_are_polled_without_a_slot() {
    let db = TestDb::new("tp_poll").await;
    topic_payload_table(&db, false).await;
    let c = db.client().await;
    produce(&c, "before", "events", 700).await;
    let p = publisher();
    let relay = start(tp_config(&db, Mode::Polling), Arc::new(p.clone()));
    produce(&c, "live", "events", 80).await;
    produce(&c, "nowhere", "billing", 1).await;
    all_published(&db).await;
    let arrived = arrivals(&p);
    once_each(&arrived, "before", 700);
    once_each(&arrived, "live", 80);
    assert_eq!(arrived.len(), 780);
    assert_eq!(db.count("status = 'DEAD' AND last_error LIKE 'unknown_destination%'").await, 1);
    relay.stop().await;
}

/// The old relay's loop from the seed article: claim unpublished rows, "send"
/// them (recorded), set `published_at`; until `stop`.
async fn old_relay(c: tokio_postgres::Client, sent: Arc<Mutex<Vec<String>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        let rows = c
            .query(
                "WITH c AS (SELECT id FROM outbox_messages WHERE published_at IS NULL ORDER BY id LIMIT 10
                             FOR UPDATE SKIP LOCKED)
                 UPDATE outbox_messages m SET published_at = now() FROM c WHERE m.id = c.id
                 RETURNING m.payload->>'e'",
                &[],
            )
            .await
            .unwrap();
        sent.lock().unwrap().extend(rows.iter().map(|r| r.get::<_, String>(0)));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Switching from a polling relay while producers write: the old relay
/// stops, this one starts. Every row goes out, and none the old relay
/// published is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_a_polling_relay_loses_nothing_and_resends_nothing() {
    let db = TestDb::new("tp_switch").await;
    topic_payload_table(&db, true).await;
    let old_sent = Arc::new(Mutex::new(Vec::new()));
    let old_stop = Arc::new(AtomicBool::new(false));
    let old = tokio::spawn(old_relay(db.client().await, Arc::clone(&old_sent), Arc::clone(&old_stop)));
    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (c, producing) = (db.client().await, Arc::clone(&producing));
        tokio::spawn(async move {
            let mut k = 0;
            while producing.load(Ordering::SeqCst) {
                k += 1;
                produce(&c, &format!("p{k}"), "events", 5).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            k
        })
    };
    let c = db.client().await;
    wait_for("the old relay published some", Duration::from_secs(30), || async {
        old_sent.lock().unwrap().len() >= 100
    })
    .await;
    old_stop.store(true, Ordering::SeqCst);
    old.await.unwrap();
    let backlog = unpublished(&c).await;
    let p = publisher();
    let relay = start(tp_config(&db, Mode::Cdc), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    producing.store(false, Ordering::SeqCst);
    let batches = producer.await.unwrap();
    let left = left_unpublished(&db).await;
    if !left.is_empty() {
        let ours = arrivals(&p);
        let old = old_sent.lock().unwrap().clone();
        let seen: Vec<(&String, Option<usize>, bool)> =
            left.iter().map(|t| (t, ours.get(t).copied(), old.contains(t))).collect();
        panic!("rows left with published_at NULL (tag, sent by us, sent by the old relay): {seen:?}");
    }
    let after = db.current_lsn().await;
    wait_for("the slot confirmed", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await >= after }).await;
    let ours = arrivals(&p);
    let old: HashSet<String> = old_sent.lock().unwrap().iter().cloned().collect();
    let mut missing = Vec::new();
    for k in 1..=batches {
        for i in 1..=5 {
            let tag = format!("p{k}:{i}");
            let n = ours.get(&tag).copied().unwrap_or(0) + usize::from(old.contains(&tag));
            if n != 1 {
                missing.push((tag, n));
            }
        }
    }
    assert!(missing.is_empty(), "each row sent exactly once by one relay or the other: {missing:?}");
    assert!(backlog > 0 || !ours.is_empty(), "the switch happened with rows to send");
    relay.stop().await;
}
