//! Settlement: published, DEAD and deferred rows are recorded in PostgreSQL
//! in bulk, one statement per flush, and only then does the watermark move.
//!
//! A published row is deleted (with its id recorded in a run of consecutive
//! ids, for the replay filter) or, with `published_rows = "keep"`, marked
//! PUBLISHED. DEAD and deferred rows are updated in place. A transient row
//! (deleted by its own transaction) needs nothing when published; DEAD or
//! deferred, it is written back to the table so its reason, or its retry,
//! is kept. So is any row found gone that nothing proves published: a row
//! deleted by its own transaction after its chunk was handed on, or on a
//! shard whose publication carries no deletes, looks persistent until then.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio_postgres::GenericClient;
use tracing::Instrument;

use crate::config::PublishedRows;
use crate::db::schema::RowStatus;
use crate::event::{MappedRow, OutboxEvent, PublishedColumn, TableNow};
use crate::metrics::Metrics;
use crate::pipeline::owed::{Owed, RETRY_EVERY};
use crate::pipeline::watermark::{TxnSeq, Watermark};
use crate::policy::dead::DeadReason;

/// How one event ended, as far as this relay is concerned.
#[derive(Debug, Clone)]
pub enum Outcome {
    Published,
    Dead(DeadReason),
    /// Not sent now: the row stays NEW with `next_attempt_at` set and the
    /// table path sends it. The text becomes `last_error`.
    Deferred(String, Due),
}

/// When a deferred row is due in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Its send failed: after the retry policy's backoff on its attempts.
    Backoff,
    /// It was never tried (its lane spools because it is behind, or it
    /// follows an earlier entry of its group): at once.
    Now,
    /// Its `deliver_at` is later than SQS can delay it: at once as far as
    /// `next_attempt_at` goes, and the table path claims it when its
    /// `deliver_at` allows ([`crate::policy::delay`]).
    Held,
}

impl Due {
    /// The code the marking statements take (`u.defer`): 0 not deferred.
    fn code(self) -> i16 {
        match self {
            Due::Backoff => 1,
            Due::Now | Due::Held => 2,
        }
    }
}

/// One event's settlement, on its way to the settler.
#[derive(Debug)]
pub struct Settlement {
    /// The row as it was read (stream or table): its id and event id say
    /// which row to mark; if that row is gone from the table and the event
    /// was not published, it is written back from here.
    pub event: Arc<OutboxEvent>,
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

impl Settlement {
    /// A settlement with no budget permit and no lane count attached.
    pub fn new(event: Arc<OutboxEvent>, txn: Option<TxnSeq>, destination: Arc<str>, outcome: Outcome) -> Self {
        Settlement { event, txn, destination, outcome, permit: None, unmarked: None }
    }

    /// The same, holding its event's budget permit and (a deferred event
    /// of a streaming lane) its lane's count of unmarked rows.
    pub fn holding(self, permit: Option<crate::pipeline::budget::Permit>, unmarked: Option<Arc<Unmarked>>) -> Self {
        Settlement { permit, unmarked, ..self }
    }

    pub fn id(&self) -> i64 {
        self.event.id
    }

