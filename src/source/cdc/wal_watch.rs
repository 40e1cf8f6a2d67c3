//! The WAL-budget watch of a session: how much WAL the slot holds, and
//! the lane the spooling policy picks told to spool.

use std::sync::Arc;
use std::time::Duration;

use crate::db;
use crate::pipeline::parts::Parts;
use crate::policy::spool::lane_to_spool;

/// Four times a second: the slot's WAL held (current WAL minus confirmed
/// flush), and the lane [`lane_to_spool`] picks, spooled.
pub(crate) async fn watch_wal(db: db::Db, slot: String, max_retained_wal: u64, parts: Arc<Parts>) {
    let mut kept = db::Kept::new(db.clone());
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(c) = kept.get().await else { continue };
        let held = match db
            .query(
                "reading the slot's retained WAL",
                c.query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                ),
            )
            .await
        {
            Ok(Some(r)) => r.get::<_, Option<i64>>(0).unwrap_or(0).max(0) as u64,
            Ok(None) => continue,
            Err(_) => {
                kept.lost();
                continue;
            }
        };
        // Every lane now: destinations looked up since the session began too.
        let lanes = parts.destinations.states();
        let ages: Vec<Option<Duration>> =
            lanes.iter().map(|l| if l.is_spooling() { None } else { l.oldest_unsettled_age() }).collect();
        if let Some(i) = lane_to_spool(held, max_retained_wal, &ages) {
            lanes[i].start_spooling(crate::policy::spool::SpoolCause::WalBudget {
                held,
                max: max_retained_wal,
                oldest: ages[i].unwrap_or_default(),
            });
        }
    }
}
