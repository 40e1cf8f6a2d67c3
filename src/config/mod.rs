//! Configuration: a TOML file, then `OUTBOX_RELAY_*` environment variables,
//! then command-line flags, each overriding the one before. Validated once,
//! with errors that say how to fix them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use crate::publish::kind::Kind as DestinationKind;
use crate::publish::template::AddressTemplate;

pub mod keys;
pub mod outbox;

pub use keys::bytes;
use keys::{Key, Origin, Raw};

/// How the relay reads the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Cdc,
    Polling,
    Auto,
}

impl FromStr for Mode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "cdc" => Ok(Mode::Cdc),
            "polling" => Ok(Mode::Polling),
            "auto" => Ok(Mode::Auto),
            _ => Err(ConfigError::Invalid(format!("mode {s:?} is not one of cdc, polling, auto"))),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Cdc => "cdc",
            Mode::Polling => "polling",
            Mode::Auto => "auto",
        })
    }
}

/// What settlement does with a published row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PublishedRows {
    /// Delete it (one small WAL record; the table holds only what is left to
    /// do and DEAD rows). The default.
    #[default]
    Delete,
    /// Keep it as PUBLISHED with `published_at` (history in the table, swept
    /// by `retention`): a full row version and index entries per row.
    Keep,
}

impl FromStr for PublishedRows {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "delete" => Ok(PublishedRows::Delete),
            "keep" => Ok(PublishedRows::Keep),
            _ => Err(ConfigError::Invalid(format!("published_rows {s:?} is not one of delete, keep"))),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("config file {path} is not valid TOML for outbox-relay: {message}")]
    Parse { path: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// The file's keys, flattened (`[sqs] region` is `sqs.region`), and its
/// destinations. Unknown keys are refused when the file is read.
#[derive(Debug, Default, Clone)]
pub struct FileConfig {
    values: BTreeMap<String, String>,
    pub destinations: BTreeMap<String, String>,
    /// `[s3.buckets]`: a destination's own bucket, `bucket` or `bucket/prefix`.
    pub s3_buckets: BTreeMap<String, String>,
    /// `[[outbox]]`: mapped tables, as written.
    pub outbox: Vec<outbox::Written>,
}

impl FileConfig {
    /// Parse a TOML text; an error says the line, or which key is unknown.
    pub fn parse(text: &str) -> Result<FileConfig, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        let mut file = FileConfig::default();
        for (k, v) in table {
            match (k.as_str(), v) {
                ("destinations", toml::Value::Table(t)) => {
                    for (name, url) in t {
                        let url = url
                            .as_str()
                            .ok_or(format!("destinations.{name} must be a string (a queue URL or a topic ARN)"))?;
                        file.destinations.insert(name, url.to_string());
                    }
                }
                ("outbox", toml::Value::Table(t)) => file.outbox.push(outbox::Written::from_toml(t, 1)?),
                ("outbox", toml::Value::Array(a)) => {
                    for (i, t) in a.into_iter().enumerate() {
                        let toml::Value::Table(t) = t else { return Err("[[outbox]] must be tables".into()) };
                        file.outbox.push(outbox::Written::from_toml(t, i + 1)?);
                    }
                }
                ("sqs" | "sns" | "s3" | "archive", toml::Value::Table(t)) => {
                    for (inner, v) in t {
                        match (k.as_str(), inner.as_str(), v) {
                            ("s3", "buckets", toml::Value::Table(b)) => {
                                for (name, bucket) in b {
                                    let bucket = bucket.as_str().ok_or(format!(
                                        "s3.buckets.{name} must be a string (a bucket, or bucket/prefix)"
                                    ))?;
                                    file.s3_buckets.insert(name, bucket.to_string());
                                }
                            }
                            (_, _, v) => file.set_value(&format!("{k}.{inner}"), v)?,
                        }
                    }
                }
                (_, v) => file.set_value(&k, v)?,
            }
        }
        Ok(file)
    }

    fn set_value(&mut self, name: &str, v: toml::Value) -> Result<(), String> {
        let text = match v {
            toml::Value::String(s) => s,
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => return Err(format!("{name} = {other} is not a string, a number or true/false")),
        };
        self.set(name, text)
    }

    /// Set a key as the file would; refused if there is no such key.
    pub fn set(&mut self, name: &str, value: impl Into<String>) -> Result<(), String> {
        if keys::find(name).is_none() {
            let known: Vec<&str> = keys::KEYS.iter().map(|k| k.name).collect();
            return Err(format!("unknown key `{name}`: the keys are {}, [destinations], [[outbox]]", known.join(", ")));
        }
        self.values.insert(name.to_string(), value.into());
        Ok(())
    }

    /// A file of these keys and destinations, as if written in TOML.
    pub fn of(keys: &[(&str, &str)], destinations: &[(&str, &str)]) -> Result<FileConfig, String> {
        let mut file = FileConfig::default();
        for (key, value) in keys {
            file.set(key, *value)?;
        }
        file.destinations = destinations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Ok(file)
    }

    /// The keys given, by name.
    pub fn values(&self) -> &BTreeMap<String, String> {
        &self.values
    }
}

/// Values given on the command line; they win over the file and environment.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub database_url: Option<String>,
    pub mode: Option<Mode>,
    pub slot: Option<String>,
    pub publication: Option<String>,
    pub metrics_addr: Option<String>,
    pub sqs_endpoint_url: Option<String>,
}

