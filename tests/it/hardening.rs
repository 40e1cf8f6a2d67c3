//! What a hostile but fair user found (issue 18), each as a test that failed
//! before its fix: a server that never answers, secrets in connection
//! strings, shutdown during a queue outage, memory with large bodies, bad
//! durations, a panicking task, `status` before `migrate`.

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::CallError;
use testkit::process::{relay_bin, RelayProcess};
use testkit::*;

const Q: &str = "http://memory.invalid/orders";
const SECRET: &str = "Hunter2Secret";

/// A server that takes TCP connections and never says a word; counts them.
struct SilentServer {
    port: u16,
    accepted: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl SilentServer {
    fn start() -> SilentServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let held = Arc::clone(&accepted);
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                held.lock().unwrap().push(s);
            }
        });
        SilentServer { port, accepted }
    }

    fn connections(&self) -> usize {
        self.accepted.lock().unwrap().len()
    }
}

/// A config file in a directory of its own (removed on drop).
struct ConfigFile {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl ConfigFile {
    fn new(text: &str) -> ConfigFile {
        let dir = std::env::temp_dir().join(unique("hardening"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(&path, text).unwrap();
        ConfigFile { dir, path }
    }

    fn arg(&self) -> &str {
        self.path.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

fn config_text(database_url: &str, extra: &str) -> String {
    format!(
        "database_url = \"{database_url}\"\nmetrics_addr = \"off\"\n{extra}\n[sqs]\nendpoint_url = \"http://127.0.0.1:1\"\n[destinations]\norders = \"{Q}\"\n"
    )
}

/// Run the binary to its end (killed after `deadline`); its output and how long it took.
fn run_bin(args: &[&str], env: &[(&str, &str)], deadline: Duration) -> (Output, Duration) {
    let mut cmd = Command::new(relay_bin());
    cmd.args(args).env("RUST_LOG", "debug").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out, started.elapsed())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn a_server_that_never_answers_fails_start_up_naming_it() {
    let server = SilentServer::start();
    let url = format!("postgres://app@127.0.0.1:{}/app", server.port);
    let cfg = ConfigFile::new(&config_text(&url, "connect_timeout = \"1s\""));
    let (out, took) = run_bin(&["run", "--config", cfg.arg()], &[], Duration::from_secs(20));
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let expected = format!("PostgreSQL at 127.0.0.1:{} did not answer within 1s while connecting", server.port);
    assert!(all.contains(&expected) && all.contains("connect_timeout"), "{all}");

    // status and slot status give up the same way.
    for args in [&["status", "--config", cfg.arg()][..], &["slot", "status", "--config", cfg.arg()][..]] {
        let (out, took) = run_bin(args, &[], Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        assert!(took < Duration::from_secs(8), "{args:?} took {took:?}");
        assert!(text(&out).contains(&expected), "{args:?}: {}", text(&out));
    }
}

#[tokio::test]
async fn sigterm_during_a_hung_start_up_stops_at_once() {
    let server = SilentServer::start();
    let url = format!("postgres://app@127.0.0.1:{}/app", server.port);
    let cfg = ConfigFile::new(&config_text(&url, "connect_timeout = \"10m\""));
    let relay = RelayProcess::spawn(&cfg.path, &[]);
    wait_for("the relay connects to the silent server", Duration::from_secs(20), || async {
        server.connections() >= 1
    })
    .await;
    let asked = Instant::now();
    let status = relay.terminate(Duration::from_secs(10)).await.expect("run ends after SIGTERM, not killed");
    assert!(status.success(), "{status:?}");
    assert!(asked.elapsed() < Duration::from_secs(3), "took {:?} after SIGTERM", asked.elapsed());

    // `migrate` too (its own default deadline is 10 s: SIGTERM comes first).
    let mut migrate = Command::new(relay_bin())
        .args(["migrate", "--database-url", &url])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let before = server.connections();
    wait_for("migrate connects", Duration::from_secs(20), || async { server.connections() > before }).await;
    let asked = Instant::now();
    Command::new("kill").args(["-TERM", &migrate.id().to_string()]).status().unwrap();
    let mut code = None;
    while asked.elapsed() < Duration::from_secs(5) && code.is_none() {
        code = migrate.try_wait().unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = migrate.kill();
    let _ = migrate.wait();
    assert_eq!(code.and_then(|c| c.code()), Some(130), "migrate stops on SIGTERM");
}

#[test]
fn zero_durations_are_refused_at_start_up() {
    for (line, key) in
        [("heartbeat_interval = \"0s\"", "heartbeat_interval"), ("poll_interval = \"0s\"", "poll_interval")]
    {
        let cfg = ConfigFile::new(&config_text("postgres://app@127.0.0.1:1/app", line));
        let (out, _) = run_bin(&["run", "--config", cfg.arg()], &[], Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2));
        let all = text(&out);
        assert!(all.contains(&format!("{key} = \"0s\" is out of range: it must be from")), "{all}");
    }
    let cfg = ConfigFile::new("slot = \"x\"\nlinger = 5ms\n");
    let (out, _) = run_bin(&["run", "--config", cfg.arg()], &[], Duration::from_secs(20));
    assert!(text(&out).contains("line 2, column"), "{}", text(&out));
}

/// `run --check` reads the configuration and says what it sets (never the
/// database URL) with the memory bound, connecting to nothing; a bad one is
/// refused as `run` refuses it.
#[test]
fn run_check_says_what_the_configuration_sets_and_connects_to_nothing() {
    let url = format!("postgres://app@127.0.0.1:1/app?password={SECRET}");
    let cfg = ConfigFile::new(&config_text(&url, "max_unsettled_bytes = \"100MB\""));
    let (out, _) = run_bin(&["run", "--check", "--config", cfg.arg()], &[], Duration::from_secs(20));
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("configuration accepted") && all.contains("mode: "), "{all}");
    // 100 MB (MiB, as every size here) + 2 x 1 MiB (no S3) + 64 MiB.
    assert!(all.contains("memory bound: 166 MiB"), "{all}");
    assert!(!all.contains(SECRET) && !all.contains("127.0.0.1:1"), "{all}");
    let cfg = ConfigFile::new(&config_text(&url, "max_in_flight_batches = 0"));
    let (out, _) = run_bin(&["run", "--check", "--config", cfg.arg()], &[], Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("max_in_flight_batches = 0 is out of range"), "{}", text(&out));
}

#[test]
fn secrets_never_show_in_logs_or_errors() {
    // A password as a URL parameter, against a server that never answers:
    // the start-up log line and the connection error.
    let server = SilentServer::start();
    let url = format!("postgres://app@127.0.0.1:{}/app?password={SECRET}", server.port);
    let cfg = ConfigFile::new(&config_text(&url, "connect_timeout = \"500ms\""));
    for args in [
        &["run", "--config", cfg.arg()][..],
        &["status", "--config", cfg.arg()][..],
        &["migrate", "--database-url", &url][..],
    ] {
        let (out, _) = run_bin(args, &[], Duration::from_secs(20));
        let all = text(&out);
        assert!(!all.contains(SECRET), "{args:?} shows the secret: {all}");
        assert!(all.contains("did not answer"), "{args:?}: {all}");
        if args[0] == "run" {
            assert!(all.contains("password=***"), "{args:?}: {all}");
        }
    }
    // sslpassword is refused, hidden.
    let cfg = ConfigFile::new(&config_text(&format!("{url}&sslpassword={SECRET}"), ""));
    let (out, _) = run_bin(&["run", "--config", cfg.arg()], &[], Duration::from_secs(20));
    let all = text(&out);
    assert!(all.contains("sslpassword=***") && all.contains("is not supported") && !all.contains(SECRET), "{all}");
    // A key=value connection string is refused, without echoing its password.
    let kv = format!("host=127.0.0.1 port={} user=app password={SECRET} dbname=app", server.port);
    let cfg = ConfigFile::new(&config_text(&kv, ""));
    let (out, _) = run_bin(&["run", "--config", cfg.arg()], &[], Duration::from_secs(20));
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(all.contains("key=value connection strings are not supported") && !all.contains(SECRET), "{all}");
}

/// Against the real server: every log line of a run (debug level), and
/// `status`, with the password given in the URL and in the environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_show_in_a_real_run_or_status() {
    let db = TestDb::new("secret").await;
    let url = format!("{}?password={SECRET}", db.url);
    let queue = create_queue(&sqs().await, "secret", false, None).await;
    let cfg = ConfigFile::new(&format!(
        "database_url = \"{url}\"\nslot = \"{}\"\nmetrics_addr = \"off\"\nheartbeat_interval = \"200ms\"\n[sqs]\nendpoint_url = \"{}\"\n[destinations]\norders = \"{queue}\"\n",
        db.slot,
        stack().sqs_url
    ));
    let mut child = Command::new(relay_bin())
        .args(["run", "--config", cfg.arg()])
        .env("RUST_LOG", "debug")
        .env("PGPASSWORD", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    insert_rows(&db.client().await, "s", "orders", 5, None).await;
    wait_for("rows published", Duration::from_secs(30), || async { db.count("true").await == 0 }).await;
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let end = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let logs = text(&out);
    assert!(logs.contains("starting") && logs.contains("password=***"), "{logs}");
    assert!(!logs.contains(SECRET), "the run's logs show the secret");
    for args in [
        &["status", "--config", cfg.arg()][..],
        &["status", "--json", "--config", cfg.arg()][..],
        &["dead", "list", "--config", cfg.arg()][..],
    ] {
        let (out, _) = run_bin(args, &[("PGPASSWORD", SECRET)], Duration::from_secs(30));
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert!(!text(&out).contains(SECRET), "{args:?} shows the secret");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_before_migrate_says_to_migrate() {
    let s = stack();
    let name = unique("t_unmigrated");
    db_admin(&format!("CREATE DATABASE {name}")).await;
    let url = format!("{}/{name}", s.pg_url.rsplit_once('/').unwrap().0);
    let cfg = ConfigFile::new(&config_text(&url, ""));
    let (out, _) = run_bin(&["status", "--config", cfg.arg()], &[], Duration::from_secs(30));
    let all = text(&out);
    db_admin(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(all.contains("run `outbox-relay migrate"), "{all}");
    assert!(!all.contains("db error: db error"), "{all}");
}

async fn db_admin(sql: &str) {
    outbox_relay::db::connect(&stack().pg_url).await.unwrap().batch_execute(sql).await.unwrap();
}

fn in_flight(m: &outbox_relay::metrics::Metrics) -> i64 {
    m.in_flight_events.with_label_values(&["orders"]).get()
}

/// SIGTERM while the queue is down and the pipeline is full (the stream
/// blocked handing an event on): the relay stops within seconds, and every
/// row is published by the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_queue_outage_is_prompt_and_loses_nothing() {
    let db = TestDb::new("outage_stop").await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    p.break_queue(Q, CallError::transport("connection refused"));
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.max_unsettled_events = 50;
    cfg.lane_stall_timeout = Duration::from_secs(3_600);
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    insert_rows(&db.client().await, "o", "orders", 200, None).await;
    wait_for("the budget is full", Duration::from_secs(30), || async {
        in_flight(&relay.metrics) >= 50 && p.calls() > 2
    })
    .await;
    let asked = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), relay.stop()).await.expect("the relay stops");
    let took = asked.elapsed();
    eprintln!("shutdown with the queue down and the budget full: {took:?}");
    assert!(took < Duration::from_secs(4), "stopping took {took:?}");

    p.fix_queue(Q);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("every row published", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    relay.stop().await;
    let mut ids: Vec<i64> = p.sent(Q).iter().map(|s| s.outbox_id.unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 200);
}

/// Large bodies: what is read from the slot and not settled is bounded in
/// bytes, not only in events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsettled_events_are_bounded_in_bytes() {
    let db = TestDb::new("bytes").await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 1 << 20);
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.max_unsettled_bytes = 2 << 20;
    cfg.lane_stall_timeout = Duration::from_secs(3_600);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    p.close_gate();
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox (event_id, destination, body) SELECT 'big:' || i, 'orders', repeat('x', 262144) FROM generate_series(1, 40) i",
        &[],
    )
    .await
    .unwrap();
    // 2 MiB hold 7 bodies of 256 KiB (each also counts its small overhead).
    wait_for("the byte budget is full", Duration::from_secs(30), || async { in_flight(&relay.metrics) >= 7 }).await;
    for _ in 0..10 {
        assert!(
            in_flight(&relay.metrics) <= 8,
            "{} unsettled events of 256 KiB with a 2 MiB budget",
            in_flight(&relay.metrics)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    p.open_gate();
    wait_for("every row published", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    relay.stop().await;
}

/// A panic in a background task (here the slot monitor, through a fail
/// point) stops the process instead of leaving it running without it.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_task_stops_the_process() {
    let db = TestDb::new("panic").await;
    let queue = create_queue(&sqs().await, "panic", false, None).await;
    let cfg = testkit::process::RelayConfig::new(&db, "cdc", &[("orders", &queue)], "");
    let mut relay = cfg.spawn_with(&[("FAILPOINTS", "monitor::tick=panic")]);
    let status = relay.wait_exit(Duration::from_secs(30)).await;
    let _ = relay.child.kill();
    assert_eq!(status.and_then(|s| s.code()), Some(70), "{status:?}");
}
