//! The one place that decides what is retried, what is DEAD, and how long to
//! wait. Everything else asks here. A kind of destination says what its
//! service's answers mean ([`Failure`], `publish::kind`); what is done about
//! them is decided here, the same for every kind.

use std::time::Duration;

/// What to do about a failed entry or call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remedy {
    /// Send it again, alone, after a backoff.
    Retry,
    /// It will never be accepted: mark the row DEAD.
    Dead,
    /// The request as a whole was refused for a reason one entry may have
    /// caused: send each entry alone to find out which.
    Split,
    /// Refused as longer than the destination takes, though it was judged
    /// by its `MaximumMessageSize`: the limit was lowered since it was
    /// read. Read it again and judge the entry anew (through S3, or DEAD
    /// `too_large`); if it was not lowered, the entry is DEAD.
    Reread,
}

/// What a failed entry or call means, whatever the service's words for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Told to slow down (throttling), even when marked as the sender's fault.
    Throttled,
    /// May pass: the service's own trouble, the network, a timeout, or what
    /// an operator must mend (the credentials, a permission, a key).
    Passing,
    /// The destination does not exist (deleted, or never created): an
    /// operator may create it; a destination looked up for the first time
    /// is DEAD.
    Missing,
    /// Refused as longer than the destination takes.
    TooLong,
    /// Refused for good: the request's fault.
    Refused,
}

/// Whether a failure tells the sender to slow down (the lane's concurrency
/// limit shrinks: [`crate::policy::concurrency`]).
pub fn slows_down(failure: Failure) -> bool {
    failure == Failure::Throttled
}

/// How a start-up step failed: the server went away under it (a restart,
/// a failover, the network), or it refused what it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartUpFailure {
    /// Start-up is tried again after the reconnect backoff.
    ServerWentAway,
    /// Start-up ends with the check's message (exit 2).
    Refused,
}

/// SQLSTATEs of a server shutting down or starting up: `admin_shutdown`,
/// `crash_shutdown`, `cannot_connect_now`.
const SERVER_GOING: &[&str] = &["57P01", "57P02", "57P03"];

/// Whether a PostgreSQL error is the server going away: shutting down or
/// starting up, the connection closed or reset (not a refused connection,
/// nor a value that did not convert, which would fail the same way again).
pub fn server_going(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        Some(db) => SERVER_GOING.contains(&db.code().code()),
        None => {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
            let io = std::error::Error::source(e).and_then(|s| s.downcast_ref::<std::io::Error>());
            e.is_closed()
                || io.is_some_and(|io| {
                    matches!(io.kind(), ConnectionReset | ConnectionAborted | UnexpectedEof | BrokenPipe)
                })
        }
    }
}

/// What a failed database step says about the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFailure {
    /// No connection was made; `going`: the server was reached and is
    /// shutting down or starting up, or dropped the connection.
    Connect { going: bool },
    /// A query failed; `going`: see [`server_going`].
    Query { going: bool },
    /// A check refused what it found, or a deadline passed.
    Refusal,
}

/// Classify a failed start-up step. `connected` says whether this start-up
/// already reached the server: a first connection that fails is a wrong URL
/// or a server that is not there, said at once; once connected, a new
/// connection that fails, or one that closes, is the server going away.
pub fn classify_start_up(failure: DbFailure, connected: bool) -> StartUpFailure {
    let went_away = match failure {
        DbFailure::Connect { going } => connected || going,
        DbFailure::Query { going } => going,
        DbFailure::Refusal => false,
    };
    if went_away {
        StartUpFailure::ServerWentAway
    } else {
        StartUpFailure::Refused
    }
}

/// What a failed lookup of a destination (seen for the first time) means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// There is no such destination: its rows are DEAD (`queue_not_found`,
    /// or its kind's code).
    Missing,
    /// Anything else (the network, the credentials, throttling): its rows
    /// wait and it is looked up again.
    Retry,
}

/// A failed lookup.
pub fn classify_lookup(failure: Failure) -> Lookup {
    match failure {
        Failure::Missing => Lookup::Missing,
        _ => Lookup::Retry,
    }
}

