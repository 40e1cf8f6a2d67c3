//! Tables teams already have: Debezium's outbox convention (rows inserted
//! and deleted by one transaction, in a schema of their own), read from the
//! slot with the producers' SQL unchanged.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::CallError;
use testkit::*;

const Q: &str = "http://memory.invalid/orders.fifo";

/// Debezium's table, as its Quarkus extension creates it, in schema `app`,
/// added to the relay's publication.
async fn debezium_table(db: &TestDb) {
    db.client()
        .await
        .batch_execute(
            "CREATE SCHEMA app;
             CREATE TABLE app.outboxevent (
                 id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL, aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL, timestamp timestamp NOT NULL DEFAULT now(), payload jsonb,
                 tracingspancontext varchar(256));
             ALTER PUBLICATION outbox_relay ADD TABLE app.outboxevent;",
        )
        .await
        .unwrap();
}

/// The producer's SQL, unchanged: each event inserted and deleted in its
/// business transaction. `n` events of aggregates `0..aggregates`.
async fn produce(c: &tokio_postgres::Client, prefix: &str, aggregatetype: &str, n: usize, aggregates: usize) {
    c.batch_execute(&format!(
        "DO $$
         DECLARE eid uuid;
         BEGIN
             FOR i IN 1..{n} LOOP
                 eid := gen_random_uuid();
                 INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
                 VALUES (eid, '{aggregatetype}', 'agg' || (i % {aggregates}), 'Created',
                         jsonb_build_object('e', '{prefix}:' || i));
                 DELETE FROM app.outboxevent WHERE id = eid;
             END LOOP;
         END $$"
    ))
    .await
    .unwrap();
}

fn mapped_config(db: &TestDb) -> outbox_relay::config::Config {
    let mut cfg = config(db, &[("orders", Q)]);
    cfg.mapped = vec![Mapping::preset(Preset::Debezium, "app", "outboxevent")];
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    cfg
}

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(Q, true, 262_144);
    p
}

/// The events whose payload starts with `prefix`, by payload, in the order
/// the queue took them.
fn arrived(p: &MemoryPublisher, prefix: &str) -> Vec<(String, String)> {
    p.sent(Q)
        .into_iter()
        .filter(|s| s.body.contains(&format!("\"{prefix}:")))
        .map(|s| (s.body, s.group_id.unwrap_or_default()))
        .collect()
}

