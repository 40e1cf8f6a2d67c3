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

/// The file's shape. Every key is optional here; [`Config::resolve`] says
/// which are required.
#[derive(Debug, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub database_url: Option<String>,
    pub mode: Option<Mode>,
    pub slot: Option<String>,
    pub publication: Option<String>,
    pub metrics_addr: Option<String>,
    pub heartbeat_interval: Option<String>,
    pub linger: Option<String>,
    pub adaptive_linger: Option<bool>,
    pub failover: Option<bool>,
    pub max_in_flight_batches: Option<usize>,
    pub max_unsettled_events: Option<usize>,
    pub max_unsettled_bytes: Option<String>,
    pub connect_timeout: Option<String>,
    pub query_timeout: Option<String>,
    pub lane_stall_timeout: Option<String>,
    pub max_retained_wal: Option<String>,
    pub retry_base: Option<String>,
    pub retry_max: Option<String>,
    pub poll_interval: Option<String>,
    pub retention: Option<String>,
    pub published_rows: Option<PublishedRows>,
    pub readiness_stall: Option<String>,
    pub takeover_timeout: Option<String>,
    #[serde(default)]
    pub sqs: SqsFileConfig,
    #[serde(default)]
    pub destinations: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SqsFileConfig {
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
    /// Assume this IAM role (STS) on top of the standard credential chain.
    pub assume_role_arn: Option<String>,
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

/// The validated configuration.
#[derive(Clone)]
pub struct Config {
    pub database_url: String,
    pub mode: Mode,
    pub slot: String,
    pub publication: String,
    pub metrics_addr: Option<SocketAddr>,
    pub sqs_region: String,
    pub sqs_endpoint_url: Option<String>,
    pub sqs_assume_role_arn: Option<String>,
    /// Lane name → queue URL.
    pub destinations: BTreeMap<String, String>,
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
    /// SendMessageBatch calls in flight per lane.
    pub max_in_flight_batches: usize,
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
            .finish_non_exhaustive()
    }
}

const ENV_PREFIX: &str = "OUTBOX_RELAY_";

impl Config {
    /// The database, with this configuration's deadlines.
    pub fn db(&self) -> crate::db::Db {
        crate::db::Db::new(
            &self.database_url,
            crate::db::Deadlines { connect: self.connect_timeout, query: self.query_timeout },
        )
    }

