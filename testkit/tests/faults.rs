//! The fault-injection measurement in CI: every scenario of the README's
//! Guarantees table, a few repetitions each, through the `measure` binary
//! (the same code the 100-repetition run uses). Needs `--features failpoints`.

use std::process::Command;

#[test]
fn every_scenario_keeps_its_guarantee() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-faults-test-{}", std::process::id()));
    let json_path = dir.with_extension("json");
    let out = Command::new(env!("CARGO_BIN_EXE_measure"))
        .args(["--repetitions", "3", "--sqs-outage", "3s", "--outage-parallel", "2", "--json-out"])
        .arg(&json_path)
        .env("OUTBOX_RELAY_MEASURE_STACK_DIR", &dir)
        .output()
        .expect("run the measure binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    let text = std::fs::read_to_string(&json_path).unwrap_or_else(|e| panic!("no JSON ({e}); stderr:\n{stderr}"));
    std::fs::remove_file(&json_path).ok();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let violations = json["violations"].as_array().unwrap();
    assert!(violations.is_empty(), "violations: {violations:?}\n{stdout}\nstderr:\n{stderr}");
    assert!(out.status.success(), "measure failed: {:?}\nstderr:\n{stderr}", out.status);
    let scenarios = json["scenarios"].as_object().unwrap();
    assert_eq!(scenarios.len(), 10, "every scenario ran");
    // The baseline shows the problem; the outbox scenarios do not.
    assert_eq!(scenarios["dual_write_baseline"]["missing_messages"], 3);
    assert_eq!(scenarios["dual_write_baseline"]["missing_publish_intents"], 3);
    for (name, c) in scenarios {
        for key in [
            "missing_publish_intents",
            "partial_commits",
            "missing_messages",
            "duplicate_messages",
            "duplicate_business_effects",
            "duplicate_terminal_skips",
            "message_deletes",
        ] {
            assert!(c[key].is_u64(), "{name}.{key} is a counter: {c}");
        }
        if name != "dual_write_baseline" {
            assert_eq!(c["missing_messages"], 0, "{name}: {c}");
        }
    }
    assert_eq!(scenarios["consumer_duplicate_delivery"]["message_deletes"], 6);
    assert_eq!(scenarios["consumer_duplicate_delivery"]["duplicate_terminal_skips"], 3);
}
