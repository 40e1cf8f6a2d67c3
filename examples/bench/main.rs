//! The benchmark: the relay side by side with the physical limits of this
//! machine, in one run, as ratios. Starts its own stack (scripts/dev-stack,
//! as the tests do), generates the load, prints a table and, last, one JSON
//! summary (also written to `--json-out`, by default target/bench.json).
//!
//!     cargo run --release --example bench              # the full run (about 10 min)
//!     cargo run --release --example bench -- --quick   # under 2 min, smaller counts
//!
//! - decode ceiling: pg_recvlogical (pgoutput, the relay's publication)
//!   draining N committed rows to /dev/null, against the relay publishing the
//!   same rows to an in-process null publisher (decode, route, batch, mark, confirm);
//! - SQS ceiling: a plain aws-sdk-sqs client sending SendMessageBatch of 10
//!   to ministack with the relay's concurrency, against the relay end to end;
//! - CDC against polling: commit-to-acceptance latency (HDR histogram) at a
//!   steady 1,000 and 5,000 rows/s, and the drain time of a backlog;
//! - cost: relay CPU seconds per 100,000 events and peak RSS (VmHWM), one
//!   lane's queue gone for the whole run while rows keep arriving;
//! - scaling: throughput and RSS over row counts and destination counts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use clap::Parser;
use hdrhistogram::Histogram;
use outbox_relay::config::{Mode, PublishedRows};
use outbox_relay::publish::aws::AwsPublisher;
use outbox_relay::publish::entry::Entry;
use outbox_relay::publish::kind::Kind;
use outbox_relay::publish::kind::Target;
use outbox_relay::publish::{CallError, EntryResult, Publisher};
use serde_json::json;
use testkit::process::{cpu_and_peak_rss, free_addr, postgres_cpu, scrape, series, RelayConfig};
use testkit::*;

#[derive(Parser, Clone)]
#[command(about = "Throughput, latency and cost of the relay against the limits of this machine")]
struct Args {
    /// Smaller counts; finishes in under two minutes.
    #[arg(long)]
    quick: bool,
    /// Body size of each row, bytes.
    #[arg(long, default_value_t = 200)]
    row_size: usize,
    /// Rows per transaction of the backlog loads.
    #[arg(long, default_value_t = 1000)]
    txn_size: usize,
    /// Destinations (lanes, one queue each) of the throughput runs.
    #[arg(long, default_value_t = 3)]
    destinations: usize,
    /// Seconds of each steady-rate latency run (default 30, quick 4).
    #[arg(long)]
    steady_seconds: Option<u64>,
    /// Where the JSON summary is also written.
    #[arg(long, default_value = "target/bench.json")]
    json_out: std::path::PathBuf,
    /// Keep the benchmark's stack running afterwards.
    #[arg(long)]
    keep_stack: bool,
    /// Run only the large-body memory comparison.
    #[arg(long)]
    large_bodies_only: bool,
    /// Run only the drains of 20 and 30 MiB bodies through S3 (peak RSS
    /// beside its bound).
    #[arg(long)]
    huge_bodies_only: bool,
    /// Run only the drain of 2 MiB bodies through S3 beside a raw client.
    #[arg(long)]
    s3_only: bool,
    /// Run only the memory shapes: peak RSS beside the bound on the
    /// workloads users have (one big transaction of small rows, huge bodies
    /// committed at once, huge bodies while S3 hangs).
    #[arg(long)]
    memory_only: bool,
    /// With --memory-only: an environment variable for the relay
    /// (`NAME=value`), to compare one setting with the default.
    #[arg(long)]
    relay_env: Option<String>,
    /// With --memory-only: only the shapes whose name contains this.
    #[arg(long)]
    memory_shape: Option<String>,
    /// Run only the decode comparison (pg_recvlogical, transient and
    /// persistent rows, settlement WAL), with this many rows.
    #[arg(long)]
    decode_only: Option<usize>,
    /// Run only the steady-rate latency runs at these rates (rows/s,
    /// comma-separated): CDC, polling and the fixed linger at each.
    #[arg(long, value_delimiter = ',')]
    latency_only: Option<Vec<u64>>,
    /// Run only the drain of this many rows over 100 destinations, listed in
    /// [destinations] and routed by a queue-URL template, side by side.
    #[arg(long)]
    routing_only: Option<usize>,
    /// Run only one hot queue through the SQS stand-in at 15 and 30 ms round
    /// trip (this many messages), and 5% of its calls throttled.
    #[arg(long)]
    hot_queue_only: Option<usize>,
    /// Run only one SNS topic (ministack) drained by the relay beside a raw
    /// `PublishBatch` client, with this many messages at each body size.
    #[arg(long)]
    topic_only: Option<usize>,
    /// Run only a replay of this many published events beside the table
    /// path's drain of as many fresh rows, at each body size.
    #[arg(long)]
    replay_only: Option<usize>,
    /// Run only the stream's drain of this many rows with the archive on
    /// beside the same drain without it, at each body size.
    #[arg(long)]
    archive_only: Option<usize>,
    /// Run only `--many-destinations` (a queue-URL template) through the SQS
    /// stand-in, at 2 and 20 rows/s each, for this many seconds each.
    #[arg(long)]
    many_only: Option<u64>,
    /// Destinations of the many-destinations rows.
    #[arg(long, default_value_t = 1000)]
    many_destinations: usize,
    /// Serve the SQS stand-in with this round trip (ms) until killed: the
    /// benchmark's own child, so the stand-in's CPU is not the measured one's.
    #[arg(long, hide = true)]
    serve_standin: Option<u64>,
}

mod archive;
mod hot_queue;
mod many;
mod replay;
mod topic;

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// CPU seconds used by this process so far.
fn self_cpu() -> f64 {
    cpu_and_peak_rss(std::process::id()).map(|(c, _)| c).unwrap_or(0.0)
}

/// (busy, total) jiffies of the whole machine, from /proc/stat.
fn machine_jiffies() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> =
        s.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Measures a phase: this process's CPU and the machine's busy share.
struct Phase {
    cpu: f64,
    jiffies: (u64, u64),
    pg: f64,
}

impl Phase {
    fn start() -> Phase {
        Phase { cpu: self_cpu(), jiffies: machine_jiffies(), pg: postgres_cpu().unwrap_or(0.0) }
    }
    /// CPU seconds PostgreSQL spent since the start (every process of it:
    /// walsenders, the settlement's backend, background work).
    fn pg_cpu(&self) -> f64 {
        postgres_cpu().map_or(0.0, |c| c - self.pg)
    }
    /// (CPU seconds of this process, machine busy percent).
    fn end(&self) -> (f64, f64) {
        let (b, t) = machine_jiffies();
        let busy = (b - self.jiffies.0) as f64 / (t - self.jiffies.1).max(1) as f64 * 100.0;
        (self_cpu() - self.cpu, busy.round())
    }
}

// ---------------------------------------------------------------------------
// Publishers.

/// Accepts everything at once: the relay with the network taken away.
struct NullPublisher {
    entries: AtomicU64,
}

#[async_trait]
impl Publisher for NullPublisher {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        Ok(Target::new(kind, address, false, 1 << 20))
    }
    async fn send_batch(&self, _target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        self.entries.fetch_add(entries.len() as u64, Ordering::Relaxed);
        Ok(vec![EntryResult::Sent; entries.len()])
    }
}

/// SQS, recording each accepted entry's latency from its commit time
/// (CDC: the Begin message's commit timestamp; polling: created_at, the
/// start of the row's one-statement transaction).
struct Timed {
    inner: AwsPublisher,
    hist: Mutex<Histogram<u64>>,
    calls: AtomicU64,
}

#[async_trait]
impl Publisher for Timed {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        self.inner.describe(kind, address).await
    }
    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.send_batch(target, entries).await?;
        let now = now_us();
        let mut h = self.hist.lock().unwrap();
        for (e, res) in entries.iter().zip(&r) {
            if *res == EntryResult::Sent {
                h.saturating_record((now - e.event.commit_time_us).max(1) as u64);
            }
        }
        Ok(r)
    }
}

/// SQS, clocking the first call's start and the last call's end: the
/// relay's sending time without its start-up (slot, queue lookups).
struct Clocked {
    inner: AwsPublisher,
    /// Microseconds since the Unix epoch; 0 until the first call.
    first_us: AtomicU64,
    last_us: AtomicU64,
    calls: AtomicU64,
}

impl Clocked {
    fn new(sqs: &AwsPublisher) -> Arc<Clocked> {
        let zero = || AtomicU64::new(0);
        Arc::new(Clocked { inner: sqs.clone(), first_us: zero(), last_us: zero(), calls: zero() })
    }
}

#[async_trait]
impl Publisher for Clocked {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        self.inner.describe(kind, address).await
    }
    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let _ = self.first_us.compare_exchange(0, now_us() as u64, Ordering::AcqRel, Ordering::Acquire);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.send_batch(target, entries).await;
        self.last_us.fetch_max(now_us() as u64, Ordering::AcqRel);
        r
    }
}

// ---------------------------------------------------------------------------
// Load.

async fn create_queues(sqs: &AwsPublisher, n: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push((format!("d{i}"), create_queue(sqs, &format!("bench{i}"), false, None).await));
    }
    out
}

async fn delete_queues(sqs: &AwsPublisher, queues: &[(String, String)]) {
    for (_, url) in queues {
        let _ = sqs.sqs().delete_queue().queue_url(url).send().await;
    }
}

fn dests(queues: &[(String, String)]) -> Vec<(&str, &str)> {
    queues.iter().map(|(n, u)| (n.as_str(), u.as_str())).collect()
}

/// `n` rows over `d` destinations (d0..), `txn` rows per transaction, bodies
/// of `size` bytes. Returns the end of the WAL afterwards.
async fn insert_backlog(db: &TestDb, prefix: &str, n: usize, d: usize, txn: usize, size: usize) -> u64 {
    let c = db.client().await;
    let mut done = 0;
    while done < n {
        let k = txn.min(n - done);
        c.execute(
            "INSERT INTO outbox (event_id, destination, body)
             SELECT $1 || i, 'd' || (i % $4), rpad($1 || i || ':', $5, 'x')
               FROM generate_series($2::int, $3::int) i",
            &[&prefix, &(done as i32), &((done + k - 1) as i32), &(d as i32), &(size as i32)],
        )
        .await
        .unwrap();
        done += k;
    }
    db.current_lsn().await
}

/// `n` rows in transactions of `txn` rows, each transaction one `DO` block
/// running `each` (PL/pgSQL; `i` is the row's number, `declare` declares
/// its variables) once per row. Returns the end of the WAL afterwards.
async fn insert_each(db: &TestDb, n: usize, txn: usize, declare: &str, each: &str) -> u64 {
    let c = db.client().await;
    let mut done = 0;
    while done < n {
        let k = txn.min(n - done);
        let last = done + k - 1;
        c.batch_execute(&format!(
            "DO $$ DECLARE {declare}; BEGIN FOR i IN {done}..{last} LOOP {each} END LOOP; END $$"
        ))
        .await
        .unwrap();
        done += k;
    }
    db.current_lsn().await
}

/// `n` transient rows (each deleted right after its insert, in the same
/// transaction), `txn` per transaction. Returns the end of the WAL afterwards.
async fn insert_transient_backlog(db: &TestDb, n: usize, d: usize, txn: usize, size: usize) -> u64 {
    let each = format!(
        "INSERT INTO outbox (event_id, destination, body)
         VALUES ('t' || i, 'd' || (i % {d}), rpad('t' || i || ':', {size}, 'x')) RETURNING id INTO rid;
         DELETE FROM outbox WHERE id = rid;"
    );
    insert_each(db, n, txn, "rid bigint", &each).await
}