/// A failed entry of a batch. A destination that went missing under the
/// relay is retried: an operator may create it again, and its rows are
/// safe meanwhile.
pub fn classify_entry(failure: Failure) -> Remedy {
    match failure {
        Failure::Throttled | Failure::Passing | Failure::Missing => Remedy::Retry,
        Failure::TooLong => Remedy::Reread,
        Failure::Refused => Remedy::Dead,
    }
}

/// A call of `entries` entries that failed as a whole: refused for a
/// reason one entry may have caused, each entry is sent alone.
pub fn classify_call(failure: Failure, entries: usize) -> Remedy {
    match failure {
        Failure::Throttled | Failure::Passing | Failure::Missing => Remedy::Retry,
        _ if entries > 1 => Remedy::Split,
        Failure::TooLong => Remedy::Reread,
        Failure::Refused => Remedy::Dead,
    }
}

/// Doublings of the backoff at most: past them the cap has long been reached
/// (2^20 times any base the configuration allows).
pub const MAX_DOUBLINGS: u32 = 20;

/// Exponential backoff after `failures` failures: `base * 2^failures`
/// (at most [`MAX_DOUBLINGS`]), capped. Every wait of the relay is this
/// formula: in memory here, the table path's in SQL ([`backoff_sql`]). The
/// consumer's protocol (`migrations/0006_job_protocol.sql`,
/// `outbox_job_backoff`) is the same on its attempt count (attempt − 1
/// failures), with jitter over the upper half, since many workers retry at
/// once.
pub fn backoff(failures: u32, base: Duration, cap: Duration) -> Duration {
    base.saturating_mul(1u32 << failures.min(MAX_DOUBLINGS)).min(cap)
}

/// Entries SQS did not take, retried from memory by a streaming lane: from
/// this ...
pub const IN_MEMORY_BASE: Duration = Duration::from_millis(200);
/// ... doubling to this (a lane stalled longer spools to the table).
pub const IN_MEMORY_CAP: Duration = Duration::from_secs(10);

/// A table claim's archive segment is tried this many times before its
/// events are deferred (sent again later) rather than settled unarchived.
pub const ARCHIVE_CLAIM_TRIES: u32 = 3;

/// The wait before the archive's next try after `failures` failed writes:
/// the stream's archiver retries for as long as it takes (its events stay
/// unsettled, the slot unconfirmed), from 200 ms doubling to 10 s.
pub fn archive_backoff(failures: u32) -> Duration {
    backoff(failures, IN_MEMORY_BASE, IN_MEMORY_CAP)
}

/// How long one object's write to S3 may take before it fails (and is
/// retried like any failed send): half the lane's stall timeout (from 1 s to
/// 20 s, the SDK's own attempt timeout) plus a second per 4 MiB of body, so a
/// hung endpoint frees the lane before the lane would spool for it, while a
/// large body on a slow link still gets the time its bytes need.
pub fn s3_write_deadline(stall_timeout: Duration, body_bytes: usize) -> Duration {
    let base = (stall_timeout / 2).clamp(Duration::from_secs(1), Duration::from_secs(20));
    base + Duration::from_secs_f64(body_bytes as f64 / (4u64 << 20) as f64)
}

/// [`backoff`] as SQL, for the table path's `next_attempt_at`: seconds as
/// float8, from the row's `attempts` column and the `retry_base` /
/// `retry_max` parameters (seconds).
pub fn backoff_sql(attempts: &str, base_secs: &str, max_secs: &str) -> String {
    format!("least({max_secs}::float8, {base_secs}::float8 * power(2, least({attempts}, {MAX_DOUBLINGS})))")
}

/// The wait before reconnecting after a failed replication session or
/// connection: 250 ms doubling to 10 s over consecutive failures. A session
/// that streamed for [`Reconnect::STABLE`] or longer was healthy: the count
/// starts again, so a server restart hours later is followed by a prompt
/// reconnect rather than the cap.
#[derive(Debug, Default, Clone)]
pub struct Reconnect {
    failures: u32,
}

