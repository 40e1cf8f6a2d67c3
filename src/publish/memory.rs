//! An in-memory publisher for tests: records what was sent, and injects the
//! faults queued for it (fail entry k, throttle, fail the call, hold sends at a
//! gate), one fault action per call, like etl's `faults.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::Semaphore;

use super::{CallError, EntryResult, Publisher};
use crate::publish::entry::Entry;
use crate::publish::kind::{Kind, Target};

/// What the next `send_batch` call does instead of succeeding.
#[derive(Debug, Clone)]
pub enum Fault {
    /// These entry positions fail with `code`; the rest are sent.
    FailEntries { positions: Vec<usize>, code: String, sender_fault: bool },
    /// The whole call fails; nothing is sent.
    FailCall(CallError),
    /// These entry positions are refused as longer than the queue takes,
    /// whatever their size (SQS counting bytes the relay did not).
    TooLong { positions: Vec<usize> },
}

/// A message as the queue received it.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Its row's id in the relay's table (`None`: a mapped table's row).
    pub outbox_id: Option<i64>,
    pub event_id: String,
    pub body: String,
    pub group_id: Option<String>,
    pub dedup_id: Option<String>,
    pub attributes: Vec<(String, String, String)>,
    /// The `AWSTraceHeader` system attribute.
    pub trace_header: Option<String>,
    pub delay_seconds: Option<u32>,
    /// When the queue took it.
    pub at: std::time::SystemTime,
}

#[derive(Default)]
struct Inner {
    /// Every destination, by its address.
    queues: HashMap<String, Target>,
    sent: HashMap<String, Vec<Sent>>,
    faults: VecDeque<Fault>,
    /// Queues that fail every call with this error until fixed.
    broken: HashMap<String, CallError>,
    /// Destinations deleted: not found until added again.
    removed: std::collections::HashSet<String>,
    /// The queues subscribed to a topic: each gets a copy of every message
    /// the topic takes.
    subscriptions: HashMap<String, Vec<String>>,
    calls: usize,
    /// Calls begun, including those held at the gate.
    started: usize,
    batch_sizes: Vec<usize>,
    /// Every call takes this long before it is answered.
    latency: std::time::Duration,
    /// Calls begun and not answered yet, and the most there were at once.
    in_flight: usize,
    peak_in_flight: usize,
}

#[derive(Clone, Default)]
pub struct MemoryPublisher {
    inner: Arc<Mutex<Inner>>,
    gate: Arc<Mutex<Option<Arc<Semaphore>>>>,
}

impl MemoryPublisher {
    pub fn new() -> Self {
        Self::default()
    }

    /// A queue (or a queue's attributes changed): entries longer than
    /// `max_message_size` are refused as SQS refuses them.
    pub fn add_queue(&self, url: &str, fifo: bool, max_message_size: usize) {
        self.add(Target::queue(url, fifo, max_message_size));
    }

    fn add(&self, target: Target) {
        let mut inner = self.inner.lock().unwrap();
        inner.removed.remove(&target.address);
        inner.queues.insert(target.address.clone(), target);
    }

    /// An event bus, as [`add_queue`](Self::add_queue).
    pub fn add_bus(&self, arn: &str) {
        self.add(Target::new(Kind::Bus, arn, false, crate::publish::kind::bus::MAX_ENTRY_BYTES));
    }

    /// A topic (or a topic's attributes changed), as [`add_queue`](Self::add_queue).
    pub fn add_topic(&self, arn: &str, fifo: bool, max_message_size: usize) {
        self.add(Target::new(Kind::Topic, arn, fifo, max_message_size));
    }

    /// `queue` gets a copy of every message `topic` takes from now on.
    pub fn subscribe(&self, topic: &str, queue: &str) {
        self.inner.lock().unwrap().subscriptions.entry(topic.to_string()).or_default().push(queue.to_string());
    }

    /// A destination deleted: it answers as its service answers for one
    /// that does not exist, to lookups and sends.
    pub fn remove(&self, address: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.queues.remove(address);
        inner.removed.insert(address.to_string());
    }

    pub fn push_fault(&self, f: Fault) {
        self.inner.lock().unwrap().faults.push_back(f);
    }

    /// Fail every call to `url` with `error` until [`fix_queue`](Self::fix_queue).
    pub fn break_queue(&self, url: &str, error: CallError) {
        self.inner.lock().unwrap().broken.insert(url.to_string(), error);
    }

    pub fn fix_queue(&self, url: &str) {
        self.inner.lock().unwrap().broken.remove(url);
    }

    /// Hold every send until [`open_gate`](Self::open_gate).
    pub fn close_gate(&self) {
        *self.gate.lock().unwrap() = Some(Arc::new(Semaphore::new(0)));
    }

    pub fn open_gate(&self) {
        if let Some(s) = self.gate.lock().unwrap().take() {
            s.add_permits(Semaphore::MAX_PERMITS / 2);
        }
    }

    pub fn sent(&self, url: &str) -> Vec<Sent> {
        self.inner.lock().unwrap().sent.get(url).cloned().unwrap_or_default()
    }

    pub fn calls(&self) -> usize {
        self.inner.lock().unwrap().calls
    }

    /// Calls begun, including those waiting at a closed gate.
    pub fn calls_started(&self) -> usize {
        self.inner.lock().unwrap().started
    }

    pub fn batch_sizes(&self) -> Vec<usize> {
        self.inner.lock().unwrap().batch_sizes.clone()
    }

    /// Every call from now on is answered after `latency`.
    pub fn set_latency(&self, latency: std::time::Duration) {
        self.inner.lock().unwrap().latency = latency;
    }

