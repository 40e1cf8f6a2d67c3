//! Primary failover: a primary and a physical standby of the major under
//! test (`PG_MAJOR`), rows streaming through the relay, the primary killed
//! mid-stream and the standby promoted. The relay is given both servers
//! (`postgres://…@primary,standby/db`) and follows the promotion. On 17+ the
//! slot is created with FAILOVER and synced to the standby: the relay resumes
//! from it, no catch-up. Before 17 the new primary has no slot: the relay
//! creates one and catches up from the table. Either way every row the new
//! primary holds is delivered.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_relay::config::{Config, FileConfig, Overrides, PublishedRows};
use outbox_relay::db;
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::cluster::*;
use testkit::*;

/// The pair's directory, servers stopped and removed when dropped.
struct Pair {
    primary: Node,
    standby: Node,
    major: u32,
    _dir: ClusterDir,
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.primary.kill();
        self.standby.kill();
    }
}

/// A primary with the outbox migrated (and audited) in database `app`, and
/// a physical standby made from a copy of its cleanly stopped data directory,
/// streaming through the physical slot `sb` (syncing logical slots on 17+).
async fn build_pair() -> Pair {
    let dir = ClusterDir::new("outbox-relay-failover");
    let primary = Node::init(&dir.0, "primary");
    let standby = Node { bin: primary.bin.clone(), data: dir.0.join("standby"), port: free_port() };
    primary.start(&[]);
    let admin = db::connect(&primary.url("postgres")).await.unwrap();
    let major: u32 = admin
        .query_one("SELECT current_setting('server_version_num')::int / 10000", &[])
        .await
        .unwrap()
        .get::<_, i32>(0) as u32;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin.batch_execute("SELECT pg_create_physical_replication_slot('sb')").await.unwrap();
    drop(admin);
    let mut c = db::connect(&primary.url("app")).await.unwrap();
    db::schema::migrate(&mut c).await.unwrap();
    c.batch_execute(
        "CREATE TABLE outbox_audit (event_id text);
         CREATE FUNCTION outbox_audit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO outbox_audit VALUES (NEW.event_id); RETURN NEW; END $$;
         CREATE TRIGGER outbox_audit AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_audit();",
    )
    .await
    .unwrap();
    drop(c);
    primary.stop("fast");
    ok(Command::new("cp").arg("-a").arg(&primary.data).arg(&standby.data), "copy the data directory");
    std::fs::write(standby.data.join("standby.signal"), "").unwrap();
    let mut primary_settings = vec![];
    let mut standby_settings = vec![
        format!("primary_conninfo='host=127.0.0.1 port={} user=postgres dbname=app'", primary.port),
        "primary_slot_name=sb".to_string(),
    ];
    if major >= 17 {
        primary_settings.push("synchronized_standby_slots=sb".to_string());
        standby_settings.push("sync_replication_slots=on".to_string());
    }
    primary.start(&primary_settings);
    standby.start(&standby_settings);
    Pair { primary, standby, major, _dir: dir }
}

fn relay_config(pair: &Pair, queue: &str) -> Config {
    let url = format!("postgres://postgres@127.0.0.1:{},127.0.0.1:{}/app", pair.primary.port, pair.standby.port);
    let keys = [
        ("database_url", url.as_str()),
        ("slot", "failover_slot"),
        ("heartbeat_interval", "200ms"),
        ("connect_timeout", "2s"),
        ("query_timeout", "5s"),
        ("failover", if pair.major >= 17 { "true" } else { "false" }),
    ];
    let file = FileConfig::of(&keys, &[("d", queue)]).unwrap();
    let mut cfg = Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap();
    cfg.published_rows = PublishedRows::Delete;
    cfg
}

