//! The stream's archiver: between the lanes and the settler. It gathers
//! settlements for `archive.flush_interval` (or until their published
//! bodies reach `archive.segment_bytes`), writes their published events
//! as one segment per destination, and then hands every settlement of the
//! gathering on, in the order it came: nothing is settled (and no slot
//! position confirmed) before its event is archived.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::pipeline::settle::{Outcome, Settlement};
use crate::policy::retry::archive_backoff;

use super::{Archive, Segment};

/// Run until the lanes' side closes (and what was gathered is archived and
/// handed on, or, the archive failing then, dropped unsettled: the slot
/// sends it again).
pub async fn run_archiver(
    archive: Arc<Archive>,
    mut rx: mpsc::UnboundedReceiver<Settlement>,
    settle: mpsc::UnboundedSender<Settlement>,
    metrics: Arc<Metrics>,
) {
    let mut batch = Vec::new();
    loop {
        let Some(first) = rx.recv().await else { return };
        batch.push(first);
        gather(&mut rx, &mut batch, archive.settings.flush_interval, archive.settings.segment_bytes).await;
        if !write_all(&archive, archive.segments(&batch), &rx, &metrics).await {
            return;
        }
        for s in batch.drain(..) {
            if settle.send(s).is_err() {
                return;
            }
        }
    }
}

/// Settlements until `interval` after the first, or until their published
/// bodies reach `bytes`; a closed channel ends the gathering.
async fn gather(
    rx: &mut mpsc::UnboundedReceiver<Settlement>,
    batch: &mut Vec<Settlement>,
    interval: Duration,
    bytes: usize,
) {
    let window = tokio::time::sleep(interval);
    tokio::pin!(window);
    let mut size: usize = batch.iter().map(published_bytes).sum();
    while size < bytes {
        tokio::select! {
            biased;
            s = rx.recv() => match s {
                Some(s) => {
                    size += published_bytes(&s);
                    batch.push(s);
                }
                None => return,
            },
            () = &mut window => return,
        }
    }
}

fn published_bytes(s: &Settlement) -> usize {
    match s.outcome {
        Outcome::Published => s.event.body.len(),
        _ => 0,
    }
}

/// Write every segment, each retried with the archive's backoff until it
/// is written. `false`: the lanes' side closed while a write kept failing
/// (the relay is stopping; the gathering stays unsettled).
async fn write_all(
    archive: &Archive,
    segments: Vec<Segment>,
    rx: &mpsc::UnboundedReceiver<Settlement>,
    metrics: &Metrics,
) -> bool {
    for segment in segments {
        let mut failures = 0;
        while let Err(e) = archive.put(&segment, metrics).await {
            if rx.is_closed() {
                tracing::warn!(error = %e, "the archive is not written and the relay is stopping: its events stay unsettled and are sent again");
                return false;
            }
            if failures == 0 {
                tracing::warn!(destination = %segment.destination, error = %e, "the archive is not written: its events stay unsettled (the slot unconfirmed) until it is");
            }
            tokio::time::sleep(archive_backoff(failures)).await;
            failures += 1;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::event::OutboxEvent;
    use crate::pipeline::archive::decode;
    use crate::policy::dead::{DeadCode, DeadReason};
    use crate::publish::offload::{MemoryStore, ObjectStore};

    fn event(id: i64) -> Arc<OutboxEvent> {
        Arc::new(OutboxEvent::for_test(id, "orders", &format!("body {id}")))
    }

    /// Settlements reach the settler only once their segment is written,
    /// in the order they came; a DEAD one passes unarchived.
    #[tokio::test]
    async fn nothing_is_settled_before_it_is_archived() {
        let store = Arc::new(MemoryStore::default());
        store.down.store(true, Ordering::Release);
        let archive = Arc::new(Archive::in_memory(&store));
        let (tx, rx) = mpsc::unbounded_channel();
        let (settle_tx, mut settled) = mpsc::unbounded_channel();
        let metrics = Metrics::new();
        let task = tokio::spawn(run_archiver(archive, rx, settle_tx, Arc::clone(&metrics)));
        for id in 1..=3 {
            tx.send(Settlement::new(event(id), None, Arc::from("orders"), Outcome::Published)).unwrap();
        }
        let dead = Outcome::Dead(DeadReason::new(DeadCode::SqsRejected, "no"));
        tx.send(Settlement::new(event(4), None, Arc::from("orders"), dead)).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while metrics.archive_failures.get() < 2 {
            assert!(tokio::time::Instant::now() < deadline, "no write was tried");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(settled.try_recv().is_err(), "settled while the archive was down");
        store.down.store(false, Ordering::Release);
        let mut ids = Vec::new();
        while ids.len() < 4 {
            let s = tokio::time::timeout(Duration::from_secs(5), settled.recv()).await.unwrap().unwrap();
            ids.push(s.id().unwrap());
        }
        assert_eq!(ids, [1, 2, 3, 4]);
        let keys = store.list("b", "a/orders/", None, 10).await.unwrap();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let lines = decode(&store.get("b", &keys[0]).unwrap()).unwrap();
        let archived: Vec<&str> = lines.iter().map(|l| l.event_id.as_str()).collect();
        assert_eq!(archived, ["e:1", "e:2", "e:3"]);
        drop(tx);
        task.await.unwrap();
    }

    /// Stopping while the archive is down: the gathering is dropped
    /// unsettled (read again from the slot), and the archiver ends.
    #[tokio::test]
    async fn a_stop_while_the_archive_is_down_settles_nothing() {
        let store = Arc::new(MemoryStore::default());
        store.down.store(true, Ordering::Release);
        let archive = Arc::new(Archive::in_memory(&store));
        let (tx, rx) = mpsc::unbounded_channel();
        let (settle_tx, mut settled) = mpsc::unbounded_channel();
        let task = tokio::spawn(run_archiver(archive, rx, settle_tx, Metrics::new()));
        tx.send(Settlement::new(event(1), None, Arc::from("orders"), Outcome::Published)).unwrap();
        drop(tx);
        tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
        assert!(settled.recv().await.is_none());
    }
}
