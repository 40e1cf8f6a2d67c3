//! Settlement: published, DEAD and deferred rows are marked in PostgreSQL in
//! bulk, one statement per flush, and only then does the watermark move.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit};
use tokio_postgres::GenericClient;

use crate::event::DeadReason;
use crate::lane::LaneState;
use crate::metrics::Metrics;
use crate::watermark::{TxnSeq, Watermark};

/// How one event ended, as far as this relay is concerned.
#[derive(Debug, Clone)]
pub enum Outcome {
    Published,
    Dead(DeadReason),
    /// Not sent now: the row stays NEW with `next_attempt_at` set (time-based
    /// backoff on its attempts) and the table path sends it later. The text
    /// becomes `last_error`.
    Deferred(String),
}

/// One event's settlement, on its way to the settler.
#[derive(Debug)]
pub struct Settlement {
    pub id: i64,
    /// `None`: not tied to the stream's watermark (table path).
    pub txn: Option<TxnSeq>,
    pub destination: Arc<str>,
    pub outcome: Outcome,
    /// Returned to the pipeline's budget of unsettled events when dropped.
    pub permit: Option<OwnedSemaphorePermit>,
    /// A deferred event of a streaming lane: told once it is marked.
    pub lane: Option<Arc<LaneState>>,
}

/// The backoff of deferred rows: `base * 2^attempts`, capped, as time.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

const MARK_SQL: &str = "
UPDATE outbox o
   SET status = u.status,
       published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
       next_attempt_at = CASE WHEN u.defer
                              THEN now() + make_interval(secs => least($5::float8, $4::float8 * power(2, least(o.attempts, 40))))
                              ELSE o.next_attempt_at END,
       last_error = u.err,
       attempts = o.attempts + 1
  FROM unnest($1::bigint[], $2::text[], $3::text[], $6::bool[]) AS u(id, status, err, defer)
 WHERE o.id = u.id AND o.status = 'NEW'
RETURNING o.id";

/// How long [`mark`] waits for rows it was told about to become visible.
const VISIBILITY_DEADLINE: Duration = Duration::from_secs(10);

/// Mark a set of settlements in one statement, and make sure it took.
///
/// A row the statement did not update is either settled already (a replay, or
/// the table path got there first), or it belongs to a transaction whose
/// commit record the stream has decoded but which is not yet visible to new
/// snapshots: PostgreSQL writes the commit to WAL before it leaves the proc
/// array, and a deferred row can reach the settler inside that window. Such
/// rows are marked again, after a short wait, until they are visible.
pub async fn mark<C: GenericClient>(client: &C, batch: &[Settlement], backoff: Backoff) -> Result<u64, tokio_postgres::Error> {
    let marked = mark_once(client, batch, backoff).await?;
    let mut count = marked.len();
    if count == batch.len() {
        return Ok(count as u64);
    }
    let started = std::time::Instant::now();
    let mut wait = Duration::from_millis(1);
    let mut rest: Vec<Settlement> = batch.iter().filter(|s| !marked.contains(&s.id)).map(Settlement::shallow).collect();
    loop {
        // Rows no longer NEW were settled before (a replay, or the table
        // path got there first): nothing to do for them.
        let ids: Vec<i64> = rest.iter().map(|s| s.id).collect();
        let settled: HashSet<i64> = client
            .query("SELECT id FROM outbox WHERE id = ANY($1) AND status <> 'NEW'", &[&ids])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        rest.retain(|s| !settled.contains(&s.id));
        if rest.is_empty() {
            return Ok(count as u64);
        }
        if started.elapsed() > VISIBILITY_DEADLINE {
            let ids: Vec<i64> = rest.iter().map(|s| s.id).collect();
            tracing::warn!(?ids, "outbox rows to be marked are not in the table (deleted?); nothing left to mark");
            return Ok(count as u64);
        }
        // Not visible yet (or visible only since the UPDATE's snapshot):
        // mark them again.
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(100));
        let now = mark_once(client, &rest, backoff).await?;
        count += now.len();
        rest.retain(|s| !now.contains(&s.id));
        if rest.is_empty() {
            return Ok(count as u64);
        }
    }
}

impl Settlement {
    /// The same row and outcome, without the permit and lane (for a re-mark).
    fn shallow(&self) -> Settlement {
        Settlement {
            id: self.id,
            txn: None,
            destination: Arc::clone(&self.destination),
            outcome: self.outcome.clone(),
            permit: None,
            lane: None,
        }
    }
}

async fn mark_once<C: GenericClient>(client: &C, batch: &[Settlement], backoff: Backoff) -> Result<HashSet<i64>, tokio_postgres::Error> {
    let mut ids = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(batch.len());
    let mut defer = Vec::with_capacity(batch.len());
    for s in batch {
        ids.push(s.id);
        match &s.outcome {
            Outcome::Published => {
                statuses.push("PUBLISHED");
                errors.push(None);
                defer.push(false);
            }
            Outcome::Dead(r) => {
                statuses.push("DEAD");
                errors.push(Some(r.last_error()));
                defer.push(false);
            }
            Outcome::Deferred(e) => {
                statuses.push("NEW");
                errors.push(Some(e.clone()));
                defer.push(true);
            }
        }
    }
    let base = backoff.base.as_secs_f64();
    let max = backoff.max.as_secs_f64();
    Ok(client
        .query(MARK_SQL, &[&ids, &statuses, &errors, &base, &max, &defer])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Count a flushed batch in the metrics, and log each DEAD row once.
pub fn record(metrics: &Metrics, batch: &[Settlement]) {
    for s in batch {
        match &s.outcome {
            Outcome::Published => metrics.events_published.with_label_values(&[&s.destination]).inc(),
            Outcome::Dead(r) => {
                tracing::warn!(id = s.id, destination = %s.destination, reason = r.code, detail = %r.detail, "outbox row marked DEAD");
                metrics.events_dead.with_label_values(&[&s.destination, r.code]).inc();
            }
            Outcome::Deferred(e) => {
                tracing::debug!(id = s.id, destination = %s.destination, error = %e, "outbox row deferred to the table");
                metrics.events_deferred.with_label_values(&[&s.destination]).inc();
            }
        }
    }
}

/// Receive settlements, mark them, then settle them in the watermark and wake
/// the confirmer. Returns when the channel closes, or with the database error
/// that stopped it (nothing unmarked is settled, so nothing is lost).
pub async fn run_settler(
    client: tokio_postgres::Client,
    mut rx: mpsc::UnboundedReceiver<Settlement>,
    watermark: Arc<Mutex<Watermark>>,
    confirm: Arc<Notify>,
    metrics: Arc<Metrics>,
    backoff: Backoff,
) -> Result<(), tokio_postgres::Error> {
    let mut batch = Vec::with_capacity(MAX_FLUSH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_FLUSH {
            match rx.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        mark(&client, &batch, backoff).await?;
        {
            let mut wm = watermark.lock().unwrap();
            for s in &batch {
                if let Some(t) = s.txn {
                    wm.settle(t);
                }
            }
        }
        record(&metrics, &batch);
        for s in batch.drain(..) {
            metrics.in_flight_events.with_label_values(&[&s.destination]).dec();
            if let Some(l) = &s.lane {
                l.deferred_marked();
            }
        }
        confirm.notify_one();
    }
    Ok(())
}
