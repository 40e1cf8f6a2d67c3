//! Retention: PUBLISHED rows (kept by `published_rows = "keep"`) older than
//! `retention` deleted in batches, and the runs of published ids pruned once
//! no slot can replay them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::db;
use crate::metrics::Metrics;

/// Once a minute: prune the runs of published ids, and delete PUBLISHED rows
/// older than `retention` (if set), a thousand at a time.
pub(crate) async fn sweep_retention(
    db: db::Db,
    retention: Option<Duration>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    let mut kept = db::Kept::new(db);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let Some(c) = kept.get().await else { continue };
        if let Err(e) = prune_runs(c).await {
            tracing::warn!(error = %e, "pruning outbox_published_runs failed; retrying next minute");
            kept.lost();
            continue;
        }
        let Some(retention) = retention else { continue };
        match sweep_once(c, retention).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.retention_deleted.inc_by(n);
                tracing::info!(deleted = n, ?retention, "retention: deleted PUBLISHED rows");
            }
            Err(e) => {
                tracing::warn!(error = %e, "retention sweep failed; retrying next minute");
                kept.lost();
            }
        }
    }
}

/// The runs of published ids serve one purpose: a slot replaying what it
/// had not confirmed tells a row the relay published and deleted from one a
/// later transaction deleted. A run written before every logical slot of
/// this database has its `restart_lsn` past it can never be replayed; without
/// a slot (polling), nothing replays, and runs are kept a minute. Returns
/// runs deleted.
///
/// Not `confirmed_flush_lsn`: the server writes a slot to disk when its
/// `restart_lsn` moves, and only at checkpoints when just its confirmed
/// position does, so a crash (an immediate restart, a power cut) takes the
/// confirmed position back to the one last written, at or after the
/// `restart_lsn` shown, and the slot replays from there. Pruning by the
/// confirmed position shown deleted the runs that replay needed: 84,130
/// duplicates of 68,340 rows in 100 immediate restarts, against 30 of
/// 13,850 in 20 after this change (the fault measurement, 2026-12-03).
pub async fn prune_runs(c: &tokio_postgres::Client) -> Result<u64, tokio_postgres::Error> {
    c.execute(
        "DELETE FROM outbox_published_runs
          WHERE lsn < coalesce((SELECT min(restart_lsn) FROM pg_replication_slots
                                 WHERE database = current_database() AND slot_type = 'logical'),
                               CASE WHEN published_at < now() - interval '1 minute' THEN 'FFFFFFFF/FFFFFFFF'::pg_lsn END)",
        &[],
    )
    .await
}

/// One sweep: batches of 1,000 until none is left. Returns rows deleted.
///
/// No index on `published_at` (it would cost every publish an index insert):
/// a row is published after it is created, so only rows created before the
/// cutoff qualify, and ids grow with creation. The sweep walks the primary
/// key up to the first row created after the cutoff, which, swept every
/// minute, is a short walk.
pub async fn sweep_once(c: &tokio_postgres::Client, retention: Duration) -> Result<u64, tokio_postgres::Error> {
    let secs = retention.as_secs_f64();
    let boundary: i64 = c
        .query_opt(
            "SELECT id FROM outbox WHERE created_at >= now() - make_interval(secs => $1) ORDER BY id LIMIT 1",
            &[&secs],
        )
        .await?
        .map(|r| r.get(0))
        .unwrap_or(i64::MAX);
    let mut total = 0;
    loop {
        let n = c
            .execute(
                "DELETE FROM outbox WHERE id IN (
                     SELECT id FROM outbox
                      WHERE id < $2 AND status = 'PUBLISHED' AND published_at < now() - make_interval(secs => $1)
                      ORDER BY id LIMIT 1000)",
                &[&secs, &boundary],
            )
            .await?;
        total += n;
        if n < 1000 {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}
