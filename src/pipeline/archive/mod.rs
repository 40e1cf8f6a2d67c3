//! The archive: every published event, written to S3 before it is settled,
//! so that what `published_rows = "delete"`, a transient row or a mapped
//! table's insert-and-delete leaves nothing of can be sent again
//! ([`crate::ops::replay`]).
//!
//! It sits between the lanes and settlement: the stream's settlements go
//! through [`run_archiver`] (which gathers them for `archive.flush_interval`,
//! writes one segment per destination, and only then hands them on), and a
//! table claim's are written by [`Archive::keep`] before the claim commits.
//! So an event whose row is settled (deleted, marked, its slot position
//! confirmed) is in the archive; one not yet archived when the relay dies
//! is unsettled, read again and sent again (at least once), and archived
//! then. Segments live under `archive.key_prefix`, a folder per destination,
//! keyed by the time they were written; the sweep ([`sweep`]) deletes those
//! older than `archive.window`.

mod segment;
mod stage;
pub mod sweep;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use crate::clock::now_unix_us;
pub use crate::config::ArchiveConfig;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::pipeline::settle::{Outcome, Settlement};
use crate::publish::offload::{ObjectStore, S3Store};
use crate::publish::CallError;

pub use segment::{after, decode, folder, written_us, Line};
pub use stage::run_archiver;

/// Where the archive is written, and how.
pub struct Archive {
    pub store: Arc<dyn ObjectStore>,
    pub settings: ArchiveConfig,
    /// This process, in every key it writes: two relays (a leader and the
    /// one taking over) never write the same key.
    writer: String,
    written: AtomicU64,
}

/// One destination's segment, ready to be written.
pub struct Segment {
    pub destination: Arc<str>,
    pub key: String,
    pub body: Bytes,
    pub events: usize,
}

impl Archive {
    pub fn new(store: Arc<dyn ObjectStore>, settings: ArchiveConfig) -> Archive {
        let writer = format!("{:x}{:08x}", std::process::id(), rand::random::<u32>());
        Archive { store, settings, writer, written: AtomicU64::new(0) }
    }

    /// The archive `settings` describe, in S3 on the relay's AWS
    /// configuration (`config`'s region and role).
    pub async fn on_s3(config: &Config, settings: &ArchiveConfig) -> Archive {
        let role = config.sqs_assume_role_arn.as_deref();
        let store = S3Store::new(&config.sqs_region, settings.endpoint_url.as_deref(), role).await;
        Archive::new(Arc::new(store), settings.clone())
    }

    /// An archive in memory, its segments in `store`: for tests.
    #[cfg(test)]
    pub(crate) fn in_memory(store: &Arc<crate::publish::offload::MemoryStore>) -> Archive {
        let settings = ArchiveConfig {
            bucket: "b".into(),
            key_prefix: "a/".into(),
            endpoint_url: None,
            window: None,
            flush_interval: std::time::Duration::from_millis(20),
            segment_bytes: 1 << 20,
        };
        Archive::new(Arc::clone(store) as Arc<dyn ObjectStore>, settings)
    }

    /// The published events of `batch` as one segment per destination (in
    /// the order they were settled, which a FIFO group's events were sent
    /// in); DEAD and deferred events are not published, and not archived.
    pub fn segments(&self, batch: &[Settlement]) -> Vec<Segment> {
        let now = now_unix_us();
        let mut by: BTreeMap<&Arc<str>, Vec<Line>> = BTreeMap::new();
        for s in batch.iter().filter(|s| matches!(s.outcome, Outcome::Published)) {
            by.entry(&s.destination).or_default().push(line(s, now));
        }
        by.into_iter()
            .map(|(destination, lines)| {
                let n = self.written.fetch_add(1, Ordering::Relaxed);
                let key = segment::key(&self.settings.key_prefix, destination, now, &format!("{}-{n:06}", self.writer));
                Segment {
                    destination: Arc::clone(destination),
                    key,
                    body: segment::encode(&lines),
                    events: lines.len(),
                }
            })
            .collect()
    }

