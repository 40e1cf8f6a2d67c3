//! The slot: looked up (a lost one dropped), created with an exported
//! snapshot whose older rows are handed to the table path, dropped when that hand-off did not finish.

use std::time::Duration;

use pgwire_replication::ReplicationClient;
use replication::Lsn;
use tokio_postgres::Client;

use super::CdcError;
use crate::db::settled::{self, PositionRows};
use crate::db::Db;

pub(crate) enum SlotState {
    Exists {
        confirmed_flush: Lsn,
        /// Created (or altered) with FAILOVER: synced to standbys (17+).
        failover: bool,
    },
    Missing,
    /// The server invalidated it (the reason: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, `idle_timeout`, ...) and it was dropped.
    Lost {
        reason: String,
    },
}

/// Why the server invalidated a slot, on every major: `invalidation_reason`
/// (17+); before 17, `wal_status = 'lost'` with no `restart_lsn` left is WAL
/// removed (16 also sets `conflicting` for that, so it is read after),
/// `conflicting` otherwise a conflict with recovery on a standby. Read
/// through `to_jsonb` so one query serves servers with and without the
/// newer columns. NULL: the slot is usable.
pub const INVALIDATION_SQL: &str = "
    coalesce(to_jsonb(s) ->> 'invalidation_reason',
             CASE WHEN s.wal_status = 'lost' AND s.restart_lsn IS NULL THEN 'wal_removed' END,
             CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'rows_removed' END,
             CASE WHEN s.wal_status = 'lost' THEN 'wal_removed' END)";

/// Look the slot up; drop it if the server invalidated it (it can no longer
/// stream what it promised), so it is created afresh with the table catch-up.
pub(crate) async fn prepare_slot(sql: &Client, slot: &str) -> Result<SlotState, CdcError> {
    let row = sql
        .query_opt(
            &format!(
                "SELECT s.database = current_database(), s.plugin, {INVALIDATION_SQL}, s.confirmed_flush_lsn::text,
                        coalesce((to_jsonb(s) ->> 'failover')::bool, false)
                   FROM pg_replication_slots s WHERE s.slot_name = $1"
            ),
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(SlotState::Missing) };
    let (same_db, plugin, invalid, flush): (Option<bool>, Option<String>, Option<String>, Option<String>) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if same_db != Some(true) || plugin.as_deref() != Some("pgoutput") {
        return Err(CdcError::Protocol(format!(
            "replication slot {slot:?} exists but is not a pgoutput slot of this database: choose another `slot` name or drop it"
        )));
    }
    if let Some(reason) = invalid {
        tracing::error!(
            slot,
            reason,
            "the server invalidated the replication slot; dropping it, creating it again and catching up from the outbox table"
        );
        sql.execute("SELECT pg_drop_replication_slot($1)", &[&slot]).await?;
        return Ok(SlotState::Lost { reason });
    }
    let confirmed_flush = flush.and_then(|s| s.parse().ok()).unwrap_or_default();
    Ok(SlotState::Exists { confirmed_flush, failover: row.get(4) })
}

/// `CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export'[, FAILOVER])` on a gated
/// session: the slot's consistent point and the exported snapshot's name,
/// valid until the session runs another command.
pub(crate) async fn create_slot_exporting(
    repl: &mut ReplicationClient,
    slot: &str,
    failover: bool,
) -> Result<(Lsn, String), CdcError> {
    let rows = repl
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export'{})",
            postgres_protocol::escape::escape_identifier(slot),
            if failover { ", FAILOVER" } else { "" }
        ))
        .await?;
    let row = rows.first().ok_or_else(|| CdcError::Protocol("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| {
        row.get(i)
            .and_then(|v| v.as_ref())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .ok_or_else(|| CdcError::Protocol(format!("CREATE_REPLICATION_SLOT: column {i} missing")))
    };
    let consistent: Lsn = text(1)?.parse().map_err(|e| CdcError::Protocol(format!("{e}")))?;
    Ok((consistent, text(2)?))
}

/// A slot made before `failover = true` was set: altered to FAILOVER (17+)
/// on the gated session, before it streams.
pub(crate) async fn make_failover(repl: &mut ReplicationClient, slot: &str) -> Result<(), CdcError> {
    repl.simple_query(&format!(
        "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
        postgres_protocol::escape::escape_identifier(slot)
    ))
    .await?;
    tracing::info!(slot, "replication slot altered to FAILOVER: standbys running sync_replication_slots keep it");
    Ok(())
}

/// Open a transaction on `client` that sees exactly the exported snapshot.
pub(crate) async fn import_snapshot(client: &Client, snapshot: &str) -> Result<(), CdcError> {
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT {}",
            postgres_protocol::escape::escape_literal(snapshot)
        ))
        .await?;
    Ok(())
}

