//! Prometheus metrics, registered once per relay in its own registry (so
//! tests can run several relays in one process); served by [`crate::runtime::http`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

pub const SLOT_LAG_BYTES: &str = "outbox_relay_slot_lag_bytes";
pub const SLOT_RETAINED_WAL_BYTES: &str = "outbox_relay_slot_retained_wal_bytes";
pub const EVENTS_PUBLISHED_TOTAL: &str = "outbox_relay_events_published_total";
pub const TRANSIENT_EVENTS_TOTAL: &str = "outbox_relay_transient_events_total";
pub const EVENTS_DEAD_TOTAL: &str = "outbox_relay_events_dead_total";
pub const PUBLISH_SECONDS: &str = "outbox_relay_publish_seconds";
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "outbox_relay_commit_to_publish_seconds";
pub const BACKLOG_EVENTS: &str = "outbox_relay_backlog_events";
pub const IN_FLIGHT_EVENTS: &str = "outbox_relay_in_flight_events";
pub const OLDEST_UNPUBLISHED_SECONDS: &str = "outbox_relay_oldest_unpublished_seconds";
pub const SLOT_WAL_STATUS: &str = "outbox_relay_slot_wal_status";
pub const BATCH_ENTRIES: &str = "outbox_relay_batch_entries";
pub const BATCH_BYTES: &str = "outbox_relay_batch_bytes";
pub const HEARTBEAT_RTT_SECONDS: &str = "outbox_relay_heartbeat_rtt_seconds";
pub const IS_LEADER: &str = "outbox_relay_is_leader";
pub const LEADER_CHANGES_TOTAL: &str = "outbox_relay_leader_changes_total";
pub const MODE: &str = "outbox_relay_mode";
pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
pub const SQS_ENTRY_FAILURES_TOTAL: &str = "outbox_relay_sqs_entry_failures_total";
pub const REPLAYED_FILTERED_TOTAL: &str = "outbox_relay_replayed_events_filtered_total";
pub const STREAM_RESTARTS_TOTAL: &str = "outbox_relay_stream_restarts_total";
pub const LANE_SPOOLED: &str = "outbox_relay_lane_spooled";
pub const LANE_IN_FLIGHT_LIMIT: &str = "outbox_relay_lane_in_flight_limit";
pub const LANE_SPOOL_SWITCHES_TOTAL: &str = "outbox_relay_lane_spool_switches_total";
pub const EVENTS_DEFERRED_TOTAL: &str = "outbox_relay_events_deferred_total";
pub const SLOT_RECREATED_TOTAL: &str = "outbox_relay_slot_recreated_total";
pub const STREAM_HELD: &str = "outbox_relay_stream_held";
pub const TABLE_LANES: &str = "outbox_relay_table_lanes";
pub const STREAM_LANES: &str = "outbox_relay_stream_lanes";
pub const DESTINATION_INFO: &str = "outbox_relay_destination_info";
pub const TABLE_CONNECTIONS: &str = "outbox_relay_table_connections";
pub const STREAM_HOLDS_TOTAL: &str = "outbox_relay_stream_holds_total";
pub const DESTINATION_FAILING_SINCE_SECONDS: &str = "outbox_relay_destination_failing_since_seconds";
pub const SLOT_ACTIVE: &str = "outbox_relay_slot_active";
pub const RETENTION_DELETED_TOTAL: &str = "outbox_relay_retention_deleted_total";
pub const ARCHIVED_EVENTS_TOTAL: &str = "outbox_relay_archived_events_total";
pub const ARCHIVED_BYTES_TOTAL: &str = "outbox_relay_archived_bytes_total";
pub const ARCHIVE_FAILURES_TOTAL: &str = "outbox_relay_archive_failures_total";
pub const ARCHIVE_EXPIRED_SEGMENTS_TOTAL: &str = "outbox_relay_archive_expired_segments_total";
pub const OFFLOADED_OBJECTS_TOTAL: &str = "outbox_relay_offloaded_objects_total";
pub const OFFLOADED_BYTES_TOTAL: &str = "outbox_relay_offloaded_bytes_total";
pub const EVENTS_DELAYED_TOTAL: &str = "outbox_relay_events_delayed_total";
pub const EVENTS_HELD_TOTAL: &str = "outbox_relay_events_held_total";
pub const HELD_EVENTS: &str = "outbox_relay_held_events";
pub const MAPPED_TABLE_TROUBLE: &str = "outbox_relay_mapped_table_trouble";
pub const HELD_NEXT_DUE_SECONDS: &str = "outbox_relay_held_next_due_seconds";

