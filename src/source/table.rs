//! The table path: outbox rows read from the table rather than the slot.
//! A loop per destination with rows to claim (started when the table has
//! some, or while its lane spools; it ends once idle) claims due rows in id
//! order with
//! `FOR UPDATE SKIP LOCKED`, sends them through a lane (the same batching,
//! reconciliation and DEAD rules as the stream), marks every outcome in the
//! claiming transaction and commits. Retryable failures go back to the table
//! with `next_attempt_at` = now + `retry_base × 2^attempts` (capped at
//! `retry_max`), never to DEAD.
//!
//! It serves two sources:
//! - [`Claims::Poll`]: polling mode, every NEW row that is due.
//! - [`Claims::Spool`]: CDC mode, the rows a spooling lane (or `dead redrive`)
//!   handed to the table (`next_attempt_at` set). When a spooling lane's
//!   sends succeed (and, FIFO, its spool is empty), the lane streams again.
//!
//! Several relays may run this at once: `SKIP LOCKED` keeps them off each
//! other's rows. A FIFO destination is drained by one relay at a time (a
//! transaction-scoped advisory lock) so its groups stay in order, and a group
//! whose earliest row is not due holds its later rows back.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use crate::db;
use crate::db::settled::{self, Holder};
use crate::event::{OutboxEvent, OUTBOX_COLUMNS};
use crate::metrics::Metrics;
use crate::pipeline::assemble::{publish_claim, Parts};
use crate::pipeline::budget::{is_huge, Budget, Permit};
use crate::pipeline::destinations::{Destinations, Resolved};
use crate::pipeline::lane::{Flow, LaneState};
use crate::pipeline::route::UNKNOWN_DESTINATION_LABEL;
use crate::pipeline::settle::{record, Due, Outcome};
use crate::policy::spool::{may_stream_again, DrainRound, Resume};
use crate::publish::kind::Target;
use crate::source::claims::{sleep_or_stop, ClaimLoop, Next};

/// Which rows a table lane claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claims {
    /// Polling mode: NEW rows whose `next_attempt_at` is unset or past.
    Poll,
    /// CDC mode: NEW rows handed to the table (`next_attempt_at` set) and due.
    Spool,
}

pub struct TableLaneConfig {
    pub name: Arc<str>,
    pub target: Target,
    pub source: Claims,
    /// Rows claimed per transaction.
    pub claim_limit: usize,
    /// Sleep between claims when the last one was not full.
    pub poll_interval: Duration,
}

/// What one claim did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Round {
    /// Rows locked by the claim.
    pub claimed: usize,
    /// Rows handed to SQS (or found DEAD before sending).
    pub handled: usize,
    pub published: usize,
    pub deferred: usize,
    pub dead: usize,
    /// Bytes of the rows read (bodies and attributes).
    pub read_bytes: u64,
}

/// A connection that read this many bytes in one round is closed, not given
/// back to the pool: its read buffer grew to hold the rows and would stay
/// that large (tens of MiB a connection, with bodies through S3).
const KEEP_BELOW_BYTES: u64 = 8 << 20;

/// A table lane with nothing to claim, and no spooling lane to bring back,
/// ends after this long; it is started again when
/// rows wait ([`waiting_destinations`]).
pub const IDLE_END: Duration = Duration::from_secs(5);

/// Whether a destination's table lane must run whatever the table holds:
/// its stream lane spools, catches up or is held (the drain decides when it
/// streams again), or rows it deferred are on their way to the table.
pub fn lane_needed(state: Option<&LaneState>) -> bool {
    state.is_some_and(|s| s.is_spooling() || s.is_held() || s.deferred_unmarked() > 0)
}

/// Claim, send, mark, commit until `stop` turns true, or until the lane has
/// been idle for [`IDLE_END`], each round on a connection of the shared
/// `pool`. Database errors are logged and retried on a new connection;
/// nothing claimed is lost, since an aborted claim leaves its rows NEW.
pub async fn run_table_lane(
    cfg: TableLaneConfig,
    pool: db::pool::Pool,
    parts: Arc<Parts>,
    state: Option<Arc<LaneState>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut claims = ClaimLoop::new(cfg.poll_interval);
    // The outcome of the last round that sent anything: "sends succeed".
    let mut sends_ok = true;
    let mut idle_since: Option<std::time::Instant> = None;
    while !*stop.borrow() {
        let round = match pool.checkout(&mut stop).await {
            Some(c) => one_round(c, &cfg, &parts, state.as_deref(), &mut sends_ok).await,
            None => None,
        };
        let next = match round {
            None => Next::Failed,
            Some(round) => {
                if round.claimed > 0 || lane_needed(state.as_deref()) {
                    idle_since = None;
                } else if idle_since.get_or_insert_with(std::time::Instant::now).elapsed() >= IDLE_END {
                    return;
                }
                if round.claimed < cfg.claim_limit {
                    Next::Poll
                } else {
                    Next::Again
                }
            }
        };
        if claims.wait(next, &mut stop).await {
            return;
        }
    }
}

