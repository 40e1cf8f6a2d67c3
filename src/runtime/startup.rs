//! Start-up: the checks, each within its deadline, and the mode they allow.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{ArchiveConfig, Config, Mode, S3Config};
use crate::db;
use crate::mapping::Mapping;
use crate::metrics::Metrics;
use crate::pipeline::archive::Archive;
use crate::pipeline::budget::Memory;
use crate::pipeline::destinations::Prepare;
use crate::pipeline::settings::{LaneSettings, OffloadSettings, SlotSettings};
use crate::policy::retry::{classify_start_up, StartUpFailure};
use crate::publish::kind::{Kind, Target};
use crate::publish::offload::{ObjectStore, OffloadTarget, S3Store};
use crate::publish::Publisher;

use tokio::sync::watch;

use super::monitor::warn_if_slot_retains_wal;
use super::RelayError;

/// What start-up found out.
pub(crate) struct Started {
    pub(crate) mode: Mode,
    pub(crate) sharded: bool,
    pub(crate) queues: BTreeMap<String, Target>,
    pub(crate) retention: Option<Duration>,
    /// Each mapped table's key type and columns, in `settings.mapped`'s order.
    pub(crate) mapped: Vec<Mapping>,
    /// How a queue looked up later is prepared, as the configured ones were.
    pub(crate) prepare: Prepare,
    /// Where published events are archived (`[archive]`).
    pub(crate) archive: Option<Arc<Archive>>,
}

/// Why start-up did not finish.
pub(crate) enum NotStarted {
    /// The server went away under a check (a restart, a failover): the
    /// checks are made again.
    ServerWentAway(db::DbError),
    /// A check refused what it found: the relay exits with its message.
    Refused(RelayError),
}

impl From<RelayError> for NotStarted {
    fn from(e: RelayError) -> Self {
        NotStarted::Refused(e)
    }
}

/// A failed step, classified by the retry policy.
fn not_started(e: db::DbError, connected: bool) -> NotStarted {
    match classify_start_up(e.failure(), connected) {
        StartUpFailure::ServerWentAway => NotStarted::ServerWentAway(e),
        StartUpFailure::Refused => NotStarted::Refused(RelayError::Startup(e.to_string())),
    }
}

/// [`start_up`], made again while the server goes away under it (each time
/// after the reconnect backoff, with a warning naming the cause); `None`
/// when asked to stop first. A refused check ends it at once.
pub(crate) async fn start_up_until_done(
    config: &Config,
    db: &db::Db,
    publisher: &dyn Publisher,
    metrics: &Metrics,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<Started>, RelayError> {
    let mut reconnect = crate::policy::retry::Reconnect::default();
    let store = match &config.s3 {
        Some(s3) => Some(offload_store(config, s3).await?),
        None => None,
    };
    let archive = match &config.archive {
        Some(a) => Some(archive(config, a).await?),
        None => None,
    };
    loop {
        let attempt = tokio::select! {
            r = start_up(config, db, publisher, store.as_ref(), metrics) => r,
            _ = stop.wait_for(|s| *s) => return Ok(None),
        };
        match attempt {
            Ok(started) => return Ok(Some(Started { archive, ..started })),
            Err(NotStarted::Refused(e)) => return Err(e),
            Err(NotStarted::ServerWentAway(e)) => {
                let wait = reconnect.failed();
                tracing::warn!(error = %e, retry_in = ?wait, "start-up: PostgreSQL went away during the checks (a restart or a failover?); checking again");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.wait_for(|s| *s) => return Ok(None),
                }
            }
        }
    }
}

/// The start-up checks, each with a deadline: the database (connect_timeout,
/// query_timeout), the queues (the SQS client's own timeouts).
async fn start_up(
    config: &Config,
    db: &db::Db,
    publisher: &dyn Publisher,
    store: Option<&Arc<dyn ObjectStore>>,
    metrics: &Metrics,
) -> Result<Started, NotStarted> {
    let sql = db.connect().await.map_err(|e| not_started(e, false))?;
    let startup = |e: db::DbError| not_started(e, true);
    db.within("checking the server", db::server::check_server(&sql, &db.server(), config.failover))
        .await
        .map_err(startup)?;
    let (mode, sharded, mapped_columns) = resolve_mode(&sql, config, db).await?;
    for m in [Mode::Cdc, Mode::Polling] {
        metrics.mode.with_label_values(&[&m.to_string()]).set(i64::from(m == mode));
    }
    let prepare = prepare_queues(config, store.cloned());
    let queues = describe_destinations(config, publisher, &prepare).await?;
    if mode == Mode::Polling {
        let _ = tokio::time::timeout(config.query_timeout, warn_if_slot_retains_wal(&sql, &config.slot)).await;
    }
    db.within(
        "checking what settlement writes",
        crate::pipeline::settle::check_privileges(&sql, config.published_rows),
    )
    .await
    .map_err(startup)?;
    if mode == Mode::Cdc {
        db.within("checking the slot hand-off record", db::schema::check_handoffs(&sql)).await.map_err(startup)?;
    }
    let mut retention = config.retention;
    if retention.is_some()
        && !db.within("checking DELETE on the outbox", db::schema::can_delete_outbox(&sql)).await.map_err(startup)?
    {
        tracing::warn!("the retention sweeper needs DELETE on the outbox table (GRANT DELETE ON outbox TO <role>); PUBLISHED rows are kept");
        retention = None;
    }
    let mapped = settled_mappings(&config.mapped, mapped_columns);
    Ok(Started { mode, sharded, queues, retention, mapped, prepare, archive: None })
}