    /// Load `path` (if given), apply the environment, then `overrides`.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|source| ConfigError::Read { path: p.display().to_string(), source })?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| ConfigError::Parse { path: p.display().to_string(), message: toml_error(&text, &e) })?
            }
            None => FileConfig::default(),
        };
        let env: BTreeMap<String, String> = std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX)).collect();
        Config::resolve(file, &env, overrides)
    }

    /// Merge file, environment (`OUTBOX_RELAY_*` variables) and overrides, and
    /// validate the result.
    pub fn resolve(mut file: FileConfig, env: &BTreeMap<String, String>, o: &Overrides) -> Result<Config, ConfigError> {
        let get = |k: &str| env.get(&format!("{ENV_PREFIX}{k}")).cloned();
        let pick = |cli: &Option<String>, key: &str, file: Option<String>| cli.clone().or_else(|| get(key)).or(file);
        for (k, v) in env {
            if let Some(name) = k.strip_prefix("OUTBOX_RELAY_DESTINATIONS_") {
                file.destinations.insert(name.to_ascii_lowercase(), v.clone());
            }
        }
        let database_url = pick(&o.database_url, "DATABASE_URL", file.database_url).ok_or_else(|| {
            ConfigError::Invalid(
                "database_url is not set: put it in the config file, set OUTBOX_RELAY_DATABASE_URL, or pass --database-url".into(),
            )
        })?;
        outbox_pgconn::parse(&database_url).map_err(ConfigError::Invalid)?;
        let mode = match (o.mode, get("MODE")) {
            (Some(m), _) => m,
            (None, Some(m)) => m.parse()?,
            (None, None) => file.mode.unwrap_or_default(),
        };
        let slot = pick(&o.slot, "SLOT", file.slot).unwrap_or_else(|| "outbox_relay".into());
        validate_identifier("slot", &slot, true)?;
        let publication =
            pick(&o.publication, "PUBLICATION", file.publication).unwrap_or_else(|| "outbox_relay".into());
        validate_identifier("publication", &publication, false)?;
        let metrics_addr = metrics_addr(pick(&o.metrics_addr, "METRICS_ADDR", file.metrics_addr))?;
        let sqs_region = get("SQS_REGION")
            .or(file.sqs.region)
            .or_else(|| std::env::var("AWS_REGION").ok())
            .unwrap_or_else(|| "us-east-1".into());
        let sqs_endpoint_url =
            pick(&o.sqs_endpoint_url, "SQS_ENDPOINT_URL", file.sqs.endpoint_url).filter(|s| !s.is_empty());
        let sqs_assume_role_arn = get("SQS_ASSUME_ROLE_ARN").or(file.sqs.assume_role_arn).filter(|s| !s.is_empty());
        if let Some(arn) = sqs_assume_role_arn.as_ref().filter(|a| !a.starts_with("arn:")) {
            return Err(ConfigError::Invalid(format!(
                "sqs.assume_role_arn {arn:?} is not an ARN such as arn:aws:iam::123456789012:role/outbox-relay"
            )));
        }
        check_destinations(&file.destinations)?;
        let d = |key: &str, env_key: &str, file: Option<String>| duration(key, get(env_key).or(file));
        let heartbeat_interval = d("heartbeat_interval", "HEARTBEAT_INTERVAL", file.heartbeat_interval)?;
        let linger = d("linger", "LINGER", file.linger)?;
        let flag = |env_key: &str, file: Option<bool>, default: bool| match get(env_key) {
            Some(v) => v
                .parse()
                .map_err(|_| ConfigError::Invalid(format!("OUTBOX_RELAY_{env_key} {v:?} is not true or false"))),
            None => Ok(file.unwrap_or(default)),
        };
        let adaptive_linger = flag("ADAPTIVE_LINGER", file.adaptive_linger, true)?;
        let failover = flag("FAILOVER", file.failover, false)?;
        let max_in_flight_batches =
            number("max_in_flight_batches", get("MAX_IN_FLIGHT_BATCHES"), file.max_in_flight_batches)?;
        let max_unsettled_events =
            number("max_unsettled_events", get("MAX_UNSETTLED_EVENTS"), file.max_unsettled_events)?;
        let max_unsettled_bytes = size("max_unsettled_bytes", get("MAX_UNSETTLED_BYTES").or(file.max_unsettled_bytes))?;
        let lane_stall_timeout = d("lane_stall_timeout", "LANE_STALL_TIMEOUT", file.lane_stall_timeout)?;
        let max_retained_wal = size("max_retained_wal", get("MAX_RETAINED_WAL").or(file.max_retained_wal))?;
        let retry_base = d("retry_base", "RETRY_BASE", file.retry_base)?;
        let retry_max = d("retry_max", "RETRY_MAX", file.retry_max)?;
        if retry_max < retry_base {
            return Err(ConfigError::Invalid(format!(
                "retry_base ({retry_base:?}) must be at most retry_max ({retry_max:?})"
            )));
        }
        let poll_interval = d("poll_interval", "POLL_INTERVAL", file.poll_interval)?;
        let retention = match get("RETENTION").or(file.retention) {
            Some(s) if s == "off" || s == "0" => None,
            v => Some(duration("retention", v)?),
        };
        let published_rows = match get("PUBLISHED_ROWS") {
            Some(v) => v.parse()?,
            None => file.published_rows.unwrap_or_default(),
        };
        let readiness_stall = d("readiness_stall", "READINESS_STALL", file.readiness_stall)?;
        let takeover_timeout = d("takeover_timeout", "TAKEOVER_TIMEOUT", file.takeover_timeout)?;
        let connect_timeout = d("connect_timeout", "CONNECT_TIMEOUT", file.connect_timeout)?;
        let query_timeout = d("query_timeout", "QUERY_TIMEOUT", file.query_timeout)?;
        Ok(Config {
            database_url,
            mode,
            slot,
            publication,
            metrics_addr,
            sqs_region,
            sqs_endpoint_url,
            sqs_assume_role_arn,
            destinations: file.destinations,
            heartbeat_interval,
            linger,
            adaptive_linger,
            failover,
            max_in_flight_batches,
            max_unsettled_events,
            max_unsettled_bytes,
            connect_timeout,
            query_timeout,
            lane_stall_timeout,
            max_retained_wal,
            retry_base,
            retry_max,
            poll_interval,
            retention,
            published_rows,
            readiness_stall,
            takeover_timeout,
        })
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

/// At least one destination, each with an http(s) queue URL.
fn check_destinations(destinations: &BTreeMap<String, String>) -> Result<(), ConfigError> {
    if destinations.is_empty() {
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
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ConfigError::Invalid(format!(
                "destination {name:?}: queue URL {url:?} must start with https:// (or http:// for a local endpoint)"
            )));
        }
    }
    Ok(())
}

/// Every duration key: its default and the range it must lie in. Zero or
/// absurd values are refused at start-up, naming the key and the range.
const DURATIONS: &[(&str, &str, Duration, Duration)] = &[
    ("heartbeat_interval", "10s", Duration::from_millis(100), Duration::from_secs(3_600)),
    ("linger", "5ms", Duration::ZERO, Duration::from_secs(1)),
    ("lane_stall_timeout", "30s", Duration::from_secs(1), Duration::from_secs(86_400)),
    ("retry_base", "2s", Duration::from_millis(10), Duration::from_secs(3_600)),
    ("retry_max", "300s", Duration::from_millis(10), Duration::from_secs(86_400)),
    ("poll_interval", "100ms", Duration::from_millis(10), Duration::from_secs(3_600)),
    ("retention", "7d", Duration::from_secs(60), Duration::from_secs(3_650 * 86_400)),
    ("readiness_stall", "5m", Duration::from_secs(1), Duration::from_secs(86_400)),
    ("takeover_timeout", "10s", Duration::from_secs(1), Duration::from_secs(3_600)),
    ("connect_timeout", "10s", Duration::from_millis(100), Duration::from_secs(600)),
    ("query_timeout", "30s", Duration::from_millis(100), Duration::from_secs(3_600)),
];