/// `n` rows of Debezium's outbox table (`app.outboxevent`, in the relay's
/// publication), each deleted right after its insert as the convention
/// does, `txn` per transaction. Returns the end of the WAL afterwards.
async fn insert_debezium_backlog(db: &TestDb, n: usize, d: usize, txn: usize, size: usize) -> u64 {
    db.client()
        .await
        .batch_execute(
            "CREATE SCHEMA app;
             CREATE TABLE app.outboxevent (id uuid PRIMARY KEY, aggregatetype text NOT NULL, aggregateid text NOT NULL,
                                           type text NOT NULL, payload jsonb);
             ALTER PUBLICATION outbox_relay ADD TABLE app.outboxevent;",
        )
        .await
        .unwrap();
    let each = format!(
        "eid := gen_random_uuid();
         INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
         VALUES (eid, 'd' || (i % {d}), 'a' || (i % 97), 'Created', to_jsonb(rpad('t' || i || ':', {size}, 'x')));
         DELETE FROM app.outboxevent WHERE id = eid;"
    );
    insert_each(db, n, txn, "eid uuid", &each).await
}

async fn create_slot(db: &TestDb, name: &str) {
    db.client().await.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&name]).await.unwrap();
}

fn published(metrics: &outbox_relay::metrics::Metrics, queues: &[(String, String)]) -> u64 {
    queues.iter().map(|(name, _)| metrics.events_published.with_label_values(&[name.as_str()]).get()).sum()
}

// ---------------------------------------------------------------------------
// 1. Decode ceiling.

struct Decode {
    rows: usize,
    recvlogical_rows_per_s: f64,
    /// The relay with persistent rows (settled by deleting them).
    relay_null_rows_per_s: f64,
    relay_null_cpu_s_per_100k: f64,
    relay_null_machine_busy_pct: f64,
    /// Settle statements alone (settle::mark, MAX_FLUSH rows per statement,
    /// one connection) over fresh rows: marking PUBLISHED (keep) and
    /// deleting (the default).
    mark_only_rows_per_s: f64,
    delete_only_rows_per_s: f64,
    /// WAL bytes per row: the INSERT, the relay's whole drain (settlement,
    /// runs, heartbeats) and the keep-mode mark alone.
    insert_wal_per_row: f64,
    settle_wal_per_row: f64,
    keep_mark_wal_per_row: f64,
    /// The same count of transient rows (each deleted by its own transaction).
    transient_recvlogical_rows_per_s: f64,
    transient_relay_rows_per_s: f64,
    transient_settle_wal_per_row: f64,
    /// The same count of rows in Debezium's table (a mapped table, the
    /// debezium preset), each deleted by its own transaction.
    debezium_recvlogical_rows_per_s: f64,
    debezium_relay_rows_per_s: f64,
    debezium_relay_cpu_s_per_100k: f64,
    debezium_relay_pg_cpu_s_per_100k: f64,
    debezium_recvlogical_pg_cpu_s_per_100k: f64,
    /// The persistent drain again with `published_rows = "keep"`.
    keep_relay_rows_per_s: f64,
    keep_settle_wal_per_row: f64,
    /// CPU seconds per 100k rows of PostgreSQL (all its processes) during
    /// each drain, and of the relay where not given above: what each way of
    /// reading and settling costs the database.
    recvlogical_pg_cpu_s_per_100k: f64,
    relay_null_pg_cpu_s_per_100k: f64,
    transient_recvlogical_pg_cpu_s_per_100k: f64,
    transient_relay_pg_cpu_s_per_100k: f64,
    transient_relay_cpu_s_per_100k: f64,
    keep_relay_pg_cpu_s_per_100k: f64,
    keep_relay_cpu_s_per_100k: f64,
}

/// pg_recvlogical draining `slot` up to `end` to /dev/null: seconds, and
/// PostgreSQL's CPU seconds meanwhile.
async fn recvlogical(db: &TestDb, slot: &str, end: u64) -> (f64, f64) {
    let end_lsn = format!("{:X}/{:X}", end >> 32, end & 0xffff_ffff);
    let phase = Phase::start();
    let t = Instant::now();
    let st = tokio::process::Command::new("/usr/lib/postgresql/15/bin/pg_recvlogical")
        .args(["-d", &db.url, "--slot", slot, "--start", "--no-loop", "--endpos", &end_lsn, "-f", "/dev/null"])
        .args(["-o", "proto_version=1", "-o", "publication_names=outbox_relay"])
        .status()
        .await
        .unwrap();
    assert!(st.success(), "pg_recvlogical failed: {st:?}");
    let secs = t.elapsed().as_secs_f64();
    // Its walsender may outlive pg_recvlogical by a moment: wait until it
    // has exited, so all of its CPU is counted.
    wait_for("pg_recvlogical's walsender gone", Duration::from_secs(10), || async {
        testkit::process::postgres_walsenders() == 0
    })
    .await;
    (secs, phase.pg_cpu())
}

/// One drain of the relay in process to the null publisher.
struct NullDrain {
    secs: f64,
    /// CPU seconds of this process (the relay) and of PostgreSQL.
    cpu: f64,
    pg_cpu: f64,
    busy: f64,
    /// WAL written meanwhile (bytes).
    wal: u64,
}

/// The relay in process, publishing `n` rows to a null publisher.
async fn relay_null(a: &Args, db: &TestDb, n: usize, published_rows: PublishedRows) -> NullDrain {
    relay_null_mapped(a, db, n, published_rows, Vec::new()).await
}

/// [`relay_null`], reading `mapped` tables besides the relay's own.
async fn relay_null_mapped(
    a: &Args,
    db: &TestDb,
    n: usize,
    published_rows: PublishedRows,
    mapped: Vec<outbox_relay::mapping::Mapping>,
) -> NullDrain {
    relay_null_with(db, n, a.destinations, |cfg| {
        cfg.published_rows = published_rows;
        cfg.mapped = mapped;
    })
    .await
}

/// The relay in process draining `n` rows over `destinations` queues
/// (`d0`, `d1`, ...) to a null publisher, its configuration edited by `edit`.
async fn relay_null_with(
    db: &TestDb,
    n: usize,
    destinations: usize,
    edit: impl FnOnce(&mut outbox_relay::config::Config),
) -> NullDrain {
    let queues: Vec<(String, String)> =
        (0..destinations).map(|i| (format!("d{i}"), format!("{NULL_QUEUES}d{i}"))).collect();
    let mut cfg = config(db, &dests(&queues));
    cfg.metrics_addr = None;
    edit(&mut cfg);
    let null = Arc::new(NullPublisher { entries: AtomicU64::new(0) });
    let wal_before = db.current_lsn().await;
    let t = Instant::now();
    let phase = Phase::start();
    let relay = start(cfg, null.clone());
    wait_for("relay drained to the null publisher", Duration::from_secs(300), || {
        let (m, queues) = (Arc::clone(&relay.metrics), queues.clone());
        async move { published(&m, &queues) >= n as u64 }
    })
    .await;
    let secs = t.elapsed().as_secs_f64();
    let pg_cpu = phase.pg_cpu();
    let (cpu, busy) = phase.end();
    let wal = db.current_lsn().await - wal_before;
    relay.stop().await;
    NullDrain { secs, cpu, pg_cpu, busy, wal }
}

/// The null publisher's queue URLs: a destination's name after this.
const NULL_QUEUES: &str = "http://null.invalid/000000000000/";

/// One drain over many destinations: listed in `[destinations]`, or each
/// looked up on first use by a queue-URL template.
#[derive(serde::Serialize)]
struct RoutingDrain {
    how: &'static str,
    rows: usize,
    destinations: usize,
    rows_per_s: f64,
    relay_cpu_s_per_100k: f64,
}