/// One round on `c`, then (a spool's drain) whether its lane may stream
/// again; `None`, logged, when the round failed. A connection that failed
/// is dropped, not given back to the pool.
async fn one_round(
    mut c: db::pool::Pooled,
    cfg: &TableLaneConfig,
    parts: &Parts,
    state: Option<&LaneState>,
    sends_ok: &mut bool,
) -> Option<Round> {
    let round = match claim_round(&mut c, cfg, parts).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(destination = %cfg.name, error = %db::describe(&e), "table path round failed; its rows stay NEW and are claimed again");
            db::pool::Pool::discard(c);
            return None;
        }
    };
    *sends_ok = sends_now_ok(&cfg.name, &round, *sends_ok);
    if let Some(state) = state {
        if let Err(e) = resume_streaming(state, cfg, &round, *sends_ok, &c).await {
            tracing::warn!(destination = %cfg.name, error = %e, "spool check failed");
            db::pool::Pool::discard(c);
            return Some(round);
        }
    }
    if round.read_bytes >= KEEP_BELOW_BYTES {
        db::pool::Pool::discard(c);
    }
    Some(round)
}

/// Whether sends succeed after `round` (a round that sent nothing but DEAD
/// rows says nothing); a change is logged.
fn sends_now_ok(name: &str, round: &Round, sends_ok: bool) -> bool {
    if round.handled == 0 || round.handled <= round.dead {
        return sends_ok;
    }
    let ok = round.deferred == 0;
    if ok != sends_ok {
        if ok {
            tracing::info!(destination = %name, published = round.published, "table path: sends succeed again");
        } else {
            tracing::warn!(destination = %name, deferred = round.deferred, "table path: sends fail; rows wait in the table with a backoff (retry_base doubling to retry_max)");
        }
    }
    ok
}

/// A spooling lane streams again when the spool policy says so after this
/// round ([`may_stream_again`]).
async fn resume_streaming(
    state: &LaneState,
    cfg: &TableLaneConfig,
    round: &Round,
    sends_ok: bool,
    c: &Client,
) -> Result<(), tokio_postgres::Error> {
    let resume = may_stream_again(DrainRound {
        held: state.is_held(),
        fifo: cfg.target.fifo,
        catching_up: state.flow() == Flow::CatchingUp,
        claimed: round.claimed,
        full: round.claimed >= cfg.claim_limit,
        published: round.published,
        sends_ok,
        deferred_unmarked: state.deferred_unmarked(),
    });
    match resume {
        _ if !state.is_spooling() => {}
        Resume::No => {}
        Resume::Now => state.stop_spooling(),
        Resume::CatchUp => state.catch_up(),
        Resume::IfSpoolEmpty => {
            if spool_is_empty(c, &cfg.name).await? {
                state.stop_spooling();
            }
        }
    }
    Ok(())
}

/// No NEW row of this destination waits in the table (due or not), rows
/// held until a later `deliver_at` aside: they keep no order with the stream.
pub async fn spool_is_empty(c: &Client, destination: &str) -> Result<bool, tokio_postgres::Error> {
    let sql = format!(
        "SELECT 1 FROM outbox WHERE destination = $1 AND {} AND NOT {} LIMIT 1",
        Holder::Table.sql(""),
        crate::policy::delay::HELD_SQL
    );
    Ok(c.query_opt(&sql, &[&destination]).await?.is_none())
}

/// The order a claim reads a destination's rows in. Any order does for a
/// standard queue; a FIFO queue's rows go in commit order: first those
/// whose commit position the stream recorded (rows it handed to the table,
/// [`crate::pipeline::settle`]), by it and their place in their transaction
/// (rows written back under new ids keep it); then the rest (rows the stream never
/// brought: polling), by id. Ids alone follow commits only until the
/// identity is reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimOrder {
    /// A standard queue: by id.
    Id,
    /// A FIFO queue's rows with a commit position, by it, their place in
    /// their transaction, then id.
    Committed,
    /// A FIFO queue's rows without one, by id.
    Unpositioned,
}

