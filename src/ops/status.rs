//! `status` and `slot status`: mode, slot, lag, and per destination NEW,
//! spooled, DEAD and the oldest row.

use tokio_postgres::Client;

use super::OpsError;
use crate::config::{Config, Mode};
use crate::db;
use crate::db::settled::Holder;
use crate::publish::kind::Kind;
use crate::publish::template::AddressTemplate;

/// Format version of `status --json`; bumped only when a field changes meaning
/// or disappears (new fields may be added).
pub const STATUS_FORMAT: u32 = 1;

/// What `outbox-relay status` reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Status {
    pub format: u32,
    /// The mode in the configuration.
    pub mode: Mode,
    /// What `run` would use now (`auto` resolved against the server).
    pub effective_mode: Mode,
    /// Why CDC is not possible, when it is not.
    pub cdc_unavailable: Option<String>,
    pub slot: SlotStatus,
    pub destinations: Vec<DestinationStatus>,
    /// Whether the running relay answered on `metrics_addr` (its `/status`
    /// gives each destination's current failures and bodies through S3).
    #[serde(default)]
    pub relay: Option<RelayReached>,
    /// Each mapped table (`[[outbox]]`).
    #[serde(default)]
    pub tables: Vec<TableStatus>,
    /// Replays not finished: copying, or interrupted (`replay resume`).
    #[serde(default)]
    pub replays: Vec<super::replay::Replay>,
}

/// A mapped table as `status` sees it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct TableStatus {
    /// `schema.table`.
    pub table: String,
    /// Rows whose published column is NULL (`None`: the table has none; its
    /// rows are read from the slot only, and nothing records them).
    pub unpublished: Option<i64>,
    /// Its rows copied into the relay's table: waiting there (deferred,
    /// spooled, held) and DEAD (`dead list` shows them, their event ids
    /// starting with `schema.table:`).
    pub in_relay_table: i64,
    pub dead: i64,
    /// What stands in its way, as start-up would say it (dropped, a column
    /// gone, a key that may be NULL, a grant missing, out of the
    /// publication), or why it could not be read.
    pub error: Option<String>,
    /// Its name now, when it was renamed or moved since the configuration
    /// named it (followed by its oid).
    #[serde(default)]
    pub renamed_to: Option<String>,
}

/// The running relay as `status` found it on `metrics_addr`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct RelayReached {
    pub address: String,
    /// Why it did not answer, if it did not (not running there, say).
    pub error: Option<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub active: Option<bool>,
    pub active_pid: Option<i32>,
    pub wal_status: Option<String>,
    /// Current WAL minus the confirmed flush LSN.
    pub lag_bytes: Option<i64>,
    /// Current WAL minus the restart LSN: what the server keeps for the slot.
    pub retained_wal_bytes: Option<i64>,
    pub confirmed_flush_lsn: Option<String>,
    /// Why the server invalidated the slot (`wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, `idle_timeout`); the relay recreates it.
    pub invalidation_reason: Option<String>,
    /// Created with FAILOVER (17+): standbys running `sync_replication_slots` keep a copy.
    #[serde(default)]
    pub failover: Option<bool>,
    /// Why the server holds the slot's walsender back, when it shows it
    /// (`synchronized_standby_slots` on 17+); the running relay names any
    /// other hold in its log and `outbox_relay_stream_held`.
    #[serde(default)]
    pub held_back: Option<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct DestinationStatus {
    pub destination: String,
    pub configured: bool,
    /// What it is: a configured address's kind, or the template's (`None`:
    /// neither configured nor templated).
    #[serde(default)]
    pub kind: Option<Kind>,
    /// NEW rows for the stream or the poller (`next_attempt_at` unset).
    pub new: i64,
    /// NEW rows handed to the table path (spooled, retried later, redriven).
    pub spooled: i64,
    pub dead: i64,
    /// Age of the oldest NEW row (spooled or not), held rows aside.
    pub oldest_new_age_seconds: Option<f64>,
    /// NEW rows held until a `deliver_at` still ahead (not counted above).
    #[serde(default)]
    pub held: i64,
    /// Seconds until the earliest held row is due.
    #[serde(default)]
    pub next_due_in_seconds: Option<f64>,
    /// What the running relay's sends fail on now (S3 or SQS, since when),
    /// as its `/status` says; empty when they succeed or it was not reached.
    #[serde(default)]
    pub failing: Vec<crate::metrics::Failing>,
    /// Bodies the running relay wrote to S3 since it started, and their
    /// bytes (`None`: the relay was not reached).
    #[serde(default)]
    pub offloaded_objects: Option<u64>,
    #[serde(default)]
    pub offloaded_bytes: Option<u64>,
}

