//! A replay of published events beside the table path's drain of as many
//! fresh rows, in one run, at each body size: the same relay (polling, its
//! published rows kept) sends n new rows, then `replay` copies those n
//! rows and the relay sends the copies. The drain is timed from its first
//! call to its last; the replay from the moment the command starts (its
//! plan and copies included) to the last copy's call. CPU is this
//! process's (the relay and the command in it).

use outbox_relay::ops::replay::{self, Selection};

use super::*;

#[derive(serde::Serialize)]
pub(super) struct ReplayDrain {
    events: usize,
    body_bytes: usize,
    rows_per_txn: usize,
    table_drain_rows_per_s: f64,
    replay_rows_per_s: f64,
    /// replay / table drain: the target is ≥ 0.8.
    pub(super) ratio: f64,
    /// Seconds the command took to copy every row (the relay sends meanwhile).
    copy_s: f64,
    table_drain_cpu_s_per_100k: f64,
    replay_cpu_s_per_100k: f64,
    /// WAL the copies wrote, per event (the primary's cost of a replay).
    replay_wal_bytes_per_event: f64,
    drain_machine_busy_pct: f64,
    replay_machine_busy_pct: f64,
}

/// The comparison at each body size of `sizes`.
pub(super) async fn replay_drains(a: &Args, sqs: &AwsPublisher, n: usize, sizes: &[usize]) -> Vec<ReplayDrain> {
    let mut out = Vec::new();
    for &size in sizes {
        let row = replay_drain(a, sqs, n, size).await;
        eprintln!("bench: replay, {size} B bodies: replay {:.0}/s, ratio {:.2}", row.replay_rows_per_s, row.ratio);
        out.push(row);
    }
    out
}

async fn replay_drain(a: &Args, sqs: &AwsPublisher, n: usize, size: usize) -> ReplayDrain {
    let db = TestDb::new("bench_replay").await;
    let queues = create_queues(sqs, 1).await;
    let mut cfg = config(&db, &dests(&queues));
    cfg.metrics_addr = None;
    cfg.mode = Mode::Polling;
    cfg.published_rows = PublishedRows::Keep;
    insert_backlog(&db, "r", n, 1, a.txn_size, size).await;
    let clocked = Clocked::new(sqs);
    let phase = Phase::start();
    let relay = start(cfg.clone(), clocked.clone());
    let sent = |goal: u64| {
        let (m, queues) = (Arc::clone(&relay.metrics), queues.clone());
        move || {
            let (m, queues) = (Arc::clone(&m), queues.clone());
            async move { published(&m, &queues) >= goal }
        }
    };
    wait_for("the table path drained", Duration::from_secs(900), sent(n as u64)).await;
    let (drain_cpu, drain_busy) = phase.end();
    let drain_us = clocked.last_us.load(Ordering::Acquire) - clocked.first_us.load(Ordering::Acquire);
    let drain_rate = n as f64 / (drain_us.max(1) as f64 / 1e6);

    let mut c = db.client().await;
    let wal_before = db.current_lsn().await;
    let phase = Phase::start();
    let started_us = now_us() as u64;
    let mut selection = Selection { destination: Some("d0".into()), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut selection).await.unwrap();
    let id = replay::start(&c, &selection, &planned).await.unwrap();
    let copied = replay::run(&mut c, &cfg, id, None, |_| {}, || false).await.unwrap();
    assert_eq!(copied.copied, n as i64, "every row copied");
    let copy_s = (now_us() as u64 - started_us) as f64 / 1e6;
    let wal = db.current_lsn().await - wal_before;
    wait_for("the copies sent", Duration::from_secs(900), sent(2 * n as u64)).await;
    let (replay_cpu, replay_busy) = phase.end();
    relay.stop().await;
    let replay_us = clocked.last_us.load(Ordering::Acquire) - started_us;
    let replay_rate = n as f64 / (replay_us.max(1) as f64 / 1e6);
    delete_queues(sqs, &queues).await;
    let per_100k = |cpu: f64| (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0;
    ReplayDrain {
        events: n,
        body_bytes: size,
        rows_per_txn: a.txn_size,
        table_drain_rows_per_s: drain_rate.round(),
        replay_rows_per_s: replay_rate.round(),
        ratio: r2(replay_rate / drain_rate),
        copy_s: r2(copy_s),
        table_drain_cpu_s_per_100k: per_100k(drain_cpu),
        replay_cpu_s_per_100k: per_100k(replay_cpu),
        replay_wal_bytes_per_event: (wal as f64 / n as f64).round(),
        drain_machine_busy_pct: drain_busy,
        replay_machine_busy_pct: replay_busy,
    }
}

pub(super) fn print_replays(rows: &[ReplayDrain]) {
    println!("\n| replay (published rows kept, polling relay, SQS stand-in) | table drain of fresh rows | replay (copy + send) | replay / drain (target ≥ 0.8) | copy s | CPU s/100k drain / replay | WAL B/event of the copies | machine busy drain / replay |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} events of {} B, {} per txn | {:.0}/s | {:.0}/s | {:.2} | {:.1} | {:.2} / {:.2} | {:.0} | {:.0}% / {:.0}% |",
            r.events,
            r.body_bytes,
            r.rows_per_txn,
            r.table_drain_rows_per_s,
            r.replay_rows_per_s,
            r.ratio,
            r.copy_s,
            r.table_drain_cpu_s_per_100k,
            r.replay_cpu_s_per_100k,
            r.replay_wal_bytes_per_event,
            r.drain_machine_busy_pct,
            r.replay_machine_busy_pct,
        );
    }
}
