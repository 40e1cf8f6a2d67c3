//! Kill -9 the leading relay while rows flow; a standby (same config) takes
//! over. Used by tests/ha.rs (once) and examples/takeover.rs (ten times).

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// The relay binary: cargo tells tests; examples sit in target/<profile>/examples.
fn relay_bin() -> std::path::PathBuf {
    match option_env!("CARGO_BIN_EXE_outbox-relay") {
        Some(p) => p.into(),
        None => std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("outbox-relay"),
    }
}

fn spawn(path: &std::path::Path) -> Child {
    Command::new(relay_bin())
        .args(["run", "--config", path.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn active_pid(db: &TestDb) -> Option<i32> {
    db.client()
        .await
        .query_opt("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", &[&db.slot])
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// Takeover times (kill to the slot being read again), one per kill, and
/// whether every row arrived.
pub async fn run(kills: usize) -> (Vec<Duration>, usize, usize) {
    let db = TestDb::new("takeover").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "takeover", false, None).await;
    let toml = format!(
        "database_url = \"{}\"\nslot = \"{}\"\nmetrics_addr = \"off\"\ntakeover_timeout = \"10s\"\nheartbeat_interval = \"200ms\"\n[sqs]\nendpoint_url = \"{}\"\n[destinations]\norders = \"{q}\"\n",
        db.url,
        db.slot,
        stack().sqs_url
    );
    let dir = std::env::temp_dir().join(format!("takeover-{}", db.name));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, toml).unwrap();
    let mut relays = vec![spawn(&path)];
    wait_for("first leader streams", Duration::from_secs(30), || async { active_pid(&db).await.is_some() }).await;
    let writer = {
        let c = db.client().await;
        tokio::spawn(async move {
            let mut k = 0;
            loop {
                insert_rows(&c, &format!("t{k}"), "orders", 20, None).await;
                k += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let mut times = Vec::new();
    for _ in 0..kills {
        relays.push(spawn(&path)); // the standby
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let leader_pid = active_pid(&db).await.expect("a leader streams");
        // The relay process behind the walsender: the one that is not the newest standby.
        let mut leader = relays.remove(0);
        let killed_at = Instant::now();
        leader.kill().unwrap(); // SIGKILL
        leader.wait().unwrap();
        let end = killed_at + Duration::from_secs(30);
        loop {
            if let Some(p) = active_pid(&db).await {
                if p != leader_pid {
                    break;
                }
            }
            assert!(Instant::now() < end, "no standby took over within 30 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        times.push(killed_at.elapsed());
    }
    writer.abort();
    let _ = writer.await;
    let total = db.count("true").await as usize;
    wait_for("every row published", Duration::from_secs(120), || async { db.count("status = 'NEW'").await == 0 }).await;
    let got = receive_all(&sqs, &q, total, Duration::from_secs(120)).await;
    let unique: HashSet<String> = got.into_iter().map(|(b, _)| b).collect();
    for mut r in relays {
        let _ = r.kill();
        let _ = r.wait();
    }
    std::fs::remove_dir_all(&dir).ok();
    (times, total, unique.len())
}