impl DestinationStatus {
    /// A destination with nothing in the table.
    fn empty(destination: &str, configured: bool) -> Self {
        DestinationStatus {
            destination: destination.to_string(),
            configured,
            kind: None,
            new: 0,
            spooled: 0,
            dead: 0,
            oldest_new_age_seconds: None,
            held: 0,
            next_due_in_seconds: None,
            failing: Vec::new(),
            offloaded_objects: None,
            offloaded_bytes: None,
        }
    }
}

pub async fn slot_status(client: &Client, slot: &str) -> Result<SlotStatus, tokio_postgres::Error> {
    let row = client
        .query_opt(
            &format!(
                "SELECT active, active_pid, wal_status, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                        (pg_current_wal_lsn() - restart_lsn)::bigint, confirmed_flush_lsn::text, {},
                        (to_jsonb(s) ->> 'failover')::bool
                   FROM pg_replication_slots s WHERE slot_name = $1",
                crate::source::cdc::INVALIDATION_SQL
            ),
            &[&slot],
        )
        .await?;
    Ok(SlotStatus {
        name: slot.to_string(),
        exists: row.is_some(),
        active: row.as_ref().map(|r| r.get(0)),
        active_pid: row.as_ref().and_then(|r| r.get(1)),
        wal_status: row.as_ref().and_then(|r| r.get(2)),
        lag_bytes: row.as_ref().and_then(|r| r.get(3)),
        retained_wal_bytes: row.as_ref().and_then(|r| r.get(4)),
        confirmed_flush_lsn: row.as_ref().and_then(|r| r.get(5)),
        invalidation_reason: row.as_ref().and_then(|r| r.get(6)),
        failover: row.as_ref().and_then(|r| r.get(7)),
        held_back: if row.is_some() { crate::source::cdc::server_hold(client, slot).await? } else { None },
    })
}

/// The whole report: the mode, the slot, every destination's rows in the
/// table, and what the running relay says of them.
pub async fn status(client: &Client, config: &Config) -> Result<Status, OpsError> {
    // Before `migrate` there is nothing to report: say what to run.
    db::schema::check_outbox_table(client).await?;
    let (db, slot) = (db::Db::of(config), crate::pipeline::settings::SlotSettings::of(config));
    let memory = crate::pipeline::budget::Memory::of(config);
    let cdc_unavailable = match crate::source::cdc::check_cdc(client, &db, &slot, memory).await {
        Ok(()) => None,
        Err(db::DbError::CdcUnavailable(why)) => Some(why),
        Err(e) => return Err(e.into()),
    };
    let effective = match (config.mode, &cdc_unavailable) {
        (Mode::Polling, _) | (Mode::Auto, Some(_)) => Mode::Polling,
        _ => Mode::Cdc,
    };
    let mut destinations = destinations_in_table(client, config).await?;
    let relay = match config.metrics_addr {
        Some(addr) => Some(add_relay_view(&mut destinations, addr).await),
        None => None,
    };
    destinations.sort_by(|a, b| a.destination.cmp(&b.destination));
    for d in &mut destinations {
        d.kind = kind_of(config, &d.destination);
    }
    let mut tables = Vec::with_capacity(config.mapped.len());
    let publication = (effective != Mode::Polling).then_some(config.publication.as_str());
    for m in &config.mapped {
        tables.push(table_status(client, m, publication).await?);
    }
    let replays = super::replay::running(client).await?;
    Ok(Status {
        tables,
        replays,
        relay,
        format: STATUS_FORMAT,
        mode: config.mode,
        effective_mode: effective,
        cdc_unavailable,
        slot: slot_status(client, &config.slot).await?,
        destinations,
    })
}

/// A mapped table's unpublished rows and its rows in the relay's table.
async fn table_status(
    client: &Client,
    m: &crate::mapping::Mapping,
    publication: Option<&str>,
) -> Result<TableStatus, OpsError> {
    let table = format!("{}.{}", m.schema, m.table);
    let standing = crate::source::cdc::mapped::standing(client, m, publication).await?;
    let copies: tokio_postgres::Row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'NEW'), count(*) FILTER (WHERE status = 'DEAD')
               FROM outbox WHERE starts_with(event_id, $1)",
            &[&format!("{table}:")],
        )
        .await?;
    let mut t = TableStatus {
        table,
        unpublished: None,
        in_relay_table: copies.get(0),
        dead: copies.get(1),
        error: standing.trouble,
        renamed_to: standing.now.as_ref().map(|(schema, name)| format!("{schema}.{name}")),
    };
    if let Some(p) = m.published_column() {
        // Under its name of the day (by its oid), if renamed.
        let now =
            standing.now.map(|(schema, table)| crate::mapping::Mapping { schema, table, ..m.clone() }.qualified());
        let sql = format!("SELECT count(*) FROM {} WHERE {} IS NULL", now.as_deref().unwrap_or(&p.table), p.column);
        match client.query_one(&sql, &[]).await {
            Ok(r) => t.unpublished = Some(r.get(0)),
            Err(e) if t.error.is_none() => t.error = Some(db::describe(&e)),
            Err(_) => {}
        }
    }
    Ok(t)
}