/// The validated configuration. `Config::default()` is only where
/// [`Config::resolve`] starts: zero durations and no database.
#[derive(Clone, Default)]
pub struct Config {
    pub database_url: String,
    pub mode: Mode,
    pub slot: String,
    pub publication: String,
    pub metrics_addr: Option<SocketAddr>,
    pub sqs_region: String,
    pub sqs_endpoint_url: Option<String>,
    pub sqs_assume_role_arn: Option<String>,
    /// Tables teams already have, read as outbox rows (`[[outbox]]`).
    pub mapped: Vec<crate::mapping::Mapping>,
    /// Lane name → its address: a queue URL, or a topic or event bus ARN.
    pub destinations: BTreeMap<String, String>,
    /// `sqs.queue_url_template` or `sns.topic_arn_template`: destinations
    /// beyond `destinations`.
    pub destination_template: Option<AddressTemplate>,
    /// Bodies through S3; `None`: no bucket configured.
    pub s3: Option<S3Config>,
    /// Every published event archived in S3 (`[archive]`); `None`: no
    /// bucket configured.
    pub archive: Option<ArchiveConfig>,
    /// How often a transactional logical message is written so the slot moves
    /// even when this database is quiet.
    pub heartbeat_interval: Duration,
    /// How long a lane waits for more entries before sending a short batch.
    pub linger: Duration,
    /// A lane with nothing in flight sends at once; it lingers only while
    /// batches are in flight (default). Off: every short batch lingers.
    pub adaptive_linger: bool,
    /// Create the slot with FAILOVER (PostgreSQL 17+), so a standby running
    /// `sync_replication_slots` keeps it and a promotion needs no catch-up.
    pub failover: bool,
    /// A standard queue gets the row's `group_key` as `MessageGroupId` (SQS
    /// fair queues).
    pub fair_queues: bool,
    /// SendMessageBatch calls in flight per lane.
    pub max_in_flight_batches: usize,
    /// Calls in flight to the destinations' service, over every lane
    /// ([`crate::publish::limit`]).
    pub max_concurrent_calls: usize,
    /// Events read from the slot but not yet settled, across all lanes.
    pub max_unsettled_events: usize,
    /// Bytes (bodies and attributes) of those events: with the replication
    /// client's buffer and the table path's claims sized from it, the bound
    /// on the relay's memory whatever the bodies' size.
    pub max_unsettled_bytes: u64,
    /// How long one connection attempt to PostgreSQL (TCP, TLS, authentication)
    /// may take before it fails with a message naming the server.
    pub connect_timeout: Duration,
    /// How long a start-up check or a control query (leader lock, monitor,
    /// slot lookups) may wait for PostgreSQL's answer.
    pub query_timeout: Duration,
    /// A streaming lane whose oldest unsettled event is older than this spools.
    pub lane_stall_timeout: Duration,
    /// A stream lane with nothing to do for this long is closed.
    pub lane_idle_timeout: Duration,
    /// Connections the table path's lanes share.
    pub max_table_connections: usize,
    /// WAL the slot may hold (current WAL minus confirmed flush) before the
    /// lane holding it back spools.
    pub max_retained_wal: u64,
    /// Backoff of rows handed to the table: `retry_base × 2^attempts`, capped.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// How often the table path looks for due rows when it found none.
    pub poll_interval: Duration,
    /// PUBLISHED rows older than this are deleted; `None` keeps them.
    pub retention: Option<Duration>,
    /// Published rows are deleted (default) or kept as PUBLISHED.
    pub published_rows: PublishedRows,
    /// `/readyz` fails when the confirmed LSN has not moved this long while the slot has lag.
    pub readiness_stall: Duration,
    /// A standby takes over within this of the leader's death.
    pub takeover_timeout: Duration,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &outbox_pgconn::redact(&self.database_url))
            .field("mode", &self.mode)
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("metrics_addr", &self.metrics_addr)
            .field("sqs_region", &self.sqs_region)
            .field("sqs_endpoint_url", &self.sqs_endpoint_url)
            .field("destinations", &self.destinations)
            .field("destination_template", &self.destination_template)
            .finish_non_exhaustive()
    }
}

const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// Where each key's value comes from: flags, then the environment, then the
/// file, then the key's default.
struct Sources<'a> {
    cli: BTreeMap<&'static str, String>,
    env: &'a BTreeMap<String, String>,
    file: &'a FileConfig,
}

impl Sources<'_> {
    fn get(&self, key: &'static Key) -> Raw<'static> {
        let env_name = key.env_name();
        let (given, origin) = match (self.cli.get(key.name), self.env.get(&env_name)) {
            (Some(v), _) => (Some(v.clone()), Origin::Flag),
            (None, Some(v)) => (Some(v.clone()), Origin::Env(env_name)),
            (None, None) => match self.file.values.get(key.name) {
                Some(v) => (Some(v.clone()), Origin::File),
                None => (None, Origin::Default),
            },
        };
        Raw { key, given, origin }
    }
}

impl Overrides {
    fn by_key(&self) -> BTreeMap<&'static str, String> {
        let given = [
            (&keys::DATABASE_URL, self.database_url.clone()),
            (&keys::MODE, self.mode.map(|m| m.to_string())),
            (&keys::SLOT, self.slot.clone()),
            (&keys::PUBLICATION, self.publication.clone()),
            (&keys::METRICS_ADDR, self.metrics_addr.clone()),
            (&keys::SQS_ENDPOINT_URL, self.sqs_endpoint_url.clone()),
        ];
        given.into_iter().filter_map(|(k, v)| Some((k.name, v?))).collect()
    }
}