/// `n` rows over `destinations` destinations drained to the null publisher,
/// by a configured list and by a template, alternating, `rounds` each.
async fn routing_drains(a: &Args, n: usize, destinations: usize, rounds: usize) -> Vec<RoutingDrain> {
    let mut out = Vec::new();
    for _ in 0..rounds {
        for templated in [false, true] {
            let db = TestDb::new("bench_routing").await;
            create_slot(&db, &db.slot).await;
            insert_backlog(&db, "r", n, destinations, a.txn_size, a.row_size).await;
            let d = relay_null_with(&db, n, destinations, |cfg| {
                if templated {
                    cfg.destinations.clear();
                    let t = format!("{NULL_QUEUES}{{destination}}");
                    cfg.destination_template =
                        Some(outbox_relay::publish::template::AddressTemplate::new(&t, "r").unwrap());
                }
            })
            .await;
            out.push(RoutingDrain {
                how: if templated { "template, looked up on first use" } else { "[destinations]" },
                rows: n,
                destinations,
                rows_per_s: (n as f64 / d.secs).round(),
                relay_cpu_s_per_100k: (d.cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0,
            });
        }
    }
    out
}

fn print_routing(drains: &[RoutingDrain]) {
    println!("| destinations by | rows | destinations | rows/s | relay CPU s / 100k |");
    println!("|---|---|---|---|---|");
    for d in drains {
        println!(
            "| {} | {} | {} | {:.0} | {:.2} |",
            d.how, d.rows, d.destinations, d.rows_per_s, d.relay_cpu_s_per_100k
        );
    }
}

/// The settle statement alone over `n` fresh rows: rows/s and WAL bytes per row.
async fn settle_alone(a: &Args, db: &TestDb, prefix: &str, n: usize, published: PublishedRows) -> (f64, f64) {
    insert_backlog(db, prefix, n, a.destinations, a.txn_size, a.row_size).await;
    let c = db.client().await;
    c.batch_execute("VACUUM outbox").await.unwrap();
    let sql =
        format!("SELECT {} FROM outbox WHERE event_id LIKE $1 || '%' ORDER BY id", outbox_relay::event::OUTBOX_COLUMNS);
    let ids: Vec<Arc<outbox_relay::event::OutboxEvent>> = c
        .query(&sql, &[&prefix])
        .await
        .unwrap()
        .iter()
        .map(|r| Arc::new(outbox_relay::event::OutboxEvent::from_row(r)))
        .collect();
    let marking = outbox_relay::pipeline::settle::Marking {
        base: Duration::from_secs(2),
        max: Duration::from_secs(300),
        published,
        bound_unpositioned: true,
    };
    let wal_before = db.current_lsn().await;
    let t = Instant::now();
    for chunk in ids.chunks(outbox_relay::pipeline::settle::MAX_FLUSH) {
        let batch: Vec<outbox_relay::pipeline::settle::Settlement> = chunk
            .iter()
            .map(|ev| {
                let destination = Arc::from(ev.destination.as_str());
                let published = outbox_relay::pipeline::settle::Outcome::Published;
                outbox_relay::pipeline::settle::Settlement::new(Arc::clone(ev), None, destination, published)
            })
            .collect();
        outbox_relay::pipeline::settle::mark(&c, &batch, marking, &mut Default::default()).await.unwrap();
    }
    let rate = ids.len() as f64 / t.elapsed().as_secs_f64();
    let wal = db.current_lsn().await - wal_before;
    (rate, wal as f64 / ids.len() as f64)
}

async fn decode_ceiling(a: &Args, n: usize) -> Decode {
    let db = TestDb::new("bench_decode").await;
    create_slot(&db, "recvlogical").await;
    create_slot(&db, &db.slot).await;
    let start_lsn = db.current_lsn().await;
    let end = insert_backlog(&db, "e", n, a.destinations, a.txn_size, a.row_size).await;
    let insert_wal = (end - start_lsn) as f64 / n as f64;
    let (recv_s, recv_pg) = recvlogical(&db, "recvlogical", end).await;
    let persistent = relay_null(a, &db, n, PublishedRows::Delete).await;
    let (mark_only, keep_wal) = settle_alone(a, &db, "k", n.min(100_000), PublishedRows::Keep).await;
    let (delete_only, _) = settle_alone(a, &db, "x", n.min(100_000), PublishedRows::Delete).await;
    drop(db);

    let db = TestDb::new("bench_transient").await;
    create_slot(&db, "recvlogical").await;
    create_slot(&db, &db.slot).await;
    let end = insert_transient_backlog(&db, n, a.destinations, a.txn_size, a.row_size).await;
    let (t_recv_s, t_recv_pg) = recvlogical(&db, "recvlogical", end).await;
    let transient = relay_null(a, &db, n, PublishedRows::Delete).await;
    drop(db);
    // Debezium's table, mapped with its preset.
    let db = TestDb::new("bench_debezium").await;
    create_slot(&db, "recvlogical").await;
    create_slot(&db, &db.slot).await;
    let end = insert_debezium_backlog(&db, n, a.destinations, a.txn_size, a.row_size).await;
    let (dbz_recv_s, dbz_recv_pg) = recvlogical(&db, "recvlogical", end).await;
    let preset = outbox_relay::mapping::Mapping::preset(outbox_relay::mapping::Preset::Debezium, "app", "outboxevent");
    let debezium = relay_null_mapped(a, &db, n, PublishedRows::Delete, vec![preset]).await;
    drop(db);
    // The same drain with rows kept as PUBLISHED (the mark of before).
    let db = TestDb::new("bench_keep").await;
    create_slot(&db, &db.slot).await;
    insert_backlog(&db, "e", n, a.destinations, a.txn_size, a.row_size).await;
    let keep = relay_null(a, &db, n, PublishedRows::Keep).await;
    let r1 = |x: f64| (x * 10.0).round() / 10.0;
    let per_100k = |cpu: f64| (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0;
    Decode {
        rows: n,
        recvlogical_rows_per_s: n as f64 / recv_s,
        relay_null_rows_per_s: n as f64 / persistent.secs,
        relay_null_cpu_s_per_100k: per_100k(persistent.cpu),
        relay_null_machine_busy_pct: persistent.busy,
        recvlogical_pg_cpu_s_per_100k: per_100k(recv_pg),
        relay_null_pg_cpu_s_per_100k: per_100k(persistent.pg_cpu),
        transient_recvlogical_pg_cpu_s_per_100k: per_100k(t_recv_pg),
        transient_relay_pg_cpu_s_per_100k: per_100k(transient.pg_cpu),
        transient_relay_cpu_s_per_100k: per_100k(transient.cpu),
        keep_relay_pg_cpu_s_per_100k: per_100k(keep.pg_cpu),
        keep_relay_cpu_s_per_100k: per_100k(keep.cpu),
        mark_only_rows_per_s: mark_only,
        delete_only_rows_per_s: delete_only,
        insert_wal_per_row: r1(insert_wal),
        settle_wal_per_row: r1(persistent.wal as f64 / n as f64),
        keep_mark_wal_per_row: r1(keep_wal),
        transient_recvlogical_rows_per_s: n as f64 / t_recv_s,
        transient_relay_rows_per_s: n as f64 / transient.secs,
        transient_settle_wal_per_row: r1(transient.wal as f64 / n as f64),
        debezium_recvlogical_rows_per_s: n as f64 / dbz_recv_s,
        debezium_relay_rows_per_s: n as f64 / debezium.secs,
        debezium_relay_cpu_s_per_100k: per_100k(debezium.cpu),
        debezium_relay_pg_cpu_s_per_100k: per_100k(debezium.pg_cpu),
        debezium_recvlogical_pg_cpu_s_per_100k: per_100k(dbz_recv_pg),
        keep_relay_rows_per_s: n as f64 / keep.secs,
        keep_settle_wal_per_row: r1(keep.wal as f64 / n as f64),
    }
}

/// CPU per 100k rows of PostgreSQL and of the relay in each drain, side by
/// side: what reading and settling costs the database.
fn print_decode_cpu(d: &Decode) {
    println!();
    println!("| drain of {} rows | rows/s | PostgreSQL CPU s / 100k | relay CPU s / 100k |", d.rows);
    println!("|---|---|---|---|");
    let rows = [
        ("pg_recvlogical, persistent rows", d.recvlogical_rows_per_s, d.recvlogical_pg_cpu_s_per_100k, None),
        (
            "relay, persistent rows deleted",
            d.relay_null_rows_per_s,
            d.relay_null_pg_cpu_s_per_100k,
            Some(d.relay_null_cpu_s_per_100k),
        ),
        (
            "relay, persistent rows kept",
            d.keep_relay_rows_per_s,
            d.keep_relay_pg_cpu_s_per_100k,
            Some(d.keep_relay_cpu_s_per_100k),
        ),
        (
            "pg_recvlogical, transient rows",
            d.transient_recvlogical_rows_per_s,
            d.transient_recvlogical_pg_cpu_s_per_100k,
            None,
        ),
        (
            "relay, transient rows",
            d.transient_relay_rows_per_s,
            d.transient_relay_pg_cpu_s_per_100k,
            Some(d.transient_relay_cpu_s_per_100k),
        ),
        (
            "pg_recvlogical, Debezium's table",
            d.debezium_recvlogical_rows_per_s,
            d.debezium_recvlogical_pg_cpu_s_per_100k,
            None,
        ),
        (
            "relay, Debezium's table (debezium preset)",
            d.debezium_relay_rows_per_s,
            d.debezium_relay_pg_cpu_s_per_100k,
            Some(d.debezium_relay_cpu_s_per_100k),
        ),
    ];
    for (what, rate, pg, relay) in rows {
        let relay = relay.map_or("-".to_string(), |c| c.to_string());
        println!("| {what} | {rate:.0} | {pg} | {relay} |");
    }
}

fn decode_cpu_json(d: &Decode) -> serde_json::Value {
    json!({
        "recvlogical_pg": d.recvlogical_pg_cpu_s_per_100k,
        "relay_delete_pg": d.relay_null_pg_cpu_s_per_100k, "relay_delete_relay": d.relay_null_cpu_s_per_100k,
        "relay_keep_pg": d.keep_relay_pg_cpu_s_per_100k, "relay_keep_relay": d.keep_relay_cpu_s_per_100k,
        "transient_recvlogical_pg": d.transient_recvlogical_pg_cpu_s_per_100k,
        "transient_relay_pg": d.transient_relay_pg_cpu_s_per_100k, "transient_relay_relay": d.transient_relay_cpu_s_per_100k,
        "debezium_recvlogical_pg": d.debezium_recvlogical_pg_cpu_s_per_100k,
        "debezium_relay_pg": d.debezium_relay_pg_cpu_s_per_100k, "debezium_relay_relay": d.debezium_relay_cpu_s_per_100k,
    })
}

/// At each rate: the raw client's floor, CDC and polling, then the fixed
/// 5 ms linger of before side by side (latency and calls).
async fn latency_runs(a: &Args, sqs: &AwsPublisher, rates: &[u64], secs: u64) -> Vec<Latency> {
    let mut lat = Vec::new();
    for &rate in rates {
        lat.push(steady_raw(a, sqs, rate, secs).await);
        for mode in [Mode::Cdc, Mode::Polling] {
            lat.push(steady(a, sqs, mode, rate, secs, true).await);
        }
        lat.push(steady(a, sqs, Mode::Cdc, rate, secs, false).await);
    }
    lat
}

fn print_latency(lat: &[Latency]) {
    println!();
    println!(
        "| mode | target rows/s | achieved | rows | p50 ms | p99 ms | p99.9 ms | max ms | calls / 100k rows | machine busy % |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for l in lat {
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} |",
            l.mode,
            l.rows_per_s_target,
            l.rows_per_s_achieved,
            l.rows,
            l.p50_ms,
            l.p99_ms,
            l.p999_ms,
            l.max_ms,
            l.calls_per_100k,
            l.machine_busy_pct
        );
    }
}

// ---------------------------------------------------------------------------
// 2. SQS ceiling.

struct SqsCeiling {
    messages: usize,
    concurrency: usize,
    raw_msgs_per_s: f64,
    relay_msgs_per_s: f64,
    /// The relay's SendMessageBatch calls per 100k messages (the raw
    /// client's: 10,000).
    relay_calls_per_100k: f64,
    /// CPU seconds per 100k messages of the sending process (the bench
    /// itself: the raw client, or the relay running in it).
    raw_cpu_s_per_100k: f64,
    relay_cpu_s_per_100k: f64,
    /// Share of both cores busy (everything: PostgreSQL, ministack, us).
    raw_machine_busy_pct: f64,
    relay_machine_busy_pct: f64,
}

/// A SendMessageBatch of `bodies` (at most 10), as the raw client sends it.
fn raw_batch(
    sqs: &AwsPublisher,
    url: &str,
    bodies: impl Iterator<Item = String>,
) -> aws_sdk_sqs::operation::send_message_batch::builders::SendMessageBatchFluentBuilder {
    bodies.enumerate().fold(sqs.sqs().send_message_batch().queue_url(url), |req, (j, body)| {
        req.entries(
            aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                .id(j.to_string())
                .message_body(body)
                .build()
                .unwrap(),
        )
    })
}

async fn raw_sqs(sqs: &AwsPublisher, queues: &[(String, String)], n: usize, concurrency: usize, size: usize) -> f64 {
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (sqs, next, url) = (sqs.clone(), Arc::clone(&next), queues[w % queues.len()].1.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let start = next.fetch_add(10, Ordering::Relaxed) as usize;
                if start >= n {
                    break;
                }
                let bodies = (start..(start + 10).min(n)).map(|i| format!("{:x<size$}", format!("raw{i}:")));
                raw_batch(&sqs, &url, bodies).send().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    n as f64 / t.elapsed().as_secs_f64()
}

async fn sqs_ceiling(a: &Args, sqs: &AwsPublisher, n: usize) -> SqsCeiling {
    // Lanes x 8 batches in flight: these rows keep the fixed 8 of earlier
    // runs (the relay's cap set to it), comparable with them; the hot-queue
    // rows measure the default, adaptive, limit.
    let concurrency = a.destinations * 8;
    let queues = create_queues(sqs, a.destinations).await;
    let phase = Phase::start();
    let raw = raw_sqs(sqs, &queues, n, concurrency, a.row_size).await;
    let (raw_cpu, raw_busy) = phase.end();
    delete_queues(sqs, &queues).await;

    let db = TestDb::new("bench_sqs").await;
    create_slot(&db, &db.slot).await;
    insert_backlog(&db, "s", n, a.destinations, a.txn_size, a.row_size).await;
    let queues = create_queues(sqs, a.destinations).await;
    let mut cfg = config(&db, &dests(&queues));
    cfg.metrics_addr = None;
    cfg.max_in_flight_batches = 8;
    let clocked = Clocked::new(sqs);
    let phase = Phase::start();
    let relay = start(cfg, clocked.clone());
    wait_for("relay drained to ministack", Duration::from_secs(600), || {
        let (m, queues) = (Arc::clone(&relay.metrics), queues.clone());
        async move { published(&m, &queues) >= n as u64 }
    })
    .await;
    // From its first SendMessageBatch to its last, as the raw client is timed.
    let sending_us = clocked.last_us.load(Ordering::Acquire) - clocked.first_us.load(Ordering::Acquire);
    let relay_rate = n as f64 / (sending_us.max(1) as f64 / 1e6);
    let (relay_cpu, relay_busy) = phase.end();
    relay.stop().await;
    delete_queues(sqs, &queues).await;
    let per_100k = |cpu: f64| (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0;
    SqsCeiling {
        messages: n,
        concurrency,
        raw_msgs_per_s: raw,
        relay_msgs_per_s: relay_rate,
        relay_calls_per_100k: (clocked.calls.load(Ordering::Relaxed) as f64 * 100_000.0 / n as f64).round(),
        raw_cpu_s_per_100k: per_100k(raw_cpu),
        relay_cpu_s_per_100k: per_100k(relay_cpu),
        raw_machine_busy_pct: raw_busy,
        relay_machine_busy_pct: relay_busy,
    }
}

/// A loopback TCP proxy to `target` that holds every chunk `one_way` in
/// each direction (order kept, no bandwidth limit): ministack as far away as
/// a real SQS endpoint is.
async fn delay_proxy(target: std::net::SocketAddr, one_way: Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else { return };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(delayed_pipe(cr, sw, one_way));
                tokio::spawn(delayed_pipe(sr, cw, one_way));
            });
        }
    });
    addr
}

