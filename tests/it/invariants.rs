//! The invariants of DESIGN.md where two features cross: a row gone from the
//! table is settled only by its send or by writing it back (transient rows
//! the stream does not recognise as such, a shard's insert-only stream); a
//! replayed or settled row is matched to its own row whatever happened to
//! ids since; a hung host of several does not block connections.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use outbox_relay::config::{ArchiveConfig, PublishedRows};
use outbox_relay::event::{Commit, Origin, OutboxEvent};
use outbox_relay::pipeline::settle::{mark, Due, Marking, Outcome, Settlement};
use outbox_relay::policy::dead::{DeadCode, DeadReason};
use outbox_relay::publish::memory::{Fault, MemoryPublisher};
use outbox_relay::publish::CallError;
use testkit::cluster::{ClusterDir, Node, StopOnDrop};
use testkit::*;

const Q: &str = "http://memory.invalid/orders";

fn publisher() -> MemoryPublisher {
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    p
}

fn bodies(p: &MemoryPublisher, prefix: &str) -> HashSet<String> {
    p.sent(Q).into_iter().map(|s| s.body).filter(|b| b.starts_with(prefix)).collect()
}

/// A relay that spools a failing lane within a second and retries its
/// spool quickly.
fn quick_spool(db: &TestDb) -> outbox_relay::config::Config {
    quick_spool_to(db, Q)
}

fn quick_spool_to(db: &TestDb, queue: &str) -> outbox_relay::config::Config {
    let mut cfg = config(db, &[("orders", queue)]);
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    cfg
}

/// A relay started on `p` and streaming (its slot created).
async fn streaming(db: &TestDb, cfg: outbox_relay::config::Config, p: &MemoryPublisher) -> Running {
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    relay
}

/// One transaction inserts 1,500 rows, then deletes them: the first chunk
/// (1,000 rows) is handed on before the stream sees the deletes, so those
/// rows look persistent. Their queue is gone: the lane spools, finds the
/// rows gone, and must write them back, not settle them as "gone". A row of
/// that first chunk with 11 attributes ends DEAD and keeps its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_deleted_after_their_chunk_was_handed_on_survive_a_spool() {
    let db = TestDb::new("gone_chunk").await;
    let p = publisher();
    let relay = streaming(&db, quick_spool(&db), &p).await;
    p.break_queue(Q, CallError::transport("connection refused"));
    let attrs: String = format!("{{{}}}", (0..11).map(|i| format!("\"a{i}\": \"v\"")).collect::<Vec<_>>().join(","));
    let c = db.client().await;
    c.batch_execute(&format!(
        "BEGIN;
         INSERT INTO outbox (event_id, destination, body, attributes) VALUES ('eleven', 'orders', 'eleven', '{attrs}');
         INSERT INTO outbox (event_id, destination, body) SELECT 'big:' || i, 'orders', 'big:' || i FROM generate_series(1, 1500) i;
         DELETE FROM outbox;
         COMMIT;"
    ))
    .await
    .unwrap();
    let after = db.current_lsn().await;
    wait_for("the slot confirmed past the transaction", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    assert_eq!(
        db.count("event_id = 'eleven' AND status = 'DEAD' AND last_error LIKE 'invalid_attributes%'").await,
        1,
        "the DEAD row is written back with its reason"
    );
    p.fix_queue(Q);
    wait_for("every row delivered", Duration::from_secs(90), || async { bodies(&p, "big:").len() == 1_500 }).await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
}

/// A shard's publication carries no deletes: its transient rows look
/// persistent to the stream. Spooled during an outage, they are written
/// back and delivered, as its persistent rows are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_rows_on_a_shard_survive_a_spool() {
    let db = TestDb::new("gone_shard").await;
    let p = publisher();
    let mut cfg = quick_spool(&db);
    cfg.publication = "outbox_orders".into();
    outbox_relay::ops::slot_create(&cfg).await.unwrap();
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("streaming", Duration::from_secs(30), || async {
        relay.metrics.ready.load(std::sync::atomic::Ordering::Relaxed)
    })
    .await;
    p.break_queue(Q, CallError::transport("connection refused"));
    let c = db.client().await;
    for k in 0..4 {
        c.batch_execute(&format!(
            "DO $$ DECLARE rid bigint; BEGIN FOR i IN 1..50 LOOP
                 INSERT INTO outbox (event_id, destination, body) VALUES ('sh{k}:' || i, 'orders', 'sh{k}:' || i) RETURNING id INTO rid;
                 DELETE FROM outbox WHERE id = rid;
             END LOOP; END $$"
        ))
        .await
        .unwrap();
    }
    insert_rows(&c, "shp", "orders", 200, None).await;
    let after = db.current_lsn().await;
    wait_for("the slot confirmed past the outage's rows", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    p.fix_queue(Q);
    wait_for("every row delivered", Duration::from_secs(90), || async { bodies(&p, "sh").len() == 400 }).await;
    relay.stop().await;
}

/// A transient transaction larger than a chunk while its queue is gone, then
/// its ids given to new rows (`ALTER COLUMN id RESTART`) that are published
/// from the table first: the transient rows are not taken for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_rows_whose_ids_were_reused_survive_a_spool() {
    let db = TestDb::new("reuse_spool").await;
    let p = publisher();
    let relay = streaming(&db, quick_spool(&db), &p).await;
    let c = db.client().await;
    c.batch_execute("TRUNCATE outbox RESTART IDENTITY").await.unwrap();
    p.break_queue(Q, CallError::transport("connection refused"));
    c.batch_execute(
        "BEGIN;
         INSERT INTO outbox (event_id, destination, body) SELECT 'x:' || i, 'orders', 'x:' || i FROM generate_series(1, 1500) i;
         DELETE FROM outbox;
         COMMIT;
         ALTER TABLE outbox ALTER COLUMN id RESTART;",
    )
    .await
    .unwrap();
    insert_rows(&c, "y", "orders", 1_500, None).await;
    wait_for("the lane spools", Duration::from_secs(30), || async {
        relay.metrics.render().contains("outbox_relay_lane_spooled{destination=\"orders\"} 1")
    })
    .await;
    p.fix_queue(Q);
    let end = std::time::Instant::now() + Duration::from_secs(90);
    while std::time::Instant::now() < end && (bodies(&p, "x:").len() < 1_500 || bodies(&p, "y:").len() < 1_500) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (x, y) = (bodies(&p, "x:").len(), bodies(&p, "y:").len());
    let left: Vec<String> = c
        .query("SELECT format('%s %s %s', status, count(*), min(last_error)) FROM outbox GROUP BY status", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!((x, y), (1_500, 1_500), "in the table: {left:?}");
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
}

const FIFO: &str = "http://memory.invalid/orders.fifo";

/// A streaming relay whose FIFO queue fails; one transaction writes a FIFO
/// group's first 300 rows (`a:`) under ids from 1,000 and deletes them
/// (transient); the identity is reset. A later transaction writes the
/// group's next 300 (`b:`, [`write_next_rows`]) under ids from 1. The rows
/// wait in the table, and whatever drains them must send `a:` first: id
/// order would send `b:` first. Returns the publisher, the relay and a client.
async fn spooling_across_identity_reset(db: &TestDb) -> (MemoryPublisher, Running, tokio_postgres::Client) {
    let p = MemoryPublisher::new();
    p.add_queue(FIFO, true, 262_144);
    let relay = streaming(db, quick_spool_to(db, FIFO), &p).await;
    let c = db.client().await;
    p.break_queue(FIFO, CallError::transport("connection refused"));
    c.batch_execute(
        "ALTER TABLE outbox ALTER COLUMN id RESTART WITH 1000;
         BEGIN;
         INSERT INTO outbox (event_id, destination, body, group_key)
              SELECT 'a:' || i, 'orders', 'a:' || i, 'g' FROM generate_series(1, 300) i;
         DELETE FROM outbox WHERE event_id LIKE 'a:%';
         COMMIT;
         ALTER TABLE outbox ALTER COLUMN id RESTART;",
    )
    .await
    .unwrap();
    (p, relay, c)
}

/// The group's next 300 rows (`b:`), in one later transaction.
async fn write_next_rows(c: &tokio_postgres::Client) {
    c.batch_execute(
        "INSERT INTO outbox (event_id, destination, body, group_key)
              SELECT 'b:' || i, 'orders', 'b:' || i, 'g' FROM generate_series(1, 300) i",
    )
    .await
    .unwrap();
}

/// The group's 600 rows, sent once each, `a:1..300` then `b:1..300`.
async fn assert_commit_order(p: &MemoryPublisher) {
    wait_for("the group's 600 rows sent", Duration::from_secs(90), || async { p.sent(FIFO).len() >= 600 }).await;
    let bodies: Vec<String> = p.sent(FIFO).into_iter().map(|s| s.body).collect();
    let expected: Vec<String> = ["a", "b"].iter().flat_map(|t| (1..=300).map(move |i| format!("{t}:{i}"))).collect();
    let first_wrong = bodies.iter().zip(&expected).position(|(b, e)| b != e);
    assert!(
        bodies == expected,
        "sent {} rows, first out of order at {first_wrong:?}: {:?}",
        bodies.len(),
        first_wrong.map(|i| &bodies[i])
    );
}

/// A FIFO group spooled across an identity reset is drained in commit
/// order, not id order: the stream hands each row to the table with its
/// transaction's commit position, and the drain claims by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_group_spooled_across_an_identity_reset_keeps_its_order() {
    let db = TestDb::new("fifo_reset_spool").await;
    let (p, relay, c) = spooling_across_identity_reset(&db).await;
    write_next_rows(&c).await;
    wait_for("both transactions in the table", Duration::from_secs(30), || async {
        db.count("status = 'NEW' AND next_attempt_at IS NOT NULL").await == 600
    })
    .await;
    p.fix_queue(FIFO);
    assert_commit_order(&p).await;
    relay.stop().await;
}

/// The same group, its first rows spooled by a streaming relay, its next
/// ones written while no relay runs, then drained by a polling relay (the
/// fallback while a slot is repaired): the spooled rows, which committed
/// first, go first whatever their ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_sends_the_spooled_rows_of_a_fifo_group_first() {
    let db = TestDb::new("fifo_reset_poll").await;
    let (p, relay, c) = spooling_across_identity_reset(&db).await;
    wait_for("the first transaction written back", Duration::from_secs(30), || async {
        db.count("status = 'NEW' AND next_attempt_at IS NOT NULL AND event_id LIKE 'a:%'").await == 300
    })
    .await;
    relay.stop().await;
    write_next_rows(&c).await;
    let mut cfg = quick_spool_to(&db, FIFO);
    cfg.mode = outbox_relay::config::Mode::Polling;
    p.fix_queue(FIFO);
    let relay = start(cfg, Arc::new(p.clone()));
    assert_commit_order(&p).await;
    relay.stop().await;
}

/// What is sent is what was committed: a row inserted and then updated by
/// its own transaction goes out as updated (body, destination), a TOASTed
/// body the update left alone included, in CDC as in polling; in a
/// transaction past the chunk limits too (the update arrives after the
/// row's chunk was handed on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_updated_by_its_own_transaction_is_sent_as_committed() {
    const B: &str = "http://memory.invalid/billing";
    for mode in [outbox_relay::config::Mode::Cdc, outbox_relay::config::Mode::Polling] {
        let db = TestDb::new("same_txn").await;
        let p = publisher();
        p.add_queue(B, false, 262_144);
        let mut cfg = config(&db, &[("orders", Q), ("billing", B)]);
        cfg.mode = mode;
        let relay = start(cfg, Arc::new(p.clone()));
        if mode == outbox_relay::config::Mode::Cdc {
            wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
        }
        let big = "b".repeat(100_000);
        db.client()
            .await
            .batch_execute(&format!(
                "BEGIN;
                 INSERT INTO outbox (event_id, destination, body) VALUES ('u1', 'orders', 'v1'), ('u2', 'orders', '{big}');
                 UPDATE outbox SET body = 'v2', destination = 'billing' WHERE event_id = 'u1';
                 UPDATE outbox SET destination = 'billing' WHERE event_id = 'u2';
                 COMMIT;"
            ))
            .await
            .unwrap();
        wait_for("both rows sent", Duration::from_secs(30), || async { p.sent(B).len() >= 2 }).await;
        let sent = p.sent(B);
        let body = |e: &str| sent.iter().find(|s| s.event_id == e).map(|s| s.body.clone());
        assert_eq!(body("u1").as_deref(), Some("v2"), "{mode:?}");
        assert_eq!(body("u2").map(|b| b.len()), Some(100_000), "{mode:?}");
        assert!(p.sent(Q).is_empty(), "{mode:?}: nothing to the destination it was inserted with");
        // Past the chunk limits (1,000 rows): rows of the first chunk updated
        // after the transaction's 2,000th row.
        // Large bodies among them (read back only if changed): one changed
        // after its chunk, one not.
        db.client()
            .await
            .batch_execute(&format!(
                "BEGIN;
                 INSERT INTO outbox (event_id, destination, body) VALUES ('large:1', 'orders', '{big}'), ('large:2', 'orders', '{big}');
                 INSERT INTO outbox (event_id, destination, body)
                      SELECT 'big:' || i, 'orders', 'v1' FROM generate_series(1, 2500) i;
                 UPDATE outbox SET body = 'v2' WHERE event_id IN ('big:5', 'big:6', 'big:7');
                 UPDATE outbox SET body = 'v2', destination = 'billing' WHERE event_id = 'big:8';
                 UPDATE outbox SET body = 'c' || body WHERE event_id = 'large:2';
                 COMMIT;"
            ))
            .await
            .unwrap();
        wait_for("the big transaction sent", Duration::from_secs(30), || async { p.sent(Q).len() >= 2_501 }).await;
        let large = |e: &str| p.sent(Q).into_iter().find(|s| s.event_id == e).map(|s| s.body);
        assert_eq!(large("large:1").as_deref(), Some(big.as_str()), "{mode:?}: unchanged, sent as read");
        assert_eq!(large("large:2"), Some(format!("c{big}")), "{mode:?}: changed after its chunk, sent as committed");
        let (orders, billing) = (p.sent(Q), p.sent(B));
        let late: Vec<_> =
            orders.iter().filter(|s| ["big:5", "big:6", "big:7"].contains(&s.event_id.as_str())).collect();
        assert!(late.len() == 3 && late.iter().all(|s| s.body == "v2"), "{mode:?}: {late:?}");
        assert!(billing.iter().any(|s| s.event_id == "big:8" && s.body == "v2"), "{mode:?}");
        assert!(
            !orders.iter().any(|s| s.event_id == "big:8"),
            "{mode:?}: big:8 went to the destination it was inserted with"
        );
        relay.stop().await;
    }
}

