//! Leadership: one relay per slot streams, holding an advisory lock on a
//! connection of its own; the others wait and take over when it goes.

use std::time::Duration;

use tokio::sync::watch;

use crate::config::Config;
use crate::db::Db;
use crate::metrics::Metrics;

/// Wait until this relay holds the slot's leader lock (a session advisory
/// lock on a connection of its own); `None` when asked to stop first.
pub(crate) async fn acquire_leadership(
    config: &Config,
    db: &Db,
    metrics: &Metrics,
    stop: &mut watch::Receiver<bool>,
) -> Option<tokio_postgres::Client> {
    let key = format!("outbox_relay_leader:{}", config.slot);
    let poll = (config.takeover_timeout / 10).max(Duration::from_millis(100));
    let mut waiting = false;
    loop {
        if *stop.borrow() {
            return None;
        }
        match db.connect().await {
            Ok(c) => loop {
                match db
                    .query(
                        "taking the leader lock",
                        c.query_one("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", &[&key]),
                    )
                    .await
                {
                    Ok(r) if r.get::<_, bool>(0) => {
                        tracing::info!(slot = %config.slot, "leader: holding the slot's lock; streaming");
                        metrics.set_standby(false);
                        metrics.is_leader.set(1);
                        metrics.leader_changes.inc();
                        return Some(c);
                    }
                    Ok(_) => {
                        metrics.set_standby(true);
                        if !waiting {
                            tracing::info!(slot = %config.slot, "standby: another relay leads this slot; taking over when it goes");
                            waiting = true;
                        }
                    }
                    Err(e) => {
                        metrics.set_standby(false);
                        tracing::warn!(error = %e, "leader lock query failed; reconnecting");
                        break;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(poll) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
            },
            Err(e) => {
                metrics.set_standby(false);
                tracing::warn!(error = %e, "cannot connect for the leader lock; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(poll.max(Duration::from_secs(1))) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
            }
        }
    }
}

/// Check the lock's connection every `takeover_timeout / 5`; return when it
/// is lost (an error, or no answer within that time), or as soon as its
/// socket is closed (a server that died or failed over: seen within 100 ms,
/// no query needed). The lock is held as long as the client lives: it is
/// released when this future is dropped.
pub(crate) async fn watch_lock(client: tokio_postgres::Client, takeover_timeout: Duration) {
    const TICK: Duration = Duration::from_millis(100);
    let every = (takeover_timeout / 5).max(TICK);
    let mut last_ping = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        if client.is_closed() {
            return;
        }
        if last_ping.elapsed() >= every {
            let ok = matches!(tokio::time::timeout(every, client.simple_query("SELECT 1")).await, Ok(Ok(_)));
            if !ok || client.is_closed() {
                return;
            }
            last_ping = tokio::time::Instant::now();
        }
    }
}
