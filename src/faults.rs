//! Fail points for the fault-injection measurement (`measure`, built with
//! `--features failpoints`). Without the feature every point compiles to
//! nothing: the release binary carries none.
//!
//! A point configured with the `return` action ends the process on the spot
//! with status 137, as a `SIGKILL` would: no destructor, no graceful stop, no
//! status update to PostgreSQL. The `fail` crate's action syntax applies, so
//! `lane::after_send=3*off->return` dies at the fourth successful send.

/// Whether this build has the fail points (the `failpoints` feature).
pub const ENABLED: bool = cfg!(feature = "failpoints");

/// The points the relay and the measurement define, in pipeline order.
pub const POINTS: &[&str] = &[
    // Application side (the measurement's child processes).
    "dual_write::before_send",
    "enqueue::between_inserts",
    "enqueue::after_commit",
    // Relay: an SQS batch about to be sent; `return(ms)` holds it in flight
    // that long (the measurement's SIGKILL mid-batch needs a window).
    "lane::before_send",
    // Relay: an SQS batch accepted, its rows not yet marked.
    "lane::after_send",
    // Relay: rows marked, the slot's LSN not yet confirmed.
    "cdc::before_confirm",
    // Consumer: the handler's writes made, not committed.
    "consumer::in_handler",
    // Relay: a tick of the slot monitor (a background task); `panic` shows
    // that a panicking task stops the process.
    "monitor::tick",
];

/// Run the point `name`'s configured action (`panic`, `sleep(ms)`, ...);
/// nothing without the feature.
#[inline]
pub fn point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name);
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Die with status 137 if the point `name` is configured to `return`.
#[inline]
pub fn crash_point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    {
        fn hit(name: &'static str) -> bool {
            fail::fail_point!(name, |_| true);
            false
        }
        if hit(name) {
            eprintln!("fail point {name}: exiting with status 137");
            std::process::exit(137);
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Hold the caller `ms` milliseconds if the point `name` is configured
/// `return(ms)`, without blocking a runtime thread (the `fail` crate's own
/// `sleep` blocks one); nothing without the feature.
pub async fn delay_point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    {
        fn millis(name: &'static str) -> Option<u64> {
            fail::fail_point!(name, |v: Option<String>| v.and_then(|s| s.trim().parse().ok()));
            None
        }
        if let Some(ms) = millis(name) {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Configure the points named in `FAILPOINTS` (`name=actions;name=actions`).
/// Without the feature a non-empty `FAILPOINTS` is an error, so a measurement
/// never runs against a binary that cannot fail.
pub fn configure_from_env() -> Result<(), String> {
    let spec = std::env::var("FAILPOINTS").unwrap_or_default();
    if spec.trim().is_empty() {
        return Ok(());
    }
    #[cfg(feature = "failpoints")]
    {
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, actions) =
                part.split_once('=').ok_or_else(|| format!("FAILPOINTS: {part:?} is not name=actions"))?;
            if !POINTS.contains(&name) {
                return Err(format!("FAILPOINTS: unknown fail point {name:?}; known: {}", POINTS.join(", ")));
            }
            fail::cfg(name, actions).map_err(|e| format!("FAILPOINTS: {name}: {e}"))?;
        }
        Ok(())
    }
    #[cfg(not(feature = "failpoints"))]
    Err("FAILPOINTS is set but this binary was built without the failpoints feature".into())
}