    /// What tells settlements of one flush apart: the event id (unique),
    /// not the row id (a reused id can stand for two rows in one flush).
    pub fn key(&self) -> &str {
        &self.event.event_id
    }
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
    /// CDC mode: a row written back without a commit position (a mapped
    /// table's claim) gets the WAL's insert position, so rows of its group
    /// the stream hands over later, which committed later, follow it. In
    /// polling mode it stays without one, and follows every row that has
    /// one (as rows the poller has not claimed yet do).
    pub bound_unpositioned: bool,
}

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

/// How long the settler gathers settlements after the first before it
/// marks them: at a low rate over many lanes (one message per call, calls
/// a fraction of a millisecond apart) a statement per call cost
/// PostgreSQL more than the relay's whole sending (`bench --many-only`,
/// 2026-12-06: the machine 6–13 points less busy at 1,000 × 2 rows/s).
/// Delivery does not wait on it; the slot's confirmation and the budget's
/// release wait this much more.
const GATHER: Duration = Duration::from_millis(2);

/// The set part of marking a DEAD or deferred row (and, kept, a PUBLISHED one).
/// A row from the stream left NEW or DEAD keeps its transaction's commit
/// position and its place in it: a FIFO claim orders by them
/// ([`crate::source::table`]); a PUBLISHED one needs neither.
fn update_set() -> String {
    format!(
        "SET status = u.status,
             published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
             next_attempt_at = CASE u.defer WHEN 1 THEN now() + make_interval(secs => {})
                                            WHEN 2 THEN now() ELSE o.next_attempt_at END,
             last_error = u.err,
             attempts = o.attempts + CASE WHEN u.defer = 2 THEN 0 ELSE 1 END,
             commit_lsn = CASE WHEN u.commit IS NULL OR u.status = 'PUBLISHED' THEN o.commit_lsn
                               ELSE u.commit::pg_lsn END,
             commit_seq = CASE WHEN u.commit IS NULL OR u.status = 'PUBLISHED' THEN o.commit_seq ELSE u.seq END",
        crate::policy::retry::backoff_sql("o.attempts", "$4", "$5")
    )
}

const MARK_INPUT: &str = "unnest($1::bigint[], $7::text[], $2::text[], $3::text[], $6::int2[], $8::text[], $9::int4[])
                          AS u(id, event_id, status, err, defer, commit, seq)";

/// A row is the settlement's row when both its id and its event id match:
/// ids can be reused (an identity reset, a restore), event ids are unique.
const SAME_ROW: &str = "o.id = u.id AND o.event_id = u.event_id AND o.status = 'NEW'";

/// `published_rows = "keep"`: one UPDATE marks a flush PUBLISHED, DEAD, or
/// deferred (NEW with `next_attempt_at` from the retry policy's backoff).
static KEEP_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("UPDATE outbox o {} FROM {MARK_INPUT} WHERE {SAME_ROW} RETURNING o.event_id", update_set())
});

/// `published_rows = "delete"`: one statement deletes the published rows,
/// records their ids as runs of consecutive ids with the range of their
/// commit positions (for the replay filter: [`PROVEN_BY_RUN`]), and updates
/// the DEAD and deferred ones.
static DELETE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH u AS (SELECT * FROM {MARK_INPUT}),
         upd AS (UPDATE outbox o {} FROM u
                  WHERE {SAME_ROW} AND u.status <> 'PUBLISHED' RETURNING o.event_id),
         del AS (DELETE FROM outbox o USING u
                  WHERE {SAME_ROW} AND u.status = 'PUBLISHED' RETURNING o.id, o.event_id, u.commit::pg_lsn AS commit),
         runs AS (INSERT INTO outbox_published_runs (lo, hi, commit_lo, commit_hi, event_ids)
                  SELECT min(id), max(id),
                         CASE WHEN bool_and(commit IS NOT NULL) THEN min(commit) END,
                         CASE WHEN bool_and(commit IS NOT NULL) THEN max(commit) END,
                         CASE WHEN NOT bool_and(commit IS NOT NULL) THEN array_agg(event_id ORDER BY id) END
                    FROM (SELECT id, commit, event_id, id - row_number() OVER (ORDER BY id) AS g FROM del) r
                   GROUP BY g RETURNING lo)
         SELECT event_id FROM upd UNION ALL SELECT event_id FROM del",
        update_set()
    )
});

/// Write rows back to the table, DEAD or deferred: `own_id` under their own
/// id (so a FIFO group keeps its order in the table), otherwise under a new
/// one, for rows whose id another row has taken since (ids reused) and whose
/// event is not in the table. The insert reaches the stream with a status or
/// `next_attempt_at` set, which the decoder skips. A row keeps its commit
/// position and its place in its transaction; one the stream did not bring
/// (a mapped table's claim) gets, in CDC mode (`$15`), the WAL's insert
/// position, past its commit and before any transaction committing later
/// ([`Marking::bound_unpositioned`]).
/// Returns the event ids written.
fn restore_sql(own_id: bool) -> String {
    let (id_col, id_val, overriding, unless) = if own_id {
        ("id, ", "u.id, ", "OVERRIDING SYSTEM VALUE", "")
    } else {
        ("", "", "", "WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = u.event_id)")
    };
    format!(
        "INSERT INTO outbox ({id_col}event_id, destination, body, group_key, attributes, created_at,
                             status, attempts, next_attempt_at, last_error, deliver_at, commit_lsn, commit_seq)
         {overriding}
         SELECT {id_val}u.event_id, u.destination, u.body, u.group_key, u.attributes::jsonb,
                to_timestamp(u.created_us / 1e6), u.status, CASE WHEN u.defer = 2 THEN 0 ELSE 1 END,
                CASE u.defer WHEN 1 THEN now() + make_interval(secs => {}) WHEN 2 THEN now() END, u.err,
                CASE WHEN u.deliver_us = {never} THEN 'infinity'::timestamptz
                     WHEN u.deliver_us = -{never} THEN '-infinity'::timestamptz
                     ELSE to_timestamp(u.deliver_us / 1e6) END,
                CASE WHEN u.commit IS NOT NULL THEN u.commit::pg_lsn WHEN $15 THEN pg_current_wal_insert_lsn() END,
                u.seq
           FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::float8[],
                       $8::text[], $9::int2[], $10::text[], $13::bigint[], $14::text[], $16::int4[])
                AS u(id, event_id, destination, body, group_key, attributes, created_us, status, defer, err, deliver_us,
                     commit, seq)
         {unless}
         ON CONFLICT DO NOTHING
         RETURNING event_id",
        crate::policy::retry::backoff_sql("0", "$11", "$12"),
        never = crate::event::DeliverAt::NEVER,
    )
}

