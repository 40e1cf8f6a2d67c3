//! Spooling decisions: when a lane's events go to the table so the slot
//! moves on. A lane spools when its oldest unsettled event is older than
//! `lane_stall_timeout` (decided in the lane) or when the slot
//! holds more than half of `max_retained_wal` ([`watch_wal`], which picks
//! the lane holding the watermark back).

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

use crate::db;
use crate::pipeline::lane::LaneState;

/// Four times a second: if the slot holds more than half of
/// `max_retained_wal` (current WAL minus confirmed flush: the part the relay
/// controls), spool the lane whose oldest unsettled event is the oldest, as
/// that is the one holding the watermark back. Acting at half the budget
/// leaves room for the WAL written while the spool takes effect, so the slot
/// stays under the budget itself. Events younger than a second are in normal
/// flight, not holding anything, and are left alone.
pub(crate) async fn watch_wal(db: db::Db, slot: String, max_retained_wal: u64, lanes: Vec<Arc<LaneState>>) {
    const MIN_AGE: Duration = Duration::from_secs(1);
    let threshold = max_retained_wal / 2;
    let mut client: Option<Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = db.connect().await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
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
                client = None;
                continue;
            }
        };
        if held <= threshold {
            continue;
        }
        let worst = lanes
            .iter()
            .filter(|l| !l.is_spooling())
            .filter_map(|l| l.oldest_unsettled_age().map(|a| (a, l)))
            .filter(|(a, _)| *a >= MIN_AGE)
            .max_by_key(|(a, _)| *a);
        if let Some((age, lane)) = worst {
            lane.start_spooling(&format!(
                "slot holds {held} bytes of WAL, over half of max_retained_wal ({max_retained_wal}); this lane's oldest unsettled event is {:.1}s old",
                age.as_secs_f64()
            ));
        }
    }
}