pub struct Metrics {
    pub registry: Registry,
    pub slot_lag_bytes: IntGauge,
    pub slot_retained_wal_bytes: IntGauge,
    pub events_published: IntCounterVec,
    pub events_transient: IntCounterVec,
    pub events_dead: IntCounterVec,
    pub publish_seconds: HistogramVec,
    pub commit_to_publish_seconds: Histogram,
    /// NEW rows in the table per destination (a capped count, refreshed every 10 s).
    pub backlog_events: IntGaugeVec,
    /// Events read from the slot and not yet settled, per destination.
    pub in_flight_events: IntGaugeVec,
    pub oldest_unpublished_seconds: prometheus::GaugeVec,
    pub slot_wal_status: IntGaugeVec,
    pub batch_entries: HistogramVec,
    pub batch_bytes: HistogramVec,
    pub heartbeat_rtt_seconds: prometheus::Gauge,
    pub is_leader: IntGauge,
    pub leader_changes: IntCounter,
    pub mode: IntGaugeVec,
    pub confirmed_lsn: IntGauge,
    pub sqs_entry_failures: IntCounterVec,
    pub replayed_filtered: IntCounter,
    pub stream_restarts: IntCounter,
    pub lane_spooled: IntGaugeVec,
    pub lane_in_flight_limit: IntGaugeVec,
    pub lane_spool_switches: IntCounterVec,
    pub events_deferred: IntCounterVec,
    pub slot_recreated: IntCounterVec,
    pub slot_active: IntGauge,
    pub retention_deleted: IntCounter,
    pub archived_events: IntCounterVec,
    pub archived_bytes: IntCounter,
    pub archive_failures: IntCounter,
    pub archive_expired: IntCounter,
    /// Bodies written to S3 (the message carries a pointer), per destination.
    pub offloaded_objects: IntCounterVec,
    pub offloaded_bytes: IntCounterVec,
    /// Messages sent with `DelaySeconds`, per destination.
    pub events_delayed: IntCounterVec,
    /// Rows held in the table until their `deliver_at`, per destination.
    pub events_held: IntCounterVec,
    /// Rows held in the table and not due yet (every 10 s).
    pub held_events: IntGaugeVec,
    /// 1 while something stands in a mapped table's way (every 15 s).
    pub mapped_table_trouble: IntGaugeVec,
    /// Seconds until the earliest held row is due.
    pub held_next_due_seconds: prometheus::GaugeVec,
    /// 1 while the server holds the stream back (rows go by the table).
    pub stream_held: IntGauge,
    pub table_lanes: IntGauge,
    pub stream_lanes: IntGauge,
    /// 1 per destination known, with its kind and whether it is FIFO.
    pub destination_info: IntGaugeVec,
    pub table_connections: IntGauge,
    /// Holds named (each spooled every lane to the table).
    pub stream_holds: IntCounter,
    /// Unix time since which a destination's sends fail, by service.
    pub destination_failing_since: prometheus::GaugeVec,
    /// Each destination's current failures and its bodies through S3: what
    /// `/status` (and so `outbox-relay status`) shows.
    health: std::sync::Mutex<std::collections::BTreeMap<String, LaneHealth>>,
    /// What holds the stream back (or keeps sessions from streaming), named.
    held_cause: std::sync::Mutex<Option<String>>,
    pub ready: AtomicBool,
    /// A standby able to take over ([`Metrics::set_standby`]).
    standby: AtomicBool,
    /// The slot's confirmed LSN has not moved for `readiness_stall` while it has lag.
    pub stalled: AtomicBool,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let registry = Registry::new();
        let lat = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
        let m = Metrics {
            slot_lag_bytes: IntGauge::new(SLOT_LAG_BYTES, "Current WAL position minus the slot's confirmed flush LSN").unwrap(),
            slot_retained_wal_bytes: IntGauge::new(SLOT_RETAINED_WAL_BYTES, "Current WAL position minus the slot's restart LSN").unwrap(),
            events_published: IntCounterVec::new(Opts::new(EVENTS_PUBLISHED_TOTAL, "Events accepted by SQS and settled (deleted, or marked PUBLISHED)"), &["destination"]).unwrap(),
            events_transient: IntCounterVec::new(Opts::new(TRANSIENT_EVENTS_TOTAL, "Published events with no row in the relay's table to settle (its own transaction deleted it, or a mapped table's): nothing written there"), &["destination"]).unwrap(),
            events_dead: IntCounterVec::new(Opts::new(EVENTS_DEAD_TOTAL, "Events marked DEAD, by reason"), &["destination", "reason"]).unwrap(),
            publish_seconds: HistogramVec::new(HistogramOpts::new(PUBLISH_SECONDS, "Duration of one SendMessageBatch call").buckets(lat.clone()), &["destination"]).unwrap(),
            commit_to_publish_seconds: Histogram::with_opts(HistogramOpts::new(COMMIT_TO_PUBLISH_SECONDS, "From the row's commit time to SQS acceptance").buckets(lat)).unwrap(),
            backlog_events: IntGaugeVec::new(Opts::new(BACKLOG_EVENTS, "NEW outbox rows per destination (counted up to 1,000,000, every 10 s)"), &["destination"]).unwrap(),
            in_flight_events: IntGaugeVec::new(Opts::new(IN_FLIGHT_EVENTS, "Events read from the slot but not yet settled, per destination"), &["destination"]).unwrap(),
            oldest_unpublished_seconds: prometheus::GaugeVec::new(Opts::new(OLDEST_UNPUBLISHED_SECONDS, "Age of the oldest NEW outbox row per destination (0 when none)"), &["destination"]).unwrap(),
            slot_wal_status: IntGaugeVec::new(Opts::new(SLOT_WAL_STATUS, "1 for the slot's wal_status (reserved, extended, unreserved, lost), 0 for the others"), &["status"]).unwrap(),
            batch_entries: HistogramVec::new(HistogramOpts::new(BATCH_ENTRIES, "Entries per SendMessageBatch").buckets(vec![1.0, 2.0, 3.0, 5.0, 8.0, 10.0]), &["destination"]).unwrap(),
            batch_bytes: HistogramVec::new(HistogramOpts::new(BATCH_BYTES, "Bytes per SendMessageBatch (bodies and attributes)").buckets(prometheus::exponential_buckets(256.0, 4.0, 8).unwrap()), &["destination"]).unwrap(),
            heartbeat_rtt_seconds: prometheus::Gauge::new(HEARTBEAT_RTT_SECONDS, "From writing the last heartbeat message to reading it back from the slot").unwrap(),
            is_leader: IntGauge::new(IS_LEADER, "1 while this relay holds the slot's leader lock and streams").unwrap(),
            leader_changes: IntCounter::new(LEADER_CHANGES_TOTAL, "Times this relay became or stopped being the leader").unwrap(),
            mode: IntGaugeVec::new(Opts::new(MODE, "1 for the mode the relay runs in"), &["mode"]).unwrap(),
            confirmed_lsn: IntGauge::new(CONFIRMED_LSN, "The LSN last confirmed to the server, as a number").unwrap(),
            sqs_entry_failures: IntCounterVec::new(Opts::new(SQS_ENTRY_FAILURES_TOTAL, "Failed SendMessageBatch entries and calls, by error code"), &["destination", "code"]).unwrap(),
            replayed_filtered: IntCounter::new(REPLAYED_FILTERED_TOTAL, "Replayed events skipped after a restart because their rows were already settled").unwrap(),
            stream_restarts: IntCounter::new(STREAM_RESTARTS_TOTAL, "Times the replication stream was restarted after an error or a lost leader lock").unwrap(),
            lane_spooled: IntGaugeVec::new(Opts::new(LANE_SPOOLED, "1 while the destination's lane spools to the outbox table instead of streaming"), &["destination"]).unwrap(),
            lane_in_flight_limit: IntGaugeVec::new(Opts::new(LANE_IN_FLIGHT_LIMIT, "SendMessageBatch calls the lane may have in flight now: grows while sends succeed at a steady round trip, halves on throttling and errors, at most max_in_flight_batches (path: stream, or table for the polling and spool-drain lanes)"), &["destination", "path"]).unwrap(),
            lane_spool_switches: IntCounterVec::new(Opts::new(LANE_SPOOL_SWITCHES_TOTAL, "Times the lane switched from streaming to spooling"), &["destination"]).unwrap(),
            events_deferred: IntCounterVec::new(Opts::new(EVENTS_DEFERRED_TOTAL, "Events handed to the table path with a next_attempt_at (spooled or retried later)"), &["destination"]).unwrap(),
            slot_recreated: IntCounterVec::new(Opts::new(SLOT_RECREATED_TOTAL, "Times the replication slot was found dropped or invalidated and created again (with a catch-up from the table), by reason"), &["reason"]).unwrap(),
            slot_active: IntGauge::new(SLOT_ACTIVE, "1 if the configured slot exists and a walsender reads it, 0 if it exists and nobody reads it (it retains WAL), -1 if it does not exist").unwrap(),
            retention_deleted: IntCounter::new(RETENTION_DELETED_TOTAL, "PUBLISHED rows deleted by the retention sweeper").unwrap(),
            archived_events: IntCounterVec::new(Opts::new(ARCHIVED_EVENTS_TOTAL, "Published events written to the archive (before they were settled)"), &["destination"]).unwrap(),
            archived_bytes: IntCounter::new(ARCHIVED_BYTES_TOTAL, "Bytes of the archive's segments written to S3 (compressed)").unwrap(),
            archive_failures: IntCounter::new(ARCHIVE_FAILURES_TOTAL, "Writes of an archive segment that failed (retried; the events stay unsettled meanwhile)").unwrap(),
            archive_expired: IntCounter::new(ARCHIVE_EXPIRED_SEGMENTS_TOTAL, "Archive segments deleted by the sweep, older than archive.window").unwrap(),
            offloaded_objects: IntCounterVec::new(Opts::new(OFFLOADED_OBJECTS_TOTAL, "Bodies over the threshold written to S3 (their messages carry the extended client's pointer)"), &["destination"]).unwrap(),
            offloaded_bytes: IntCounterVec::new(Opts::new(OFFLOADED_BYTES_TOTAL, "Bytes of the bodies written to S3"), &["destination"]).unwrap(),
            events_delayed: IntCounterVec::new(Opts::new(EVENTS_DELAYED_TOTAL, "Messages sent with DelaySeconds (deliver_at due within 15 minutes, standard queues)"), &["destination"]).unwrap(),
            events_held: IntCounterVec::new(Opts::new(EVENTS_HELD_TOTAL, "Rows held in the outbox table until their deliver_at (due later than SQS can delay, or on a FIFO queue)"), &["destination"]).unwrap(),
            held_events: IntGaugeVec::new(Opts::new(HELD_EVENTS, "NEW rows whose deliver_at is still ahead, per destination (counted up to 1,000,000, every 10 s)"), &["destination"]).unwrap(),
            mapped_table_trouble: IntGaugeVec::new(Opts::new(MAPPED_TABLE_TROUBLE, "1 while something an operator did stands in a mapped table's way (dropped, a column the mapping needs gone, a key that may be NULL, a grant missing, out of the publication: the log and `status` say what), 0 otherwise; every 15 s"), &["table"]).unwrap(),
            held_next_due_seconds: prometheus::GaugeVec::new(Opts::new(HELD_NEXT_DUE_SECONDS, "Seconds until the earliest held row of the destination is due (0 when none)"), &["destination"]).unwrap(),
            table_connections: IntGauge::new(TABLE_CONNECTIONS, "Connections the table path's lanes share, open now (at most max_table_connections; one unused for 30 s is closed)").unwrap(),
            destination_info: IntGaugeVec::new(Opts::new(DESTINATION_INFO, "1 per destination the relay knows (configured, or looked up on first use): its kind (queue, topic, bus) and whether it is FIFO"), &["destination", "kind", "fifo"]).unwrap(),
            stream_lanes: IntGauge::new(STREAM_LANES, "Stream lanes open in this replication session (and destinations being looked up): one per destination with events within lane_idle_timeout or work not finished").unwrap(),
            table_lanes: IntGauge::new(TABLE_LANES, "Table-path lanes running (polling, or draining a spool beside the stream), sharing max_table_connections: one per destination with rows due in the table or a lane spooling").unwrap(),
            stream_held: IntGauge::new(STREAM_HELD, "1 while the server sends nothing of the slot's stream though this relay waits for it (the log names the cause): rows go to the outbox table meanwhile").unwrap(),
            stream_holds: IntCounter::new(STREAM_HOLDS_TOTAL, "Times a hold of the stream was named (the server sending nothing though rows are committed behind the slot, or no session streaming): each spooled every lane to the outbox table").unwrap(),
            destination_failing_since: prometheus::GaugeVec::new(Opts::new(DESTINATION_FAILING_SINCE_SECONDS, "Unix time since which the destination's sends fail and are retried, by service (s3, sqs, sns or events); absent while they succeed"), &["destination", "service"]).unwrap(),
            health: Default::default(),
            held_cause: std::sync::Mutex::new(None),
            ready: AtomicBool::new(false),
            standby: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            registry,
        };
        for c in m.collectors() {
            m.registry.register(c).unwrap();
        }
        #[cfg(target_os = "linux")]
        m.registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self())).unwrap();
        Arc::new(m)
    }

    /// Every relay metric (process metrics aside), registered once in
    /// [`new`](Self::new) and listed by [`names`](Self::names).
    fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.slot_lag_bytes.clone()),
            Box::new(self.slot_retained_wal_bytes.clone()),
            Box::new(self.events_published.clone()),
            Box::new(self.events_transient.clone()),
            Box::new(self.events_dead.clone()),
            Box::new(self.publish_seconds.clone()),
            Box::new(self.commit_to_publish_seconds.clone()),
            Box::new(self.backlog_events.clone()),
            Box::new(self.in_flight_events.clone()),
            Box::new(self.oldest_unpublished_seconds.clone()),
            Box::new(self.slot_wal_status.clone()),
            Box::new(self.batch_entries.clone()),
            Box::new(self.batch_bytes.clone()),
            Box::new(self.heartbeat_rtt_seconds.clone()),
            Box::new(self.is_leader.clone()),
            Box::new(self.leader_changes.clone()),
            Box::new(self.mode.clone()),
            Box::new(self.confirmed_lsn.clone()),
            Box::new(self.sqs_entry_failures.clone()),
            Box::new(self.replayed_filtered.clone()),
            Box::new(self.stream_restarts.clone()),
            Box::new(self.lane_spooled.clone()),
            Box::new(self.lane_in_flight_limit.clone()),
            Box::new(self.lane_spool_switches.clone()),
            Box::new(self.events_deferred.clone()),
            Box::new(self.slot_recreated.clone()),
            Box::new(self.slot_active.clone()),
            Box::new(self.retention_deleted.clone()),
            Box::new(self.archived_events.clone()),
            Box::new(self.archived_bytes.clone()),
            Box::new(self.archive_failures.clone()),
            Box::new(self.archive_expired.clone()),
            Box::new(self.offloaded_objects.clone()),
            Box::new(self.offloaded_bytes.clone()),
            Box::new(self.events_delayed.clone()),
            Box::new(self.events_held.clone()),
            Box::new(self.held_events.clone()),
            Box::new(self.mapped_table_trouble.clone()),
            Box::new(self.held_next_due_seconds.clone()),
            Box::new(self.stream_held.clone()),
            Box::new(self.table_lanes.clone()),
            Box::new(self.stream_lanes.clone()),
            Box::new(self.destination_info.clone()),
            Box::new(self.table_connections.clone()),
            Box::new(self.stream_holds.clone()),
            Box::new(self.destination_failing_since.clone()),
        ]
    }

    /// The name of every metric this relay exports (labelled ones included
    /// before they have a sample), process metrics aside.
    pub fn names(&self) -> Vec<String> {
        self.collectors().iter().flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone())).collect()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }

    /// The stream is held back, or no session streams, for `cause`:
    /// `outbox_relay_stream_held` 1 and `/readyz` says why.
    pub fn hold(&self, cause: &str) {
        if self.stream_held.get() == 0 {
            self.stream_holds.inc();
        }
        self.stream_held.set(1);
        *self.held_cause.lock().unwrap() = Some(cause.to_string());
    }

    pub fn release_hold(&self) {
        self.stream_held.set(0);
        *self.held_cause.lock().unwrap() = None;
    }

    /// A send to `destination` through `service` failed with `error` (to be
    /// retried): it fails since the first failure after a success.
    pub fn failed(&self, destination: &str, service: Service, error: &str) {
        let mut health = self.health.lock().unwrap();
        let failing = &mut health.entry(destination.to_string()).or_default().failing;
        match failing.iter_mut().find(|f| f.service == service) {
            Some(f) => f.error = error.to_string(),
            None => {
                let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let labels = [destination, service.as_str()];
                self.destination_failing_since.with_label_values(&labels).set(since.as_secs_f64());
                failing.push(Failing { service, error: error.to_string(), since_unix_ms: since.as_millis() as u64 });
            }
        }
    }

    /// A send to `destination` through `service` succeeded.
    /// Whether `destination`'s calls to `service` fail now (no success
    /// since the last failure).
    pub fn is_failing(&self, destination: &str, service: Service) -> bool {
        let health = self.health.lock().unwrap();
        health.get(destination).is_some_and(|h| h.failing.iter().any(|f| f.service == service))
    }

    pub fn succeeded(&self, destination: &str, service: Service) {
        let mut health = self.health.lock().unwrap();
        let Some(h) = health.get_mut(destination) else { return };
        if h.failing.iter().any(|f| f.service == service) {
            h.failing.retain(|f| f.service != service);
            let _ = self.destination_failing_since.remove_label_values(&[destination, service.as_str()]);
        }
    }

    /// `objects` bodies of `bytes` in all written to S3 for `destination`.
    pub fn offloaded(&self, destination: &str, objects: u64, bytes: u64) {
        self.offloaded_objects.with_label_values(&[destination]).inc_by(objects);
        self.offloaded_bytes.with_label_values(&[destination]).inc_by(bytes);
        let mut health = self.health.lock().unwrap();
        let h = health.entry(destination.to_string()).or_default();
        h.offloaded_objects += objects;
        h.offloaded_bytes += bytes;
    }

    /// Every destination this process has sent to or failed on, as `/status`
    /// shows them.
    pub fn lanes(&self) -> Vec<LaneView> {
        let health = self.health.lock().unwrap();
        health.iter().map(|(d, h)| LaneView { destination: d.clone(), health: h.clone() }).collect()
    }

    /// What `/readyz` answers when not ready: why, as far as known.
    pub fn unready_reason(&self) -> String {
        if let Some(cause) = self.held_cause.lock().unwrap().as_ref() {
            return format!("stream held: {cause}");
        }
        if self.stalled.load(Ordering::Relaxed) {
            return "the slot's confirmed position is stalled".to_string();
        }
        "not streaming".to_string()
    }

    /// The relay's heartbeat, written at `written_us` (µs since the Unix
    /// epoch), came back through the slot now.
    pub fn heartbeat_returned(&self, written_us: i64) {
        let rtt_us = (crate::clock::now_unix_us() - written_us).max(0);
        self.heartbeat_rtt_seconds.set(rtt_us as f64 / 1e6);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// A standby that can take over: connected, asking for the leader lock
    /// another relay holds (false once it leads, or when it cannot ask).
    pub fn set_standby(&self, can_take_over: bool) {
        self.standby.store(can_take_over, Ordering::Relaxed);
    }

    /// Streaming (or polling), the confirmed LSN not stalled and the stream
    /// not held back by the server.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && !self.stalled.load(Ordering::Relaxed) && self.stream_held.get() == 0
    }

    /// `/readyz`: a leader (or polling relay) that [`Self::is_ready`], or a
    /// standby that can take over. Leadership is not asked: a Deployment of
    /// a leader and a standby must finish its rolling updates.
    pub fn readiness(&self) -> Readiness {
        if self.is_leader.get() == 1 || self.ready.load(Ordering::Relaxed) {
            if self.is_ready() {
                Readiness::Active
            } else {
                Readiness::NotReady(self.unready_reason())
            }
        } else if self.standby.load(Ordering::Relaxed) {
            Readiness::Standby
        } else {
            Readiness::NotReady("starting, or cannot reach PostgreSQL for the leader lock".into())
        }
    }
}

