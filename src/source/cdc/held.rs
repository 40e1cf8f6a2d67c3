//! The held-stream watch of a session: the server sending nothing of the
//! slot's stream while this relay waits for it. PostgreSQL 17 holds a
//! failover slot's walsender while `synchronized_standby_slots` names a slot
//! that does not exist or lags; a walsender can also stop (a frozen process,
//! a wedged host). Rows must not wait on it: the watch names the cause (log,
//! `outbox_relay_stream_held`, readiness) and hands this relay's NEW rows to
//! the table path, as a spooled lane does, until the stream moves again.
//!
//! How it knows: when the stream has brought nothing new for
//! [`policy::spool::STREAM_QUIET`] while the session waits on it, the watch
//! writes a probe (a transactional logical message, as the heartbeat is). A
//! server that streams sends it back within milliseconds; one that has not
//! sent it after [`policy::spool::stream_held_after`] holds the stream.
//!
//! [`policy::spool::STREAM_QUIET`]: crate::policy::spool::STREAM_QUIET
//! [`policy::spool::stream_held_after`]: crate::policy::spool::stream_held_after

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use replication::Lsn;
use tokio_postgres::Client;

use crate::db;
use crate::pipeline::lane::LaneState;
use crate::policy::spool::{stream_held_after, SpoolCause, STREAM_QUIET};

use super::{StreamContext, HEARTBEAT_PREFIX};

/// What the session's stream loop tells the watch.
#[derive(Debug, Default)]
pub(crate) struct StreamProgress {
    /// The furthest WAL position of anything received (messages, commits,
    /// changes; not keepalives, which a held walsender still sends).
    received: AtomicU64,
    /// The loop is handing events on (waiting on its own lanes, not on the
    /// server).
    busy: AtomicBool,
}

/// The WAL position up to which rows may have been handed to the table
/// while the stream was held or down: the stream's rows committed before it
/// are checked against the table like a replay, so the table path and the
/// stream do not both send them. Outlives sessions.
#[derive(Debug, Default)]
pub struct HandedUntil(AtomicU64);

impl HandedUntil {
    pub(crate) fn get(&self) -> Lsn {
        Lsn(self.0.load(Ordering::Relaxed))
    }

    pub(crate) fn raise(&self, lsn: Lsn) {
        self.0.fetch_max(lsn.0, Ordering::Relaxed);
    }
}

impl StreamProgress {
    pub(crate) fn saw(&self, lsn: Lsn) {
        self.received.fetch_max(lsn.0, Ordering::Relaxed);
    }

    pub(crate) fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
    }
}

/// Rows handed to the table per statement while the stream is held.
const HAND_OVER_BATCH: i64 = 10_000;

/// What the watch needs of the session.
pub(crate) struct HeldWatch {
    pub db: db::Db,
    /// Every lane's state is read from here at each use (destinations are
    /// added while the session runs).
    pub parts: Arc<crate::pipeline::parts::Parts>,
    pub progress: Arc<StreamProgress>,
    pub handed_until: Arc<HandedUntil>,
}

/// Where the watch stands: the probe in flight, and whether it has called
/// the stream held (with the cause it named).
#[derive(Default)]
struct Watch {
    received: u64,
    advanced: Option<Instant>,
    probe: Option<(u64, Instant)>,
    held: Option<String>,
    /// The walsender's sent position at the last tick and when it last
    /// moved: a walsender still reading WAL (a big transaction, a busy or
    /// restarting server) is slow, not holding anything back.
    sent: Option<(u64, Instant)>,
}

/// Whether the walsender shows a hold: its sent position (`None`: no
/// walsender reads the slot) is behind the probe and has not moved for
/// [`STREAM_QUIET`]. Updates `last` with this tick's reading.
fn walsender_stuck(sent: Option<u64>, probe: u64, last: &mut Option<(u64, Instant)>) -> bool {
    let Some(sent) = sent else {
        *last = None;
        return true;
    };
    let since = match *last {
        Some((before, at)) if before == sent => at,
        _ => Instant::now(),
    };
    *last = Some((sent, since));
    sent < probe && since.elapsed() >= STREAM_QUIET
}

