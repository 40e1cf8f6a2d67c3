//! What operators do to mapped tables under a running relay: a key made
//! nullable and a row without one, columns dropped, a table renamed or moved
//! to another schema, a partitioned outbox, grants missing or taken back.
//! Nothing committed vanishes, a row that cannot become an event is DEAD
//! with its reason, and no table's trouble holds another's rows back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::*;

const ORDERS: &str = "http://memory.invalid/orders";
const EVENTS: &str = "http://memory.invalid/events";

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(ORDERS, false, 262_144);
    p.add_queue(EVENTS, false, 262_144);
    p
}

/// A Debezium-style table `schema.table` (no primary key, REPLICA IDENTITY
/// FULL, the key NOT NULL) and the seed article's `topic-payload` table,
/// both in the relay's publication.
async fn two_tables(db: &TestDb, debezium: &str) {
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS app;
             CREATE TABLE {debezium} (id uuid NOT NULL, aggregatetype text, aggregateid text, type text,
                                      payload jsonb);
             ALTER TABLE {debezium} REPLICA IDENTITY FULL;
             CREATE TABLE outbox_messages (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
                                           published_at timestamptz);
             ALTER PUBLICATION outbox_relay ADD TABLE {debezium}, outbox_messages;"
        ))
        .await
        .unwrap();
}

fn two_tables_config(db: &TestDb, debezium: (&str, &str), topic_payload: (&str, &str)) -> outbox_relay::config::Config {
    let mut cfg = config(db, &[("orders", ORDERS), ("events", EVENTS)]);
    cfg.mapped = vec![
        Mapping::preset(Preset::Debezium, debezium.0, debezium.1),
        Mapping::preset(Preset::TopicPayload, topic_payload.0, topic_payload.1),
    ];
    cfg
}

/// `n` Debezium events into `table` (kept, not deleted), payload
/// `{"e": "<prefix>:<i>"}`.
async fn debezium_rows(c: &tokio_postgres::Client, table: &str, prefix: &str, n: usize) {
    c.batch_execute(&format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, payload)
         SELECT gen_random_uuid(), 'orders', 'agg' || (i % 3), jsonb_build_object('e', '{prefix}:' || i)
           FROM generate_series(1, {n}) i"
    ))
    .await
    .unwrap();
}

/// `n` topic-payload rows into `table`.
async fn topic_rows(c: &tokio_postgres::Client, table: &str, prefix: &str, n: usize) {
    c.batch_execute(&format!(
        "INSERT INTO {table} (topic, payload)
         SELECT 'events', jsonb_build_object('e', '{prefix}:' || i) FROM generate_series(1, {n}) i"
    ))
    .await
    .unwrap();
}

/// How many times each payload tag (`prefix:i`) reached `queue`.
fn tags(p: &MemoryPublisher, queue: &str) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for s in p.sent(queue) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&s.body) {
            if let Some(e) = v["e"].as_str() {
                *n.entry(e.to_string()).or_default() += 1;
            }
        }
    }
    n
}

/// Every one of `prefix:1..=n` reached `queue`.
fn all_of(p: &MemoryPublisher, queue: &str, prefix: &str, n: usize) -> bool {
    let got = tags(p, queue);
    (1..=n).all(|i| got.contains_key(&format!("{prefix}:{i}")))
}

const WAIT: Duration = Duration::from_secs(60);

