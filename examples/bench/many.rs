//! Many destinations on one relay: the release binary, configured with a
//! queue-URL template only (every queue looked up on first use), a steady
//! load spread over a thousand queues of the SQS stand-in at a 15 ms round
//! trip. Commit → SQS's answer per message (HDR), after the first seconds
//! (the lookups) and for them; the relay's peak RSS and CPU; its RSS once
//! the load stopped and again once its idle lanes closed. Beside it, the
//! same writer with a raw aws-sdk client sending each row as it commits,
//! to a stand-in in a child process: what the SDK alone costs at that load
//! on this machine.

use super::hot_queue::ChildStandin;
use super::*;
use std::collections::HashMap;
use testkit::process::current_rss;
use testkit::standin::{Settings, Standin};

#[derive(serde::Serialize)]
pub(super) struct Many {
    destinations: usize,
    rows_per_s_each: u64,
    rows_per_s_achieved: f64,
    rows: u64,
    rtt_ms: u64,
    /// Commit → the stand-in's answer, rows committed after the warm-up.
    p50_ms: f64,
    pub(super) p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
    /// The same over the warm-up (each destination's first rows wait for
    /// its lookup).
    warmup_s: u64,
    warmup_p99_ms: f64,
    /// SendMessageBatch calls per message.
    calls_per_message: f64,
    pub(super) relay_peak_rss_mb: f64,
    /// Stream lanes open and RSS when every row was answered, and RSS once
    /// the idle lanes closed ([`LANE_IDLE`]).
    lanes_open_loaded: u64,
    relay_rss_loaded_mb: f64,
    relay_rss_lanes_closed_mb: f64,
    relay_cpu_s_per_100k: f64,
    machine_busy_pct: f64,
    /// The raw client at the same load: rows/s its writer reached (the
    /// writer shares the process: below the load when the client falls
    /// behind), commit → answer after the warm-up.
    raw_rows_per_s_achieved: f64,
    raw_p50_ms: f64,
    raw_p99_ms: f64,
    /// Its CPU (the benchmark's own, the stand-in being a child).
    raw_cpu_s_per_100k: f64,
    raw_machine_busy_pct: f64,
}

const WARMUP: Duration = Duration::from_secs(3);

/// The relay's `lane_idle_timeout` here, its default: no lane closes while
/// the load runs, and every one closes within a minute after it.
const LANE_IDLE: &str = "30s";

