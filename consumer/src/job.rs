//! What a handler sees and answers: the job's message, the claimed job, the
//! handler trait, and what became of a message.

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio_postgres::Transaction;

/// A job's message, as the outbox event carries it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct JobMessage {
    pub job_id: String,
    pub kind: String,
    pub generation: i32,
}

impl JobMessage {
    pub fn parse(body: &str) -> Option<JobMessage> {
        let m: JobMessage = serde_json::from_str(body).ok()?;
        (!m.job_id.is_empty() && !m.kind.is_empty() && m.generation >= 0).then_some(m)
    }
}

/// The claimed job a handler runs.
#[derive(Debug, Clone)]
pub struct Job {
    pub job_id: String,
    pub kind: String,
    pub payload: serde_json::Value,
    /// 1 on the first claim.
    pub attempt: i32,
    pub generation: i32,
    /// True once the job's cancellation was requested, or its lease was lost:
    /// stop early; whatever the handler returns is then fenced or discarded.
    pub cancelled: watch::Receiver<bool>,
    /// The producer's W3C `traceparent`, from the message's attribute (or
    /// rebuilt from its `AWSTraceHeader`): a handler's spans continue the
    /// producer's trace from it.
    pub traceparent: Option<String>,
}

/// How a handler failed.
#[derive(Debug, Clone)]
pub enum HandlerError {
    /// Try again later (time-based exponential backoff with jitter).
    Retry(String),
    /// It will never work: the job ends DEAD with this reason.
    Permanent(String),
}

#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Run the job. Business writes go through `tx`: they commit together
    /// with the job's transition to SUCCEEDED, or not at all.
    async fn handle(&self, job: &Job, tx: &Transaction<'_>) -> Result<(), HandlerError>;
}

/// What became of one received message.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Claimed, handled, SUCCEEDED; message deleted.
    Succeeded {
        rescued: bool,
    },
    /// Handler asked to retry: job PENDING until `after`; message hidden as long.
    Retried {
        after: Duration,
        rescued: bool,
    },
    /// Handler failed permanently (or the job was cancelled): DEAD; message deleted.
    Dead {
        reason: String,
    },
    /// Job already SUCCEEDED or DEAD: deleted without running.
    TerminalSkip,
    /// A retry not yet due: visibility changed to the remaining time.
    NotDue {
        after: Duration,
    },
    /// Another worker holds a live lease: message hidden until it expires.
    Busy {
        after: Duration,
    },
    /// A CAS found the job changed under us (claimed by another, redriven,
    /// rescued): nothing else was done.
    Fenced,
    /// A message of an older generation: rejected and deleted.
    Stale,
    /// Neither run nor deleted: SQS's redrive policy will move it to the DLQ.
    Unparseable,
    UnknownJob,
    WrongWiring(String),
}

impl Disposition {
    pub fn label(&self) -> &'static str {
        match self {
            Disposition::Succeeded { .. } => "succeeded",
            Disposition::Retried { .. } => "retried",
            Disposition::Dead { .. } => "dead",
            Disposition::TerminalSkip => "terminal_skip",
            Disposition::NotDue { .. } => "not_due",
            Disposition::Busy { .. } => "busy",
            Disposition::Fenced => "fenced",
            Disposition::Stale => "stale",
            Disposition::Unparseable => "unparseable",
            Disposition::UnknownJob => "unknown_job",
            Disposition::WrongWiring(_) => "wrong_wiring",
        }
    }
}

/// What a DLQ message did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DlqDisposition {
    /// The job was non-terminal and is now DEAD ('DLQ'); message deleted.
    MarkedDead,
    /// The job is terminal already; message deleted.
    AlreadyTerminal,
    /// A live lease: left alone (the message stays for a later look).
    LeaseLive,
    /// Not a job message or no such job: left in the DLQ for a human.
    Unrecognised,
}

impl DlqDisposition {
    /// `outbox_dlq_job`'s answer (migrations/0006_job_protocol.sql).
    pub(crate) fn parse(s: &str) -> Option<DlqDisposition> {
        Some(match s {
            "marked_dead" => DlqDisposition::MarkedDead,
            "already_terminal" => DlqDisposition::AlreadyTerminal,
            "lease_live" => DlqDisposition::LeaseLive,
            "unrecognised" => DlqDisposition::Unrecognised,
            _ => return None,
        })
    }
}