/// A row without its key, and rows of a table that lost a column: DEAD in
/// the relay's table with a reason naming the table, the column and the
/// fix; a column the mapping can do without reads as NULL; every other row
/// of both tables keeps flowing (the session never stops on them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_mapping_cannot_read_is_dead_and_nothing_else_stops() {
    let db = TestDb::new("op_unreadable").await;
    two_tables(&db, "app.ev2").await;
    let p = publisher();
    let relay = start(two_tables_config(&db, ("app", "ev2"), ("public", "outbox_messages")), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;

    c.batch_execute("ALTER TABLE app.ev2 ALTER COLUMN id DROP NOT NULL").await.unwrap();
    c.batch_execute(
        "INSERT INTO app.ev2 (id, aggregatetype, aggregateid, type, payload)
         VALUES (NULL, 'orders', 'aggN', 'Created', '{\"e\": \"nokey:1\"}')",
    )
    .await
    .unwrap();
    debezium_rows(&c, "app.ev2", "a", 20).await;
    topic_rows(&c, "outbox_messages", "t", 50).await;
    wait_for("the other rows of both tables arrive", WAIT, || async {
        all_of(&p, ORDERS, "a", 20) && all_of(&p, EVENTS, "t", 50)
    })
    .await;
    wait_for("the keyless row DEAD with its reason", WAIT, || async {
        db.count(
            "status = 'DEAD' AND event_id LIKE 'app.ev2:no-key@%' AND destination = 'orders'
             AND last_error LIKE 'unreadable_row: app.ev2: a row without its key column \"id\"%SET NOT NULL%'",
        )
        .await
            == 1
    })
    .await;
    assert!(!tags(&p, ORDERS).contains_key("nokey:1"));

    // An attribute column gone: read as absent.
    c.batch_execute("ALTER TABLE app.ev2 DROP COLUMN type").await.unwrap();
    debezium_rows(&c, "app.ev2", "b", 5).await;
    wait_for("rows without the dropped attribute arrive", WAIT, || async { all_of(&p, ORDERS, "b", 5) }).await;
    let b = p.sent(ORDERS).into_iter().find(|s| s.body.contains("\"b:1\"")).unwrap();
    assert!(b.attributes.iter().all(|a| a.0 != "type"), "{:?}", b.attributes);

    // The destination column gone: each row DEAD, naming it; the other
    // table flows on.
    c.batch_execute("ALTER TABLE app.ev2 DROP COLUMN aggregatetype").await.unwrap();
    c.batch_execute(
        "INSERT INTO app.ev2 (id, aggregateid, payload)
         SELECT gen_random_uuid(), 'agg', jsonb_build_object('e', 'c:' || i) FROM generate_series(1, 4) i",
    )
    .await
    .unwrap();
    topic_rows(&c, "outbox_messages", "u", 50).await;
    wait_for("the other table's later rows arrive", WAIT, || async { all_of(&p, EVENTS, "u", 50) }).await;
    wait_for("the rows without a destination column DEAD", WAIT, || async {
        db.count(
            "status = 'DEAD' AND last_error LIKE 'unreadable_row: app.ev2: no column \"aggregatetype\"%dead redrive%'",
        )
        .await
            == 4
    })
    .await;
    let after = db.current_lsn().await;
    wait_for("the slot confirmed past all of it", WAIT, || async { db.confirmed_flush_lsn().await >= after }).await;
    let cfg = two_tables_config(&db, ("app", "ev2"), ("public", "outbox_messages"));
    let status = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    let trouble = status.tables[0].error.as_deref().unwrap_or_default();
    assert!(trouble.contains("no column \"aggregatetype\""), "{trouble}");
    assert_eq!((status.tables[0].dead, status.tables[1].error.as_deref()), (5, None));
    wait_for("the trouble in the metrics", Duration::from_secs(30), || async {
        relay.metrics.render().contains("outbox_relay_mapped_table_trouble{table=\"app.ev2\"} 1")
    })
    .await;
    assert!(relay
        .metrics
        .render()
        .contains("outbox_relay_events_dead_total{destination=\"unknown\",reason=\"unreadable_row\"} 5"));

    // Mended by hand (the column's values are gone): corrected and redriven,
    // the rows go out from the relay's table.
    c.batch_execute(
        "UPDATE outbox SET destination = 'orders' WHERE status = 'DEAD' AND last_error LIKE '%aggregatetype%'",
    )
    .await
    .unwrap();
    let filter = outbox_relay::ops::DeadFilter { destination: Some("orders"), table: None };
    let redriven = outbox_relay::ops::dead_redrive(&c, filter, None).await.unwrap();
    assert_eq!(redriven, 5, "the four and the keyless one");
    wait_for("redriven rows arrive", WAIT, || async {
        all_of(&p, ORDERS, "c", 4) && tags(&p, ORDERS).contains_key("nokey:1")
    })
    .await;
    relay.stop().await;
}