/// Every configured destination as its service describes it, prepared
/// ([`prepare_queues`]); one that does not answer refuses the start.
async fn describe_destinations(
    config: &Config,
    publisher: &dyn Publisher,
    prepare: &Prepare,
) -> Result<BTreeMap<String, Target>, RelayError> {
    let mut queues = BTreeMap::new();
    for (name, address) in &config.destinations {
        let kind =
            Kind::of_address(address).map_err(|why| RelayError::Startup(format!("destination {name:?}: {why}")))?;
        let info = publisher.describe(kind, address).await.map_err(|e| {
            RelayError::Startup(format!(
                "destination {name:?}: {kind} {address} did not answer {} ({e}); check its address, the region/endpoint and the credentials",
                kind.rules().describe_name()
            ))
        })?;
        let info = prepare(name, info);
        tracing::info!(destination = %name, %kind, %address, fifo = info.fifo, max_message_size = info.max_message_size(), "destination ready");
        queues.insert(name.clone(), info);
    }
    Ok(queues)
}

/// The configured mappings with what start-up read of each table (its oid,
/// its key's type, which optional columns it has).
fn settled_mappings(mapped: &[Mapping], found: Vec<crate::source::cdc::mapped::Found>) -> Vec<Mapping> {
    mapped
        .iter()
        .zip(found)
        .map(|(m, found)| {
            let mut m = m.clone();
            m.settle_columns(found.oid, found.id_type, |c| found.columns.iter().any(|n| n == c));
            m
        })
        .collect()
}

/// The S3 client, once each configured bucket answered `HeadBucket`.
async fn offload_store(config: &Config, s3: &S3Config) -> Result<Arc<dyn ObjectStore>, RelayError> {
    let store =
        S3Store::new(&config.sqs_region, s3.endpoint_url.as_deref(), config.sqs_assume_role_arn.as_deref()).await;
    let mut buckets: BTreeSet<&str> = config.destinations.keys().filter_map(|d| s3.target(d)).map(|(b, _)| b).collect();
    // Destinations looked up on first use take the default bucket.
    if config.destination_template.is_some() {
        buckets.extend(s3.bucket.as_deref());
    }
    for bucket in buckets {
        store.check_bucket(bucket).await.map_err(|e| {
            RelayError::Startup(format!(
                "s3: bucket {bucket:?} did not answer HeadBucket ({e}); create it or fix s3.bucket / [s3.buckets], s3.endpoint_url and the credentials (the relay needs s3:PutObject on it)"
            ))
        })?;
        tracing::info!(bucket, "S3 bucket ready for bodies over the threshold");
    }
    Ok(Arc::new(store))
}

/// The archive's client, once its bucket answered `HeadBucket`.
async fn archive(config: &Config, a: &ArchiveConfig) -> Result<Arc<Archive>, RelayError> {
    let archive = Archive::on_s3(config, a).await;
    archive.store.check_bucket(&a.bucket).await.map_err(|e| {
        RelayError::Startup(format!(
            "archive: bucket {:?} did not answer HeadBucket ({e}); create it or fix archive.bucket, s3.endpoint_url and the credentials (the relay needs s3:PutObject, s3:ListBucket and, with a window, s3:DeleteObject on it)",
            a.bucket
        ))
    })?;
    tracing::info!(bucket = %a.bucket, prefix = %a.key_prefix, window = ?a.window, "archiving every published event");
    Ok(Arc::new(archive))
}

/// How every queue is prepared for sending, configured or looked up on
/// first use: fair-queue groups as configured, and its S3 target (bucket
/// and key prefix from the configuration, the rest from the settings) if
/// its bodies may go through S3.
fn prepare_queues(config: &Config, store: Option<Arc<dyn ObjectStore>>) -> Prepare {
    let (s3, offload, fair) = (config.s3.clone(), OffloadSettings::of(config), config.fair_queues);
    let stall_timeout = LaneSettings::of(config).stall_timeout;
    Box::new(move |destination, mut info| {
        info.fair = fair;
        info.offload = (|| {
            let offload = offload?;
            let (bucket, key_prefix) = s3.as_ref()?.target(destination)?;
            Some(Arc::new(OffloadTarget {
                store: Arc::clone(store.as_ref()?),
                bucket: bucket.to_string(),
                key_prefix: key_prefix.to_string(),
                threshold: offload.threshold,
                max_body: offload.max_body as usize,
                stall_timeout,
            }))
        })();
        info
    })
}