/// Insert batches of 20 rows every 20 ms into `url` until told to stop or the
/// server goes; returns how many batches committed.
fn writer(url: String, prefix: &'static str, stop: Arc<std::sync::atomic::AtomicBool>) -> tokio::task::JoinHandle<u32> {
    tokio::spawn(async move {
        let Ok(c) = db::connect(&url).await else { return 0 };
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if c.execute(
                "INSERT INTO outbox (event_id, destination, body) SELECT $1 || i, 'd', $1 || i FROM generate_series(1, 20) i",
                &[&format!("{prefix}{n}:")],
            )
            .await
            .is_err()
            {
                break;
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        n
    })
}

fn delivered(publisher: &MemoryPublisher, queue: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for s in publisher.sent(queue) {
        *m.entry(s.event_id).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_follows_a_promoted_standby_and_delivers_every_row_it_holds() {
    let pair = build_pair().await;
    let queue = "http://memory.invalid/000000000000/failover";
    let publisher = MemoryPublisher::new();
    publisher.add_queue(queue, false, 262_144);
    let tenant = |t: &str| format!("http://memory.invalid/000000000000/{t}");
    for t in ["tenant_a", "tenant_b"] {
        publisher.add_queue(&tenant(t), false, 262_144);
    }
    let mut cfg = relay_config(&pair, queue);
    // Destinations beside `d` are looked up by the template on first use,
    // before the failover and after it.
    cfg.destination_template =
        Some(outbox_relay::publish::template::AddressTemplate::new(&tenant("{destination}"), "r").unwrap());
    let max_in_flight = cfg.max_unsettled_events;
    let relay = start(cfg, Arc::new(publisher.clone()));

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let before = writer(pair.primary.url("app"), "before", Arc::clone(&stop));
    wait_for("rows streaming from the primary", Duration::from_secs(60), || {
        let p = publisher.clone();
        async move { delivered(&p, queue).len() >= 200 }
    })
    .await;
    let tenant_rows = |url: String, prefix: &'static str, t: &'static str| async move {
        let c = db::connect(&url).await.unwrap();
        insert_rows(&c, prefix, t, 10, None).await;
    };
    let arrived =
        |t: &str, prefix: &str| publisher.sent(&tenant(t)).iter().filter(|s| s.body.starts_with(prefix)).count();
    tenant_rows(pair.primary.url("app"), "tenant_a_before", "tenant_a").await;
    wait_for("a looked-up destination's rows sent", Duration::from_secs(30), || async {
        arrived("tenant_a", "tenant_a_before") == 10
    })
    .await;
    // The standby alone is refused, with the fix.
    let mut only_standby = relay_config(&pair, queue);
    only_standby.database_url = pair.standby.url("app");
    only_standby.slot = "other_slot".into();
    let err = start_up_error(only_standby, Arc::new(publisher.clone())).await;
    assert!(err.contains("is a standby or read-only") && err.contains("needs the primary"), "{err}");
    let standby = db::connect(&format!("{}?target_session_attrs=any", pair.standby.url("app"))).await.unwrap();
    if pair.major >= 17 {
        wait_for("the slot synced to the standby", Duration::from_secs(60), || {
            let s = &standby;
            async move {
                s.query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'failover_slot' AND synced AND NOT temporary",
                    &[],
                )
                .await
                .unwrap()
                .is_some()
            }
        })
        .await;
    }
    // Mid-stream: the writer is still writing.
    let seen = delivered(&publisher, queue).len();
    wait_for("more rows streaming", Duration::from_secs(30), || {
        let p = publisher.clone();
        async move { delivered(&p, queue).len() >= seen + 20 }
    })
    .await;
    if pair.major >= 17 {
        let r = standby
            .query_one(
                "SELECT restart_lsn::text, confirmed_flush_lsn::text, pg_last_wal_replay_lsn()::text
                   FROM pg_replication_slots WHERE slot_name = 'failover_slot'",
                &[],
            )
            .await
            .unwrap();
        let (restart, flush, replayed): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        println!("synced slot before the kill: restart_lsn {restart}, confirmed_flush_lsn {flush}; standby replayed to {replayed}");
    }
    pair.primary.stop("immediate");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches_before = before.await.unwrap();
    drop(standby);
    pair.standby.promote();
    let promoted = Instant::now();
    tracing::info!("standby promoted");

    // Rows written on the new primary after the promotion.
    let stop_after = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let after = writer(pair.standby.url("app"), "after", Arc::clone(&stop_after));
    wait_for("a row written after the promotion published", Duration::from_secs(90), || {
        let p = publisher.clone();
        async move { delivered(&p, queue).keys().any(|k| k.starts_with("after")) }
    })
    .await;
    let first_row_after = promoted.elapsed();
    wait_for("rows streaming from the new primary", Duration::from_secs(30), || {
        let p = publisher.clone();
        async move { delivered(&p, queue).keys().filter(|k| k.starts_with("after")).count() >= 20 }
    })
    .await;
    stop_after.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches_after = after.await.unwrap();
    // Looked up before the failover (known) and after it (first use).
    tenant_rows(pair.standby.url("app"), "tenant_a_after", "tenant_a").await;
    tenant_rows(pair.standby.url("app"), "tenant_b_after", "tenant_b").await;
    wait_for("looked-up destinations' rows sent from the new primary", Duration::from_secs(30), || async {
        arrived("tenant_a", "tenant_a_after") >= 10 && arrived("tenant_b", "tenant_b_after") >= 10
    })
    .await;

    // Every row the new primary holds is delivered.
    let c = db::connect(&pair.standby.url("app")).await.unwrap();
    let held: HashSet<String> = c
        .query("SELECT event_id FROM outbox_audit WHERE event_id NOT LIKE 'tenant%'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    wait_for("every row the new primary holds delivered", Duration::from_secs(90), || {
        let (p, held) = (publisher.clone(), &held);
        async move {
            let d = delivered(&p, queue);
            held.iter().all(|e| d.contains_key(e))
        }
    })
    .await;
    let d = delivered(&publisher, queue);
    let duplicates: usize = d.values().map(|n| n - 1).sum();
    let recreated = relay.metrics.slot_recreated.with_label_values(&["dropped"]).get();
    println!(
        "PostgreSQL {}: {} rows held by the new primary ({} batches before the kill, {} after the promotion), all delivered; \
         {duplicates} duplicates; slot recreated {recreated} time(s); promotion to the first row published from the new primary: {} ms",
        pair.major,
        held.len(),
        batches_before,
        batches_after,
        first_row_after.as_millis()
    );
    if pair.major >= 17 {
        // The synced slot: no catch-up, duplicates at most what was in flight.
        assert_eq!(recreated, 0, "the synced slot was used, not recreated");
        assert!(duplicates <= max_in_flight, "{duplicates} duplicates");
    } else {
        assert!(recreated >= 1, "the new primary had no slot: it was created with the catch-up");
    }
    // The new primary's slot now follows what was published.
    let slot: Option<bool> = c
        .query_opt("SELECT active FROM pg_replication_slots WHERE slot_name = 'failover_slot'", &[])
        .await
        .unwrap()
        .map(|r| r.get(0));
    assert_eq!(slot, Some(true), "the relay streams from the new primary's slot");
    if pair.major >= 17 {
        let failover: bool = c
            .query_one("SELECT failover FROM pg_replication_slots WHERE slot_name = 'failover_slot'", &[])
            .await
            .unwrap()
            .get(0);
        assert!(failover, "the slot keeps FAILOVER on the new primary");
    }
    relay.stop().await;
}

/// Resets `synchronized_standby_slots` on the shared server when dropped.
struct StandbySlotsSetting(String);

impl StandbySlotsSetting {
    async fn set(url: &str, value: &str) -> StandbySlotsSetting {
        let c = db::connect(url).await.unwrap();
        c.batch_execute(&format!("ALTER SYSTEM SET synchronized_standby_slots = '{value}'")).await.unwrap();
        c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        StandbySlotsSetting(url.to_string())
    }
}

impl Drop for StandbySlotsSetting {
    fn drop(&mut self) {
        let url = self.0.clone();
        let reset = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let c = db::connect(&url).await.unwrap();
                c.batch_execute("ALTER SYSTEM RESET synchronized_standby_slots").await.unwrap();
                c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
            })
        });
        let _ = reset.join();
    }
}

