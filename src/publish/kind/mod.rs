//! A kind of destination: what its service enforces and how it answers.
//! Each kind implements [`Rules`] once (SQS queues: [`queue::SqsQueue`],
//! SNS topics: [`topic::SnsTopic`], EventBridge buses: [`bus::EventBus`]);
//! the lanes, settlement, routing and spooling ask the destination's
//! [`Target`] (a destination as its service describes it) and never name a
//! service.
//!
//! What a kind decides:
//! - the entry made from a row, or why the row is DEAD ([`Rules::prepare`]);
//! - the batch it takes ([`Rules::batch_limits`]);
//! - what its service's error codes mean ([`Rules::codes`]), in the
//!   relay's words ([`Failure`]); what is then done about them is
//!   [`crate::policy::retry`]'s, the same for every kind;
//! - the DEAD codes of a refused entry and of a destination that does not
//!   exist.
//!
//! The network call itself is the [`Publisher`](crate::publish::Publisher)'s.

pub mod bus;
pub mod queue;
pub mod topic;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::event::OutboxEvent;
use crate::metrics::Service;
use crate::policy::dead::{DeadCode, DeadReason};
pub use crate::policy::retry::Failure;
use crate::publish::entry::Entry;
use crate::publish::offload::OffloadTarget;

/// The kinds of destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// An Amazon SQS queue, by its URL.
    Queue,
    /// An Amazon SNS topic, by its ARN.
    Topic,
    /// An Amazon EventBridge event bus, by its ARN.
    Bus,
}

impl Kind {
    /// The kind a configured address names: a queue's URL, a topic's or an
    /// event bus's ARN.
    pub fn of_address(address: &str) -> Result<Kind, String> {
        if address.starts_with("https://") || address.starts_with("http://") {
            return Ok(Kind::Queue);
        }
        if let Some(arn) = Arn::parse(address) {
            return match arn.service {
                "sns" => check_name(arn.resource, topic::MAX_NAME, "topic").map(|()| Kind::Topic),
                "events" => bus::check_resource(arn.resource).map(|()| Kind::Bus),
                other => Err(format!("{address:?}: an ARN of {other:?}; a destination is an SQS queue's URL, an SNS topic's ARN (arn:aws:sns:<region>:<account>:<topic>) or an event bus's (arn:aws:events:<region>:<account>:event-bus/<name>)")),
            };
        }
        Err(format!(
            "{address:?} is not a destination's address: a queue URL must start with https:// \
             (or http:// for a local endpoint), a topic's ARN with arn:aws:sns:, an event bus's with arn:aws:events:"
        ))
    }

    /// Its rules.
    pub fn rules(self) -> &'static dyn Rules {
        match self {
            Kind::Queue => &queue::SqsQueue,
            Kind::Topic => &topic::SnsTopic,
            Kind::Bus => &bus::EventBus,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Queue => "queue",
            Kind::Topic => "topic",
            Kind::Bus => "bus",
        }
    }
}

/// Whether `name` can name a queue or a topic (`noun`): 1 to `max` letters,
/// digits, `-` and `_`, a FIFO one's ending in `.fifo` (SQS's and SNS's
/// rule, with their own maximum).
pub fn check_name(name: &str, max: usize, noun: &str) -> Result<(), String> {
    let stem = name.strip_suffix(".fifo").unwrap_or(name);
    let ok = !stem.is_empty()
        && name.len() <= max
        && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} cannot name a {noun} (1 to {max} letters, digits, - and _, .fifo at the end of a FIFO {noun}'s)"
        ))
    }
}

/// The parts of an ARN (`arn:<partition>:<service>:<region>:<account>:<resource>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arn<'a> {
    pub partition: &'a str,
    pub service: &'a str,
    pub region: &'a str,
    pub account: &'a str,
    pub resource: &'a str,
}

impl<'a> Arn<'a> {
    /// `text` as an ARN, if it is one.
    pub fn parse(text: &'a str) -> Option<Arn<'a>> {
        let mut parts = text.splitn(6, ':');
        if parts.next()? != "arn" {
            return None;
        }
        let arn = Arn {
            partition: parts.next()?,
            service: parts.next()?,
            region: parts.next()?,
            account: parts.next()?,
            resource: parts.next()?,
        };
        (!arn.partition.is_empty() && !arn.service.is_empty()).then_some(arn)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A service's error codes, in the relay's words: one classification of
/// every kind's answers ([`Codes::failure`]), each kind its own lists.
pub struct Codes {
    /// "Slow down", even when marked as the sender's fault.
    pub slow_down: &'static [&'static str],
    /// The destination does not exist.
    pub missing: &'static [&'static str],
    /// The service's own trouble, and what an operator must mend, whoever
    /// is said to be at fault.
    pub passing: &'static [&'static str],
    /// Whether a refusal (code, message) says the entry is longer than the
    /// destination takes.
    pub too_long: fn(&str, &str) -> bool,
}