impl Reconnect {
    pub const BASE: Duration = Duration::from_millis(250);
    pub const CAP: Duration = Duration::from_secs(10);
    /// A session streaming this long counts as healthy.
    pub const STABLE: Duration = Duration::from_secs(5);

    /// A connection or round failed: how long to wait before the next.
    pub fn failed(&mut self) -> Duration {
        let wait = backoff(self.failures, Self::BASE, Self::CAP);
        self.failures = self.failures.saturating_add(1);
        wait
    }

    /// Work succeeded: the next failure waits [`Reconnect::BASE`] again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// A replication session ended with an error after streaming for
    /// `streamed_for` (`None`: it never started streaming).
    pub fn session_ended(&mut self, streamed_for: Option<Duration>) -> Duration {
        if streamed_for.is_some_and(|d| d >= Self::STABLE) {
            self.succeeded();
        }
        self.failed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_up_failures() {
        let refused = DbFailure::Connect { going: false };
        // A server never reached is said at once; one that was reached and
        // then refused a connection went away.
        assert_eq!(classify_start_up(refused, false), StartUpFailure::Refused);
        assert_eq!(classify_start_up(refused, true), StartUpFailure::ServerWentAway);
        assert_eq!(classify_start_up(DbFailure::Connect { going: true }, false), StartUpFailure::ServerWentAway);
        assert_eq!(classify_start_up(DbFailure::Query { going: true }, true), StartUpFailure::ServerWentAway);
        assert_eq!(classify_start_up(DbFailure::Query { going: false }, true), StartUpFailure::Refused);
        assert_eq!(classify_start_up(DbFailure::Refusal, true), StartUpFailure::Refused);
    }

    #[test]
    fn remedies() {
        use Failure::*;
        assert_eq!(classify_entry(Refused), Remedy::Dead);
        for passing in [Throttled, Passing, Missing] {
            assert_eq!(classify_entry(passing), Remedy::Retry);
            assert_eq!(classify_call(passing, 10), Remedy::Retry);
            assert_eq!(classify_call(passing, 1), Remedy::Retry);
        }
        assert_eq!(classify_entry(TooLong), Remedy::Reread);
        assert_eq!(classify_call(Refused, 10), Remedy::Split);
        assert_eq!(classify_call(TooLong, 10), Remedy::Split);
        assert_eq!(classify_call(Refused, 1), Remedy::Dead);
        assert_eq!(classify_call(TooLong, 1), Remedy::Reread);
        assert_eq!(classify_lookup(Missing), Lookup::Missing);
        assert_eq!(classify_lookup(Throttled), Lookup::Retry);
        assert!(slows_down(Throttled) && !slows_down(Passing));
        assert_eq!(
            backoff_sql("o.attempts", "$4", "$5"),
            "least($5::float8, $4::float8 * power(2, least(o.attempts, 20)))"
        );
    }

    #[test]
    fn backoff_doubles_to_a_cap() {
        let b = |n| backoff(n, Duration::from_millis(100), Duration::from_secs(5));
        assert_eq!(b(0), Duration::from_millis(100));
        assert_eq!(b(3), Duration::from_millis(800));
        assert_eq!(b(10), Duration::from_secs(5));
        assert_eq!(b(u32::MAX), Duration::from_secs(5));
    }

    #[test]
    fn reconnect_backoff_grows_then_resets_after_a_healthy_session() {
        let mut r = Reconnect::default();
        let waits: Vec<Duration> = (0..8).map(|_| r.session_ended(None)).collect();
        assert_eq!(waits[0], Duration::from_millis(250));
        assert_eq!(waits[1], Duration::from_millis(500));
        assert_eq!(waits[7], Duration::from_secs(10));
        // Short sessions are not healthy: still at the cap.
        assert_eq!(r.session_ended(Some(Duration::from_secs(1))), Duration::from_secs(10));
        // Twenty seconds of streaming: back to the start.
        assert_eq!(r.session_ended(Some(Duration::from_secs(20))), Duration::from_millis(250));
        assert_eq!(r.session_ended(None), Duration::from_millis(500));
        r.succeeded();
        assert_eq!(r.failed(), Duration::from_millis(250));
    }
}
