//! One lane's queue deleted under load while unrelated tables write hundreds
//! of MB: the scenario behind `tests/it/degraded.rs` (short) and
//! `examples/outage.rs` (the measurement for the README).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::*;

pub struct Params {
    pub baseline: Duration,
    pub outage: Duration,
    /// Rows per second written to each of the three lanes.
    pub rows_per_lane_per_s: u32,
    /// MB per second written to an unrelated table during the outage.
    pub noise_mb_per_s: u32,
    pub max_retained_wal: u64,
    pub lane_stall_timeout: Duration,
}

#[derive(Debug, serde::Serialize)]
pub struct Report {
    pub outage_seconds: f64,
    pub max_retained_wal_bytes: u64,
    /// max over samples of pg_current_wal_lsn() - confirmed_flush_lsn.
    pub max_slot_lag_bytes: i64,
    pub noise_bytes_written: u64,
    pub healthy_p50_ms_before: f64,
    pub healthy_p99_ms_before: f64,
    pub healthy_p50_ms_during: f64,
    pub healthy_p99_ms_during: f64,
    /// Rows of the sick lane written after its queue was deleted.
    pub sick_rows_during_outage: usize,
    /// Committed rows that never reached their queue.
    pub rows_lost: usize,
    pub rows_dead: i64,
    pub spool_switches: f64,
}

async fn percentiles(db: &TestDb, lanes: &str, from: f64, to: f64) -> (f64, f64) {
    let c = db.client().await;
    let r = c
        .query_one(
            &format!(
                "SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM published_at - created_at)), 0)::float8 * 1000,
                        coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM published_at - created_at)), 0)::float8 * 1000
                   FROM outbox
                  WHERE destination IN ({lanes}) AND status = 'PUBLISHED'
                    AND extract(epoch FROM created_at)::float8 BETWEEN $1 AND $2"
            ),
            &[&from, &to],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

async fn epoch(c: &Client) -> f64 {
    c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await.unwrap().get(0)
}

pub async fn run(p: Params) -> Report {
    let db = TestDb::new("outage").await;
    let sqs = sqs().await;
    let qa = create_queue(&sqs, "oa", false, None).await;
    let qb = create_queue(&sqs, "ob", false, None).await;
    let qc = create_queue(&sqs, "oc", false, None).await;
    let cfg = outage_config(&db, &[("a", &qa), ("b", &qb), ("c", &qc)], &p);
    let relay = start(cfg, Arc::new(sqs.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    c.batch_execute("CREATE TABLE noise (x text)").await.unwrap();

    // Rows on all three lanes, a transaction per lane every 100 ms.
    let stop_writer = Arc::new(AtomicBool::new(false));
    let writer = lane_writer(db.client().await, (p.rows_per_lane_per_s / 10).max(1) as usize, Arc::clone(&stop_writer));
    tokio::time::sleep(p.baseline).await;

    // The outage: b's queue is deleted; the noise starts; the lag is sampled.
    let t_delete = epoch(&c).await;
    sqs.sqs().delete_queue().queue_url(&qb).send().await.unwrap();
    let outage_started = Instant::now();
    let stop_noise = Arc::new(AtomicBool::new(false));
    let noise_bytes = Arc::new(AtomicU64::new(0));
    let rows_per_tick = p.noise_mb_per_s as i32 * 1000 / 4; // 1 kB rows, 4 ticks a second
    let noise = noise_writer(db.client().await, rows_per_tick, Arc::clone(&stop_noise), Arc::clone(&noise_bytes));
    let max_lag = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let sampler = lag_sampler(db.client().await, db.slot.clone(), Arc::clone(&max_lag));
    tokio::time::sleep(p.outage).await;
    stop_noise.store(true, Ordering::Relaxed);
    noise.await.unwrap();
    let t_recreate = epoch(&c).await;
    let outage_seconds = outage_started.elapsed().as_secs_f64();
    recreate_queue(&sqs, &qb).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_writer.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    if !no_row_new_within(&db, Duration::from_secs(120)).await {
        let state = stuck_state(&c, t_delete, t_recreate).await;
        panic!("rows still NEW 120 s after the queue came back:\n{state}\n{}", relay.metrics.render());
    }
    sampler.abort();
    let (sick_rows_during_outage, rows_lost) = sick_rows_lost(&c, &sqs, &qb, t_delete).await;
    let (p50b, p99b) = percentiles(&db, "'a', 'c'", 0.0, t_delete).await;
    let (p50d, p99d) = percentiles(&db, "'a', 'c'", t_delete, t_recreate).await;
    let report = Report {
        outage_seconds,
        max_retained_wal_bytes: p.max_retained_wal,
        max_slot_lag_bytes: max_lag.load(Ordering::Relaxed),
        noise_bytes_written: noise_bytes.load(Ordering::Relaxed),
        healthy_p50_ms_before: p50b,
        healthy_p99_ms_before: p99b,
        healthy_p50_ms_during: p50d,
        healthy_p99_ms_during: p99d,
        sick_rows_during_outage,
        rows_lost,
        rows_dead: db.count("status = 'DEAD'").await,
        spool_switches: spool_switches(&relay.metrics.render()),
    };
    relay.stop().await;
    report
}

/// The relay's configuration for `lanes`, with the outage's budget and stall
/// timeout, short retries, and published rows kept: the latencies are read
/// from their published_at.
fn outage_config(db: &TestDb, lanes: &[(&str, &str)], p: &Params) -> Config {
    let mut cfg = config(db, lanes);
    cfg.lane_stall_timeout = p.lane_stall_timeout;
    cfg.max_retained_wal = p.max_retained_wal;
    cfg.retry_base = Duration::from_millis(500);
    cfg.retry_max = Duration::from_secs(5);
    cfg.published_rows = outbox_relay::config::PublishedRows::Keep;
    cfg
}

/// Create the deleted queue `url` again; it has the same URL.
async fn recreate_queue(sqs: &outbox_relay::publish::aws::AwsPublisher, url: &str) {
    let name = url.rsplit('/').next().unwrap().to_string();
    let again = sqs.sqs().create_queue().queue_name(&name).send().await.unwrap().queue_url.unwrap();
    assert_eq!(again, url, "the recreated queue has the same URL");
}

/// `per_tick` rows on each of the lanes a, b and c every 100 ms until `stop`.
fn lane_writer(c: Client, per_tick: usize, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut k = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            for lane in ["a", "b", "c"] {
                insert_rows(&c, &format!("{lane}{k}"), lane, per_tick, None).await;
            }
            k += 1;
        }
    })
}