static RESTORE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| restore_sql(true));
static RESTORE_NEW_ID_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| restore_sql(false));

/// How long [`mark`] waits, at most, for a row whose transaction is not
/// visible yet (a safety net: that window lasts microseconds).
const VISIBILITY_DEADLINE: Duration = Duration::from_secs(10);

/// Of the rows a mark did not update, in one statement: whether the row is
/// there (same id and event id) and whether it is still NEW (mark it again
/// now), and whether its inserting transaction is visible to this
/// statement's snapshot. Visible and there but not NEW: settled before (a
/// replay, the table path). Visible and absent: deleted (by its own
/// transaction or a later one, or published and deleted before). Not
/// visible: the commit was decoded before it left the server's proc array;
/// wait.
///
/// The stream gives 32-bit xids; they are widened against the snapshot's
/// xmax (a committed transaction is less than 2^31 behind it).
static MISSING_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT u.event_id, o.status = 'NEW', o.id IS NOT NULL, {XID_VISIBLE} AS visible
           FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS u(id, xid, event_id)
           LEFT JOIN outbox o ON o.id = u.id AND o.event_id = u.event_id
          {XID_SNAPSHOT}"
    )
});

/// Joined to rows `u` with a 32-bit `xid` (from the stream): the
/// statement's snapshot, and each xid's distance below its xmax.
const XID_SNAPSHOT: &str = "CROSS JOIN (SELECT pg_current_snapshot() AS snap,
                    pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax) s
 CROSS JOIN LATERAL (SELECT ((s.xmax % 4294967296) - u.xid + 4294967296) % 4294967296 AS delta) d";

/// Over [`XID_SNAPSHOT`]: `u.xid`'s transaction is visible to the snapshot
/// (true for no xid).
const XID_VISIBLE: &str = "(u.xid IS NULL OR (d.delta > 0 AND d.delta < 2147483648
                         AND pg_visible_in_snapshot((s.xmax - d.delta)::text::xid8, s.snap)))";

/// When a run of published ids (`r`) proves that the row with id `$id` and
/// event id `$event_id`, committed at `$commit`, was published: the run was
/// written after that commit, covers the id, and either its rows' commit
/// positions (stream rows) span the row's commit or it lists the event id
/// (rows the table path published: their commit is unknown). Covering the id
/// is not enough: the id may have been given to another row since (an
/// identity reset, or a row deleted and its id reused) and that row
/// published.
pub const PROVEN_BY_RUN: &str = "int8range(r.lo, r.hi, '[]') @> $id AND r.lsn > $commit
     AND ((r.commit_lo <= $commit AND r.commit_hi >= $commit) OR $event_id = ANY(r.event_ids))";

/// Of the given (id, commit position, event id), the event ids a run proves published
/// ([`PROVEN_BY_RUN`]). A row read from the table has no commit position and
/// nothing proves it.
static PUBLISHED_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT u.event_id FROM unnest($1::bigint[], $2::text[], $3::text[]) AS u(id, lsn, event_id)
          WHERE EXISTS (SELECT 1 FROM outbox_published_runs r WHERE {})",
        PROVEN_BY_RUN.replace("$id", "u.id").replace("$commit", "u.lsn::pg_lsn").replace("$event_id", "u.event_id")
    )
});