/// `cdc` needs its prerequisites; `polling` the outbox table; `auto` takes
/// CDC when the server and role allow it, polling otherwise, and says why.
/// Also returns whether this CDC relay is one shard (a filtered publication),
/// and each mapped table's key type.
async fn resolve_mode(
    sql: &tokio_postgres::Client,
    config: &Config,
    db: &db::Db,
) -> Result<(Mode, bool, Vec<crate::source::cdc::mapped::Found>), NotStarted> {
    let startup = |e: db::DbError| not_started(e, true);
    // The CDC checks, the shard's included; Ok(sharded).
    let cdc = || async {
        let slot = SlotSettings::of(config);
        let check = crate::source::cdc::check_cdc(sql, db, &slot, Memory::of(config));
        db.within_connecting("checking the CDC prerequisites", check).await?;
        let destinations: Vec<String> = config.destinations.keys().cloned().collect();
        db.within(
            "checking the publication's shard",
            crate::source::cdc::publication::check_shard(sql, &config.publication, &destinations),
        )
        .await
    };
    let outbox_table = || db.within("checking the outbox table", db::schema::check_outbox_table(sql));
    let (mode, mut sharded) = match config.mode {
        Mode::Cdc => (Mode::Cdc, cdc().await.map_err(startup)?),
        Mode::Polling => {
            outbox_table().await.map_err(startup)?;
            (Mode::Polling, false)
        }
        Mode::Auto => {
            outbox_table().await.map_err(startup)?;
            auto_mode(cdc().await).map_err(startup)?
        }
    };
    if mode == Mode::Polling {
        // A shard's relay polling (the fallback while its slot is repaired)
        // is still a shard: the other shards' rows are not its to judge.
        let destinations: Vec<String> = config.destinations.keys().cloned().collect();
        let shard = crate::source::cdc::publication::check_shard(sql, &config.publication, &destinations);
        sharded = db.within("checking the publication's shard", shard).await.map_err(startup)?;
    }
    if sharded && config.destination_template.is_some() {
        return Err(startup(db::DbError::Check(format!(
            "publication {:?} is a shard (filtered to its destinations), and a shard sends only its [destinations]: \
             remove sqs.queue_url_template, or read an unfiltered publication",
            config.publication
        ))));
    }
    let columns = check_mapped_tables(sql, config, mode, sharded, db).await.map_err(startup)?;
    Ok((mode, sharded, columns))
}

/// `auto`: CDC if its checks passed, polling if CDC is not possible here.
fn auto_mode(cdc: Result<bool, db::DbError>) -> Result<(Mode, bool), db::DbError> {
    match cdc {
        Ok(sharded) => {
            tracing::info!("mode auto: CDC (wal_level=logical, the role may replicate, the publication exists)");
            Ok((Mode::Cdc, sharded))
        }
        Err(db::DbError::CdcUnavailable(why)) => {
            tracing::warn!(
                reason = %why,
                "mode auto: polling, because CDC is not possible here; rows deleted by their own transaction (transient rows) are not seen by polling"
            );
            Ok((Mode::Polling, false))
        }
        Err(e) => Err(e),
    }
}

/// Mapped tables are read from the slot, and polled only by their published
/// column: each is checked, and polling is refused for a table without one.
/// Returns each table's key type and columns.
async fn check_mapped_tables(
    sql: &tokio_postgres::Client,
    config: &Config,
    mode: Mode,
    sharded: bool,
    db: &db::Db,
) -> Result<Vec<crate::source::cdc::mapped::Found>, db::DbError> {
    let Some(first) = config.mapped.first() else { return Ok(Vec::new()) };
    if sharded {
        return Err(db::DbError::Check(format!(
            "mapped table {}.{}: a sharded relay (a row-filtered publication) cannot read mapped tables yet: \
             every shard would send all of its rows",
            first.schema, first.table
        )));
    }
    if let Some(m) = config.mapped.iter().find(|m| m.published.is_none() && mode == Mode::Polling) {
        return Err(db::DbError::Check(format!(
            "mapped table {}.{}: polling finds a mapped table's rows by its published column, and this mapping \
             has none (its rows may be deleted as they are written, as Debezium's convention does): read it from \
             the replication slot (mode cdc, which needs wal_level=logical and a role that may replicate), or \
             name a `published` timestamptz column",
            m.schema, m.table
        )));
    }
    let publication = (mode != Mode::Polling).then_some(config.publication.as_str());
    let mut found = Vec::with_capacity(config.mapped.len());
    for m in &config.mapped {
        let check = crate::source::cdc::mapped::check_mapped(sql, m, publication);
        found.push(db.within("checking a mapped table", check).await?);
    }
    Ok(found)
}