/// A table renamed, and another moved to another schema, while producers
/// write to them under their new names: the stream knows a table by its oid,
/// so every row is sent and the published column is set under the new
/// name; a relay restarted before its configuration names them finds them
/// by the oids its last start recorded, and one restarted with the new
/// names sends nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renamed_and_moved_tables_are_followed() {
    let db = TestDb::new("op_rename").await;
    two_tables(&db, "app.outboxevent").await;
    let p = publisher();
    let relay =
        start(two_tables_config(&db, ("app", "outboxevent"), ("public", "outbox_messages")), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    debezium_rows(&c, "app.outboxevent", "a", 20).await;
    topic_rows(&c, "outbox_messages", "t", 20).await;
    c.batch_execute(
        "ALTER TABLE app.outboxevent RENAME TO outboxevent_v2;
         CREATE SCHEMA moved; ALTER TABLE outbox_messages SET SCHEMA moved;",
    )
    .await
    .unwrap();
    debezium_rows(&c, "app.outboxevent_v2", "b", 20).await;
    topic_rows(&c, "moved.outbox_messages", "u", 20).await;
    wait_for("every row of both tables arrives", WAIT, || async {
        all_of(&p, ORDERS, "a", 20)
            && all_of(&p, ORDERS, "b", 20)
            && all_of(&p, EVENTS, "t", 20)
            && all_of(&p, EVENTS, "u", 20)
    })
    .await;
    wait_for("published_at set under the new name", WAIT, || async {
        let n: i64 = c
            .query_one("SELECT count(*) FROM moved.outbox_messages WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        n == 0
    })
    .await;
    let after = db.current_lsn().await;
    wait_for("settled", WAIT, || async { db.confirmed_flush_lsn().await >= after }).await;
    let old_names = two_tables_config(&db, ("app", "outboxevent"), ("public", "outbox_messages"));
    let status = outbox_relay::ops::status(&c, &old_names).await.unwrap();
    let renamed: Vec<(Option<&str>, Option<&str>)> =
        status.tables.iter().map(|t| (t.renamed_to.as_deref(), t.error.as_deref())).collect();
    assert_eq!(renamed, [(Some("app.outboxevent_v2"), None), (Some("moved.outbox_messages"), None)]);
    assert_eq!(status.tables[1].unpublished, Some(0), "counted under its new name");
    relay.stop().await;

    // Restarted before its configuration is updated: the old names lead to
    // the tables by the oids the first start recorded.
    let relay =
        start(two_tables_config(&db, ("app", "outboxevent"), ("public", "outbox_messages")), Arc::new(p.clone()));
    debezium_rows(&c, "app.outboxevent_v2", "d", 10).await;
    topic_rows(&c, "moved.outbox_messages", "w", 10).await;
    wait_for("rows after a restart under the old names arrive", WAIT, || async {
        all_of(&p, ORDERS, "d", 10) && all_of(&p, EVENTS, "w", 10)
    })
    .await;
    let after = db.current_lsn().await;
    wait_for("settled", WAIT, || async { db.confirmed_flush_lsn().await >= after }).await;
    relay.stop().await;

    // Restarted with the new names: the rows after it arrive, none twice.
    let relay =
        start(two_tables_config(&db, ("app", "outboxevent_v2"), ("moved", "outbox_messages")), Arc::new(p.clone()));
    debezium_rows(&c, "app.outboxevent_v2", "c", 10).await;
    topic_rows(&c, "moved.outbox_messages", "v", 10).await;
    wait_for("rows after the restart arrive", WAIT, || async {
        all_of(&p, ORDERS, "c", 10) && all_of(&p, EVENTS, "v", 10)
    })
    .await;
    relay.stop().await;
    for queue in [ORDERS, EVENTS] {
        let twice: Vec<_> = tags(&p, queue).into_iter().filter(|(_, n)| *n > 1).collect();
        assert!(twice.is_empty(), "{queue}: {twice:?}");
    }
    assert_eq!(db.count("true").await, 0, "nothing DEAD or waiting in the relay's table");
}

/// A partitioned outbox (by time, for retention): refused with the real fix
/// while its publication publishes rows under the partitions' names, read
/// once it publishes via the root, rows of every partition sent and marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_is_read_through_its_root() {
    let db = TestDb::new("op_partitioned").await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE tp (id bigint GENERATED ALWAYS AS IDENTITY, topic text NOT NULL, payload jsonb NOT NULL,
                          published_at timestamptz, created date NOT NULL DEFAULT current_date,
                          PRIMARY KEY (id, created)) PARTITION BY RANGE (created);
         CREATE TABLE tp_old PARTITION OF tp FOR VALUES FROM ('2000-01-01') TO ('2026-01-01');
         CREATE TABLE tp_new PARTITION OF tp FOR VALUES FROM ('2026-01-01') TO ('2100-01-01');
         ALTER PUBLICATION outbox_relay ADD TABLE tp;",
    )
    .await
    .unwrap();
    let cfg = || {
        let mut cfg = config(&db, &[("events", EVENTS)]);
        cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "tp")];
        cfg
    };
    let e = start_up_error(cfg(), Arc::new(publisher())).await;
    assert!(
        e.contains("mapped table public.tp is partitioned")
            && e.contains("ALTER PUBLICATION \"outbox_relay\" SET (publish_via_partition_root = true)"),
        "{e}"
    );
    c.batch_execute("ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = true)").await.unwrap();
    let p = publisher();
    let relay = start(cfg(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    c.batch_execute(
        "INSERT INTO tp (topic, payload, created)
         SELECT 'events', jsonb_build_object('e', 'p:' || i), CASE WHEN i % 2 = 0 THEN date '2020-01-01' ELSE current_date END
           FROM generate_series(1, 40) i",
    )
    .await
    .unwrap();
    wait_for("rows of both partitions arrive", WAIT, || async { all_of(&p, EVENTS, "p", 40) }).await;
    wait_for("every row marked", WAIT, || async {
        let n: i64 = c.query_one("SELECT count(*) FROM tp WHERE published_at IS NULL", &[]).await.unwrap().get(0);
        n == 0
    })
    .await;
    relay.stop().await;
}

/// A mapped table with a published column needs SELECT on its columns and
/// UPDATE of that column: start-up names the missing grant and its
/// statement; a grant taken back under the running relay is named in the
/// log, and the rows written meanwhile are sent all the same, as are the
/// relay's own table's, also by a relay restarted under the revoke.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapped_table_grants_are_checked_and_a_revoke_loses_nothing() {
    let db = TestDb::new("op_grants").await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE outbox_messages (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
                                       published_at timestamptz);
         ALTER PUBLICATION outbox_relay ADD TABLE outbox_messages;",
    )
    .await
    .unwrap();
    let role = format!("r_{}", db.name);
    c.batch_execute(&format!(
        "CREATE ROLE {role} LOGIN REPLICATION;
         GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {role};
         GRANT SELECT, INSERT, DELETE ON outbox_published_runs TO {role};
         GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {role};"
    ))
    .await
    .unwrap();
    let sources = format!("GRANT SELECT, INSERT, UPDATE ON outbox_relay_sources TO {role}");
    let cfg = || {
        let mut cfg = config(&db, &[("events", EVENTS)]);
        cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "outbox_messages")];
        cfg.database_url = db.url.replacen("postgres@", &format!("{role}@"), 1);
        cfg
    };
    let e = start_up_error(cfg(), Arc::new(publisher())).await;
    assert!(e.contains(&format!("GRANT SELECT (\"id\") ON \"public\".\"outbox_messages\" TO \"{role}\"")), "{e}");
    c.batch_execute(&format!("GRANT SELECT ON outbox_messages TO {role}")).await.unwrap();
    let e = start_up_error(cfg(), Arc::new(publisher())).await;
    assert!(
        e.contains(&format!("GRANT UPDATE (\"published_at\") ON \"public\".\"outbox_messages\" TO \"{role}\"")),
        "{e}"
    );
    c.batch_execute(&format!("GRANT UPDATE (published_at) ON outbox_messages TO {role}")).await.unwrap();
    // Without the grants on outbox_relay_sources (granted before migration
    // 14) the relay starts all the same; with them, it knows the table
    // from this start on.
    let relay = start(cfg(), Arc::new(publisher()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    relay.stop().await;
    c.batch_execute(&sources).await.unwrap();
    let p = publisher();
    let relay = start(cfg(), Arc::new(p.clone()));
    topic_rows(&c, "outbox_messages", "a", 20).await;
    wait_for("rows arrive", WAIT, || async { all_of(&p, EVENTS, "a", 20) }).await;

    c.batch_execute(&format!("REVOKE UPDATE (published_at) ON outbox_messages FROM {role}")).await.unwrap();
    topic_rows(&c, "outbox_messages", "b", 20).await;
    insert_rows(&c, "own", "events", 20, None).await;
    wait_for("rows written under the revoke arrive, and the relay's own", WAIT, || async {
        all_of(&p, EVENTS, "b", 20) && p.sent(EVENTS).iter().filter(|s| s.body.starts_with("own:")).count() >= 20
    })
    .await;
    let after = db.current_lsn().await;
    wait_for("the slot moves on", WAIT, || async { db.confirmed_flush_lsn().await >= after }).await;
    let as_relay = tokio_postgres::connect(&cfg().database_url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(as_relay.1);
    let status = outbox_relay::ops::status(&as_relay.0, &cfg()).await.unwrap();
    let trouble = status.tables[0].error.as_deref().unwrap_or_default();
    assert!(trouble.contains("GRANT UPDATE (\"published_at\")"), "{trouble}");

    // Restarted under the revoke (a pod rescheduled): the table was
    // accepted before, so start-up says what is missing and goes on; every
    // source keeps flowing, and the rows are marked once the grant is back.
    relay.stop().await;
    let relay = start(cfg(), Arc::new(p.clone()));
    topic_rows(&c, "outbox_messages", "c", 20).await;
    insert_rows(&c, "own2", "events", 20, None).await;
    wait_for("rows written across a restart under the revoke arrive", WAIT, || async {
        all_of(&p, EVENTS, "c", 20) && p.sent(EVENTS).iter().filter(|s| s.body.starts_with("own2:")).count() >= 20
    })
    .await;
    c.batch_execute(&format!("GRANT UPDATE (published_at) ON outbox_messages TO {role}")).await.unwrap();
    wait_for("every row marked once the grant is back", Duration::from_secs(60), || async {
        let n: i64 =
            c.query_one("SELECT count(*) FROM outbox_messages WHERE published_at IS NULL", &[]).await.unwrap().get(0);
        n == 0
    })
    .await;
    relay.stop().await;
    c.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}")).await.unwrap();
}

/// Setting published rows' published column back to NULL is the way to ask
/// for them again: a streaming relay sends them within moments (by a claim
/// of their keys), as a polling relay does within a poll, and marks them
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_set_unpublished_again_are_sent_again_in_both_modes() {
    let db = TestDb::new("op_resend").await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE outbox_messages (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
                                       published_at timestamptz);
         ALTER PUBLICATION outbox_relay ADD TABLE outbox_messages;",
    )
    .await
    .unwrap();
    let cfg = |mode| {
        let mut cfg = config(&db, &[("events", EVENTS)]);
        cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "outbox_messages")];
        cfg.mode = mode;
        cfg.poll_interval = Duration::from_millis(200);
        cfg
    };
    let unpublished = || async {
        c.query_one("SELECT count(*) FROM outbox_messages WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let times = |p: &MemoryPublisher, prefix: &str, n: usize| {
        let got = tags(p, EVENTS);
        (1..=n).map(|i| got.get(&format!("{prefix}:{i}")).copied().unwrap_or(0)).min().unwrap_or(0)
    };
    let p = publisher();
    let relay = start(cfg(outbox_relay::config::Mode::Cdc), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    topic_rows(&c, "outbox_messages", "a", 60).await;
    wait_for("sent and marked", WAIT, || async { times(&p, "a", 60) == 1 && unpublished().await == 0 }).await;
    c.batch_execute("UPDATE outbox_messages SET published_at = NULL WHERE payload->>'e' <= 'a:5'").await.unwrap();
    let asked: Vec<usize> = (1..=60).filter(|i| format!("a:{i}").as_str() <= "a:5").collect();
    wait_for("the streaming relay sends them again", Duration::from_secs(10), || async {
        let got = tags(&p, EVENTS);
        asked.iter().all(|i| got.get(&format!("a:{i}")) == Some(&2))
    })
    .await;
    wait_for("marked again", WAIT, || async { unpublished().await == 0 }).await;
    let others = tags(&p, EVENTS).into_iter().filter(|(t, n)| *n > 1 && t.as_str() > "a:5").count();
    assert_eq!(others, 0, "only the rows asked for are sent again");
    relay.stop().await;

    let relay = start(cfg(outbox_relay::config::Mode::Polling), Arc::new(p.clone()));
    c.batch_execute("UPDATE outbox_messages SET published_at = NULL WHERE payload->>'e' <= 'a:5'").await.unwrap();
    wait_for("the polling relay sends them again", Duration::from_secs(10), || async {
        let got = tags(&p, EVENTS);
        asked.iter().all(|i| got.get(&format!("a:{i}")) == Some(&3))
    })
    .await;
    wait_for("marked again", WAIT, || async { unpublished().await == 0 }).await;
    relay.stop().await;
}
