//! Every configuration key, declared once: its name (the file's spelling;
//! the environment's is derived from it), its kind with the range it must lie
//! in, its default and a line of documentation. Parsing, range checks, the
//! environment's names and the check of the reference in
//! docs/configuration.md all read this table.

use std::time::Duration;

use super::ConfigError;

/// What a key holds, and the range a value must lie in.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// Checked by the code that uses it (a URL, a name, an address, a choice).
    Text,
    /// `true` or `false`.
    Flag,
    /// A duration such as `10s` or `5ms`; `off` is accepted where `off` is set.
    Duration { min: Duration, max: Duration, off: bool },
    /// A size such as `256MB` (powers of 1024).
    Size { min: u64, max: u64 },
    /// A whole number.
    Count { min: usize, max: usize },
}

/// One configuration key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// As in the file; `sqs.region` is `region` in the `[sqs]` table.
    pub name: &'static str,
    pub kind: Kind,
    /// The value used when the key is not given; `None`: none (or required).
    pub default: Option<&'static str>,
    pub doc: &'static str,
}

impl Key {
    /// `OUTBOX_RELAY_` and the name in upper case, `.` as `_`.
    pub fn env_name(&self) -> String {
        format!("OUTBOX_RELAY_{}", self.name.replace('.', "_").to_ascii_uppercase())
    }
}

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}
const DAY: u64 = 86_400;

const fn key(name: &'static str, kind: Kind, default: Option<&'static str>, doc: &'static str) -> Key {
    Key { name, kind, default, doc }
}
const fn duration(min: Duration, max: Duration) -> Kind {
    Kind::Duration { min, max, off: false }
}

pub const DATABASE_URL: Key =
    key("database_url", Kind::Text, None, "the PostgreSQL to read (a postgres:// URL); required");
pub const MODE: Key =
    key("mode", Kind::Text, Some("cdc"), "cdc | polling | auto (CDC when the server and role allow it)");
pub const SLOT: Key = key("slot", Kind::Text, Some("outbox_relay"), "the logical replication slot");
pub const PUBLICATION: Key = key("publication", Kind::Text, Some("outbox_relay"), "the publication the slot reads");
pub const METRICS_ADDR: Key =
    key("metrics_addr", Kind::Text, None, "/metrics, /healthz, /readyz on this address; \"off\" or unset disables");
pub const HEARTBEAT_INTERVAL: Key = key(
    "heartbeat_interval",
    duration(ms(100), secs(3_600)),
    Some("10s"),
    "a transactional logical message keeps the slot moving on a quiet database",
);
pub const LINGER: Key =
    key("linger", duration(Duration::ZERO, secs(1)), Some("5ms"), "how long a lane waits to fill a batch");
pub const ADAPTIVE_LINGER: Key =
    key("adaptive_linger", Kind::Flag, Some("true"), "a lane with nothing in flight sends at once");
pub const FAILOVER: Key = key("failover", Kind::Flag, Some("false"), "PostgreSQL 17+: create the slot with FAILOVER");
pub const FAIR_QUEUES: Key = key(
    "fair_queues",
    Kind::Flag,
    Some("true"),
    "a standard queue gets the row's group_key as MessageGroupId (SQS fair queues)",
);
pub const PUBLISHED_ROWS: Key =
    key("published_rows", Kind::Text, Some("delete"), "delete | keep (marked PUBLISHED, swept by retention)");
pub const MAX_IN_FLIGHT_BATCHES: Key = key(
    "max_in_flight_batches",
    Kind::Count { min: 1, max: 1024 },
    Some("256"),
    "the cap of a lane's SendMessageBatch calls in flight (the limit under it adapts)",
);
pub const MAX_CONCURRENT_CALLS: Key = key(
    "max_concurrent_calls",
    Kind::Count { min: 1, max: 10_000 },
    Some("256"),
    "the cap of calls in flight to the destinations' service over every lane: each is a connection with its buffers",
);
pub const MAX_UNSETTLED_EVENTS: Key = key(
    "max_unsettled_events",
    Kind::Count { min: 1, max: 10_000_000 },
    Some("20000"),
    "events read but not yet settled, all lanes",
);
pub const MAX_UNSETTLED_BYTES: Key = key(
    "max_unsettled_bytes",
    Kind::Size { min: 1 << 20, max: 64 << 30 },
    Some("64MB"),
    "bytes of those events: bounds memory whatever the body size",
);
pub const CONNECT_TIMEOUT: Key = key(
    "connect_timeout",
    duration(ms(100), secs(600)),
    Some("10s"),
    "one connection attempt to PostgreSQL (TCP, TLS, authentication)",
);
pub const QUERY_TIMEOUT: Key =
    key("query_timeout", duration(ms(100), secs(3_600)), Some("30s"), "a start-up check or control query");
