//! Routing by a queue-URL template: a destination that is not configured is
//! looked up on first use (its lane, and its table lane, made then); one
//! whose queue does not exist, or whose name no queue can have, is DEAD with
//! that reason and holds nothing else back.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::Mode;
use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::template::AddressTemplate;
use outbox_relay::publish::CallError;
use testkit::*;

const BASE: &str = "http://memory.invalid/q/";

fn url(name: &str) -> String {
    format!("{BASE}{name}")
}

/// A relay with no `[destinations]`, every queue from the template.
fn templated(db: &TestDb, mode: Mode) -> outbox_relay::config::Config {
    // testkit's config wants a destination: none is kept.
    let mut cfg = config(db, &[("none", &url("none"))]);
    cfg.destinations.clear();
    cfg.destination_template = Some(AddressTemplate::new(&format!("{BASE}{{destination}}"), "r").unwrap());
    cfg.mode = mode;
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(100);
    cfg.retry_max = Duration::from_millis(500);
    cfg.poll_interval = Duration::from_millis(100);
    cfg
}

fn publisher(names: &[&str]) -> MemoryPublisher {
    let p = MemoryPublisher::new();
    for n in names {
        p.add_queue(&url(n), n.ends_with(".fifo"), 262_144);
    }
    p
}

fn bodies(p: &MemoryPublisher, name: &str) -> HashSet<String> {
    p.sent(&url(name)).into_iter().map(|s| s.body).collect()
}

async fn settled(db: &TestDb) {
    let after = db.current_lsn().await;
    wait_for("the slot confirmed past every row", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
}

/// From the stream: rows of the relay's table and of a `topic-payload`
/// table routed to queues named by their value; the missing queue and the
/// impossible name DEAD with `queue_not_found`, without holding the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_routes_each_new_destination_to_its_queue() {
    let db = TestDb::new("route_tmpl").await;
    let c = db.client().await;
    crate::topic_payload::topic_payload_table(&db, true).await;
    let names: Vec<String> = (0..20).map(|i| format!("tenant-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let p = publisher(&refs);
    let mut cfg = templated(&db, Mode::Cdc);
    cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "outbox_messages")];
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    for n in &names {
        insert_rows(&c, &format!("own-{n}"), n, 5, None).await;
    }
    insert_rows(&c, "lost", "nosuch", 3, None).await;
    insert_rows(&c, "bad", "a/../b", 2, None).await;
    c.batch_execute(
        "INSERT INTO outbox_messages (topic, payload)
         SELECT 'tenant-' || (i % 20), jsonb_build_object('e', 'tp:' || i) FROM generate_series(1, 100) i;
         INSERT INTO outbox_messages (topic, payload) VALUES ('nosuch', '{\"e\": \"tp:lost\"}');",
    )
    .await
    .unwrap();
    settled(&db).await;
    for (i, n) in names.iter().enumerate() {
        let got = bodies(&p, n);
        for k in 1..=5 {
            assert!(got.contains(&format!("own-{n}:{k}")), "{n}: own-{n}:{k}");
        }
        let tp = got.iter().filter(|b| b.contains("\"tp:")).count();
        assert_eq!(tp, 5, "{n} (tenant {i}): its topic-payload rows");
    }
    let dead = "status = 'DEAD' AND last_error LIKE 'queue_not_found%";
    assert_eq!(db.count(&format!("{dead}nosuch%'")).await, 4, "the missing queue's rows, both tables");
    assert_eq!(db.count(&format!("{dead}cannot name a queue%'")).await, 2);
    assert_eq!(db.count("status = 'NEW'").await, 0);
    relay.stop().await;
}

