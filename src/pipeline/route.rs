//! Routing: each event is judged for its destination's queue (validated, or
//! DEAD with its reason) and handed to its lane, to the table when the lane
//! spools, or straight to the settler when DEAD. [`judge_for`] is the one rule,
//! used by the stream's [`Router`] and by the table path alike.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_postgres::Client;
use tracing::Instrument;

use crate::clock::now_unix_us;
use crate::db::settled::{self, Replayed};
use crate::event::{MappedRow, OutboxEvent, PublishedColumn, TableNow};
use crate::pipeline::budget::{Budget, Permit};
use crate::pipeline::destinations::{Destination, Resolved};
use crate::pipeline::lane::{run_lane, Finished, Flow, LaneConfig, LaneItem, Streamed, Wiring};
use crate::pipeline::parts::Parts;
use crate::pipeline::settle::{seq_param, Due, Outcome, Settlement};
use crate::pipeline::watermark::{TxnSeq, Watermark};
use crate::policy::dead::{DeadCode, DeadReason};
use crate::policy::delay::Timing;
use crate::publish::entry::Entry;
use crate::publish::kind::Target;

/// The metric label of events whose destination is not configured.
pub const UNKNOWN_DESTINATION_LABEL: &str = "unknown";

/// Why routing stopped: the database (replay filter) or the stage behind it.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("database: {}", crate::db::describe(.0))]
    Db(tokio_postgres::Error),
    #[error("the {0} stopped")]
    Stopped(&'static str),
    /// The source broke the order of a stream (begin, rows, commit).
    #[error("stream out of order: {0}")]
    Order(&'static str),
}

impl From<tokio_postgres::Error> for RouteError {
    fn from(e: tokio_postgres::Error) -> Self {
        RouteError::Db(e)
    }
}

/// What becomes of one event now.
#[derive(Debug)]
pub enum Judged {
    /// Into its lane, to be sent.
    Send(Entry),
    /// Not due yet and not deliverable with `DelaySeconds`: into the table
    /// until it is ([`crate::policy::delay`]); the text says why.
    Hold(&'static str),
    Dead(DeadReason),
}

impl Judged {
    /// The settlement of an event that is not sent now (`None`: send it).
    pub fn unsent(self) -> Result<Entry, Outcome> {
        match self {
            Judged::Send(entry) => Ok(entry),
            Judged::Hold(why) => Err(Outcome::Deferred(why.into(), Due::Held)),
            Judged::Dead(reason) => Err(Outcome::Dead(reason)),
        }
    }
}

/// The one rule for an event bound for `target`, judged at `now_us`
/// (microseconds since the Unix epoch): validated and timed, held, or DEAD.
pub fn judge_for(target: &Target, ev: &Arc<OutboxEvent>, now_us: i64) -> Judged {
    let delays = target.delays();
    let timing = match crate::policy::delay::timing(ev.deliver_at, now_us, delays) {
        Ok(t) => t,
        Err(reason) => return Judged::Dead(reason),
    };
    match (timing, target.prepare(Arc::clone(ev))) {
        (_, Err(reason)) => Judged::Dead(reason),
        (Timing::Hold, Ok(_)) => Judged::Hold(target.rules().held(target)),
        (Timing::Now, Ok(entry)) => Judged::Send(entry),
        (Timing::Delay(s), Ok(entry)) => Judged::Send(Entry { delay_seconds: Some(s), ..entry }),
    }
}

/// Of replayed events, those settled by an earlier run ([`settled::replayed`]):
/// the row (same id and event id) is DEAD, PUBLISHED (kept) or handed to the
/// table, or it is gone and a run of ids the settlement recorded when it
/// deleted rows proves it published ([`settled::PROVEN_BY_RUN`]). A row gone
/// without such a run was deleted by another transaction (its own:
/// transient; or a later one) and is sent again: nothing says it was
/// published. Rows in the table path's care that the stream meets again
/// get the chunk's commit position ([`settled::position_replayed`]).
async fn replayed_settled(sql: &Client, events: &[OutboxEvent]) -> Result<HashSet<i64>, RouteError> {
    // A mapped table's rows are not in the relay's table: nothing there can
    // prove them settled (see [`mapped_published`]).
    let event_of: HashMap<i64, &OutboxEvent> = events.iter().filter_map(|e| Some((e.row_id()?, e))).collect();
    let ids: Vec<i64> = event_of.keys().copied().collect();
    // One transaction's chunk: one commit.
    let commit = event_of.values().next().and_then(|e| e.commit()).map(|c| c.lsn);
    let (mut runs, mut marked, mut unpositioned) = (Vec::new(), HashSet::new(), Vec::new());
    for found in settled::replayed(sql, &ids, commit).await? {
        match found {
            Replayed::Listed { lo, hi, event_ids } => {
                let listed: HashSet<&str> = event_ids.iter().map(String::as_str).collect();
                marked.extend(
                    event_of
                        .iter()
                        .filter(|(id, e)| (lo..=hi).contains(*id) && listed.contains(e.event_id.as_str()))
                        .map(|(id, _)| *id),
                );
            }
            Replayed::Run { lo, hi } => runs.push((lo, hi)),
            Replayed::Row { id, event_id, unpositioned: u } => {
                let Some(ev) = event_of.get(&id).filter(|e| e.event_id == event_id) else { continue };
                marked.insert(id);
                if u {
                    unpositioned.push((id, ev.event_id.as_str(), seq_param(ev)));
                }
            }
        }
    }
    if let (false, Some(at)) = (unpositioned.is_empty(), commit) {
        settled::position_replayed(sql, &unpositioned, at).await?;
    }
    Ok(settled::covered(&ids, runs, marked))
}

/// Of a replayed chunk's mapped rows, the indexes of those whose table says
/// they were published (their published column is set: by an earlier run,
/// or by the claim at the session's start). A mapped table without such a
/// column cannot say: its rows are sent again (at least once).
async fn mapped_published(sql: &Client, events: &[OutboxEvent]) -> Result<HashSet<usize>, RouteError> {
    let mut by_table: HashMap<&PublishedColumn, Vec<(usize, &str)>> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        if let Some(MappedRow { key, published: Some(p), .. }) = e.mapped() {
            by_table.entry(p.as_ref()).or_default().push((i, key.as_str()));
        }
    }
    let mut done = HashSet::new();
    for (table, rows) in by_table {
        // A table dropped since: nothing says its rows were published.
        let TableNow::Ready(name) = table.table_now(sql).await? else { continue };
        let keys: Vec<&str> = rows.iter().map(|(_, k)| *k).collect();
        let published: HashSet<String> =
            sql.query(&table.published_sql(&name), &[&keys]).await?.iter().map(|r| r.get(0)).collect();
        done.extend(rows.iter().filter(|(_, k)| published.contains(*k)).map(|(i, _)| *i));
    }
    Ok(done)
}

/// For each event, whether it is the last of `events` bound for its destination.
fn chunk_ends(events: &[OutboxEvent]) -> Vec<bool> {
    let mut seen = HashSet::new();
    let mut ends: Vec<bool> = events.iter().rev().map(|e| seen.insert(e.destination.as_str())).collect();
    ends.reverse();
    ends
}

/// Routes events to their lanes, or straight to the settler as DEAD. A
/// destination met for the first time gets its lane here, once it is
/// looked up ([`crate::pipeline::destinations::Destinations::resolve`]); a lane idle for
/// `lane_idle_timeout` with everything it was given finished is closed, and
/// opened again by its destination's next event.
pub struct Router {
    parts: Arc<Parts>,
    /// Where each destination with a lane (or a lookup) this session has its
    /// events go.
    lanes: HashMap<String, Route>,
    /// Every lane's task, started here or before routing began: the
    /// session's end waits on them once the router is gone.
    lane_tasks: Arc<Mutex<JoinSet<()>>>,
    settle: mpsc::UnboundedSender<Settlement>,
    budget: Budget,
    watermark: Arc<Mutex<Watermark>>,
    /// How long a lane stays idle before it is closed, and when lanes were
    /// last looked over for that.
    idle_end: Duration,
    swept: Instant,
}

/// A destination's lane, open for this session.
pub struct Open {
    pub destination: Arc<Destination>,
    pub tx: mpsc::Sender<LaneItem>,
    drained: Arc<Drained>,
}

/// Where a destination's events go this session.
pub enum Path {
    /// Its lane.
    Lane(Open),
    /// The task looking it up (a queue-URL template), which hands them on
    /// in order once it knows the queue ([`look_up_then_hand_on`]): the
    /// stream does not wait on a lookup.
    Lookup(mpsc::Sender<Routed>),
}

/// A destination's path this session, and how far along it its events are.
struct Route {
    path: Path,
    /// Events routed to it, and when the last one was.
    routed: u64,
    last: Instant,
    drained: Arc<Drained>,
}

/// How far a path's events are through: handed on by whoever feeds its lane
/// (the router, or the task that looked its destination up), and finished by
/// the lane.
#[derive(Default)]
struct Drained {
    /// Events dealt with: handed to the lane, or settled without it.
    taken: AtomicU64,
    /// Of those, handed to the lane.
    forwarded: AtomicU64,
    lane: Arc<Finished>,
}

impl Drained {
    /// Every one of `routed` events is settled, or finished by an idle lane:
    /// closing the path now loses and reorders nothing.
    fn done(&self, routed: u64) -> bool {
        self.taken.load(Ordering::Acquire) == routed && self.lane.through() == self.forwarded.load(Ordering::Acquire)
    }

    fn took(&self, forwarded: bool) {
        if forwarded {
            self.forwarded.fetch_add(1, Ordering::Release);
        }
        self.taken.fetch_add(1, Ordering::Release);
    }
}

/// How often the router looks for idle lanes.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// An event routed to a destination, holding its place in the stream and
/// its share of the memory budget.
pub struct Routed {
    ev: Arc<OutboxEvent>,
    seq: Option<TxnSeq>,
    permit: Permit,
    /// The last of its chunk for its lane.
    chunk_end: bool,
}

/// What routing hands settlements and counts to.
#[derive(Clone)]
struct Outlet {
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// `destination`'s lane for this session: its input, and its task.
fn lane_for(
    parts: &Parts,
    settle: &mpsc::UnboundedSender<Settlement>,
    destination: Arc<Destination>,
    drained: Arc<Drained>,
) -> (Open, impl std::future::Future<Output = ()> + Send + 'static) {
    let (tx, rx) = mpsc::channel(LANE_CHANNEL);
    let wiring =
        Wiring { publisher: Arc::clone(&parts.publisher), settle: settle.clone(), metrics: Arc::clone(&parts.metrics) };
    let stream = Streamed { state: Arc::clone(&destination.state), finished: Some(Arc::clone(&drained.lane)) };
    let lane = run_lane(
        LaneConfig::streaming(&destination.name, &destination.target, &parts.settings.lanes),
        wiring,
        rx,
        Some(stream),
    );
    (Open { destination, tx, drained }, lane)
}

impl Router {
    pub fn new(
        parts: Arc<Parts>,
        lane_tasks: Arc<Mutex<JoinSet<()>>>,
        settle: mpsc::UnboundedSender<Settlement>,
        watermark: Arc<Mutex<Watermark>>,
    ) -> Router {
        Router {
            budget: parts.budget.clone(),
            idle_end: parts.settings.lanes.idle_timeout,
            parts,
            lanes: HashMap::new(),
            lane_tasks,
            settle,
            watermark,
            swept: Instant::now(),
        }
    }

    /// Start `destination`'s lane for this session.
    pub fn open(&mut self, destination: Arc<Destination>) {
        let name = destination.name.to_string();
        let (open, lane) = lane_for(&self.parts, &self.settle, destination, Arc::default());
        self.lane_tasks.lock().unwrap().spawn(lane);
        let drained = Arc::clone(&open.drained);
        self.insert(name, Path::Lane(open), drained);
    }

    /// Start looking `name` up, its events waiting for the answer in order.
    fn look_up(&mut self, name: &str) {
        let (tx, rx) = mpsc::channel(LANE_CHANNEL);
        let outlet = Outlet { settle: self.settle.clone(), metrics: Arc::clone(&self.parts.metrics) };
        let drained = Arc::new(Drained::default());
        let task = look_up_then_hand_on(name.to_string(), Arc::clone(&self.parts), outlet, rx, Arc::clone(&drained));
        self.lane_tasks.lock().unwrap().spawn(task);
        self.insert(name.to_string(), Path::Lookup(tx), drained);
    }

    fn insert(&mut self, name: String, path: Path, drained: Arc<Drained>) {
        self.lanes.insert(name, Route { path, routed: 0, last: Instant::now(), drained });
        self.parts.metrics.stream_lanes.set(self.lanes.len() as i64);
    }

    /// Close the lanes (and lookups) idle for `idle_end` that have finished
    /// everything routed to them, at most once per [`SWEEP_EVERY`]: a
    /// thousand destinations seen once do not keep a thousand lanes.
    pub fn retire_idle(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.swept) < SWEEP_EVERY.min(self.idle_end) {
            return;
        }
        self.swept = now;
        let idle_end = self.idle_end;
        let before = self.lanes.len();
        self.lanes.retain(|_, r| now.duration_since(r.last) < idle_end || !r.drained.done(r.routed));
        if self.lanes.len() < before {
            tracing::debug!(closed = before - self.lanes.len(), open = self.lanes.len(), "idle lanes closed");
            self.parts.metrics.stream_lanes.set(self.lanes.len() as i64);
        }
        // Reap the tasks of lanes that ended.
        let mut tasks = self.lane_tasks.lock().unwrap();
        while tasks.try_join_next().is_some() {}
    }

    /// Dispatch a chunk of one transaction's events. `replayed`: the chunk was
    /// committed before this session started, so rows already settled by an
    /// earlier run are filtered out first (one indexed query).
    pub async fn dispatch(
        &mut self,
        sql: &Client,
        seq: TxnSeq,
        replayed: bool,
        events: Vec<OutboxEvent>,
    ) -> Result<(), RouteError> {
        if events.is_empty() {
            return Ok(());
        }
        let span = tracing::info_span!("outbox_relay.route", events = events.len(), replayed);
        self.dispatch_chunk(sql, seq, replayed, events).instrument(span).await
    }

    /// [`Self::dispatch`] of a chunk that is not empty.
    async fn dispatch_chunk(
        &mut self,
        sql: &Client,
        seq: TxnSeq,
        replayed: bool,
        mut events: Vec<OutboxEvent>,
    ) -> Result<(), RouteError> {
        if replayed {
            let done = replayed_settled(sql, &events).await?;
            let mapped_done = mapped_published(sql, &events).await?;
            if !done.is_empty() || !mapped_done.is_empty() {
                self.parts.metrics.replayed_filtered.inc_by((done.len() + mapped_done.len()) as u64);
                let mut i = 0;
                events.retain(|e| {
                    let keep = match e.row_id() {
                        None => !mapped_done.contains(&i),
                        Some(id) => !done.contains(&id),
                    };
                    i += 1;
                    keep
                });
            }
        }
        let ends = chunk_ends(&events);
        for (ev, chunk_end) in events.into_iter().zip(ends) {
            self.route(Some(seq), ev, chunk_end).await?;
        }
        Ok(())
    }

    /// Where `name`'s next event goes: its lane (opened now if it is known),
    /// the task looking it up, or nowhere (no template: DEAD).
    fn path(&mut self, name: &str) -> Result<&Path, Outcome> {
        if !self.lanes.contains_key(name) {
            match self.parts.destinations.get(name) {
                Some(d) => self.open(d),
                None if self.parts.destinations.templated() => self.look_up(name),
                None => return Err(Outcome::Dead(DeadReason::unknown_destination(name))),
            }
        }
        let route = self.lanes.get_mut(name).expect("opened above");
        route.routed += 1;
        route.last = Instant::now();
        Ok(&route.path)
    }

    /// Route one event; `chunk_end`: the last of its chunk for its lane.
    async fn route(&mut self, seq: Option<TxnSeq>, ev: OutboxEvent, chunk_end: bool) -> Result<(), RouteError> {
        let permit = self.budget.acquire(ev.size()).await;
        if let Some(seq) = seq {
            self.watermark.lock().unwrap().add(seq, 1);
        }
        let routed = Routed { ev: Arc::new(ev), seq, permit, chunk_end };
        let outlet = Outlet { settle: self.settle.clone(), metrics: Arc::clone(&self.parts.metrics) };
        if let Some(why) = routed.ev.mapped().and_then(|m| m.unreadable.as_deref()) {
            let dead = Outcome::Dead(DeadReason::new(DeadCode::UnreadableRow, why));
            return unrouted(routed, dead, &outlet);
        }
        match self.path(&routed.ev.destination) {
            Ok(Path::Lane(open)) => hand_on(open, routed, &outlet).await,
            Ok(Path::Lookup(tx)) => tx.send(routed).await.map_err(|_| RouteError::Stopped("lookup")),
            Err(outcome) => unrouted(routed, outcome, &outlet),
        }
    }
}

/// Hand `r` to `open`'s lane, judged for its queue: sent through the lane,
/// straight to the table (a standard queue's lane spools), or settled now
/// (held, DEAD).
async fn hand_on(open: &Open, r: Routed, outlet: &Outlet) -> Result<(), RouteError> {
    let d = &open.destination;
    let (outcome, unmarked) = match judge_for(&d.target, &r.ev, now_unix_us()).unsent() {
        // A spooling lane's new events go straight to the table; a FIFO
        // lane's go through the lane, which keeps those of a group with an
        // entry in flight until it is settled.
        Ok(_) if d.state.flow() == Flow::Spooling && !d.state.fifo => {
            (Outcome::Deferred(d.state.deferral("spooled"), Due::Now), Some(d.state.deferring()))
        }
        Ok(entry) => {
            outlet.metrics.in_flight_events.with_label_values(&[&r.ev.destination]).inc();
            let item = LaneItem::new(entry, r.seq, Some(r.permit)).ending_chunk(r.chunk_end);
            open.tx.send(item).await.map_err(|_| RouteError::Stopped("lane"))?;
            open.drained.took(true);
            return Ok(());
        }
        Err(outcome) => (outcome, None),
    };
    outlet.metrics.in_flight_events.with_label_values(&[&r.ev.destination]).inc();
    let destination = Arc::from(r.ev.destination.as_str());
    let settlement = Settlement::new(r.ev, r.seq, destination, outcome).holding(Some(r.permit), unmarked);
    outlet.settle.send(settlement).map_err(|_| RouteError::Stopped("settler"))?;
    open.drained.took(false);
    Ok(())
}

/// Settle `r`, which reaches no lane: DEAD, or back to the table while its
/// destination cannot be looked up.
fn unrouted(r: Routed, outcome: Outcome, outlet: &Outlet) -> Result<(), RouteError> {
    outlet.metrics.in_flight_events.with_label_values(&[UNKNOWN_DESTINATION_LABEL]).inc();
    let settlement =
        Settlement::new(r.ev, r.seq, Arc::from(UNKNOWN_DESTINATION_LABEL), outcome).holding(Some(r.permit), None);
    outlet.settle.send(settlement).map_err(|_| RouteError::Stopped("settler"))
}

/// A destination met for the first time: look it up (its events waiting in
/// `rx`, in order), then run its lane and hand them on. While it cannot be
/// found its events are settled (DEAD: no such queue; to the table with a
/// backoff: the lookup failed), each looking it up again.
async fn look_up_then_hand_on(
    name: String,
    parts: Arc<Parts>,
    outlet: Outlet,
    mut rx: mpsc::Receiver<Routed>,
    drained: Arc<Drained>,
) {
    while let Some(r) = rx.recv().await {
        let d = match parts.destinations.resolve(&name).await {
            Resolved::Ready(d) => d,
            Resolved::Dead(reason) => {
                let _ = unrouted(r, Outcome::Dead(reason), &outlet);
                drained.took(false);
                continue;
            }
            Resolved::Unavailable(why) => {
                let _ = unrouted(r, Outcome::Deferred(why, Due::Backoff), &outlet);
                drained.took(false);
                continue;
            }
        };
        let (open, lane) = lane_for(&parts, &outlet.settle, d, drained);
        let feed = async move {
            let mut next = Some(r);
            while let Some(r) = next {
                if hand_on(&open, r, &outlet).await.is_err() {
                    return;
                }
                next = rx.recv().await;
            }
        };
        tokio::join!(lane, feed);
        return;
    }
}

/// Items a lane's channel holds (each holds its share of the budget).
pub const LANE_CHANNEL: usize = 4_096;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, FileConfig, Overrides};
    use crate::metrics::Metrics;
    use crate::pipeline::destinations::Destinations;
    use crate::pipeline::settings::Settings;
    use crate::publish::memory::MemoryPublisher;
    use crate::publish::template::AddressTemplate;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const FIFO: &str = "http://memory.invalid/r1/orders.fifo";

    /// A router over the in-memory publisher: `orders.fifo` configured, any
    /// other name looked up with a template; its settlements come out of the
    /// receiver; lanes idle for 100 ms are closed.
    fn router(p: &MemoryPublisher) -> (Router, mpsc::UnboundedReceiver<Settlement>) {
        p.add_queue(FIFO, true, 262_144);
        p.add_queue("http://memory.invalid/r1/tenant-1", false, 262_144);
        let keys = [("database_url", "postgres://relay@localhost/db"), ("lane_idle_timeout", "100ms")];
        let file = FileConfig::of(&keys, &[("orders.fifo", FIFO)]).unwrap();
        let config = Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap();
        let metrics = Metrics::new();
        let template = AddressTemplate::new("http://memory.invalid/{region}/{destination}", "r1").unwrap();
        let configured = BTreeMap::from([("orders.fifo".to_string(), Target::queue(FIFO, true, 262_144))]);
        let publisher: Arc<dyn crate::publish::Publisher> = Arc::new(p.clone());
        let destinations = Destinations::new(
            configured,
            Some(template),
            Box::new(|_, q| q),
            Arc::clone(&publisher),
            Arc::clone(&metrics),
        );
        let parts = Arc::new(Parts::new(
            Settings::of(&config, crate::config::Mode::Cdc, Vec::new()),
            destinations,
            publisher,
            metrics,
        ));
        let (settle, rx) = mpsc::unbounded_channel();
        (Router::new(parts, Arc::default(), settle, Arc::default()), rx)
    }

    fn event(id: i64, destination: &str) -> OutboxEvent {
        OutboxEvent { group_key: Some("g".into()), ..OutboxEvent::for_test(id, destination, &format!("b{id}")) }
    }

    /// The next `n` settlements, all published.
    async fn published(rx: &mut mpsc::UnboundedReceiver<Settlement>, n: usize) {
        for _ in 0..n {
            let s = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("settled").unwrap();
            assert!(matches!(s.outcome, Outcome::Published), "{:?}", s.outcome);
        }
    }

    /// Retire idle lanes until `name`'s is closed and its task has ended.
    async fn closed_within(router: &mut Router, name: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            router.swept = Instant::now() - SWEEP_EVERY;
            router.retire_idle();
            if !router.lanes.contains_key(name) && router.lane_tasks.lock().unwrap().is_empty() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[tokio::test]
    async fn an_idle_lane_is_closed_and_opened_again_behind_what_it_sent() {
        let p = MemoryPublisher::new();
        let (mut router, mut rx) = router(&p);
        for id in 1..=3 {
            router.route(None, event(id, "orders.fifo"), id == 3).await.unwrap();
        }
        published(&mut rx, 3).await;
        assert!(closed_within(&mut router, "orders.fifo", Duration::from_secs(5)).await);
        assert_eq!(router.parts.metrics.stream_lanes.get(), 0);
        router.route(None, event(4, "orders.fifo"), true).await.unwrap();
        published(&mut rx, 1).await;
        let ids: Vec<i64> = p.sent(FIFO).iter().map(|s| s.outbox_id.unwrap()).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        assert_eq!(router.parts.metrics.stream_lanes.get(), 1);
    }

    #[tokio::test]
    async fn a_lane_with_an_entry_unsettled_stays_open_however_long_it_takes() {
        let p = MemoryPublisher::new();
        let (mut router, mut rx) = router(&p);
        p.close_gate();
        router.route(None, event(1, "orders.fifo"), true).await.unwrap();
        assert!(!closed_within(&mut router, "orders.fifo", Duration::from_millis(400)).await);
        p.open_gate();
        published(&mut rx, 1).await;
        assert!(closed_within(&mut router, "orders.fifo", Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn a_looked_up_destinations_lane_is_closed_too_and_reopened_without_a_lookup() {
        let p = MemoryPublisher::new();
        let (mut router, mut rx) = router(&p);
        router.route(None, event(1, "tenant-1"), true).await.unwrap();
        // Its lookup's verdict (no queue) settles without a lane.
        router.route(None, event(2, "tenant-2"), true).await.unwrap();
        for _ in 0..2 {
            let s = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
            match s.id().unwrap() {
                1 => assert!(matches!(s.outcome, Outcome::Published)),
                _ => assert!(matches!(s.outcome, Outcome::Dead(_))),
            }
        }
        assert!(closed_within(&mut router, "tenant-1", Duration::from_secs(5)).await);
        assert!(router.lanes.is_empty(), "the failed lookup's path is closed as well");
        router.route(None, event(3, "tenant-1"), true).await.unwrap();
        assert!(matches!(router.lanes["tenant-1"].path, Path::Lane(_)), "known now: no second lookup");
        published(&mut rx, 1).await;
        assert_eq!(p.sent("http://memory.invalid/r1/tenant-1").len(), 2);
    }

    proptest! {
        /// Exactly one end per destination, at its last event.
        #[test]
        fn chunk_ends_mark_each_destinations_last_event(dests in proptest::collection::vec(0u8..4, 0..40)) {
            let events: Vec<OutboxEvent> =
                dests.iter().enumerate().map(|(i, d)| OutboxEvent::for_test(i as i64, &format!("d{d}"), "")).collect();
            let ends = chunk_ends(&events);
            for (i, d) in dests.iter().enumerate() {
                prop_assert_eq!(ends[i], !dests[i + 1..].contains(d));
            }
        }
    }
}