/// Each destination with rows in the table (NEW, spooled, held, DEAD), and
/// each configured one without.
async fn destinations_in_table(client: &Client, config: &Config) -> Result<Vec<DestinationStatus>, OpsError> {
    let held = crate::policy::delay::HELD_SQL;
    let (stream, table) = (Holder::Stream.sql(""), Holder::Table.sql(""));
    let sql = format!(
        "SELECT destination,
                count(*) FILTER (WHERE {stream} AND NOT {held}),
                count(*) FILTER (WHERE {table} AND NOT {held}),
                count(*) FILTER (WHERE status = 'DEAD'),
                extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'NEW' AND NOT {held}))::float8,
                count(*) FILTER (WHERE {held}),
                extract(epoch FROM min(deliver_at) FILTER (WHERE {held}) - now())::float8
           FROM outbox WHERE status IN ('NEW', 'DEAD') GROUP BY destination ORDER BY destination"
    );
    let mut destinations: Vec<DestinationStatus> = client
        .query(&sql, &[])
        .await?
        .iter()
        .map(|r| DestinationStatus {
            destination: r.get(0),
            configured: config.destinations.contains_key(r.get::<_, &str>(0)) || config.destination_template.is_some(),
            new: r.get(1),
            spooled: r.get(2),
            dead: r.get(3),
            oldest_new_age_seconds: r.get(4),
            held: r.get(5),
            next_due_in_seconds: r.get(6),
            ..DestinationStatus::empty("", false)
        })
        .collect();
    for name in config.destinations.keys() {
        if !destinations.iter().any(|d| &d.destination == name) {
            destinations.push(DestinationStatus::empty(name, true));
        }
    }
    Ok(destinations)
}

/// What `destination` is: its configured address's kind, else the
/// template's.
fn kind_of(config: &Config, destination: &str) -> Option<Kind> {
    match config.destinations.get(destination) {
        Some(address) => Kind::of_address(address).ok(),
        None => config.destination_template.as_ref().map(AddressTemplate::kind),
    }
}

/// Ask the running relay on `addr` (its `/status`) for each destination's
/// current failures and bodies through S3, and add them.
async fn add_relay_view(destinations: &mut Vec<DestinationStatus>, addr: std::net::SocketAddr) -> RelayReached {
    let addr = reachable(addr);
    let views = match fetch_relay_view(addr).await {
        Ok(v) => v,
        Err(error) => return RelayReached { address: addr.to_string(), error: Some(error) },
    };
    for v in views {
        let d = match destinations.iter().position(|d| d.destination == v.destination) {
            Some(i) => &mut destinations[i],
            None => {
                destinations.push(DestinationStatus::empty(&v.destination, true));
                destinations.last_mut().expect("pushed")
            }
        };
        d.failing = v.health.failing;
        d.offloaded_objects = Some(v.health.offloaded_objects);
        d.offloaded_bytes = Some(v.health.offloaded_bytes);
    }
    for d in destinations.iter_mut() {
        d.offloaded_objects.get_or_insert(0);
        d.offloaded_bytes.get_or_insert(0);
    }
    RelayReached { address: addr.to_string(), error: None }
}

/// A listening address as a client reaches it: `0.0.0.0` is this host.
fn reachable(mut addr: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    if addr.ip().is_unspecified() {
        addr.set_ip(if addr.is_ipv4() { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { IpAddr::V6(Ipv6Addr::LOCALHOST) });
    }
    addr
}

/// `GET /status` on `addr`, within 3 s.
async fn fetch_relay_view(addr: std::net::SocketAddr) -> Result<Vec<crate::metrics::LaneView>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let get = async {
        let mut c = tokio::net::TcpStream::connect(addr).await?;
        c.write_all(b"GET /status HTTP/1.0\r\nHost: relay\r\n\r\n").await?;
        let mut reply = Vec::new();
        c.take(16 << 20).read_to_end(&mut reply).await?;
        std::io::Result::Ok(reply)
    };
    let reply = match tokio::time::timeout(std::time::Duration::from_secs(3), get).await {
        Ok(r) => r.map_err(|e| format!("no relay answers there ({e})"))?,
        Err(_) => return Err("no answer within 3 s".into()),
    };
    let text = String::from_utf8_lossy(&reply);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("not an HTTP answer")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!("/status answered {}", head.lines().next().unwrap_or("")));
    }
    serde_json::from_str(body).map_err(|e| format!("/status is not what this version reads: {e}"))
}