/// What one [`mark`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MarkReport {
    /// Rows updated or deleted.
    pub marked: u64,
    /// Rows found settled already (in the table, or proven published):
    /// nothing to record.
    pub gone: u64,
    /// Times it waited for a transaction to become visible.
    pub waits: u32,
    /// Transient rows published: nothing written.
    pub transient: u64,
    /// Rows written back to the table, DEAD or deferred: transient ones, and
    /// any other whose row was gone and not proven published.
    pub restored: u64,
    /// Mapped rows whose published column was set.
    pub published_marked: u64,
}

/// Where a row the marking statement did not touch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Missing {
    /// There and NEW: mark it again.
    Pending,
    /// There, no longer NEW: settled before.
    Settled,
    /// Not in the table, its transaction visible: deleted.
    Absent,
    /// Its transaction is not visible yet: wait.
    Invisible,
}

/// Record a set of settlements, in one statement for the rows in the table
/// (and one for rows to write back), and make sure it took. An event whose
/// row is gone is settled only by its successful send, by proof that it was
/// published before, or by writing its row back: never by "the row is gone".
///
/// Mapped rows whose published column cannot be set now go to `owed`.
pub async fn mark<C: GenericClient>(
    client: &C,
    batch: &[Settlement],
    marking: Marking,
    owed: &mut Owed,
) -> Result<MarkReport, tokio_postgres::Error> {
    let (transient, rows): (Vec<&Settlement>, Vec<&Settlement>) = batch.iter().partition(|s| s.event.transient);
    let unpublished = |s: &&Settlement| !matches!(s.outcome, Outcome::Published);
    let mut restore: Vec<&Settlement> = transient.iter().copied().filter(unpublished).collect();
    let mut report = MarkReport { transient: (transient.len() - restore.len()) as u64, ..Default::default() };
    if !rows.is_empty() {
        let absent = mark_rows(client, &rows, marking, &mut report).await?;
        // Published and gone: the send settled it.
        report.gone += absent.iter().filter(|s| !unpublished(s)).count() as u64;
        let absent: Vec<&Settlement> = absent.into_iter().filter(unpublished).collect();
        if !absent.is_empty() {
            let proven = published_before(client, &absent).await?;
            report.gone += proven.len() as u64;
            restore.extend(absent.into_iter().filter(|s| !proven.contains(s.key())));
        }
    }
    if !restore.is_empty() {
        report.restored = restore_rows(client, &restore, marking).await?;
        tracing::debug!(rows = restore.len(), written = report.restored, "rows gone from the table written back");
    }
    report.published_marked = mark_mapped_published(client, &transient, owed).await?;
    Ok(report)
}

/// Set the published column of mapped rows settled here (sent, or written
/// to the relay's table just now, in the same transaction): one statement
/// per table. Rows set already, or deleted by their producers, are left. A
/// row whose transaction the stream decoded before it became visible to new
/// snapshots is waited for and marked then, as [`mark_rows`] does for the
/// relay's own. A table the statement cannot run on now (a grant taken,
/// moved out of reach) has its rows' keys kept in `owed`.
async fn mark_mapped_published<C: GenericClient>(
    client: &C,
    settled: &[&Settlement],
    owed: &mut Owed,
) -> Result<u64, tokio_postgres::Error> {
    let mut by_table: std::collections::HashMap<&Arc<PublishedColumn>, Vec<(&str, Option<i64>)>> =
        std::collections::HashMap::new();
    for s in settled {
        if let Some(MappedRow { key, published: Some(p), .. }) = &s.event.mapped {
            by_table.entry(p).or_default().push((key, s.event.xid.map(i64::from)));
        }
    }
    let mut n = 0;
    for (table, mut rows) in by_table {
        // By its oid: renamed or moved since start-up, it is marked under
        // its name of the day; dropped, its rows have nothing to mark.
        let name = match table.table_now(client).await? {
            TableNow::Ready(name) => name,
            TableNow::Gone => {
                tracing::warn!(table = %table.table, rows = rows.len(), "mapped table dropped: its rows were settled, no published column is left to set");
                continue;
            }
            // Sent (or in the relay's table) all the same: marked once the
            // statement can run.
            TableNow::Refused(why) => {
                tracing::error!(table = %table.table, rows = rows.len(), "mapped rows settled but their published column not set now (set once it can be): {why}");
                owed.owe(table, rows.iter().map(|(k, _)| k.to_string()));
                continue;
            }
        };
        let mark_sql = table.mark_sql(&name);
        let started = std::time::Instant::now();
        let mut waits = 0;
        loop {
            let keys: Vec<&str> = rows.iter().map(|(k, _)| *k).collect();
            let marked: HashSet<String> = client.query(&mark_sql, &[&keys]).await?.iter().map(|r| r.get(0)).collect();
            n += marked.len() as u64;
            rows.retain(|(k, _)| !marked.contains(*k));
            let invisible = not_visible_yet(client, table, &name, &rows).await?;
            let done: Vec<&str> = rows.iter().map(|(k, _)| *k).filter(|k| !invisible.contains(*k)).collect();
            if !done.is_empty() {
                tracing::debug!(table = %table.table, keys = ?done, "mapped rows published already or gone: not marked");
            }
            rows.retain(|(k, _)| invisible.contains(*k));
            if rows.is_empty() {
                break;
            }
            if started.elapsed() > VISIBILITY_DEADLINE {
                let keys: Vec<&str> = rows.iter().map(|(k, _)| *k).take(5).collect();
                tracing::warn!(table = %table.table, ?keys, "mapped rows to mark published did not become visible; their published column stays NULL (they may be sent again)");
                break;
            }
            tokio::time::sleep(crate::policy::retry::backoff(
                waits,
                Duration::from_millis(1),
                Duration::from_millis(100),
            ))
            .await;
            waits += 1;
        }
    }
    Ok(n)
}