/// The claim locks rows and reads their sizes, not their bodies; the bodies
/// of the rows that fit in `claim_bytes` are read next ([`fetch_sql`]).
fn claim_sql(source: Claims, order: ClaimOrder, delays: bool) -> String {
    let fifo = order != ClaimOrder::Id;
    let mut sql = String::from(
        "SELECT id, octet_length(body)::bigint + coalesce(octet_length(attributes::text), 0)::bigint,
                next_attempt_at IS NULL OR next_attempt_at <= now(), group_key
           FROM outbox
          WHERE destination = $1 AND ",
    );
    sql += &settled::unsettled_sql("");
    // Rows held until a later deliver_at are not claimed, nor hold a group.
    sql += " AND ";
    sql += &crate::policy::delay::claimable_sql(delays);
    if source == Claims::Spool {
        sql += " AND ";
        sql += &Holder::Table.sql("");
    }
    if !fifo {
        // FIFO claims a window whether due or not, so a group whose earliest
        // row waits holds its later rows back.
        sql += " AND (next_attempt_at IS NULL OR next_attempt_at <= now())";
    }
    sql += &match order {
        ClaimOrder::Id => " ORDER BY id".to_string(),
        ClaimOrder::Committed => format!(" AND commit_lsn IS NOT NULL ORDER BY {}", settled::COMMIT_ORDER),
        ClaimOrder::Unpositioned => " AND commit_lsn IS NULL ORDER BY id".to_string(),
    };
    sql += " LIMIT $2 FOR UPDATE SKIP LOCKED";
    sql
}

/// Lock up to `claim_limit` of the destination's rows, in the order they
/// are to be sent ([`ClaimOrder`]).
async fn lock_rows(
    tx: &tokio_postgres::Transaction<'_>,
    cfg: &TableLaneConfig,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let (name, limit) = (&*cfg.name, cfg.claim_limit as i64);
    let delays = cfg.target.delays();
    if !cfg.target.fifo {
        return tx.query(&claim_sql(cfg.source, ClaimOrder::Id, delays), &[&name, &limit]).await;
    }
    let mut rows = tx.query(&claim_sql(cfg.source, ClaimOrder::Committed, delays), &[&name, &limit]).await?;
    let rest = limit - rows.len() as i64;
    if rest > 0 {
        rows.extend(tx.query(&claim_sql(cfg.source, ClaimOrder::Unpositioned, delays), &[&name, &rest]).await?);
    }
    Ok(rows)
}

/// The full rows of the chosen ids, in the order given (the claim's), and
/// the database's clock (microseconds), which the claim judged `deliver_at` by.
fn fetch_sql() -> String {
    format!(
        "SELECT {OUTBOX_COLUMNS}, (extract(epoch FROM now()) * 1000000)::bigint
           FROM unnest($1::bigint[]) WITH ORDINALITY AS k(id, n) JOIN outbox USING (id) ORDER BY k.n"
    )
}

/// A locked row as the claim reads it: id, size (body and attributes),
/// due now, group.
type Locked = (i64, i64, bool, Option<String>);

/// What a round takes of its locked rows: their ids, their bytes, and the
/// room its huge rows hold in the relay's budget (held until they are
/// settled).
#[derive(Default)]
struct Chosen {
    ids: Vec<i64>,
    bytes: u64,
    room: Vec<Permit>,
}

/// Of the locked rows in claim order: the due ones to send now, while their
/// sizes fit in `claim_bytes` (the first always does). On a FIFO queue a
/// group whose earlier row is not due, or did not fit, holds its later rows
/// back. A huge row (through S3) takes its share of the relay's `budget`,
/// as the stream's do, or waits for a later round (on a FIFO queue, with
/// every row after it: they keep their order). The table path never waits
/// for room: a stream lane catching up behind this drain may hold the
/// budget.
fn choose(locked: &[Locked], fifo: bool, claim_bytes: u64, budget: &Budget) -> Chosen {
    let mut chosen = Chosen::default();
    // Rows that fit so far, a huge one without room among them.
    let (mut fitted, mut used) = (0usize, 0u64);
    let mut waiting_groups: HashSet<Option<String>> = HashSet::new();
    let mut full = false;
    for (id, size, due, group) in locked {
        let size = (*size).max(0) as u64;
        full = full || (fitted > 0 && used + size > claim_bytes);
        if fifo {
            if !due || full || waiting_groups.contains(group) {
                waiting_groups.insert(group.clone());
                continue;
            }
        } else if !due || full {
            continue;
        }
        fitted += 1;
        used += size;
        if is_huge(size as usize) {
            match budget.try_acquire(size as usize) {
                Some(p) => chosen.room.push(p),
                None if fifo => break,
                None => continue,
            }
        }
        chosen.bytes += size;
        chosen.ids.push(*id);
    }
    chosen
}

