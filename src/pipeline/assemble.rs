//! The pipeline, assembled in one place from its [`Settings`]. Both sources
//! use it:
//! - the stream: the router in front of one lane per destination, every
//!   lane's settlements to one settler ([`Streaming::start`]), through the
//!   archiver when there is an archive;
//! - the table path: one claim's events routed, sent through a lane of
//!   their own, their settlements marked in the claiming transaction
//!   ([`publish_claim`]).

use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, Notify};
use tokio::task::{JoinHandle, JoinSet};
use tokio_postgres::{Client, GenericClient};

use crate::event::OutboxEvent;
use crate::metrics::Metrics;
use crate::publish::kind::Target;
use crate::publish::Publisher;

use super::archive::run_archiver;
use super::intake::Intake;
use super::lane::{run_lane, LaneConfig, LaneItem, Wiring};
use super::owed::Owed;
use super::route::{judge_for, Router};
use super::settings::Settings;
use super::settle::{mark, run_settler, Settlement};
use super::watermark::Watermark;

pub use super::parts::Parts;

/// The settler's task: it ends when every lane and the router are gone.
pub type Settler = JoinHandle<Result<(), tokio_postgres::Error>>;

/// A stream's running pipeline.
pub struct Streaming {
    pub intake: Intake,
    /// Every lane's task, those the router opens later included.
    pub lanes: Arc<Mutex<JoinSet<()>>>,
    pub settler: Settler,
}

impl Streaming {
    /// The settler on `settler_client`, one lane per destination, and the
    /// router in front of them within the memory budget.
    pub fn start(
        parts: &Arc<Parts>,
        settler_client: Client,
        watermark: &Arc<Mutex<Watermark>>,
        confirm: &Arc<Notify>,
    ) -> Streaming {
        let (mut settle_tx, settle_rx) = mpsc::unbounded_channel();
        if let Some(archive) = &parts.archive {
            // Settlements go through the archiver first: nothing is settled
            // before its event is archived. It ends when the lanes and the
            // router are gone, and the settler after it.
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run_archiver(Arc::clone(archive), rx, settle_tx, Arc::clone(&parts.metrics)));
            settle_tx = tx;
        }
        let settler = tokio::spawn(run_settler(
            settler_client,
            settle_rx,
            Arc::clone(watermark),
            Arc::clone(confirm),
            Arc::clone(&parts.metrics),
            parts.settings.marking,
        ));
        let lanes = Arc::new(Mutex::new(JoinSet::new()));
        let mut router = Router::new(Arc::clone(parts), Arc::clone(&lanes), settle_tx, Arc::clone(watermark));
        for d in parts.destinations.all() {
            router.open(d);
        }
        Streaming { intake: Intake::new(router, Arc::clone(watermark)), lanes, settler }
    }
}

/// One table claim's events through the pipeline: each routed ([`judge_for`],
/// judged at `now_us`, the database's clock), those to send through a lane of
/// their own (retries go back to the table, not into memory), and every
/// settlement marked in `claim`, the claiming transaction. The table path
/// commits it (its confirm) and then [`record`](super::settle::record)s the settlements.
pub async fn publish_claim<C: GenericClient>(
    claim: &C,
    parts: &Parts,
    target: (&Arc<str>, &Target),
    events: Vec<Arc<OutboxEvent>>,
    now_us: i64,
) -> Result<Vec<Settlement>, tokio_postgres::Error> {
    let (name, target) = target;
    let settings = &parts.settings;
    let mut settled: Vec<Settlement> = Vec::new();
    let mut items: Vec<LaneItem> = Vec::with_capacity(events.len());
    for ev in events {
        match judge_for(target, &ev, now_us).unsent() {
            Ok(entry) => items.push(LaneItem::new(entry, None, None)),
            Err(outcome) => settled.push(Settlement::new(ev, None, Arc::clone(name), outcome)),
        }
    }
    settled.extend(send_through_lane(settings, name, target, items, &parts.publisher, &parts.metrics).await);
    if let Some(archive) = &parts.archive {
        // Archived before the claim commits, or sent again later.
        archive.keep(&mut settled, &parts.metrics).await;
    }
    if !settled.is_empty() {
        // Claimed rows are locked FOR UPDATE: their column can be set, or
        // they stay unpublished and the next claim takes them.
        mark(claim, &settled, settings.marking, &mut Owed::default()).await?;
    }
    Ok(settled)
}

/// A claim's entries through a lane of their own; their settlements, once
/// all are done.
async fn send_through_lane(
    settings: &Settings,
    name: &Arc<str>,
    target: &Target,
    items: Vec<LaneItem>,
    publisher: &Arc<dyn Publisher>,
    metrics: &Arc<Metrics>,
) -> Vec<Settlement> {
    let mut settled = Vec::with_capacity(items.len());
    if items.is_empty() {
        return settled;
    }
    let (item_tx, item_rx) = mpsc::channel(items.len());
    let (settle_tx, mut settle_rx) = mpsc::unbounded_channel();
    let lane_cfg = LaneConfig::table(Arc::clone(name), target, &settings.lanes, &settings.marking);
    let wiring = Wiring { publisher: Arc::clone(publisher), settle: settle_tx, metrics: Arc::clone(metrics) };
    let lane = tokio::spawn(run_lane(lane_cfg, wiring, item_rx, None));
    let last = items.len() - 1;
    for (i, item) in items.into_iter().enumerate() {
        // Capacity is the number of items: never waits.
        let _ = item_tx.send(item.ending_chunk(i == last)).await;
    }
    drop(item_tx);
    while let Some(s) = settle_rx.recv().await {
        settled.push(s);
    }
    let _ = lane.await;
    settled
}
