//! One hot queue across a real SQS round trip, through the SQS stand-in
//! (`testkit::standin`): the relay with its default configuration (no
//! tuning: its lane finds its own concurrency) against the lesser of the
//! slot's drain rate (pg_recvlogical) and a raw client keeping the relay's
//! cap of calls in flight, side by side in one run; then 5% of the calls
//! throttled, and what the relay carries once it stops.
//!
//! The stand-in runs in a child process (this benchmark again, with
//! `--serve-standin`), so its CPU is neither the relay's nor the raw
//! client's; the throttling run keeps it in process, to switch it off.

use super::*;
use testkit::standin::{Settings, Standin};

#[derive(serde::Serialize)]
pub(super) struct HotQueue {
    rtt_ms: u64,
    messages: usize,
    /// The raw client's calls in flight: the relay's `max_in_flight_batches`.
    cap: usize,
    slot_msgs_per_s: f64,
    raw_msgs_per_s: f64,
    relay_msgs_per_s: f64,
    /// relay / min(slot, raw): the target is ≥ 0.9.
    pub(super) ratio: f64,
    raw_cpu_s_per_100k: f64,
    relay_cpu_s_per_100k: f64,
    /// Share of both cores busy (everything: PostgreSQL, the stand-in, us).
    raw_machine_busy_pct: f64,
    relay_machine_busy_pct: f64,
    /// PostgreSQL's CPU seconds per 100k messages while the relay drained
    /// (its walsender decoding, the settlement's backend).
    relay_pg_cpu_s_per_100k: f64,
    /// The highest limit the relay's lane reached.
    relay_peak_limit: i64,
    relay_calls: u64,
}

impl HotQueue {
    /// The relay's CPU per message over the raw client's.
    pub(super) fn cpu_ratio(&self) -> f64 {
        self.relay_cpu_s_per_100k / self.raw_cpu_s_per_100k.max(1e-9)
    }
}

impl Throttled {
    pub(super) fn nothing_lost(&self) -> bool {
        self.published >= self.messages as u64 && self.dead == 0
    }
}

/// A stand-in in a child process: this benchmark with `--serve-standin`.
pub(super) struct ChildStandin {
    child: tokio::process::Child,
    pub(super) endpoint: String,
}

impl ChildStandin {
    pub(super) async fn spawn(rtt: Duration) -> ChildStandin {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--serve-standin", &rtt.as_millis().to_string()])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the stand-in's child");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("the stand-in's endpoint");
        let endpoint = line.strip_prefix("endpoint=").expect("endpoint=...").to_string();
        ChildStandin { child, endpoint }
    }

    pub(super) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The child's side: serve until killed, the endpoint on the first line.
pub(super) async fn serve_standin(rtt_ms: u64) {
    let settings = Settings { rtt: Duration::from_millis(rtt_ms), ..Settings::default() };
    let standin = Standin::start(([127, 0, 0, 1], 0).into(), settings).await.expect("bind the stand-in");
    println!("endpoint={}", standin.endpoint());
    std::future::pending::<()>().await;
}

/// The hot-queue comparison at each round trip of `rtts`.
pub(super) async fn hot_queues(a: &Args, n: usize, rtts: &[u64]) -> Vec<HotQueue> {
    let mut out = Vec::new();
    for &ms in rtts {
        let row = hot_queue(a, n, Duration::from_millis(ms)).await;
        eprintln!("bench: hot queue at {ms} ms: relay {:.0}/s, ratio {:.2}", row.relay_msgs_per_s, row.ratio);
        out.push(row);
    }
    out
}

