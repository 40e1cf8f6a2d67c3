//! A lane whose queue is deleted while rows arrive on three lanes and other
//! tables write hundreds of MB: the other lanes keep their latency, the slot's
//! lag stays under `max_retained_wal`, and once the queue is back every row
//! arrives.

use std::time::Duration;

use testkit::outage::{run, Params};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_queue_never_holds_the_slot_and_loses_nothing() {
    let r = run(Params {
        baseline: Duration::from_secs(2),
        outage: Duration::from_secs(8),
        rows_per_lane_per_s: 200,
        noise_mb_per_s: 30,
        max_retained_wal: 96 << 20,
        lane_stall_timeout: Duration::from_secs(2),
    })
    .await;
    eprintln!("{}", serde_json::to_string_pretty(&r).unwrap());
    assert!(r.noise_bytes_written > 150 << 20, "the noise wrote hundreds of MB: {}", r.noise_bytes_written);
    assert!(
        r.max_slot_lag_bytes < r.max_retained_wal_bytes as i64,
        "slot lag {} passed the budget {}",
        r.max_slot_lag_bytes,
        r.max_retained_wal_bytes
    );
    assert!(r.sick_rows_during_outage > 1_000);
    assert_eq!(r.rows_lost, 0);
    assert_eq!(r.rows_dead, 0);
    assert!(r.spool_switches >= 1.0);
    // Healthy lanes: generous bounds for a shared 2-core machine.
    assert!(r.healthy_p50_ms_during < 1_000.0 && r.healthy_p99_ms_during < 3_000.0, "{r:?}");
}