pub const LANE_STALL_TIMEOUT: Key = key(
    "lane_stall_timeout",
    duration(secs(1), secs(DAY)),
    Some("30s"),
    "a lane whose oldest unsettled event is older spools to the table",
);
pub const MAX_TABLE_CONNECTIONS: Key = key(
    "max_table_connections",
    Kind::Count { min: 1, max: 1_000 },
    Some("16"),
    "connections the table path's lanes (polling, spool drains) share, a round each at a time",
);
pub const LANE_IDLE_TIMEOUT: Key = key(
    "lane_idle_timeout",
    duration(ms(100), secs(DAY)),
    Some("30s"),
    "a stream lane with nothing to do this long is closed; its next event opens it again",
);
pub const MAX_RETAINED_WAL: Key = key(
    "max_retained_wal",
    Kind::Size { min: 1 << 20, max: 1 << 50 },
    Some("256MB"),
    "WAL the slot may hold for a sick lane (acts at half of it)",
);
pub const RETRY_BASE: Key =
    key("retry_base", duration(ms(10), secs(3_600)), Some("2s"), "table-path backoff: retry_base x 2^attempts");
pub const RETRY_MAX: Key =
    key("retry_max", duration(ms(10), secs(DAY)), Some("300s"), "the backoff's cap; at least retry_base");
pub const POLL_INTERVAL: Key = key(
    "poll_interval",
    duration(ms(10), secs(3_600)),
    Some("100ms"),
    "table path: wait between claims that found nothing",
);
pub const RETENTION: Key = key(
    "retention",
    Kind::Duration { min: secs(60), max: secs(3_650 * DAY), off: true },
    Some("7d"),
    "kept PUBLISHED rows older than this are deleted; \"off\" keeps them",
);
pub const TAKEOVER_TIMEOUT: Key = key(
    "takeover_timeout",
    duration(secs(1), secs(3_600)),
    Some("10s"),
    "a standby leads within this of the leader's death",
);
pub const READINESS_STALL: Key = key(
    "readiness_stall",
    duration(secs(1), secs(DAY)),
    Some("5m"),
    "/readyz fails when the slot has lag and has not moved this long",
);
pub const SQS_REGION: Key =
    key("sqs.region", Kind::Text, Some("us-east-1"), "the AWS region (else AWS_REGION, else us-east-1)");
pub const SQS_ENDPOINT_URL: Key =
    key("sqs.endpoint_url", Kind::Text, None, "an SQS-compatible endpoint; unset for AWS");
pub const SQS_QUEUE_URL_TEMPLATE: Key = key(
    "sqs.queue_url_template",
    Kind::Text,
    None,
    "a queue URL with {destination} (and {region}): a destination not in [destinations] is looked up there on first use",
);
pub const SNS_TOPIC_ARN_TEMPLATE: Key = key(
    "sns.topic_arn_template",
    Kind::Text,
    None,
    "a topic ARN with {destination} (and {region}): a destination not in [destinations] is looked up there on first use",
);
pub const SQS_ASSUME_ROLE_ARN: Key =
    key("sqs.assume_role_arn", Kind::Text, None, "an IAM role to assume (STS) on top of the credential chain");
pub const S3_BUCKET: Key = key(
    "s3.bucket",
    Kind::Text,
    None,
    "bodies over the threshold go through this bucket (SQS Extended Client format); unset: they are DEAD",
);
pub const S3_KEY_PREFIX: Key = key("s3.key_prefix", Kind::Text, None, "prepended to every object's key");
pub const S3_ENDPOINT_URL: Key =
    key("s3.endpoint_url", Kind::Text, None, "an S3-compatible endpoint (path-style addressing); unset for AWS");
pub const S3_THRESHOLD: Key = key(
    "s3.threshold",
    Kind::Text,
    Some("queue"),
    "queue (over the queue's MaximumMessageSize) | always | a size such as 64KB",
);
pub const S3_MAX_BODY_BYTES: Key = key(
    "s3.max_body_bytes",
    Kind::Size { min: 1 << 20, max: 2 << 30 },
    Some("32MB"),
    "a body over this is DEAD (too_large) even through S3; counts in max_unsettled_bytes",
);
pub const ARCHIVE_BUCKET: Key = key(
    "archive.bucket",
    Kind::Text,
    None,
    "every published event is written to this bucket before it is settled, for `replay`; unset: no archive",
);
pub const ARCHIVE_KEY_PREFIX: Key =
    key("archive.key_prefix", Kind::Text, Some("outbox-archive/"), "the archive's keys start with this");