/// One claim: lock due rows, send them, mark every outcome, commit.
pub async fn claim_round(
    client: &mut Client,
    cfg: &TableLaneConfig,
    parts: &Parts,
) -> Result<Round, tokio_postgres::Error> {
    let fifo = cfg.target.fifo;
    let tx = client.transaction().await?;
    if fifo {
        let key = format!("outbox_relay:{}", cfg.name);
        let got: bool =
            tx.query_one("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", &[&key]).await?.get(0);
        if !got {
            tx.commit().await?;
            return Ok(Round::default());
        }
    }
    let locked = lock_rows(&tx, cfg).await?;
    let mut round = Round { claimed: locked.len(), ..Default::default() };
    let locked: Vec<Locked> = locked.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    // Its room is held until the round's rows are settled.
    let chosen = choose(&locked, fifo, parts.settings.memory.table_claim_bytes(), &parts.budget);
    let (ids, _room) = (chosen.ids, chosen.room);
    round.read_bytes = chosen.bytes;
    let rows = if ids.is_empty() { Vec::new() } else { tx.query(&fetch_sql(), &[&ids]).await? };
    // The database's clock, which the claim judged `deliver_at` by.
    let now_us: i64 = rows.first().map_or(0, |r| r.get(crate::event::OUTBOX_COLUMN_COUNT));
    // Each row is dropped once its event is made: a body is held once, not
    // twice (the row's bytes and the event's), while the claim is sent.
    let events: Vec<Arc<OutboxEvent>> = rows.into_iter().map(|r| Arc::new(OutboxEvent::from_row(&r))).collect();
    round.handled = events.len();
    let target = (&cfg.name, &cfg.target);
    let settled = publish_claim(&tx, parts, target, events, now_us).await?;
    for s in &settled {
        match s.outcome {
            Outcome::Published => round.published += 1,
            Outcome::Dead(_) => round.dead += 1,
            // Held (not due by the clocks' reckoning): not a send.
            Outcome::Deferred(_, Due::Held) => round.handled -= 1,
            Outcome::Deferred(..) => round.deferred += 1,
        }
    }
    tx.commit().await?;
    record(&parts.metrics, &settled);
    Ok(round)
}

/// The destinations that have NEW rows, found with a loose index scan over
/// `outbox_new_by_destination` (one probe per destination, not per row).
const NEW_DESTINATIONS_SQL: &str = "
WITH RECURSIVE d AS (
    (SELECT destination FROM outbox WHERE status = 'NEW' ORDER BY destination LIMIT 1)
    UNION ALL
    SELECT (SELECT o.destination FROM outbox o
             WHERE o.status = 'NEW' AND o.destination > d.destination
             ORDER BY o.destination LIMIT 1)
      FROM d WHERE d.destination IS NOT NULL
)
SELECT destination FROM d WHERE destination IS NOT NULL";

/// The destinations whose rows a lane of `source` could claim now: NEW
/// (handed to the table, for the spool), due, and not held past what a send
/// may delay; found with a loose index scan (one probe per destination).
fn waiting_destinations_sql(source: Claims) -> String {
    let mut cond = format!(
        "status = 'NEW' AND (next_attempt_at IS NULL OR next_attempt_at <= now()) AND {}",
        crate::policy::delay::claimable_sql(true)
    );
    if source == Claims::Spool {
        cond += " AND ";
        cond += &Holder::Table.sql("");
    }
    format!(
        "WITH RECURSIVE d AS (
            (SELECT destination FROM outbox WHERE {cond} ORDER BY destination LIMIT 1)
            UNION ALL
            SELECT (SELECT o.destination FROM outbox o
                     WHERE {cond} AND o.destination > d.destination
                     ORDER BY o.destination LIMIT 1)
              FROM d WHERE d.destination IS NOT NULL
        )
        SELECT destination FROM d WHERE destination IS NOT NULL"
    )
}

/// [`waiting_destinations_sql`]'s destinations.
pub async fn waiting_destinations(c: &Client, source: Claims) -> Result<HashSet<String>, tokio_postgres::Error> {
    Ok(c.query(&waiting_destinations_sql(source), &[]).await?.iter().map(|r| r.get(0)).collect())
}

