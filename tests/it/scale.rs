//! One relay against SQS's latency and throttling, through the SQS stand-in
//! (`testkit::standin`, the SQS JSON protocol over HTTP with the relay's own
//! client): a lane finds its own concurrency, shrinks it when calls are
//! throttled, and loses nothing and kills nothing meanwhile.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::publish::aws::AwsPublisher;
use testkit::standin::{Settings, Standin};
use testkit::*;

/// 5% of the calls throttled while half the rows go, none after: every row
/// arrives, none is DEAD, the slot is confirmed past all of them, and the
/// lane's limit grows again once the throttling stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_calls_lose_nothing_and_the_limit_comes_back() {
    const N: usize = 20_000;
    let settings = Settings { rtt: Duration::from_millis(5), throttle_rate: 0.05, record: true, ..Settings::default() };
    let standin = Standin::start(([127, 0, 0, 1], 0).into(), settings).await.unwrap();
    let db = TestDb::new("throttled").await;
    let url = standin.queue_url("hot");
    let mut cfg = config(&db, &[("hot", &url)]);
    cfg.metrics_addr = None;
    let relay = start(cfg, Arc::new(AwsPublisher::new("us-east-1", Some(standin.endpoint())).await));
    wait_for("the slot exists", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    for t in 0..N / 1000 {
        insert_rows(&c, &format!("t{t}"), "hot", 1000, None).await;
    }
    let published = || relay.metrics.events_published.with_label_values(&["hot"]).get();
    let limit = || relay.metrics.lane_in_flight_limit.with_label_values(&["hot", "stream"]).get();
    wait_for("half the rows published", Duration::from_secs(120), || async { published() >= N as u64 / 2 }).await;
    assert!(standin.stats().throttled > 0, "calls were throttled");
    standin.set(|s| s.throttle_rate = 0.0);
    let at_stop = limit();
    let end = db.current_lsn().await;
    wait_for("every row published", Duration::from_secs(120), || async { published() >= N as u64 }).await;
    wait_for("the slot confirmed past every row", Duration::from_secs(60), || async {
        db.confirmed_flush_lsn().await >= end
    })
    .await;
    let got: HashSet<String> = standin.bodies("hot").into_iter().collect();
    let missing: Vec<String> =
        (0..N / 1000).flat_map(|t| (1..=1000).map(move |i| format!("t{t}:{i}"))).filter(|b| !got.contains(b)).collect();
    assert!(missing.is_empty(), "{} rows never arrived, e.g. {:?}", missing.len(), &missing[..missing.len().min(5)]);
    assert_eq!(db.count("status = 'DEAD'").await, 0, "nothing DEAD for throttling");
    assert_eq!(db.count("status = 'NEW'").await, 0);
    // More rows with nothing throttled: the limit grows past where the
    // throttling left it.
    for t in 0..5 {
        insert_rows(&c, &format!("u{t}"), "hot", 1000, None).await;
    }
    wait_for("the limit grown again", Duration::from_secs(60), || async { limit() > at_stop.min(255) }).await;
    relay.stop().await;
}
