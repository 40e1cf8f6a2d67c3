//! The fault-injection measurement: every scenario of the README's
//! "Guarantees" table, N times each, on a stack of its own; prints a table,
//! then one JSON object of counters (also written to `--json-out`).
//!
//!     cargo run --release -p outbox-relay-testkit --features outbox-relay/failpoints --bin measure -- --repetitions 100
//!
//! Exits 1 when a must-be-zero cell is not zero. Built only with the relay's
//! `failpoints` feature; the relay binary it spawns must have the fail points
//! too: it checks (`outbox-relay --built-with-failpoints`) and builds it with
//! them when it does not.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use testkit::faults;

#[derive(Parser)]
#[command(about = "Kill processes at the worst moments and count what is lost or duplicated")]
struct Args {
    /// Repetitions of each scenario.
    #[arg(long, default_value_t = 100)]
    repetitions: usize,
    /// How long one lane's queue is gone in sqs_down_one_lane.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    sqs_outage: Duration,
    /// Lane outages run side by side in sqs_down_one_lane.
    #[arg(long, default_value_t = 10)]
    outage_parallel: usize,
    /// Only scenarios whose name contains one of these (repeatable).
    #[arg(long)]
    only: Vec<String>,
    /// Also write the JSON here.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
    /// Keep the measurement's stack running afterwards.
    #[arg(long)]
    keep_stack: bool,
}

/// The relay binary beside this one must have the fail points: a binary
/// built without them would silently not fail where planned. If it lacks
/// them (or is missing), build it with them, with the cargo that built us.
fn ensure_failpoint_relay() -> Result<(), String> {
    let relay = testkit::process::relay_bin();
    let has = |p: &std::path::Path| {
        std::process::Command::new(p).arg("--built-with-failpoints").status().map(|s| s.success()).unwrap_or(false)
    };
    if has(&relay) {
        return Ok(());
    }
    eprintln!("measure: {} lacks the fail points; building it with --features failpoints", relay.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let built = std::process::Command::new(cargo)
        .args(["build", "--release", "--features", "failpoints", "--bin", "outbox-relay", "--manifest-path", manifest])
        .status()
        .map_err(|e| format!("cannot run cargo to build the fail-point relay: {e}"))?;
    if built.success() && has(&relay) {
        Ok(())
    } else {
        Err(format!(
            "{} has no fail points even after building it; run `cargo build --release --features failpoints --bin outbox-relay`",
            relay.display()
        ))
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("child") {
        return match faults::child(&argv[2..]).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("measure child: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    let args = Args::parse();
    if let Err(e) = ensure_failpoint_relay() {
        eprintln!("measure: {e}");
        return ExitCode::FAILURE;
    }
    // A stack of its own: one scenario restarts PostgreSQL.
    let stack_guard = testkit::process::StackGuard::own("measure", "OUTBOX_RELAY_MEASURE_STACK_DIR", args.keep_stack);
    let params = faults::Params {
        repetitions: args.repetitions,
        sqs_outage: args.sqs_outage,
        outage_parallel: args.outage_parallel,
        child_bin: std::env::current_exe().expect("own path"),
        only: args.only,
    };
    let started = std::time::Instant::now();
    let results = faults::run_all(&params).await;
    let mut json = faults::json(&results, &params);
    json["seconds"] = serde_json::json!((started.elapsed().as_secs_f64()).round());
    json["date"] = serde_json::json!(String::from_utf8_lossy(
        &std::process::Command::new("date").arg("-u").arg("+%Y-%m-%d").output().map(|o| o.stdout).unwrap_or_default()
    )
    .trim());
    drop(stack_guard);
    println!("{}", faults::table(&results));
    let text = serde_json::to_string_pretty(&json).unwrap();
    println!("{text}");
    if let Some(p) = args.json_out {
        std::fs::write(&p, &text).expect("write --json-out");
    }
    if json["violations"].as_array().map(|v| v.is_empty()).unwrap_or(false) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