/// What `/readyz` answers ([`Metrics::readiness`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Leading (streaming) or polling, not stalled, not held.
    Active,
    /// Waiting on the leader lock, able to take over.
    Standby,
    /// Why not.
    NotReady(String),
}

/// What a destination's sends go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    /// SendMessageBatch.
    Sqs,
    /// PublishBatch.
    Sns,
    /// PutEvents.
    Events,
    /// The objects of bodies through S3.
    S3,
}

impl Service {
    pub fn as_str(self) -> &'static str {
        match self {
            Service::Sqs => "sqs",
            Service::Sns => "sns",
            Service::Events => "events",
            Service::S3 => "s3",
        }
    }
}

/// What the running relay knows of a destination that the table does not.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LaneHealth {
    /// Its current failures: at most one per service.
    pub failing: Vec<Failing>,
    /// Bodies written to S3 since the relay started, and their bytes.
    pub offloaded_objects: u64,
    pub offloaded_bytes: u64,
}

/// One destination's [`LaneHealth`], as `/status` serves it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LaneView {
    pub destination: String,
    #[serde(flatten)]
    pub health: LaneHealth,
}

/// A destination's current failure on one service.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Failing {
    pub service: Service,
    /// The last error.
    pub error: String,
    /// Unix milliseconds of the first failure since the last success.
    pub since_unix_ms: u64,
}

#[cfg(test)]
mod tests {
    /// The names in `docs/operations.md` are the names defined here, no
    /// more, no fewer.
    #[test]
    fn every_metric_is_documented_and_every_documented_one_exists() {
        fn names(text: &str, quoted: bool) -> std::collections::BTreeSet<String> {
            let start = if quoted { "\"outbox_relay_" } else { "outbox_relay_" };
            text.match_indices(start)
                .map(|(i, m)| {
                    let rest = &text[i + m.len()..];
                    let end = rest.find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(rest.len());
                    format!("outbox_relay_{}", &rest[..end])
                })
                .collect()
        }
        let defined = names(include_str!("metrics.rs").split("#[cfg(test)]").next().unwrap(), true);
        let documented = names(include_str!("../docs/operations.md"), false);
        assert!(defined.len() > 20, "{defined:?}");
        let undocumented: Vec<_> = defined.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&defined).collect();
        assert!(undocumented.is_empty(), "metrics missing from docs/operations.md: {undocumented:?}");
        assert!(unknown.is_empty(), "docs/operations.md names metrics that do not exist: {unknown:?}");
    }
}