async fn delayed_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, buf)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&buf).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(k) = from.read(&mut buf).await {
        if k == 0 || tx.send((tokio::time::Instant::now() + delay, buf[..k].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// The SQS ceiling again through [`delay_proxy`] adding `rtt` of round trip,
/// over `lanes` destinations (8 batches in flight each).
async fn sqs_ceiling_rtt(a: &Args, n: usize, rtt: Duration, lanes: usize) -> SqsCeiling {
    let target: std::net::SocketAddr =
        stack().sqs_url.trim_start_matches("http://").trim_end_matches('/').parse().expect("ministack's address");
    let proxy = delay_proxy(target, rtt / 2).await;
    let far = AwsPublisher::new("us-east-1", Some(&format!("http://{proxy}"))).await;
    sqs_ceiling(&Args { destinations: lanes, ..a.clone() }, &far, n).await
}

// ---------------------------------------------------------------------------
// 3. Latency at a steady rate.

#[derive(Clone, serde::Serialize)]
struct Latency {
    mode: String,
    rows_per_s_target: u64,
    rows_per_s_achieved: f64,
    rows: u64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
    /// SendMessageBatch calls per 100,000 rows.
    calls_per_100k: f64,
    /// Share of both cores busy during the run (everything on the machine).
    machine_busy_pct: f64,
}

/// A histogram of latencies in microseconds, up to 120 s.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).unwrap()
}

/// Latency fields from a histogram of microseconds.
fn latency_of(mode: String, rate: u64, achieved: f64, h: &Histogram<u64>, calls: u64, rows: u64, busy: f64) -> Latency {
    let ms = |q: f64| (h.value_at_quantile(q) as f64 / 100.0).round() / 10.0;
    Latency {
        mode,
        rows_per_s_target: rate,
        rows_per_s_achieved: achieved.round(),
        rows: h.len(),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        p999_ms: ms(0.999),
        max_ms: (h.max() as f64 / 100.0).round() / 10.0,
        calls_per_100k: (calls as f64 * 100_000.0 / rows.max(1) as f64).round(),
        machine_busy_pct: busy,
    }
}

/// Every 10 ms, one transaction of rate/100 rows over the destinations,
/// for `secs`, each followed by `after(tick, commit time in µs)` (the raw
/// floor starts sending the rows itself). Returns (rows, achieved rows/s).
async fn write_steadily(a: &Args, db: &TestDb, rate: u64, secs: u64, mut after: impl FnMut(i32, i64)) -> (u64, f64) {
    let per_tick = (rate / 100).max(1) as i32;
    let c = db.client().await;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let t = Instant::now();
    let mut rows = 0u64;
    let mut k = 0i32;
    while t.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        c.execute(
            "INSERT INTO outbox (event_id, destination, body)
             SELECT 'l' || $1::int || ':' || i, 'd' || (($1::int + i) % $3), rpad('l' || $1::int || ':' || i || ':', $4, 'x') FROM generate_series(1, $2) i",
            &[&k, &per_tick, &(a.destinations as i32), &(a.row_size as i32)],
        )
        .await
        .unwrap();
        after(k, now_us());
        rows += per_tick as u64;
        k += 1;
    }
    (rows, rows as f64 / t.elapsed().as_secs_f64())
}

/// A raw client sending a tick's rows as their transaction commits, as the
/// relay's lanes would: per destination (row `i` of tick `k` to
/// `urls[(k + i) % urls.len()]`), batches of 10, at most 8 calls in flight;
/// commit → answer of the rows of ticks from `record_from` on.
struct RawSender {
    sqs: AwsPublisher,
    urls: Vec<String>,
    lanes: Vec<Arc<tokio::sync::Semaphore>>,
    hist: Arc<Mutex<Histogram<u64>>>,
    calls: Arc<AtomicU64>,
    sends: tokio::task::JoinSet<()>,
    per_tick: i32,
    row_size: usize,
    record_from: i32,
}

impl RawSender {
    fn new(sqs: &AwsPublisher, urls: Vec<String>, rate: u64, row_size: usize, record_from: i32) -> RawSender {
        RawSender {
            sqs: sqs.clone(),
            lanes: urls.iter().map(|_| Arc::new(tokio::sync::Semaphore::new(8))).collect(),
            urls,
            hist: Arc::new(Mutex::new(latency_histogram())),
            calls: Arc::new(AtomicU64::new(0)),
            sends: tokio::task::JoinSet::new(),
            per_tick: (rate / 100).max(1) as i32,
            row_size,
            record_from,
        }
    }

    /// Send tick `k`'s rows, committed at `committed_us`.
    fn tick(&mut self, k: i32, committed_us: i64) {
        let mut by_destination: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for i in 1..=self.per_tick {
            let body = format!("{:x<size$}", format!("l{k}:{i}:"), size = self.row_size);
            by_destination.entry((k + i) as usize % self.urls.len()).or_default().push(body);
        }
        let record = k >= self.record_from;
        for (d, bodies) in by_destination {
            for chunk in bodies.chunks(10) {
                let req = raw_batch(&self.sqs, &self.urls[d], chunk.iter().cloned());
                let (lane, hist, calls, n) =
                    (Arc::clone(&self.lanes[d]), Arc::clone(&self.hist), Arc::clone(&self.calls), chunk.len());
                self.sends.spawn(async move {
                    let _slot = lane.acquire_owned().await.unwrap();
                    calls.fetch_add(1, Ordering::Relaxed);
                    let out = req.send().await.unwrap();
                    assert_eq!(out.successful.len(), n, "entries refused: {:?}", out.failed);
                    if record {
                        let lat = (now_us() - committed_us).max(1) as u64;
                        let mut h = hist.lock().unwrap();
                        for _ in 0..n {
                            h.saturating_record(lat);
                        }
                    }
                });
            }
        }
        while self.sends.try_join_next().is_some() {}
    }

    /// Once every call is answered: the latencies and the calls made.
    async fn finish(mut self) -> (Histogram<u64>, u64) {
        while self.sends.join_next().await.is_some() {}
        let h = self.hist.lock().unwrap().clone();
        (h, self.calls.load(Ordering::Relaxed))
    }
}

/// The floor under the relay's latency on this machine: the same writer,
/// and the same messages sent to ministack by the bench itself as each
/// transaction commits ([`RawSender`], as the relay's lanes), from the
/// commit to SQS's answer. What is left between it and the relay is the
/// relay (its reading of the slot, batching and settling), not ministack
/// or the machine's two cores.
async fn steady_raw(a: &Args, sqs: &AwsPublisher, rate: u64, secs: u64) -> Latency {
    let db = TestDb::new("bench_lat_raw").await;
    let queues = create_queues(sqs, a.destinations).await;
    let mut raw = RawSender::new(sqs, queues.iter().map(|(_, url)| url.clone()).collect(), rate, a.row_size, 0);
    let phase = Phase::start();
    let (rows, achieved) = write_steadily(a, &db, rate, secs, |k, committed_us| raw.tick(k, committed_us)).await;
    let (h, calls) = raw.finish().await;
    let (_, busy) = phase.end();
    delete_queues(sqs, &queues).await;
    latency_of("raw SQS client (floor)".into(), rate, achieved, &h, calls, rows, busy)
}

async fn steady(a: &Args, sqs: &AwsPublisher, mode: Mode, rate: u64, secs: u64, adaptive: bool) -> Latency {
    let db = TestDb::new(&format!("bench_lat_{mode}")).await;
    let queues = create_queues(sqs, a.destinations).await;
    let mut cfg = config(&db, &dests(&queues));
    cfg.metrics_addr = None;
    cfg.mode = mode;
    cfg.adaptive_linger = adaptive;
    let timed = Arc::new(Timed { inner: sqs.clone(), hist: Mutex::new(latency_histogram()), calls: AtomicU64::new(0) });
    let relay = start(cfg, timed.clone());
    if mode == Mode::Cdc {
        wait_for("slot streaming", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await > 0 }).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let phase = Phase::start();
    let (rows, achieved) = write_steadily(a, &db, rate, secs, |_, _| {}).await;
    wait_for("steady rows published", Duration::from_secs(120), || {
        let (m, queues) = (Arc::clone(&relay.metrics), queues.clone());
        async move { published(&m, &queues) >= rows }
    })
    .await;
    let (_, busy) = phase.end();
    relay.stop().await;
    delete_queues(sqs, &queues).await;
    let h = timed.hist.lock().unwrap();
    let mode = if adaptive { mode.to_string() } else { format!("{mode}, fixed linger") };
    latency_of(mode, rate, achieved, &h, timed.calls.load(Ordering::Relaxed), rows, busy)
}

// ---------------------------------------------------------------------------
// 4-5. The relay as a process: backlog drains, CPU, peak RSS.

#[derive(Clone, serde::Serialize)]
struct Drain {
    case: String,
    mode: String,
    rows: usize,
    destinations: usize,
    seconds: f64,
    rows_per_s: f64,
    cpu_s_per_100k: f64,
    peak_rss_mb: f64,
}

/// Insert a backlog, start the relay binary, time until every row is published.
async fn drain(a: &Args, sqs: &AwsPublisher, case: &str, mode: &str, n: usize, d: usize) -> Drain {
    drain_with(a, sqs, case, mode, n, d, &[]).await
}

/// [`drain`] with extra environment for the relay process.
async fn drain_with(
    a: &Args,
    sqs: &AwsPublisher,
    case: &str,
    mode: &str,
    n: usize,
    d: usize,
    env: &[(&str, &str)],
) -> Drain {
    let db = TestDb::new("bench_drain").await;
    if mode == "cdc" {
        create_slot(&db, &db.slot).await;
    }
    let queues = create_queues(sqs, d).await;
    insert_backlog(&db, "b", n, d, a.txn_size, a.row_size).await;
    let addr = free_addr();
    let cfg = RelayConfig::new(&db, mode, &dests(&queues), &format!("metrics_addr = \"{addr}\""));
    let t = Instant::now();
    let relay = cfg.spawn_with(env);
    let end = t + Duration::from_secs(1800);
    let mut last = (0.0, 0);
    loop {
        if let Some(text) = scrape(&addr).await {
            if series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum::<f64>() >= n as f64 {
                break;
            }
        }
        if let Some(s) = cpu_and_peak_rss(relay.pid()) {
            last = s;
        }
        assert!(Instant::now() < end, "{case}: not drained in 30 min");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let (cpu, rss) = cpu_and_peak_rss(relay.pid()).unwrap_or(last);
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues).await;
    Drain {
        case: case.into(),
        mode: mode.into(),
        rows: n,
        destinations: d,
        seconds: (secs * 100.0).round() / 100.0,
        rows_per_s: (n as f64 / secs).round(),
        cpu_s_per_100k: (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0,
        peak_rss_mb: (rss as f64 / 1048576.0 * 10.0).round() / 10.0,
    }
}

#[derive(Clone, serde::Serialize)]
struct LaneDown {
    rows: usize,
    seconds: f64,
    peak_rss_mb: f64,
    cpu_s_per_100k: f64,
    rows_deferred: f64,
    healthy_published: f64,
}

/// Two lanes; one queue deleted after start-up and never recreated; `n` rows
/// arrive (half to each lane) while the relay runs. Done when the healthy
/// lane has published its half and the slot confirmed everything.
async fn lane_down(a: &Args, sqs: &AwsPublisher, n: usize) -> LaneDown {
    let db = TestDb::new("bench_down").await;
    let queues = create_queues(sqs, 2).await;
    let addr = free_addr();
    let cfg = RelayConfig::new(
        &db,
        "cdc",
        &dests(&queues),
        &format!("metrics_addr = \"{addr}\"\nlane_stall_timeout = \"5s\""),
    );
    let relay = cfg.spawn();
    wait_for("slot streaming", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await > 0 }).await;
    sqs.sqs().delete_queue().queue_url(&queues[1].1).send().await.unwrap();
    let t = Instant::now();
    let end_lsn = insert_backlog(&db, "x", n, 2, a.txn_size, a.row_size).await;
    let deadline = t + Duration::from_secs(1800);
    let (mut healthy, mut deferred);
    loop {
        if let Some(text) = scrape(&addr).await {
            healthy = series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum::<f64>();
            deferred = series(&text, "outbox_relay_events_deferred_total").iter().map(|(_, v)| v).sum::<f64>();
            let confirmed = series(&text, "outbox_relay_confirmed_lsn").first().map(|(_, v)| *v).unwrap_or(0.0);
            if healthy >= (n / 2) as f64 && confirmed >= end_lsn as f64 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "lane down: not settled in 30 min");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let (cpu, rss) = cpu_and_peak_rss(relay.pid()).unwrap_or((0.0, 0));
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues[..1]).await;
    LaneDown {
        rows: n,
        seconds: (secs * 10.0).round() / 10.0,
        peak_rss_mb: (rss as f64 / 1048576.0 * 10.0).round() / 10.0,
        cpu_s_per_100k: (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0,
        rows_deferred: deferred,
        healthy_published: healthy,
    }
}

// ---------------------------------------------------------------------------
// 6. Large bodies: memory bounded in bytes, not only in events.

#[derive(Clone, serde::Serialize)]
struct LargeBodies {
    max_unsettled_bytes: String,
    rows: usize,
    body_bytes: usize,
    seconds: f64,
    peak_unsettled_events: f64,
    peak_rss_mb: f64,
    /// `cdc` or `polling` (the rows of 250 KB bodies are `cdc`).
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<String>,
    /// Bodies through S3: `max_unsettled_bytes + 2 × s3.max_body_bytes + 64 MiB`,
    /// the bound peak RSS must stay within.
    #[serde(skip_serializing_if = "Option::is_none")]
    rss_bound_mb: Option<f64>,
}

/// `n` rows of `body` bytes committed before the relay starts (so it reads
/// the slot far faster than SQS takes 250 KB messages), drained to one
/// queue with `budget` as `max_unsettled_bytes`: peak RSS and the most
/// events unsettled at once.
async fn large_bodies(sqs: &AwsPublisher, n: usize, body: usize, budget: &str) -> LargeBodies {
    let db = TestDb::new("bench_large").await;
    create_slot(&db, &db.slot).await;
    let queues = create_queues(sqs, 1).await;
    let c = db.client().await;
    // Stored uncompressed, so the table holds what the relay holds.
    c.batch_execute("ALTER TABLE outbox ALTER COLUMN body SET STORAGE EXTERNAL").await.unwrap();
    for start in (0..n).step_by(50) {
        c.execute(
            "INSERT INTO outbox (event_id, destination, body)
             SELECT 'large:' || i, $1, repeat(chr(97 + i % 26), $2) FROM generate_series($3::int, $4::int) i",
            &[&queues[0].0, &(body as i32), &(start as i32), &((start + 49).min(n - 1) as i32)],
        )
        .await
        .unwrap();
    }
    let addr = free_addr();
    let extra = format!("metrics_addr = \"{addr}\"\nmax_unsettled_bytes = \"{budget}\"\nlane_stall_timeout = \"1h\"");
    let cfg = RelayConfig::new(&db, "cdc", &dests(&queues), &extra);
    let t = Instant::now();
    let relay = cfg.spawn();
    let end = t + Duration::from_secs(1800);
    let (mut peak_unsettled, mut last) = (0.0f64, (0.0, 0));
    loop {
        if let Some(text) = scrape(&addr).await {
            let unsettled: f64 = series(&text, "outbox_relay_in_flight_events").iter().map(|(_, v)| v).sum();
            peak_unsettled = peak_unsettled.max(unsettled);
            if series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum::<f64>() >= n as f64 {
                break;
            }
        }
        if let Some(s) = cpu_and_peak_rss(relay.pid()) {
            last = s;
        }
        assert!(Instant::now() < end, "large bodies: not drained in 30 min");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let (_, rss) = cpu_and_peak_rss(relay.pid()).unwrap_or(last);
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues).await;
    LargeBodies {
        max_unsettled_bytes: budget.into(),
        rows: n,
        body_bytes: body,
        seconds: (secs * 10.0).round() / 10.0,
        peak_unsettled_events: peak_unsettled,
        peak_rss_mb: (rss as f64 / 1048576.0 * 10.0).round() / 10.0,
        mode: None,
        rss_bound_mb: None,
    }
}

/// `n` rows of `body` bytes for `destination` (event ids `tag:i`), stored
/// uncompressed, so the table holds what the relay holds.
async fn insert_bodies(db: &TestDb, destination: &str, tag: &str, n: usize, body: usize) {
    let c = db.client().await;
    c.batch_execute("ALTER TABLE outbox ALTER COLUMN body SET STORAGE EXTERNAL").await.unwrap();
    for i in 0..n {
        c.execute(
            "INSERT INTO outbox (event_id, destination, body) VALUES ($4 || ':' || $1::int, $2, repeat(chr(97 + $1::int % 26), $3))",
            &[&(i as i32), &destination, &(body as i32), &tag],
        )
        .await
        .unwrap();
    }
}

/// `n` rows of `body` bytes (tens of MiB) committed before the relay starts,
/// drained through S3 in `mode` with `max_unsettled_bytes = 64MB` and
/// `s3.max_body_bytes = 32MB`: peak RSS beside the bound
/// `max_unsettled_bytes + 2 × max_body_bytes + 64 MiB`.
async fn huge_bodies(sqs: &AwsPublisher, n: usize, body: usize, mode: &str) -> LargeBodies {
    let (budget, max_body) = (64u64 << 20, 32u64 << 20);
    let bucket = testkit::create_bucket("benchhuge").await;
    let db = TestDb::new("bench_huge").await;
    if mode == "cdc" {
        create_slot(&db, &db.slot).await;
    }
    let queues = create_queues(sqs, 1).await;
    insert_bodies(&db, &queues[0].0, "huge", n, body).await;
    let addr = free_addr();
    let extra = format!(
        "metrics_addr = \"{addr}\"\nmax_unsettled_bytes = \"{budget}\"\nlane_stall_timeout = \"1h\"\n\
         [s3]\nbucket = \"{bucket}\"\nendpoint_url = \"{}\"\nmax_body_bytes = \"{max_body}\"",
        stack().sqs_url
    );
    let cfg = RelayConfig::new(&db, mode, &dests(&queues), &extra);
    let t = Instant::now();
    let relay = cfg.spawn();
    let mut peak_unsettled = 0.0f64;
    let (secs, rss) = drained(&relay, &addr, n, t, "huge bodies", |_, text| {
        let unsettled: f64 = series(text, "outbox_relay_in_flight_events").iter().map(|(_, v)| v).sum();
        peak_unsettled = peak_unsettled.max(unsettled);
    })
    .await;
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues).await;
    let mb = |b: u64| (b as f64 / 1048576.0 * 10.0).round() / 10.0;
    LargeBodies {
        max_unsettled_bytes: "64MB".into(),
        rows: n,
        body_bytes: body,
        seconds: (secs * 10.0).round() / 10.0,
        peak_unsettled_events: peak_unsettled,
        peak_rss_mb: mb(rss),
        mode: Some(mode.into()),
        rss_bound_mb: Some(mb(budget + 2 * max_body + (64 << 20))),
    }
}

// ---------------------------------------------------------------------------
// 6b. Memory on the shapes users have: peak RSS (VmHWM) beside the bound a
// container is sized by, `max_unsettled_bytes + 2 × the largest body +
// 64 MiB`, with the defaults (64 MB budget; `s3.max_body_bytes` 32 MB where
// bodies go through S3).

#[derive(Clone, serde::Serialize)]
struct MemoryShape {
    shape: String,
    rows: usize,
    seconds: f64,
    peak_rss_mb: f64,
    bound_mb: f64,
    /// The relay's environment beside the default, if any.
    env: String,
}

/// Where a memory shape's rows go.
#[derive(Clone, Copy)]
enum MemoryTarget {
    /// One queue, no S3.
    Queue,
    /// One queue, bodies over 256 KiB through S3, which hangs for this
    /// long once the relay is up (0: not at all).
    S3 { hang_secs: u64 },
    /// This many queues, looked up by the queue-URL template on first use.
    Templated(usize),
}

/// One shape: rows written by `write` to the destinations of `target` (the
/// slot exists already, the relay not started), drained by the relay; peak
/// RSS beside the bound.
async fn memory_shape(
    sqs: &AwsPublisher,
    a: &Args,
    shape: &str,
    largest_body: u64,
    target: MemoryTarget,
    write: impl AsyncFnOnce(&TestDb, &[String]) -> usize,
) -> Option<MemoryShape> {
    if a.memory_shape.as_ref().is_some_and(|only| !shape.contains(only.as_str())) {
        return None;
    }
    let budget = 64u64 << 20;
    let db = TestDb::new("bench_mem").await;
    create_slot(&db, &db.slot).await;
    let queues = create_queues(sqs, if let MemoryTarget::Templated(n) = target { n } else { 1 }).await;
    db.client().await.batch_execute("ALTER TABLE outbox ALTER COLUMN body SET STORAGE EXTERNAL").await.unwrap();
    let destinations: Vec<String> = match target {
        // The queues' names, looked up by the template.
        MemoryTarget::Templated(_) => {
            queues.iter().map(|(_, url)| url.rsplit('/').next().unwrap().to_string()).collect()
        }
        _ => vec![queues[0].0.clone()],
    };
    let rows = write(&db, &destinations).await;
    let addr = free_addr();
    let upstream = stack().sqs_url.trim_start_matches("http://").to_string();
    let proxy = testkit::proxy::Proxy::start(&upstream).await;
    let mut extra = format!("metrics_addr = \"{addr}\"\nlane_stall_timeout = \"1h\"");
    let (s3, hang) = match target {
        MemoryTarget::S3 { hang_secs } => (true, Duration::from_secs(hang_secs)),
        _ => (false, Duration::ZERO),
    };
    if s3 {
        let bucket = testkit::create_bucket("benchmem").await;
        extra += &format!("\n[s3]\nbucket = \"{bucket}\"\nendpoint_url = \"{}\"\nmax_body_bytes = \"32MB\"", proxy.url);
    }
    let cfg = match target {
        MemoryTarget::Templated(_) => {
            let (name, url) = (&destinations[0], &queues[0].1);
            let template = format!("{}{{destination}}", url.strip_suffix(name.as_str()).unwrap());
            RelayConfig::templated(&db, "cdc", &extra, &stack().sqs_url, &template)
        }
        _ => RelayConfig::new(&db, "cdc", &dests(&queues), &extra),
    };
    let env: Vec<(String, String)> =
        a.relay_env.iter().filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let t = Instant::now();
    let relay = cfg.spawn_with(&env_refs);
    if !hang.is_zero() {
        // Hung once the relay is up (its start-up checks the bucket).
        while scrape(&addr).await.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        proxy.hang();
    }
    let (secs, rss) = drained(&relay, &addr, rows, t, shape, |elapsed, _| {
        if !hang.is_zero() && elapsed > hang {
            proxy.up();
        }
    })
    .await;
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues).await;
    let mb = |b: u64| (b as f64 / 1048576.0 * 10.0).round() / 10.0;
    let bound = budget + 2 * if s3 { 32 << 20 } else { largest_body } + (64 << 20);
    Some(MemoryShape {
        shape: shape.into(),
        rows,
        seconds: (secs * 10.0).round() / 10.0,
        peak_rss_mb: mb(rss),
        bound_mb: mb(bound),
        env: a.relay_env.clone().unwrap_or_default(),
    })
}

