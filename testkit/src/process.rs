//! The relay as a separate process: config file, spawn (optionally with fail
//! points), SIGKILL, SIGTERM. Used by tests/it/end_to_end.rs, the takeover
//! measurement and the fault-injection measurement (src/bin/measure.rs of the
//! test kit).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::*;

/// The relay binary, `target/<profile>/outbox-relay`: beside the binary running
/// (the measurement) or one level up (tests in deps/, examples in examples/).
pub fn relay_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let beside = dir.join("outbox-relay");
    if beside.exists() {
        beside
    } else {
        dir.parent().unwrap().join("outbox-relay")
    }
}

/// A config file for `db`, its slot and `destinations`, in a directory of its
/// own that is removed on drop. `extra` is appended to the top-level keys.
pub struct RelayConfig {
    dir: PathBuf,
    pub path: PathBuf,
}

impl RelayConfig {
    pub fn new(db: &TestDb, mode: &str, destinations: &[(&str, &str)], extra: &str) -> RelayConfig {
        RelayConfig::through(db, mode, destinations, extra, &stack().sqs_url)
    }

    /// A relay with no `[destinations]`: every queue from `template` (a
    /// queue-URL template), SQS reached at `sqs_endpoint`.
    pub fn templated(db: &TestDb, mode: &str, extra: &str, sqs_endpoint: &str, template: &str) -> RelayConfig {
        let sqs = format!("endpoint_url = \"{sqs_endpoint}\"\nqueue_url_template = \"{template}\"");
        RelayConfig::written(db, mode, &[], extra, &sqs)
    }

    /// [`RelayConfig::new`] with SQS reached at `sqs_endpoint` (a proxy).
    pub fn through(
        db: &TestDb,
        mode: &str,
        destinations: &[(&str, &str)],
        extra: &str,
        sqs_endpoint: &str,
    ) -> RelayConfig {
        RelayConfig::written(db, mode, destinations, extra, &format!("endpoint_url = \"{sqs_endpoint}\""))
    }

    /// The configuration file: `extra` at the top, `sqs` the `[sqs]` table's lines.
    fn written(db: &TestDb, mode: &str, destinations: &[(&str, &str)], extra: &str, sqs: &str) -> RelayConfig {
        let metrics = if extra.contains("metrics_addr") { "" } else { "metrics_addr = \"off\"\n" };
        let mut toml = format!(
            "database_url = \"{}\"\nslot = \"{}\"\nmode = \"{mode}\"\nheartbeat_interval = \"200ms\"\n{metrics}{extra}\n[sqs]\n{sqs}\n[destinations]\n",
            db.url,
            db.slot,
        );
        for (name, url) in destinations {
            toml.push_str(&format!("{name} = \"{url}\"\n"));
        }
        let dir = std::env::temp_dir().join(format!("relay-{}-{}", db.name, unique("cfg")));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(&path, toml).unwrap();
        RelayConfig { dir, path }
    }

    pub fn spawn(&self) -> RelayProcess {
        self.spawn_with(&[])
    }

    /// Spawn with extra environment, e.g. `("FAILPOINTS", "lane::after_send=return")`.
    pub fn spawn_with(&self, env: &[(&str, &str)]) -> RelayProcess {
        RelayProcess::spawn(&self.path, env)
    }
}

