//! Settlement: published, DEAD and deferred rows are recorded in PostgreSQL
//! in bulk, one statement per flush, and only then does the watermark move.
//!
//! A published row is deleted (with its id recorded in a run of consecutive
//! ids, for the replay filter) or, with `published_rows = "keep"`, marked
//! PUBLISHED. DEAD and deferred rows are updated in place. A transient row
//! (deleted by its own transaction) needs nothing when published; DEAD or
//! deferred, it is written back to the table so its reason, or its retry,
//! is kept.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio_postgres::GenericClient;

use crate::config::PublishedRows;
use crate::event::{DeadReason, OutboxEvent};
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
    /// A transient row (its transaction deleted it): the row itself, written
    /// back to the table if it ends DEAD or deferred.
    pub row: Option<Arc<OutboxEvent>>,
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

/// How rows are recorded: the backoff of deferred rows (`base * 2^attempts`,
/// capped, as time) and what becomes of published ones.
#[derive(Debug, Clone, Copy)]
pub struct Marking {
    pub base: Duration,
    pub max: Duration,
    pub published: PublishedRows,
}

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

/// The set part of marking a DEAD or deferred row (and, kept, a PUBLISHED one).
fn update_set() -> String {
    format!(
        "SET status = u.status,
             published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
             next_attempt_at = CASE WHEN u.defer THEN now() + make_interval(secs => {}) ELSE o.next_attempt_at END,
             last_error = u.err,
             attempts = o.attempts + 1",
        crate::policy::retry::backoff_sql("o.attempts", "$4", "$5")
    )
}

const MARK_INPUT: &str = "unnest($1::bigint[], $2::text[], $3::text[], $6::bool[]) AS u(id, status, err, defer)";

/// `published_rows = "keep"`: one UPDATE marks a flush PUBLISHED, DEAD, or
/// deferred (NEW with `next_attempt_at` from the retry policy's backoff).
static KEEP_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("UPDATE outbox o {} FROM {MARK_INPUT} WHERE o.id = u.id AND o.status = 'NEW' RETURNING o.id", update_set())
});

/// `published_rows = "delete"`: one statement deletes the published rows,
/// records their ids as runs of consecutive ids (for the replay filter), and
/// updates the DEAD and deferred ones.
static DELETE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH u AS (SELECT * FROM {MARK_INPUT}),
         upd AS (UPDATE outbox o {} FROM u
                  WHERE o.id = u.id AND o.status = 'NEW' AND u.status <> 'PUBLISHED' RETURNING o.id),
         del AS (DELETE FROM outbox o USING u
                  WHERE o.id = u.id AND o.status = 'NEW' AND u.status = 'PUBLISHED' RETURNING o.id),
         runs AS (INSERT INTO outbox_published_runs (lo, hi)
                  SELECT min(id), max(id) FROM (SELECT id, id - row_number() OVER (ORDER BY id) AS g FROM del) r
                   GROUP BY g RETURNING lo)
         SELECT id FROM upd UNION ALL SELECT id FROM del",
        update_set()
    )
});

/// A transient row that ended DEAD or deferred, written back under its own
/// id (so a FIFO group keeps its order in the table). Its insert reaches the
/// stream with a status or `next_attempt_at` set, which the decoder skips.
static RESTORE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "INSERT INTO outbox (id, event_id, destination, body, group_key, attributes, created_at,
                             status, attempts, next_attempt_at, last_error)
         OVERRIDING SYSTEM VALUE
         SELECT u.id, u.event_id, u.destination, u.body, u.group_key, u.attributes::jsonb,
                to_timestamp(u.created_us / 1e6), u.status, 1,
                CASE WHEN u.defer THEN now() + make_interval(secs => {}) END, u.err
           FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::float8[],
                       $8::text[], $9::bool[], $10::text[])
                AS u(id, event_id, destination, body, group_key, attributes, created_us, status, defer, err)
         ON CONFLICT DO NOTHING",
        crate::policy::retry::backoff_sql("0", "$11", "$12")
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
    /// Rows updated or deleted.
    pub marked: u64,
    /// Rows found settled already or deleted: nothing to record.
    pub gone: u64,
    /// Times it waited for a transaction to become visible.
    pub waits: u32,
    /// Transient rows published: nothing written.
    pub transient: u64,
    /// Transient rows written back to the table, DEAD or deferred.
    pub restored: u64,
}

/// Record a set of settlements, in one statement for the rows in the table
/// (and one for transient rows to write back), and make sure it took.
pub async fn mark<C: GenericClient>(
    client: &C,
    batch: &[Settlement],
    marking: Marking,
) -> Result<MarkReport, tokio_postgres::Error> {
    let (transient, rows): (Vec<&Settlement>, Vec<&Settlement>) = batch.iter().partition(|s| s.row.is_some());
    let restore: Vec<&Settlement> =
        transient.iter().copied().filter(|s| !matches!(s.outcome, Outcome::Published)).collect();
    let mut report = MarkReport { transient: (transient.len() - restore.len()) as u64, ..Default::default() };
    if !restore.is_empty() {
        report.restored = restore_rows(client, &restore, marking).await?;
    }
    if !rows.is_empty() {
        mark_rows(client, &rows, marking, &mut report).await?;
    }
    Ok(report)
}

