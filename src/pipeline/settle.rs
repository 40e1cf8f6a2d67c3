//! Settlement: published, DEAD and deferred rows are marked in PostgreSQL in
//! bulk, one statement per flush, and only then does the watermark move.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio_postgres::GenericClient;

use crate::event::DeadReason;
use crate::metrics::Metrics;
use crate::pipeline::watermark::{TxnSeq, Watermark};

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
    /// The inserting transaction, for a row read from the stream.
    pub xid: Option<u32>,
    /// `None`: not tied to the stream's watermark (table path).
    pub txn: Option<TxnSeq>,
    pub destination: Arc<str>,
    pub outcome: Outcome,
    /// Returned to the pipeline's budget of unsettled events when dropped.
    pub permit: Option<crate::pipeline::budget::Permit>,
    /// A deferred event of a streaming lane: its lane's count of deferred
    /// rows not yet marked, decremented once it is.
    pub unmarked: Option<Arc<Unmarked>>,
}

/// Deferred rows of one lane handed to the settler and not marked yet: the
/// spool drain does not return the lane to streaming while any are on their
/// way (their rows are not in the table yet).
#[derive(Debug, Default)]
pub struct Unmarked(std::sync::atomic::AtomicUsize);

impl Unmarked {
    pub fn add(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn marked(&self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn reset(&self) {
        self.0.store(0, std::sync::atomic::Ordering::Release);
    }
}

/// The backoff of deferred rows: `base * 2^attempts`, capped, as time.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

/// One statement marks a flush: PUBLISHED, DEAD, or deferred (NEW with
/// `next_attempt_at` from the retry policy's backoff on the row's attempts).
static MARK_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "UPDATE outbox o
            SET status = u.status,
                published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
                next_attempt_at = CASE WHEN u.defer
                                       THEN now() + make_interval(secs => {})
                                       ELSE o.next_attempt_at END,
                last_error = u.err,
                attempts = o.attempts + 1
           FROM unnest($1::bigint[], $2::text[], $3::text[], $6::bool[]) AS u(id, status, err, defer)
          WHERE o.id = u.id AND o.status = 'NEW'
         RETURNING o.id",
        crate::policy::retry::backoff_sql("o.attempts", "$4", "$5")
    )
});

/// How long [`mark`] waits, at most, for a row whose transaction is not
/// visible yet (a safety net: that window lasts microseconds).
const VISIBILITY_DEADLINE: Duration = Duration::from_secs(10);

/// Of the rows a mark did not update, in one statement: whether the row is
/// there and NEW (mark it again now), and whether its inserting transaction
/// is visible to this statement's snapshot. Visible and not NEW (or gone):
/// it was settled before (a replay, the table path), or deleted (by its own
/// transaction or a later one) — nothing to wait for. Not visible: the
/// commit was decoded before it left the server's proc array; wait.
///
/// The stream gives 32-bit xids; they are widened against the snapshot's
/// xmax (a committed transaction is less than 2^31 behind it).
const MISSING_SQL: &str = "
SELECT u.id,
       EXISTS (SELECT 1 FROM outbox o WHERE o.id = u.id AND o.status = 'NEW') AS pending,
       u.xid IS NULL OR (d.delta > 0 AND d.delta < 2147483648
                         AND pg_visible_in_snapshot((s.xmax - d.delta)::text::xid8, s.snap)) AS visible
  FROM unnest($1::bigint[], $2::bigint[]) AS u(id, xid)
 CROSS JOIN (SELECT pg_current_snapshot() AS snap,
                    pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax) s
 CROSS JOIN LATERAL (SELECT ((s.xmax % 4294967296) - u.xid + 4294967296) % 4294967296 AS delta) d";

/// What one [`mark`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MarkReport {
    /// Rows updated.
    pub marked: u64,
    /// Rows found settled already or deleted: nothing to record.
    pub gone: u64,
    /// Times it waited for a transaction to become visible.
    pub waits: u32,
}

/// Mark a set of settlements in one statement, and make sure it took.
///
/// A row the statement did not update was settled already, was deleted, or
/// belongs to a transaction whose commit the stream decoded before it became
/// visible to new snapshots. One query ([`MISSING_SQL`]) tells them apart:
/// only the last is waited for, so a deleted row costs that one query.
pub async fn mark<C: GenericClient>(
    client: &C,
    batch: &[Settlement],
    backoff: Backoff,
) -> Result<MarkReport, tokio_postgres::Error> {
    let marked = mark_once(client, batch, backoff).await?;
    let mut report = MarkReport { marked: marked.len() as u64, ..Default::default() };
    let mut rest: Vec<Settlement> = batch.iter().filter(|s| !marked.contains(&s.id)).map(Settlement::shallow).collect();
    let started = std::time::Instant::now();
    while !rest.is_empty() {
        let ids: Vec<i64> = rest.iter().map(|s| s.id).collect();
        let xids: Vec<Option<i64>> = rest.iter().map(|s| s.xid.map(i64::from)).collect();
        let mut pending = HashSet::new();
        let mut invisible = HashSet::new();
        for r in client.query(MISSING_SQL, &[&ids, &xids]).await? {
            let (id, is_new, visible): (i64, bool, bool) = (r.get(0), r.get(1), r.get(2));
            if is_new {
                pending.insert(id);
            } else if !visible {
                invisible.insert(id);
            }
        }
        report.gone += rest.iter().filter(|s| !pending.contains(&s.id) && !invisible.contains(&s.id)).count() as u64;
        rest.retain(|s| pending.contains(&s.id) || invisible.contains(&s.id));
        if !pending.is_empty() {
            let todo: Vec<Settlement> =
                rest.iter().filter(|s| pending.contains(&s.id)).map(Settlement::shallow).collect();
            let now = mark_once(client, &todo, backoff).await?;
            report.marked += now.len() as u64;
            rest.retain(|s| !now.contains(&s.id));
        }
        if rest.is_empty() {
            break;
        }
        if started.elapsed() > VISIBILITY_DEADLINE {
            let ids: Vec<i64> = rest.iter().map(|s| s.id).collect();
            tracing::warn!(?ids, "outbox rows to be marked did not become visible; nothing left to mark");
            break;
        }
        tokio::time::sleep(crate::policy::retry::backoff(
            report.waits,
            Duration::from_millis(1),
            Duration::from_millis(100),
        ))
        .await;
        report.waits += 1;
    }
    if report.gone > 0 {
        tracing::debug!(rows = report.gone, "outbox rows settled before or deleted: nothing to mark");
    }
    Ok(report)
}

impl Settlement {
    /// The same row and outcome, without the permit and lane (for a re-mark).
    fn shallow(&self) -> Settlement {
        Settlement {
            id: self.id,
            xid: self.xid,
            txn: None,
            destination: Arc::clone(&self.destination),
            outcome: self.outcome.clone(),
            permit: None,
            unmarked: None,
        }
    }
}

async fn mark_once<C: GenericClient>(
    client: &C,
    batch: &[Settlement],
    backoff: Backoff,
) -> Result<HashSet<i64>, tokio_postgres::Error> {
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
        .query(MARK_SQL.as_str(), &[&ids, &statuses, &errors, &base, &max, &defer])
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
                tracing::warn!(id = s.id, destination = %s.destination, reason = r.code.as_str(), detail = %r.detail, "outbox row marked DEAD");
                metrics.events_dead.with_label_values(&[&s.destination, r.code.as_str()]).inc();
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
            if let Some(u) = &s.unmarked {
                u.marked();
            }
        }
        confirm.notify_one();
    }
    Ok(())
}