/// `rows_per_tick` rows of 1 kB into the unrelated table every 250 ms until
/// `stop`, adding the WAL bytes they took to `written`.
fn noise_writer(
    c: Client,
    rows_per_tick: i32,
    stop: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let before: i64 = c.query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[]).await.unwrap().get(0);
            c.execute(
                "INSERT INTO noise SELECT repeat(md5(i::text), 32) FROM generate_series(1, $1) i",
                &[&rows_per_tick],
            )
            .await
            .unwrap();
            let after: i64 = c.query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[]).await.unwrap().get(0);
            written.fetch_add((after - before) as u64, Ordering::Relaxed);
        }
    })
}

/// The slot's lag (current WAL position - confirmed_flush_lsn) every 100 ms,
/// its maximum kept in `max_lag`; runs until aborted.
fn lag_sampler(c: Client, slot: String, max_lag: Arc<std::sync::atomic::AtomicI64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let lag: Option<i64> = c
                .query_one(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map(|r| r.get(0))
                .unwrap_or(None);
            max_lag.fetch_max(lag.unwrap_or(0), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// True once no row is NEW, false if some still are after `within`.
async fn no_row_new_within(db: &TestDb, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        while db.count("status = 'NEW'").await > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .is_ok()
}

/// The outbox by destination and status, and the rows still NEW, for the
/// failure message.
async fn stuck_state(c: &Client, t_delete: f64, t_recreate: f64) -> String {
    let rows = c
        .query(
            "SELECT destination || ' ' || status || ' spooled=' || (next_attempt_at IS NOT NULL) || ' n=' || count(*)
                    || ' attempts<=' || max(attempts) || ' next<=' || coalesce(max(next_attempt_at)::text, '-') || ' ' || coalesce(min(last_error), '')
               FROM outbox GROUP BY destination, status, next_attempt_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let mut state: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let stuck = c
        .query("SELECT min(event_id) || '..' || max(event_id) || ' ids ' || min(id) || '..' || max(id) || ' created ' || min(extract(epoch FROM created_at)::float8)::text FROM outbox WHERE status = 'NEW'", &[])
        .await
        .unwrap();
    state.push(format!("stuck: {} (deleted at {t_delete}, recreated at {t_recreate})", stuck[0].get::<_, String>(0)));
    state.join("\n")
}

/// Rows of b written while its queue was gone (minus a margin for sends in
/// flight at the deletion, which the old queue took with it) must all be in
/// the recreated queue: how many there are, and how many are not.
async fn sick_rows_lost(
    c: &Client,
    sqs: &outbox_relay::publish::aws::AwsPublisher,
    qb: &str,
    t_delete: f64,
) -> (usize, usize) {
    let expect: HashSet<String> = c
        .query(
            "SELECT body FROM outbox WHERE destination = 'b' AND extract(epoch FROM created_at)::float8 > $1",
            &[&(t_delete + 0.5)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut got: HashSet<String> = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while expect.iter().any(|b| !got.contains(b)) && Instant::now() < deadline {
        let batch = receive_all(sqs, qb, 1_000, Duration::from_secs(5)).await;
        if batch.is_empty() {
            break;
        }
        got.extend(batch.into_iter().map(|(b, _)| b));
    }
    (expect.len(), expect.iter().filter(|b| !got.contains(*b)).count())
}

/// Lane b's spool switches, from the metrics text.
fn spool_switches(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("outbox_relay_lane_spool_switches_total{destination=\"b\"}"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}