/// Every one of the `n` events arrived once, each group's in order (`i` in
/// the payload rises within a group).
fn in_order_per_group(events: &[(String, String)], n: usize) {
    let index = |body: &str| -> usize { body.rsplit(':').next().unwrap().trim_end_matches("\"}").parse().unwrap() };
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (b, g) in events {
        let i = index(b);
        assert!(seen.insert(i), "event {i} sent twice");
        if let Some(before) = last.insert(g.as_str(), i) {
            assert!(i > before, "group {g}: event {i} after {before}");
        }
    }
    assert_eq!(seen.len(), n, "every event arrives");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_rows_are_published_with_the_producers_sql_unchanged() {
    let db = TestDb::new("mapped_dbz").await;
    debezium_table(&db).await;
    let p = publisher();
    let relay = start(mapped_config(&db), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    produce(&c, "a", "orders", 300, 7).await;
    // Not configured: DEAD in the relay's table with its reason; a NULL
    // payload: DEAD (empty body). Neither holds the others back.
    produce(&c, "nowhere", "billing", 3, 1).await;
    c.batch_execute(
        "BEGIN; INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
                VALUES ('00000000-0000-4000-8000-000000000001', 'orders', 'aggX', 'Created', NULL);
         DELETE FROM app.outboxevent; COMMIT;",
    )
    .await
    .unwrap();
    produce(&c, "b", "orders", 50, 3).await;
    let after = db.current_lsn().await;
    wait_for("every event settled", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await >= after })
        .await;
    in_order_per_group(&arrived(&p, "a"), 300);
    in_order_per_group(&arrived(&p, "b"), 50);
    let first = &p.sent(Q)[0];
    assert!(first.attributes.iter().any(|(n, _, v)| n == "type" && v == "Created"), "{:?}", first.attributes);
    let dedup = first.dedup_id.as_deref().unwrap_or_default();
    assert!(dedup.starts_with("app.outboxevent:") && dedup.len() == 52, "the table and uuid deduplicate: {dedup}");
    assert_eq!(db.count("status = 'DEAD' AND last_error LIKE 'unknown_destination%'").await, 3);
    assert_eq!(db.count("status = 'DEAD' AND last_error LIKE 'empty_body%'").await, 1);
    assert_eq!(db.count("status = 'NEW'").await, 0, "published rows leave nothing in the relay's table");
    relay.stop().await;
}

/// A queue down: the lane spools, its rows are copied into the relay's table
/// with their mapped fields and drained from there when the queue is back;
/// a relay killed meanwhile loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_rows_survive_a_spool_and_a_kill() {
    let db = TestDb::new("mapped_spool").await;
    debezium_table(&db).await;
    let p = publisher();
    let relay = start(mapped_config(&db), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    p.break_queue(Q, CallError::transport("connection refused"));
    produce(&c, "s", "orders", 200, 5).await;
    wait_for("rows spooled into the relay's table", Duration::from_secs(30), || async {
        db.count("status = 'NEW' AND next_attempt_at IS NOT NULL").await > 0
    })
    .await;
    relay.abort();
    produce(&c, "k", "orders", 100, 5).await;
    p.fix_queue(Q);
    let relay = start(mapped_config(&db), Arc::new(p.clone()));
    wait_for("every event arrives", Duration::from_secs(90), || async {
        let got = |prefix: &str| arrived(&p, prefix).iter().map(|(b, _)| b.clone()).collect::<HashSet<_>>().len();
        got("s") == 200 && got("k") == 100
    })
    .await;
    let copied = p.sent(Q).iter().filter(|s| s.body.contains("\"s:")).count();
    assert!(copied >= 200);
    wait_for("the spool drained", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapping_that_cannot_work_is_refused_naming_the_table_column_and_fix() {
    let db = TestDb::new("mapped_refuse").await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE events (id bigint PRIMARY KEY, topic text, payload int, attrs text);
         CREATE TABLE nokey (id bigint, topic text, payload text);",
    )
    .await
    .unwrap();
    let refused = |m: Mapping| {
        let mut cfg = config(&db, &[("orders", Q)]);
        cfg.mapped = vec![m];
        start_up_error(cfg, Arc::new(publisher()))
    };
    let custom = |table: &str| Mapping {
        schema: "public".into(),
        table: table.into(),
        id: "id".into(),
        event_id: "id".into(),
        destination: "topic".into(),
        body: "payload".into(),
        group_key: None,
        attributes: None,
        attribute_columns: vec![],
    };
    let e = refused(Mapping { body: "data".into(), ..custom("events") }).await;
    assert!(e.contains("mapped table public.events: no column \"data\""), "{e}");
    let e = refused(custom("events")).await;
    assert!(e.contains("body column \"payload\" is integer"), "{e}");
    let e = refused(Mapping { body: "topic".into(), attributes: Some("attrs".into()), ..custom("events") }).await;
    assert!(e.contains("attributes column \"attrs\" is text"), "{e}");
    let e = refused(Mapping { body: "topic".into(), ..custom("nokey") }).await;
    assert!(e.contains("no replica identity") && e.contains("REPLICA IDENTITY FULL"), "{e}");
    let e = refused(Mapping { body: "topic".into(), ..custom("events") }).await;
    assert!(e.contains("ALTER PUBLICATION outbox_relay ADD TABLE \"public\".\"events\""), "{e}");
    let e = refused(custom("missing")).await;
    assert!(e.contains("mapped table public.missing: no such table"), "{e}");
    let mut polling = config(&db, &[("orders", Q)]);
    polling.mapped = vec![Mapping { body: "topic".into(), ..custom("events") }];
    polling.mode = outbox_relay::config::Mode::Polling;
    let e = start_up_error(polling, Arc::new(publisher())).await;
    assert!(e.contains("polling reads only the relay's own outbox table"), "{e}");
}
