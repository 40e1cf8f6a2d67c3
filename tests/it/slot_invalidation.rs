//! A slot the server really invalidates: a cluster of its own (so
//! `max_slot_wal_keep_size`, which is cluster-wide, touches no other test's
//! slot), the relay stopped while rows are written and WAL past the limit is
//! checkpointed away. The next relay drops the lost slot, creates it again,
//! counts the reason, and delivers the rows written meanwhile from the table.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{Config, FileConfig, Overrides};
use outbox_relay::db;
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::cluster::*;
use testkit::*;

fn relay_config(url: &str, queue: &str) -> Config {
    let keys = [("database_url", url), ("slot", "lost_slot"), ("heartbeat_interval", "200ms")];
    let file = FileConfig::of(&keys, &[("d", queue)]).unwrap();
    Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap()
}

fn delivered(p: &MemoryPublisher, queue: &str) -> HashSet<String> {
    p.sent(queue).into_iter().map(|s| s.event_id).collect()
}

/// Wait until `n` distinct rows reached `queue`.
async fn wait_delivered(what: &str, publisher: &MemoryPublisher, queue: &str, n: usize) {
    wait_for(what, Duration::from_secs(60), || {
        let p = publisher.clone();
        async move { delivered(&p, queue).len() >= n }
    })
    .await;
}

async fn insert(c: &tokio_postgres::Client, prefix: &str, n: i32) {
    c.execute(
        "INSERT INTO outbox (event_id, destination, body) SELECT $1 || i, 'd', $1 || i FROM generate_series(1, $2) i",
        &[&prefix, &n],
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_invalidated_by_the_server_is_recreated_with_its_reason_and_nothing_is_lost() {
    let dir = ClusterDir::new("outbox-relay-invalidate");
    let node = Node::init(&dir.0, "pg");
    node.start(&["max_slot_wal_keep_size=1MB".to_string()]);
    let _stop = StopOnDrop(&node);
    let admin = db::connect(&node.url("postgres")).await.unwrap();
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let mut c = db::connect(&node.url("app")).await.unwrap();
    db::schema::migrate(&mut c).await.unwrap();

    let queue = "http://memory.invalid/000000000000/lost";
    let publisher = MemoryPublisher::new();
    publisher.add_queue(queue, false, 262_144);
    let relay = start(relay_config(&node.url("app"), queue), Arc::new(publisher.clone()));
    insert(&c, "before:", 100).await;
    wait_delivered("the first rows delivered", &publisher, queue, 100).await;
    relay.stop().await;

    // While no relay reads the slot: rows, then WAL far past the limit,
    // checkpointed, so the server invalidates the slot.
    insert(&c, "away:", 500).await;
    c.batch_execute(
        "CREATE TABLE junk (b text);
         INSERT INTO junk SELECT repeat(md5(i::text), 32) FROM generate_series(1, 40000) i;",
    )
    .await
    .unwrap();
    wait_for("the slot invalidated", Duration::from_secs(60), || {
        let c = &c;
        async move {
            c.batch_execute("SELECT pg_switch_wal(); CHECKPOINT").await.unwrap();
            let s = outbox_relay::ops::slot_status(c, "lost_slot").await.unwrap();
            s.invalidation_reason.is_some()
        }
    })
    .await;
    let status = outbox_relay::ops::slot_status(&c, "lost_slot").await.unwrap();
    assert_eq!(status.invalidation_reason.as_deref(), Some("wal_removed"), "{status:?}");
    assert!(outbox_relay::ops::format_slot(&status).contains("INVALIDATED (wal_removed"));

    // The next relay recreates it and catches the rows written meanwhile up from the table.
    let relay = start(relay_config(&node.url("app"), queue), Arc::new(publisher.clone()));
    insert(&c, "after:", 100).await;
    wait_delivered("every row delivered", &publisher, queue, 700).await;
    let got = delivered(&publisher, queue);
    for prefix in ["before:", "away:", "after:"] {
        let n = if prefix == "away:" { 500 } else { 100 };
        for i in 1..=n {
            assert!(got.contains(&format!("{prefix}{i}")), "{prefix}{i} delivered");
        }
    }
    assert_eq!(relay.metrics.slot_recreated.with_label_values(&["wal_removed"]).get(), 1);
    let s = outbox_relay::ops::slot_status(&c, "lost_slot").await.unwrap();
    assert!(s.exists && s.invalidation_reason.is_none(), "a fresh slot: {s:?}");
    relay.stop().await;
}