/// Every count key: default, least and most.
const NUMBERS: &[(&str, usize, usize, usize)] =
    &[("max_in_flight_batches", 8, 1, 256), ("max_unsettled_events", 20_000, 1, 10_000_000)];

/// Every size key: default, least and most (bytes).
const SIZES: &[(&str, &str, u64, u64)] =
    &[("max_retained_wal", "256MB", 1 << 20, 1 << 50), ("max_unsettled_bytes", "64MB", 1 << 20, 64 << 30)];

fn duration(key: &str, v: Option<String>) -> Result<Duration, ConfigError> {
    let (_, default, min, max) = *DURATIONS.iter().find(|l| l.0 == key).expect("every duration key has its limits");
    let s = v.unwrap_or_else(|| default.to_string());
    let d = humantime::parse_duration(&s)
        .map_err(|e| ConfigError::Invalid(format!("{key} = {s:?} is not a duration such as 10s or 5ms: {e}")))?;
    if d < min || d > max {
        return Err(ConfigError::Invalid(format!(
            "{key} = {s:?} is out of range: it must be from {} to {}",
            humantime::format_duration(min),
            humantime::format_duration(max)
        )));
    }
    Ok(d)
}

fn size(key: &str, v: Option<String>) -> Result<u64, ConfigError> {
    let (_, default, min, max) = *SIZES.iter().find(|l| l.0 == key).expect("every size key has its limits");
    let s = v.unwrap_or_else(|| default.to_string());
    let n = bytes(key, &s)?;
    if n < min || n > max {
        return Err(ConfigError::Invalid(format!(
            "{key} = {s:?} is out of range: it must be from {} to {}",
            show_bytes(min),
            show_bytes(max)
        )));
    }
    Ok(n)
}

fn show_bytes(n: u64) -> String {
    match n {
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

fn number(key: &str, env: Option<String>, file: Option<usize>) -> Result<usize, ConfigError> {
    let (_, default, min, max) = *NUMBERS.iter().find(|l| l.0 == key).expect("every count key has its limits");
    let n = match env {
        Some(s) => s.parse().map_err(|_| ConfigError::Invalid(format!("{key} = {s:?} is not a whole number")))?,
        None => file.unwrap_or(default),
    };
    if n < min || n > max {
        return Err(ConfigError::Invalid(format!("{key} = {n} is out of range: it must be from {min} to {max}")));
    }
    Ok(n)
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
    /// every key there is, each with a value start-up accepts, and every
    /// tuning value it shows is the default.
    #[test]
    fn the_documented_reference_is_every_key_with_its_default() {
        let doc = include_str!("../docs/configuration.md");
        let block = doc.split("```toml\n").nth(1).and_then(|b| b.split("```").next()).expect("a TOML block");
        let documented: FileConfig = toml::from_str(block).expect("every documented key exists");
        let keys = serde_json::to_value(&documented).unwrap();
        let missing: Vec<String> = keys
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(k, v)| match v.as_object() {
                Some(inner) => inner.iter().filter(|(_, v)| v.is_null()).map(|(i, _)| format!("{k}.{i}")).collect(),
                None if v.is_null() => vec![k.clone()],
                None => vec![],
            })
            .collect();
        assert!(missing.is_empty(), "keys missing from the reference in docs/configuration.md: {missing:?}");
        let shown = Config::resolve(documented, &BTreeMap::new(), &Overrides::default()).expect("documented values");
        let minimal = file(
            r#"database_url = "postgres://app@127.0.0.1:5432/app"
               [destinations]
               orders = "http://127.0.0.1:4566/000000000000/orders""#,
        );
        let default = Config::resolve(minimal, &BTreeMap::new(), &Overrides::default()).unwrap();
        let tuning = |c: &Config| {
            format!(
                "{:?}",
                (
                    (c.mode, &c.slot, &c.publication, c.heartbeat_interval, c.linger, c.adaptive_linger, c.failover),
                    (c.published_rows, c.max_in_flight_batches, c.max_unsettled_events, c.max_unsettled_bytes),
                    (c.connect_timeout, c.query_timeout, c.lane_stall_timeout, c.max_retained_wal),
                    (c.retry_base, c.retry_max, c.poll_interval, c.retention, c.takeover_timeout, c.readiness_stall),
                )
            )
        };
        assert_eq!(tuning(&shown), tuning(&default), "the reference shows a value that is not the default");
    }

    fn file(toml_text: &str) -> FileConfig {
        toml::from_str(toml_text).unwrap()
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
        assert!(toml::from_str::<FileConfig>("unknown_key = 1").is_err());
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
            ("max_in_flight_batches = 0", "max_in_flight_batches = 0 is out of range: it must be from 1 to 256"),
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
