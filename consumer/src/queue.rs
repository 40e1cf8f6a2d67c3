//! Where the consumer's messages come from: a [`Queue`] — SQS
//! ([`crate::sqs::SqsQueue`], feature `sqs`), or an in-memory queue with SQS's
//! visibility, receive-count and redrive semantics
//! ([`crate::memory::MemoryQueue`], feature `test-utils`) — and [`Batched`],
//! which turns single deletes and visibility changes into batch calls.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

/// SQS's ceiling for a message's visibility timeout.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// Entries of one SQS batch call.
pub const MAX_BATCH: usize = 10;

#[derive(Debug, Clone)]
pub struct ReceivedMessage {
    pub body: String,
    pub receipt: String,
    /// `ApproximateReceiveCount`: 1 on the first delivery.
    pub receive_count: u32,
    /// The producer's W3C `traceparent` ([`crate::Job::traceparent`]).
    pub traceparent: Option<String>,
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("queue: {0}")]
pub struct QueueError(pub String);

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// Up to `max` messages, waiting up to `wait` for the first.
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError>;
    async fn delete(&self, receipt: &str) -> Result<(), QueueError>;
    /// Make the message visible again `after` from now (capped at 12 h).
    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError>;

    /// Up to [`MAX_BATCH`] deletes; one result per receipt, in order. By
    /// default one call each; SQS answers them in one `DeleteMessageBatch`.
    async fn delete_batch(&self, receipts: &[String]) -> Vec<Result<(), QueueError>> {
        let mut out = Vec::with_capacity(receipts.len());
        for r in receipts {
            out.push(self.delete(r).await);
        }
        out
    }

    /// Up to [`MAX_BATCH`] visibility changes; one result per entry, in order.
    async fn change_visibility_batch(&self, entries: &[(String, Duration)]) -> Vec<Result<(), QueueError>> {
        let mut out = Vec::with_capacity(entries.len());
        for (r, after) in entries {
            out.push(self.change_visibility(r, *after).await);
        }
        out
    }
}

/// Seconds for SQS's visibility parameters: rounded up, at most 12 h.
pub fn visibility_secs(d: Duration) -> i32 {
    d.min(MAX_VISIBILITY).as_secs_f64().ceil() as i32
}

type Reply = Option<oneshot::Sender<Result<(), QueueError>>>;

/// A [`Queue`] whose `delete` and `change_visibility` calls, from however
/// many tasks, are gathered into batch calls of up to 10 (waiting at most
/// `linger` for company). Awaited, each caller gets its own entry's result;
/// detached, the call returns once its entry is queued and a failure is
/// logged (the message then comes back, and its job's row decides again).
/// [`Batched::close`] sends what is queued and waits for it.
pub struct Batched {
    inner: Arc<dyn Queue>,
    detached: bool,
    deletes: mpsc::UnboundedSender<(String, Reply)>,
    hides: mpsc::UnboundedSender<((String, Duration), Reply)>,
    gatherers: Vec<tokio::task::JoinHandle<()>>,
}

impl Batched {
    /// Spawns the two gatherers on the current runtime.
    pub fn new(inner: Arc<dyn Queue>, linger: Duration, detached: bool) -> Self {
        let (deletes, drx) = mpsc::unbounded_channel();
        let (hides, hrx) = mpsc::unbounded_channel();
        let q = Arc::clone(&inner);
        let d = tokio::spawn(gather(drx, linger, "DeleteMessageBatch", move |batch: Vec<String>| {
            let q = Arc::clone(&q);
            async move { q.delete_batch(&batch).await }
        }));
        let q = Arc::clone(&inner);
        let h =
            tokio::spawn(gather(hrx, linger, "ChangeMessageVisibilityBatch", move |batch: Vec<(String, Duration)>| {
                let q = Arc::clone(&q);
                async move { q.change_visibility_batch(&batch).await }
            }));
        Self { inner, detached, deletes, hides, gatherers: vec![d, h] }
    }

    /// Send everything queued and wait for the calls to finish.
    pub async fn close(self) {
        let Batched { deletes, hides, gatherers, .. } = self;
        drop((deletes, hides));
        for g in gatherers {
            let _ = g.await;
        }
    }

    async fn queued(&self, rx: Option<oneshot::Receiver<Result<(), QueueError>>>) -> Result<(), QueueError> {
        match rx {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(QueueError("the batching task ended".into()))),
            None => Ok(()),
        }
    }

    fn reply(&self) -> (Reply, Option<oneshot::Receiver<Result<(), QueueError>>>) {
        if self.detached {
            (None, None)
        } else {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        }
    }
}

/// Batch calls of one kind in flight at once.
const IN_FLIGHT: usize = 8;

