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
    let poll = (config.takeover_timeout / 10).max(Duration::from_millis(100));
    let mut waiting = false;
    while !*stop.borrow() {
        let c = match db.connect().await {
            Ok(c) => c,
            Err(e) => {
                metrics.set_standby(false);
                tracing::warn!(error = %e, "cannot connect for the leader lock; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(poll.max(Duration::from_secs(1))) => continue,
                    _ = stop.wait_for(|s| *s) => return None,
                }
            }
        };
        // Server-side keepalives on the lock's session: a leader whose host
        // vanished (no FIN, no RST) loses the lock within about
        // `takeover_timeout`, not the OS's two hours. Ignored over a Unix
        // socket.
        if let Err(e) = c.batch_execute(&lock_keepalive(config.takeover_timeout)).await {
            tracing::debug!(error = %e, "cannot set the lock session's keepalives");
        }
        match try_lock_until(&c, config, db, metrics, poll, &mut waiting, stop).await {
            Some(true) => return Some(c),
            Some(false) => continue,
            None => return None,
        }
    }
    None
}

/// Try the slot's lock on `c` every `poll`: `Some(true)` once it is taken,
/// `Some(false)` when the connection failed (connect again), `None` at
/// `stop`. `waiting`: the standby was said already.
async fn try_lock_until(
    c: &tokio_postgres::Client,
    config: &Config,
    db: &Db,
    metrics: &Metrics,
    poll: Duration,
    waiting: &mut bool,
    stop: &mut watch::Receiver<bool>,
) -> Option<bool> {
    let key = format!("outbox_relay_leader:{}", config.slot);
    loop {
        let sql = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))";
        match db.query("taking the leader lock", c.query_one(sql, &[&key])).await {
            Ok(r) if r.get::<_, bool>(0) => {
                tracing::info!(slot = %config.slot, "leader: holding the slot's lock; streaming");
                metrics.set_standby(false);
                metrics.is_leader.set(1);
                metrics.leader_changes.inc();
                return Some(true);
            }
            Ok(_) => {
                metrics.set_standby(true);
                if !std::mem::replace(waiting, true) {
                    tracing::info!(slot = %config.slot, "standby: another relay leads this slot; taking over when it goes");
                }
            }
            Err(e) => {
                metrics.set_standby(false);
                tracing::warn!(error = %e, "leader lock query failed; reconnecting");
                return Some(false);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = stop.wait_for(|s| *s) => return None,
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

/// The settings of the lock's session that end it on the server when its
/// client's host is gone: keepalives after a third of `takeover`, three
/// probes half of it apart, and unacknowledged data given up after `takeover`.
fn lock_keepalive(takeover: Duration) -> String {
    let idle = (takeover.as_secs() / 3).max(1);
    let interval = (takeover.as_secs() / 6).max(1);
    format!(
        "SET tcp_keepalives_idle = {idle}; SET tcp_keepalives_interval = {interval}; \
         SET tcp_keepalives_count = 3; SET tcp_user_timeout = {}",
        takeover.as_millis().max(1000)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vanished_leader_loses_the_lock_within_about_the_takeover_timeout() {
        // 3 s idle + 3 probes 1 s apart: 6 s of silence, under 10 s.
        let s = lock_keepalive(Duration::from_secs(10));
        assert_eq!(
            s,
            "SET tcp_keepalives_idle = 3; SET tcp_keepalives_interval = 1; \
             SET tcp_keepalives_count = 3; SET tcp_user_timeout = 10000"
        );
        // Never below what the server accepts (whole seconds, at least 1).
        assert!(lock_keepalive(Duration::from_secs(1))
            .starts_with("SET tcp_keepalives_idle = 1; SET tcp_keepalives_interval = 1"));
    }
}
