//! The pipeline's settings, derived once from the configuration at start-up:
//! how lanes batch and send, how settlement marks rows, and the bounds on
//! memory, the slot the stream reads. Both sources build their pipeline
//! from these, never from [`Config`] directly.

use std::time::Duration;

use crate::config::{Config, Mode};
use crate::mapping::Mapping;
use crate::publish::offload::Threshold;

use super::budget::Memory;
use super::settle::Marking;

/// How every lane batches and sends.
#[derive(Debug, Clone, Copy)]
pub struct LaneSettings {
    /// How long a lane waits for more entries before sending a short batch.
    pub linger: Duration,
    /// Send at once when nothing is in flight; linger only while batches are.
    pub adaptive: bool,
    /// SendMessageBatch calls in flight per lane.
    pub max_in_flight: usize,
    /// A streaming lane whose oldest unsettled event is older spools.
    pub stall_timeout: Duration,
    /// A stream lane with nothing to do for this long is closed.
    pub idle_timeout: Duration,
}

/// The replication slot the stream reads, and the leader's lock.
#[derive(Debug, Clone)]
pub struct SlotSettings {
    pub name: String,
    pub publication: String,
    /// Created (or altered to be) a failover slot (PostgreSQL 17+).
    pub failover: bool,
    /// The slot's retained WAL past which every lane spools.
    pub max_retained_wal: u64,
    /// A leader whose lock's connection does not answer for this long stops.
    pub takeover_timeout: Duration,
}

/// How bodies go through S3, whatever the destination's bucket.
#[derive(Debug, Clone, Copy)]
pub struct OffloadSettings {
    pub threshold: Threshold,
    /// Bodies over this many bytes are DEAD (`too_large`) even through S3;
    /// also the largest event the memory budget plans for.
    pub max_body: u64,
}

/// Everything the relay's sources and pipeline are built from.
#[derive(Debug, Clone)]
pub struct Settings {
    pub lanes: LaneSettings,
    pub marking: Marking,
    pub memory: Memory,
    pub slot: SlotSettings,
    /// The table path's sleep between claims that were not full.
    pub poll_interval: Duration,
    /// Connections the table path's lanes share.
    pub table_connections: usize,
    /// `None`: no S3; a body over its queue's limit is DEAD.
    pub offload: Option<OffloadSettings>,
    /// Tables teams already have, read by the stream beside the relay's own.
    pub mapped: Vec<Mapping>,
}

impl LaneSettings {
    pub fn of(config: &Config) -> LaneSettings {
        LaneSettings {
            linger: config.linger,
            adaptive: config.adaptive_linger,
            max_in_flight: config.max_in_flight_batches,
            stall_timeout: config.lane_stall_timeout,
            idle_timeout: config.lane_idle_timeout,
        }
    }
}

impl SlotSettings {
    pub fn of(config: &Config) -> SlotSettings {
        SlotSettings {
            name: config.slot.clone(),
            publication: config.publication.clone(),
            failover: config.failover,
            max_retained_wal: config.max_retained_wal,
            takeover_timeout: config.takeover_timeout,
        }
    }
}

impl OffloadSettings {
    /// `None`: no S3.
    pub fn of(config: &Config) -> Option<OffloadSettings> {
        config.s3.as_ref().map(|s3| OffloadSettings { threshold: s3.threshold, max_body: s3.max_body_bytes })
    }
}

impl Memory {
    pub fn of(config: &Config) -> Memory {
        Memory {
            max_events: config.max_unsettled_events,
            max_bytes: config.max_unsettled_bytes,
            max_event_bytes: OffloadSettings::of(config).map_or(1 << 20, |o| o.max_body),
        }
    }
}

impl Settings {
    /// Derived once, when start-up has chosen the `mode` and read the
    /// `mapped` tables (their oids, key types and columns settled:
    /// [`Mapping::settle_columns`]). What runs before that (the checks,
    /// `status`, `slot create`) derives the part it needs alone.
    pub fn of(config: &Config, mode: Mode, mapped: Vec<Mapping>) -> Settings {
        Settings {
            lanes: LaneSettings::of(config),
            marking: Marking {
                base: config.retry_base,
                max: config.retry_max,
                published: config.published_rows,
                bound_unpositioned: mode != Mode::Polling,
            },
            memory: Memory::of(config),
            slot: SlotSettings::of(config),
            poll_interval: config.poll_interval,
            table_connections: config.max_table_connections,
            offload: OffloadSettings::of(config),
            mapped,
        }
    }
}