impl Config {
    /// What `run --check` prints: what the configuration sets, without its
    /// secrets (the database URL is not shown), and the memory the relay
    /// stays within, for a container's limit.
    pub fn summary(&self) -> String {
        let mib = |b: u64| b.div_ceil(1 << 20);
        // Without S3 a body is at most a message: 1 MiB, SQS's ceiling.
        let body = self.s3.as_ref().map_or(1 << 20, |s| s.max_body_bytes);
        let bound = self.max_unsettled_bytes + 2 * body + (64 << 20);
        let metrics = self.metrics_addr.map_or_else(|| "off".to_string(), |a| a.to_string());
        let template = match &self.destination_template {
            Some(t) => format!(" (and any by the {} template)", t.kind()),
            None => String::new(),
        };
        format!(
            "configuration accepted\n\
             mode: {}\nslot: {}\npublication: {}\n\
             destinations: {}{template}\nmapped tables: {}\nbodies through S3: {}\n\
             metrics, /healthz, /readyz, /leader: {metrics}\n\
             memory bound: {} MiB (max_unsettled_bytes {} MiB + 2 x the largest body {} MiB + 64 MiB)",
            self.mode,
            self.slot,
            self.publication,
            self.destinations.len(),
            self.mapped.len(),
            if self.s3.is_some() { "yes" } else { "no" },
            mib(bound),
            mib(self.max_unsettled_bytes),
            mib(body),
        )
    }

    /// Load `path` (if given), apply the environment, then `overrides`.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|source| ConfigError::Read { path: p.display().to_string(), source })?;
                FileConfig::parse(&text)
                    .map_err(|message| ConfigError::Parse { path: p.display().to_string(), message })?
            }
            None => FileConfig::default(),
        };
        let env: BTreeMap<String, String> = std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX)).collect();
        Config::resolve(file, &env, overrides)
    }

    /// Merge file, environment (`OUTBOX_RELAY_*` variables) and overrides, and
    /// validate the result.
    pub fn resolve(mut file: FileConfig, env: &BTreeMap<String, String>, o: &Overrides) -> Result<Config, ConfigError> {
        for (k, v) in env {
            if let Some(name) = k.strip_prefix("OUTBOX_RELAY_DESTINATIONS_") {
                file.destinations.insert(name.to_ascii_lowercase(), v.clone());
            }
        }
        for (k, v) in env {
            if let Some(name) = k.strip_prefix("OUTBOX_RELAY_S3_BUCKETS_") {
                if v.trim().is_empty() {
                    return Err(keys::empty(
                        k,
                        &format!("the environment variable {k}"),
                        &format!("s3.buckets.{name}"),
                    ));
                }
                file.s3_buckets.insert(name.to_ascii_lowercase(), v.clone());
            }
        }
        let src = Sources { cli: o.by_key(), env, file: &file };
        let mut config = Config::connections(&src)?;
        config.destination_template = destination_template(&src, &config.sqs_region)?;
        check_destinations(&file.destinations, config.destination_template.is_some())?;
        config.tune(&src)?;
        config.s3 = S3Config::resolve(&src, &file)?;
        config.archive = ArchiveConfig::resolve(&src)?;
        config.mapped = outbox::resolve(&file.outbox, env)?;
        config.destinations = file.destinations;
        Ok(config)
    }

    /// The keys that say what to connect to; tuning keys at their defaults.
    fn connections(src: &Sources) -> Result<Config, ConfigError> {
        let database_url = src.get(&keys::DATABASE_URL).string()?.ok_or_else(|| {
            ConfigError::Invalid(
                "database_url is not set: put it in the config file, set OUTBOX_RELAY_DATABASE_URL, or pass --database-url".into(),
            )
        })?;
        outbox_pgconn::parse(&database_url).map_err(ConfigError::Invalid)?;
        let mode = src.get(&keys::MODE).string()?.unwrap_or_default().parse()?;
        let slot = src.get(&keys::SLOT).string()?.unwrap_or_default();
        validate_identifier("slot", &slot, true)?;
        let publication = src.get(&keys::PUBLICATION).string()?.unwrap_or_default();
        validate_identifier("publication", &publication, false)?;
        let metrics_addr = metrics_addr(src.get(&keys::METRICS_ADDR).string()?)?;
        let region = src.get(&keys::SQS_REGION);
        let sqs_region = match region.given {
            Some(_) => region.string()?.unwrap_or_default(),
            None => std::env::var("AWS_REGION").ok().or(region.string()?).unwrap_or_default(),
        };
        let sqs_endpoint_url = src.get(&keys::SQS_ENDPOINT_URL).string()?;
        let sqs_assume_role_arn = src.get(&keys::SQS_ASSUME_ROLE_ARN).string()?;
        if let Some(arn) = sqs_assume_role_arn.as_ref().filter(|a| !a.starts_with("arn:")) {
            return Err(ConfigError::Invalid(format!(
                "sqs.assume_role_arn {arn:?} is not an ARN such as arn:aws:iam::123456789012:role/outbox-relay"
            )));
        }
        Ok(Config {
            database_url,
            mode,
            slot,
            publication,
            metrics_addr,
            sqs_region,
            sqs_endpoint_url,
            sqs_assume_role_arn,
            ..Config::default()
        })
    }

    /// The tuning keys: durations, counts, sizes and flags, each in its range.
    fn tune(&mut self, src: &Sources) -> Result<(), ConfigError> {
        let d = |k: &'static Key| src.get(k).required_duration();
        self.heartbeat_interval = d(&keys::HEARTBEAT_INTERVAL)?;
        self.linger = d(&keys::LINGER)?;
        self.adaptive_linger = src.get(&keys::ADAPTIVE_LINGER).flag()?;
        self.failover = src.get(&keys::FAILOVER).flag()?;
        self.fair_queues = src.get(&keys::FAIR_QUEUES).flag()?;
        self.published_rows = src.get(&keys::PUBLISHED_ROWS).string()?.unwrap_or_default().parse()?;
        self.max_in_flight_batches = src.get(&keys::MAX_IN_FLIGHT_BATCHES).count()?;
        self.max_concurrent_calls = src.get(&keys::MAX_CONCURRENT_CALLS).count()?;
        self.max_unsettled_events = src.get(&keys::MAX_UNSETTLED_EVENTS).count()?;
        self.max_unsettled_bytes = src.get(&keys::MAX_UNSETTLED_BYTES).size()?;
        self.connect_timeout = d(&keys::CONNECT_TIMEOUT)?;
        self.query_timeout = d(&keys::QUERY_TIMEOUT)?;
        self.lane_stall_timeout = d(&keys::LANE_STALL_TIMEOUT)?;
        self.lane_idle_timeout = d(&keys::LANE_IDLE_TIMEOUT)?;
        self.max_table_connections = src.get(&keys::MAX_TABLE_CONNECTIONS).count()?;
        self.max_retained_wal = src.get(&keys::MAX_RETAINED_WAL).size()?;
        self.retry_base = d(&keys::RETRY_BASE)?;
        self.retry_max = d(&keys::RETRY_MAX)?;
        if self.retry_max < self.retry_base {
            return Err(ConfigError::Invalid(format!(
                "retry_base ({:?}) must be at most retry_max ({:?})",
                self.retry_base, self.retry_max
            )));
        }
        self.poll_interval = d(&keys::POLL_INTERVAL)?;
        self.retention = src.get(&keys::RETENTION).duration()?;
        self.takeover_timeout = d(&keys::TAKEOVER_TIMEOUT)?;
        self.readiness_stall = d(&keys::READINESS_STALL)?;
        Ok(())
    }
}

