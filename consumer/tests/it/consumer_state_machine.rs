//! Property test of the job state machine against the real PostgreSQL: no
//! sequence of concurrent deliveries, handler outcomes, lease expiries,
//! crashes mid-handler, redrives and cancellations yields two completions of
//! one job generation, and a SUCCEEDED job has exactly one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer::memory::MemoryQueue;
use outbox_consumer::queue::Queue;
use outbox_consumer::{enqueue, redrive, request_cancel, Consumer, ConsumerConfig, Handler, HandlerError, Job, NewJob};
use proptest::prelude::*;
use testkit::jobs::{effects_db, Effect};
use testkit::*;
use tokio_postgres::Transaction;

#[derive(Debug, Clone, Copy)]
enum Behaviour {
    Succeed,
    Retry,
    Permanent,
    /// The worker dies mid-handler (its future is dropped after the effect
    /// was written in the open transaction).
    Crash,
}

struct Scripted(Behaviour);

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError> {
        Effect.handle(job, tx).await?;
        match self.0 {
            Behaviour::Succeed => Ok(()),
            Behaviour::Retry => Err(HandlerError::Retry("again".into())),
            Behaviour::Permanent => Err(HandlerError::Permanent("never".into())),
            Behaviour::Crash => std::future::pending().await,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Deliveries processed at the same time, each by its own worker.
    Deliver(Vec<(Behaviour, bool)>),
    ExpireLeasesAndBackoffs,
    Redrive,
    Cancel,
}

fn behaviour() -> impl Strategy<Value = Behaviour> {
    prop_oneof![
        4 => Just(Behaviour::Succeed),
        2 => Just(Behaviour::Retry),
        1 => Just(Behaviour::Permanent),
        2 => Just(Behaviour::Crash),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::collection::vec((behaviour(), any::<bool>()), 1..4).prop_map(Op::Deliver),
        3 => Just(Op::ExpireLeasesAndBackoffs),
        1 => Just(Op::Redrive),
        1 => Just(Op::Cancel),
    ]
}

struct World {
    db: TestDb,
    pool: deadpool_postgres::Pool,
    n: AtomicU64,
}

async fn run_case(w: &World, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let c = w.db.client().await;
    let case = w.n.fetch_add(1, Ordering::Relaxed);
    let payload = serde_json::json!({"case": case});
    let id = enqueue(
        &c,
        &NewJob { kind: "k", payload: &payload, destination: "jobs", group_key: None, job_id: None, traceparent: None },
    )
    .await
    .unwrap();
    let queue = MemoryQueue::new(Duration::from_secs(3600));
    let mut worker_no = 0;
    for op in ops {
        match op {
            Op::Deliver(deliveries) => deliver(w, &c, &queue, &id, deliveries, &mut worker_no).await,
            Op::ExpireLeasesAndBackoffs => {
                c.execute(
                    "UPDATE jobs SET lease_expires_at = now() - interval '1 second',
                                     next_attempt_at = CASE WHEN next_attempt_at IS NULL THEN NULL ELSE now() - interval '1 second' END
                      WHERE job_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            }
            Op::Redrive => {
                redrive(&c, &id).await.unwrap();
            }
            Op::Cancel => {
                request_cancel(&c, &id).await.unwrap();
            }
        }
        no_generation_completed_twice(&c, &id).await?;
    }
    one_effect_if_succeeded(&c, &id).await
}

/// Deliveries processed at the same time, each by a worker of its own
/// (numbered on from `worker_no`); a stale one carries the previous
/// generation's message.
async fn deliver(
    w: &World,
    c: &tokio_postgres::Client,
    queue: &MemoryQueue,
    id: &str,
    deliveries: Vec<(Behaviour, bool)>,
    worker_no: &mut usize,
) {
    let generation: i32 =
        c.query_one("SELECT redrive_generation FROM jobs WHERE job_id = $1", &[&id]).await.unwrap().get(0);
    let mut tasks = Vec::new();
    for (b, stale) in deliveries {
        let g = if stale && generation > 0 { generation - 1 } else { generation };
        let body: String = c.query_one("SELECT outbox_job_message($1, 'k', $2)", &[&id, &g]).await.unwrap().get(0);
        queue.send(body);
        let m = queue.receive(1, Duration::ZERO).await.unwrap().remove(0);
        *worker_no += 1;
        let cons = Consumer::new(
            w.pool.clone(),
            ConsumerConfig {
                worker_id: format!("w{worker_no}"),
                lease: Duration::from_secs(60),
                retry_base: Duration::from_secs(60),
                retry_max: Duration::from_secs(60),
            },
        )
        .handle("k", Scripted(b));
        let queue = queue.clone();
        tasks.push(tokio::spawn(async move {
            // A crash: the claim stands, the handler's transaction goes.
            let _ = tokio::time::timeout(Duration::from_millis(300), cons.process(&queue, &m)).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// After every step: no generation completed twice.
async fn no_generation_completed_twice(c: &tokio_postgres::Client, id: &str) -> Result<(), TestCaseError> {
    let twice = c
        .query(
            "SELECT generation, count(*) FROM business_effects WHERE job_id = $1 GROUP BY generation HAVING count(*) > 1",
            &[&id],
        )
        .await
        .unwrap();
    prop_assert!(
        twice.is_empty(),
        "generation {} has {} effects",
        twice[0].get::<_, i32>(0),
        twice[0].get::<_, i64>(1)
    );
    Ok(())
}

/// At the end: a SUCCEEDED job has exactly one committed effect in its
/// generation, any other none.
async fn one_effect_if_succeeded(c: &tokio_postgres::Client, id: &str) -> Result<(), TestCaseError> {
    let r = c.query_one("SELECT status, redrive_generation FROM jobs WHERE job_id = $1", &[&id]).await.unwrap();
    let (status, generation): (String, i32) = (r.get(0), r.get(1));
    let done: i64 = c
        .query_one("SELECT count(*) FROM business_effects WHERE job_id = $1 AND generation = $2", &[&id, &generation])
        .await
        .unwrap()
        .get(0);
    if status == "SUCCEEDED" {
        prop_assert_eq!(done, 1, "a SUCCEEDED job has exactly one committed effect in its generation");
    } else {
        prop_assert_eq!(done, 0, "a job not SUCCEEDED has no committed effect in its generation");
    }
    Ok(())
}

#[test]
fn no_interleaving_completes_a_generation_twice() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let world = rt.block_on(async {
        let db = effects_db("statemachine").await;
        let pool = Consumer::pool(&db.url, 32).unwrap();
        Arc::new(World { db, pool, n: AtomicU64::new(0) })
    });
    let cfg = ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(cfg, |(ops in prop::collection::vec(op(), 1..12))| {
        let w = Arc::clone(&world);
        rt.block_on(async move { run_case(&w, ops).await })?;
    });
}