/// Once a second until the session ends (the task is aborted with it, and
/// the session clears `outbox_relay_stream_held`).
pub(crate) async fn watch_held(w: HeldWatch) {
    let mut kept = crate::db::Kept::new(w.db.clone());
    let mut state = Watch { advanced: Some(Instant::now()), ..Default::default() };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(c) = kept.get().await else { continue };
        if let Err(e) = w.db.query("watching the stream", step(&w, c, &mut state)).await {
            tracing::debug!(error = %e, "held-stream watch query failed; reconnecting");
            kept.lost();
        }
    }
}

/// One tick: note progress, write a probe when the stream is quiet, call it
/// held when the probe does not come back, hand rows over while it is.
async fn step(w: &HeldWatch, c: &Client, s: &mut Watch) -> Result<(), tokio_postgres::Error> {
    let received = w.progress.received.load(Ordering::Relaxed);
    if received != s.received {
        s.received = received;
        s.advanced = Some(Instant::now());
    }
    let quiet = s.advanced.is_none_or(|t| t.elapsed() >= STREAM_QUIET) && !w.progress.busy.load(Ordering::Relaxed);
    match s.probe {
        Some((lsn, _)) if received >= lsn => {
            s.probe = None;
            s.sent = None;
            if s.held.take().is_some() {
                w.parts.metrics.release_hold();
                w.parts.destinations.states().iter().for_each(|l| l.release());
                tracing::info!(slot = %w.parts.settings.slot.name, "the server streams again; lanes return to streaming as their spools allow");
            }
        }
        Some((lsn, at)) if quiet && at.elapsed() >= stream_held_after(w.parts.settings.lanes.stall_timeout) => {
            if s.held.is_none() {
                // Evidence, not the wait alone: a walsender waiting for WAL
                // looks the same as one held back.
                let sent = walsender_sent(c, &w.parts.settings.slot.name).await?;
                if !walsender_stuck(sent, lsn, &mut s.sent) {
                    return Ok(());
                }
                let cause = diagnose(c, &w.parts.settings.slot.name).await?;
                tracing::warn!(slot = %w.parts.settings.slot.name, %cause, "the server holds the replication stream back: this relay's rows go by the outbox table until it streams again");
                w.parts.metrics.hold(&cause);
                for lane in &w.parts.destinations.states() {
                    lane.hold(SpoolCause::StreamHeld(cause.clone()));
                }
                s.held = Some(cause);
            }
            let cause = s.held.as_deref().unwrap_or_default();
            hand_over(c, &handable(&w.parts.destinations.states()), cause, &w.handed_until).await?;
        }
        Some(_) => {}
        None if quiet => {
            let lsn: String = c
                .query_one(
                    "SELECT pg_logical_emit_message(true, $1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint::text)::text",
                    &[&HEARTBEAT_PREFIX],
                )
                .await?
                .get(0);
            if let Ok(lsn) = lsn.parse::<Lsn>() {
                s.probe = Some((lsn.0, Instant::now()));
            }
        }
        None => {}
    }
    Ok(())
}