async fn hot_queue(a: &Args, n: usize, rtt: Duration) -> HotQueue {
    let standin = ChildStandin::spawn(rtt).await;
    let sqs = AwsPublisher::new("us-east-1", Some(&standin.endpoint)).await;
    let url = format!("{}/000000000000/hot", standin.endpoint);
    let db = TestDb::new("bench_hot").await;
    let cap = config(&db, &[("d0", &url)]).max_in_flight_batches;

    let phase = Phase::start();
    let raw = raw_sqs(&sqs, &[("d0".into(), url.clone())], n, cap, a.row_size).await;
    let (raw_cpu, raw_busy) = phase.end();

    create_slot(&db, &db.slot).await;
    create_slot(&db, "bench_hot_recvlogical").await;
    let end = insert_backlog(&db, "h", n, 1, a.txn_size, a.row_size).await;
    let (recv_secs, _) = recvlogical(&db, "bench_hot_recvlogical", end).await;
    db.client().await.execute("SELECT pg_drop_replication_slot('bench_hot_recvlogical')", &[]).await.unwrap();

    let relay = relay_to(&db, &url, &sqs, n).await;
    standin.stop().await;
    let slot = n as f64 / recv_secs;
    let per_100k = |cpu: f64| (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0;
    HotQueue {
        rtt_ms: rtt.as_millis() as u64,
        messages: n,
        cap,
        slot_msgs_per_s: slot.round(),
        raw_msgs_per_s: raw.round(),
        relay_msgs_per_s: relay.rate.round(),
        ratio: r2(relay.rate / slot.min(raw)),
        raw_cpu_s_per_100k: per_100k(raw_cpu),
        relay_cpu_s_per_100k: per_100k(relay.cpu),
        raw_machine_busy_pct: raw_busy,
        relay_machine_busy_pct: relay.busy,
        relay_pg_cpu_s_per_100k: per_100k(relay.pg_cpu),
        relay_peak_limit: relay.peak_limit,
        relay_calls: relay.calls,
    }
}

/// What [`relay_to`] measured.
struct RelayDrain {
    /// Messages/s from its first call to its last.
    rate: f64,
    /// CPU seconds of the relay (this process) and of PostgreSQL.
    cpu: f64,
    pg_cpu: f64,
    busy: f64,
    peak_limit: i64,
    calls: u64,
}

/// The relay in process, its configuration the default but for the
/// database and the one destination, draining `n` rows to `url`.
async fn relay_to(db: &TestDb, url: &str, sqs: &AwsPublisher, n: usize) -> RelayDrain {
    let mut cfg = config(db, &[("d0", url)]);
    cfg.metrics_addr = None;
    let clocked = Clocked::new(sqs);
    let phase = Phase::start();
    let relay = start(cfg, clocked.clone());
    let peak = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let queues = [("d0".to_string(), url.to_string())];
    wait_for("relay drained to the stand-in", Duration::from_secs(600), || {
        let (m, queues, peak) = (Arc::clone(&relay.metrics), queues.clone(), Arc::clone(&peak));
        async move {
            let limit = m.lane_in_flight_limit.with_label_values(&["d0", "stream"]).get();
            peak.fetch_max(limit, Ordering::Relaxed);
            published(&m, &queues) >= n as u64
        }
    })
    .await;
    let pg_cpu = phase.pg_cpu();
    let (cpu, busy) = phase.end();
    relay.stop().await;
    let sending_us = clocked.last_us.load(Ordering::Acquire) - clocked.first_us.load(Ordering::Acquire);
    RelayDrain {
        rate: n as f64 / (sending_us.max(1) as f64 / 1e6),
        cpu,
        pg_cpu,
        busy,
        peak_limit: peak.load(Ordering::Relaxed),
        calls: clocked.calls.load(Ordering::Relaxed),
    }
}

/// 5% of the calls throttled, then none.
#[derive(serde::Serialize)]
pub(super) struct Throttled {
    rtt_ms: u64,
    messages: usize,
    /// Messages/s while 5% of the calls were throttled, and after.
    throttled_msgs_per_s: f64,
    after_msgs_per_s: f64,
    /// Seconds from the end of the throttling until a second's rate first
    /// reached 0.9 of the rate after it.
    recovery_s: f64,
    calls_throttled: u64,
    /// Every row published once at least, none DEAD.
    published: u64,
    dead: u64,
}

/// `n` rows to one queue at `rtt`, 5% of the calls throttled until half of
/// them are published, none after.
pub(super) async fn throttled(a: &Args, n: usize, rtt: Duration) -> Throttled {
    let settings = Settings { rtt, throttle_rate: 0.05, ..Settings::default() };
    let standin = Standin::start(([127, 0, 0, 1], 0).into(), settings).await.unwrap();
    let sqs = AwsPublisher::new("us-east-1", Some(standin.endpoint())).await;
    let url = standin.queue_url("hot");
    let db = TestDb::new("bench_throttled").await;
    create_slot(&db, &db.slot).await;
    insert_backlog(&db, "t", n, 1, a.txn_size, a.row_size).await;
    let mut cfg = config(&db, &[("d0", &url)]);
    cfg.metrics_addr = None;
    let relay = start(cfg, Arc::new(sqs));
    let count = || relay.metrics.events_published.with_label_values(&["d0"]).get();
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let mut stopped: Option<(Instant, u64)> = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    while count() < n as u64 {
        assert!(Instant::now() < deadline, "the throttled drain did not end");
        let now = (Instant::now(), count());
        samples.push(now);
        if stopped.is_none() && now.1 >= n as u64 / 2 {
            standin.set(|s| s.throttle_rate = 0.0);
            stopped = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    samples.push((Instant::now(), count()));
    relay.stop().await;
    let dead = db.count("status = 'DEAD'").await as u64;
    let (t_stop, at_stop) = stopped.unwrap_or(samples[0]);
    let first = samples[0];
    let (t_end, at_end) = *samples.last().unwrap();
    let throttled_rate = (at_stop - first.1) as f64 / t_stop.duration_since(first.0).as_secs_f64().max(1e-3);
    let after_rate = (at_end - at_stop) as f64 / t_end.duration_since(t_stop).as_secs_f64().max(1e-3);
    let recovery_s = recovery(&samples, t_stop, after_rate).unwrap_or(f64::NAN);
    Throttled {
        rtt_ms: rtt.as_millis() as u64,
        messages: n,
        throttled_msgs_per_s: throttled_rate.round(),
        after_msgs_per_s: after_rate.round(),
        recovery_s: r2(recovery_s),
        calls_throttled: standin.stats().throttled,
        published: at_end,
        dead,
    }
}

/// Seconds after `from` until the rate over one second of `samples` first
/// reached 0.9 of `rate` (`None`: never).
fn recovery(samples: &[(Instant, u64)], from: Instant, rate: f64) -> Option<f64> {
    let after: Vec<&(Instant, u64)> = samples.iter().filter(|(t, _)| *t >= from).collect();
    after.iter().enumerate().find_map(|(i, (t, c))| {
        let back = after[..i].iter().rev().find(|(u, _)| t.duration_since(*u) >= Duration::from_secs(1))?;
        let r = (c - back.1) as f64 / t.duration_since(back.0).as_secs_f64();
        (r >= 0.9 * rate).then(|| back.0.duration_since(from).as_secs_f64())
    })
}

pub(super) fn print_hot(rows: &[HotQueue], throttled: &Throttled) {
    println!("\n| one queue through the stand-in | slot (pg_recvlogical) | raw client, cap {} | relay, no tuning | relay / min | CPU s/100k raw / relay (PostgreSQL) | machine busy raw / relay | lane's peak limit |", rows.first().map_or(0, |r| r.cap));
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} ms round trip, {} msgs | {:.0}/s | {:.0}/s | {:.0}/s | {:.2} | {:.2} / {:.2} ({:.2}) | {:.0}% / {:.0}% | {} |",
            r.rtt_ms,
            r.messages,
            r.slot_msgs_per_s,
            r.raw_msgs_per_s,
            r.relay_msgs_per_s,
            r.ratio,
            r.raw_cpu_s_per_100k,
            r.relay_cpu_s_per_100k,
            r.relay_pg_cpu_s_per_100k,
            r.raw_machine_busy_pct,
            r.relay_machine_busy_pct,
            r.relay_peak_limit
        );
    }
    let t = throttled;
    println!(
        "\n5% of calls throttled ({} ms, {} msgs): {:.0}/s throttled ({} calls), {:.0}/s after (its first second at 0.9 of that began {:.2} s after); published {}, DEAD {}",
        t.rtt_ms, t.messages, t.throttled_msgs_per_s, t.calls_throttled, t.after_msgs_per_s, t.recovery_s, t.published, t.dead
    );
}
