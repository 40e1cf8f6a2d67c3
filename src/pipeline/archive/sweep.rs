//! The archive's window: segments written longer than `archive.window` ago
//! are deleted, destination by destination, oldest first (keys sort by the
//! time they were written, so each folder's listing stops at the first
//! segment inside the window).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::clock::now_unix_us;
use crate::metrics::Metrics;
use crate::publish::CallError;

use super::segment::written_us;
use super::Archive;

/// Keys listed (and deleted) per call.
const PAGE: usize = 1_000;

/// How often the sweep runs: a tenth of the window, from a second to an
/// hour.
pub fn every(window: Duration) -> Duration {
    (window / 10).clamp(Duration::from_secs(1), Duration::from_secs(3_600))
}

/// Sweep now and then until `stop`; nothing when the window is off.
pub async fn run_sweep(archive: Arc<Archive>, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let Some(window) = archive.settings.window else { return };
    let mut tick = tokio::time::interval(every(window));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let cutoff = now_unix_us() - window.as_micros() as i64;
        match sweep_once(&archive, cutoff).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.archive_expired.inc_by(n as u64);
                tracing::info!(deleted = n, ?window, "archive: deleted segments older than its window");
            }
            Err(e) => tracing::warn!(error = %e, "archive sweep failed; retrying at the next"),
        }
    }
}

/// Delete every segment written before `cutoff_us`; returns how many.
pub async fn sweep_once(archive: &Archive, cutoff_us: i64) -> Result<usize, CallError> {
    let (store, bucket) = (&archive.store, archive.settings.bucket.as_str());
    let mut deleted = 0;
    for folder in store.folders(bucket, &archive.settings.key_prefix).await? {
        loop {
            let keys = store.list(bucket, &folder, None, PAGE).await?;
            let old: Vec<String> =
                keys.iter().take_while(|k| written_us(&folder, k).is_some_and(|t| t < cutoff_us)).cloned().collect();
            if old.is_empty() {
                break;
            }
            store.delete(bucket, &old).await?;
            deleted += old.len();
            if old.len() < keys.len() {
                break;
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::offload::{MemoryStore, ObjectStore};

    #[tokio::test]
    async fn segments_past_the_window_go_and_the_rest_stay() {
        let store = Arc::new(MemoryStore::default());
        let archive = Archive::in_memory(&store);
        for dest in ["orders", "x/y"] {
            for t in [10, 20, 30, 40] {
                let key = super::super::segment::key("a/", dest, t, "w-0");
                store.put("b", &key, bytes::Bytes::from_static(b"")).await.unwrap();
            }
        }
        store.put("b", "a/other-file", bytes::Bytes::from_static(b"")).await.unwrap();
        assert_eq!(sweep_once(&archive, 30).await.unwrap(), 4, "10 and 20 of each destination");
        let left = store.list("b", "a/", None, 100).await.unwrap();
        assert_eq!(left.len(), 5, "{left:?}");
        assert!(left.iter().all(|k| !k.contains("00000000000000000010-")));
        assert_eq!(sweep_once(&archive, 30).await.unwrap(), 0);
        assert_eq!(sweep_once(&archive, i64::MAX).await.unwrap(), 4, "a key that is not a segment's stays");
    }

    #[test]
    fn the_sweep_runs_a_tenth_of_the_window_apart() {
        assert_eq!(every(Duration::from_secs(7 * 86_400)), Duration::from_secs(3_600));
        assert_eq!(every(Duration::from_secs(5)), Duration::from_secs(1));
        assert_eq!(every(Duration::from_secs(600)), Duration::from_secs(60));
    }
}