    /// Write one segment, counted in `metrics` (a failure too).
    pub async fn put(&self, segment: &Segment, metrics: &Metrics) -> Result<(), CallError> {
        match self.store.put(&self.settings.bucket, &segment.key, segment.body.clone()).await {
            Ok(()) => {
                metrics.archived_events.with_label_values(&[&segment.destination]).inc_by(segment.events as u64);
                metrics.archived_bytes.inc_by(segment.body.len() as u64);
                Ok(())
            }
            Err(e) => {
                metrics.archive_failures.inc();
                Err(e)
            }
        }
    }

    /// Archive the published events of a table claim before it commits:
    /// each segment tried up to [`crate::policy::retry::ARCHIVE_CLAIM_TRIES`]
    /// times. Those of a segment not written stay unpublished (deferred to
    /// the table with the error): they are sent again later, and archived
    /// then; an event is never settled unarchived.
    pub async fn keep(&self, batch: &mut [Settlement], metrics: &Metrics) {
        let mut failed: Vec<(Arc<str>, String)> = Vec::new();
        for segment in self.segments(batch) {
            let mut tries = 0;
            loop {
                match self.put(&segment, metrics).await {
                    Ok(()) => break,
                    Err(e) if tries + 1 >= crate::policy::retry::ARCHIVE_CLAIM_TRIES => {
                        tracing::warn!(destination = %segment.destination, error = %e, "the archive is not written: the claim's published events are sent again later");
                        failed.push((segment.destination, format!("archive: {e}")));
                        break;
                    }
                    Err(_) => {
                        tokio::time::sleep(crate::policy::retry::archive_backoff(tries)).await;
                        tries += 1;
                    }
                }
            }
        }
        for (destination, why) in failed {
            for s in batch.iter_mut().filter(|s| s.destination == destination) {
                if matches!(s.outcome, Outcome::Published) {
                    s.outcome = Outcome::Deferred(why.clone(), crate::pipeline::settle::Due::Backoff);
                }
            }
        }
    }
}

/// A published settlement as the archive's line, archived at `now`.
fn line(s: &Settlement, now: i64) -> Line {
    let e = &s.event;
    Line {
        event_id: e.event_id.clone(),
        destination: s.destination.to_string(),
        body: e.body.clone(),
        group_key: e.group_key.clone(),
        attributes: e.attributes.clone(),
        committed_us: e.commit_time_us,
        published_us: now,
        table: e.mapped().map(|m| m.table.to_string()),
        replay_of: e.replay_of,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering as AtomicOrdering;

    use super::*;
    use crate::event::OutboxEvent;
    use crate::pipeline::settle::Due;
    use crate::publish::offload::MemoryStore;

    fn published(id: i64, destination: &str) -> Settlement {
        let event = Arc::new(OutboxEvent::for_test(id, destination, "b"));
        Settlement::new(event, None, Arc::from(destination), Outcome::Published)
    }

    /// A table claim's published events are archived before it commits, a
    /// segment per destination; when S3 does not take them they are not
    /// settled as published but left for the table path to send again.
    #[tokio::test]
    async fn a_claim_is_archived_or_sent_again_never_settled_unarchived() {
        let store = Arc::new(MemoryStore::default());
        let a = Archive::in_memory(&store);
        let metrics = Metrics::new();
        let mut batch = vec![published(1, "orders"), published(2, "audit"), published(3, "orders")];
        a.keep(&mut batch, &metrics).await;
        assert!(batch.iter().all(|s| matches!(s.outcome, Outcome::Published)));
        assert_eq!(store.len(), 2, "a segment per destination");
        assert_eq!(metrics.archived_events.with_label_values(&["orders"]).get(), 2);

        store.down.store(true, AtomicOrdering::Release);
        let mut batch = vec![published(4, "orders")];
        a.keep(&mut batch, &metrics).await;
        assert!(matches!(&batch[0].outcome, Outcome::Deferred(why, Due::Backoff) if why.starts_with("archive: S3.")));
        assert_eq!(metrics.archive_failures.get(), u64::from(crate::policy::retry::ARCHIVE_CLAIM_TRIES));
    }
}