/// Mark rows of the table. A row the statement did not touch was settled
/// already, was deleted, or belongs to a transaction whose commit the stream
/// decoded before it became visible to new snapshots. One query
/// ([`MISSING_SQL`]) tells them apart: only the last is waited for, so a
/// deleted row costs that one query.
async fn mark_rows<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
    report: &mut MarkReport,
) -> Result<(), tokio_postgres::Error> {
    let marked = mark_once(client, batch, marking).await?;
    report.marked += marked.len() as u64;
    let mut rest: Vec<&Settlement> = batch.iter().copied().filter(|s| !marked.contains(&s.id)).collect();
    let started = std::time::Instant::now();
    while !rest.is_empty() {
        let (pending, invisible) = missing(client, &rest).await?;
        report.gone += rest.iter().filter(|s| !pending.contains(&s.id) && !invisible.contains(&s.id)).count() as u64;
        rest.retain(|s| pending.contains(&s.id) || invisible.contains(&s.id));
        if !pending.is_empty() {
            let todo: Vec<&Settlement> = rest.iter().copied().filter(|s| pending.contains(&s.id)).collect();
            let now = mark_once(client, &todo, marking).await?;
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
        let wait = crate::policy::retry::backoff(report.waits, Duration::from_millis(1), Duration::from_millis(100));
        tokio::time::sleep(wait).await;
        report.waits += 1;
    }
    if report.gone > 0 {
        tracing::debug!(rows = report.gone, "outbox rows settled before or deleted: nothing to mark");
    }
    Ok(())
}

/// Of rows not marked: the ids still NEW (mark again), and the ids whose
/// transaction is not visible yet (wait).
async fn missing<C: GenericClient>(
    client: &C,
    rest: &[&Settlement],
) -> Result<(HashSet<i64>, HashSet<i64>), tokio_postgres::Error> {
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
    Ok((pending, invisible))
}

/// A settlement's status, `last_error` and whether it is deferred, as the
/// marking statements take them.
fn columns(outcome: &Outcome) -> (&'static str, Option<String>, bool) {
    match outcome {
        Outcome::Published => ("PUBLISHED", None, false),
        Outcome::Dead(r) => ("DEAD", Some(r.last_error()), false),
        Outcome::Deferred(e) => ("NEW", Some(e.clone()), true),
    }
}

async fn mark_once<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<HashSet<i64>, tokio_postgres::Error> {
    let mut ids = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(batch.len());
    let mut defer = Vec::with_capacity(batch.len());
    for s in batch {
        let (status, err, d) = columns(&s.outcome);
        ids.push(s.id);
        statuses.push(status);
        errors.push(err);
        defer.push(d);
    }
    let base = marking.base.as_secs_f64();
    let max = marking.max.as_secs_f64();
    let sql = match marking.published {
        PublishedRows::Delete => DELETE_SQL.as_str(),
        PublishedRows::Keep => KEEP_SQL.as_str(),
    };
    // Planned at every flush, never as a prepared statement: a generic plan
    // made while the table was small scans it whole once it has grown.
    Ok(client.query(sql, &[&ids, &statuses, &errors, &base, &max, &defer]).await?.iter().map(|r| r.get(0)).collect())
}

/// Write transient rows that ended DEAD or deferred back to the table.
/// Returns the rows written (a replay finds its earlier copy and skips it).
async fn restore_rows<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<u64, tokio_postgres::Error> {
    let n = batch.len();
    let (mut ids, mut event_ids, mut dests, mut bodies) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut groups, mut attrs, mut created, mut statuses) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut defer, mut errors) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for s in batch {
        let ev = s.row.as_ref().expect("a transient settlement carries its row");
        let (status, err, d) = columns(&s.outcome);
        ids.push(ev.id);
        event_ids.push(ev.event_id.as_str());
        dests.push(ev.destination.as_str());
        bodies.push(ev.body.as_str());
        groups.push(ev.group_key.as_deref());
        attrs.push(ev.attributes.as_deref());
        created.push(ev.commit_time_us as f64);
        statuses.push(status);
        defer.push(d);
        errors.push(err);
    }
    let (base, max) = (marking.base.as_secs_f64(), marking.max.as_secs_f64());
    client
        .execute(
            RESTORE_SQL.as_str(),
            &[&ids, &event_ids, &dests, &bodies, &groups, &attrs, &created, &statuses, &defer, &errors, &base, &max],
        )
        .await
}

/// Count a flushed batch in the metrics, and log each DEAD row once.
pub fn record(metrics: &Metrics, batch: &[Settlement]) {
    for s in batch {
        match &s.outcome {
            Outcome::Published => {
                metrics.events_published.with_label_values(&[&s.destination]).inc();
                if s.row.is_some() {
                    metrics.events_transient.with_label_values(&[&s.destination]).inc();
                }
            }
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
    marking: Marking,
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
        mark(&client, &batch, marking).await?;
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
