//! The invariants of DESIGN.md where two features cross: a row gone from the
//! table is settled only by its send or by writing it back (transient rows
//! the stream does not recognise as such, a shard's insert-only stream); a
//! replayed or settled row is matched to its own row whatever happened to
//! ids since; a hung host of several does not block connections.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use outbox_relay::config::PublishedRows;
use outbox_relay::event::OutboxEvent;
use outbox_relay::pipeline::settle::{mark, Marking, Outcome, Settlement};
use outbox_relay::policy::dead::{DeadCode, DeadReason};
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::CallError;

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
    let mut cfg = config(db, &[("orders", Q)]);
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    cfg
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
    let relay = start(quick_spool(&db), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
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
    let relay = start(config(&db, &[("orders", Q)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    insert_rows(&c, "old", "orders", 300, None).await;
    wait_for("the first rows delivered", Duration::from_secs(30), || async { bodies(&p, "old:").len() == 300 }).await;
    // While streaming: the same ids again, twice.
    c.batch_execute("TRUNCATE outbox RESTART IDENTITY").await.unwrap();
    insert_rows(&c, "again", "orders", 300, None).await;
    wait_for("rows with reused ids delivered", Duration::from_secs(30), || async { bodies(&p, "again:").len() == 300 })
        .await;
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
    Marking { base: Duration::from_secs(1), max: Duration::from_secs(2), published }
}

/// Row `id` (event `event_id`) as the stream read it, committed at `commit`.
fn read(id: i64, event_id: &str, commit: u64) -> Arc<OutboxEvent> {
    Arc::new(OutboxEvent {
        id,
        event_id: event_id.into(),
        destination: "orders".into(),
        body: event_id.into(),
        group_key: None,
        attributes: None,
        commit_time_us: 0,
        xid: None,
        commit_lsn: Some(replication::Lsn(commit)),
        transient: false,
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
        mark(&c, &[s], marking(published)).await.unwrap();
        assert_eq!(db.count("id = 7 AND event_id = 'new' AND status = 'NEW'").await, 1, "{published:?}");
    }
    let dead = Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "refused"));
    let s = Settlement::new(read(7, "old", commit), None, Arc::from("orders"), dead);
    let report = mark(&c, &[s], marking(PublishedRows::Delete)).await.unwrap();
    assert_eq!(report.restored, 1, "{report:?}");
    assert_eq!(db.count("id = 7 AND event_id = 'new' AND status = 'NEW'").await, 1);
    assert_eq!(db.count("id <> 7 AND event_id = 'old' AND status = 'DEAD' AND last_error LIKE '%refused%'").await, 1);
    // The same settlement again (a replay) writes nothing twice.
    let dead = Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "refused"));
    let s = Settlement::new(read(7, "old", commit), None, Arc::from("orders"), dead);
    mark(&c, &[s], marking(PublishedRows::Delete)).await.unwrap();
    assert_eq!(db.count("event_id = 'old'").await, 1);
}

/// A deferred row that is gone and that a run written after its commit
/// proves published is not written back; one no run proves is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_row_is_written_back_unless_proven_published() {
    let db = TestDb::new("proof").await;
    let c = db.client().await;
    let commit =
        c.query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[]).await.unwrap().get::<_, i64>(0) as u64;
    c.batch_execute("INSERT INTO outbox_published_runs (lo, hi) VALUES (10, 20)").await.unwrap();
    let deferred = || Outcome::Deferred("spooled".into(), outbox_relay::pipeline::settle::Due::Backoff);
    let batch = vec![
        Settlement::new(read(15, "proven", commit), None, Arc::from("orders"), deferred()),
        Settlement::new(read(25, "unproven", commit), None, Arc::from("orders"), deferred()),
        // Committed after the run: the run is about an earlier row with its id.
        Settlement::new(read(12, "later", u64::MAX / 2), None, Arc::from("orders"), deferred()),
    ];
    let report = mark(&c, &batch, marking(PublishedRows::Delete)).await.unwrap();
    assert_eq!((report.gone, report.restored), (1, 2), "{report:?}");
    assert_eq!(db.count("event_id IN ('unproven', 'later') AND next_attempt_at IS NOT NULL").await, 2);
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
    let relay = start(quick_spool(&db), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
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