/// PostgreSQL 17+: a failover slot while `synchronized_standby_slots` names
/// a slot the server lacks (a standby promoted with the old primary's
/// setting): the server holds the walsender for ever. The relay names the
/// setting (log, `outbox_relay_stream_held`, `status`), publishes the rows
/// from the table meanwhile, and streams again once the setting is fixed.
/// Before 17 there are no failover slots and no such hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_slot_the_server_lacks_is_named_and_rows_go_by_the_table() {
    let db = TestDb::new("standby_hold").await;
    let c = db.client().await;
    let version: i32 = c.query_one("SHOW server_version_num", &[]).await.unwrap().get::<_, String>(0).parse().unwrap();
    if version < 170_000 {
        eprintln!("PostgreSQL {version}: no failover slots before 17, nothing to hold");
        return;
    }
    let q = "http://memory.invalid/orders";
    let p = MemoryPublisher::new();
    p.add_queue(q, false, 262_144);
    let mut cfg = config(&db, &[("orders", q)]);
    cfg.failover = true;
    cfg.lane_stall_timeout = Duration::from_secs(1);
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let held = |m: &str| m.lines().any(|l| l == "outbox_relay_stream_held 1");
    let sent = |p: &MemoryPublisher, prefix: &str| p.sent(q).iter().filter(|s| s.body.starts_with(prefix)).count();
    let setting = StandbySlotsSetting::set(&stack().pg_url, "ghost_standby").await;
    insert_rows(&c, "hold", "orders", 100, None).await;
    wait_for("the hold named", Duration::from_secs(30), || async { held(&relay.metrics.render()) }).await;
    let status = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    let why = status.slot.held_back.unwrap_or_default();
    assert!(why.contains("ghost_standby") && why.contains("synchronized_standby_slots"), "{why}");
    wait_for("rows delivered by the table path", Duration::from_secs(30), || async { sent(&p, "hold:") == 100 }).await;
    drop(setting);
    wait_for("the stream flows again", Duration::from_secs(30), || async { !held(&relay.metrics.render()) }).await;
    insert_rows(&c, "after", "orders", 20, None).await;
    wait_for("rows after delivered", Duration::from_secs(30), || async { sent(&p, "after:") == 20 }).await;
    wait_for("nothing left NEW", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    relay.stop().await;
}