/// Of (key, inserting xid) pairs not marked, those to try again, in one
/// snapshot: the row is there with the column NULL (it became visible after
/// the marking statement's snapshot), or its transaction is not visible yet.
/// A row with the column set, or gone, is done.
async fn not_visible_yet<C: GenericClient>(
    client: &C,
    table: &PublishedColumn,
    name: &str,
    rows: &[(&str, Option<i64>)],
) -> Result<HashSet<String>, tokio_postgres::Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let (keys, xids): (Vec<&str>, Vec<Option<i64>>) = rows.iter().copied().unzip();
    let sql = format!(
        "SELECT u.key FROM unnest($1::text[], $2::bigint[]) AS u(key, xid) {XID_SNAPSHOT}
          WHERE NOT {XID_VISIBLE} OR EXISTS (SELECT 1 FROM {name} x WHERE {} AND x.{} IS NULL)",
        table.key_is("x", "u.key"),
        table.column
    );
    Ok(client.query(&sql, &[&keys, &xids]).await?.iter().map(|r| r.get(0)).collect())
}

/// Mark rows of the table; returns the settlements whose row is absent. A
/// row the statement did not touch was settled already, is gone, or belongs
/// to a transaction whose commit the stream decoded before it became visible
/// to new snapshots. One query ([`MISSING_SQL`]) tells them apart: only the
/// last is waited for, so an absent row costs that one query.
async fn mark_rows<'a, C: GenericClient>(
    client: &C,
    batch: &[&'a Settlement],
    marking: Marking,
    report: &mut MarkReport,
) -> Result<Vec<&'a Settlement>, tokio_postgres::Error> {
    let marked = mark_once(client, batch, marking).await?;
    report.marked += marked.len() as u64;
    let mut rest: Vec<&Settlement> = batch.iter().copied().filter(|s| !marked.contains(s.key())).collect();
    let mut absent = Vec::new();
    let started = std::time::Instant::now();
    while !rest.is_empty() {
        let state = missing(client, &rest).await?;
        let of = |s: &Settlement| state.get(s.key()).copied().unwrap_or(Missing::Absent);
        report.gone += rest.iter().filter(|s| of(s) == Missing::Settled).count() as u64;
        absent.extend(rest.iter().copied().filter(|s| of(s) == Missing::Absent));
        rest.retain(|s| matches!(of(s), Missing::Pending | Missing::Invisible));
        let todo: Vec<&Settlement> = rest.iter().copied().filter(|s| of(s) == Missing::Pending).collect();
        if !todo.is_empty() {
            let now = mark_once(client, &todo, marking).await?;
            report.marked += now.len() as u64;
            rest.retain(|s| !now.contains(s.key()));
        }
        if rest.is_empty() {
            break;
        }
        if started.elapsed() > VISIBILITY_DEADLINE {
            // Never settled as gone: whatever is still invisible is written back.
            let ids: Vec<i64> = rest.iter().map(|s| s.id()).collect();
            tracing::warn!(?ids, "outbox rows to be marked did not become visible; treating them as absent");
            absent.append(&mut rest);
            break;
        }
        let wait = crate::policy::retry::backoff(report.waits, Duration::from_millis(1), Duration::from_millis(100));
        tokio::time::sleep(wait).await;
        report.waits += 1;
    }
    Ok(absent)
}