/// Ids reused while streaming and between runs: `TRUNCATE ... RESTART
/// IDENTITY`, `ALTER COLUMN id RESTART`. Settlement records runs of the same
/// ids again, and the replay after a restart does not take the new rows for
/// the old, published ones. A second slot keeps the old runs from pruning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_ids_are_never_taken_for_published_ones() {
    let db = TestDb::new("reuse").await;
    let c = db.client().await;
    let hold = format!("{}_hold", db.slot);
    c.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&hold]).await.unwrap();
    let p = publisher();
    let relay = streaming(&db, config(&db, &[("orders", Q)]), &p).await;
    insert_rows(&c, "old", "orders", 300, None).await;
    wait_for("the first rows delivered", Duration::from_secs(30), || async { bodies(&p, "old:").len() == 300 }).await;
    // While streaming: the same ids again, twice.
    c.batch_execute("TRUNCATE outbox RESTART IDENTITY").await.unwrap();
    insert_rows(&c, "again", "orders", 300, None).await;
    wait_for("rows with reused ids delivered", Duration::from_secs(30), || async { bodies(&p, "again:").len() == 300 })
        .await;
    // An identity reset over rows still in the table fails on their ids, as
    // it would for an operator: reset once settlement has deleted them.
    wait_for("the reused rows settled", Duration::from_secs(30), || async { db.count("true").await == 0 }).await;
    c.batch_execute("ALTER TABLE outbox ALTER COLUMN id RESTART").await.unwrap();
    insert_rows(&c, "restart", "orders", 300, None).await;
    wait_for("rows after ALTER ... RESTART delivered", Duration::from_secs(30), || async {
        bodies(&p, "restart:").len() == 300
    })
    .await;
    relay.stop().await;
    // Between runs: committed before the next session starts, so replayed
    // through the filter, over ids every earlier run covers.
    c.batch_execute("TRUNCATE outbox RESTART IDENTITY").await.unwrap();
    insert_rows(&c, "replayed", "orders", 300, None).await;
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("replayed rows with reused ids delivered", Duration::from_secs(30), || async {
        bodies(&p, "replayed:").len() == 300
    })
    .await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
    c.execute("SELECT pg_drop_replication_slot($1)", &[&hold]).await.unwrap();
}

fn marking(published: PublishedRows) -> Marking {
    Marking { base: Duration::from_secs(1), max: Duration::from_secs(2), published, bound_unpositioned: true }
}

/// Row `id` (event `event_id`) as the stream read it, committed at `commit`
/// by a transaction long visible (xid 2, the frozen one).
fn read(id: i64, event_id: &str, commit: u64) -> Arc<OutboxEvent> {
    let commit = Commit { xid: 2, lsn: replication::Lsn(commit), seq: 0 };
    Arc::new(OutboxEvent {
        event_id: event_id.into(),
        destination: "orders".into(),
        body: event_id.into(),
        group_key: None,
        attributes: None,
        commit_time_us: 0,
        deliver_at: Default::default(),
        replay_of: None,
        origin: Origin::Own { id, commit: Some(commit) },
    })
}

/// A settlement of a row whose id another row has taken since (the old row
/// truncated, the identity reset) touches the new row in no way: published,
/// nothing is deleted; DEAD, the old row is written back under a new id with
/// its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_a_row_whose_id_was_reused_leaves_the_new_row_alone() {
    let db = TestDb::new("reuse_mark").await;
    let c = db.client().await;
    let lsn = |c: &tokio_postgres::Row| c.get::<_, i64>(0) as u64;
    let commit = lsn(&c.query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[]).await.unwrap());
    c.batch_execute(
        "INSERT INTO outbox (id, event_id, destination, body) OVERRIDING SYSTEM VALUE VALUES (7, 'new', 'orders', 'new')",
    )
    .await
    .unwrap();
    for published in [PublishedRows::Delete, PublishedRows::Keep] {
        let s = Settlement::new(read(7, "old", commit), None, Arc::from("orders"), Outcome::Published);
        mark(&c, &[s], marking(published), &mut Default::default()).await.unwrap();
        assert_eq!(db.count("id = 7 AND event_id = 'new' AND status = 'NEW'").await, 1, "{published:?}");
    }
    let dead = Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "refused"));
    let s = Settlement::new(read(7, "old", commit), None, Arc::from("orders"), dead);
    let report = mark(&c, &[s], marking(PublishedRows::Delete), &mut Default::default()).await.unwrap();
    assert_eq!(report.restored, 1, "{report:?}");
    assert_eq!(db.count("id = 7 AND event_id = 'new' AND status = 'NEW'").await, 1);
    assert_eq!(db.count("id <> 7 AND event_id = 'old' AND status = 'DEAD' AND last_error LIKE '%refused%'").await, 1);
    // The same settlement again (a replay) writes nothing twice.
    let dead = Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "refused"));
    let s = Settlement::new(read(7, "old", commit), None, Arc::from("orders"), dead);
    mark(&c, &[s], marking(PublishedRows::Delete), &mut Default::default()).await.unwrap();
    assert_eq!(db.count("event_id = 'old'").await, 1);
}

/// After `RESTART IDENTITY`, rows written back under their own ids sit
/// where the identity will give ids again: a row written back under a new id
/// that collides is written once the identity is moved past them, never
/// dropped (a deferred one would be lost: nothing else holds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_whose_new_id_is_taken_is_written_past_it() {
    let db = TestDb::new("reuse_new_id").await;
    let c = db.client().await;
    c.batch_execute(
        "TRUNCATE outbox RESTART IDENTITY;
         INSERT INTO outbox (id, event_id, destination, body) OVERRIDING SYSTEM VALUE
         SELECT i, 'own' || i, 'orders', 'x' FROM generate_series(1, 3) i;",
    )
    .await
    .unwrap();
    let mut batch = Vec::new();
    for (i, outcome) in
        [Outcome::Deferred("down".into(), Due::Backoff), Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "no"))]
            .into_iter()
            .enumerate()
    {
        let mut ev = (*read(0, &format!("public.t:{i}"), 1)).clone();
        let row = outbox_relay::event::MappedRow {
            table: std::sync::Arc::from("public.mapped"),
            key: i.to_string(),
            published: None,
            unreadable: None,
        };
        ev.origin = Origin::Mapped { row, commit: ev.commit().copied() };
        batch.push(Settlement::new(Arc::new(ev), None, Arc::from("orders"), outcome));
    }
    let report = mark(&c, &batch, marking(PublishedRows::Delete), &mut Default::default()).await.unwrap();
    assert_eq!(report.restored, 2, "{report:?}");
    assert_eq!(db.count("event_id LIKE 'public.t:%' AND id > 3").await, 2);
    assert_eq!(db.count("event_id LIKE 'own%'").await, 3);
}

/// A deferred row that is gone and that a run written after its commit
/// proves published is not written back; one no run proves is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_row_is_written_back_unless_proven_published() {
    let db = TestDb::new("proof").await;
    let c = db.client().await;
    // Before the runs below are written (their `lsn` is the insert position
    // then, which equals this one when nothing was written in between).
    let commit =
        c.query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[]).await.unwrap().get::<_, i64>(0) as u64
            - 1;
    // A run of rows committed at `commit` (and a later one, written after
    // `commit` too, of the same ids: rows that reused them).
    c.execute(
        "INSERT INTO outbox_published_runs (lo, hi, commit_lo, commit_hi)
         VALUES (10, 20, $1::text::pg_lsn, $1::text::pg_lsn), (10, 20, '7FFFFFFF/0', '7FFFFFFF/0'),
                (30, 40, NULL, NULL)",
        &[&replication::Lsn(commit).to_string()],
    )
    .await
    .unwrap();
    let deferred = || Outcome::Deferred("spooled".into(), outbox_relay::pipeline::settle::Due::Backoff);
    let batch = vec![
        Settlement::new(read(15, "proven", commit), None, Arc::from("orders"), deferred()),
        Settlement::new(read(25, "unproven", commit), None, Arc::from("orders"), deferred()),
        // Committed after the first run: that run is about an earlier row
        // with its id; the second covers rows committed later still.
        Settlement::new(read(12, "later", u64::MAX / 4), None, Arc::from("orders"), deferred()),
        // A run written by the table path: its id reused by a row published
        // from the table after this one's commit.
        Settlement::new(read(35, "reused", commit), None, Arc::from("orders"), deferred()),
    ];
    let report = mark(&c, &batch, marking(PublishedRows::Delete), &mut Default::default()).await.unwrap();
    assert_eq!((report.gone, report.restored), (1, 3), "{report:?}");
    assert_eq!(db.count("event_id IN ('unproven', 'later', 'reused') AND next_attempt_at IS NOT NULL").await, 3);
    assert_eq!(db.count("event_id = 'proven'").await, 0);
}

/// A listener that accepts connections and never answers: a frozen host.
async fn frozen_host() -> (u16, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (port, task)
}

/// `postgres://user@127.0.0.1:A,127.0.0.1:B/db`: `first` before the real server.
fn with_first_host(url: &str, first: u16) -> String {
    let (scheme_user, rest) = url.split_once('@').unwrap();
    format!("{scheme_user}@127.0.0.1:{first},{rest}")
}

/// Every SQL connection tries each host with a deadline of its own: a first
/// host that accepts TCP and never answers, or refuses, costs one deadline,
/// and the second host (the primary) is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_or_refusing_first_host_does_not_block_sql_connections() {
    let db = TestDb::new("hung_host").await;
    let (frozen, task) = frozen_host().await;
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let deadlines = outbox_relay::db::Deadlines { connect: Duration::from_secs(1), query: Duration::from_secs(5) };
    for first in [frozen, refused] {
        let url = with_first_host(&db.url, first);
        let started = std::time::Instant::now();
        let c = outbox_relay::db::Db::new(&url, deadlines).connect().await.unwrap_or_else(|e| panic!("{url}: {e}"));
        let one: i32 = c.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1);
        assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    }
    // Both hosts unusable: the error names each.
    let scheme_user = db.url.split_once('@').unwrap().0;
    let url = format!("{scheme_user}@127.0.0.1:{frozen},127.0.0.1:{refused}/{}", db.name);
    let err = outbox_relay::db::Db::new(&url, deadlines).connect().await.unwrap_err().to_string();
    assert!(err.contains(&format!(":{frozen}")) && err.contains(&format!(":{refused}")), "{err}");
    task.abort();
}