/// Collect up to [`MAX_BATCH`] requests (the first, then whatever arrives
/// within `linger`), send them as one call (up to [`IN_FLIGHT`] at once),
/// answer each; once the senders are gone, wait for the calls in flight.
async fn gather<T, F, Fut>(mut rx: mpsc::UnboundedReceiver<(T, Reply)>, linger: Duration, what: &'static str, call: F)
where
    T: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = Vec<Result<(), QueueError>>> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut calls = tokio::task::JoinSet::new();
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + linger;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(next)) => batch.push(next),
                _ => break,
            }
        }
        let (items, replies): (Vec<T>, Vec<Reply>) = batch.into_iter().unzip();
        let permit = Arc::clone(&slots).acquire_owned().await.expect("never closed");
        let sent = call(items);
        calls.spawn(async move {
            for (reply, r) in replies.into_iter().zip(sent.await) {
                match reply {
                    Some(reply) => {
                        let _ = reply.send(r);
                    }
                    None => {
                        if let Err(e) = r {
                            tracing::warn!(error = %e, call = what, "entry failed alone too: the message comes back and its job decides again");
                        }
                    }
                }
            }
            drop(permit);
        });
        while calls.try_join_next().is_some() {}
    }
    while calls.join_next().await.is_some() {}
}

#[async_trait]
impl Queue for Batched {
    async fn receive(&self, max: i32, wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
        self.inner.receive(max, wait).await
    }

    async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
        let (tx, rx) = self.reply();
        self.deletes.send((receipt.to_string(), tx)).map_err(|_| QueueError("the batching task ended".into()))?;
        self.queued(rx).await
    }

    async fn change_visibility(&self, receipt: &str, after: Duration) -> Result<(), QueueError> {
        let (tx, rx) = self.reply();
        self.hides
            .send(((receipt.to_string(), after), tx))
            .map_err(|_| QueueError("the batching task ended".into()))?;
        self.queued(rx).await
    }

    async fn delete_batch(&self, receipts: &[String]) -> Vec<Result<(), QueueError>> {
        self.inner.delete_batch(receipts).await
    }

    async fn change_visibility_batch(&self, entries: &[(String, Duration)]) -> Vec<Result<(), QueueError>> {
        self.inner.change_visibility_batch(entries).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records each batch call; a receipt starting with "bad" fails.
    #[derive(Default)]
    struct Recording {
        batches: Mutex<Vec<usize>>,
    }

    #[async_trait]
    impl Queue for Recording {
        async fn receive(&self, _max: i32, _wait: Duration) -> Result<Vec<ReceivedMessage>, QueueError> {
            Ok(Vec::new())
        }
        async fn delete(&self, receipt: &str) -> Result<(), QueueError> {
            if receipt.starts_with("bad") {
                Err(QueueError(format!("{receipt} refused")))
            } else {
                Ok(())
            }
        }
        async fn change_visibility(&self, _receipt: &str, _after: Duration) -> Result<(), QueueError> {
            Ok(())
        }
        async fn delete_batch(&self, receipts: &[String]) -> Vec<Result<(), QueueError>> {
            self.batches.lock().unwrap().push(receipts.len());
            let mut out = Vec::new();
            for r in receipts {
                out.push(self.delete(r).await);
            }
            out
        }
    }

    #[tokio::test]
    async fn concurrent_deletes_share_batch_calls_and_each_gets_its_own_answer() {
        let inner = Arc::new(Recording::default());
        let b = Arc::new(Batched::new(Arc::clone(&inner) as Arc<dyn Queue>, Duration::from_millis(50), false));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..25 {
            let b = Arc::clone(&b);
            let receipt = if i == 7 { "bad-7".to_string() } else { format!("r{i}") };
            tasks.spawn(async move { (i, b.delete(&receipt).await) });
        }
        let mut failed = Vec::new();
        while let Some(r) = tasks.join_next().await {
            let (i, r) = r.unwrap();
            if r.is_err() {
                failed.push(i);
            }
        }
        assert_eq!(failed, vec![7], "only the refused entry fails");
        let batches = inner.batches.lock().unwrap().clone();
        assert_eq!(batches.iter().sum::<usize>(), 25);
        assert!(batches.iter().all(|&n| n <= MAX_BATCH), "{batches:?}");
        assert!(batches.len() <= 4, "25 deletes within one linger take 3 calls, not 25: {batches:?}");
    }

    #[tokio::test]
    async fn detached_calls_return_at_once_and_close_sends_what_is_queued() {
        let inner = Arc::new(Recording::default());
        let b = Batched::new(Arc::clone(&inner) as Arc<dyn Queue>, Duration::from_secs(60), true);
        for i in 0..3 {
            b.delete(&format!("r{i}")).await.unwrap();
        }
        // The linger has not passed: nothing sent yet; close sends it.
        assert!(inner.batches.lock().unwrap().is_empty());
        b.close().await;
        assert_eq!(*inner.batches.lock().unwrap(), vec![3]);
    }
}