/// Of rows not marked, where each stands ([`Missing`]).
async fn missing<C: GenericClient>(
    client: &C,
    rest: &[&Settlement],
) -> Result<std::collections::HashMap<String, Missing>, tokio_postgres::Error> {
    let ids: Vec<i64> = rest.iter().map(|s| s.id()).collect();
    let xids: Vec<Option<i64>> = rest.iter().map(|s| s.event.xid.map(i64::from)).collect();
    let event_ids: Vec<&str> = rest.iter().map(|s| s.event.event_id.as_str()).collect();
    let mut out = std::collections::HashMap::new();
    for r in client.query(MISSING_SQL.as_str(), &[&ids, &xids, &event_ids]).await? {
        let (key, is_new, present, visible): (String, Option<bool>, bool, bool) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let state = match (present, is_new == Some(true), visible) {
            (true, true, _) => Missing::Pending,
            (true, false, _) => Missing::Settled,
            (false, _, true) => Missing::Absent,
            (false, _, false) => Missing::Invisible,
        };
        out.insert(key, state);
    }
    Ok(out)
}

/// Of settlements whose row is absent, the ids proven published before
/// ([`PUBLISHED_SQL`]).
async fn published_before<C: GenericClient>(
    client: &C,
    rows: &[&Settlement],
) -> Result<HashSet<String>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|s| s.id()).collect();
    let lsns: Vec<Option<String>> = rows.iter().map(|s| s.event.commit_lsn.map(|l| l.to_string())).collect();
    let keys: Vec<&str> = rows.iter().map(|s| s.key()).collect();
    Ok(client.query(PUBLISHED_SQL.as_str(), &[&ids, &lsns, &keys]).await?.iter().map(|r| r.get(0)).collect())
}

/// A settlement's status, `last_error` and deferral code ([`Due::code`]),
/// as the marking statements take them.
fn columns(outcome: &Outcome) -> (&'static str, Option<String>, i16) {
    let (status, error, due) = match outcome {
        Outcome::Published => (RowStatus::Published, None, 0),
        Outcome::Dead(r) => (RowStatus::Dead, Some(r.last_error()), 0),
        Outcome::Deferred(e, due) => (RowStatus::New, Some(e.clone()), due.code()),
    };
    (status.as_str(), error, due)
}