/// The sent position of the walsender reading `slot`, if one does.
async fn walsender_sent(c: &Client, slot: &str) -> Result<Option<u64>, tokio_postgres::Error> {
    let r = c
        .query_opt(
            "SELECT r.sent_lsn::text FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    let sent: Option<String> = r.and_then(|r| r.get(0));
    Ok(sent.and_then(|t| t.parse::<Lsn>().ok()).map(|l| l.0))
}

/// Hand this relay's NEW rows the stream has not brought to the table path:
/// due now, the cause as their `last_error`. A batch per tick. Every row it
/// hands over committed before the WAL position it reads (the rows are
/// visible to it), which `until` keeps for the stream's replay check.
async fn hand_over(
    c: &Client,
    destinations: &[String],
    cause: &str,
    until: &HandedUntil,
) -> Result<u64, tokio_postgres::Error> {
    let why = format!("stream held back: {cause}");
    let (handed, lsn) = crate::db::settled::hand_held(c, destinations, &why, HAND_OVER_BATCH).await?;
    if handed > 0 {
        if let Ok(lsn) = lsn.parse::<Lsn>() {
            until.raise(lsn);
        }
    }
    Ok(handed)
}

/// Why the server may be holding the slot's walsender, in an operator's
/// words: what [`server_hold`] finds, or else what the walsender waits on.
pub async fn diagnose(c: &Client, slot: &str) -> Result<String, tokio_postgres::Error> {
    if let Some(cause) = server_hold(c, slot).await? {
        return Ok(cause);
    }
    let r = c
        .query_opt(
            "SELECT s.active_pid, a.wait_event_type, a.wait_event
               FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
              WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(r) = r else { return Ok(format!("the slot {slot} does not exist")) };
    let (pid, wait_type, wait): (Option<i32>, Option<String>, Option<String>) = (r.get(0), r.get(1), r.get(2));
    Ok(match pid {
        Some(pid) => format!(
            "the walsender (pid {pid}) sends nothing while this relay waits; it waits on {}/{}",
            wait_type.unwrap_or_else(|| "-".into()),
            wait.unwrap_or_else(|| "nothing (it runs, or is stopped)".into())
        ),
        None => "no walsender reads the slot".to_string(),
    })
}

/// A hold the server itself shows, for `status` and the watch: a failover
/// slot (PostgreSQL 17+) while `synchronized_standby_slots` names a slot
/// this server lacks (its walsender waits for ever; typical of a standby
/// promoted with the old primary's setting), or its walsender waiting for
/// those standby slots to confirm.
pub async fn server_hold(c: &Client, slot: &str) -> Result<Option<String>, tokio_postgres::Error> {
    let Some(r) = c
        .query_opt(
            "SELECT a.wait_event, current_setting('synchronized_standby_slots', true),
                    (to_jsonb(s) ->> 'failover')::bool
               FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
              WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?
    else {
        return Ok(None);
    };
    let (wait, standby, failover): (Option<String>, Option<String>, Option<bool>) = (r.get(0), r.get(1), r.get(2));
    let standby: Vec<String> = standby
        .unwrap_or_default()
        .split(',')
        .map(|n| n.trim().trim_matches('"').to_string())
        .filter(|n| !n.is_empty())
        .collect();
    if failover != Some(true) || standby.is_empty() {
        return Ok(None);
    }
    let present: Vec<String> = c
        .query("SELECT slot_name::text FROM pg_replication_slots WHERE slot_name = ANY($1)", &[&standby])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let missing: Vec<&String> = standby.iter().filter(|n| !present.contains(n)).collect();
    Ok(if !missing.is_empty() {
        Some(format!(
            "synchronized_standby_slots names {missing:?}, which this server does not have: PostgreSQL holds every failover slot's walsender until they exist and confirm (remove them from the setting on this server, the new primary after a failover)"
        ))
    } else if wait.as_deref() == Some("WaitForStandbyConfirmation") {
        Some(format!(
            "the walsender waits for the standby slots of synchronized_standby_slots ({standby:?}) to confirm the WAL: a standby is behind or gone"
        ))
    } else {
        None
    })
}

/// While this relay leads but no replication session streams (the slot in
/// use by another process, a walsender left frozen by an earlier session,
/// slot creation waiting on a long transaction, replication connections
/// refused), rows must not wait either: after the same
/// [`stream_held_after`], name the cause, spool every lane and hand the NEW
/// rows to the table path each second, until a session streams. Runs for as
/// long as the relay leads; `last_error` is the last session's error.
pub async fn watch_down(ctx: &StreamContext, last_error: &Mutex<Option<String>>) {
    let db = &ctx.db;
    let after = stream_held_after(ctx.parts.settings.lanes.stall_timeout);
    let mut kept = crate::db::Kept::new(db.clone());
    let (mut down_since, mut named): (Option<Instant>, Option<(String, Instant)>) = (None, None);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if ctx.streaming_since.lock().unwrap().is_some() {
            down_since = None;
            if named.take().is_some() {
                ctx.parts.metrics.release_hold();
                ctx.parts.destinations.states().iter().for_each(|l| l.release());
                tracing::info!(slot = %ctx.parts.settings.slot.name, "a replication session streams again; lanes return to streaming as their spools allow");
            }
            continue;
        }
        if down_since.get_or_insert_with(Instant::now).elapsed() < after {
            continue;
        }
        let Some(c) = kept.get().await else { continue };
        let last = last_error.lock().unwrap().clone();
        let step = down_step(ctx, c, last.as_deref(), &mut named);
        if let Err(e) = db.query("watching for a replication session", step).await {
            tracing::debug!(error = %e, "session watch query failed; reconnecting");
            kept.lost();
        }
    }
}

/// How often the cause of a missing session is logged again when it changes.
const RENAMED_AFTER: Duration = Duration::from_secs(30);

/// One tick without a session: name the cause (again when it changed, at
/// most every [`RENAMED_AFTER`]), hold the lanes, hand rows over.
async fn down_step(
    ctx: &StreamContext,
    c: &Client,
    last_error: Option<&str>,
    named: &mut Option<(String, Instant)>,
) -> Result<(), tokio_postgres::Error> {
    let cause = diagnose_down(c, &ctx.parts.settings.slot.name, last_error).await?;
    let renamed = named.as_ref().is_none_or(|(n, at)| *n != cause && at.elapsed() >= RENAMED_AFTER);
    if renamed {
        tracing::warn!(slot = %ctx.parts.settings.slot.name, %cause, "no replication session streams: this relay's rows go by the outbox table until one does");
        ctx.parts.metrics.hold(&cause);
        for lane in &ctx.parts.destinations.states() {
            lane.hold(SpoolCause::StreamHeld(cause.clone()));
        }
        *named = Some((cause.clone(), Instant::now()));
    }
    hand_over(c, &handable(&ctx.parts.destinations.states()), &cause, &ctx.handed_until).await?;
    Ok(())
}

/// The destinations whose NEW rows may go by the table while the stream is
/// held or down ([`LaneState::may_hand_over`]); the others wait for the
/// stream, their cause named all the same.
fn handable<'a>(lanes: impl IntoIterator<Item = &'a Arc<LaneState>>) -> Vec<String> {
    lanes.into_iter().filter(|l| l.may_hand_over()).map(|l| l.name.to_string()).collect()
}

/// Why no session streams, in an operator's words: a hold the server shows,
/// the slot in use by another process, slot creation waiting on a
/// transaction, or else the last session's error.
async fn diagnose_down(c: &Client, slot: &str, last_error: Option<&str>) -> Result<String, tokio_postgres::Error> {
    if let Some(cause) = server_hold(c, slot).await? {
        return Ok(cause);
    }
    if let Some(r) = c
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'),
                    coalesce(a.backend_start::text, '?'), coalesce(a.wait_event, 'nothing')
               FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
              WHERE s.slot_name = $1 AND s.active_pid IS NOT NULL",
            &[&slot],
        )
        .await?
    {
        let (pid, app, addr, since, wait): (i32, String, String, String, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        return Ok(format!(
            "the slot {slot} is in use by pid {pid} ({app:?} from {addr}, since {since}, waiting on {wait}): another relay, or a walsender left by an earlier session (PostgreSQL ends one whose client is gone after wal_sender_timeout; a stopped process keeps the slot until it is ended: SELECT pg_terminate_backend({pid}))"
        ));
    }
    if let Some(r) = c
        .query_opt(
            "SELECT b.pid, b.xact_start::text FROM pg_stat_activity a
               JOIN LATERAL (SELECT pid, xact_start FROM pg_stat_activity
                              WHERE backend_xid IS NOT NULL AND pid <> a.pid ORDER BY xact_start LIMIT 1) b ON true
              WHERE a.backend_type = 'walsender' AND a.query ILIKE 'CREATE_REPLICATION_SLOT%' AND strpos(a.query, $1) > 0",
            &[&slot],
        )
        .await?
    {
        let (pid, since): (i32, Option<String>) = (r.get(0), r.get(1));
        return Ok(format!(
            "creating the slot {slot} waits for the transactions open when it began; the oldest is pid {pid}, open since {}",
            since.unwrap_or_else(|| "?".into())
        ));
    }
    Ok(match last_error {
        Some(e) => format!("no replication session: {e}"),
        None => "no replication session has started yet".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold is named only when the walsender's sent position is behind
    /// the probe and stands still: one reading WAL (moving), or past the
    /// probe (caught up, waiting for WAL), holds nothing.
    #[test]
    fn a_hold_needs_a_walsender_standing_behind_the_probe() {
        let mut last = None;
        assert!(!walsender_stuck(Some(100), 500, &mut last), "first reading: not yet shown to stand");
        last = Some((100, Instant::now() - STREAM_QUIET));
        assert!(walsender_stuck(Some(100), 500, &mut last), "behind and still for the quiet time");
        assert!(!walsender_stuck(Some(200), 500, &mut last), "moving: busy, not held");
        last = Some((600, Instant::now() - STREAM_QUIET));
        assert!(!walsender_stuck(Some(600), 500, &mut last), "past the probe: caught up");
        assert!(walsender_stuck(None, 500, &mut last), "no walsender reads the slot");
    }
}
