//! The fault-injection measurement: ten scenarios in which a process dies at
//! the worst moment, each repeated N times against the real PostgreSQL and
//! ministack. Run by this crate's `measure` binary (src/bin/measure.rs: 100
//! repetitions, the README's Guarantees table) and by its test,
//! tests/faults.rs (a few repetitions, in CI).
//!
//! Processes die by `SIGKILL`, or by `exit(137)` at a fail point
//! (`outbox_relay::faults`, `--features outbox-relay/failpoints`). The measurement runs on
//! a stack of its own (`OUTBOX_RELAY_STACK_DIR`), since one scenario restarts
//! PostgreSQL in immediate mode.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_consumer::queue::{Queue, QueueError, ReceivedMessage};
use outbox_consumer::sqs::SqsQueue;
use outbox_consumer::worker::Worker;
use outbox_consumer::{enqueue, NewJob};
use outbox_relay::faults::crash_point;
use rand::Rng;
use serde::Serialize;

use crate::jobs::{consumer, effects, effects_db, Effect, RunningWorker};
use crate::process::{died_like_kill_9, free_addr, scrape, series, RelayConfig, RelayProcess};
use crate::*;

pub struct Params {
    pub repetitions: usize,
    /// How long one lane's queue is gone in `sqs_down_one_lane`.
    pub sqs_outage: Duration,
    /// Lane outages run side by side in that scenario (a repetition is one
    /// lane's outage; 100 outages of 30 s one after another would take 50 min).
    pub outage_parallel: usize,
    /// This measurement's binary, for the child processes that die.
    pub child_bin: PathBuf,
    /// Only the scenarios whose names contain one of these (all when empty).
    pub only: Vec<String>,
}

/// One scenario's counters. Must-be-zero cells are checked by [`Scenario::violations`].
#[derive(Debug, Default, Clone, Serialize)]
pub struct Counters {
    pub repetitions: u64,
    /// Repetitions in which the process died where the scenario says.
    pub killed: u64,
    /// Business changes committed (jobs, or outbox rows for relay scenarios).
    pub committed: u64,
    /// Committed jobs with no outbox row: no durable record that a message is owed.
    pub missing_publish_intents: u64,
    /// Transactions that left a job without its outbox row or the reverse.
    pub partial_commits: u64,
    /// Committed rows or jobs whose message never reached the queue.
    pub missing_messages: u64,
    /// Messages received beyond the first of each.
    pub duplicate_messages: u64,
    /// Business effects beyond the first of a job generation.
    pub duplicate_business_effects: u64,
    /// Deliveries the consumer skipped because the job was already finished.
    pub duplicate_terminal_skips: u64,
    /// Messages the consumer deleted.
    pub message_deletes: u64,
    /// Outbox rows that ended DEAD.
    pub dead_rows: u64,
    /// Scenario-specific figures.
    #[serde(flatten)]
    pub extra: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    DualWriteBaseline,
    DieBetweenJobAndOutboxInsert,
    DieAfterCommitRelayAfterwards,
    RelayKilledAfterSendBeforeMark,
    RelayKilledAfterMarkBeforeConfirm,
    RelayKilledMidBatchSeveralLanes,
    PostgresRestartImmediate,
    SqsDownOneLane,
    ConsumerDuplicateDelivery,
    ConsumerKilledMidHandler,
}