async fn mark_once<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<HashSet<String>, tokio_postgres::Error> {
    let mut ids = Vec::with_capacity(batch.len());
    let mut event_ids = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(batch.len());
    let mut defer = Vec::with_capacity(batch.len());
    let mut commits: Vec<Option<String>> = Vec::with_capacity(batch.len());
    let mut seqs: Vec<Option<i32>> = Vec::with_capacity(batch.len());
    for s in batch {
        let (status, err, d) = columns(&s.outcome);
        commits.push(s.event.commit_lsn.map(|l| l.to_string()));
        seqs.push(seq_param(&s.event));
        ids.push(s.id());
        event_ids.push(s.event.event_id.as_str());
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
    Ok(client
        .query(sql, &[&ids, &statuses, &errors, &base, &max, &defer, &event_ids, &commits, &seqs])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// An event's place in its transaction as the `commit_seq` column takes it.
pub(crate) fn seq_param(ev: &OutboxEvent) -> Option<i32> {
    ev.commit_seq.map(|s| i32::try_from(s).unwrap_or(i32::MAX))
}

/// Write rows that ended DEAD or deferred and are gone from the table back
/// to it: under their own id, or, where another row has taken that id since,
/// under a new one. Returns the rows written (a row whose event is in the
/// table already, a replay's earlier copy, is skipped).
async fn restore_rows<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<u64, tokio_postgres::Error> {
    // A mapped table's row has no id of the relay's table: a new one.
    let own: Vec<&Settlement> = batch.iter().copied().filter(|s| s.event.mapped.is_none()).collect();
    let written =
        if own.is_empty() { HashSet::new() } else { restore_with(client, RESTORE_SQL.as_str(), &own, marking).await? };
    let rest: Vec<&Settlement> = batch
        .iter()
        .copied()
        .filter(|s| s.event.mapped.is_some() || !written.contains(s.event.event_id.as_str()))
        .collect();
    let mut n = written.len() as u64;
    if !rest.is_empty() {
        n += restore_under_new_ids(client, rest, marking).await?;
    }
    Ok(n)
}

/// Write rows back under new ids. A row whose event is in the table
/// already is skipped (its copy stands for it). A row whose new id was in
/// use (ids given again after `RESTART IDENTITY`, while rows written back
/// under their own id keep theirs) is written again once the identity is
/// moved past every id in the table: never dropped.
async fn restore_under_new_ids<C: GenericClient>(
    client: &C,
    mut todo: Vec<&Settlement>,
    marking: Marking,
) -> Result<u64, tokio_postgres::Error> {
    let mut n = 0;
    for _ in 0..RESTORE_ATTEMPTS {
        let written = restore_with(client, RESTORE_NEW_ID_SQL.as_str(), &todo, marking).await?;
        n += written.len() as u64;
        todo.retain(|s| !written.contains(s.key()));
        if todo.is_empty() {
            return Ok(n);
        }
        let keys: Vec<&str> = todo.iter().map(|s| s.key()).collect();
        let present: HashSet<String> = client
            .query("SELECT event_id FROM outbox WHERE event_id = ANY($1)", &[&keys])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let copies: Vec<&str> = keys.iter().copied().filter(|k| present.contains(*k)).take(5).collect();
        if !copies.is_empty() {
            tracing::warn!(
                event_ids = ?copies,
                "rows gone from the table not written back: their event_id is in the table already (a replay's \
                 earlier write-back, or another row under the same idempotency key, whose message stands for it)"
            );
        }
        todo.retain(|s| !present.contains(s.key()));
        if todo.is_empty() {
            return Ok(n);
        }
        tracing::warn!(
            rows = todo.len(),
            "new ids for rows written back were in use (the identity was reset): moving it past the table's ids"
        );
        client.batch_execute(BUMP_IDENTITY_SQL).await?;
    }
    // Never settled unwritten: the flush fails, and its events are sent again.
    client.batch_execute(RESTORE_FAILED_SQL).await?;
    unreachable!("RESTORE_FAILED_SQL raises")
}

/// Rounds of [`restore_under_new_ids`] before the flush fails.
const RESTORE_ATTEMPTS: usize = 5;

/// The identity moved past every id in the table, never back (it needs
/// UPDATE on the identity's sequence; without it the flush fails, and is
/// made again).
const BUMP_IDENTITY_SQL: &str = "SELECT setval(s, greatest((SELECT max(id) FROM outbox), pg_sequence_last_value(s), 1))
    FROM CAST(pg_get_serial_sequence('outbox', 'id') AS regclass) s";

const RESTORE_FAILED_SQL: &str = "DO $$ BEGIN RAISE EXCEPTION
    'outbox rows to write back kept getting ids already in use: the flush fails and its events are sent again'; END $$";

async fn restore_with<C: GenericClient>(
    client: &C,
    sql: &str,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<HashSet<String>, tokio_postgres::Error> {
    let n = batch.len();
    let (mut ids, mut event_ids, mut dests, mut bodies) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut groups, mut attrs, mut created, mut statuses) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut defer, mut errors, mut deliver) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut commits, mut seqs): (Vec<Option<String>>, Vec<Option<i32>>) =
        (Vec::with_capacity(n), Vec::with_capacity(n));
    for s in batch {
        let ev = &s.event;
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
        deliver.push(ev.deliver_at.micros());
        commits.push(ev.commit_lsn.map(|l| l.to_string()));
        seqs.push(seq_param(ev));
    }
    let (base, max) = (marking.base.as_secs_f64(), marking.max.as_secs_f64());
    let rows = client
        .query(
            sql,
            &[
                &ids,
                &event_ids,
                &dests,
                &bodies,
                &groups,
                &attrs,
                &created,
                &statuses,
                &defer,
                &errors,
                &base,
                &max,
                &deliver,
                &commits,
                &marking.bound_unpositioned,
                &seqs,
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Count a flushed batch in the metrics, and log each DEAD row once.
pub fn record(metrics: &Metrics, batch: &[Settlement]) {
    for s in batch {
        match &s.outcome {
            Outcome::Published => {
                metrics.events_published.with_label_values(&[&s.destination]).inc();
                if s.event.transient {
                    metrics.events_transient.with_label_values(&[&s.destination]).inc();
                }
            }
            Outcome::Dead(r) => {
                tracing::warn!(id = s.id(), event_id = %s.event.event_id, destination = %s.destination, reason = r.code.as_str(), detail = %r.detail, "outbox row marked DEAD");
                metrics.events_dead.with_label_values(&[&s.destination, r.code.as_str()]).inc();
            }
            Outcome::Deferred(_, Due::Held) => {
                metrics.events_held.with_label_values(&[&s.destination]).inc();
            }
            Outcome::Deferred(e, _) => {
                tracing::debug!(id = s.id(), destination = %s.destination, error = %e, "outbox row deferred to the table");
                metrics.events_deferred.with_label_values(&[&s.destination]).inc();
            }
        }
    }
}

/// Settlements that came within [`GATHER`] of the first in `batch`, up to
/// [`MAX_FLUSH`]; a closed channel ends the gathering (what came is marked).
async fn gather(rx: &mut mpsc::UnboundedReceiver<Settlement>, batch: &mut Vec<Settlement>) {
    let window = tokio::time::sleep(GATHER);
    tokio::pin!(window);
    while batch.len() < MAX_FLUSH {
        tokio::select! {
            biased;
            s = rx.recv() => match s {
                Some(s) => batch.push(s),
                None => return,
            },
            () = &mut window => return,
        }
    }
}

/// Receive settlements, mark them, then settle them in the watermark and wake
/// the confirmer. Returns when the channel closes, or with the database error
/// that stopped it (nothing unmarked is settled, so nothing is lost).
pub async fn run_settler(
    mut client: tokio_postgres::Client,
    mut rx: mpsc::UnboundedReceiver<Settlement>,
    watermark: Arc<Mutex<Watermark>>,
    confirm: Arc<Notify>,
    metrics: Arc<Metrics>,
    marking: Marking,
) -> Result<(), tokio_postgres::Error> {
    let mut batch = Vec::with_capacity(MAX_FLUSH);
    let mut owed = Owed::default();
    loop {
        let first = tokio::select! {
            first = rx.recv() => first,
            () = tokio::time::sleep(RETRY_EVERY), if !owed.is_empty() => None,
        };
        if owed.due() {
            owed.pay(&client).await?;
        }
        let Some(first) = first else {
            if rx.is_closed() && rx.is_empty() {
                return Ok(());
            }
            continue;
        };
        batch.push(first);
        gather(&mut rx, &mut batch).await;
        let span = tracing::info_span!("outbox_relay.settle", rows = batch.len());
        if batch.iter().all(|s| matches!(s.outcome, Outcome::Published)) {
            mark(&client, &batch, marking, &mut owed).instrument(span).await?;
        } else {
            // Rows handed to the table (deferred, or DEAD) become visible to
            // the table path together: marked rows and rows written back in
            // separate commits let a FIFO drain claim a group's later row
            // (marked) before its earlier one (written back) was there.
            let tx = client.transaction().await?;
            mark(&tx, &batch, marking, &mut owed).instrument(span).await?;
            tx.commit().await?;
        }
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
}

/// What settlement writes, by `published_rows`: DELETE (and INSERT, for
/// transient rows ended DEAD or deferred) on the outbox, and the runs of
/// published ids. Each missing privilege is named with its GRANT.
pub async fn check_privileges(
    client: &tokio_postgres::Client,
    published: PublishedRows,
) -> Result<(), crate::db::DbError> {
    let runs: bool = client.query_one("SELECT to_regclass('outbox_published_runs') IS NOT NULL", &[]).await?.get(0);
    if !runs {
        return Err(crate::db::DbError::Check(
            "the table outbox_published_runs does not exist: run `outbox-relay migrate --database-url ...` (migration 5)"
                .into(),
        ));
    }
    let mut needed = vec![("outbox", "INSERT"), ("outbox_published_runs", "SELECT")];
    if published == PublishedRows::Delete {
        needed.extend([("outbox", "DELETE"), ("outbox_published_runs", "INSERT"), ("outbox_published_runs", "DELETE")]);
    }
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    for (table, privilege) in needed {
        let ok: bool = client.query_one("SELECT has_table_privilege($1, $2)", &[&table, &privilege]).await?.get(0);
        if !ok {
            return Err(crate::db::DbError::Check(format!(
                "role {user:?} lacks {privilege} on {table}, which settlement needs (published_rows = {published:?}): GRANT {privilege} ON {table} TO {user}"
            )));
        }
    }
    Ok(())
}
