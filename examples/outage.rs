//! Measure a one-lane outage under load (issue "never hold the slot hostage"):
//! three lanes at a steady rate, the middle lane's queue deleted for
//! `--outage` seconds while an unrelated table writes `--noise-mb` MB/s, then
//! the queue recreated. Prints the report as JSON: the slot's max lag against
//! `max_retained_wal`, the healthy lanes' commit-to-publish p50/p99 before and
//! during the outage, and the rows lost.
//!
//!     cargo run --release --example outage -- [--outage 60] [--rate 500] [--noise-mb 20] [--budget-mb 256]
//!
//! It starts the project's own stack (scripts/dev-stack), as the tests do.

use std::time::Duration;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} takes a number")))
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let params = testkit::outage::Params {
        baseline: Duration::from_secs(arg("--baseline", 20)),
        outage: Duration::from_secs(arg("--outage", 60)),
        rows_per_lane_per_s: arg("--rate", 500) as u32,
        noise_mb_per_s: arg("--noise-mb", 20) as u32,
        max_retained_wal: arg("--budget-mb", 256) << 20,
        lane_stall_timeout: Duration::from_secs(arg("--stall-timeout", 30)),
    };
    let report = testkit::outage::run(params).await;
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}