/// Where and when bodies go through S3 (`[s3]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Config {
    /// The default bucket; `None` when only `[s3.buckets]` names some.
    pub bucket: Option<String>,
    pub key_prefix: String,
    pub endpoint_url: Option<String>,
    pub threshold: crate::publish::offload::Threshold,
    pub max_body_bytes: u64,
    /// Per destination: (bucket, key prefix).
    pub buckets: BTreeMap<String, (String, String)>,
}

impl S3Config {
    /// `None` when no bucket is configured at all.
    fn resolve(src: &Sources, file: &FileConfig) -> Result<Option<S3Config>, ConfigError> {
        let bucket = src.get(&keys::S3_BUCKET).string()?;
        if bucket.is_none() && file.s3_buckets.is_empty() {
            return Ok(None);
        }
        let key_prefix = src.get(&keys::S3_KEY_PREFIX).string_or_empty();
        let mut buckets = BTreeMap::new();
        for (dest, spec) in &file.s3_buckets {
            if !file.destinations.contains_key(dest) {
                return Err(ConfigError::Invalid(format!(
                    "s3.buckets.{dest}: no destination {dest:?} in [destinations]"
                )));
            }
            let (b, prefix) = spec.split_once('/').map_or((spec.as_str(), ""), |(b, p)| (b, p));
            check_bucket(&format!("s3.buckets.{dest}"), b)?;
            buckets.insert(dest.clone(), (b.to_string(), prefix.to_string()));
        }
        if let Some(b) = &bucket {
            check_bucket("s3.bucket", b)?;
        }
        Ok(Some(S3Config {
            bucket,
            key_prefix,
            endpoint_url: src.get(&keys::S3_ENDPOINT_URL).string()?,
            threshold: threshold(&src.get(&keys::S3_THRESHOLD).string()?.unwrap_or_default())?,
            max_body_bytes: src.get(&keys::S3_MAX_BODY_BYTES).size()?,
            buckets,
        }))
    }

    /// The (bucket, key prefix) of `destination`, if its bodies may go through S3.
    pub fn target(&self, destination: &str) -> Option<(&str, &str)> {
        match self.buckets.get(destination) {
            Some((b, p)) => Some((b, p)),
            None => self.bucket.as_deref().map(|b| (b, self.key_prefix.as_str())),
        }
    }
}

/// The archive of what was published (`[archive]`): S3, on `s3.endpoint_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveConfig {
    pub bucket: String,
    /// Prepended to every key.
    pub key_prefix: String,
    pub endpoint_url: Option<String>,
    /// Segments older than this are deleted by the relay's sweep; `None`:
    /// the relay deletes none (a lifecycle rule on the bucket does).
    pub window: Option<Duration>,
    /// How long the stream's settlements wait to be archived together.
    pub flush_interval: Duration,
    /// A gathering is archived early once its published bodies reach this many
    /// bytes, before the interval ends.
    pub segment_bytes: usize,
}

impl ArchiveConfig {
    /// `None` when `archive.bucket` is not set.
    fn resolve(src: &Sources) -> Result<Option<ArchiveConfig>, ConfigError> {
        let Some(bucket) = src.get(&keys::ARCHIVE_BUCKET).string()? else { return Ok(None) };
        check_bucket("archive.bucket", &bucket)?;
        Ok(Some(ArchiveConfig {
            bucket,
            key_prefix: src.get(&keys::ARCHIVE_KEY_PREFIX).string_or_empty(),
            endpoint_url: src.get(&keys::S3_ENDPOINT_URL).string()?,
            window: src.get(&keys::ARCHIVE_WINDOW).duration()?,
            flush_interval: src.get(&keys::ARCHIVE_FLUSH_INTERVAL).required_duration()?,
            segment_bytes: src.get(&keys::ARCHIVE_SEGMENT_BYTES).size()? as usize,
        }))
    }
}