/// Rows for destinations this relay does not know reach no lane of the table
/// path: with a queue-URL template each is looked up (found, its table lane
/// starts; no such queue, DEAD `queue_not_found`; the lookup failed, they
/// wait); without one they are DEAD (`unknown_destination`), as the stream
/// does. In CDC mode only rows handed to the table are this sweeper's (the
/// stream judges the rest itself). Runs every few seconds until `stop`.
pub async fn run_unknown_destination_sweeper(
    db: db::Db,
    parts: Arc<Parts>,
    source: Claims,
    mut stop: watch::Receiver<bool>,
) {
    let mut kept = db::Kept::new(db);
    loop {
        if sleep_or_stop(Duration::from_secs(5), &mut stop).await {
            return;
        }
        let Some(c) = kept.get().await else { continue };
        if let Err(e) = sweep_unknown_destinations(c, &parts.destinations, source, &parts.metrics).await {
            tracing::warn!(error = %e, "unknown-destination sweep failed; retrying");
            kept.lost();
        }
    }
}

/// One sweep; returns the rows marked DEAD.
pub async fn sweep_unknown_destinations(
    c: &Client,
    destinations: &Destinations,
    source: Claims,
    metrics: &Metrics,
) -> Result<u64, tokio_postgres::Error> {
    let mut total = 0;
    for row in c.query(NEW_DESTINATIONS_SQL, &[]).await? {
        let destination: String = row.get(0);
        if destinations.get(&destination).is_some() {
            continue;
        }
        let reason = match destinations.resolve(&destination).await {
            Resolved::Ready(_) => continue,
            Resolved::Unavailable(why) => {
                tracing::warn!(destination = %destination, error = %why, "destination not looked up; its rows wait");
                continue;
            }
            Resolved::Dead(reason) => reason,
        };
        let error = reason.last_error();
        let n = c
            .execute(
                &format!(
                    "UPDATE outbox SET status = 'DEAD', last_error = $2, attempts = attempts + 1
                      WHERE destination = $1 AND {}",
                    match source {
                        Claims::Spool => Holder::Table.sql(""),
                        Claims::Poll => settled::unsettled_sql(""),
                    }
                ),
                &[&destination, &error],
            )
            .await?;
        if n > 0 {
            tracing::warn!(destination = %destination, rows = n, reason = reason.code.as_str(), "outbox rows marked DEAD");
            metrics.events_dead.with_label_values(&[UNKNOWN_DESTINATION_LABEL, reason.code.as_str()]).inc_by(n);
            total += n;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, size: i64) -> Locked {
        (id, size, true, None)
    }

    #[test]
    fn a_huge_row_waits_for_room_in_the_relays_budget() {
        let (claim, budget) = (64 << 20, Budget::new(100, 64 << 20));
        let rows = [row(1, 25 << 20), row(2, 4_000), row(3, 25 << 20), row(4, 4_000)];
        // The first huge row takes 50 MB of the 64: the second waits; a
        // standard queue sends the small rows beside it.
        let chosen = choose(&rows, false, claim, &budget);
        assert_eq!(chosen.ids, vec![1, 2, 4]);
        assert_eq!(chosen.bytes, (25 << 20) + 8_000);
        assert_eq!(chosen.room.len(), 1);
        // A FIFO queue's rows after it wait with it.
        assert_eq!(choose(&rows[1..], true, claim, &budget).ids, vec![2]);
        // The stream holding the budget, the table path takes no huge row.
        drop(chosen);
        let stream = budget.try_acquire(30 << 20).expect("room");
        assert_eq!(choose(&rows[..2], false, claim, &budget).ids, vec![2]);
        drop(stream);
        assert_eq!(choose(&rows[..2], false, claim, &budget).ids, vec![1, 2]);
    }

    #[test]
    fn a_claim_takes_what_fits_and_a_fifo_group_keeps_its_order() {
        let budget = Budget::new(100, 64 << 20);
        let g = |id: i64, size: i64, due: bool, group: &str| (id, size, due, Some(group.to_string()));
        // The first row always goes; then rows while they fit.
        let rows = [row(1, 900), row(2, 200), row(3, 50)];
        assert_eq!(choose(&rows, false, 1_000, &budget).ids, vec![1]);
        assert_eq!(choose(&rows[1..], false, 1_000, &budget).ids, vec![2, 3]);
        // A group whose row is not due holds its later rows back; others go.
        let rows = [g(1, 10, false, "a"), g(2, 10, true, "b"), g(3, 10, true, "a"), g(4, 10, true, "b")];
        assert_eq!(choose(&rows, true, 1_000, &budget).ids, vec![2, 4]);
        // A standard queue sends every due row.
        assert_eq!(choose(&rows, false, 1_000, &budget).ids, vec![2, 3, 4]);
    }
}