/// Wait until the relay at `addr` (started at `t`) has published `rows`,
/// every 20 ms calling `tick` with the time since `t` and the metrics (when
/// they answered) and sampling its peak RSS; 30 minutes at most. Seconds
/// taken and the peak RSS in bytes.
async fn drained(
    relay: &testkit::process::RelayProcess,
    addr: &str,
    rows: usize,
    t: Instant,
    what: &str,
    mut tick: impl FnMut(Duration, &str),
) -> (f64, u64) {
    let mut rss = 0;
    loop {
        let text = scrape(addr).await;
        tick(t.elapsed(), text.as_deref().unwrap_or_default());
        let published =
            |text: &str| series(text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum::<f64>();
        if text.as_deref().is_some_and(|text| published(text) >= rows as f64) {
            break;
        }
        rss = cpu_and_peak_rss(relay.pid()).map_or(rss, |s| s.1);
        assert!(t.elapsed() < Duration::from_secs(1800), "{what}: not drained in 30 min");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    (secs, cpu_and_peak_rss(relay.pid()).map_or(rss, |s| s.1))
}

/// `n` rows of 20-30 MiB in transactions of `per_txn`, committed at once
/// (each transaction on its own connection, all open until the last row).
async fn huge_at_once(db: &TestDb, destination: &str, n: usize, per_txn: usize) -> usize {
    let mut txns = Vec::new();
    for t in 0..n.div_ceil(per_txn) {
        let c = db.client().await;
        let dest = destination.to_string();
        let rows: Vec<(i32, i32)> = (t * per_txn..((t + 1) * per_txn).min(n))
            .map(|i| (i as i32, ((20 << 20) + (i % 3) * (5 << 20)) as i32))
            .collect();
        txns.push(tokio::spawn(async move {
            c.batch_execute("BEGIN").await.unwrap();
            for (i, size) in rows {
                c.execute(
                    "INSERT INTO outbox (event_id, destination, body) VALUES ('huge:' || $1::int, $2, repeat(chr(97 + $1::int % 26), $3))",
                    &[&i, &dest, &size],
                )
                .await
                .unwrap();
            }
            c
        }));
    }
    let mut open = Vec::new();
    for t in txns {
        open.push(t.await.unwrap());
    }
    for c in open {
        c.batch_execute("COMMIT").await.unwrap();
    }
    n
}

/// `n` rows of 2-8 KB over `destinations` (round robin), in transactions
/// of `per_txn`.
async fn small_rows(db: &TestDb, destinations: &[String], n: usize, per_txn: usize) -> usize {
    let c = db.client().await;
    for start in (0..n).step_by(per_txn) {
        c.execute(
            "INSERT INTO outbox (event_id, destination, body)
             SELECT 'small:' || i, ($3::text[])[1 + i % cardinality($3::text[])],
                    repeat(chr(97 + i % 26), 2048 + (i * 7919) % 6145)
               FROM generate_series($1::int, $2::int) i",
            &[&(start as i32), &((start + per_txn).min(n) as i32 - 1), &destinations],
        )
        .await
        .unwrap();
    }
    n
}

async fn memory_shapes(a: &Args, sqs: &AwsPublisher) -> Vec<MemoryShape> {
    use MemoryTarget::{Queue, Templated, S3};
    let small = if a.quick { 5_000 } else { 20_000 };
    let up = S3 { hang_secs: 0 };
    let mut out = Vec::new();
    let shape = format!("one transaction of {small} rows of 2-8 KB");
    out.extend(memory_shape(sqs, a, &shape, 8 << 10, Queue, async |db, d| small_rows(db, d, small, small).await).await);
    let shape = format!("{small} rows of 2-8 KB over 1,000 destinations by template, transactions of 1,000");
    let templated = async |db: &TestDb, d: &[String]| small_rows(db, d, small, 1_000).await;
    out.extend(memory_shape(sqs, a, &shape, 8 << 10, Templated(1_000), templated).await);
    let shape = "4 bodies of 20-30 MiB in one transaction";
    out.extend(memory_shape(sqs, a, shape, 30 << 20, up, async |db, d| huge_at_once(db, &d[0], 4, 4).await).await);
    let shape = "20 bodies of 20-30 MiB, 5 transactions committed at once";
    out.extend(memory_shape(sqs, a, shape, 30 << 20, up, async |db, d| huge_at_once(db, &d[0], 20, 4).await).await);
    for (n, hang_secs) in [(12, 25), (24, 25), (12, 50)] {
        let shape = format!("{n} bodies of 20-30 MiB while S3 hangs {hang_secs} s");
        let write = async |db: &TestDb, d: &[String]| huge_at_once(db, &d[0], n, 4).await;
        out.extend(memory_shape(sqs, a, &shape, 30 << 20, S3 { hang_secs }, write).await);
    }
    out
}

fn print_memory(shapes: &[MemoryShape]) {
    println!("| shape | rows | seconds | peak RSS MB | bound MB | relay env |");
    println!("|---|---|---|---|---|---|");
    for m in shapes {
        println!("| {} | {} | {} | {} | {} | {} |", m.shape, m.rows, m.seconds, m.peak_rss_mb, m.bound_mb, m.env);
    }
    println!();
}

// ---------------------------------------------------------------------------
// 7. Bodies through S3: the relay beside a raw client doing PutObject and
// SendMessageBatch (the extended client's pointer) at the same concurrency.

#[derive(Clone, serde::Serialize)]
struct S3Bodies {
    rows: usize,
    body_bytes: usize,
    /// Bodies in flight at once: the relay's `max_unsettled_bytes` over the
    /// body size, and the raw client's batches of 10 in flight to match.
    bodies_in_flight: usize,
    relay_msgs_per_s: f64,
    raw_msgs_per_s: f64,
    relay_vs_raw: f64,
    relay_peak_rss_mb: f64,
}

/// `n` rows of `body` bytes, committed before the relay starts, drained to
/// one standard queue through S3 (`threshold = "always"`), timed from its
/// first published message; then the raw client sends as many through S3
/// with `in_flight / 10` batches at once.
async fn s3_bodies(sqs: &AwsPublisher, n: usize, body: usize) -> S3Bodies {
    let budget: usize = 64 << 20;
    let in_flight = (budget / body).max(10) / 10 * 10;
    let s3 = testkit::s3_client().await;
    let bucket = testkit::create_bucket("benchbodies").await;
    let db = TestDb::new("bench_s3").await;
    create_slot(&db, &db.slot).await;
    let queues = create_queues(sqs, 1).await;
    insert_bodies(&db, &queues[0].0, "s3", n, body).await;
    let addr = free_addr();
    let extra = format!(
        "metrics_addr = \"{addr}\"\nmax_unsettled_bytes = \"{budget}\"\nlane_stall_timeout = \"1h\"\n\
         [s3]\nbucket = \"{bucket}\"\nendpoint_url = \"{}\"\nthreshold = \"always\"",
        stack().sqs_url
    );
    let cfg = RelayConfig::new(&db, "cdc", &dests(&queues), &extra);
    let t = Instant::now();
    let relay = cfg.spawn();
    let (mut rss, mut first) = (0, None);
    // From the first message published (start-up aside, as the raw client
    // has none) to the last.
    loop {
        if let Some(text) = scrape(&addr).await {
            let published: f64 = series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum();
            if published >= 1.0 && first.is_none() {
                first = Some((Instant::now(), published));
            }
            if published >= n as f64 {
                break;
            }
        }
        rss = cpu_and_peak_rss(relay.pid()).map_or(rss, |s| s.1);
        assert!(t.elapsed() < Duration::from_secs(1800), "bodies through S3: not drained in 30 min");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (t0, at_first) = first.expect("published");
    let relay_rate = (n as f64 - at_first) / t0.elapsed().as_secs_f64();
    rss = cpu_and_peak_rss(relay.pid()).map_or(rss, |s| s.1);
    relay.terminate(Duration::from_secs(15)).await;
    let raw_rate = raw_s3(sqs, &s3, &bucket, &queues[0].1, n, body, in_flight / 10).await;
    delete_queues(sqs, &queues).await;
    S3Bodies {
        rows: n,
        body_bytes: body,
        bodies_in_flight: in_flight,
        relay_msgs_per_s: r2(relay_rate),
        raw_msgs_per_s: r2(raw_rate),
        relay_vs_raw: r2(relay_rate / raw_rate),
        relay_peak_rss_mb: (rss as f64 / 1048576.0 * 10.0).round() / 10.0,
    }
}

/// The raw client: `concurrency` workers, each writing 10 objects at once
/// and then sending their 10 pointers in one `SendMessageBatch`.
async fn raw_s3(
    sqs: &AwsPublisher,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    url: &str,
    n: usize,
    body: usize,
    concurrency: usize,
) -> f64 {
    let payload = bytes::Bytes::from(vec![b'r'; body]);
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (sqs, s3, next, url, bucket, payload) =
            (sqs.clone(), s3.clone(), Arc::clone(&next), url.to_string(), bucket.to_string(), payload.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let start = next.fetch_add(10, Ordering::Relaxed) as usize;
                if start >= n {
                    break;
                }
                let keys: Vec<String> = (start..(start + 10).min(n)).map(|i| format!("raw/{i}")).collect();
                let mut puts = tokio::task::JoinSet::new();
                for k in &keys {
                    puts.spawn(s3.put_object().bucket(&bucket).key(k).body(payload.clone().into()).send());
                }
                while let Some(r) = puts.join_next().await {
                    r.unwrap().unwrap();
                }
                let size = aws_sdk_sqs::types::MessageAttributeValue::builder()
                    .data_type("Number")
                    .string_value(body.to_string())
                    .build()
                    .unwrap();
                let req = keys.iter().enumerate().fold(sqs.sqs().send_message_batch().queue_url(&url), |req, (j, k)| {
                    let pointer = json!(["software.amazon.payloadoffloading.PayloadS3Pointer", {"s3BucketName": bucket, "s3Key": k}]);
                    req.entries(
                        aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                            .id(j.to_string())
                            .message_body(pointer.to_string())
                            .message_attributes("ExtendedPayloadSize", size.clone())
                            .build()
                            .unwrap(),
                    )
                });
                req.send().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    n as f64 / t.elapsed().as_secs_f64()
}

fn print_s3(s: &S3Bodies) {
    println!("| bodies through S3 | rows | body bytes | bodies in flight | relay msg/s | raw msg/s | relay / raw | relay peak RSS MB |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| | {} | {} | {} | {} | {} | {} | {} |",
        s.rows,
        s.body_bytes,
        s.bodies_in_flight,
        s.relay_msgs_per_s,
        s.raw_msgs_per_s,
        s.relay_vs_raw,
        s.relay_peak_rss_mb
    );
    println!();
}

// ---------------------------------------------------------------------------

fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_string()))
        })
        .unwrap_or_default();
    let mem_kb: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemTotal:").map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0);
    json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu,
        "memory_gib": (mem_kb as f64 / 1048576.0).round(),
    })
}

