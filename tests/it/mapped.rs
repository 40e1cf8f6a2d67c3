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
pub(crate) async fn debezium_table(db: &TestDb) {
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
    // Traced (the Quarkus extension with OpenTelemetry on): its span
    // context, a Java properties text, carries the producer's trace.
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let context = format!("#Sun Dec 06 22:00:00 UTC 2026\ntracestate=rojo\\=00f067aa0ba902b7\ntraceparent={tp}\n");
    let mut traced = db.client().await;
    let tx = traced.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload, tracingspancontext)
         VALUES ('00000000-0000-4000-8000-000000000002', 'orders', 'aggT', 'Created', '{\"e\": \"traced\"}', $1)",
        &[&context],
    )
    .await
    .unwrap();
    tx.batch_execute("DELETE FROM app.outboxevent").await.unwrap();
    tx.commit().await.unwrap();
    let after = db.current_lsn().await;
    wait_for("every event settled", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await >= after })
        .await;
    let t = p.sent(Q).into_iter().find(|s| s.body.contains("traced")).expect("the traced event");
    assert_eq!(
        t.trace_header.as_deref(),
        Some("Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1")
    );
    let attr = |n: &str| t.attributes.iter().find(|a| a.0 == n).map(|a| a.2.clone());
    assert_eq!(attr("traceparent").as_deref(), Some(tp));
    assert_eq!(attr("tracestate").as_deref(), Some("rojo=00f067aa0ba902b7"));
    assert!(p.sent(Q).iter().filter(|s| !s.body.contains("traced")).all(|s| s.trace_header.is_none()));
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
         CREATE TABLE nokey (id bigint NOT NULL, topic text, payload text);
         CREATE TABLE nullkey (id bigint, topic text, payload text);",
    )
    .await
    .unwrap();
    let refused = |m: Mapping| {
        let mut cfg = config(&db, &[("orders", Q)]);
        cfg.mapped = vec![m];
        start_up_error(cfg, Arc::new(publisher()))
    };
    let custom = |table: &str| Mapping::of("public", table, "id", "topic", "payload");
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
    let e = refused(Mapping { body: "topic".into(), ..custom("nullkey") }).await;
    assert!(e.contains("key column \"id\" may be NULL") && e.contains("ALTER COLUMN \"id\" SET NOT NULL"), "{e}");
    let e = refused(custom("missing")).await;
    assert!(e.contains("mapped table public.missing: no such table"), "{e}");
    let mut polling = config(&db, &[("orders", Q)]);
    polling.mapped = vec![Mapping { body: "topic".into(), ..custom("events") }];
    polling.mode = outbox_relay::config::Mode::Polling;
    let e = start_up_error(polling, Arc::new(publisher())).await;
    assert!(e.contains("polling finds a mapped table's rows by its published column"), "{e}");
    let e = refused(Mapping { body: "topic".into(), published: Some("topic".into()), ..custom("events") }).await;
    assert!(e.contains("published column \"topic\" is text; it must be timestamptz or timestamp"), "{e}");
}

/// A table of another shape: its own schema, a uuid key, a bytea body, a
/// jsonb attributes column, an attribute column, a delay and the producer's
/// trace context; rows kept in the table (never deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_mapping_carries_bytea_attributes_delay_and_trace_context() {
    const STD: &str = "http://memory.invalid/shop";
    let db = TestDb::new("mapped_custom").await;
    db.client()
        .await
        .batch_execute(
            "CREATE SCHEMA shop;
             CREATE TABLE shop.events (id uuid PRIMARY KEY, queue text, data bytea, tenant text, attrs jsonb,
                                       due timestamptz, trace text);
             ALTER PUBLICATION outbox_relay ADD TABLE shop.events;",
        )
        .await
        .unwrap();
    let p = MemoryPublisher::new();
    p.add_queue(STD, false, 262_144);
    let mut cfg = config(&db, &[("shop", STD)]);
    cfg.mapped = vec![Mapping {
        schema: "shop".into(),
        table: "events".into(),
        id: "id".into(),
        event_id: "id".into(),
        destination: "queue".into(),
        body: "data".into(),
        group_key: Some("tenant".into()),
        attributes: Some("attrs".into()),
        attribute_columns: vec!["tenant".into()],
        deliver_at: Some("due".into()),
        traceparent: Some("trace".into()),
        traceparent_if_present: None,
        published: None,
        id_type: None,
        oid: None,
    }];
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    db.client()
        .await
        .execute(
            "INSERT INTO shop.events VALUES
               ('00000000-0000-4000-8000-000000000001', 'shop', 'hi'::bytea, 't1', '{\"n\": 7}', NULL, $1),
               ('00000000-0000-4000-8000-000000000002', 'shop', 'soon'::bytea, 't2', NULL, now() + interval '5 seconds', NULL),
               ('00000000-0000-4000-8000-000000000003', 'shop', 'later'::bytea, 't3', NULL, now() + interval '20 minutes', NULL)",
            &[&tp],
        )
        .await
        .unwrap();
    wait_for("two messages sent", Duration::from_secs(30), || async { p.sent(STD).len() == 2 }).await;
    let by_id = |suffix: &str| p.sent(STD).into_iter().find(|s| s.event_id.ends_with(suffix)).unwrap();
    let now = by_id("0001");
    assert_eq!(now.body, "aGk=");
    assert_eq!(now.group_id.as_deref(), Some("t1"), "a standard queue's fair-queue group");
    let attr = |s: &outbox_relay::publish::memory::Sent, n: &str| {
        s.attributes.iter().find(|a| a.0 == n).map(|a| (a.1.clone(), a.2.clone()))
    };
    assert_eq!(attr(&now, "n"), Some(("Number".into(), "7".into())));
    assert_eq!(attr(&now, "tenant"), Some(("String".into(), "t1".into())));
    assert_eq!(attr(&now, "content-transfer-encoding"), Some(("String".into(), "base64".into())));
    assert_eq!(
        now.trace_header.as_deref(),
        Some("Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1")
    );
    let soon = by_id("0002");
    assert!(soon.delay_seconds.is_some_and(|d| (3..=5).contains(&d)), "{:?}", soon.delay_seconds);
    // Due in 20 minutes: held in the relay's table until then.
    wait_for("the later row held in the relay's table", Duration::from_secs(30), || async {
        db.count("status = 'NEW' AND deliver_at > now() + interval '10 minutes' AND event_id = 'shop.events:00000000-0000-4000-8000-000000000003'").await == 1
    })
    .await;
    db.client().await.batch_execute("UPDATE outbox SET deliver_at = now() WHERE deliver_at IS NOT NULL").await.unwrap();
    wait_for("the held row sent once due", Duration::from_secs(30), || async { p.sent(STD).len() == 3 }).await;
    assert_eq!(by_id("0003").body, "bGF0ZXI=");
    relay.stop().await;
}
