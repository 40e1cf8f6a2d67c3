//! Scenario 7: PostgreSQL restarted in immediate mode under a streaming relay.

use super::*;

fn restart_postgres() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/dev-stack");
    let st = Command::new("bash").arg(script).arg("pg-restart").stdout(Stdio::null()).status().unwrap();
    assert!(st.success(), "scripts/dev-stack pg-restart failed");
}

pub(super) async fn postgres_restart(p: &Params) -> Counters {
    let db = TestDb::new("pgrestart").await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let (qa, qb) = (create_queue(&sqs, "ra", false, None).await, create_queue(&sqs, "rb", false, None).await);
    let urls = vec![qa.clone(), qb.clone()];
    let cfg = RelayConfig::new(&db, "cdc", &[("a", &qa), ("b", &qb)], "");
    let mut relay = cfg.spawn();
    wait_for("the relay streams", Duration::from_secs(60), || async { slot_active(&db).await }).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut reconnect_ms = Vec::new();
    let mut exits = 0u64;
    for rep in 0..p.repetitions {
        let stop = Arc::new(AtomicBool::new(false));
        let writer = restart_writer(&db.url, rep, Arc::clone(&stop));
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::task::spawn_blocking(restart_postgres).await.unwrap();
        c.killed += 1;
        if let Some(ms) = streaming_again_ms(&db, Instant::now()).await {
            reconnect_ms.push(ms);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, Ordering::Relaxed);
        writer.await.unwrap();
        let filter = format!("event_id LIKE 'r{rep}k%'");
        if settle_repetition(&db, &cfg, &mut relay, &filter, rep).await {
            exits += 1;
        }
        let expected = bodies(&db, &filter).await;
        c.committed += expected.len() as u64;
        let got = collect(&sqs, &urls, &expected, Duration::from_secs(60)).await;
        tally(&mut c, &expected, &got);
    }
    relay.terminate(Duration::from_secs(15)).await;
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    c.extra.insert("relay_exits".into(), exits as f64);
    c.extra.insert("reconnect_ms_p50".into(), round1(percentile(&mut reconnect_ms.clone(), 0.5)));
    c.extra.insert("reconnect_ms_max".into(), round1(percentile(&mut reconnect_ms, 1.0)));
    c
}

/// A writer that commits a transaction every 20 ms, before, during and after
/// the restart of repetition `rep`, reconnecting until `stop`; failed or
/// uncertain commits are settled by looking at the table afterwards.
fn restart_writer(url: &str, rep: usize, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let mut k = 0;
        while !stop.load(Ordering::Relaxed) {
            if let Ok(c) = outbox_relay::db::connect(&url).await {
                while !stop.load(Ordering::Relaxed) {
                    let sql = format!(
                        "INSERT INTO outbox (event_id, destination, body) SELECT 'r{rep}k{k}' || l || i, l, 'r{rep}k{k}' || l || i
                           FROM unnest(ARRAY['a','b']) l, generate_series(1, 5) i"
                    );
                    k += 1;
                    if c.batch_execute(&sql).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// Milliseconds from `restarted` until the relay streams again (its slot
/// active), or None if it does not within 60 s.
async fn streaming_again_ms(db: &TestDb, restarted: Instant) -> Option<f64> {
    let end = restarted + Duration::from_secs(60);
    loop {
        if slot_active(db).await {
            return Some(restarted.elapsed().as_secs_f64() * 1000.0);
        }
        if Instant::now() > end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until repetition `rep`'s rows (`filter`) are settled; a relay that
/// exited meanwhile is replaced, as a supervisor would. True if it had exited.
async fn settle_repetition(db: &TestDb, cfg: &RelayConfig, relay: &mut RelayProcess, filter: &str, rep: usize) -> bool {
    let lsn = db.current_lsn().await;
    if !settled(db, filter, lsn, Duration::from_secs(60)).await {
        eprintln!("measure: postgres_restart: repetition {rep} did not settle within 60 s");
    }
    let Ok(Some(s)) = relay.child.try_wait() else { return false };
    eprintln!("measure: postgres_restart: the relay exited ({s:?}); starting another");
    *relay = cfg.spawn();
    settled(db, filter, lsn, Duration::from_secs(60)).await;
    true
}
