//! Kill -9 the leading relay while rows flow; a standby (same config) takes
//! over. Used by tests/it/ha.rs (once) and examples/takeover.rs (ten times).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::process::{RelayConfig, RelayProcess};
use crate::*;

async fn active_pid(db: &TestDb) -> Option<i32> {
    db.client()
        .await
        .query_opt("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", &[&db.slot])
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// Wait until another walsender than `leader_pid` reads the slot; panics at `end`.
async fn standby_reads(db: &TestDb, leader_pid: i32, end: Instant) {
    loop {
        if let Some(p) = active_pid(db).await {
            if p != leader_pid {
                return;
            }
        }
        assert!(Instant::now() < end, "no standby took over within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// At-least-once: a kill -9 mid-send duplicates what was in flight, so
/// receive until `total` distinct rows came (not until `total` messages did),
/// 120 s at most.
async fn receive_distinct(sqs: &AwsPublisher, q: &str, total: usize) -> HashSet<String> {
    let mut unique: HashSet<String> = HashSet::new();
    let end = Instant::now() + Duration::from_secs(120);
    while unique.len() < total && Instant::now() < end {
        unique.extend(
            receive_all(sqs, q, total - unique.len(), Duration::from_secs(5)).await.into_iter().map(|(b, _)| b),
        );
    }
    unique
}

/// Takeover times (kill to the slot being read again), one per kill, and
/// whether every row arrived.
pub async fn run(kills: usize) -> (Vec<Duration>, usize, usize) {
    let db = TestDb::new("takeover").await;
    // Published rows are deleted: the audit copy knows every committed one.
    db.audit_inserts().await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "takeover", false, None).await;
    let config = RelayConfig::new(&db, "cdc", &[("orders", &q)], "takeover_timeout = \"10s\"");
    let mut relays: Vec<RelayProcess> = vec![config.spawn()];
    wait_for("first leader streams", Duration::from_secs(30), || async { active_pid(&db).await.is_some() }).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, stop) = (db.client().await, std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                insert_rows(&c, &format!("t{k}"), "orders", 20, None).await;
                k += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let mut times = Vec::new();
    for _ in 0..kills {
        relays.push(config.spawn()); // the standby
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let leader_pid = active_pid(&db).await.expect("a leader streams");
        // The relay process behind the walsender: the one that is not the newest standby.
        let leader = relays.remove(0);
        let killed_at = Instant::now();
        leader.kill(); // SIGKILL
        standby_reads(&db, leader_pid, killed_at + Duration::from_secs(30)).await;
        times.push(killed_at.elapsed());
    }
    // The writer finishes the insert it is in: every row is counted below.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.unwrap();
    let c = db.client().await;
    let total = c.query_one("SELECT count(*) FROM outbox_audit", &[]).await.unwrap().get::<_, i64>(0) as usize;
    wait_for("every row published", Duration::from_secs(120), || async { db.count("status = 'NEW'").await == 0 }).await;
    let unique = receive_distinct(&sqs, &q, total).await;
    for r in relays {
        r.kill();
    }
    let committed: HashSet<String> =
        c.query("SELECT body FROM outbox_audit", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    let strays = unique.difference(&committed).count();
    assert_eq!(strays, 0, "only committed rows reach the queue");
    (times, total, unique.len())
}
