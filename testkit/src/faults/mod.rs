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

mod app;
mod children;
mod consumer;
mod postgres;
mod relay_kills;
mod sqs;

use app::app_child_scenario;
pub use children::child;
use children::spawn_child;
use consumer::{consumer_duplicate_delivery, consumer_killed_mid_handler};
use postgres::postgres_restart;
use relay_kills::{relay_fail_point, relay_killed_mid_batch};
use sqs::sqs_down_one_lane;

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
// Helpers.

/// Receive from `urls` until every body in `expected` arrived (or the
/// deadline), then until a round comes back empty. All bodies received.
pub async fn collect(
    sqs: &AwsPublisher,
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
async fn receive_batch(sqs: &AwsPublisher, url: &str, wait_s: i32) -> Vec<String> {
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