pub fn format_slot(s: &SlotStatus) -> String {
    if !s.exists {
        return format!(
            "slot {}: does not exist (the relay creates it at start, or `outbox-relay slot create`)\n",
            s.name
        );
    }
    let invalid = match &s.invalidation_reason {
        Some(r) => format!(" INVALIDATED ({r}: the relay recreates it and catches up from the table)"),
        None => String::new(),
    };
    let failover = if s.failover == Some(true) { " failover" } else { "" };
    let held = match &s.held_back {
        Some(why) => format!("\n  HELD BACK by the server: {why}; the relay publishes from the table meanwhile"),
        None => String::new(),
    };
    format!(
        "slot {}: {} wal_status={} lag={} bytes retained={} bytes confirmed_flush_lsn={}{failover}{invalid}{held}\n",
        s.name,
        match (s.active, s.active_pid) {
            (Some(true), Some(pid)) => format!("active (pid {pid})"),
            (Some(true), None) => "active".into(),
            _ => "INACTIVE (retaining WAL)".into(),
        },
        s.wal_status.as_deref().unwrap_or("?"),
        s.lag_bytes.unwrap_or(0),
        s.retained_wal_bytes.unwrap_or(0),
        s.confirmed_flush_lsn.as_deref().unwrap_or("?"),
    )
}

pub fn format_status(s: &Status) -> String {
    let mut out = format!("mode: {} (configured {})\n", s.effective_mode, s.mode);
    if let (Some(why), Mode::Auto | Mode::Cdc) = (&s.cdc_unavailable, s.mode) {
        out += &format!("CDC unavailable: {why}\n");
    }
    out += &format_slot(&s.slot);
    out += &format!(
        "{:<24} {:<6} {:>10} {:>10} {:>10} {:>14} {:>10} {:>14}\n",
        "destination", "kind", "NEW", "spooled", "DEAD", "oldest NEW (s)", "held", "next due (s)"
    );
    let secs = |v: Option<f64>| v.map(|a| format!("{a:.1}")).unwrap_or_else(|| "-".into());
    for d in &s.destinations {
        out += &format!(
            "{:<24} {:<6} {:>10} {:>10} {:>10} {:>14} {:>10} {:>14}{}\n",
            d.destination,
            d.kind.map_or("-", Kind::as_str),
            d.new,
            d.spooled,
            d.dead,
            secs(d.oldest_new_age_seconds),
            d.held,
            secs(d.next_due_in_seconds),
            if d.configured { "" } else { "  (not configured)" }
        );
        out += &format_health(d);
    }
    if let Some(RelayReached { address, error: Some(e) }) = &s.relay {
        out += &format!("relay at {address}: {e} (failures and bodies through S3 are shown when it answers)\n");
    }
    out += &format_tables(&s.tables);
    for r in &s.replays {
        out += &format!("{}\n", super::replay::format_replay(r));
    }
    out
}

/// The mapped tables' lines, if any.
fn format_tables(tables: &[TableStatus]) -> String {
    if tables.is_empty() {
        return String::new();
    }
    let mut out = format!("{:<40} {:>12} {:>16} {:>10}\n", "mapped table", "unpublished", "in relay table", "DEAD");
    for t in tables {
        let unpublished = t.unpublished.map_or_else(|| "-".to_string(), |n| n.to_string());
        out += &format!("{:<40} {:>12} {:>16} {:>10}\n", t.table, unpublished, t.in_relay_table, t.dead);
        if let Some(now) = &t.renamed_to {
            out += &format!("  renamed or moved: now {now} (followed by its oid; set `table` in [[outbox]])\n");
        }
        if let Some(e) = &t.error {
            out += &format!("  {e}\n");
        }
    }
    out
}

/// A destination's current failures and bodies through S3, indented under
/// its line (nothing when the relay was not reached or has none to show).
fn format_health(d: &DestinationStatus) -> String {
    let mut out = String::new();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_millis() as u64)
        .unwrap_or_default();
    for f in &d.failing {
        let since = std::time::UNIX_EPOCH + std::time::Duration::from_millis(f.since_unix_ms);
        out += &format!(
            "  FAILING on {} since {} ({:.0} s): {}\n",
            f.service.as_str().to_uppercase(),
            humantime::format_rfc3339_seconds(since),
            now_ms.saturating_sub(f.since_unix_ms) as f64 / 1000.0,
            f.error
        );
    }
    if let (Some(n), Some(bytes)) = (d.offloaded_objects, d.offloaded_bytes) {
        if n > 0 {
            out += &format!("  bodies through S3 since the relay started: {n} objects, {bytes} bytes\n");
        }
    }
    out
}
