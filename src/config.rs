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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
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
            _ => Err(ConfigError::Invalid(format!(
                "mode {s:?} is not one of cdc, polling, auto"
            ))),
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
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub database_url: Option<String>,
    pub mode: Option<Mode>,
    pub slot: Option<String>,
    pub publication: Option<String>,
    pub metrics_addr: Option<String>,
    pub heartbeat_interval: Option<String>,
    pub linger: Option<String>,
    pub max_in_flight_batches: Option<usize>,
    pub max_unsettled_events: Option<usize>,
    pub lane_stall_timeout: Option<String>,
    pub max_retained_wal: Option<String>,
    pub retry_base: Option<String>,
    pub retry_max: Option<String>,
    pub poll_interval: Option<String>,
    pub retention: Option<String>,
    pub readiness_stall: Option<String>,
    pub takeover_timeout: Option<String>,
    #[serde(default)]
    pub sqs: SqsFileConfig,
    #[serde(default)]
    pub destinations: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
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
    /// SendMessageBatch calls in flight per lane.
    pub max_in_flight_batches: usize,
    /// Events read from the slot but not yet settled, across all lanes: the
    /// bound on the relay's memory.
    pub max_unsettled_events: usize,
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
    /// `/readyz` fails when the confirmed LSN has not moved this long while the slot has lag.
    pub readiness_stall: Duration,
    /// A standby takes over within this of the leader's death.
    pub takeover_timeout: Duration,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &redact_url(&self.database_url))
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

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
pub fn redact_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        if let Some((auth, host)) = rest.rsplit_once('@') {
            if let Some((user, _)) = auth.split_once(':') {
                return format!("{scheme}://{user}:***@{host}");
            }
        }
    }
    url.to_string()
}

const ENV_PREFIX: &str = "OUTBOX_RELAY_";