/// S3's bucket naming rule, checked before any call: 3 to 63 of lower-case
/// letters, digits, `.` and `-`, starting and ending with a letter or digit.
fn check_bucket(key: &str, b: &str) -> Result<(), ConfigError> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok = (3..=63).contains(&b.len())
        && b.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
        && edge(b.chars().next())
        && edge(b.chars().last());
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!(
            "{key} = {b:?} is not an S3 bucket name (3 to 63 lower-case letters, digits, '.' and '-')"
        )))
    }
}

/// `s3.threshold`: `queue`, `always`, or a size.
fn threshold(s: &str) -> Result<crate::publish::offload::Threshold, ConfigError> {
    use crate::publish::offload::Threshold;
    match s.to_ascii_lowercase().as_str() {
        "queue" => Ok(Threshold::QueueLimit),
        "always" => Ok(Threshold::Always),
        other => match bytes("s3.threshold", other) {
            Ok(n) => Ok(Threshold::Bytes(n as usize)),
            Err(_) => {
                Err(ConfigError::Invalid(format!("s3.threshold = {s:?} is not queue, always or a size such as 64KB")))
            }
        },
    }
}

/// `metrics_addr`: an address, or off.
fn metrics_addr(v: Option<String>) -> Result<Option<SocketAddr>, ConfigError> {
    match v {
        None => Ok(None),
        Some(s) if s.is_empty() || s == "off" => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ConfigError::Invalid(format!("metrics_addr {s:?} is not an address such as 127.0.0.1:9187"))),
    }
}

/// `sqs.queue_url_template` or `sns.topic_arn_template` (one of them: a
/// name routed to neither configured destination would be ambiguous).
fn destination_template(src: &Sources, region: &str) -> Result<Option<AddressTemplate>, ConfigError> {
    let mut found = Vec::new();
    for (key, kind) in [
        (&keys::SQS_QUEUE_URL_TEMPLATE, DestinationKind::Queue),
        (&keys::SNS_TOPIC_ARN_TEMPLATE, DestinationKind::Topic),
    ] {
        if let Some(t) = src.get(key).string()?.filter(|t| !t.is_empty()) {
            let template = AddressTemplate::new(&t, region).map_err(ConfigError::Invalid)?;
            if template.kind() != kind {
                return Err(ConfigError::Invalid(format!("{}: {t:?} does not make a {kind}'s address", key.name)));
            }
            found.push(template);
        }
    }
    if found.len() > 1 {
        return Err(ConfigError::Invalid(
            "sqs.queue_url_template and sns.topic_arn_template are both set: a destination name not in \
             [destinations] would go to a queue or a topic of that name; set one"
                .into(),
        ));
    }
    Ok(found.pop())
}

/// At least one destination (or a queue-URL template), each with an
/// http(s) queue URL.
fn check_destinations(destinations: &BTreeMap<String, String>, templated: bool) -> Result<(), ConfigError> {
    if destinations.is_empty() && !templated {
        return Err(ConfigError::Invalid(
            "no destinations configured: add a [destinations] table mapping each lane name to its queue URL, e.g. orders = \"https://sqs.us-east-1.amazonaws.com/123456789012/orders\"".into(),
        ));
    }
    for (name, url) in destinations {
        if url.trim().is_empty() {
            return Err(ConfigError::Invalid(format!(
                "destination {name:?} has no queue URL: set [destinations] {name} = \"<queue URL>\" or OUTBOX_RELAY_DESTINATIONS_{}",
                name.to_ascii_uppercase()
            )));
        }
        if let Err(why) = DestinationKind::of_address(url) {
            return Err(ConfigError::Invalid(format!("destination {name:?}: {why}")));
        }
    }
    Ok(())
}

/// A TOML error with the line and column it is at, and that line.
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else { return e.message().to_string() };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map(|l| l.chars().count() + 1).unwrap_or(1);
    let shown = text.lines().nth(line - 1).unwrap_or("").trim();
    format!("line {line}, column {column}: {} (at `{shown}`)", e.message().trim())
}