/// What the full run measured, in the order it measures.
struct Results {
    large: Vec<LargeBodies>,
    dec: Decode,
    sqsc: SqsCeiling,
    /// Through the 15 ms RTT proxy: one lane, then every lane.
    far: SqsCeiling,
    far3: SqsCeiling,
    lat: Vec<Latency>,
    drains: Vec<Drain>,
    down: LaneDown,
    s3: S3Bodies,
    /// One queue through the SQS stand-in at 15 and 30 ms, and throttled.
    hot: Vec<hot_queue::HotQueue>,
    throttled: hot_queue::Throttled,
    /// A thousand destinations at 2 and 20 rows/s each.
    many: Vec<many::Many>,
}

/// The ratios and latencies the targets are about.
struct Ratios {
    relay_vs_recv: f64,
    relay_vs_raw: f64,
    relay_vs_raw_far: f64,
    relay_vs_raw_far3: f64,
    transient_vs_recv: f64,
    settle_wal_ratio: f64,
    /// The physical limits through the proxy: batches in flight × 10 / RTT.
    far_limit: f64,
    far3_limit: f64,
    c1: Latency,
    p1: Latency,
    c5: Latency,
    f5: Latency,
}

const RTT: Duration = Duration::from_millis(15);

impl Results {
    fn ratios(&self) -> Ratios {
        let at = |mode: &str, rate: u64| {
            self.lat.iter().find(|l| l.mode == mode && l.rows_per_s_target == rate).cloned().unwrap()
        };
        let (dec, sqsc, far, far3) = (&self.dec, &self.sqsc, &self.far, &self.far3);
        Ratios {
            relay_vs_recv: dec.relay_null_rows_per_s / dec.recvlogical_rows_per_s,
            relay_vs_raw: sqsc.relay_msgs_per_s / sqsc.raw_msgs_per_s,
            relay_vs_raw_far: far.relay_msgs_per_s / far.raw_msgs_per_s,
            relay_vs_raw_far3: far3.relay_msgs_per_s / far3.raw_msgs_per_s,
            transient_vs_recv: dec.transient_relay_rows_per_s / dec.transient_recvlogical_rows_per_s,
            settle_wal_ratio: dec.settle_wal_per_row / dec.insert_wal_per_row,
            far_limit: far.concurrency as f64 * 10.0 / RTT.as_secs_f64(),
            far3_limit: far3.concurrency as f64 * 10.0 / RTT.as_secs_f64(),
            c1: at("cdc", 1000),
            p1: at("polling", 1000),
            c5: at("cdc", 5000),
            f5: at("cdc, fixed linger", 5000),
        }
    }
}