pub const ALL: [Scenario; 10] = [
    Scenario::DualWriteBaseline,
    Scenario::DieBetweenJobAndOutboxInsert,
    Scenario::DieAfterCommitRelayAfterwards,
    Scenario::RelayKilledAfterSendBeforeMark,
    Scenario::RelayKilledAfterMarkBeforeConfirm,
    Scenario::RelayKilledMidBatchSeveralLanes,
    Scenario::PostgresRestartImmediate,
    Scenario::SqsDownOneLane,
    Scenario::ConsumerDuplicateDelivery,
    Scenario::ConsumerKilledMidHandler,
];

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::DualWriteBaseline => "dual_write_baseline",
            Scenario::DieBetweenJobAndOutboxInsert => "die_between_job_and_outbox_insert",
            Scenario::DieAfterCommitRelayAfterwards => "die_after_commit_relay_afterwards",
            Scenario::RelayKilledAfterSendBeforeMark => "relay_killed_after_send_before_mark",
            Scenario::RelayKilledAfterMarkBeforeConfirm => "relay_killed_after_mark_before_confirm",
            Scenario::RelayKilledMidBatchSeveralLanes => "relay_killed_mid_batch_several_lanes",
            Scenario::PostgresRestartImmediate => "postgres_restart_immediate",
            Scenario::SqsDownOneLane => "sqs_down_one_lane",
            Scenario::ConsumerDuplicateDelivery => "consumer_duplicate_delivery",
            Scenario::ConsumerKilledMidHandler => "consumer_killed_mid_handler",
        }
    }

    pub fn expected(self) -> &'static str {
        match self {
            Scenario::DualWriteBaseline => "N missing messages (the problem, measured)",
            Scenario::DieBetweenJobAndOutboxInsert => "0 partial commits",
            Scenario::DieAfterCommitRelayAfterwards => "0 missing messages",
            Scenario::RelayKilledAfterSendBeforeMark => "0 missing; duplicates counted",
            Scenario::RelayKilledAfterMarkBeforeConfirm => "0 missing; duplicates counted",
            Scenario::RelayKilledMidBatchSeveralLanes => "0 missing",
            Scenario::PostgresRestartImmediate => "0 missing, relay reconnects by itself",
            Scenario::SqsDownOneLane => "0 missing, other lanes unaffected",
            Scenario::ConsumerDuplicateDelivery => "0 duplicate effects, N terminal skips, 2N deletes",
            Scenario::ConsumerKilledMidHandler => "job completed exactly once after lease expiry",
        }
    }

    /// What the counters must show; every broken rule, in words.
    pub fn violations(self, c: &Counters) -> Vec<String> {
        let n = c.repetitions;
        let mut v = Vec::new();
        let mut need = |ok: bool, what: String| {
            if !ok {
                v.push(what);
            }
        };
        need(c.killed == n, format!("the process died where planned in {} of {n} repetitions", c.killed));
        need(c.dead_rows == 0, format!("{} rows DEAD", c.dead_rows));
        match self {
            Scenario::DualWriteBaseline => {
                need(c.missing_messages == n, format!("{} missing messages, expected {n}", c.missing_messages));
            }
            Scenario::DieBetweenJobAndOutboxInsert => {
                need(c.partial_commits == 0, format!("{} partial commits", c.partial_commits));
                need(c.committed == 0, format!("{} jobs committed by a transaction that died", c.committed));
            }
            Scenario::ConsumerDuplicateDelivery => {
                need(c.duplicate_business_effects == 0, format!("{} duplicate effects", c.duplicate_business_effects));
                need(
                    c.duplicate_terminal_skips == n,
                    format!("{} terminal skips, expected {n}", c.duplicate_terminal_skips),
                );
                need(c.message_deletes == 2 * n, format!("{} deletes, expected {}", c.message_deletes, 2 * n));
            }
            Scenario::ConsumerKilledMidHandler => {
                need(c.duplicate_business_effects == 0, format!("{} duplicate effects", c.duplicate_business_effects));
                let once = c.extra.get("completed_exactly_once").copied().unwrap_or(0.0) as u64;
                need(once == n, format!("{once} of {n} jobs completed exactly once after the lease expired"));
            }
            _ => {
                need(c.missing_messages == 0, format!("{} missing messages", c.missing_messages));
                need(c.missing_publish_intents == 0, format!("{} missing publish intents", c.missing_publish_intents));
                need(c.partial_commits == 0, format!("{} partial commits", c.partial_commits));
                need(c.committed > 0, "nothing was committed".into());
                if self == Scenario::PostgresRestartImmediate {
                    let exits = c.extra.get("relay_exits").copied().unwrap_or(0.0);
                    need(exits == 0.0, format!("the relay exited {exits} times instead of reconnecting"));
                }
                if self == Scenario::SqsDownOneLane {
                    let healthy = c.extra.get("healthy_lane_missing").copied().unwrap_or(0.0);
                    need(healthy == 0.0, format!("{healthy} messages of the healthy lane missing"));
                }
            }
        }
        v
    }
}

/// Run every selected scenario; (name, counters) in table order.
pub async fn run_all(p: &Params) -> Vec<(Scenario, Counters)> {
    let mut out = Vec::new();
    for s in ALL {
        if !p.only.is_empty() && !p.only.iter().any(|o| s.name().contains(o.as_str())) {
            continue;
        }
        let started = Instant::now();
        eprintln!("measure: {} x{} ...", s.name(), p.repetitions);
        let mut c = run(s, p).await;
        c.extra.insert("seconds".into(), (started.elapsed().as_secs_f64() * 10.0).round() / 10.0);
        eprintln!("measure: {} done in {:.1} s: {:?}", s.name(), started.elapsed().as_secs_f64(), c);
        out.push((s, c));
    }
    out
}

pub async fn run(s: Scenario, p: &Params) -> Counters {
    match s {
        Scenario::DualWriteBaseline => app_child_scenario(p, "dual-write", "dual_write::before_send").await,
        Scenario::DieBetweenJobAndOutboxInsert => {
            app_child_scenario(p, "between-inserts", "enqueue::between_inserts").await
        }
        Scenario::DieAfterCommitRelayAfterwards => app_child_scenario(p, "after-commit", "enqueue::after_commit").await,
        Scenario::RelayKilledAfterSendBeforeMark => relay_fail_point(p, "lane::after_send").await,
        Scenario::RelayKilledAfterMarkBeforeConfirm => relay_fail_point(p, "cdc::before_confirm").await,
        Scenario::RelayKilledMidBatchSeveralLanes => relay_killed_mid_batch(p).await,
        Scenario::PostgresRestartImmediate => postgres_restart(p).await,
        Scenario::SqsDownOneLane => sqs_down_one_lane(p).await,
        Scenario::ConsumerDuplicateDelivery => consumer_duplicate_delivery(p).await,
        Scenario::ConsumerKilledMidHandler => consumer_killed_mid_handler(p).await,
    }
}

// ---------------------------------------------------------------------------
// Children: the processes that die. `measure child <mode> <args...>`.

/// Run a child mode; returns only if the fail point did not fire.
pub async fn child(args: &[String]) -> anyhow::Result<()> {
    outbox_relay::faults::configure_from_env().map_err(anyhow::Error::msg)?;
    let arg = |i: usize| args.get(i).cloned().ok_or_else(|| anyhow::anyhow!("child: argument {i} missing"));
    let (mode, url) = (arg(0)?, arg(1)?);
    match mode.as_str() {
        "dual-write" => child_dual_write(&url, &arg(2)?, &arg(3)?, &arg(4)?).await,
        "between-inserts" => child_between_inserts(&url, &arg(2)?).await,
        "after-commit" => child_after_commit(&url, &arg(2)?).await,
        "worker" => child_worker(&url, &arg(2)?, &arg(3)?).await,
        other => anyhow::bail!("child: unknown mode {other:?}"),
    }
}