/// Under a steady load, a lane spooled by an outage streams again once its
/// sends succeed, without waiting for the writer to stop: rows spooled
/// because the lane was behind are due at once, and the spool drains beside
/// the stream (a standard queue: order does not matter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spooled_lane_streams_again_under_a_steady_load() {
    let db = TestDb::new("steady_spool").await;
    let p = publisher();
    let relay = streaming(&db, quick_spool(&db), &p).await;
    let spooled = |m: &str| m.contains("outbox_relay_lane_spooled{destination=\"orders\"} 1");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, stop) = (db.client().await, Arc::clone(&stop));
        tokio::spawn(async move {
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                insert_rows(&c, &format!("st{k}"), "orders", 10, None).await;
                k += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            k
        })
    };
    p.break_queue(Q, CallError::transport("connection refused"));
    wait_for("the lane spools", Duration::from_secs(30), || async { spooled(&relay.metrics.render()) }).await;
    p.fix_queue(Q);
    wait_for("the lane streams again while the writer writes", Duration::from_secs(30), || async {
        !spooled(&relay.metrics.render())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches = writer.await.unwrap();
    wait_for("every row delivered", Duration::from_secs(60), || async { bodies(&p, "st").len() == batches * 10 }).await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
}

/// A generated workload, seeded: transactions of persistent and transient
/// rows on both sides of the chunk limits (1,000 rows, 4 MiB), rows deleted
/// by their own transaction before and after their chunk was handed on,
/// several destinations (one FIFO), unknown destinations, queue outages,
/// bursts of throttled calls and entries over a round trip of a few
/// milliseconds (the lanes' adaptive limits growing and shrinking),
/// identity resets, relays killed without a goodbye and restarted (a
/// shard's relay now and then polling, the fallback, until its next
/// restart or the end),
/// PostgreSQL crashed or stopped and started again (each seed runs a server
/// of its own), rows due later (`deliver_at` in seconds, or in 20 minutes
/// and then moved by an UPDATE), and, for even seeds, two shards
/// (insert-only publications) instead of one relay; for odd seeds the one
/// relay maps Debezium's table and the topic-payload one (partitioned by
/// its key, published via its root, for seeds 1, 5, 9, ...), which an
/// operator renames, moves to another schema, drops a column of, lets the
/// key be NULL and takes grants from (the relay runs under a role with the
/// documented grants only) while producers write ([`workload::operate`]).
/// After it: every
/// committed row delivered or DEAD with its reason, none left NEW, none
/// visible before its `deliver_at`, each FIFO group in commit order, every
/// slot confirmed past the last commit.
///
/// The short run here takes two seeds of 20 steps; a long one:
/// `OUTBOX_RELAY_INVARIANT_SEEDS=1-50 OUTBOX_RELAY_INVARIANT_STEPS=80 cargo test --release
/// --features outbox-relay/test-utils --test it invariants::randomized -- --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_workloads_keep_every_invariant() {
    let seeds = std::env::var("OUTBOX_RELAY_INVARIANT_SEEDS").unwrap_or_else(|_| "1-2".into());
    let (lo, hi) = seeds.split_once('-').unwrap_or((&seeds, &seeds));
    let steps: usize = std::env::var("OUTBOX_RELAY_INVARIANT_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    for seed in lo.parse::<u64>().unwrap()..=hi.parse::<u64>().unwrap() {
        let started = std::time::Instant::now();
        let tally = workload::run(seed, steps).await;
        eprintln!("seed {seed}: {tally} in {:.1}s", started.elapsed().as_secs_f64());
    }
}

/// The same invariants with the release binary as a process of its own,
/// killed with SIGKILL at random moments (mid-send, mid-settle,
/// mid-confirm), against ministack, PostgreSQL crashed or stopped between,
/// SQS or S3 gone for a while (proxies taken down), the big rows' bodies
/// through S3 (queues of 1 KiB), and rows of 1.5-2.5 MiB, some deleted by
/// their own transaction ([`workload::produce_huge`]): every pointer
/// received resolves.
/// A relay that exits at start-up (the server down) is started again, as a
/// supervisor would. CI runs two seeds of 20 steps; a long run: `OUTBOX_RELAY_INVARIANT_SEEDS=1-8
/// OUTBOX_RELAY_INVARIANT_STEPS=60 cargo test --release --features
/// outbox-relay/test-utils --test it invariants::randomized_sigkills -- --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_sigkills_of_the_release_binary_keep_every_invariant() {
    let seeds = std::env::var("OUTBOX_RELAY_INVARIANT_SEEDS").unwrap_or_else(|_| "1-2".into());
    let (lo, hi) = seeds.split_once('-').unwrap_or((&seeds, &seeds));
    let steps: usize = std::env::var("OUTBOX_RELAY_INVARIANT_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    for seed in lo.parse::<u64>().unwrap()..=hi.parse::<u64>().unwrap() {
        let started = std::time::Instant::now();
        let tally = workload::run_processes(seed, steps).await;
        eprintln!("seed {seed} (SIGKILL): {tally} in {:.1}s", started.elapsed().as_secs_f64());
    }
}

mod workload {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::time::Instant;
    use testkit::process::{RelayConfig, RelayProcess};
    use testkit::proxy::Proxy;

    /// The in-process workload's destinations: queues, SNS topics (a
    /// standard one and a FIFO one, [`SUBSCRIBERS`] subscribed) and an
    /// EventBridge bus. The
    /// unsharded relay is configured with all but `t1` and `t2`, which it
    /// finds by its queue-URL template ([`TEMPLATE`]), on first use; the
    /// shards are configured with all.
    const QUEUES: [(&str, &str, bool); 8] = [
        ("a", "http://memory.invalid/a", false),
        ("b", "http://memory.invalid/b", false),
        ("f", "http://memory.invalid/f.fifo", true),
        ("t1", "http://memory.invalid/t1", false),
        ("t2", "http://memory.invalid/t2", false),
        ("s", "arn:aws:sns:r:1:s", false),
        ("sf", "arn:aws:sns:r:1:sf.fifo", true),
        ("e", "arn:aws:events:r:1:event-bus/e", false),
    ];

    /// Whether destination `d` is an event bus: its rows' bodies are JSON
    /// objects (the relay's table only: the mapped tables' producers write
    /// JSON strings, which a bus refuses).
    fn bus(d: &str) -> bool {
        QUEUES.iter().any(|(name, address, _)| *name == d && address.contains(":event-bus/"))
    }

    /// The queues subscribed to each topic of [`QUEUES`]: every event the
    /// topic takes reaches each of them.
    const SUBSCRIBERS: [(&str, &str); 3] = [
        ("arn:aws:sns:r:1:s", "http://memory.invalid/s-sub1"),
        ("arn:aws:sns:r:1:s", "http://memory.invalid/s-sub2"),
        ("arn:aws:sns:r:1:sf.fifo", "http://memory.invalid/sf-sub.fifo"),
    ];

    /// Whether destination `d` keeps order per group (and needs group keys).
    fn ordered(d: &str) -> bool {
        QUEUES.iter().any(|(name, _, fifo)| *name == d && *fifo)
    }
    const TEMPLATE: &str = "http://memory.invalid/{destination}";

    /// The end of a big row's event id: its body is 100 kB.
    const BIG: &str = ":big";

    /// Queue `b`'s `MaximumMessageSize` once lowered under the relays: big
    /// rows no longer fit.
    const LOWERED: usize = 65_536;

    /// What the workload committed, and what became of it.
    #[derive(Default)]
    pub struct Tally {
        delivered: usize,
        dead: usize,
        transient: usize,
        failed_txns: usize,
        outages: usize,
        restarts: usize,
        pg_restarts: usize,
        /// Relays that exited at start-up, the server down, and were
        /// started again as a supervisor would.
        supervised: usize,
        resets: usize,
        /// Rows with a `deliver_at`, and held rows moved by an UPDATE.
        delayed: usize,
        moved: usize,
        /// Messages received through S3 (the SIGKILL variant), and rows of
        /// 1.5-2.5 MiB among them.
        offloaded: usize,
        huge: usize,
        /// Bursts of throttled calls and entries (the lanes' limits shrink).
        throttles: usize,
        /// Rows of the mapped (Debezium) table.
        mapped: usize,
        /// Events the topics took (the in-process variant), each on every
        /// queue subscribed.
        topics: usize,
        /// Events the bus took (the in-process variant).
        buses: usize,
        /// Big rows DEAD `too_large` once queue `b`'s size limit was
        /// lowered under the relays (the in-process variant).
        too_large: usize,
        /// Events replayed (`outbox-relay replay`, published rows kept: the
        /// in-process variant's seeds 1, 5, 9, ...), each sent again.
        replayed: usize,
        /// Relays started again in the other mode, polling or CDC.
        mode_switches: usize,
        /// What an operator did to the mapped tables ([`operate`]).
        operations: usize,
    }