pub const ARCHIVE_WINDOW: Key = key(
    "archive.window",
    Kind::Duration { min: secs(1), max: secs(3_650 * DAY), off: true },
    Some("7d"),
    "segments older than this are deleted by the relay; \"off\" leaves it to a lifecycle rule",
);
pub const ARCHIVE_FLUSH_INTERVAL: Key = key(
    "archive.flush_interval",
    duration(ms(1), secs(60)),
    Some("1s"),
    "the stream's published events are archived together this long (settlement waits as long)",
);
pub const ARCHIVE_SEGMENT_BYTES: Key = key(
    "archive.segment_bytes",
    Kind::Size { min: 1 << 20, max: 1 << 30 },
    Some("8MB"),
    "the gathering is archived early once its published bodies reach this, before the interval ends",
);

/// Every key, in the order of the reference in docs/configuration.md.
pub const KEYS: &[Key] = &[
    DATABASE_URL,
    MODE,
    SLOT,
    PUBLICATION,
    METRICS_ADDR,
    HEARTBEAT_INTERVAL,
    LINGER,
    ADAPTIVE_LINGER,
    FAILOVER,
    FAIR_QUEUES,
    PUBLISHED_ROWS,
    MAX_IN_FLIGHT_BATCHES,
    MAX_CONCURRENT_CALLS,
    MAX_UNSETTLED_EVENTS,
    MAX_UNSETTLED_BYTES,
    CONNECT_TIMEOUT,
    QUERY_TIMEOUT,
    LANE_STALL_TIMEOUT,
    LANE_IDLE_TIMEOUT,
    MAX_TABLE_CONNECTIONS,
    MAX_RETAINED_WAL,
    RETRY_BASE,
    RETRY_MAX,
    POLL_INTERVAL,
    RETENTION,
    TAKEOVER_TIMEOUT,
    READINESS_STALL,
    SQS_REGION,
    SQS_ENDPOINT_URL,
    SQS_ASSUME_ROLE_ARN,
    SQS_QUEUE_URL_TEMPLATE,
    SNS_TOPIC_ARN_TEMPLATE,
    S3_BUCKET,
    S3_KEY_PREFIX,
    S3_ENDPOINT_URL,
    S3_THRESHOLD,
    S3_MAX_BODY_BYTES,
    ARCHIVE_BUCKET,
    ARCHIVE_KEY_PREFIX,
    ARCHIVE_WINDOW,
    ARCHIVE_FLUSH_INTERVAL,
    ARCHIVE_SEGMENT_BYTES,
];

/// The key of that name.
pub fn find(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// Where a key's value came from, for the error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Not given: the key's default applies.
    Default,
    File,
    /// The environment variable of this name.
    Env(String),
    /// A command-line flag.
    Flag,
}

/// A value read for a key, and where from (for the error messages).
pub struct Raw<'a> {
    pub key: &'a Key,
    /// `None`: the key was not given; the default applies.
    pub given: Option<String>,
    pub origin: Origin,
}

