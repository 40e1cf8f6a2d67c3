//! Measure standby takeover: kill -9 the leading relay N times (default 10)
//! while rows flow; print each takeover time (kill to the slot being read by
//! the standby), the median, and whether every row arrived.
//!
//!     cargo run --release --example takeover -- [--kills 10]

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let kills = args
        .iter()
        .position(|a| a == "--kills")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let (mut times, total, unique) = testkit::takeover::run(kills).await;
    let ms: Vec<u128> = times.iter().map(|d| d.as_millis()).collect();
    times.sort();
    let median = times[times.len() / 2];
    println!(
        "{}",
        serde_json::json!({
            "kills": kills,
            "takeover_ms": ms,
            "median_takeover_ms": median.as_millis(),
            "max_takeover_ms": times.last().unwrap().as_millis(),
            "rows_committed": total,
            "rows_received": unique,
        })
    );
}