impl Config {
    /// Load `path` (if given), apply the environment, then `overrides`.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let file = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::Parse {
                    path: p.display().to_string(),
                    message: e.message().to_string(),
                })?
            }
            None => FileConfig::default(),
        };
        let env: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        Config::resolve(file, &env, overrides)
    }

    /// Merge file, environment (`OUTBOX_RELAY_*` variables) and overrides, and
    /// validate the result.
    pub fn resolve(
        mut file: FileConfig,
        env: &BTreeMap<String, String>,
        o: &Overrides,
    ) -> Result<Config, ConfigError> {
        let get = |k: &str| env.get(&format!("{ENV_PREFIX}{k}")).cloned();
        let pick = |cli: &Option<String>, key: &str, file: Option<String>| {
            cli.clone().or_else(|| get(key)).or(file)
        };
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
        crate::pgconn::parse(&database_url).map_err(ConfigError::Invalid)?;
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
        let metrics_addr = match pick(&o.metrics_addr, "METRICS_ADDR", file.metrics_addr) {
            None => None,
            Some(s) if s.is_empty() || s == "off" => None,
            Some(s) => Some(s.parse().map_err(|_| {
                ConfigError::Invalid(format!("metrics_addr {s:?} is not an address such as 127.0.0.1:9187"))
            })?),
        };
        let sqs_region = get("SQS_REGION")
            .or(file.sqs.region)
            .or_else(|| std::env::var("AWS_REGION").ok())
            .unwrap_or_else(|| "us-east-1".into());
        let sqs_endpoint_url = pick(&o.sqs_endpoint_url, "SQS_ENDPOINT_URL", file.sqs.endpoint_url)
            .filter(|s| !s.is_empty());
        let sqs_assume_role_arn = get("SQS_ASSUME_ROLE_ARN").or(file.sqs.assume_role_arn).filter(|s| !s.is_empty());
        if let Some(arn) = &sqs_assume_role_arn {
            if !arn.starts_with("arn:") {
                return Err(ConfigError::Invalid(format!("sqs.assume_role_arn {arn:?} is not an ARN such as arn:aws:iam::123456789012:role/outbox-relay")));
            }
        }
        if file.destinations.is_empty() {
            return Err(ConfigError::Invalid(
                "no destinations configured: add a [destinations] table mapping each lane name to its queue URL, e.g. orders = \"https://sqs.us-east-1.amazonaws.com/123456789012/orders\"".into(),
            ));
        }
        for (name, url) in &file.destinations {
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
        let heartbeat_interval = duration("heartbeat_interval", get("HEARTBEAT_INTERVAL").or(file.heartbeat_interval), "10s")?;
        let linger = duration("linger", get("LINGER").or(file.linger), "5ms")?;
        let max_in_flight_batches = number("max_in_flight_batches", get("MAX_IN_FLIGHT_BATCHES"), file.max_in_flight_batches, 8)?;
        let max_unsettled_events = number("max_unsettled_events", get("MAX_UNSETTLED_EVENTS"), file.max_unsettled_events, 20_000)?;
        let lane_stall_timeout = duration("lane_stall_timeout", get("LANE_STALL_TIMEOUT").or(file.lane_stall_timeout), "30s")?;
        let max_retained_wal = bytes("max_retained_wal", &get("MAX_RETAINED_WAL").or(file.max_retained_wal).unwrap_or_else(|| "256MB".into()))?;
        let retry_base = duration("retry_base", get("RETRY_BASE").or(file.retry_base), "2s")?;
        let retry_max = duration("retry_max", get("RETRY_MAX").or(file.retry_max), "300s")?;
        if retry_base.is_zero() || retry_max < retry_base {
            return Err(ConfigError::Invalid(format!(
                "retry_base ({retry_base:?}) must be above zero and at most retry_max ({retry_max:?})"
            )));
        }
        let poll_interval = duration("poll_interval", get("POLL_INTERVAL").or(file.poll_interval), "100ms")?;
        let retention = match get("RETENTION").or(file.retention) {
            Some(s) if s == "off" || s == "0" => None,
            v => Some(duration("retention", v, "7d")?),
        };
        let readiness_stall = duration("readiness_stall", get("READINESS_STALL").or(file.readiness_stall), "5m")?;
        let takeover_timeout = duration("takeover_timeout", get("TAKEOVER_TIMEOUT").or(file.takeover_timeout), "10s")?;
        if takeover_timeout < Duration::from_secs(1) {
            return Err(ConfigError::Invalid(format!("takeover_timeout {takeover_timeout:?} must be at least 1s")));
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
            destinations: file.destinations,
            heartbeat_interval,
            linger,
            max_in_flight_batches,
            max_unsettled_events,
            lane_stall_timeout,
            max_retained_wal,
            retry_base,
            retry_max,
            poll_interval,
            retention,
            readiness_stall,
            takeover_timeout,
        })
    }
}

fn duration(key: &str, v: Option<String>, default: &str) -> Result<Duration, ConfigError> {
    let s = v.unwrap_or_else(|| default.to_string());
    humantime::parse_duration(&s)
        .map_err(|e| ConfigError::Invalid(format!("{key} = {s:?} is not a duration such as 10s or 5ms: {e}")))
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
        Ok(n) if mult > 0 && n > 0 => n.checked_mul(mult).ok_or_else(|| ConfigError::Invalid(format!("{key} = {s:?} is too large"))),
        _ => Err(ConfigError::Invalid(format!("{key} = {s:?} is not a size such as 256MB or 1GB"))),
    }
}

fn number(key: &str, env: Option<String>, file: Option<usize>, default: usize) -> Result<usize, ConfigError> {
    let n = match env {
        Some(s) => s
            .parse()
            .map_err(|_| ConfigError::Invalid(format!("{key} = {s:?} is not a whole number")))?,
        None => file.unwrap_or(default),
    };
    if n == 0 {
        return Err(ConfigError::Invalid(format!("{key} must be at least 1")));
    }
    Ok(n)
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
        let e = Config::resolve(file(&format!("retry_base = \"10s\"\nretry_max = \"1s\"\n{BASE}")), &BTreeMap::new(), &Overrides::default());
        assert!(e.unwrap_err().to_string().contains("at most retry_max"));
    }

    #[test]
    fn debug_never_shows_the_password() {
        let c = Config::resolve(file(BASE), &BTreeMap::new(), &Overrides::default()).unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("app:***@127.0.0.1"));
    }
}