/// A destination looked up on first use whose queue fails: its lane spools
/// to the table, a table lane made for it drains the rows once the queue is
/// back, and a relay started again finds its rows and looks it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looked_up_destination_spools_and_drains_like_a_configured_one() {
    let db = TestDb::new("route_spool").await;
    let c = db.client().await;
    let p = publisher(&["alpha", "beta"]);
    let relay = start(templated(&db, Mode::Cdc), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    insert_rows(&c, "a0", "alpha", 10, None).await;
    insert_rows(&c, "b0", "beta", 10, None).await;
    settled(&db).await;
    p.break_queue(&url("beta"), CallError::transport("connection refused"));
    insert_rows(&c, "b1", "beta", 50, None).await;
    insert_rows(&c, "a1", "alpha", 50, None).await;
    wait_for("beta's rows wait in the table", Duration::from_secs(30), || async {
        db.count("destination = 'beta' AND status = 'NEW' AND next_attempt_at IS NOT NULL").await > 0
    })
    .await;
    settled(&db).await;
    relay.stop().await;
    insert_rows(&c, "b2", "beta", 20, None).await;
    p.fix_queue(&url("beta"));
    let relay = start(templated(&db, Mode::Cdc), Arc::new(p.clone()));
    wait_for("every beta row sent", Duration::from_secs(60), || async {
        let got = bodies(&p, "beta");
        (1..=50).all(|k| got.contains(&format!("b1:{k}"))) && (1..=20).all(|k| got.contains(&format!("b2:{k}")))
    })
    .await;
    wait_for("the table drained", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    let alpha = bodies(&p, "alpha");
    assert!((1..=50).all(|k| alpha.contains(&format!("a1:{k}"))), "alpha went on while beta spooled");
    relay.stop().await;
}

/// Polling mode: destinations found in the table are looked up by the
/// sweeper, and each gets its table lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_looks_destinations_up_from_the_table() {
    let db = TestDb::new("route_poll").await;
    let c = db.client().await;
    let p = publisher(&["alpha", "beta.fifo"]);
    insert_rows(&c, "a", "alpha", 30, None).await;
    insert_rows(&c, "f", "beta.fifo", 30, Some(3)).await;
    insert_rows(&c, "x", "nosuch", 2, None).await;
    let relay = start(templated(&db, Mode::Polling), Arc::new(p.clone()));
    wait_for("every row settled", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    assert_eq!(bodies(&p, "alpha").len(), 30);
    assert_eq!(bodies(&p, "beta.fifo").len(), 30);
    assert_eq!(db.count("status = 'DEAD' AND last_error LIKE 'queue_not_found%'").await, 2);
    relay.stop().await;
}

/// Polling mode, 200 destinations with rows waiting (20 of them FIFO) and
/// `max_table_connections = 4`: their table lanes take turns on the shared
/// connections, never holding more than 4 beside the relay's fixed ones,
/// and every row is sent, each FIFO group in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_many_destinations_share_a_few_connections() {
    let db = TestDb::new("route_poll_many").await;
    let c = db.client().await;
    let names: Vec<String> =
        (0..200).map(|i| if i % 10 == 0 { format!("pm-{i}.fifo") } else { format!("pm-{i}") }).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let p = publisher(&refs);
    let mut cfg = templated(&db, Mode::Polling);
    cfg.max_table_connections = 4;
    let relay = start(cfg, Arc::new(p.clone()));
    // The relay's fixed connections, once it runs with nothing to claim.
    wait_for("the relay polls", Duration::from_secs(30), || async { !relay_connections(&db).await.is_empty() }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fixed = relay_connections(&db).await.len();
    for n in &names {
        insert_rows(&c, n, n, 5, n.ends_with(".fifo").then_some(2)).await;
    }
    let mut peak = 0;
    let end = std::time::Instant::now() + Duration::from_secs(120);
    while db.count("status = 'NEW'").await > 0 {
        assert!(std::time::Instant::now() < end, "rows still NEW after 120 s");
        peak = peak.max(relay_connections(&db).await.len());
        assert!(relay.metrics.table_connections.get() <= 4);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Beside the fixed ones, the sweeper that looks destinations up opens
    // one once rows name them; a connection per lane would be 200.
    assert!(peak <= fixed + 1 + 4, "at most 4 table connections: {peak} in all, {fixed} fixed");
    assert!(peak > fixed + 1, "the lanes used the pool: {peak} in all, {fixed} fixed");
    for n in &names {
        let sent: Vec<String> = p.sent(&url(n)).into_iter().map(|m| m.body).collect();
        let expected: Vec<String> = (1..=5).map(|i| format!("{n}:{i}")).collect();
        if n.ends_with(".fifo") {
            for g in 0..2 {
                let of = |v: &[String]| -> Vec<String> {
                    v.iter()
                        .filter(|b| b.rsplit(':').next().unwrap().parse::<usize>().unwrap() % 2 == g)
                        .cloned()
                        .collect()
                };
                assert_eq!(of(&sent), of(&expected), "{n}: group {g} in order");
            }
        } else {
            assert_eq!(sent.iter().collect::<HashSet<_>>(), expected.iter().collect::<HashSet<_>>(), "{n}");
        }
    }
    relay.stop().await;
}

/// The relay's connections to this test's database: each one's last query.
async fn relay_connections(db: &TestDb) -> Vec<String> {
    let c = db.client().await;
    let rows = c
        .query(
            "SELECT left(query, 60) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Three hundred destinations, each looked up on first use: they stream
/// with a handful of connections between them (no table lane each); one
/// whose queue fails gets a table lane for its spool, which drains it once
/// the queue is back and ends when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_destinations_stream_on_a_few_connections() {
    let db = TestDb::new("route_many").await;
    let c = db.client().await;
    let names: Vec<String> = (0..300).map(|i| format!("tenant-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let p = publisher(&refs);
    let relay = start(templated(&db, Mode::Cdc), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    c.execute(
        "INSERT INTO outbox (event_id, destination, body)
         SELECT 'm:' || i, 'tenant-' || (i % 300), 'm:' || i FROM generate_series(1, 900) i",
        &[],
    )
    .await
    .unwrap();
    settled(&db).await;
    assert_eq!(names.iter().map(|n| bodies(&p, n).len()).sum::<usize>(), 900);
    assert_eq!(relay.metrics.table_lanes.get(), 0, "no table lane while every destination streams");
    let who = relay_connections(&db).await;
    assert!(who.len() <= 12, "a fixed few, whatever the destinations: {who:?}");

    p.break_queue(&url("tenant-7"), CallError::transport("connection refused"));
    insert_rows(&c, "late", "tenant-7", 20, None).await;
    wait_for("tenant-7's rows wait in the table", Duration::from_secs(30), || async {
        db.count("destination = 'tenant-7' AND status = 'NEW' AND next_attempt_at IS NOT NULL").await > 0
    })
    .await;
    wait_for("a table lane for its spool", Duration::from_secs(30), || async { relay.metrics.table_lanes.get() == 1 })
        .await;
    p.fix_queue(&url("tenant-7"));
    wait_for("the spool drained", Duration::from_secs(60), || async {
        let got = bodies(&p, "tenant-7");
        (1..=20).all(|k| got.contains(&format!("late:{k}"))) && db.count("status = 'NEW'").await == 0
    })
    .await;
    wait_for("the drain's lane ended", Duration::from_secs(30), || async { relay.metrics.table_lanes.get() == 0 })
        .await;
    assert!(relay_connections(&db).await.len() <= 12);
    relay.stop().await;
}

/// Lanes idle for `lane_idle_timeout` close, on a quiet database too (the
/// heartbeat's transactions are all the stream says), and their
/// destinations' next rows open them again: each message sent once, a FIFO
/// group in commit order across the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_lanes_close_and_their_next_rows_open_them_again() {
    let db = TestDb::new("route_idle").await;
    let c = db.client().await;
    let mut names: Vec<String> = (0..50).map(|i| format!("idle-{i}")).collect();
    names.push("idle.fifo".into());
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let p = publisher(&refs);
    let mut cfg = templated(&db, Mode::Cdc);
    cfg.lane_idle_timeout = Duration::from_secs(1);
    cfg.heartbeat_interval = Duration::from_millis(500);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    for round in ["r1", "r2"] {
        for n in &names {
            insert_rows(&c, &format!("{n}-{round}"), n, 4, n.ends_with(".fifo").then_some(1)).await;
        }
        settled(&db).await;
        wait_for("every lane closed", Duration::from_secs(30), || async { relay.metrics.stream_lanes.get() == 0 })
            .await;
    }
    for n in &names {
        let sent: Vec<String> = p.sent(&url(n)).into_iter().map(|m| m.body).collect();
        let expected: Vec<String> =
            ["r1", "r2"].iter().flat_map(|r| (1..=4).map(move |i| format!("{n}-{r}:{i}"))).collect();
        if n.ends_with(".fifo") {
            assert_eq!(sent, expected, "one group, in commit order across the close");
        } else {
            assert_eq!(sent.iter().collect::<HashSet<_>>(), expected.iter().collect::<HashSet<_>>());
            assert_eq!(sent.len(), 8, "each sent once");
        }
    }
    relay.stop().await;
}

/// A publisher whose lookup of one queue takes `slow` (the rest as `inner`).
struct SlowLookup {
    inner: MemoryPublisher,
    queue: String,
    slow: Duration,
}

#[async_trait::async_trait]
impl outbox_relay::publish::Publisher for SlowLookup {
    async fn describe(
        &self,
        kind: outbox_relay::publish::kind::Kind,
        url: &str,
    ) -> Result<outbox_relay::publish::kind::Target, CallError> {
        if url == self.queue {
            tokio::time::sleep(self.slow).await;
        }
        self.inner.describe(kind, url).await
    }

    async fn send_batch(
        &self,
        target: &outbox_relay::publish::kind::Target,
        entries: &[outbox_relay::publish::entry::Entry],
    ) -> Result<Vec<outbox_relay::publish::EntryResult>, CallError> {
        self.inner.send_batch(target, entries).await
    }
}

/// A destination whose lookup is slow holds nothing else: rows committed
/// after its first row reach other new destinations while it is looked up,
/// and its own rows follow in order once it is found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lookup_holds_only_its_own_destination() {
    let db = TestDb::new("route_slow").await;
    let c = db.client().await;
    let p = publisher(&["slow.fifo", "quick"]);
    let slow = Duration::from_secs(3);
    let publisher = SlowLookup { inner: p.clone(), queue: url("slow.fifo"), slow };
    let relay = start(templated(&db, Mode::Cdc), Arc::new(publisher));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let started = std::time::Instant::now();
    insert_rows(&c, "s0", "slow.fifo", 5, Some(1)).await;
    insert_rows(&c, "q0", "quick", 5, None).await;
    insert_rows(&c, "s1", "slow.fifo", 5, Some(1)).await;
    wait_for("quick's rows sent", Duration::from_secs(30), || async { bodies(&p, "quick").len() == 5 }).await;
    assert!(started.elapsed() < slow, "quick waited for slow's lookup: {:?}", started.elapsed());
    assert!(bodies(&p, "slow.fifo").is_empty(), "slow is still being looked up");
    wait_for("slow's rows sent", Duration::from_secs(30), || async { bodies(&p, "slow.fifo").len() == 10 }).await;
    let order: Vec<String> = p.sent(&url("slow.fifo")).into_iter().map(|m| m.body).collect();
    let expected: Vec<String> = ["s0", "s1"].iter().flat_map(|t| (1..=5).map(move |i| format!("{t}:{i}"))).collect();
    assert_eq!(order, expected, "one FIFO group, in commit order behind the lookup");
    settled(&db).await;
    relay.stop().await;
}