/// `destinations` queues, `each` rows/s to each, for `secs` (after the warm-up).
pub(super) async fn many(a: &Args, destinations: usize, each: u64, secs: u64) -> Many {
    let rtt = RTT;
    let settings = Settings { rtt, record: true, ..Settings::default() };
    let standin = Standin::start(([127, 0, 0, 1], 0).into(), settings).await.unwrap();
    let db = TestDb::new("bench_many").await;
    let template = format!("{}/000000000000/{{destination}}", standin.endpoint());
    let addr = free_addr();
    let extra = format!("metrics_addr = \"{addr}\"\nlane_idle_timeout = \"{LANE_IDLE}\"");
    let cfg = RelayConfig::templated(&db, "cdc", &extra, standin.endpoint(), &template);
    let relay = cfg.spawn();
    wait_for("slot streaming", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let commits = Mutex::new(Vec::new());
    let load = Args { destinations, ..a.clone() };
    let phase = Phase::start();
    let warm_secs = WARMUP.as_secs();
    let (rows, achieved) = write_steadily(&load, &db, each * destinations as u64, warm_secs + secs, |k, us| {
        commits.lock().unwrap().push((k, us));
    })
    .await;
    wait_for("every row answered", Duration::from_secs(300), || async { standin.stats().messages >= rows }).await;
    let (_, busy) = phase.end();
    let (cpu, rss) = cpu_and_peak_rss(relay.pid()).unwrap_or((0.0, 0));
    let (lanes_open_loaded, rss_loaded, rss_closed) = rss_as_lanes_close(relay.pid(), &addr).await;
    relay.terminate(Duration::from_secs(15)).await;
    let commits: HashMap<i32, i64> = commits.into_inner().unwrap().into_iter().collect();
    let warm_until = commits.iter().filter(|(_, us)| **us - first(&commits) < WARMUP.as_micros() as i64).count() as i32;
    let (steady, warm) = histograms(&standin, destinations, &commits, warm_until, rtt);
    let ms = |h: &Histogram<u64>, q: f64| (h.value_at_quantile(q) as f64 / 100.0).round() / 10.0;
    let raw = raw_many(&load, each * destinations as u64, secs).await;
    Many {
        destinations,
        rows_per_s_each: each,
        rows_per_s_achieved: achieved.round(),
        rows,
        rtt_ms: rtt.as_millis() as u64,
        p50_ms: ms(&steady, 0.5),
        p99_ms: ms(&steady, 0.99),
        p999_ms: ms(&steady, 0.999),
        max_ms: (steady.max() as f64 / 100.0).round() / 10.0,
        warmup_s: warm_secs,
        warmup_p99_ms: ms(&warm, 0.99),
        calls_per_message: r2(standin.stats().send_calls as f64 / rows.max(1) as f64),
        relay_peak_rss_mb: mb(rss),
        lanes_open_loaded,
        relay_rss_loaded_mb: mb(rss_loaded),
        relay_rss_lanes_closed_mb: mb(rss_closed),
        relay_cpu_s_per_100k: per_100k(cpu, rows),
        machine_busy_pct: busy,
        raw_rows_per_s_achieved: raw.achieved.round(),
        raw_p50_ms: ms(&raw.latency, 0.5),
        raw_p99_ms: ms(&raw.latency, 0.99),
        raw_cpu_s_per_100k: per_100k(raw.cpu, raw.rows),
        raw_machine_busy_pct: raw.busy,
    }
}

fn per_100k(cpu: f64, rows: u64) -> f64 {
    (cpu * 100_000.0 / rows.max(1) as f64 * 100.0).round() / 100.0
}

struct RawMany {
    /// Commit → answer of the rows committed after the warm-up.
    latency: Histogram<u64>,
    rows: u64,
    achieved: f64,
    cpu: f64,
    busy: f64,
}

/// The same writer and load as the relay's run, each row sent by a raw
/// aws-sdk client as its transaction commits ([`RawSender`]: a
/// transaction's rows go to distinct destinations, each of which has a row
/// every 1/`each` s, so each goes in a call of its own), to a stand-in at
/// the same round trip in a child process.
async fn raw_many(load: &Args, rate: u64, secs: u64) -> RawMany {
    let standin = ChildStandin::spawn(RTT).await;
    let sqs = AwsPublisher::new("us-east-1", Some(&standin.endpoint)).await;
    let db = TestDb::new("bench_many_raw").await;
    let urls = (0..load.destinations).map(|d| format!("{}/000000000000/d{d}", standin.endpoint)).collect();
    let mut raw = RawSender::new(&sqs, urls, rate, load.row_size, (WARMUP.as_millis() / 10) as i32);
    let phase = Phase::start();
    let (rows, achieved) =
        write_steadily(load, &db, rate, WARMUP.as_secs() + secs, |k, committed_us| raw.tick(k, committed_us)).await;
    let (latency, _) = raw.finish().await;
    let (cpu, busy) = phase.end();
    standin.stop().await;
    RawMany { latency, rows, achieved, cpu, busy }
}

fn mb(bytes: u64) -> f64 {
    (bytes as f64 / 1048576.0 * 10.0).round() / 10.0
}

/// The stream lanes open and the relay's RSS now, and its RSS once no lane
/// is open (60 s at most; heartbeats keep the stream going meanwhile).
async fn rss_as_lanes_close(pid: u32, addr: &str) -> (u64, u64, u64) {
    let lanes = || async {
        let text = scrape(addr).await?;
        series(&text, "outbox_relay_stream_lanes").first().map(|(_, v)| *v as u64)
    };
    let (open, loaded) = (lanes().await.unwrap_or(0), current_rss(pid).unwrap_or(0));
    wait_for("the idle lanes closed", Duration::from_secs(60), || async { lanes().await == Some(0) }).await;
    (open, loaded, current_rss(pid).unwrap_or(0))
}

fn first(commits: &HashMap<i32, i64>) -> i64 {
    commits.values().copied().min().unwrap_or(0)
}

/// Commit → answer of every message the stand-in took, split at tick
/// `warm_until`: (after the warm-up, during it).
fn histograms(
    standin: &Standin,
    destinations: usize,
    commits: &HashMap<i32, i64>,
    warm_until: i32,
    rtt: Duration,
) -> (Histogram<u64>, Histogram<u64>) {
    let (mut steady, mut warm) = (latency_histogram(), latency_histogram());
    for d in 0..destinations {
        for (body, at) in standin.arrivals(&format!("d{d}")) {
            // Bodies are "l{tick}:{i}:xxx…".
            let tick: Option<i32> =
                body.strip_prefix('l').and_then(|b| b.split(':').next()).and_then(|k| k.parse().ok());
            let Some(committed) = tick.and_then(|k| commits.get(&k).map(|c| (k, *c))) else { continue };
            let answered = at.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64 + rtt.as_micros() as i64;
            let h = if committed.0 < warm_until { &mut warm } else { &mut steady };
            h.saturating_record((answered - committed.1).max(1) as u64);
        }
    }
    (steady, warm)
}

pub(super) fn print_many(rows: &[Many]) {
    println!("\n| destinations (template, looked up on first use) | rows/s | p50 / p99 / p99.9 ms | max ms | warm-up p99 ms | calls/msg | relay peak RSS | RSS loaded (lanes) / lanes closed | relay CPU s/100k | machine busy | raw client at the same load: rows/s, p50 / p99 ms, CPU s/100k, machine busy |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for m in rows {
        println!(
            "| {} × {}/s, {} ms round trip | {:.0} | {} / {} / {} | {} | {} | {} | {} MB | {} MB ({}) / {} MB | {} | {:.0}% | {:.0}, {} / {}, {}, {:.0}% |",
            m.destinations,
            m.rows_per_s_each,
            m.rtt_ms,
            m.rows_per_s_achieved,
            m.p50_ms,
            m.p99_ms,
            m.p999_ms,
            m.max_ms,
            m.warmup_p99_ms,
            m.calls_per_message,
            m.relay_peak_rss_mb,
            m.relay_rss_loaded_mb,
            m.lanes_open_loaded,
            m.relay_rss_lanes_closed_mb,
            m.relay_cpu_s_per_100k,
            m.machine_busy_pct,
            m.raw_rows_per_s_achieved,
            m.raw_p50_ms,
            m.raw_p99_ms,
            m.raw_cpu_s_per_100k,
            m.raw_machine_busy_pct
        );
    }
}
