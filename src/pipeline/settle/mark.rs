//! Marking a flush of settlements in one statement, and making sure it
//! took: a row not touched is settled already, gone, or not visible yet.

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::config::PublishedRows;
use crate::pipeline::owed::Owed;

use super::mapped::mark_mapped_published;
use super::outcome::{columns, seq_param, Marking, Outcome, Settlement};
use super::restore::restore_rows;
use super::sql::{DELETE_SQL, KEEP_SQL, MISSING_SQL};
use super::visible::VISIBILITY_DEADLINE;

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
pub(super) enum Missing {
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
    let (rows, transient): (Vec<&Settlement>, Vec<&Settlement>) = batch.iter().partition(|s| s.has_row());
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

/// Mark rows of the table; returns the settlements whose row is absent. A
/// row the statement did not touch was settled already, is gone, or belongs
/// to a transaction whose commit the stream decoded before it became visible
/// to new snapshots. One query ([`MISSING_SQL`]) tells them apart: only the
/// last is waited for, so an absent row costs that one query.
pub(super) async fn mark_rows<'a, C: GenericClient>(
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
            let ids: Vec<Option<i64>> = rest.iter().map(|s| s.id()).collect();
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
pub(super) async fn missing<C: GenericClient>(
    client: &C,
    rest: &[&Settlement],
) -> Result<std::collections::HashMap<String, Missing>, tokio_postgres::Error> {
    let ids: Vec<Option<i64>> = rest.iter().map(|s| s.id()).collect();
    let xids: Vec<Option<i64>> = rest.iter().map(|s| s.event.commit().map(|c| i64::from(c.xid))).collect();
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
/// ([`crate::db::settled::proven_published`]).
pub(super) async fn published_before<C: GenericClient>(
    client: &C,
    rows: &[&Settlement],
) -> Result<HashSet<String>, tokio_postgres::Error> {
    let ids: Vec<Option<i64>> = rows.iter().map(|s| s.id()).collect();
    let lsns: Vec<Option<String>> = rows.iter().map(|s| s.event.commit_lsn_text()).collect();
    let keys: Vec<&str> = rows.iter().map(|s| s.key()).collect();
    crate::db::settled::proven_published(client, &ids, &lsns, &keys).await
}

pub(super) async fn mark_once<C: GenericClient>(
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
        commits.push(s.event.commit_lsn_text());
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