    /// The most calls there were in flight at once.
    pub fn peak_in_flight(&self) -> usize {
        self.inner.lock().unwrap().peak_in_flight
    }
}

#[async_trait]
impl Publisher for MemoryPublisher {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        // A description of its own: not one the relay's copies share.
        let queues = &self.inner.lock().unwrap().queues;
        let found = queues.get(address).filter(|t| t.kind == kind);
        let target = found.map(|t| Target::new(kind, address, t.fifo, t.max_message_size()));
        target.ok_or_else(|| not_found(kind, address))
    }

    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let limits = target.batch_limits();
        assert!(entries.len() <= limits.entries, "batch over {}'s entries", target.kind);
        let bytes = entries.iter().map(|e| e.size).sum::<usize>();
        assert!(entries.len() == 1 || bytes <= limits.bytes, "batch of {bytes} bytes over the {}'s limit", target.kind);
        let latency = {
            let mut inner = self.inner.lock().unwrap();
            inner.in_flight += 1;
            inner.peak_in_flight = inner.peak_in_flight.max(inner.in_flight);
            inner.latency
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let result = self.answer(target, entries).await;
        self.inner.lock().unwrap().in_flight -= 1;
        result
    }
}

impl MemoryPublisher {
    /// A call's answer, once its latency passed.
    async fn answer(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        let queue_url = target.address.as_str();
        self.inner.lock().unwrap().started += 1;
        let gate = self.gate.lock().unwrap().clone();
        if let Some(g) = gate {
            let _permit = g.acquire().await.map_err(|_| CallError::transport("gate closed"))?;
        }
        let mut inner = self.inner.lock().unwrap();
        inner.calls += 1;
        if let Some(e) = inner.broken.get(queue_url) {
            return Err(e.clone());
        }
        if inner.removed.contains(queue_url) {
            return Err(not_found(target.kind, queue_url));
        }
        inner.batch_sizes.push(entries.len());
        let fault = inner.faults.pop_front();
        let failing: Vec<usize> = match &fault {
            Some(Fault::FailCall(e)) => return Err(CallError { code: dialect(target.kind, &e.code), ..e.clone() }),
            Some(Fault::FailEntries { positions, .. } | Fault::TooLong { positions }) => positions.clone(),
            None => vec![],
        };
        let limit = inner.queues.get(queue_url).map_or(usize::MAX, Target::max_message_size);
        let mut out = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if e.size > limit || (failing.contains(&i) && matches!(fault, Some(Fault::TooLong { .. }))) {
                out.push(too_long(target.kind, limit));
                continue;
            }
            if failing.contains(&i) {
                let Some(Fault::FailEntries { code, sender_fault, .. }) = &fault else { unreachable!() };
                out.push(EntryResult::Failed {
                    code: dialect(target.kind, code),
                    sender_fault: *sender_fault,
                    message: "injected".into(),
                });
                continue;
            }
            inner.deliver(queue_url, e);
            out.push(EntryResult::Sent);
        }
        Ok(out)
    }
}

impl Inner {
    /// `e` taken by the destination at `address`, and by every queue
    /// subscribed to it.
    fn deliver(&mut self, address: &str, e: &Entry) {
        let sent = Sent {
            outbox_id: e.event.row_id(),
            event_id: e.event.event_id.clone(),
            body: e.message_body().to_string(),
            group_id: e.group_id.clone(),
            dedup_id: e.dedup_id.clone(),
            trace_header: e.trace_header.clone(),
            delay_seconds: e.delay_seconds,
            at: std::time::SystemTime::now(),
            attributes: e.attributes.iter().map(|a| (a.name.clone(), a.data_type.clone(), a.value.clone())).collect(),
        };
        let subscribers = self.subscriptions.get(address).cloned().unwrap_or_default();
        for queue in subscribers {
            self.sent.entry(queue).or_default().push(sent.clone());
        }
        self.sent.entry(address.to_string()).or_default().push(sent);
    }
}

/// An injected code in the destination's service's words: SQS's
/// `RequestThrottled` is SNS's `Throttled` and EventBridge's
/// `ThrottlingException`, its `InternalError` EventBridge's
/// `InternalFailure` (the faults are queued for whichever call comes next,
/// of any kind).
fn dialect(kind: Kind, code: &str) -> String {
    match (kind, code) {
        (Kind::Topic, "RequestThrottled") => "Throttled".into(),
        (Kind::Bus, "RequestThrottled") => "ThrottlingException".into(),
        (Kind::Bus, "InternalError") => "InternalFailure".into(),
        _ => code.into(),
    }
}

/// How a service answers for a destination that does not exist.
fn not_found(kind: Kind, address: &str) -> CallError {
    let code = match kind {
        Kind::Queue => "AWS.SimpleQueueService.NonExistentQueue",
        Kind::Topic => "NotFound",
        Kind::Bus => "ResourceNotFoundException",
    };
    CallError { code: code.into(), message: format!("no {kind} {address}"), sender_fault: true }
}

/// How a service refuses an entry over the destination's limit.
fn too_long(kind: Kind, limit: usize) -> EntryResult {
    let (code, message) = match kind {
        Kind::Queue => (
            "InvalidParameterValue",
            format!("One or more parameters are invalid. Reason: Message must be shorter than {limit} bytes."),
        ),
        Kind::Topic => {
            ("InvalidParameter", format!("Invalid parameter: Message too long. Maximum size is {limit} bytes."))
        }
        Kind::Bus => ("ValidationException", format!("Total size of the entries exceeds the limit of {limit} bytes.")),
    };
    EntryResult::Failed { code: code.into(), sender_fault: true, message }
}