/// Slot names: lower-case letters, digits, underscores (PostgreSQL's rule).
/// Publication names: an identifier we can quote.
fn validate_identifier(what: &str, s: &str, slot_rules: bool) -> Result<(), ConfigError> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || (!slot_rules && b.is_ascii_uppercase())
        });
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!(
            "{what} {s:?} is not valid: use 1 to 63 lower-case letters, digits and underscores"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference in docs/configuration.md (its first TOML block) names
    /// every key there is, and every value it shows is the key's default;
    /// the ranges it states are the table's.
    #[test]
    fn the_documented_reference_is_every_key_with_its_default_and_range() {
        let doc = include_str!("../../docs/configuration.md");
        let block = doc.split("```toml\n").nth(1).and_then(|b| b.split("```").next()).expect("a TOML block");
        let documented = FileConfig::parse(block).expect("every documented key exists");
        let missing: Vec<&str> =
            keys::KEYS.iter().map(|k| k.name).filter(|k| !documented.values().contains_key(*k)).collect();
        assert!(missing.is_empty(), "keys missing from the reference in docs/configuration.md: {missing:?}");
        for key in keys::KEYS {
            let Some(default) = key.default else { continue };
            let shown = Raw { key, given: documented.values().get(key.name).cloned(), origin: Origin::File };
            let default = Raw { key, given: Some(default.to_string()), origin: Origin::Default };
            assert_eq!(parsed(&shown), parsed(&default), "the reference shows {} other than its default", key.name);
        }
        let flat = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        for key in keys::KEYS {
            if let Some(range) = keys::range(key) {
                let stated = format!("`{}` {range}", key.name);
                assert!(flat.contains(&stated), "docs/configuration.md does not state the range {stated}");
            }
        }
    }

    /// A value as the relay reads it, for comparison.
    fn parsed(raw: &Raw) -> String {
        match raw.key.kind {
            keys::Kind::Text => format!("{:?}", raw.string_or_empty()),
            keys::Kind::Flag => format!("{:?}", raw.flag().unwrap()),
            keys::Kind::Duration { .. } => format!("{:?}", raw.duration().unwrap()),
            keys::Kind::Size { .. } => format!("{:?}", raw.size().unwrap()),
            keys::Kind::Count { .. } => format!("{:?}", raw.count().unwrap()),
        }
    }

    fn file(toml_text: &str) -> FileConfig {
        FileConfig::parse(toml_text).unwrap()
    }

    const BASE: &str = r#"
database_url = "postgres://app:s3cret@127.0.0.1:5432/app"
[sqs]
endpoint_url = "http://127.0.0.1:4566"
[destinations]
orders = "http://127.0.0.1:4566/000000000000/orders"
"#;

    #[test]
    fn file_env_and_flags_in_that_order() {
        let mut env = BTreeMap::new();
        env.insert("OUTBOX_RELAY_SLOT".into(), "from_env".into());
        env.insert("OUTBOX_RELAY_MODE".into(), "polling".into());
        env.insert("OUTBOX_RELAY_DESTINATIONS_BILLING".into(), "http://x/q.fifo".into());
        let c = Config::resolve(file(BASE), &env, &Overrides::default()).unwrap();
        assert_eq!(c.slot, "from_env");
        assert_eq!(c.mode, Mode::Polling);
        assert_eq!(c.destinations.len(), 2);
        assert_eq!(c.publication, "outbox_relay");
        let o = Overrides { slot: Some("from_cli".into()), mode: Some(Mode::Cdc), ..Default::default() };
        let c = Config::resolve(file(BASE), &env, &o).unwrap();
        assert_eq!((c.slot.as_str(), c.mode), ("from_cli", Mode::Cdc));
    }

    #[test]
    fn s3_bodies_globally_and_per_destination() {
        let env = BTreeMap::new();
        let resolve = |t: &str| Config::resolve(file(&format!("{BASE}\n{t}")), &env, &Overrides::default());
        assert_eq!(resolve("").unwrap().s3, None, "no bucket: no S3");
        let c = resolve("[s3]\nbucket = \"bodies\"\nkey_prefix = \"outbox/\"\nthreshold = \"64KB\"").unwrap();
        let s3 = c.s3.unwrap();
        assert_eq!(s3.target("orders"), Some(("bodies", "outbox/")));
        assert_eq!(s3.threshold, crate::publish::offload::Threshold::Bytes(64 << 10));
        assert_eq!(s3.max_body_bytes, 32 << 20);
        let c = resolve("[s3]\nthreshold = \"always\"\n[s3.buckets]\norders = \"own-bucket/p/\"").unwrap();
        let s3 = c.s3.unwrap();
        assert_eq!(s3.target("orders"), Some(("own-bucket", "p/")));
        assert_eq!(s3.target("other"), None, "no default bucket: only the named destination");
        let env_bucket: BTreeMap<String, String> =
            [("OUTBOX_RELAY_S3_BUCKETS_ORDERS".to_string(), "env-bucket".to_string())].into();
        let c = Config::resolve(file(BASE), &env_bucket, &Overrides::default()).unwrap();
        assert_eq!(c.s3.unwrap().target("orders"), Some(("env-bucket", "")));
        let err = |t: &str| resolve(t).unwrap_err().to_string();
        assert!(err("[s3]\nbucket = \"Bad_Bucket\"").contains("is not an S3 bucket name"));
        assert!(err("[s3]\nbucket = \"b12\"\nthreshold = \"big\"").contains("not queue, always or a size"));
        assert!(err("[s3.buckets]\nnope = \"b12\"").contains("no destination \"nope\""));
        assert!(err("[s3]\nbucket = \"b12\"\nmax_body_bytes = \"4GB\"").contains("out of range"));
    }

    /// An empty string never switches a feature off silently: the bucket
    /// from a file emptied by the environment, an empty endpoint, role or
    /// address are refused, naming the key and where the value came from.
    #[test]
    fn an_empty_string_is_refused_with_where_it_came_from() {
        let with_bucket = format!("{BASE}\n[s3]\nbucket = \"bodies\"");
        let env = |k: &str| -> BTreeMap<String, String> { [(k.to_string(), String::new())].into() };
        let e = Config::resolve(file(&with_bucket), &env("OUTBOX_RELAY_S3_BUCKET"), &Overrides::default());
        let e = e.unwrap_err().to_string();
        assert!(e.contains("OUTBOX_RELAY_S3_BUCKET is set to an empty string"), "{e}");
        assert!(e.contains("the environment variable OUTBOX_RELAY_S3_BUCKET"), "{e}");
        let none = BTreeMap::new();
        let head = "database_url = \"postgres://a@b/c\"\n[destinations]\norders = \"http://x/q\"\n";
        for (key, text) in [
            ("s3.bucket", "[s3]\nbucket = \"\""),
            ("s3.endpoint_url", "[s3]\nbucket = \"bodies\"\nendpoint_url = \"\""),
            ("s3.threshold", "[s3]\nbucket = \"bodies\"\nthreshold = \" \""),
            ("sqs.assume_role_arn", "[sqs]\nassume_role_arn = \"\""),
            ("sqs.region", "[sqs]\nregion = \"\""),
            ("sqs.endpoint_url", "[sqs]\nendpoint_url = \"\""),
        ] {
            let e = Config::resolve(file(&format!("{head}{text}")), &none, &Overrides::default());
            let e = e.unwrap_err().to_string();
            assert!(e.starts_with(&format!("{key} is set to an empty string (in the config file)")), "{key}: {e}");
        }
        let e = Config::resolve(
            file("database_url = \"\"\n[destinations]\norders = \"http://x/q\""),
            &none,
            &Overrides::default(),
        );
        assert!(e.unwrap_err().to_string().starts_with("database_url is set to an empty string"));
        for key in ["metrics_addr", "slot", "mode", "publication", "published_rows"] {
            let e = Config::resolve(file(&format!("{key} = \"\"\n{BASE}")), &none, &Overrides::default());
            let e = e.unwrap_err().to_string();
            assert!(e.starts_with(&format!("{key} is set to an empty string (in the config file)")), "{key}: {e}");
        }
        let flag = Overrides { sqs_endpoint_url: Some(String::new()), ..Overrides::default() };
        let e = Config::resolve(file(BASE), &none, &flag).unwrap_err().to_string();
        assert!(e.contains("--sqs-endpoint-url is set to an empty string (in the flag --sqs-endpoint-url)"), "{e}");
        // An empty key prefix is a prefix of none, not a feature switched off.
        assert!(
            Config::resolve(file(&format!("{with_bucket}\nkey_prefix = \"\"")), &none, &Overrides::default()).is_ok()
        );
    }

    #[test]
    fn refuses_with_a_fix() {
        let env = BTreeMap::new();
        let err = |t: &str| Config::resolve(file(t), &env, &Overrides::default()).unwrap_err().to_string();
        assert!(err("[destinations]\norders = \"http://x/q\"").contains("database_url is not set"));
        assert!(err("database_url = \"postgres://a@b/c\"").contains("no destinations configured"));
        let e = err("database_url = \"postgres://a@b/c\"\n[destinations]\norders = \"\"");
        assert!(e.contains("destination \"orders\" has no queue URL"), "{e}");
        let e = err(&format!("slot = \"Bad-Slot\"\n{BASE}"));
        assert!(e.contains("slot \"Bad-Slot\" is not valid"), "{e}");
        let bad_mode = Config::resolve(
            file(BASE),
            &[("OUTBOX_RELAY_MODE".to_string(), "fast".to_string())].into(),
            &Overrides::default(),
        );
        assert!(bad_mode.unwrap_err().to_string().contains("not one of cdc, polling, auto"));
        assert!(FileConfig::parse("unknown_key = 1").unwrap_err().contains("unknown key `unknown_key`"));
    }

    #[test]
    fn topics_and_their_template() {
        let env = BTreeMap::new();
        let resolve = |t: &str| Config::resolve(file(t), &env, &Overrides::default());
        let db = "database_url = \"postgres://a@b/c\"\n";
        let c = resolve(&format!("{db}[destinations]\nevents = \"arn:aws:sns:eu-west-1:1:events.fifo\"")).unwrap();
        assert_eq!(c.destinations["events"], "arn:aws:sns:eu-west-1:1:events.fifo");
        let e = resolve(&format!("{db}[destinations]\nevents = \"arn:aws:sqs:eu-west-1:1:q\"")).unwrap_err();
        assert!(e.to_string().contains("an ARN of \"sqs\""), "{e}");
        let e = resolve(&format!("{db}[destinations]\nevents = \"events\"")).unwrap_err();
        assert!(e.to_string().contains("a topic's ARN with arn:aws:sns:"), "{e}");
        let t =
            resolve(&format!("{db}[sns]\ntopic_arn_template = \"arn:aws:sns:{{region}}:1:{{destination}}\"")).unwrap();
        let template = t.destination_template.unwrap();
        assert_eq!(template.kind(), DestinationKind::Topic);
        assert_eq!(template.address("orders").unwrap(), "arn:aws:sns:us-east-1:1:orders");
        let both = format!(
            "{db}[sns]\ntopic_arn_template = \"arn:aws:sns:r:1:{{destination}}\"\n\
             [sqs]\nqueue_url_template = \"https://q/{{destination}}\""
        );
        assert!(resolve(&both).unwrap_err().to_string().contains("both set"));
        let crossed = format!("{db}[sns]\ntopic_arn_template = \"https://q/{{destination}}\"");
        assert!(resolve(&crossed).unwrap_err().to_string().contains("does not make a topic's address"));
    }

    #[test]
    fn sizes_and_spool_settings() {
        assert_eq!(bytes("k", "256MB").unwrap(), 256 << 20);
        assert_eq!(bytes("k", "1 GB").unwrap(), 1 << 30);
        assert_eq!(bytes("k", "4096").unwrap(), 4096);
        assert!(bytes("k", "lots").unwrap_err().to_string().contains("not a size"));
        assert!(bytes("k", "0MB").is_err());
        let c = Config::resolve(file(BASE), &BTreeMap::new(), &Overrides::default()).unwrap();
        assert_eq!(c.lane_stall_timeout, Duration::from_secs(30));
        assert_eq!(c.lane_idle_timeout, Duration::from_secs(30));
        assert_eq!(c.max_retained_wal, 256 << 20);
        assert_eq!((c.retry_base, c.retry_max), (Duration::from_secs(2), Duration::from_secs(300)));
        assert_eq!(c.retention, Some(Duration::from_secs(7 * 86_400)));
        let env: BTreeMap<String, String> = [("OUTBOX_RELAY_RETENTION".to_string(), "off".to_string())].into();
        assert_eq!(Config::resolve(file(BASE), &env, &Overrides::default()).unwrap().retention, None);
        let e = Config::resolve(
            file(&format!("retry_base = \"10s\"\nretry_max = \"1s\"\n{BASE}")),
            &BTreeMap::new(),
            &Overrides::default(),
        );
        assert!(e.unwrap_err().to_string().contains("at most retry_max"));
        assert_eq!(c.max_unsettled_bytes, 64 << 20);
        assert_eq!((c.connect_timeout, c.query_timeout), (Duration::from_secs(10), Duration::from_secs(30)));
    }

    #[test]
    fn debug_never_shows_the_password() {
        let c = Config::resolve(file(BASE), &BTreeMap::new(), &Overrides::default()).unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("app:***@127.0.0.1"));
    }

    #[test]
    fn zero_or_absurd_values_are_refused_naming_key_and_range() {
        let env = BTreeMap::new();
        let err = |line: &str| {
            Config::resolve(file(&format!("{line}\n{BASE}")), &env, &Overrides::default()).unwrap_err().to_string()
        };
        let cases = [
            ("heartbeat_interval = \"0s\"", "heartbeat_interval = \"0s\" is out of range: it must be from 100ms to 1h"),
            ("poll_interval = \"0s\"", "poll_interval = \"0s\" is out of range: it must be from 10ms to 1h"),
            ("linger = \"10m\"", "linger = \"10m\" is out of range"),
            ("lane_stall_timeout = \"0s\"", "lane_stall_timeout"),
            ("retry_base = \"0s\"", "retry_base = \"0s\" is out of range"),
            ("readiness_stall = \"0s\"", "readiness_stall"),
            ("takeover_timeout = \"100ms\"", "takeover_timeout"),
            ("connect_timeout = \"0s\"", "connect_timeout = \"0s\" is out of range"),
            ("query_timeout = \"1000d\"", "query_timeout"),
            ("retention = \"1s\"", "retention = \"1s\" is out of range: it must be from 1m"),
            ("max_in_flight_batches = 0", "max_in_flight_batches = 0 is out of range: it must be from 1 to 1024"),
            ("max_in_flight_batches = 100000", "max_in_flight_batches = 100000 is out of range"),
            ("max_unsettled_events = 0", "max_unsettled_events = 0 is out of range"),
            (
                "max_unsettled_bytes = \"1kB\"",
                "max_unsettled_bytes = \"1kB\" is out of range: it must be from 1MB to 64GB",
            ),
            ("max_retained_wal = \"10\"", "max_retained_wal = \"10\" is out of range"),
        ];
        for (line, expected) in cases {
            let e = err(line);
            assert!(e.contains(expected), "{line}: {e}");
        }
        let ok = Config::resolve(
            file(&format!("linger = \"0s\"\nmax_unsettled_bytes = \"8MB\"\n{BASE}")),
            &env,
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!((ok.linger, ok.max_unsettled_bytes), (Duration::ZERO, 8 << 20));
        let by_env: BTreeMap<String, String> =
            [("OUTBOX_RELAY_HEARTBEAT_INTERVAL".to_string(), "0s".to_string())].into();
        let e = Config::resolve(file(BASE), &by_env, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("heartbeat_interval = \"0s\" is out of range"), "{e}");
    }

    #[test]
    fn the_file_is_read_by_the_key_table() {
        let e = FileConfig::parse("[sqs]\nregoin = \"eu-west-1\"").unwrap_err();
        assert!(e.contains("unknown key `sqs.regoin`") && e.contains("sqs.region"), "{e}");
        let e = FileConfig::parse("linger = [1, 2]").unwrap_err();
        assert!(e.contains("linger = [1, 2] is not a string, a number or true/false"), "{e}");
        let e = FileConfig::parse("[destinations]\norders = 3").unwrap_err();
        assert!(e.contains("destinations.orders must be a string"), "{e}");
        let c = Config::resolve(
            file(&format!("max_in_flight_batches = 16\nadaptive_linger = false\n{BASE}")),
            &[("OUTBOX_RELAY_SQS_REGION".to_string(), "eu-west-1".to_string())].into(),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!((c.max_in_flight_batches, c.adaptive_linger, c.sqs_region.as_str()), (16, false, "eu-west-1"));
        for key in keys::KEYS {
            assert!(key.env_name().starts_with("OUTBOX_RELAY_") && !key.env_name().contains('.'), "{}", key.name);
        }
        let e = Config::resolve(
            file(BASE),
            &[("OUTBOX_RELAY_FAILOVER".to_string(), "yes".to_string())].into(),
            &Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("OUTBOX_RELAY_FAILOVER \"yes\" is not true or false"), "{e}");
    }

    #[test]
    fn a_toml_syntax_error_names_the_line() {
        let dir = std::env::temp_dir().join(format!("cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(&path, "slot = \"a\"\n\nlinger = 5ms\n").unwrap();
        let e = Config::load(Some(&path), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("relay.toml") && e.contains("line 3, column 11") && e.contains("`linger = 5ms`"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