/// After a hand-off that did not finish: drop the slot this session created (its
/// walsender may take a moment to let go of it).
pub(crate) async fn drop_unfinished_slot(db: &Db, slot: &str, sql: &Client) {
    for _ in 0..20 {
        let r = tokio::time::timeout(
            db.deadlines.query,
            sql.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
                &[&slot],
            ),
        )
        .await;
        if matches!(r, Ok(Ok(1))) {
            tracing::warn!(slot = %slot, "the new slot's hand-off of older rows did not finish: dropped the slot, so the next session creates it again");
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::error!(slot = %slot, "the new slot's hand-off of older rows did not finish and the slot could not be dropped: drop it (`outbox-relay slot drop`) before the next start so NEW rows written before it are published");
}

/// The rows a new slot will not stream (NEW in its snapshot, not handed to
/// the table yet; only this shard's destinations) are handed to the table
/// path: `next_attempt_at = now()`, so the spool drain publishes them and the
/// lanes stream again once it is empty. Ids are read in the snapshot, then
/// updated outside it (no conflict with later writers). Every NEW row of the
/// snapshot without a commit position gets `consistent` (the slot's
/// consistent point): it committed before any row the slot streams, and
/// after any the table holds with a position ([`settled::position_handed`]). Returns
/// the rows handed.
pub(crate) async fn hand_to_table(snap: Client, shard: Option<Vec<String>>, consistent: Lsn) -> Result<u64, CdcError> {
    let ids = settled::not_streamed(&snap, shard.as_deref()).await?;
    snap.batch_execute("COMMIT").await?;
    let mut handed = 0;
    for chunk in ids.chunks(10_000) {
        handed += settled::hand_ids(&snap, chunk, consistent).await?;
        settled::position_handed(&snap, PositionRows::Ids(chunk), consistent).await?;
    }
    Ok(handed)
}

/// Record that `slot`'s hand-off is about to run, before the slot is
/// created: a session finding the slot with this record still there knows
/// the hand-off did not finish ([`finish_hand_off`]).
pub(crate) async fn hand_off_begins(sql: &Client, slot: &str) -> Result<(), CdcError> {
    sql.execute("INSERT INTO outbox_relay_handoffs (slot) VALUES ($1) ON CONFLICT (slot) DO NOTHING", &[&slot]).await?;
    Ok(())
}

/// The hand-off is done: forget it.
pub(crate) async fn hand_off_done(sql: &Client, slot: &str) -> Result<(), CdcError> {
    sql.execute("DELETE FROM outbox_relay_handoffs WHERE slot = $1", &[&slot]).await?;
    Ok(())
}

/// A slot that has streamed nothing yet: its confirmed position, which is
/// its consistent point ([`hand_to_table`]'s position for the rows handed).
async fn consistent_point(sql: &Client, slot: &str) -> Result<Lsn, CdcError> {
    let at: Option<String> = sql
        .query_opt("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
        .await?
        .and_then(|r| r.get(0));
    at.ok_or_else(|| CdcError::Protocol(format!("slot {slot:?} has no confirmed position")))?
        .parse()
        .map_err(|e| CdcError::Protocol(format!("confirmed_flush_lsn: {e}")))
}

/// A slot found with its hand-off still recorded: the relay stopped between
/// creating it and handing the older rows over, which of them were handed
/// is unknown, and the slot will never stream them. Every NEW row not yet
/// in the table path's care (this shard's destinations) is handed to it;
/// rows the stream brings as well are committed before the position
/// returned, and the stream checks those against the table, so none is
/// sent twice. Returns the rows handed and that position; None when no
/// hand-off was pending.
pub(crate) async fn finish_hand_off(
    sql: &Client,
    slot: &str,
    shard: Option<&[String]>,
) -> Result<Option<(u64, Lsn)>, CdcError> {
    let pending = sql.query_opt("SELECT 1 FROM outbox_relay_handoffs WHERE slot = $1", &[&slot]).await?;
    if pending.is_none() {
        return Ok(None);
    }
    // The rows the slot will not stream are committed, so visible now, and
    // none has an id over the highest visible: rows written later are
    // streamed.
    let hi: Option<i64> = sql.query_one("SELECT max(id) FROM outbox", &[]).await?.get(0);
    let at = consistent_point(sql, slot).await?;
    settled::position_handed(sql, PositionRows::Destinations(shard), at).await?;
    let (mut handed, mut from) = (0u64, i64::MIN);
    loop {
        let (last, n) = settled::hand_range(sql, from, hi.unwrap_or(i64::MIN), shard, at).await?;
        handed += n;
        match last {
            Some(last) => from = last,
            None => break,
        }
    }
    let lsn = sql.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await?.get::<_, String>(0);
    let lsn = lsn.parse().map_err(|e| CdcError::Protocol(format!("pg_current_wal_insert_lsn: {e}")))?;
    hand_off_done(sql, slot).await?;
    Ok(Some((handed, lsn)))
}
