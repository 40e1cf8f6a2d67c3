//! The relay's integration tests, one binary: a module per area, so a test's
//! path names its area (`end_to_end::...`, `table_path::...`). They run
//! against the local stack (scripts/dev-stack) through the test kit
//! (testkit/). Filters are substrings of the path:
//! `cargo test --release --test it -- end_to_end:: tls::`.

mod buses;
mod degraded;
mod delay;
mod end_to_end;
mod failover;
mod ha;
mod hardening;
mod invariants;
mod mapped;
mod operated;
mod pipeline;
mod replay;
mod routing;
mod s3;
mod scale;
mod slot_invalidation;
mod table_path;
mod telemetry;
mod tls;
mod topic_payload;
mod topics;
// Fail points in the relay: `--features outbox-relay/failpoints`.
#[cfg(feature = "failpoints")]
mod transient;
