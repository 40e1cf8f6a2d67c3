//! Writing rows gone from the table back (transient rows DEAD or deferred,
//! rows found gone that nothing proves published), under a new id when
//! theirs was taken.

use std::collections::HashSet;

use tokio_postgres::GenericClient;

use super::outcome::{columns, seq_param};
use super::outcome::{Marking, Settlement};
use super::sql::{BUMP_IDENTITY_SQL, RESTORE_FAILED_SQL, RESTORE_NEW_ID_SQL, RESTORE_SQL};

/// Write rows that ended DEAD or deferred and are gone from the table back
/// to it: under their own id, or, where another row has taken that id since,
/// under a new one. Returns the rows written (a row whose event is in the
/// table already, a replay's earlier copy, is skipped).
pub(super) async fn restore_rows<C: GenericClient>(
    client: &C,
    batch: &[&Settlement],
    marking: Marking,
) -> Result<u64, tokio_postgres::Error> {
    // A mapped table's row has no id of the relay's table: a new one.
    let own: Vec<&Settlement> = batch.iter().copied().filter(|s| s.id().is_some()).collect();
    let written =
        if own.is_empty() { HashSet::new() } else { restore_with(client, RESTORE_SQL.as_str(), &own, marking).await? };
    let rest: Vec<&Settlement> =
        batch.iter().copied().filter(|s| s.id().is_none() || !written.contains(s.event.event_id.as_str())).collect();
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
pub(super) async fn restore_under_new_ids<C: GenericClient>(
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
pub(super) const RESTORE_ATTEMPTS: usize = 5;

pub(super) async fn restore_with<C: GenericClient>(
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
    let mut replays: Vec<Option<i64>> = Vec::with_capacity(n);
    for s in batch {
        let ev = &s.event;
        let (status, err, d) = columns(&s.outcome);
        ids.push(ev.row_id());
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
        commits.push(ev.commit_lsn_text());
        seqs.push(seq_param(ev));
        replays.push(ev.replay_of);
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
                &replays,
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