/// What the outbox replaces: commit the job, then send the message.
async fn child_dual_write(url: &str, endpoint: &str, queue: &str, tag: &str) -> anyhow::Result<()> {
    let c = outbox_relay::db::connect(url).await?;
    let sqs = SqsPublisher::new("us-east-1", Some(endpoint)).await;
    let job_id = format!("dw-{tag}");
    c.execute(
        "INSERT INTO jobs (job_id, kind, payload, destination) VALUES ($1, 'effect', jsonb_build_object('tag', $2::text), 'jobs')",
        &[&job_id, &tag],
    )
    .await?;
    crash_point("dual_write::before_send");
    sqs.client().send_message().queue_url(queue).message_body(&job_id).send().await?;
    Ok(())
}

/// An application writing the job and its event as two statements of one
/// transaction, dying between them.
async fn child_between_inserts(url: &str, tag: &str) -> anyhow::Result<()> {
    let mut c = outbox_relay::db::connect(url).await?;
    let tx = c.transaction().await?;
    let payload = serde_json::json!({ "tag": tag });
    let id = outbox_consumer::job_id(&tx, "effect", &payload).await?;
    tx.execute(
        "INSERT INTO jobs (job_id, kind, payload, destination) VALUES ($1, 'effect', $2, 'jobs')",
        &[&id, &payload],
    )
    .await?;
    crash_point("enqueue::between_inserts");
    tx.execute(
        "INSERT INTO outbox (event_id, destination, body) VALUES ('effect:' || $1 || ':0', 'jobs', outbox_job_message($1, 'effect', 0))",
        &[&id],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The library's enqueue, committed; the process dies right after.
async fn child_after_commit(url: &str, tag: &str) -> anyhow::Result<()> {
    let mut c = outbox_relay::db::connect(url).await?;
    let tx = c.transaction().await?;
    let payload = serde_json::json!({ "tag": tag });
    enqueue(&tx, &NewJob { kind: "effect", payload: &payload, destination: "jobs", group_key: None, job_id: None })
        .await?;
    tx.commit().await?;
    crash_point("enqueue::after_commit");
    Ok(())
}

/// A worker whose handler dies after writing its effect.
async fn child_worker(url: &str, endpoint: &str, queue: &str) -> anyhow::Result<()> {
    // The connection the other modes use, made first here too.
    let _c = outbox_relay::db::connect(url).await?;
    let sqs = SqsPublisher::new("us-east-1", Some(endpoint)).await;
    let cons = Arc::new(consumer(url, "doomed", Duration::from_secs(1)).handle("effect", Effect));
    let q = SqsQueue::new(sqs.client().clone(), queue.to_string());
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        for m in q.receive(1, Duration::from_secs(1)).await? {
            cons.process(&q, &m).await?;
        }
    }
    anyhow::bail!("worker: no message to die on within 20 s");
}

/// Spawn `measure child ...` with `FAILPOINTS`; true if it died like kill -9.
async fn spawn_child(p: &Params, args: &[&str], failpoints: &str) -> bool {
    let mut cmd = tokio::process::Command::new(&p.child_bin);
    cmd.arg("child")
        .args(args)
        .env("FAILPOINTS", failpoints)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out =
        tokio::time::timeout(Duration::from_secs(60), cmd.output()).await.expect("child finishes within 60 s").unwrap();
    let died = died_like_kill_9(&out.status);
    if !died {
        eprintln!("measure: child {args:?} did not die: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    died
}

// ---------------------------------------------------------------------------
// Helpers.

/// Receive from `urls` until every body in `expected` arrived (or the
/// deadline), then until a round comes back empty. All bodies received.
pub async fn collect(
    sqs: &SqsPublisher,
    urls: &[String],
    expected: &HashSet<String>,
    deadline: Duration,
) -> Vec<String> {
    let end = Instant::now() + deadline;
    let mut got: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        let complete = expected.iter().all(|e| seen.contains(e));
        let mut round = 0;
        for url in urls {
            let msgs = receive_batch(sqs, url, 0).await;
            round += msgs.len();
            for b in msgs {
                seen.insert(b.clone());
                got.push(b);
            }
        }
        if (complete && round == 0) || Instant::now() >= end {
            return got;
        }
        if round == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Bodies of one receive round; a failed receive (a deleted queue) is an
/// empty round after a pause, and bodies count even if their delete failed.
async fn receive_batch(sqs: &SqsPublisher, url: &str, wait_s: i32) -> Vec<String> {
    match receive_round(sqs, url, wait_s).await {
        Ok(round) => round.messages.into_iter().map(|(body, _)| body).collect(),
        Err(_) => {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Vec::new()
        }
    }
}

/// Missing and duplicate counts of `got` against `expected`; bodies that are
/// not expected (late copies from an earlier repetition) count as duplicates.
fn tally(c: &mut Counters, expected: &HashSet<String>, got: &[String]) {
    let unique: HashSet<&String> = got.iter().collect();
    c.missing_messages += expected.iter().filter(|e| !unique.contains(e)).count() as u64;
    c.duplicate_messages +=
        (got.len() - unique.len()) as u64 + unique.iter().filter(|b| !expected.contains(**b)).count() as u64;
}

/// The bodies of the committed rows matching `where_clause` (from the audit
/// copy: settlement deletes published rows).
async fn bodies(db: &TestDb, where_clause: &str) -> HashSet<String> {
    db.client()
        .await
        .query(&format!("SELECT body FROM outbox_audit WHERE {where_clause}"), &[])
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.get(0))
        .collect()
}

async fn count_where(db: &TestDb, sql: &str) -> i64 {
    db.client().await.query_one(sql, &[]).await.unwrap().get(0)
}

async fn slot_active(db: &TestDb) -> bool {
    let Ok(c) = outbox_relay::db::connect(&db.url).await else { return false };
    c.query_opt("SELECT active FROM pg_replication_slots WHERE slot_name = $1", &[&db.slot])
        .await
        .ok()
        .flatten()
        .map(|r| r.get::<_, bool>(0))
        .unwrap_or(false)
}

/// Create the slot with a relay run, so later rows travel the stream.
async fn create_slot(db: &TestDb, cfg: &RelayConfig) {
    let r = cfg.spawn();
    wait_for("the relay streams", Duration::from_secs(60), || async { slot_active(db).await }).await;
    r.terminate(Duration::from_secs(15)).await.expect("relay stops on SIGTERM");
}

/// Wait (without panicking) until the rows matching `where_clause` are no
/// longer NEW and the slot confirmed `lsn`; false at the deadline.
async fn settled(db: &TestDb, where_clause: &str, lsn: u64, deadline: Duration) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        let ok = async {
            let c = outbox_relay::db::connect(&db.url).await.ok()?;
            let new: i64 = c
                .query_one(&format!("SELECT count(*) FROM outbox WHERE status = 'NEW' AND ({where_clause})"), &[])
                .await
                .ok()?
                .get(0);
            let conf: Option<i64> = c
                .query_opt(
                    "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &[&db.slot],
                )
                .await
                .ok()?
                .and_then(|r| r.get(0));
            Some(new == 0 && conf.unwrap_or(0) as u64 >= lsn)
        }
        .await
        .unwrap_or(false);
        if ok {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

// ---------------------------------------------------------------------------
// Scenarios 1-3: the application process dies.

async fn app_child_scenario(p: &Params, mode: &str, point: &str) -> Counters {
    let db = effects_db(&mode.replace('-', "_")).await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "jobs", false, None).await;
    let relay_cfg = RelayConfig::new(&db, "cdc", &[("jobs", &q)], "");
    if mode == "after-commit" {
        create_slot(&db, &relay_cfg).await;
    }
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    for rep in 0..p.repetitions {
        let tag = format!("{rep}");
        let args: Vec<&str> = match mode {
            "dual-write" => vec![mode, &db.url, &stack().sqs_url, &q, &tag],
            _ => vec![mode, &db.url, &tag],
        };
        if spawn_child(p, &args, &format!("{point}=return")).await {
            c.killed += 1;
        }
    }
    let jobs = count_where(&db, "SELECT count(*) FROM jobs").await;
    c.committed = jobs as u64;
    let jobs_without_event =
        count_where(&db, "SELECT count(*) FROM jobs j WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = j.kind || ':' || j.job_id || ':0')").await;
    let events_without_job = count_where(
        &db,
        "SELECT count(*) FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE o.event_id = j.kind || ':' || j.job_id || ':0')",
    )
    .await;
    c.missing_publish_intents = jobs_without_event as u64;
    match mode {
        "dual-write" => dual_write_deliveries(&db, &sqs, &q, &mut c).await,
        "between-inserts" => c.partial_commits = (jobs_without_event + events_without_job) as u64,
        _ => {
            c.partial_commits = (jobs_without_event + events_without_job) as u64;
            relay_afterwards(&db, &sqs, &q, &relay_cfg, &mut c).await;
        }
    }
    c
}

/// No outbox: a job whose message is not in the queue is lost.
async fn dual_write_deliveries(db: &TestDb, sqs: &SqsPublisher, q: &str, c: &mut Counters) {
    let expected: HashSet<String> =
        db.client().await.query("SELECT job_id FROM jobs", &[]).await.unwrap().into_iter().map(|r| r.get(0)).collect();
    let got = collect(sqs, &[q.to_string()], &expected, Duration::from_secs(3)).await;
    tally(c, &expected, &got);
}

/// The relay runs after the application died: it publishes every row.
async fn relay_afterwards(db: &TestDb, sqs: &SqsPublisher, q: &str, relay_cfg: &RelayConfig, c: &mut Counters) {
    let lsn = db.current_lsn().await;
    let relay = relay_cfg.spawn();
    settled(db, "true", lsn, Duration::from_secs(120)).await;
    let expected = bodies(db, "true").await;
    let got = collect(sqs, &[q.to_string()], &expected, Duration::from_secs(60)).await;
    relay.terminate(Duration::from_secs(15)).await;
    tally(c, &expected, &got);
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
}

// ---------------------------------------------------------------------------
// Scenarios 4-5: the relay dies at a fail point; a fresh relay takes over.

async fn relay_fail_point(p: &Params, point: &str) -> Counters {
    let db = TestDb::new(&point.replace("::", "_")).await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let (qa, qb) = (create_queue(&sqs, "fa", false, None).await, create_queue(&sqs, "fb", false, None).await);
    let cfg = RelayConfig::new(&db, "cdc", &[("a", &qa), ("b", &qb)], "");
    create_slot(&db, &cfg).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut marked_at_death = 0u64;
    let mut unconfirmed_marked = 0u64;
    let w = db.client().await;
    for rep in 0..p.repetitions {
        // Three transactions over two lanes, committed before the relay starts.
        for t in 0..3 {
            insert_rows(&w, &format!("r{rep}t{t}a"), "a", 10, None).await;
            insert_rows(&w, &format!("r{rep}t{t}b"), "b", 10, None).await;
        }
        let lsn = db.current_lsn().await;
        let before = db.confirmed_flush_lsn().await;
        let skip = rand::rng().random_range(0..3);
        let actions = if skip == 0 { "return".to_string() } else { format!("{skip}*off->return") };
        let mut r = cfg.spawn_with(&[("FAILPOINTS", &format!("{point}={actions}"))]);
        match r.wait_exit(Duration::from_secs(60)).await {
            Some(s) if died_like_kill_9(&s) => c.killed += 1,
            other => eprintln!("measure: {point}: relay did not die at the fail point: {other:?}"),
        }
        drop(r);
        let filter = format!("event_id LIKE 'r{rep}t%'");
        let marked = count_where(
            &db,
            &format!("SELECT count(*) FROM outbox_audit a WHERE {filter} AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = a.event_id AND o.status = 'NEW')"),
        )
        .await as u64;
        marked_at_death += marked;
        let confirmed = db.confirmed_flush_lsn().await;
        if marked > 0 && confirmed < lsn && confirmed >= before {
            unconfirmed_marked += 1;
        }
        let r = cfg.spawn();
        settled(&db, &filter, lsn, Duration::from_secs(60)).await;
        let expected = bodies(&db, &filter).await;
        c.committed += expected.len() as u64;
        let got = collect(&sqs, &[qa.clone(), qb.clone()], &expected, Duration::from_secs(60)).await;
        r.terminate(Duration::from_secs(15)).await;
        tally(&mut c, &expected, &got);
    }
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    c.extra.insert("rows_marked_when_killed".into(), marked_at_death as f64);
    c.extra.insert("kills_with_marked_rows_unconfirmed".into(), unconfirmed_marked as f64);
    c
}

// ---------------------------------------------------------------------------
// Scenario 6: SIGKILL while several lanes hold batches in flight.

/// outbox_relay_in_flight_events per destination, from /metrics.
async fn in_flight(addr: &str) -> Option<HashMap<String, f64>> {
    let text = scrape(addr).await?;
    Some(
        series(&text, "outbox_relay_in_flight_events")
            .into_iter()
            .filter_map(|(labels, v)| Some((labels.split("destination=\"").nth(1)?.split('"').next()?.to_string(), v)))
            .collect(),
    )
}

async fn relay_killed_mid_batch(p: &Params) -> Counters {
    let db = TestDb::new("midbatch").await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let mut queues = Vec::new();
    for l in ["a", "b", "c", "d"] {
        queues.push((l, create_queue(&sqs, &format!("m{l}"), false, None).await));
    }
    let dests: Vec<(&str, &str)> = queues.iter().map(|(l, q)| (*l, q.as_str())).collect();
    let urls: Vec<String> = queues.iter().map(|(_, q)| q.clone()).collect();
    let addr = free_addr();
    let cfg = RelayConfig::new(&db, "cdc", &dests, &format!("metrics_addr = \"{addr}\""));
    create_slot(&db, &cfg).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut lanes_at_kill = Vec::new();
    let w = db.client().await;
    for rep in 0..p.repetitions {
        for (l, _) in &queues {
            insert_rows(&w, &format!("r{rep}{l}"), l, 400, None).await;
        }
        let lsn = db.current_lsn().await;
        let filter = format!("event_id LIKE 'r{rep}_:%'");
        let r = cfg.spawn();
        // Kill as soon as at least two lanes hold unsettled events.
        let end = Instant::now() + Duration::from_secs(30);
        let mut lanes = 0;
        while Instant::now() < end {
            if let Some(m) = in_flight(&addr).await {
                lanes = m.values().filter(|v| **v > 0.0).count();
                if lanes >= 2 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        r.kill();
        if lanes >= 2 {
            c.killed += 1;
        }
        lanes_at_kill.push(lanes as f64);
        let r = cfg.spawn();
        settled(&db, &filter, lsn, Duration::from_secs(60)).await;
        let expected = bodies(&db, &filter).await;
        c.committed += expected.len() as u64;
        let got = collect(&sqs, &urls, &expected, Duration::from_secs(60)).await;
        r.terminate(Duration::from_secs(15)).await;
        tally(&mut c, &expected, &got);
    }
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    c.extra.insert(
        "mean_lanes_in_flight_at_kill".into(),
        round1(lanes_at_kill.iter().sum::<f64>() / lanes_at_kill.len().max(1) as f64),
    );
    c
}

// ---------------------------------------------------------------------------
// Scenario 7: PostgreSQL restarted in immediate mode under a streaming relay.

fn restart_postgres() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/dev-stack");
    let st = Command::new("bash").arg(script).arg("pg-restart").stdout(Stdio::null()).status().unwrap();
    assert!(st.success(), "scripts/dev-stack pg-restart failed");
}

async fn postgres_restart(p: &Params) -> Counters {
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

// ---------------------------------------------------------------------------
// Scenario 8: one lane's queue gone for a while; the other lanes carry on.

async fn sqs_down_one_lane(p: &Params) -> Counters {
    let db = TestDb::new("sqsdown").await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let parallel = p.outage_parallel.clamp(1, p.repetitions.max(1));
    let healthy = create_queue(&sqs, "healthy", false, None).await;
    let mut sick = Vec::new();
    for i in 0..parallel {
        sick.push((format!("s{i}"), create_queue(&sqs, &format!("sick{i}"), false, None).await));
    }
    let mut dests: Vec<(&str, &str)> = vec![("h", healthy.as_str())];
    dests.extend(sick.iter().map(|(l, q)| (l.as_str(), q.as_str())));
    let cfg = RelayConfig::new(
        &db,
        "cdc",
        &dests,
        "lane_stall_timeout = \"10s\"\nretry_base = \"500ms\"\nretry_max = \"5s\"",
    );
    let relay = cfg.spawn();
    wait_for("the relay streams", Duration::from_secs(60), || async { slot_active(&db).await }).await;
    let lanes = Lanes::start(&db, &sqs, healthy, sick).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let windows = lanes.outages(&db, &sqs, p, parallel, &mut c).await;
    // Let the spools drain, then stop writing and collect the rest.
    let (expected_all, received) = lanes.finish(&db).await;
    relay.terminate(Duration::from_secs(15)).await;
    let got: Vec<String> = received.values().flatten().cloned().collect();
    report_missing(&db, &expected_all, &got, &windows).await;
    c.committed = expected_all.len() as u64;
    tally(&mut c, &expected_all, &got);
    let healthy_expected = bodies(&db, "destination = 'h'").await;
    let healthy_got: HashSet<String> = received.get("h").cloned().unwrap_or_default().into_iter().collect();
    c.extra.insert(
        "healthy_lane_missing".into(),
        healthy_expected.iter().filter(|b| !healthy_got.contains(*b)).count() as f64,
    );
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    // Every mark counts an attempt: a row deferred to the table and sent later has two or more.
    c.extra.insert("rows_deferred_to_table".into(), db.count("attempts > 1").await as f64);
    healthy_latency(&db, &windows, &mut c).await;
    c.extra.insert("outage_seconds".into(), p.sqs_outage.as_secs_f64());
    c.extra.insert("outages_side_by_side".into(), parallel as f64);
    c
}

/// The lanes of sqs_down_one_lane while rows flow: a receiver per queue, all
/// the time, into one list per lane; a writer committing a transaction every
/// 100 ms with 2 rows per lane, whose sick lanes' rows can be held back while
/// their queues are drained.
struct Lanes {
    /// (lane, queue URL) of the lanes whose queues go away.
    sick: Vec<(String, String)>,
    received: Arc<Mutex<HashMap<String, Vec<String>>>>,
    stop_receivers: Arc<AtomicBool>,
    receivers: Vec<tokio::task::JoinHandle<()>>,
    stop_writer: Arc<AtomicBool>,
    hold_sick: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<()>,
}

impl Lanes {
    async fn start(db: &TestDb, sqs: &SqsPublisher, healthy: String, sick: Vec<(String, String)>) -> Lanes {
        let received: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
        let stop_receivers = Arc::new(AtomicBool::new(false));
        let mut receivers = Vec::new();
        for (lane, url) in std::iter::once(("h".to_string(), healthy)).chain(sick.iter().cloned()) {
            let (sqs, received, stop) = (sqs.clone(), Arc::clone(&received), Arc::clone(&stop_receivers));
            receivers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let got = receive_batch(&sqs, &url, 1).await;
                    received.lock().unwrap().entry(lane.clone()).or_default().extend(got);
                }
            }));
        }
        let stop_writer = Arc::new(AtomicBool::new(false));
        let hold_sick = Arc::new(AtomicBool::new(false));
        let lanes: Vec<String> = sick.iter().map(|(l, _)| l.clone()).collect();
        let writer = lane_writer(db.client().await, lanes, Arc::clone(&stop_writer), Arc::clone(&hold_sick));
        Lanes { sick, received, stop_receivers, receivers, stop_writer, hold_sick, writer }
    }

    /// `p.repetitions` outages, `parallel` side by side: the sick queues
    /// deleted for `p.sqs_outage`, then created again. The outages' windows
    /// (epoch seconds of the database clock).
    async fn outages(
        &self,
        db: &TestDb,
        sqs: &SqsPublisher,
        p: &Params,
        parallel: usize,
        c: &mut Counters,
    ) -> Vec<(f64, f64)> {
        let mut windows = Vec::new();
        let mut done = 0;
        while done < p.repetitions {
            let k = parallel.min(p.repetitions - done);
            self.drain_sick(db).await;
            for (_, url) in self.sick.iter().take(k) {
                sqs.client().delete_queue().queue_url(url).send().await.unwrap();
            }
            let from = db_epoch(db).await;
            self.hold_sick.store(false, Ordering::Relaxed);
            tokio::time::sleep(p.sqs_outage).await;
            for (_, url) in self.sick.iter().take(k) {
                let name = url.rsplit('/').next().unwrap();
                let again = sqs.client().create_queue().queue_name(name).send().await.unwrap().queue_url.unwrap();
                assert_eq!(&again, url, "ministack gives a recreated queue its old URL");
            }
            windows.push((from, db_epoch(db).await));
            c.killed += k as u64;
            done += k;
        }
        windows
    }

    /// Everything already sent to the doomed queues must be received first:
    /// deleting a queue deletes its messages, which is not the relay's loss.
    /// Holds the sick lanes' rows back until the outage starts.
    async fn drain_sick(&self, db: &TestDb) {
        let sick_list = self.sick.iter().map(|(l, _)| format!("'{l}'")).collect::<Vec<_>>().join(",");
        self.hold_sick.store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        wait_for("sick lanes drained before the outage", Duration::from_secs(120), || async {
            if db.count(&format!("status = 'NEW' AND destination IN ({sick_list})")).await != 0 {
                return false;
            }
            let published: HashSet<String> = bodies(db, &format!("destination IN ({sick_list})")).await;
            let r = self.received.lock().unwrap();
            let got: HashSet<&String> = r.iter().filter(|(l, _)| *l != "h").flat_map(|(_, v)| v.iter()).collect();
            published.iter().all(|b| got.contains(b))
        })
        .await;
    }

    /// Stop writing, wait until every row is settled and received (60 s at
    /// most) and for stragglers, stop receiving. Every row's body, and what
    /// each lane received.
    async fn finish(self, db: &TestDb) -> (HashSet<String>, HashMap<String, Vec<String>>) {
        self.stop_writer.store(true, Ordering::Relaxed);
        self.writer.await.unwrap();
        let lsn = db.current_lsn().await;
        settled(db, "true", lsn, Duration::from_secs(120)).await;
        let expected_all = bodies(db, "true").await;
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let all: HashSet<String> = self.received.lock().unwrap().values().flatten().cloned().collect();
            if expected_all.iter().all(|b| all.contains(b)) || Instant::now() > end {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await; // stragglers (duplicates)
        self.stop_receivers.store(true, Ordering::Relaxed);
        for r in self.receivers {
            let _ = r.await;
        }
        let received = std::mem::take(&mut *self.received.lock().unwrap());
        (expected_all, received)
    }
}

/// The writer of [`Lanes`]: 2 rows per lane every 100 ms; the sick lanes'
/// rows only while `hold` is false.
fn lane_writer(
    c: Client,
    lanes: Vec<String>,
    stop: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut k = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut ls = vec!["h".to_string()];
            if !hold.load(Ordering::Relaxed) {
                ls.extend(lanes.iter().cloned());
            }
            c.execute(
                "INSERT INTO outbox (event_id, destination, body) SELECT 'w' || $1 || l || i, l, 'w' || $1 || l || i FROM unnest($2::text[]) l, generate_series(1, 2) i",
                &[&k.to_string(), &ls],
            )
            .await
            .unwrap();
            k += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The database's clock, in epoch seconds.
async fn db_epoch(db: &TestDb) -> f64 {
    let c = db.client().await;
    c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await.unwrap().get::<_, f64>(0)
}

/// Name up to five missing rows with their state, for the log.
async fn report_missing(db: &TestDb, expected: &HashSet<String>, got: &[String], windows: &[(f64, f64)]) {
    let got_set: HashSet<&String> = got.iter().collect();
    let missing: Vec<&String> = expected.iter().filter(|b| !got_set.contains(b)).take(5).collect();
    for b in missing {
        let r = db
            .client()
            .await
            .query_opt("SELECT destination, status, attempts, created_at::text, published_at::text FROM outbox WHERE body = $1", &[b])
            .await
            .unwrap();
        let Some(r) = r else {
            eprintln!("measure: sqs_down_one_lane: {b} missing: published and deleted; outages {windows:?}");
            continue;
        };
        eprintln!(
            "measure: sqs_down_one_lane: {b} missing: {:?} {:?} attempts {:?} created {:?} published {:?}; outages {windows:?}",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i32>(2),
            r.get::<_, String>(3),
            r.get::<_, Option<String>>(4)
        );
    }
}

/// The healthy lane's commit-to-mark latency outside and inside the outages.
async fn healthy_latency(db: &TestDb, windows: &[(f64, f64)], c: &mut Counters) {
    let lat = db
        .client()
        .await
        .query(
            "SELECT extract(epoch FROM created_at)::float8, extract(epoch FROM published_at - created_at)::float8 * 1000 FROM outbox WHERE destination = 'h' AND published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let (mut inside, mut outside): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for r in lat {
        let (at, ms): (f64, f64) = (r.get(0), r.get(1));
        if windows.iter().any(|(a, b)| at >= *a && at <= *b) {
            inside.push(ms);
        } else {
            outside.push(ms);
        }
    }
    c.extra.insert("healthy_p50_ms_outside_outages".into(), round1(percentile(&mut outside.clone(), 0.5)));
    c.extra.insert("healthy_p99_ms_outside_outages".into(), round1(percentile(&mut outside, 0.99)));
    c.extra.insert("healthy_p50_ms_during_outages".into(), round1(percentile(&mut inside.clone(), 0.5)));
    c.extra.insert("healthy_p99_ms_during_outages".into(), round1(percentile(&mut inside, 0.99)));
}

// ---------------------------------------------------------------------------
// Scenarios 9-10: the consumer.

/// A queue that counts deletes.
struct Counting {
    inner: SqsQueue,
    deletes: AtomicU64,
}

#[async_trait]
impl Queue for Counting {
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
        self.inner.receive(max, wait).await
    }
    async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
        self.inner.delete(receipt).await?;
        self.deletes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError> {
        self.inner.change_visibility(receipt, after).await
    }
}

async fn duplicate_effects(db: &TestDb) -> u64 {
    count_where(db, "SELECT coalesce(sum(n - 1), 0)::bigint FROM (SELECT count(*) n FROM business_effects GROUP BY job_id, generation) x").await
        as u64
}

async fn consumer_duplicate_delivery(p: &Params) -> Counters {
    let n = p.repetitions;
    let db = effects_db("dupdeliver").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "dup", false, None).await;
    let cfg = RelayConfig::new(&db, "cdc", &[("jobs", &q)], "");
    create_slot(&db, &cfg).await;
    let relay = cfg.spawn();
    let w = db.client().await;
    for i in 0..n {
        let payload = serde_json::json!({ "dup": i });
        enqueue(&w, &NewJob { kind: "effect", payload: &payload, destination: "jobs", group_key: None, job_id: None })
            .await
            .unwrap();
    }
    let lsn = db.current_lsn().await;
    settled(&db, "true", lsn, Duration::from_secs(120)).await;
    relay.terminate(Duration::from_secs(15)).await;
    send_every_message_again(&db, &sqs, &q).await;
    let queue = Arc::new(Counting { inner: SqsQueue::new(sqs.client().clone(), &q), deletes: AtomicU64::new(0) });
    let worker = Worker::new(
        Arc::new(consumer(&db.url, "w", Duration::from_secs(5)).handle("effect", Effect)),
        queue.clone(),
        8,
    );
    let worker = RunningWorker::start(worker, Duration::from_secs(1));
    let metrics = Arc::clone(&worker.metrics);
    let end = Instant::now() + Duration::from_secs(120);
    while queue.deletes.load(Ordering::Relaxed) < 2 * n as u64 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    worker.stop().await;
    let succeeded = count_where(&db, "SELECT count(*) FROM jobs WHERE status = 'SUCCEEDED'").await as u64;
    Counters {
        repetitions: n as u64,
        killed: n as u64, // every job delivered twice: the fault is the second copy
        committed: n as u64,
        missing_messages: (n as u64).saturating_sub(succeeded),
        duplicate_messages: n as u64,
        duplicate_business_effects: duplicate_effects(&db).await,
        duplicate_terminal_skips: metrics.count("terminal_skip"),
        message_deletes: queue.deletes.load(Ordering::Relaxed),
        extra: BTreeMap::from([
            ("jobs_succeeded".into(), succeeded as f64),
            ("deliveries_busy_or_fenced".into(), (metrics.count("busy") + metrics.count("fenced")) as f64),
        ]),
        ..Default::default()
    }
}

async fn consumer_killed_mid_handler(p: &Params) -> Counters {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let db = effects_db("killedworker").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "killed", false, None).await;
    sqs.client().set_queue_attributes().queue_url(&q).attributes(A::VisibilityTimeout, "1").send().await.unwrap();
    let queue = Arc::new(Counting { inner: SqsQueue::new(sqs.client().clone(), &q), deletes: AtomicU64::new(0) });
    let rescuer = Arc::new(consumer(&db.url, "rescuer", Duration::from_secs(5)).handle("effect", Effect));
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut once = 0u64;
    let mut rescue_ms = Vec::new();
    let w = db.client().await;
    for rep in 0..p.repetitions {
        let payload = serde_json::json!({ "killed": rep });
        let id = enqueue(
            &w,
            &NewJob { kind: "effect", payload: &payload, destination: "jobs", group_key: None, job_id: None },
        )
        .await
        .unwrap();
        c.committed += 1;
        let body: String = w.query_one("SELECT outbox_job_message($1, 'effect', 0)", &[&id]).await.unwrap().get(0);
        sqs.client().send_message().queue_url(&q).message_body(body).send().await.unwrap();
        // A worker process claims it and dies inside the handler.
        if spawn_child(p, &["worker", &db.url, &stack().sqs_url, &q], "consumer::in_handler=return").await {
            c.killed += 1;
        }
        let died = Instant::now();
        // Another worker finds it after the lease expires.
        let worker = RunningWorker::start(Worker::new(Arc::clone(&rescuer), queue.clone(), 2), Duration::from_secs(1));
        let metrics = Arc::clone(&worker.metrics);
        let state = job_state_within(&w, &id, "SUCCEEDED", Duration::from_secs(60)).await;
        rescue_ms.push(died.elapsed().as_secs_f64() * 1000.0);
        worker.stop().await;
        let n_effects = effects(&db, &format!("job_id = '{id}'")).await;
        let attempts: i32 =
            w.query_one("SELECT attempt_count FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0);
        if state == "SUCCEEDED" && n_effects == 1 && attempts == 2 && metrics.rescued.get() == 1 {
            once += 1;
        } else {
            eprintln!(
                "measure: consumer_killed_mid_handler: job {id}: {state}, {n_effects} effects, {attempts} attempts"
            );
        }
        if state != "SUCCEEDED" {
            c.missing_messages += 1;
        }
    }
    c.duplicate_business_effects = duplicate_effects(&db).await;
    c.message_deletes = queue.deletes.load(Ordering::Relaxed);
    c.extra.insert("completed_exactly_once".into(), once as f64);
    c.extra.insert("rescue_ms_p50".into(), round1(percentile(&mut rescue_ms.clone(), 0.5)));
    c.extra.insert("rescue_ms_max".into(), round1(percentile(&mut rescue_ms, 1.0)));
    c
}

/// The state of job `id` once it is `want`, or the last seen when `within`
/// has passed.
async fn job_state_within(w: &Client, id: &str, want: &str, within: Duration) -> String {
    let end = Instant::now() + within;
    let mut state = String::new();
    while Instant::now() < end {
        state = w.query_one("SELECT status FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0);
        if state == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state
}

/// Every message a second time, as a relay crash or SQS itself may do.
async fn send_every_message_again(db: &TestDb, sqs: &SqsPublisher, q: &str) {
    let all: Vec<String> = bodies(db, "true").await.into_iter().collect();
    for chunk in all.chunks(10) {
        let mut req = sqs.client().send_message_batch().queue_url(q);
        for (i, b) in chunk.iter().enumerate() {
            req = req.entries(
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(b)
                    .build()
                    .unwrap(),
            );
        }
        req.send().await.unwrap();
    }
}

// ---------------------------------------------------------------------------
// Output.

pub fn table(results: &[(Scenario, Counters)]) -> String {
    let mut s = String::from(
        "| scenario | expected | N | killed | missing msgs | duplicate msgs | partial commits | missing intents | dup effects | terminal skips | deletes | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (sc, c) in results {
        let v = sc.violations(c);
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            sc.name(),
            sc.expected(),
            c.repetitions,
            c.killed,
            c.missing_messages,
            c.duplicate_messages,
            c.partial_commits,
            c.missing_publish_intents,
            c.duplicate_business_effects,
            c.duplicate_terminal_skips,
            c.message_deletes,
            if v.is_empty() { "as expected".to_string() } else { format!("FAILED: {}", v.join("; ")) }
        ));
    }
    s
}

pub fn json(results: &[(Scenario, Counters)], p: &Params) -> serde_json::Value {
    let mut scenarios = serde_json::Map::new();
    let mut violations = Vec::new();
    for (sc, c) in results {
        scenarios.insert(sc.name().into(), serde_json::to_value(c).unwrap());
        for v in sc.violations(c) {
            violations.push(format!("{}: {v}", sc.name()));
        }
    }
    serde_json::json!({
        "repetitions": p.repetitions,
        "sqs_outage_seconds": p.sqs_outage.as_secs_f64(),
        "scenarios": scenarios,
        "violations": violations,
    })
}