fn r2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn print_decode_only(d: &Decode) {
    println!(
        "keep: relay {:.0} rows/s, settle WAL {} B/row; persistent: recvlogical {:.0} relay {:.0} rows/s ({:.2}); transient: recvlogical {:.0} relay {:.0} ({:.2}); Debezium's table: recvlogical {:.0} relay {:.0} ({:.2}); WAL per row: insert {} settle {} transient {} keep-mark {}",
        d.keep_relay_rows_per_s,
        d.keep_settle_wal_per_row,
        d.recvlogical_rows_per_s,
        d.relay_null_rows_per_s,
        d.relay_null_rows_per_s / d.recvlogical_rows_per_s,
        d.transient_recvlogical_rows_per_s,
        d.transient_relay_rows_per_s,
        d.transient_relay_rows_per_s / d.transient_recvlogical_rows_per_s,
        d.debezium_recvlogical_rows_per_s,
        d.debezium_relay_rows_per_s,
        d.debezium_relay_rows_per_s / d.debezium_recvlogical_rows_per_s,
        d.insert_wal_per_row,
        d.settle_wal_per_row,
        d.transient_settle_wal_per_row,
        d.keep_mark_wal_per_row
    );
    print_decode_cpu(d);
}

fn print_large(large: &[LargeBodies]) {
    println!(
        "| max_unsettled_bytes | mode | rows | body bytes | seconds | peak unsettled events | peak RSS MB | bound MB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for l in large {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            l.max_unsettled_bytes,
            l.mode.as_deref().unwrap_or("cdc"),
            l.rows,
            l.body_bytes,
            l.seconds,
            l.peak_unsettled_events,
            l.peak_rss_mb,
            l.rss_bound_mb.map_or("-".into(), |b| b.to_string())
        );
    }
    println!();
}

/// Bodies of 20 and 30 MiB through S3, from the stream and polling.
async fn huge_bodies_rows(a: &Args, sqs: &AwsPublisher) -> Vec<LargeBodies> {
    let n = if a.quick { 6 } else { 16 };
    let mut huge = Vec::new();
    for (body, mode) in [(20 << 20, "cdc"), (30 << 20, "cdc"), (30 << 20, "polling")] {
        huge.push(huge_bodies(sqs, n, body, mode).await);
    }
    huge
}

/// Large bodies, the default byte budget beside one so large that only the
/// event budget (20,000) binds: peak RSS side by side.
async fn large_bodies_rows(a: &Args, sqs: &AwsPublisher, started: Instant) -> Vec<LargeBodies> {
    let large_n = if a.quick { 600 } else { 2_000 };
    let mut large = Vec::new();
    for budget in ["64MB", "64GB"] {
        large.push(large_bodies(sqs, large_n, 250_000, budget).await);
    }
    large.extend(huge_bodies_rows(a, sqs).await);
    eprintln!("bench: large bodies done ({:.0} s)", started.elapsed().as_secs_f64());
    large
}

/// The ceilings: decode against pg_recvlogical, SQS against a plain client,
/// directly and through the 15 ms RTT proxy.
async fn ceilings(a: &Args, sqs: &AwsPublisher, started: Instant) -> (Decode, SqsCeiling, SqsCeiling, SqsCeiling) {
    let q = a.quick;
    let dec = decode_ceiling(a, if q { 50_000 } else { 200_000 }).await;
    eprintln!("bench: decode ceiling done ({:.0} s)", started.elapsed().as_secs_f64());
    let sqsc = sqs_ceiling(a, sqs, if q { 10_000 } else { 50_000 }).await;
    eprintln!("bench: SQS ceiling done ({:.0} s)", started.elapsed().as_secs_f64());
    // One lane: 8 batches in flight bound it (5,333 msg/s at 15 ms), below
    // what ministack takes; three lanes: ministack and the two cores bind.
    let far = sqs_ceiling_rtt(a, if q { 10_000 } else { 40_000 }, RTT, 1).await;
    let far3 = sqs_ceiling_rtt(a, if q { 10_000 } else { 50_000 }, RTT, a.destinations).await;
    eprintln!("bench: SQS ceiling at 15 ms RTT done ({:.0} s)", started.elapsed().as_secs_f64());
    (dec, sqsc, far, far3)
}

/// The backlog drains: CDC, polling, CDC on one worker thread, CDC again.
async fn backlog_drains(a: &Args, sqs: &AwsPublisher, backlog: usize) -> Vec<Drain> {
    vec![
        drain(a, sqs, "backlog", "cdc", backlog, a.destinations).await,
        drain(a, sqs, "backlog", "polling", backlog, a.destinations).await,
        // The same drain on a one-thread runtime, side by side.
        drain_with(
            a,
            sqs,
            "backlog, --worker-threads 1",
            "cdc",
            backlog,
            a.destinations,
            &[("OUTBOX_RELAY_WORKER_THREADS", "1")],
        )
        .await,
        drain(a, sqs, "backlog (again)", "cdc", backlog, a.destinations).await,
    ]
}

/// Scaling: drains over row counts and destination counts (those the
/// backlog drains did not already measure).
async fn scaling_drains(a: &Args, sqs: &AwsPublisher, backlog: usize) -> Vec<Drain> {
    let q = a.quick;
    let mut drains = Vec::new();
    let rows_curve: &[usize] = if q { &[10_000, 50_000] } else { &[10_000, 100_000, 1_000_000] };
    for &n in rows_curve {
        if n != backlog {
            drains.push(drain(a, sqs, "rows", "cdc", n, a.destinations).await);
        }
    }
    let dest_rows = if q { 10_000 } else { 100_000 };
    for d in [1, 3, 10] {
        if !(d == a.destinations && dest_rows == backlog) {
            drains.push(drain(a, sqs, "destinations", "cdc", dest_rows, d).await);
        }
    }
    drains
}

/// One hot queue at 15 and 30 ms, `n` messages; then 5% of its calls
/// throttled at 15 ms.
async fn hot_queue_rows(a: &Args, n: usize) -> (Vec<hot_queue::HotQueue>, hot_queue::Throttled) {
    let hot = hot_queue::hot_queues(a, n, &[15, 30]).await;
    let throttled = hot_queue::throttled(a, n, RTT).await;
    (hot, throttled)
}

/// `--many-destinations` (a thousand) at 2 and at 20 rows/s each, `secs` each.
async fn many_rows(a: &Args, secs: u64) -> Vec<many::Many> {
    let mut rows = Vec::new();
    for each in [2, 20] {
        rows.push(many::many(a, a.many_destinations, each, secs).await);
    }
    rows
}

/// Every row of the full run after the large bodies.
async fn measure_all(
    a: &Args,
    sqs: &AwsPublisher,
    large: Vec<LargeBodies>,
    steady_s: u64,
    started: Instant,
) -> Results {
    let (dec, sqsc, far, far3) = ceilings(a, sqs, started).await;
    let lat = latency_runs(a, sqs, &[1_000, 5_000], steady_s).await;
    eprintln!("bench: latency done ({:.0} s)", started.elapsed().as_secs_f64());
    let backlog = if a.quick { 10_000 } else { 100_000 };
    let mut drains = backlog_drains(a, sqs, backlog).await;
    eprintln!("bench: backlog drains done ({:.0} s)", started.elapsed().as_secs_f64());
    let down = lane_down(a, sqs, if a.quick { 100_000 } else { 1_000_000 }).await;
    eprintln!("bench: lane down done ({:.0} s)", started.elapsed().as_secs_f64());
    drains.extend(scaling_drains(a, sqs, backlog).await);
    eprintln!("bench: scaling done ({:.0} s)", started.elapsed().as_secs_f64());
    let s3 = s3_bodies(sqs, if a.quick { 60 } else { 200 }, 2 << 20).await;
    eprintln!("bench: bodies through S3 done ({:.0} s)", started.elapsed().as_secs_f64());
    let (hot, throttled) = hot_queue_rows(a, if a.quick { 50_000 } else { 300_000 }).await;
    eprintln!("bench: hot queue done ({:.0} s)", started.elapsed().as_secs_f64());
    let many = many_rows(a, if a.quick { 5 } else { 20 }).await;
    eprintln!("bench: many destinations done ({:.0} s)", started.elapsed().as_secs_f64());
    Results { large, dec, sqsc, far, far3, lat, drains, down, s3, hot, throttled, many }
}

fn print_ceilings(a: &Args, r: &Results, x: &Ratios) {
    let (dec, sqsc, far, far3) = (&r.dec, &r.sqsc, &r.far, &r.far3);
    println!("| ceiling | limit | relay | ratio | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| decode, {} persistent rows (deleted when published) | pg_recvlogical {:.0} rows/s | null publisher {:.0} rows/s | {:.2} | >= 0.80 |",
        dec.rows, dec.recvlogical_rows_per_s, dec.relay_null_rows_per_s, x.relay_vs_recv
    );
    println!(
        "| decode, {} transient rows (deleted by their transaction) | pg_recvlogical {:.0} rows/s | null publisher {:.0} rows/s | {:.2} | >= 0.90 |",
        dec.rows, dec.transient_recvlogical_rows_per_s, dec.transient_relay_rows_per_s, x.transient_vs_recv
    );
    println!(
        "| decode, {} rows of Debezium's table (debezium preset) | pg_recvlogical {:.0} rows/s | null publisher {:.0} rows/s | {:.2} | >= 0.90 |",
        dec.rows, dec.debezium_recvlogical_rows_per_s, dec.debezium_relay_rows_per_s,
        dec.debezium_relay_rows_per_s / dec.debezium_recvlogical_rows_per_s
    );
    println!(
        "| settlement WAL per row (persistent; transient {} B) | INSERT {} B | relay's drain {} B (keep-mode mark alone {} B) | {:.2} | <= 0.25 |",
        dec.transient_settle_wal_per_row, dec.insert_wal_per_row, dec.settle_wal_per_row, dec.keep_mark_wal_per_row, x.settle_wal_ratio
    );
    println!(
        "| settle statement alone: delete / mark PUBLISHED | {:.0} rows/s | {:.0} rows/s | | |",
        dec.delete_only_rows_per_s, dec.mark_only_rows_per_s
    );
    println!(
        "| decode, {} persistent rows kept as PUBLISHED (published_rows = keep) | pg_recvlogical {:.0} rows/s | null publisher {:.0} rows/s, settlement WAL {} B/row | {:.2} | |",
        dec.rows, dec.recvlogical_rows_per_s, dec.keep_relay_rows_per_s, dec.keep_settle_wal_per_row, dec.keep_relay_rows_per_s / dec.recvlogical_rows_per_s
    );
    println!(
        "| SQS, {} messages, {} concurrent batches | aws-sdk-sqs {:.0} msg/s | relay {:.0} msg/s | {:.2} | >= 0.90 |",
        sqsc.messages, sqsc.concurrency, sqsc.raw_msgs_per_s, sqsc.relay_msgs_per_s, x.relay_vs_raw
    );
    println!(
        "|  sender CPU s / 100k, machine busy, calls / 100k | {} s, {}%, 10000 | {} s, {}%, {} | | |",
        sqsc.raw_cpu_s_per_100k,
        sqsc.raw_machine_busy_pct,
        sqsc.relay_cpu_s_per_100k,
        sqsc.relay_machine_busy_pct,
        sqsc.relay_calls_per_100k
    );
    println!(
        "| SQS through a proxy adding 15 ms RTT, 1 lane, {} concurrent batches (limit {:.0} msg/s) | aws-sdk-sqs {:.0} msg/s | relay {:.0} msg/s | {:.2} | >= 0.95 |",
        far.concurrency, x.far_limit, far.raw_msgs_per_s, far.relay_msgs_per_s, x.relay_vs_raw_far
    );
    println!(
        "| same, {} lanes, {} concurrent batches (limit {:.0} msg/s; ministack binds) | aws-sdk-sqs {:.0} msg/s | relay {:.0} msg/s | {:.2} | |",
        a.destinations, far3.concurrency, x.far3_limit, far3.raw_msgs_per_s, far3.relay_msgs_per_s, x.relay_vs_raw_far3
    );
}