impl Codes {
    /// What `code` (with whether the service blamed the sender, and its
    /// message) means.
    pub fn failure(&self, code: &str, sender_fault: bool, message: &str) -> Failure {
        if self.slow_down.contains(&code) {
            Failure::Throttled
        } else if self.missing.contains(&code) {
            Failure::Missing
        } else if self.passing.contains(&code) || !sender_fault {
            Failure::Passing
        } else if (self.too_long)(code, message) {
            Failure::TooLong
        } else {
            Failure::Refused
        }
    }
}

/// How much one batch may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    pub entries: usize,
    /// Bytes of the entries' [`Entry::size`] together.
    pub bytes: usize,
}

/// One kind of destination's rules. Implemented once per kind.
pub trait Rules: Send + Sync + 'static {
    fn kind(&self) -> Kind;

    /// Validate `event` for `target` and build its entry, or say why it is
    /// DEAD: every rule the service would enforce is checked here, before
    /// any send, so a row it would refuse does not fail a whole batch.
    fn prepare(&self, event: Arc<OutboxEvent>, target: &Target) -> Result<Entry, DeadReason>;

    /// The most one call to `target` takes.
    fn batch_limits(&self, target: &Target) -> BatchLimits;

    /// What the service's error codes mean.
    fn codes(&self) -> &'static Codes;

    /// Whether a row may be sent before its `deliver_at` with the service
    /// holding it until then (a standard queue's `DelaySeconds`): otherwise
    /// it is held in the table until due.
    fn delays(&self, target: &Target) -> bool;

    /// The `last_error` of a row held in the table until its `deliver_at`.
    fn held(&self, target: &Target) -> &'static str;

    /// The DEAD code of an entry the service refused for good.
    fn rejected(&self) -> DeadCode;

    /// The DEAD code of a destination that does not exist.
    fn missing(&self) -> DeadCode;

    /// The service its calls count against, in `status` and the metrics.
    fn service(&self) -> Service;

    /// The call a batch is, for logs and spans (`SendMessageBatch`).
    fn call_name(&self) -> &'static str;

    /// The call that describes a destination, for errors
    /// (`GetQueueAttributes`).
    fn describe_name(&self) -> &'static str;
}

/// What the relay needs to know about a destination to batch for it.
#[derive(Debug, Clone)]
pub struct Target {
    pub kind: Kind,
    /// A queue's URL, a topic's or a bus's ARN.
    pub address: String,
    /// Order per group: a FIFO queue or topic.
    pub fifo: bool,
    /// `MaximumMessageSize`, bytes (body plus attributes), shared by every
    /// copy of this description: read again ([`Target::resize`]), the
    /// router and every lane of the destination judge by the new one.
    max_message_size: Arc<AtomicUsize>,
    /// A destination without order gets the row's `group_key` as
    /// `MessageGroupId` (SQS fair queues: one busy tenant does not delay
    /// the others); from the `fair_queues` setting, on unless configured off.
    pub fair: bool,
    /// Bodies over the threshold go through S3 (none: they are DEAD,
    /// `too_large`).
    pub offload: Option<Arc<OffloadTarget>>,
}

impl Target {
    /// A destination as its service describes it, fair-queue groups on, no S3.
    pub fn new(kind: Kind, address: impl Into<String>, fifo: bool, max_message_size: usize) -> Target {
        let max_message_size = Arc::new(AtomicUsize::new(max_message_size));
        Target { kind, address: address.into(), fifo, max_message_size, fair: true, offload: None }
    }

    /// An SQS queue.
    pub fn queue(url: impl Into<String>, fifo: bool, max_message_size: usize) -> Target {
        Target::new(Kind::Queue, url, fifo, max_message_size)
    }

    /// `MaximumMessageSize`, as last read.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size.load(Ordering::Relaxed)
    }

    /// The `MaximumMessageSize` read again, for this description and every
    /// copy of it.
    pub fn resize(&self, max_message_size: usize) {
        self.max_message_size.store(max_message_size, Ordering::Relaxed);
    }

    /// Its kind's rules.
    pub fn rules(&self) -> &'static dyn Rules {
        self.kind.rules()
    }

    /// `event` as an entry for this destination, or why it is DEAD.
    pub fn prepare(&self, event: Arc<OutboxEvent>) -> Result<Entry, DeadReason> {
        self.rules().prepare(event, self)
    }

    /// The most one call takes.
    pub fn batch_limits(&self) -> BatchLimits {
        self.rules().batch_limits(self)
    }

    /// Whether the service holds a row until its `deliver_at` (else the
    /// table holds it).
    pub fn delays(&self) -> bool {
        self.rules().delays(self)
    }

    /// What the service's answer means.
    pub fn failure(&self, code: &str, sender_fault: bool, message: &str) -> Failure {
        self.rules().codes().failure(code, sender_fault, message)
    }

    /// The DEAD reason of an entry the service refused for good.
    pub fn rejected(&self, error: String) -> DeadReason {
        DeadReason::new(self.rules().rejected(), error)
    }

    /// The DEAD code of a destination that does not exist.
    pub fn missing(&self) -> DeadCode {
        self.rules().missing()
    }
}

impl PartialEq for Target {
    fn eq(&self, other: &Target) -> bool {
        (self.kind, &self.address, self.fifo, self.max_message_size(), self.fair, &self.offload)
            == (other.kind, &other.address, other.fifo, other.max_message_size(), other.fair, &other.offload)
    }
}