impl Drop for RelayConfig {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

pub struct RelayProcess {
    pub child: Child,
}

impl RelayProcess {
    pub fn spawn(config: &Path, env: &[(&str, &str)]) -> RelayProcess {
        let mut cmd = Command::new(relay_bin());
        cmd.args(["run", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", std::env::var("RELAY_LOG").unwrap_or_else(|_| "error".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("RELAY_LOG").is_some() { Stdio::inherit() } else { Stdio::null() });
        for (k, v) in env {
            cmd.env(k, v);
        }
        RelayProcess { child: cmd.spawn().expect("spawn the relay binary") }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The exit status, if the process ends within `deadline`.
    pub async fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + deadline;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then the exit status (SIGKILL after `deadline`: `None`).
    pub async fn terminate(mut self, deadline: Duration) -> Option<ExitStatus> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        match self.wait_exit(deadline).await {
            Some(s) => Some(s),
            None => {
                self.kill();
                None
            }
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The exit code a fail point leaves (`std::process::exit(137)`), or a SIGKILL.
pub fn died_like_kill_9(s: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    s.code() == Some(137) || s.signal() == Some(9)
}

/// `GET /metrics` from a relay's metrics address.
pub async fn scrape(addr: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await.ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    Some(buf)
}

/// Every series of metric `name` in a scrape: (labels text, value).
pub fn series<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let (labels, v) = r.split_once('}')?;
                (labels, v)
            } else if rest.starts_with(' ') {
                ("", rest)
            } else {
                return None;
            };
            Some((labels, value.trim().parse().ok()?))
        })
        .collect()
}

/// A free loopback address for a relay's metrics.
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// CPU seconds (user + system) and peak resident set (VmHWM, bytes) of a
/// live process, from /proc.
pub fn cpu_and_peak_rss(pid: u32) -> Option<(f64, u64)> {
    let fields = stat_fields(&pid.to_string())?;
    let cpu = (fields.utime + fields.stime) / clock_ticks();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm_kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some((cpu, hwm_kb * 1024))
}

/// A process's resident set now (bytes).
pub fn current_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// CPU seconds of the stack's PostgreSQL (`OUTBOX_RELAY_STACK_DIR`): the
/// postmaster, its live children (walsenders, backends, background
/// workers) and its reaped ones (`cutime`, `cstime`), so the difference of
/// two readings counts processes that ended in between too.
pub fn postgres_cpu() -> Option<f64> {
    let (postmaster, children) = postgres_processes()?;
    let own = stat_fields(&postmaster)?;
    let live: f64 = children.iter().map(|(_, f)| f.utime + f.stime).sum();
    Some((own.utime + own.stime + own.cutime + own.cstime + live) / clock_ticks())
}

/// Walsender processes of the stack's PostgreSQL still alive.
pub fn postgres_walsenders() -> usize {
    let Some((_, children)) = postgres_processes() else { return 0 };
    children
        .iter()
        .filter(|(pid, _)| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.windows(9).any(|w| w == b"walsender"))
        })
        .count()
}

/// The numbers of `/proc/<pid>/stat` this harness reads.
struct Stat {
    ppid: String,
    utime: f64,
    stime: f64,
    cutime: f64,
    cstime: f64,
}

fn stat_fields(pid: &str) -> Option<Stat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name: ppid is field 4, utime 14 .. cstime 17 (1-based).
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let n = |i: usize| f.get(i)?.parse::<f64>().ok();
    Some(Stat { ppid: f.get(1)?.to_string(), utime: n(11)?, stime: n(12)?, cutime: n(13)?, cstime: n(14)? })
}

/// The postmaster of the stack in `OUTBOX_RELAY_STACK_DIR` and its live
/// children (zombies included, until reaped), each with its stat.
fn postgres_processes() -> Option<(String, Vec<(String, Stat)>)> {
    let dir = std::env::var("OUTBOX_RELAY_STACK_DIR").ok()?;
    let pid_file = std::fs::read_to_string(format!("{dir}/pg/postmaster.pid")).ok()?;
    let postmaster = pid_file.lines().next()?.trim().to_string();
    let children = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())).map(str::to_string))
        .filter_map(|pid| stat_fields(&pid).filter(|s| s.ppid == postmaster).map(|s| (pid, s)))
        .collect();
    Some((postmaster, children))
}

fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// Stops the stack in `OUTBOX_RELAY_STACK_DIR` when dropped, panics included:
/// the measurement and the benchmark run stacks of their own.
pub struct StackGuard {
    pub keep: bool,
}

impl StackGuard {
    /// Point the harness at a stack of this process's own: the directory in
    /// `override_var`, else `/tmp/outbox-relay-<name>-<pid>`. Call before the
    /// first [`stack`]; `keep` leaves it running afterwards.
    pub fn own(name: &str, override_var: &str, keep: bool) -> StackGuard {
        let dir = std::env::var(override_var).unwrap_or_else(|_| {
            format!("{}/outbox-relay-{name}-{}", std::env::temp_dir().display(), std::process::id())
        });
        std::env::set_var("OUTBOX_RELAY_STACK_DIR", dir);
        StackGuard { keep }
    }
}

impl Drop for StackGuard {
    fn drop(&mut self) {
        if !self.keep {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/dev-stack");
            let _ = Command::new("bash").arg(script).arg("down").stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}