fn print_drains(r: &Results) {
    println!();
    println!("| run | mode | rows | destinations | seconds | rows/s | CPU s / 100k | peak RSS MB |");
    println!("|---|---|---|---|---|---|---|---|");
    for d in &r.drains {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            d.case, d.mode, d.rows, d.destinations, d.seconds, d.rows_per_s, d.cpu_s_per_100k, d.peak_rss_mb
        );
    }
    let down = &r.down;
    println!(
        "| one lane's queue gone | cdc | {} | 2 | {} | - | {} | {} |",
        down.rows, down.seconds, down.cpu_s_per_100k, down.peak_rss_mb
    );
    println!();
}

fn print_results(a: &Args, r: &Results, x: &Ratios) {
    println!(
        "outbox-relay bench ({}), row {} B, {} destinations, backlog transactions of {} rows",
        if a.quick { "quick" } else { "full" },
        a.row_size,
        a.destinations,
        a.txn_size
    );
    println!();
    print_ceilings(a, r, x);
    print_decode_cpu(&r.dec);
    print_latency(&r.lat);
    print_drains(r);
    print_large(&r.large);
    print_s3(&r.s3);
}

fn decode_json(dec: &Decode) -> serde_json::Value {
    json!({"rows": dec.rows, "recvlogical_rows_per_s": dec.recvlogical_rows_per_s.round(), "relay_null_rows_per_s": dec.relay_null_rows_per_s.round(),
        "relay_null_cpu_s_per_100k": dec.relay_null_cpu_s_per_100k, "relay_null_machine_busy_pct": dec.relay_null_machine_busy_pct,
        "mark_only_rows_per_s": dec.mark_only_rows_per_s.round(), "delete_only_rows_per_s": dec.delete_only_rows_per_s.round(),
        "insert_wal_bytes_per_row": dec.insert_wal_per_row, "settle_wal_bytes_per_row": dec.settle_wal_per_row,
        "keep_mark_wal_bytes_per_row": dec.keep_mark_wal_per_row,
        "transient_recvlogical_rows_per_s": dec.transient_recvlogical_rows_per_s.round(),
        "transient_relay_null_rows_per_s": dec.transient_relay_rows_per_s.round(),
        "transient_settle_wal_bytes_per_row": dec.transient_settle_wal_per_row,
        "debezium_recvlogical_rows_per_s": dec.debezium_recvlogical_rows_per_s.round(),
        "debezium_relay_null_rows_per_s": dec.debezium_relay_rows_per_s.round(),
        "keep_relay_null_rows_per_s": dec.keep_relay_rows_per_s.round(), "keep_settle_wal_bytes_per_row": dec.keep_settle_wal_per_row,
        "cpu_s_per_100k": decode_cpu_json(dec)})
}

fn sqs_json(r: &Results, x: &Ratios) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let (sqsc, far, far3) = (&r.sqsc, &r.far, &r.far3);
    let direct = json!({
        "messages": sqsc.messages, "concurrency": sqsc.concurrency,
        "raw_msgs_per_s": sqsc.raw_msgs_per_s.round(), "relay_msgs_per_s": sqsc.relay_msgs_per_s.round(),
        "raw_cpu_s_per_100k": sqsc.raw_cpu_s_per_100k, "relay_cpu_s_per_100k": sqsc.relay_cpu_s_per_100k,
        "raw_machine_busy_pct": sqsc.raw_machine_busy_pct, "relay_machine_busy_pct": sqsc.relay_machine_busy_pct,
        "relay_calls_per_100k": sqsc.relay_calls_per_100k,
    });
    let one_lane = json!({
        "messages": far.messages, "concurrency": far.concurrency, "physical_limit_msgs_per_s": x.far_limit.round(),
        "raw_msgs_per_s": far.raw_msgs_per_s.round(), "relay_msgs_per_s": far.relay_msgs_per_s.round(),
        "raw_cpu_s_per_100k": far.raw_cpu_s_per_100k, "relay_cpu_s_per_100k": far.relay_cpu_s_per_100k,
        "relay_calls_per_100k": far.relay_calls_per_100k,
    });
    let all_lanes = json!({
        "messages": far3.messages, "concurrency": far3.concurrency, "physical_limit_msgs_per_s": x.far3_limit.round(),
        "raw_msgs_per_s": far3.raw_msgs_per_s.round(), "relay_msgs_per_s": far3.relay_msgs_per_s.round(),
        "ratio": r2(x.relay_vs_raw_far3),
    });
    (direct, one_lane, all_lanes)
}

fn targets_met(r: &Results, x: &Ratios) -> BTreeMap<&'static str, bool> {
    BTreeMap::from([
        ("relay_vs_recvlogical_0_80", x.relay_vs_recv >= 0.8),
        ("relay_vs_raw_sqs_0_90", x.relay_vs_raw >= 0.9),
        ("relay_vs_recvlogical_transient_0_90", x.transient_vs_recv >= 0.9),
        ("settle_wal_0_25_of_insert", x.settle_wal_ratio <= 0.25),
        ("relay_vs_raw_sqs_rtt_15ms_0_95", x.relay_vs_raw_far >= 0.95),
        ("cdc_p50_under_10_ms_at_1000", x.c1.p50_ms < 10.0),
        ("cdc_p50_under_5_ms_at_1000", x.c1.p50_ms < 5.0),
        ("cdc_p99_under_25_ms_at_1000", x.c1.p99_ms < 25.0),
        ("cdc_p99_under_50_ms_at_5000", x.c5.p99_ms < 50.0),
        ("cdc_calls_at_5000_no_more_than_fixed_linger", x.c5.calls_per_100k <= x.f5.calls_per_100k),
        ("peak_rss_under_100_mb_lane_down", r.down.peak_rss_mb < 100.0),
        ("peak_rss_under_256_mb_large_bodies", r.large[0].peak_rss_mb < 256.0),
        ("hot_queue_vs_min_slot_raw_0_90", r.hot.iter().all(|h| h.ratio >= 0.9)),
        ("hot_queue_cpu_1_3_of_raw", r.hot.iter().all(|h| h.cpu_ratio() <= 1.3)),
        ("throttled_nothing_lost_nothing_dead", r.throttled.nothing_lost()),
        ("many_destinations_p99_under_50_ms", r.many.iter().all(|m| m.p99_ms < 50.0)),
        ("many_destinations_rss_under_150_mb", r.many.iter().all(|m| m.relay_peak_rss_mb < 150.0)),
    ])
}

fn summary(a: &Args, r: &Results, x: &Ratios, started: Instant) -> serde_json::Value {
    let (sqs, sqs_rtt, sqs_rtt_all) = sqs_json(r, x);
    json!({
        "quick": a.quick,
        "machine": machine(),
        "seconds": started.elapsed().as_secs_f64().round(),
        "relay_vs_recvlogical": r2(x.relay_vs_recv),
        "relay_vs_raw_sqs": r2(x.relay_vs_raw),
        "relay_vs_recvlogical_transient": r2(x.transient_vs_recv),
        "settle_wal_per_insert_wal": r2(x.settle_wal_ratio),
        "relay_vs_raw_sqs_rtt_15ms": r2(x.relay_vs_raw_far),
        "cdc_p50_ms_5000": x.c5.p50_ms,
        "cdc_p99_ms_5000": x.c5.p99_ms,
        "cdc_calls_per_100k_5000": x.c5.calls_per_100k,
        "cdc_fixed_linger_calls_per_100k_5000": x.f5.calls_per_100k,
        "cdc_p50_ms": x.c1.p50_ms,
        "cdc_p99_ms": x.c1.p99_ms,
        "cdc_p999_ms": x.c1.p999_ms,
        "polling_p50_ms": x.p1.p50_ms,
        "polling_p99_ms": x.p1.p99_ms,
        "polling_p999_ms": x.p1.p999_ms,
        "peak_rss_mb_lane_down": r.down.peak_rss_mb,
        "decode": decode_json(&r.dec),
        "sqs": sqs,
        "sqs_rtt_15ms": sqs_rtt,
        "sqs_rtt_15ms_all_lanes": sqs_rtt_all,
        "latency": r.lat,
        "drains": r.drains,
        "lane_down": r.down,
        "large_bodies": r.large,
        "s3_bodies": r.s3,
        "hot_queue": r.hot,
        "throttled": r.throttled,
        "many_destinations": r.many,
        "targets_met": targets_met(r, x),
    })
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    if let Some(rtt_ms) = a.serve_standin {
        return hot_queue::serve_standin(rtt_ms).await;
    }
    let stack_guard = testkit::process::StackGuard::own("bench", "OUTBOX_RELAY_BENCH_STACK_DIR", a.keep_stack);
    let started = Instant::now();
    let steady_s = a.steady_seconds.unwrap_or(if a.quick { 4 } else { 30 });
    let sqs = sqs().await;
    eprintln!("bench: stack up ({:.1} s)", started.elapsed().as_secs_f64());
    if let Some(rates) = &a.latency_only {
        print_latency(&latency_runs(&a, &sqs, rates, steady_s).await);
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.routing_only {
        let drains = routing_drains(&a, n, 100, 2).await;
        print_routing(&drains);
        println!("{}", serde_json::to_string_pretty(&json!({ "routing": drains })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.hot_queue_only {
        let (hot, throttled) = hot_queue_rows(&a, n).await;
        hot_queue::print_hot(&hot, &throttled);
        println!("{}", serde_json::to_string_pretty(&json!({ "hot_queue": hot, "throttled": throttled })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.topic_only {
        let rows = topic::topic_drains(&a, &sqs, n, &[200, 4096]).await;
        topic::print_topics(&rows);
        println!("{}", serde_json::to_string_pretty(&json!({ "topic": rows })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.archive_only {
        let rows = archive::archive_drains(&a, &sqs, n, &[200, 4096]).await;
        archive::print_archives(&rows);
        println!("{}", serde_json::to_string_pretty(&json!({ "archive": rows })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.replay_only {
        let rows = replay::replay_drains(&a, &sqs, n, &[200, 4096]).await;
        replay::print_replays(&rows);
        println!("{}", serde_json::to_string_pretty(&json!({ "replay": rows })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(secs) = a.many_only {
        let rows = many_rows(&a, secs).await;
        many::print_many(&rows);
        println!("{}", serde_json::to_string_pretty(&json!({ "many_destinations": rows })).unwrap());
        drop(stack_guard);
        return;
    }
    if let Some(n) = a.decode_only {
        print_decode_only(&decode_ceiling(&a, n).await);
        drop(stack_guard);
        return;
    }
    if a.huge_bodies_only {
        let huge = huge_bodies_rows(&a, &sqs).await;
        print_large(&huge);
        println!("{}", serde_json::to_string_pretty(&json!({ "large_bodies": huge })).unwrap());
        drop(stack_guard);
        return;
    }
    if a.memory_only {
        let shapes = memory_shapes(&a, &sqs).await;
        print_memory(&shapes);
        println!("{}", serde_json::to_string_pretty(&json!({ "memory_shapes": shapes })).unwrap());
        drop(stack_guard);
        return;
    }
    if a.s3_only {
        let s3 = s3_bodies(&sqs, if a.quick { 60 } else { 200 }, 2 << 20).await;
        print_s3(&s3);
        println!("{}", serde_json::to_string_pretty(&json!({ "s3_bodies": s3 })).unwrap());
        drop(stack_guard);
        return;
    }
    let large = large_bodies_rows(&a, &sqs, started).await;
    if a.large_bodies_only {
        print_large(&large);
        println!("{}", serde_json::to_string_pretty(&json!({ "large_bodies": large })).unwrap());
        drop(stack_guard);
        return;
    }
    let r = measure_all(&a, &sqs, large, steady_s, started).await;
    let x = r.ratios();
    print_results(&a, &r, &x);
    hot_queue::print_hot(&r.hot, &r.throttled);
    many::print_many(&r.many);
    let text = serde_json::to_string_pretty(&summary(&a, &r, &x, started)).unwrap();
    std::fs::write(&a.json_out, &text).unwrap_or_else(|e| panic!("write {}: {e}", a.json_out.display()));
    drop(stack_guard);
    println!("{text}");
}