impl Raw<'_> {
    fn text(&self) -> Option<String> {
        self.given.clone().or_else(|| self.key.default.map(str::to_string))
    }

    /// The key as the user spelled it where it came from.
    fn spelled(&self) -> String {
        match &self.origin {
            Origin::Env(name) => name.clone(),
            Origin::Flag => format!("--{}", self.key.name.replace(['_', '.'], "-")),
            Origin::Default | Origin::File => self.key.name.to_string(),
        }
    }

    /// Where the value came from, in words.
    fn whence(&self) -> String {
        match &self.origin {
            Origin::Env(name) => format!("the environment variable {name}"),
            Origin::Flag => format!("the flag {}", self.spelled()),
            Origin::File => "the config file".into(),
            Origin::Default => "its default".into(),
        }
    }

    pub fn flag(&self) -> Result<bool, ConfigError> {
        let v = self.text().unwrap_or_default();
        v.parse().map_err(|_| {
            let name = self.spelled();
            ConfigError::Invalid(format!("{name} {v:?} is not true or false"))
        })
    }

    /// `None` for `off` where the key allows it.
    pub fn duration(&self) -> Result<Option<Duration>, ConfigError> {
        let Kind::Duration { min, max, off } = self.key.kind else { unreachable!("{} is a duration", self.key.name) };
        let name = self.key.name;
        let s = self.text().unwrap_or_default();
        if off && (s == "off" || s == "0") {
            return Ok(None);
        }
        let d = humantime::parse_duration(&s)
            .map_err(|e| ConfigError::Invalid(format!("{name} = {s:?} is not a duration such as 10s or 5ms: {e}")))?;
        if d < min || d > max {
            return Err(ConfigError::Invalid(format!(
                "{name} = {s:?} is out of range: it must be from {} to {}",
                show_duration(min),
                show_duration(max)
            )));
        }
        Ok(Some(d))
    }

    /// A duration that has no `off`.
    pub fn required_duration(&self) -> Result<Duration, ConfigError> {
        Ok(self.duration()?.expect("only retention may be off"))
    }

    pub fn size(&self) -> Result<u64, ConfigError> {
        let Kind::Size { min, max } = self.key.kind else { unreachable!("{} is a size", self.key.name) };
        let s = self.text().unwrap_or_default();
        let n = bytes(self.key.name, &s)?;
        if n < min || n > max {
            return Err(ConfigError::Invalid(format!(
                "{} = {s:?} is out of range: it must be from {} to {}",
                self.key.name,
                show_bytes(min),
                show_bytes(max)
            )));
        }
        Ok(n)
    }

    pub fn count(&self) -> Result<usize, ConfigError> {
        let Kind::Count { min, max } = self.key.kind else { unreachable!("{} is a count", self.key.name) };
        let name = self.key.name;
        let s = self.text().unwrap_or_default();
        let n: usize = s.parse().map_err(|_| ConfigError::Invalid(format!("{name} = {s:?} is not a whole number")))?;
        if n < min || n > max {
            return Err(ConfigError::Invalid(format!("{name} = {n} is out of range: it must be from {min} to {max}")));
        }
        Ok(n)
    }

    /// The value, or the default; `None` when neither. A value given as an
    /// empty string is refused, naming the key and where it came from: an
    /// empty bucket, endpoint or role would otherwise switch its feature off
    /// (or point it elsewhere) without a word. Leave the key out to unset it.
    pub fn string(&self) -> Result<Option<String>, ConfigError> {
        match self.text() {
            Some(s) if s.trim().is_empty() => Err(empty(&self.spelled(), &self.whence(), self.key.name)),
            t => Ok(t),
        }
    }

    /// The value or the default, where an empty string is a value (a key
    /// prefix of none).
    pub fn string_or_empty(&self) -> String {
        self.text().unwrap_or_default()
    }
}

/// The refusal of a value given as an empty string: `spelled` as the user
/// wrote the key, `whence` where it came from, `unset` what leaving it out
/// leaves unset.
pub fn empty(spelled: &str, whence: &str, unset: &str) -> ConfigError {
    ConfigError::Invalid(format!(
        "{spelled} is set to an empty string (in {whence}): give it a value, or remove it to leave {unset} unset"
    ))
}

/// A key's range as the docs write it (`100ms–1h`), or `None` for text and flags.
pub fn range(k: &Key) -> Option<String> {
    match k.kind {
        Kind::Duration { min, max, off } => {
            let off = if off { " (or `off`)" } else { "" };
            Some(format!("{}–{}{off}", show_duration(min), show_duration(max)))
        }
        Kind::Size { min, max } => Some(format!("{}–{}", show_bytes(min), show_bytes(max))),
        Kind::Count { min, max } => Some(format!("{min}–{max}")),
        Kind::Text | Kind::Flag => None,
    }
}

/// A duration in the largest unit that divides it: `100ms`, `1h`, `3650d`.
fn show_duration(d: Duration) -> String {
    let ms = d.as_millis();
    let units = [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s")];
    match units.iter().find(|(n, _)| ms >= *n && ms % n == 0) {
        Some((n, unit)) => format!("{}{unit}", ms / n),
        None if ms == 0 => "0".into(),
        None => format!("{ms}ms"),
    }
}

pub(super) fn show_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 50 && n % (1 << 50) == 0 => format!("{}PB", n >> 50),
        n if n >= 1 << 40 && n % (1 << 40) == 0 => format!("{}TB", n >> 40),
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}GB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MB", n >> 20),
        n => format!("{n} bytes"),
    }
}

/// `256MB`, `1GB`, `512kB` or a plain number of bytes; units are powers of
/// 1024, as in PostgreSQL's settings.
pub fn bytes(key: &str, s: &str) -> Result<u64, ConfigError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1 << 10,
        "mb" => 1 << 20,
        "gb" => 1 << 30,
        "tb" => 1 << 40,
        _ => 0,
    };
    match num.parse::<u64>() {
        Ok(n) if mult > 0 && n > 0 => {
            n.checked_mul(mult).ok_or_else(|| ConfigError::Invalid(format!("{key} = {s:?} is too large")))
        }
        _ => Err(ConfigError::Invalid(format!("{key} = {s:?} is not a size such as 256MB or 1GB"))),
    }
}