    impl std::fmt::Display for Tally {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "{} delivered ({} transient, {} from a mapped table, {} to topics, {} to a bus, {} with a deliver_at, {} of them moved, {} messages through S3, {} of 1.5-2.5 MiB), {} DEAD with their reason, {} of them too large for a lowered limit; {} outages, {} relay kills, {} PostgreSQL restarts ({} relays started again after exiting at start-up), {} identity resets, {} throttling bursts, {} switches between CDC and polling, {} operator actions on mapped tables, {} producer transactions refused, {} events replayed",
                self.delivered, self.transient, self.mapped, self.topics, self.buses, self.delayed, self.moved, self.offloaded, self.huge, self.dead, self.too_large, self.outages, self.restarts, self.pg_restarts, self.supervised, self.resets, self.throttles, self.mode_switches, self.operations, self.failed_txns, self.replayed
            )
        }
    }

    /// Every row held until a `deliver_at` more than a minute away is moved
    /// to a second from now (an UPDATE, as a producer would); the rows moved
    /// and their new due times (none if the server is away).
    async fn move_held(c: &tokio_postgres::Client) -> Vec<(String, SystemTime)> {
        let sql = "UPDATE outbox SET deliver_at = now() + interval '1 second'
                    WHERE status = 'NEW' AND deliver_at > now() + interval '1 minute'
                RETURNING event_id, deliver_at";
        c.query(sql, &[]).await.map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect()).unwrap_or_default()
    }

    /// No message went out before its row's `deliver_at` (as last moved):
    /// taken at `at` with `DelaySeconds`, it is visible from `at + delay`.
    fn none_early(p: &MemoryPublisher, committed: &[Row], moved: &HashMap<String, SystemTime>, seed: u64) {
        let due: HashMap<&str, SystemTime> =
            committed.iter().filter_map(|r| Some((r.0.as_str(), moved.get(&r.0).copied().or(r.3)?))).collect();
        let slack = Duration::from_millis(50);
        for s in QUEUES.iter().flat_map(|(_, q, _)| p.sent(q)) {
            let Some(due) = due.get(s.event_id.as_str()) else { continue };
            let visible = s.at + Duration::from_secs(s.delay_seconds.unwrap_or(0).into());
            assert!(
                visible + slack >= *due,
                "seed {seed}: {} visible {:?} before its deliver_at",
                s.event_id,
                due.duration_since(visible)
            );
        }
    }

    /// FIFO order per group: on each FIFO destination (the queue, the
    /// topic and the queue subscribed to it), the first send of each row
    /// of a group comes after the first send of every row committed before
    /// it in that group (rows with a `deliver_at` keep no order, by design;
    /// nor do transient rows committed while a relay polled, `unseen`:
    /// polling cannot see them, and they are sent once streaming resumes).
    fn fifo_order_kept(p: &MemoryPublisher, committed: &[Row], unseen: &HashSet<String>, seed: u64) {
        let fifo = QUEUES.iter().filter(|q| q.2).map(|(d, url, _)| (*d, *url));
        let subscribed = SUBSCRIBERS.iter().filter(|(_, q)| q.ends_with(".fifo")).map(|(_, q)| ("sf", *q));
        for (d, f) in fifo.chain(subscribed) {
            order_kept_on(p, committed, unseen, (d, f), seed);
        }
    }

    /// [`fifo_order_kept`] for destination `d`'s rows, as `f` received them.
    fn order_kept_on(
        p: &MemoryPublisher,
        committed: &[Row],
        unseen: &HashSet<String>,
        (d, f): (&str, &str),
        seed: u64,
    ) {
        let order: HashMap<&str, usize> = committed
            .iter()
            .filter(|r| r.3.is_none() && r.1 == d && !unseen.contains(&r.0))
            .enumerate()
            .map(|(i, r)| (r.0.as_str(), i))
            .collect();
        let mut first_seen: HashSet<String> = HashSet::new();
        let mut last_in_group: HashMap<String, (usize, String)> = HashMap::new();
        for s in p.sent(f) {
            let Some(&i) = order.get(s.event_id.as_str()) else { continue };
            if !first_seen.insert(s.event_id.clone()) {
                continue; // a resend: at least once
            }
            let group = s.group_id.clone().unwrap_or_default();
            if let Some((before, id)) = last_in_group.get(&group) {
                if *before >= i {
                    let how = |e: &str| committed.iter().find(|r| r.0 == e).map(|r| r.2);
                    let sends: Vec<String> = p
                        .sent(f)
                        .iter()
                        .filter(|x| x.group_id.as_deref() == Some(group.as_str()))
                        .map(|x| format!("{}#{:?}", x.event_id, x.outbox_id))
                        .collect();
                    panic!(
                        "seed {seed}: group {group}: {id} (transient {:?}) sent before {} (transient {:?}), committed earlier; the group's sends: {sends:?}",
                        how(id), s.event_id, how(&s.event_id)
                    );
                }
            }
            last_in_group.insert(group, (i, s.event_id));
        }
    }

    /// Every event a topic took reached each queue subscribed to it, and
    /// nothing else did; how many events the topics took.
    fn every_subscriber_has_every_event(p: &MemoryPublisher, seed: u64) -> usize {
        let took = |address: &str| -> HashSet<String> { p.sent(address).into_iter().map(|s| s.event_id).collect() };
        for (topic, queue) in SUBSCRIBERS {
            assert_eq!(
                took(queue),
                took(topic),
                "seed {seed}: {queue} subscribed to {topic}: every event the topic took, no other"
            );
        }
        QUEUES.iter().filter(|(_, a, _)| a.starts_with("arn:aws:sns:")).map(|(_, a, _)| took(a).len()).sum()
    }

    /// The relays of one run: one for every destination, or two shards.
    struct Relays {
        configs: Vec<outbox_relay::config::Config>,
        running: Vec<Option<Running>>,
        /// Started in polling mode (the operator's fallback, the slot kept)
        /// rather than CDC.
        polling: Vec<bool>,
    }

    impl Relays {
        fn start(&mut self, i: usize, p: &MemoryPublisher) {
            let mut cfg = self.configs[i].clone();
            if self.polling[i] {
                cfg.mode = outbox_relay::config::Mode::Polling;
            }
            self.running[i] = Some(start(cfg, Arc::new(p.clone())));
        }

        /// Every relay streaming again (a slot is confirmed past the last
        /// commit only by a stream). Returns how many were switched.
        async fn all_streaming(&mut self, p: &MemoryPublisher) -> usize {
            let mut switched = 0;
            for i in 0..self.running.len() {
                if std::mem::take(&mut self.polling[i]) {
                    if let Some(r) = self.running[i].take() {
                        r.abort();
                    }
                    self.start(i, p);
                    switched += 1;
                }
            }
            switched
        }

        /// Do what a supervisor does (systemd's `Restart=on-failure`): start
        /// again a relay that exited because it could not reach PostgreSQL
        /// at start-up (started while the server was down), or that refused
        /// a mapped table's key while an operator let it be NULL for a
        /// moment ([`operate`]); any other end is a failure. Returns how
        /// many were started again.
        async fn supervise(&mut self, p: &MemoryPublisher, when: &str) -> usize {
            let mut restarted = 0;
            for i in 0..self.running.len() {
                let Some(how) = self.running[i].as_mut().unwrap().ended().await else { continue };
                let expected = how.starts_with("cannot connect to PostgreSQL") || how.contains("may be NULL");
                assert!(expected, "{when}: relay {i} ended: {how}");
                self.start(i, p);
                restarted += 1;
            }
            restarted
        }
    }

    async fn relays(db: &TestDb, sharded: bool, keep: bool, archive: Option<&ArchiveConfig>) -> Relays {
        let all: Vec<(&str, &str)> = QUEUES.iter().map(|(d, q, _)| (*d, *q)).collect();
        let mut configs = Vec::new();
        let groups: Vec<Vec<(&str, &str)>> =
            if sharded { vec![all[..2].to_vec(), all[2..].to_vec()] } else { vec![all] };
        for (i, g) in groups.iter().enumerate() {
            let mut cfg = config(db, g);
            if !sharded {
                cfg.destinations.retain(|d, _| !d.starts_with('t'));
                cfg.destination_template =
                    Some(outbox_relay::publish::template::AddressTemplate::new(TEMPLATE, "r").unwrap());
            }
            cfg.lane_stall_timeout = Duration::from_secs(1);
            cfg.retry_base = Duration::from_millis(200);
            cfg.retry_max = Duration::from_secs(1);
            // Lanes close when idle and open again under the workload.
            cfg.lane_idle_timeout = Duration::from_millis(300);
            // Spool drains take turns on two connections.
            cfg.max_table_connections = 2;
            if keep {
                cfg.published_rows = PublishedRows::Keep;
            }
            cfg.archive = archive.cloned();
            if !sharded {
                // Debezium's table beside the relay's own ([`produce_debezium`]).
                use outbox_relay::mapping::{Mapping, Preset};
                cfg.mapped = vec![
                    Mapping::preset(Preset::Debezium, "app", "outboxevent"),
                    Mapping::preset(Preset::TopicPayload, "public", "outbox_messages"),
                ];
            }
            if !sharded {
                // The single relay runs under a role with only the grants
                // docs/configuration.md lists, so an operator's REVOKE
                // ([`operate`]) bites.
                cfg.database_url = least_privilege_role(db).await;
            }
            if sharded {
                cfg.publication = format!("outbox_shard{i}");
                cfg.slot = format!("{}_{i}", db.slot);
                outbox_relay::ops::slot_create(&cfg).await.unwrap();
            }
            configs.push(cfg);
        }
        let running = configs.iter().map(|_| None).collect();
        let polling = vec![false; configs.len()];
        Relays { configs, running, polling }
    }

    /// The role of the single relay, with the grants docs/configuration.md
    /// lists (\"Least privilege\" and \"Mapped tables\") and nothing
    /// more; its connection URL.
    async fn least_privilege_role(db: &TestDb) -> String {
        db.client()
            .await
            .batch_execute(
                "CREATE ROLE relay LOGIN REPLICATION;
                 GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO relay;
                 GRANT SELECT, INSERT, DELETE ON outbox_published_runs TO relay;
                 GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO relay;
                 GRANT SELECT, INSERT, UPDATE ON outbox_relay_sources TO relay;
                 GRANT USAGE ON SCHEMA app TO relay;
                 GRANT SELECT ON app.outboxevent, outbox_messages TO relay;
                 GRANT UPDATE (published_at) ON outbox_messages TO relay;",
            )
            .await
            .unwrap();
        db.url.replacen("postgres@", "relay@", 1)
    }

    /// A committed row: event id, destination, transient, and its
    /// `deliver_at` if it has one.
    type Row = (String, String, bool, Option<SystemTime>);

    /// One producer transaction: `n` rows, some deleted by it (transient),
    /// some big, and (`delays`) some due later: in a few seconds (sent with
    /// `DelaySeconds`, or held on the FIFO queue) or in 20 minutes (held in
    /// the table until a step moves them). Returns the committed rows, or
    /// nothing if the server refused it.
    async fn produce(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        tag: &str,
        dests: &[&str],
        delays: bool,
    ) -> Option<Vec<Row>> {
        let n = match rng.random_range(0..10) {
            0 => rng.random_range(1_000..1_300),
            1 => rng.random_range(40..50),
            _ => rng.random_range(1..30),
        };
        let big = n < 50 && rng.random_bool(0.3);
        let transient_share = [0.0, 0.5, 1.0][rng.random_range(0..3)];
        // A big row's event id says so ([`BIG`]).
        let big_mark = if big { BIG } else { "" };
        let rows: Vec<(String, String, bool)> = (0..n)
            .map(|i| {
                let d = dests[rng.random_range(0..dests.len())].to_string();
                (format!("{tag}:{i}{big_mark}"), d, rng.random_bool(transient_share))
            })
            .collect();
        let ids: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
        let ds: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
        let gone: Vec<&str> = rows.iter().filter(|r| r.2).map(|r| r.0.as_str()).collect();
        let pad = if big { 100_000 } else { 0 };
        let due = match rng.random_range(0..if delays { 8 } else { 1 }) {
            1 => Some(SystemTime::now() + Duration::from_millis(rng.random_range(500..3_000))),
            2 => Some(SystemTime::now() + Duration::from_secs(20 * 60)),
            _ => None,
        };
        let tx = c.transaction().await.ok()?;
        tx.execute(
            "INSERT INTO outbox (event_id, destination, body, group_key, deliver_at)
             SELECT e, d, CASE WHEN d = 'e' THEN json_build_object('e', e, 'pad', repeat('.', $3))::text ELSE e || repeat('.', $3) END,
                    CASE WHEN d IN ('f', 'sf') THEN 'g' || (length(e) % 3) END, $4
               FROM unnest($1::text[], $2::text[]) AS u(e, d)",
            &[&ids, &ds, &pad, &due],
        )
        .await
        .ok()?;
        if !gone.is_empty() {
            tx.execute("DELETE FROM outbox WHERE event_id = ANY($1)", &[&gone]).await.ok()?;
        }
        tx.commit().await.ok()?;
        Some(rows.into_iter().map(|(e, d, t)| (e, d, t, due)).collect())
    }

    /// A transaction of one to three rows of 1.5-2.5 MiB (huge: through S3,
    /// counted twice, handed on alone the moment each is decoded, and taking
    /// room in the relay's budget on the table path), to `a` or the FIFO
    /// queue `f`, some deleted by their own transaction after the next row
    /// was written (handed on before their delete is seen).
    async fn produce_huge(c: &mut tokio_postgres::Client, rng: &mut StdRng, tag: &str) -> Option<Vec<Row>> {
        let n = rng.random_range(1..=3);
        let rows: Vec<(String, String, bool, i32)> = (0..n)
            .map(|i| {
                let d = ["a", "f"][rng.random_range(0..2)].to_string();
                (format!("{tag}:{i}:huge"), d, rng.random_bool(0.3), rng.random_range(1_500_000..2_600_000))
            })
            .collect();
        let tx = c.transaction().await.ok()?;
        for (e, d, _, pad) in &rows {
            tx.execute(
                "INSERT INTO outbox (event_id, destination, body, group_key)
                 VALUES ($1, $2, $1 || repeat('.', $3), CASE WHEN $2 = 'f' THEN 'g' || (length($1) % 3) END)",
                &[e, d, pad],
            )
            .await
            .ok()?;
        }
        let gone: Vec<&str> = rows.iter().filter(|r| r.2).map(|r| r.0.as_str()).collect();
        if !gone.is_empty() {
            tx.execute("DELETE FROM outbox WHERE event_id = ANY($1)", &[&gone]).await.ok()?;
        }
        tx.commit().await.ok()?;
        Some(rows.into_iter().map(|(e, d, t, _)| (e, d, t, None)).collect())
    }

    /// Debezium's outbox table, mapped by the single relay of [`run`]
    /// (without a primary key, REPLICA IDENTITY FULL, so that an operator
    /// can let its key be NULL: [`operate`]). Its
    /// FIFO groups are its own: a group fed by two tables keeps no order
    /// across them once its lane spools (a row copied into the relay's
    /// table takes a new id, after rows of the relay's own committed later).
    async fn debezium_table(db: &TestDb) {
        db.client()
            .await
            .batch_execute(
                "CREATE SCHEMA app;
                 CREATE TABLE app.outboxevent (id uuid NOT NULL, aggregatetype text NOT NULL,
                     aggregateid text NOT NULL, type text NOT NULL, payload jsonb, tracingspancontext text);
                 CREATE INDEX ON app.outboxevent (id);
                 ALTER TABLE app.outboxevent REPLICA IDENTITY FULL;
                 ALTER PUBLICATION outbox_relay ADD TABLE app.outboxevent;",
            )
            .await
            .unwrap();
    }

    /// The `topic-payload` table partitioned by its key (retention by
    /// range, as partitioned outboxes are), published via its root: its
    /// rows cross from one partition to the next as the workload writes.
    async fn partitioned_topic_payload_table(db: &TestDb) {
        db.client()
            .await
            .batch_execute(
                "CREATE TABLE outbox_messages (
                     id bigserial, topic text NOT NULL, payload jsonb NOT NULL, published_at timestamptz,
                     PRIMARY KEY (id)) PARTITION BY RANGE (id);
                 CREATE TABLE outbox_messages_1 PARTITION OF outbox_messages FOR VALUES FROM (MINVALUE) TO (500);
                 CREATE TABLE outbox_messages_2 PARTITION OF outbox_messages FOR VALUES FROM (500) TO (3000);
                 CREATE TABLE outbox_messages_3 PARTITION OF outbox_messages FOR VALUES FROM (3000) TO (MAXVALUE);
                 CREATE INDEX ON outbox_messages (id) WHERE published_at IS NULL;
                 ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = true);
                 ALTER PUBLICATION outbox_relay ADD TABLE outbox_messages;",
            )
            .await
            .unwrap();
    }

    /// One producer transaction on the `topic-payload` table: `n` rows to
    /// standard queues (the preset has no group) or nowhere, a few inserted
    /// as published already (`{"pre": true}`: never to be sent). The rows
    /// to send, under their event ids (`body_ids`: their bodies as sent).
    async fn produce_topic_payload(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        tag: &str,
        dests: &[&str],
        body_ids: bool,
    ) -> Option<Vec<Row>> {
        produce_topic_payload_into(c, rng, "outbox_messages", tag, dests, body_ids).await
    }

    /// [`produce_topic_payload`] into `table` (the table moved to another
    /// schema by [`operate`]); its event ids keep the configured name.
    async fn produce_topic_payload_into(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        table: &str,
        tag: &str,
        dests: &[&str],
        body_ids: bool,
    ) -> Option<Vec<Row>> {
        let n = if rng.random_range(0..8) == 0 { rng.random_range(600..900) } else { rng.random_range(1..30) };
        let tags: Vec<String> = (0..n).map(|i| format!("{tag}:{i}")).collect();
        let ds: Vec<&str> = (0..n).map(|_| dests[rng.random_range(0..dests.len())]).collect();
        let pre: Vec<bool> = (0..n).map(|_| rng.random_bool(0.05)).collect();
        let tx = c.transaction().await.ok()?;
        let ids: Vec<i64> = tx
            .query(
                &format!(
                    "INSERT INTO {table} (topic, payload, published_at)
                     SELECT d, CASE WHEN p THEN jsonb_build_object('e', e, 'pre', true) ELSE to_jsonb(e) END,
                            CASE WHEN p THEN now() END
                       FROM unnest($1::text[], $2::text[], $3::bool[]) WITH ORDINALITY AS u(e, d, p, o) ORDER BY o
                     RETURNING id"
                ),
                &[&tags, &ds, &pre],
            )
            .await
            .ok()?
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.commit().await.ok()?;
        let name = |i: usize, id: i64| {
            if body_ids {
                format!("\"{}\"", tags[i])
            } else {
                format!("public.outbox_messages:{id}")
            }
        };
        let rows = ids.into_iter().zip(ds).enumerate().filter(|(i, _)| !pre[*i]);
        Some(rows.map(|(i, (id, d))| (name(i, id), d.to_string(), false, None)).collect())
    }

    /// Every `topic-payload` row has its `published_at` set, and none
    /// inserted as published already was sent (`sent`: event ids or bodies).
    async fn topic_payload_settled(db: &TestDb, sent: &HashSet<String>, seed: u64) {
        let c = db.client().await;
        wait_for(&format!("seed {seed}: every topic-payload row published"), Duration::from_secs(60), || async {
            let n: i64 = c
                .query_one("SELECT count(*) FROM outbox_messages WHERE published_at IS NULL", &[])
                .await
                .unwrap()
                .get(0);
            n == 0
        })
        .await;
        let pre: Vec<(String, String)> = c
            .query(
                "SELECT 'public.outbox_messages:' || id, payload::text FROM outbox_messages WHERE payload ? 'pre'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let resent: Vec<&(String, String)> = pre.iter().filter(|(e, b)| sent.contains(e) || sent.contains(b)).collect();
        assert!(resent.is_empty(), "seed {seed}: rows inserted as published were sent: {resent:?}");
    }

    /// One producer transaction on Debezium's table: `n` events, most
    /// deleted by it (the convention), some kept (a table that is never
    /// emptied). The committed rows under the event ids the relay gives them.
    /// `body_ids`: each row is named by its body as sent (the JSON string of
    /// its tag) instead of its event id, for a variant that reads messages
    /// from a queue.
    async fn produce_debezium(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        tag: &str,
        dests: &[&str],
        body_ids: bool,
    ) -> Option<Vec<Row>> {
        produce_debezium_into(c, rng, ("app.outboxevent", true), tag, dests, body_ids).await
    }

    /// [`produce_debezium`] into `table.0` (renamed by [`operate`]; the
    /// event ids keep the configured name), with the span-context column
    /// if `table.1` (dropped for a while by [`operate`]).
    async fn produce_debezium_into(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        (table, traced): (&str, bool),
        tag: &str,
        dests: &[&str],
        body_ids: bool,
    ) -> Option<Vec<Row>> {
        let n = if rng.random_range(0..8) == 0 { rng.random_range(1_000..1_300) } else { rng.random_range(1..40) };
        let tags: Vec<String> = (0..n).map(|i| format!("{tag}:{i}")).collect();
        let ds: Vec<&str> = (0..n).map(|_| dests[rng.random_range(0..dests.len())]).collect();
        let kept: HashSet<usize> = (0..n).filter(|_| rng.random_bool(0.2)).collect();
        let tx = c.transaction().await.ok()?;
        let ids: Vec<String> = tx
            .query(
                // A third traced (Debezium's span context), a third with a
                // context that holds no traceparent, a third without.
                &if traced {
                    format!(
                        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, tracingspancontext)
                         SELECT gen_random_uuid(), d, 'm' || (length(e) % 3), 'Created', to_jsonb(e),
                                CASE o % 3 WHEN 0 THEN E'#Sun Dec 06 22:00:00 UTC 2026\ntraceparent=00-' || md5(e) || '-00f067aa0ba902b7-01\n'
                                           WHEN 1 THEN 'uber-trace-id=' || md5(e) ELSE NULL END
                           FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(e, d, o) ORDER BY o
                         RETURNING id::text"
                    )
                } else {
                    format!(
                        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload)
                         SELECT gen_random_uuid(), d, 'm' || (length(e) % 3), 'Created', to_jsonb(e)
                           FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(e, d, o) ORDER BY o
                         RETURNING id::text"
                    )
                },
                &[&tags, &ds],
            )
            .await
            .ok()?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let gone: Vec<&str> =
            ids.iter().enumerate().filter(|(i, _)| !kept.contains(i)).map(|(_, id)| id.as_str()).collect();
        tx.execute(&format!("DELETE FROM {table} WHERE id = ANY($1::text[]::uuid[])"), &[&gone]).await.ok()?;
        tx.commit().await.ok()?;
        let name =
            |i: usize, id: String| if body_ids { format!("\"{}\"", tags[i]) } else { format!("app.outboxevent:{id}") };
        let rows = ids.into_iter().zip(ds).enumerate();
        Some(rows.map(|(i, (id, d))| (name(i, id), d.to_string(), !kept.contains(&i), None)).collect())
    }

    /// The destination the workload gives rows its mapping cannot read (a
    /// NULL key, [`operate`]): each must end DEAD `unreadable_row`, named
    /// by its body (its event id is the relay's to make).
    const UNREADABLE: &str = "unreadable";

    /// What an operator does to the mapped tables while producers write
    /// (one of, at random): rename Debezium's table and move the
    /// topic-payload one to another schema, a transaction written to each
    /// under the new names, then both put back; drop the optional span
    /// context column, write, add it again; let the key be NULL and write
    /// rows with and without one, then delete the keyless ones (DEAD in the
    /// relay's table by then, or on their way) and make the key NOT NULL
    /// again. The committed rows, as the producers' own.
    pub(super) async fn operate(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        tag: &str,
        dests: &[&str],
    ) -> Option<Vec<Row>> {
        let standard: Vec<&str> = dests.iter().copied().filter(|d| !ordered(d)).collect();
        match rng.random_range(0..4) {
            0 => {
                c.batch_execute(
                    "ALTER TABLE app.outboxevent RENAME TO outboxevent_v2;
                     CREATE SCHEMA IF NOT EXISTS moved; ALTER TABLE public.outbox_messages SET SCHEMA moved;",
                )
                .await
                .ok()?;
                let mut rows =
                    produce_debezium_into(c, rng, ("app.outboxevent_v2", true), &format!("{tag}r"), dests, false)
                        .await
                        .unwrap_or_default();
                let moved_tag = format!("{tag}m");
                let moved = produce_topic_payload_into(c, rng, "moved.outbox_messages", &moved_tag, &standard, false);
                rows.extend(moved.await.unwrap_or_default());
                c.batch_execute(
                    "ALTER TABLE app.outboxevent_v2 RENAME TO outboxevent;
                     ALTER TABLE moved.outbox_messages SET SCHEMA public;",
                )
                .await
                .unwrap();
                Some(rows)
            }
            1 => {
                // The relay may neither read Debezium's table nor mark the
                // topic-payload one until the next such step gives the
                // grants back (or the end of the run: [`grant_back`]),
                // whatever happens meanwhile (kills, restarts).
                let revoked = "SELECT NOT has_table_privilege('relay', 'app.outboxevent', 'SELECT')";
                let give_back = c.query_one(revoked, &[]).await.ok()?.get::<_, bool>(0);
                if give_back {
                    grant_back(c).await;
                } else {
                    c.batch_execute(
                        "REVOKE SELECT ON app.outboxevent FROM relay;
                         REVOKE UPDATE (published_at) ON outbox_messages FROM relay;",
                    )
                    .await
                    .ok()?;
                }
                let mut rows = produce_debezium(c, rng, tag, dests, false).await.unwrap_or_default();
                let revoked_tag = format!("{tag}g");
                let more = produce_topic_payload_into(c, rng, "outbox_messages", &revoked_tag, &standard, false);
                rows.extend(more.await.unwrap_or_default());
                Some(rows)
            }
            2 => {
                c.batch_execute("ALTER TABLE app.outboxevent DROP COLUMN tracingspancontext").await.ok()?;
                let rows = produce_debezium_into(c, rng, ("app.outboxevent", false), tag, dests, false).await;
                c.batch_execute("ALTER TABLE app.outboxevent ADD COLUMN tracingspancontext text").await.unwrap();
                rows
            }
            _ => {
                c.batch_execute("ALTER TABLE app.outboxevent ALTER COLUMN id DROP NOT NULL").await.ok()?;
                let n = rng.random_range(1..5);
                let tags: Vec<String> = (0..n).map(|i| format!("{tag}k:{i}")).collect();
                let d = dests[rng.random_range(0..dests.len())];
                let keyless = c
                    .execute(
                        "INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
                         SELECT NULL, $2, 'm0', 'Created', to_jsonb(e) FROM unnest($1::text[]) e",
                        &[&tags, &d],
                    )
                    .await
                    .is_ok();
                let mut rows = produce_debezium(c, rng, tag, dests, false).await.unwrap_or_default();
                c.batch_execute(
                    "DELETE FROM app.outboxevent WHERE id IS NULL;
                     ALTER TABLE app.outboxevent ALTER COLUMN id SET NOT NULL;",
                )
                .await
                .unwrap();
                if keyless {
                    rows.extend(tags.iter().map(|t| (format!("\"{t}\""), UNREADABLE.to_string(), false, None)));
                }
                Some(rows)
            }
        }
    }

    /// The grants [`operate`] took from the single relay, given back.
    async fn grant_back(c: &tokio_postgres::Client) {
        c.batch_execute(
            "GRANT SELECT ON app.outboxevent TO relay;
             GRANT UPDATE (published_at) ON outbox_messages TO relay;",
        )
        .await
        .unwrap();
    }

    /// Every row of `expect` (bodies of keyless rows) is DEAD
    /// `unreadable_row` in the relay's table, once, with the fix.
    async fn unreadable_dead(db: &TestDb, expect: &HashSet<&str>, seed: u64) {
        let bodies: Vec<&str> = expect.iter().copied().collect();
        let c = db.client().await;
        let sql = "SELECT count(*) FROM outbox WHERE status = 'DEAD' AND body = ANY($1)
                     AND last_error LIKE 'unreadable_row: app.outboxevent: a row without its key column \"id\"%SET NOT NULL%'";
        wait_for(&format!("seed {seed}: keyless rows DEAD with their reason"), Duration::from_secs(60), || async {
            c.query_one(sql, &[&bodies]).await.unwrap().get::<_, i64>(0) == bodies.len() as i64
        })
        .await;
    }

    /// One relay process, started again when it ends (a kill, or an exit
    /// at start-up while the server was down).
    struct Supervised {
        config: RelayConfig,
        process: Option<RelayProcess>,
        /// Exits it was started again after (not kills).
        exits: usize,
    }

    impl Supervised {
        fn keep_running(&mut self) {
            let exited = match self.process.as_mut() {
                None => true,
                Some(p) => matches!(p.child.try_wait(), Ok(Some(_))),
            };
            if exited {
                if self.process.is_some() {
                    self.exits += 1;
                }
                self.process = Some(self.config.spawn());
            }
        }

        fn kill(&mut self) {
            if let Some(p) = self.process.take() {
                p.kill();
            }
        }
    }

    /// [`run`] with the release binary, killed by SIGKILL, and ministack.
    pub async fn run_processes(seed: u64, steps: usize) -> Tally {
        let mut rng = StdRng::seed_from_u64(seed);
        let dir = ClusterDir::new(&format!("outbox-relay-sigkill{seed}"));
        let node = Node::init(&dir.0, "pg");
        node.start(&[]);
        let _stop = StopOnDrop(&node);
        let db = TestDb::on(&node.url("postgres"), &format!("sigkill{seed}")).await;
        let sqs = sqs().await;
        // Queues of 1 KiB: the big rows' bodies go through S3. SQS and S3
        // are reached through proxies the workload takes down.
        let (a, f) =
            (create_queue(&sqs, "sk_a", false, Some(1024)).await, create_queue(&sqs, "sk_f", true, Some(1024)).await);
        let upstream = stack().sqs_url.trim_start_matches("http://").to_string();
        let (sqs_proxy, s3_proxy) = (Proxy::start(&upstream).await, Proxy::start(&upstream).await);
        let bucket = create_bucket("sigkill").await;
        // Debezium's table and the topic-payload one too, mapped in the
        // file ([`produce_debezium`], [`produce_topic_payload`]); rows of the
        // latter written before the slot exists are caught up.
        debezium_table(&db).await;
        crate::topic_payload::topic_payload_table(&db, true).await;
        let mut c = db.client().await;
        let before_slot = produce_topic_payload(&mut c, &mut rng, &format!("k{seed}pre"), &["a"], true).await.unwrap();
        // Every published event archived, through the same proxy: an S3
        // outage holds settlement back, never loses an archived event.
        let archive = ArchiveConfig {
            bucket: create_bucket("skarchive").await,
            key_prefix: "sk/".into(),
            endpoint_url: Some(stack().sqs_url.clone()),
            window: None,
            flush_interval: Duration::from_millis(rng.random_range(5..300)),
            segment_bytes: 1 << 20,
        };
        let extra = format!(
            "lane_stall_timeout = \"2s\"\nlane_idle_timeout = \"500ms\"\nretry_base = \"200ms\"\nretry_max = \"1s\"\n[archive]\nbucket = \"{}\"\nkey_prefix = \"sk/\"\nflush_interval = \"{}ms\"\n[s3]\nbucket = \"{bucket}\"\nendpoint_url = \"{}\"\n[[outbox]]\ntable = \"app.outboxevent\"\npreset = \"debezium\"\n[[outbox]]\ntable = \"outbox_messages\"\npreset = \"topic-payload\"",
            archive.bucket,
            archive.flush_interval.as_millis(),
            s3_proxy.url
        );
        // SNS topics too: a standard one with two raw subscriptions, a
        // FIFO one with a FIFO queue subscribed (its order is checked).
        let (s, sf) = (create_topic(&sqs, "sk_s", false).await, create_topic(&sqs, "sk_sf", true).await);
        let s_subs = [subscribed_queue(&sqs, &s, "sk_s1", true).await, subscribed_queue(&sqs, &s, "sk_s2", true).await];
        let sf_sub = subscribed_queue(&sqs, &sf, "sk_sf1", true).await;
        let dests = [("a", a.as_str()), ("f", f.as_str()), ("s", s.as_str()), ("sf", sf.as_str())];
        let config = RelayConfig::through(&db, "cdc", &dests, &extra, &sqs_proxy.url);
        let mut relay = Supervised { config, process: None, exits: 0 };
        relay.keep_running();
        wait_for("the slot exists", Duration::from_secs(60), || async { confirmed(&db, &db.slot).await > 0 }).await;
        let dests = ["a", "f", "s", "sf", "nowhere"];
        let mut tally = Tally::default();
        let mut committed = before_slot;
        for step in 0..steps {
            match rng.random_range(0..12) {
                4 | 5 => {
                    // SQS or S3 gone for a while, whatever the relay does.
                    let proxy = if rng.random_bool(0.5) { &sqs_proxy } else { &s3_proxy };
                    proxy.down();
                    tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_000))).await;
                    proxy.up();
                    tally.outages += 1;
                }
                0 | 1 => {
                    // At a random moment of whatever it is doing.
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..400))).await;
                    relay.kill();
                    tally.restarts += 1;
                }
                2 => {
                    c = restart_postgres(&node, &mut rng, &db).await;
                    tally.pg_restarts += 1;
                }
                3 => {
                    reset_identity(&c).await;
                    tally.resets += 1;
                }
                6 => match produce_debezium(&mut c, &mut rng, &format!("k{seed}t{step}"), &["a", "f"], true).await {
                    Some(rows) => committed.extend(rows),
                    None => tally.failed_txns += 1,
                },
                7 => match produce_topic_payload(&mut c, &mut rng, &format!("k{seed}t{step}"), &["a"], true).await {
                    Some(rows) => committed.extend(rows),
                    None => tally.failed_txns += 1,
                },
                8 => match produce_huge(&mut c, &mut rng, &format!("k{seed}t{step}")).await {
                    Some(rows) => committed.extend(rows),
                    None => tally.failed_txns += 1,
                },
                _ => match produce(&mut c, &mut rng, &format!("k{seed}t{step}"), &dests, false).await {
                    Some(rows) => committed.extend(rows),
                    None => tally.failed_txns += 1,
                },
            }
            relay.keep_running();
        }
        let to = |d: &[&str]| -> HashSet<&str> {
            committed.iter().filter(|r| d.contains(&r.1.as_str())).map(|r| r.0.as_str()).collect()
        };
        let expect: HashSet<&str> = committed.iter().filter(|r| r.1 != "nowhere").map(|r| r.0.as_str()).collect();
        let queued: HashSet<&str> = expect.difference(&to(&["s", "sf"])).copied().collect();
        let got;
        (tally.offloaded, got) = all_received(&sqs, &[&a, &f], &mut relay, &queued, seed).await;
        for sub in &s_subs {
            all_received(&sqs, &[sub], &mut relay, &to(&["s"]), seed).await;
        }
        let arrived = all_received_in_order(&sqs, &sf_sub, &mut relay, &to(&["sf"]), seed).await;
        order_per_group_kept(&committed, "sf", &arrived, seed);
        tally.topics = to(&["s", "sf"]).len();
        topic_payload_settled(&db, &got, seed).await;
        wait_for(&format!("seed {seed}: no row left NEW"), Duration::from_secs(60), || async {
            db.count("status = 'NEW'").await == 0
        })
        .await;
        let nowhere: Vec<&str> = committed.iter().filter(|r| r.1 == "nowhere").map(|r| r.0.as_str()).collect();
        unknown_destination_dead_count(&db, &nowhere, seed).await;
        slots_confirmed(&db, std::iter::once(db.slot.as_str()), seed).await;
        let lines = archived_lines(&archive).await;
        let archived: HashSet<&str> = lines.iter().map(|l| l.body.trim_end_matches('.')).collect();
        let missing: Vec<&String> = got.iter().filter(|b| !archived.contains(b.as_str())).take(5).collect();
        assert!(missing.is_empty(), "seed {seed}: delivered and settled, not archived, e.g. {missing:?}");
        relay.kill();
        // Each exit is a start-up that found the server, SQS or S3 down.
        let downs = tally.pg_restarts + tally.outages;
        assert!(relay.exits <= downs, "seed {seed}: {} exits, {downs} outages and restarts", relay.exits);
        tally.supervised = relay.exits;
        tally.delivered = expect.len();
        tally.dead = nowhere.len();
        tally.transient = committed.iter().filter(|r| r.2).count();
        tally.mapped = committed.iter().filter(|r| r.0.starts_with('"')).count();
        tally.huge = committed.iter().filter(|r| r.0.ends_with(":huge")).count();
        tally
    }

    /// Receive from `urls` (keeping the relay running, 180 s at most) until
    /// every row of `expect` came; panics naming missing ones, or a pointer
    /// whose object is not there. Returns the messages that came through S3,
    /// and the bodies received.
    async fn all_received(
        sqs: &outbox_relay::publish::aws::AwsPublisher,
        urls: &[&str],
        relay: &mut Supervised,
        expect: &HashSet<&str>,
        seed: u64,
    ) -> (usize, HashSet<String>) {
        let mut got: HashSet<String> = HashSet::new();
        let mut through_s3 = 0;
        let s3 = s3_client().await;
        let end = Instant::now() + Duration::from_secs(180);
        while Instant::now() < end && !expect.iter().all(|e| got.contains(*e)) {
            relay.keep_running();
            for url in urls {
                let round = receive_round(sqs, url, 0).await.unwrap();
                for (raw, _) in round.messages {
                    // A pointer's object must be there: none dangles.
                    through_s3 += usize::from(raw.contains("PayloadS3Pointer"));
                    got.insert(resolve_body(&s3, raw).await.trim_end_matches('.').to_string());
                }
            }
        }
        let missing: Vec<&&str> = expect.iter().filter(|e| !got.contains(**e)).take(10).collect();
        assert!(missing.is_empty(), "seed {seed}: committed rows never delivered, e.g. {missing:?}");
        (through_s3, got)
    }

    /// Receive from `url` (keeping the relay running, 180 s at most) until
    /// every row of `expect` came; the event ids and groups in the order
    /// they came.
    async fn all_received_in_order(
        sqs: &outbox_relay::publish::aws::AwsPublisher,
        url: &str,
        relay: &mut Supervised,
        expect: &HashSet<&str>,
        seed: u64,
    ) -> Vec<(String, Option<String>)> {
        let mut arrived = Vec::new();
        let mut got: HashSet<String> = HashSet::new();
        let end = Instant::now() + Duration::from_secs(180);
        while Instant::now() < end && !expect.iter().all(|e| got.contains(*e)) {
            relay.keep_running();
            for (body, group) in receive_round(sqs, url, 0).await.unwrap().messages {
                let id = body.trim_end_matches('.').to_string();
                got.insert(id.clone());
                arrived.push((id, group));
            }
        }
        let missing: Vec<&&str> = expect.iter().filter(|e| !got.contains(**e)).take(10).collect();
        assert!(missing.is_empty(), "seed {seed}: committed rows never delivered to {url}, e.g. {missing:?}");
        arrived
    }

    /// Each group of destination `d`'s rows arrived in commit order: the
    /// first arrival of each row after the first arrival of every row
    /// committed before it in its group (a later copy is at least once).
    fn order_per_group_kept(committed: &[Row], d: &str, arrived: &[(String, Option<String>)], seed: u64) {
        let order: HashMap<&str, usize> = committed
            .iter()
            .filter(|r| r.1 == d && r.3.is_none())
            .enumerate()
            .map(|(i, r)| (r.0.as_str(), i))
            .collect();
        let mut first: HashSet<&str> = HashSet::new();
        let mut last: HashMap<&str, (usize, &str)> = HashMap::new();
        for (id, group) in arrived {
            let (Some(&i), Some(g)) = (order.get(id.as_str()), group.as_deref()) else { continue };
            if !first.insert(id) {
                continue;
            }
            if let Some((before, other)) = last.get(g) {
                assert!(*before < i, "seed {seed}: group {g} of {d}: {other} arrived before {id}, committed earlier");
            }
            last.insert(g, (i, id));
        }
    }

    /// Every row of `nowhere` (counted once) is DEAD with the unknown
    /// destination as its reason.
    async fn unknown_destination_dead_count(db: &TestDb, nowhere: &[&str], seed: u64) {
        let dead: i64 = db
            .client()
            .await
            .query_one(
                "SELECT count(DISTINCT event_id) FROM outbox
                  WHERE event_id = ANY($1) AND status = 'DEAD' AND last_error LIKE 'unknown_destination%'",
                &[&nowhere],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(dead as usize, nowhere.len(), "seed {seed}: rows for an unknown destination DEAD with their reason");
    }

    /// A crash (immediate) or a clean stop (fast) of the server, while the
    /// relays send, settle and confirm; started again after up to a second.
    /// Returns a new client for the producer.
    async fn restart_postgres(node: &Node, rng: &mut StdRng, db: &TestDb) -> tokio_postgres::Client {
        node.stop(["immediate", "fast"][rng.random_range(0..2)]);
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..1_000))).await;
        node.start(&[]);
        db.client().await
    }

    /// `TRUNCATE outbox RESTART IDENTITY`, only on an empty table: a reset
    /// never truncates a row.
    async fn reset_identity(c: &tokio_postgres::Client) {
        c.batch_execute(
            "DO $$ BEGIN LOCK TABLE outbox;
               IF NOT EXISTS (SELECT 1 FROM outbox) THEN TRUNCATE outbox RESTART IDENTITY; END IF; END $$",
        )
        .await
        .unwrap();
    }

    async fn confirmed(db: &TestDb, slot: &str) -> u64 {
        let c = db.client().await;
        let sql = "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1";
        c.query_opt(sql, &[&slot]).await.unwrap().and_then(|r| r.get::<_, Option<i64>>(0)).unwrap_or(0) as u64
    }

    pub async fn run(seed: u64, steps: usize) -> Tally {
        let mut rng = StdRng::seed_from_u64(seed);
        let sharded = seed % 2 == 0;
        // A server of its own: the workload restarts it.
        let dir = ClusterDir::new(&format!("outbox-relay-random{seed}"));
        let node = Node::init(&dir.0, "pg");
        node.start(&[]);
        let _stop = StopOnDrop(&node);
        let db = TestDb::on(&node.url("postgres"), &format!("random{seed}")).await;
        let p = MemoryPublisher::new();
        for (_, q, fifo) in QUEUES {
            if q.contains(":event-bus/") {
                p.add_bus(q);
            } else if q.starts_with("arn:") {
                p.add_topic(q, fifo, 262_144);
            } else {
                p.add_queue(q, fifo, 262_144);
            }
        }
        for (topic, queue) in SUBSCRIBERS {
            p.subscribe(topic, queue);
        }
        // A round trip, so lanes keep calls in flight and their limits grow.
        p.set_latency(Duration::from_millis(rng.random_range(0..8)));
        let mut before_slot = Vec::new();
        if !sharded {
            debezium_table(&db).await;
            if seed % 4 == 1 {
                partitioned_topic_payload_table(&db).await;
            } else {
                crate::topic_payload::topic_payload_table(&db, true).await;
            }
            // Written before the slot: caught up from the table.
            let mut c = db.client().await;
            before_slot =
                produce_topic_payload(&mut c, &mut rng, &format!("s{seed}pre"), &["a", "b"], false).await.unwrap();
        }
        // Published rows kept (replays in the mix) on some unsharded seeds;
        // every published event archived in S3 (replays from it in the
        // mix) on some others, sharded ones included.
        let keep = seed % 4 == 1;
        let archive = match seed % 4 {
            2 | 3 => Some(archive_config(&create_bucket("inv").await, &stack().sqs_url, &mut rng)),
            _ => None,
        };
        let mut relays = started_relays(&db, sharded, keep, archive.as_ref(), &p).await;
        // Shards see only their destinations: an unknown one would wait for
        // a relay that serves it, so only the single relay gets those.
        let mut dests = vec!["a", "b", "f", "s", "sf", "e"];
        if !sharded {
            // Looked up by the template: two queues, and one that is not.
            dests.extend(["t1", "t2", "nowhere"]);
        }
        let env = InProcess { node: &node, db: &db, p: &p, moved: Mutex::default(), lowered: Default::default() };
        let mut c = db.client().await;
        let mut tally = Tally::default();
        let mut committed = before_slot;
        let mut unseen = HashSet::new();
        for step in 0..steps {
            let tag = format!("s{seed}t{step}");
            let (polled, before) = (relays.polling.clone(), committed.len());
            if let Some(rows) = env.step(&mut rng, &mut relays, &mut c, &mut tally, &tag, &dests).await {
                committed.extend(rows);
            }
            if relays.polling.iter().zip(&polled).any(|(now, before)| *now && !before) {
                // A relay polls from now on: transient rows it had not sent
                // are unseen until it streams again.
                let fifo = QUEUES.iter().filter(|q| q.2).flat_map(|(_, q, _)| p.sent(q));
                let sent: HashSet<String> = fifo.map(|s| s.event_id).collect();
                unseen.extend(committed.iter().filter(|r| r.2 && !sent.contains(&r.0)).map(|r| r.0.clone()));
            } else if relays.polling.iter().any(|p| *p) {
                unseen.extend(committed[before..].iter().filter(|r| r.2).map(|r| r.0.clone()));
            }
            tally.supervised += relays.supervise(&p, &format!("seed {seed} step {step}")).await;
        }
        if !sharded {
            grant_back(&c).await;
        }
        tally.mode_switches += relays.all_streaming(&p).await;
        let expect_dead: HashSet<&str> = committed.iter().filter(|r| r.1 == "nowhere").map(|r| r.0.as_str()).collect();
        let unreadable: HashSet<&str> = committed.iter().filter(|r| r.1 == UNREADABLE).map(|r| r.0.as_str()).collect();
        // Sent, or DEAD `too_large` if sent after the limit was lowered.
        let lowered = env.lowered.load(std::sync::atomic::Ordering::Relaxed);
        let maybe_too_large: HashSet<&str> =
            committed.iter().filter(|r| lowered && r.1 == "b" && r.0.ends_with(BIG)).map(|r| r.0.as_str()).collect();
        let expect_sent: HashSet<&str> = committed
            .iter()
            .filter(|r| r.1 != "nowhere" && r.1 != UNREADABLE && !maybe_too_large.contains(r.0.as_str()))
            .map(|r| r.0.as_str())
            .collect();
        tally.supervised += env.all_sent(&mut relays, &expect_sent, seed).await;
        wait_for(&format!("seed {seed}: no row left NEW"), Duration::from_secs(60), || async {
            db.count("status = 'NEW'").await == 0
        })
        .await;
        unknown_destinations_dead(&db, &expect_dead, "queue_not_found", seed).await;
        unreadable_dead(&db, &unreadable, seed).await;
        tally.too_large = too_large_or_sent(&db, &p, &maybe_too_large, seed).await;
        if !sharded {
            let sent = QUEUES.iter().flat_map(|(_, q, _)| p.sent(q)).map(|s| s.event_id).collect();
            topic_payload_settled(&db, &sent, seed).await;
        }
        let moved = env.moved.lock().unwrap().clone();
        none_early(&p, &committed, &moved, seed);
        fifo_order_kept(&p, &committed, &unseen, seed);
        replays_only_selected(&p, &committed, seed);
        tally.topics = every_subscriber_has_every_event(&p, seed);
        let on_bus = QUEUES.iter().filter(|(d, _, _)| bus(d)).flat_map(|(_, a, _)| p.sent(a));
        tally.buses = on_bus.map(|s| s.event_id).collect::<HashSet<_>>().len();
        tally.moved = moved.len();
        tally.delayed = committed.iter().filter(|r| r.3.is_some()).count();
        slots_confirmed(&db, relays.configs.iter().map(|c| c.slot.as_str()), seed).await;
        if let Some(a) = &archive {
            let sent = QUEUES.iter().flat_map(|(_, q, _)| p.sent(q)).map(|s| s.event_id);
            every_sent_archived(a, sent.collect(), seed).await;
        }
        for r in relays.running.iter_mut().filter_map(Option::take) {
            r.stop().await;
        }
        tally.delivered = expect_sent.len();
        tally.dead = expect_dead.len() + unreadable.len() + tally.too_large;
        tally.transient = committed.iter().filter(|r| r.2).count();
        let mapped = |e: &str| e.starts_with("app.outboxevent:") || e.starts_with("public.outbox_messages:");
        tally.mapped = committed.iter().filter(|r| mapped(&r.0)).count();
        tally
    }

    /// An operator replays what one destination (or every one) published
    /// in the last few seconds, to completion: the copies, as rows
    /// committed now (each must be sent, in its group's order). `None`
    /// when nothing matched.
    async fn replay_some(
        c: &mut tokio_postgres::Client,
        rng: &mut StdRng,
        config: &outbox_relay::config::Config,
        dests: &[&str],
    ) -> Option<Vec<Row>> {
        use outbox_relay::ops::replay;
        // One this relay knows (a shard's own), or every one.
        let known: Vec<&str> = dests
            .iter()
            .copied()
            .filter(|d| config.destinations.contains_key(*d) || config.destination_template.is_some())
            .collect();
        let destination = rng.random_bool(0.7).then(|| known[rng.random_range(0..known.len())].to_string());
        let since: String = c
            .query_one("SELECT (now() - make_interval(secs => $1))::text", &[&rng.random_range(1.5..6.0f64)])
            .await
            .ok()?
            .get(0);
        // From the archive, up to a second ago: a segment being written
        // when the replay starts (its events published just before) is not
        // listed by the plan, and would be copied beyond its total.
        let until = match config.archive {
            Some(_) => Some(c.query_one("SELECT (now() - interval '1s')::text", &[]).await.ok()?.get(0)),
            None => None,
        };
        let mut selection = replay::Selection { destination, since: Some(since), until, ..Default::default() };
        let planned = match replay::plan(c, config, &mut selection).await {
            Ok(p) => p,
            Err(outbox_relay::ops::OpsError::Refused(why))
                if ["no published event", "no archived event", "holds nothing"].iter().any(|w| why.contains(w)) =>
            {
                return None
            }
            Err(e) => panic!("replay refused: {e}"),
        };
        let id = replay::start(c, &selection, &planned).await.ok()?;
        let r = replay::run(c, config, id, None, |_| {}, || false).await.ok()?;
        assert_eq!((r.copied, r.total), (r.total, planned.iter().map(|p| p.events).sum::<i64>()), "replay {id}");
        if selection.source == Some(replay::Source::Archive) {
            // The copies are deleted once sent: what the replay selected is
            // read from the archive, in the order it copied it.
            return Some(archived_copies(config, &selection, id).await);
        }
        let copies =
            c.query("SELECT event_id, destination FROM outbox WHERE replay_of = $1 ORDER BY id", &[&id]).await.ok()?;
        Some(copies.iter().map(|r| (r.get(0), r.get(1), false, None)).collect())
    }

    /// An archive of the randomized workload: its flush interval drawn.
    fn archive_config(bucket: &str, endpoint: &str, rng: &mut StdRng) -> ArchiveConfig {
        ArchiveConfig {
            bucket: bucket.to_string(),
            key_prefix: "inv/".into(),
            endpoint_url: Some(endpoint.to_string()),
            window: None,
            flush_interval: Duration::from_millis(rng.random_range(5..300)),
            segment_bytes: 1 << 20,
        }
    }

    /// Every line of the archive, in key order.
    async fn archived_lines(a: &ArchiveConfig) -> Vec<outbox_relay::pipeline::archive::Line> {
        use outbox_relay::publish::offload::{ObjectStore, S3Store};
        let store = S3Store::new("us-east-1", a.endpoint_url.as_deref(), None).await;
        let mut lines = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let keys = store.list(&a.bucket, &a.key_prefix, after.as_deref(), 1_000).await.unwrap();
            let Some(last) = keys.last().cloned() else { return lines };
            for k in &keys {
                lines.extend(outbox_relay::pipeline::archive::decode(&store.get(&a.bucket, k).await.unwrap()).unwrap());
            }
            after = Some(last);
        }
    }

    /// The copies replay `id` of `selection` wrote, from the archive: its
    /// selected lines in key order, each once.
    async fn archived_copies(
        config: &outbox_relay::config::Config,
        selection: &outbox_relay::ops::replay::Selection,
        id: i64,
    ) -> Vec<Row> {
        use outbox_relay::ops::replay::archive::{selects, Bounds};
        let c = outbox_relay::db::connect(&config.database_url).await.unwrap();
        let bounds = Bounds::of(&c, selection).await.unwrap();
        let mut seen = HashSet::new();
        let lines = archived_lines(config.archive.as_ref().unwrap()).await;
        lines
            .into_iter()
            .filter(|l| selects(selection, bounds, l) && seen.insert(l.event_id.clone()))
            .map(|l| {
                let to = selection.to.clone().unwrap_or(l.destination);
                (format!("{}/replay-{id}", l.event_id), to, false, None)
            })
            .collect()
    }

    /// Every event sent is in the archive once every slot is confirmed: no
    /// event was settled before it was archived.
    async fn every_sent_archived(a: &ArchiveConfig, sent: HashSet<String>, seed: u64) {
        let archived: HashSet<String> = archived_lines(a).await.into_iter().map(|l| l.event_id).collect();
        let missing: Vec<&String> = sent.iter().filter(|b| !archived.contains(*b)).take(5).collect();
        assert!(missing.is_empty(), "seed {seed}: sent and settled, not archived, e.g. {missing:?}");
    }

    /// Every replayed message sent is a copy a replay wrote: no event
    /// outside a replay's selection was sent again as a replay.
    fn replays_only_selected(p: &MemoryPublisher, committed: &[Row], seed: u64) {
        let copies: HashSet<&str> = committed.iter().map(|r| r.0.as_str()).filter(|e| e.contains("/replay-")).collect();
        for (_, q, _) in QUEUES {
            for s in p.sent(q).iter().filter(|s| s.event_id.contains("/replay-")) {
                assert!(copies.contains(s.event_id.as_str()), "seed {seed}: {} sent, not a replay's copy", s.event_id);
            }
        }
    }

    /// The relays of [`run`], started, each once its slot exists: transient
    /// rows committed before a slot exists are seen by nothing.
    async fn started_relays(
        db: &TestDb,
        sharded: bool,
        keep: bool,
        archive: Option<&ArchiveConfig>,
        p: &MemoryPublisher,
    ) -> Relays {
        let mut relays = relays(db, sharded, keep, archive).await;
        for i in 0..relays.configs.len() {
            relays.start(i, p);
        }
        for cfg in &relays.configs {
            wait_for("the slot exists", Duration::from_secs(30), || async { confirmed(db, &cfg.slot).await > 0 }).await;
        }
        relays
    }

    /// The next calls (of any lane) throttled as a whole or entry by entry,
    /// or failing with a server error: the lanes' limits shrink, and every
    /// entry is retried, none DEAD.
    fn throttle_burst(p: &MemoryPublisher, rng: &mut StdRng) {
        for _ in 0..rng.random_range(1..40) {
            let code = ["RequestThrottled", "ThrottlingException", "InternalError"][rng.random_range(0..3)];
            p.push_fault(if rng.random_bool(0.5) {
                Fault::FailCall(CallError { code: code.into(), message: "injected".into(), sender_fault: true })
            } else {
                Fault::FailEntries {
                    positions: vec![0, rng.random_range(1..10)],
                    code: code.into(),
                    sender_fault: true,
                }
            });
        }
    }

    /// What [`run`]'s steps act on: its server, database and publisher.
    struct InProcess<'a> {
        node: &'a Node,
        db: &'a TestDb,
        p: &'a MemoryPublisher,
        /// Held rows moved by an UPDATE, and their new due times.
        moved: Mutex<HashMap<String, SystemTime>>,
        /// Queue `b`'s size limit was lowered ([`LOWERED`]).
        lowered: std::sync::atomic::AtomicBool,
    }

    impl InProcess<'_> {
        /// One random step: a queue outage, a relay aborted and started
        /// again, an identity reset, a server restart, or (most often) a
        /// producer transaction, whose committed rows it returns.
        async fn step(
            &self,
            rng: &mut StdRng,
            relays: &mut Relays,
            c: &mut tokio_postgres::Client,
            tally: &mut Tally,
            tag: &str,
            dests: &[&str],
        ) -> Option<Vec<Row>> {
            let mapped: Vec<&str> = dests.iter().copied().filter(|d| !bus(d)).collect();
            match rng.random_range(0..15) {
                14 => {
                    throttle_burst(self.p, rng);
                    tally.throttles += 1;
                }
                0 => {
                    let (_, q, _) = QUEUES[rng.random_range(0..QUEUES.len())];
                    self.p.break_queue(q, CallError::transport("connection refused"));
                    tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_000))).await;
                    self.p.fix_queue(q);
                    tally.outages += 1;
                }
                1 => {
                    let i = rng.random_range(0..relays.running.len());
                    if let Some(r) = relays.running[i].take() {
                        r.abort();
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
                    // Started again polling (the fallback; a relay with a
                    // mapped table lacking a published column cannot poll),
                    // or streaming.
                    let polling = relays.configs[i].mapped.is_empty() && rng.random_bool(0.4);
                    tally.mode_switches += usize::from(polling != relays.polling[i]);
                    relays.polling[i] = polling;
                    relays.start(i, self.p);
                    tally.restarts += 1;
                }
                2 => {
                    reset_identity(c).await;
                    tally.resets += 1;
                }
                3 => {
                    *c = restart_postgres(self.node, rng, self.db).await;
                    tally.pg_restarts += 1;
                }
                4 => {
                    let moved = move_held(c).await;
                    self.moved.lock().unwrap().extend(moved);
                }
                13 if !self.lowered.load(std::sync::atomic::Ordering::Relaxed) => {
                    // An operator lowers a queue's size limit: SQS refuses
                    // the big rows the relays judged by the old one.
                    self.p.add_queue(QUEUES[1].1, false, LOWERED);
                    self.lowered.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                5 | 6 if !relays.configs[0].mapped.is_empty() => {
                    match produce_debezium(c, rng, tag, &mapped, false).await {
                        Some(rows) => return Some(rows),
                        None => tally.failed_txns += 1,
                    }
                }
                7 if !relays.configs[0].mapped.is_empty() => {
                    let standard: Vec<&str> = mapped.iter().copied().filter(|d| !ordered(d)).collect();
                    match produce_topic_payload(c, rng, tag, &standard, false).await {
                        Some(rows) => return Some(rows),
                        None => tally.failed_txns += 1,
                    }
                }
                12 if relays.configs[0].published_rows == PublishedRows::Keep
                    || relays.configs[0].archive.is_some() =>
                {
                    if let Some(rows) = replay_some(c, rng, &relays.configs[0], dests).await {
                        tally.replayed += rows.len();
                        return Some(rows);
                    }
                }
                8 if !relays.configs[0].mapped.is_empty() => {
                    tally.operations += 1;
                    match operate(c, rng, tag, &mapped).await {
                        Some(rows) => return Some(rows),
                        None => tally.failed_txns += 1,
                    }
                }
                _ => match produce(c, rng, tag, dests, true).await {
                    Some(rows) => return Some(rows),
                    None => tally.failed_txns += 1,
                },
            }
            None
        }

        /// Wait (supervising the relays, 120 s at most) until every row of
        /// `expect_sent` was sent; panics naming the missing ones and their
        /// state. Returns how many relays were started again meanwhile.
        async fn all_sent(&self, relays: &mut Relays, expect_sent: &HashSet<&str>, seed: u64) -> usize {
            let sent = |p: &MemoryPublisher| -> HashSet<String> {
                QUEUES.iter().flat_map(|(_, q, _)| p.sent(q)).map(|s| s.event_id).collect()
            };
            let mut supervised = 0;
            let end = Instant::now() + Duration::from_secs(120);
            let c = self.db.client().await;
            while Instant::now() < end && !expect_sent.iter().all(|e| sent(self.p).contains(*e)) {
                supervised += relays.supervise(self.p, &format!("seed {seed} at the end")).await;
                // Rows held for 20 minutes (transient ones written back
                // meanwhile among them) are brought forward.
                let moved = move_held(&c).await;
                self.moved.lock().unwrap().extend(moved);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let got = sent(self.p);
            let missing: Vec<&str> = expect_sent.iter().filter(|e| !got.contains(**e)).take(10).copied().collect();
            if !missing.is_empty() {
                let rows: Vec<String> = self.db
                    .client()
                    .await
                    .query("SELECT format('%s id=%s %s dest=%s next=%s err=%s', event_id, id, status, destination, next_attempt_at, last_error) FROM outbox WHERE event_id = ANY($1)
                            UNION ALL SELECT format('slot %s active=%s confirmed=%s restart=%s', slot_name, active, confirmed_flush_lsn, restart_lsn) FROM pg_replication_slots", &[&missing])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                panic!("seed {seed}: committed rows never delivered, e.g. {missing:?}; in the table: {rows:?}");
            }
            supervised
        }
    }

    /// Every row of `maybe` (big, to `b` after its limit was lowered) was
    /// sent, or is DEAD `too_large`, and no other row is; how many are DEAD.
    async fn too_large_or_sent(db: &TestDb, p: &MemoryPublisher, maybe: &HashSet<&str>, seed: u64) -> usize {
        let dead: HashSet<String> = db
            .client()
            .await
            .query("SELECT event_id FROM outbox WHERE status = 'DEAD' AND last_error LIKE 'too_large%'", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let stray: Vec<&String> = dead.iter().filter(|e| !maybe.contains(e.as_str())).take(10).collect();
        assert!(stray.is_empty(), "seed {seed}: DEAD too_large though they fit: {stray:?}");
        let sent: HashSet<String> = p.sent(QUEUES[1].1).into_iter().map(|s| s.event_id).collect();
        let lost: Vec<&&str> = maybe.iter().filter(|e| !dead.contains(**e) && !sent.contains(**e)).take(10).collect();
        assert!(lost.is_empty(), "seed {seed}: big rows neither sent nor DEAD too_large: {lost:?}");
        dead.len()
    }

    /// Every row of `expect_dead` is DEAD with `reason` (its queue is not
    /// there).
    async fn unknown_destinations_dead(db: &TestDb, expect_dead: &HashSet<&str>, reason: &str, seed: u64) {
        let dead: HashSet<String> = db
            .client()
            .await
            .query("SELECT event_id FROM outbox WHERE status = 'DEAD' AND last_error LIKE $1 || '%'", &[&reason])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let not_dead: Vec<&str> = expect_dead.iter().filter(|e| !dead.contains(**e)).take(10).copied().collect();
        if !not_dead.is_empty() {
            let rows: Vec<String> = db
                .client()
                .await
                .query(
                    "SELECT format('%s id=%s %s err=%s', event_id, id, status, last_error) FROM outbox
                      WHERE event_id = ANY($1)
                     UNION ALL SELECT format('mapped %s %s published_at=%s', id, topic, published_at) FROM outbox_messages
                      WHERE 'public.outbox_messages:' || id = ANY($1)",
                    &[&not_dead],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            panic!("seed {seed}: rows for an unknown destination not DEAD with their reason: {not_dead:?}; in the table: {rows:?}");
        }
    }

    /// Every slot of `slots` confirmed past the last commit (60 s at most each).
    async fn slots_confirmed(db: &TestDb, slots: impl Iterator<Item = &str>, seed: u64) {
        let last = db.current_lsn().await;
        for slot in slots {
            let what = format!("seed {seed}: slot {slot} confirmed past the last commit");
            wait_for(&what, Duration::from_secs(60), || async { confirmed(db, slot).await >= last }).await;
        }
    }
}

/// Sends SIGCONT to a stopped process when dropped, whatever the test did.
struct Stopped(i32);

impl Stopped {
    fn stop(pid: i32) -> Stopped {
        let ok = std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap().success();
        assert!(ok, "kill -STOP {pid}");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill").args(["-CONT", &self.0.to_string()]).status();
    }
}

/// The pid of the walsender reading `slot`, once there is one.
async fn walsender(c: &tokio_postgres::Client, slot: &str) -> i32 {
    let active = "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1";
    let end = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(pid) = c.query_one(active, &[&slot]).await.unwrap().get(0) {
            return pid;
        }
        assert!(std::time::Instant::now() < end, "no walsender reads the slot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn held(relay: &Running) -> bool {
    relay.metrics.render().lines().any(|l| l == "outbox_relay_stream_held 1")
}

/// While the stream is held (or down) the lane stays spooled: its drain
/// sending rows does not take it back to a stream that brings nothing.
async fn stays_spooled(relay: &Running) {
    for _ in 0..10 {
        let m = relay.metrics.render();
        assert!(
            m.contains("outbox_relay_lane_spooled{destination=\"orders\"} 1"),
            "the lane left the spool while held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each of `n` rows whose body starts with `prefix` sent exactly once.
fn sent_once(p: &MemoryPublisher, prefix: &str, n: usize) -> bool {
    let sent: Vec<String> = p.sent(Q).into_iter().map(|s| s.body).filter(|b| b.starts_with(prefix)).collect();
    let distinct: HashSet<&String> = sent.iter().collect();
    assert_eq!(sent.len(), distinct.len(), "{prefix} rows sent twice: by the table while held, then by the stream");
    distinct.len() == n
}

/// Once the stream flows again: new rows are delivered, nothing is left NEW,
/// and each of the 200 rows sent while it was held (`held_prefix`) was sent once.
async fn flows_on_after_the_hold(db: &TestDb, c: &tokio_postgres::Client, p: &MemoryPublisher, held_prefix: &str) {
    insert_rows(c, "after", "orders", 50, None).await;
    wait_for("rows after delivered", Duration::from_secs(30), || async { bodies(p, "after:").len() == 50 }).await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    assert!(sent_once(p, held_prefix, 200));
}

/// A walsender that stops sending (here: frozen with SIGSTOP) while rows
/// are written: the relay names it within seconds (metric, readiness) and
/// the rows go by the table meanwhile, the lane staying spooled; once it
/// sends again, the stream takes over, does not send those rows again, and
/// nothing is left NEW.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_stream_is_named_and_its_rows_go_by_the_table() {
    let db = TestDb::new("held").await;
    let p = publisher();
    let relay = streaming(&db, quick_spool(&db), &p).await;
    let c = db.client().await;
    let frozen = Stopped::stop(walsender(&c, &db.slot).await);
    insert_rows(&c, "held", "orders", 200, None).await;
    wait_for("the held stream named", Duration::from_secs(20), || async { held(&relay) }).await;
    assert!(!relay.metrics.is_ready(), "not ready while the stream is held");
    let why = relay.metrics.unready_reason();
    assert!(why.contains("walsender"), "the cause is named: {why}");
    wait_for("the rows delivered by the table path", Duration::from_secs(30), || async { sent_once(&p, "held:", 200) })
        .await;
    stays_spooled(&relay).await;
    drop(frozen);
    wait_for("the stream flows again", Duration::from_secs(30), || async { !held(&relay) }).await;
    flows_on_after_the_hold(&db, &c, &p, "held:").await;
    relay.stop().await;
}

/// A relay restarted while its old walsender, frozen, still owns the slot
/// ("slot is active for PID n"): no session can stream, so after the same
/// delay the relay names the process holding the slot and its rows go by
/// the table; when the old walsender goes, a session streams again and
/// nothing is sent twice or left NEW.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_held_by_a_stale_walsender_is_named_and_rows_go_by_the_table() {
    let db = TestDb::new("stale").await;
    let p = publisher();
    let first = streaming(&db, quick_spool(&db), &p).await;
    let c = db.client().await;
    let pid = walsender(&c, &db.slot).await;
    let frozen = Stopped::stop(pid);
    first.abort();
    let relay = start(quick_spool(&db), Arc::new(p.clone()));
    insert_rows(&c, "stale", "orders", 200, None).await;
    wait_for("no session named", Duration::from_secs(30), || async { held(&relay) }).await;
    wait_for("the rows delivered by the table path", Duration::from_secs(30), || async {
        sent_once(&p, "stale:", 200)
    })
    .await;
    stays_spooled(&relay).await;
    let why = relay.metrics.unready_reason();
    assert!(why.contains(&format!("in use by pid {pid}")), "the process holding the slot is named: {why}");
    // Let the old walsender run: its client is gone, it ends, the slot is free.
    drop(frozen);
    wait_for("a session streams again", Duration::from_secs(60), || async {
        !held(&relay) && relay.metrics.is_ready()
    })
    .await;
    flows_on_after_the_hold(&db, &c, &p, "stale:").await;
    let reader: Option<i32> = c
        .query_one("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", &[&db.slot])
        .await
        .unwrap()
        .get(0);
    assert!(reader.is_some_and(|r| r != pid), "the new relay's walsender reads the slot: {reader:?}");
    relay.stop().await;
}

/// What a relay killed between creating its slot and the end of the
/// hand-off leaves: a slot whose consistent point is past NEW rows nobody
/// handed to the table, and the hand-off's record. The next relay finishes
/// the hand-off: every one of those rows is delivered, once, beside the rows
/// the stream brings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_cut_short_by_a_kill_is_finished_by_the_next_relay() {
    let db = TestDb::new("handoff").await;
    let p = publisher();
    let c = db.client().await;
    insert_rows(&c, "before", "orders", 300, None).await;
    c.execute("INSERT INTO outbox_relay_handoffs (slot) VALUES ($1)", &[&db.slot]).await.unwrap();
    c.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&db.slot]).await.unwrap();
    insert_rows(&c, "after", "orders", 100, None).await;
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("every row delivered", Duration::from_secs(60), || async {
        sent_once(&p, "before:", 300) && sent_once(&p, "after:", 100)
    })
    .await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    let pending: i64 = c.query_one("SELECT count(*) FROM outbox_relay_handoffs", &[]).await.unwrap().get(0);
    assert_eq!(pending, 0, "the hand-off's record is gone once it is done");
    relay.stop().await;
}

/// A FIFO lane spooled under a steady load streams again while the writer
/// still writes (it catches up: its new events wait while the drain sends
/// the rest of the spool), and every group arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spooled_fifo_lane_streams_again_under_a_steady_load_in_order() {
    const F: &str = "http://memory.invalid/orders.fifo";
    let db = TestDb::new("steady_fifo").await;
    let p = MemoryPublisher::new();
    p.add_queue(F, true, 262_144);
    let relay = streaming(&db, quick_spool_to(&db, F), &p).await;
    let spooled = |m: &str| m.contains("outbox_relay_lane_spooled{destination=\"orders\"} 1");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, stop) = (db.client().await, Arc::clone(&stop));
        tokio::spawn(async move {
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                insert_rows(&c, &format!("sf{k}"), "orders", 10, Some(4)).await;
                k += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            k
        })
    };
    p.break_queue(F, CallError::transport("connection refused"));
    wait_for("the lane spools", Duration::from_secs(30), || async { spooled(&relay.metrics.render()) }).await;
    p.fix_queue(F);
    wait_for("the lane streams again while the writer writes", Duration::from_secs(30), || async {
        !spooled(&relay.metrics.render())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches = writer.await.unwrap();
    let delivered = || {
        let sent: HashSet<String> = p.sent(F).into_iter().map(|s| s.body).collect();
        sent.len()
    };
    wait_for("every row delivered", Duration::from_secs(60), || async { delivered() == batches * 10 }).await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    // Per group, in the order first sent: ascending ids (rows of a group are
    // inserted in id order).
    let mut seen = HashSet::new();
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    for s in p.sent(F) {
        if !seen.insert(s.body.clone()) {
            continue;
        }
        let g = s.group_id.clone().expect("a FIFO entry has a group");
        let id = s.outbox_id.expect("a row of the relay's table");
        let prev = last.insert(g.clone(), id);
        assert!(prev.is_none_or(|p| p < id), "group {g}: id {id} sent after {prev:?}");
    }
    relay.stop().await;
}
