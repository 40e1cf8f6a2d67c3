//! Production connections: TLS (verify-full, verify-ca, require) and SCRAM
//! to PostgreSQL on both the SQL and the replication connections, a
//! least-privilege role, clear failures, and no password in any output.
//! The harness's PostgreSQL has ssl=on with a throwaway CA; members of
//! `scram_users` may only connect over TLS with a SCRAM password.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{Config, FileConfig, Overrides};
use outbox_relay::db;
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::*;

const Q: &str = "http://memory.invalid/orders";

fn port() -> u16 {
    stack().pg_url.rsplit_once(':').unwrap().1.split('/').next().unwrap().parse().unwrap()
}

fn ca() -> String {
    format!("{}/ca.crt", stack().tls_dir)
}

/// A login role with exactly the grants the README documents for `run`.
async fn least_privilege_role(db: &TestDb, password: &str) -> String {
    let role = format!("relay_{}", db.name);
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{password}' IN ROLE scram_users;
             GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {role};
             GRANT SELECT, INSERT, DELETE ON outbox_published_runs TO {role};
             GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {role};"
        ))
        .await
        .unwrap();
    role
}

fn url(host: &str, role: &str, password: &str, db: &TestDb, params: &str) -> String {
    format!("postgres://{role}:{password}@{host}:{}/{}?{params}", port(), db.name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_scram_and_least_privilege_runs_the_relay_end_to_end() {
    let db = TestDb::new("tlsfull").await;
    let pw = "s3cret-Pa55";
    let role = least_privilege_role(&db, pw).await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.database_url = url("localhost", &role, pw, &db, &format!("sslmode=verify-full&sslrootcert={}", ca()));
    cfg.heartbeat_interval = Duration::from_millis(200);
    let c = db.client().await;
    insert_rows(&c, "before", "orders", 50, None).await;
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created over TLS", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    insert_rows(&c, "after", "orders", 150, None).await;
    wait_for("every row published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    assert_eq!(p.sent(Q).len(), 200);
    // The heartbeat (pg_logical_emit_message) works under this role: one
    // was written and read back from the slot.
    wait_for("a heartbeat read back", Duration::from_secs(10), || async {
        relay.metrics.render().lines().any(|l| {
            l.strip_prefix("outbox_relay_heartbeat_rtt_seconds ")
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
        })
    })
    .await;
    // Both of the relay's kinds of connection are TLS with this role.
    let ssl: Vec<(bool, String)> = c
        .query(
            "SELECT s.ssl, a.backend_type FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.usename = $1",
            &[&role],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(ssl.iter().any(|(_, t)| t == "walsender"), "{ssl:?}");
    assert!(ssl.iter().all(|(on, _)| *on), "{ssl:?}");
    relay.stop().await;
    c.batch_execute(&format!("DROP OWNED BY {role}")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_checks_fail_with_the_check_that_failed() {
    let db = TestDb::new("tlscheck").await;
    let pw = "another-Secret1";
    let role = least_privilege_role(&db, pw).await;
    // The certificate names localhost, not 127.0.0.1.
    let e = db::connect(&url("127.0.0.1", &role, pw, &db, &format!("sslmode=verify-full&sslrootcert={}", ca())))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not name host \"127.0.0.1\""), "{e}");
    assert!(!e.contains(pw), "{e}");
    // verify-ca checks the chain only.
    let c = db::connect(&url("127.0.0.1", &role, pw, &db, &format!("sslmode=verify-ca&sslrootcert={}", ca())))
        .await
        .unwrap();
    let on: bool = c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get(0);
    assert!(on);
    // A CA that did not sign the server's certificate.
    let other = format!("{}/other-ca.crt", stack().tls_dir);
    let e = db::connect(&url("localhost", &role, pw, &db, &format!("sslmode=verify-full&sslrootcert={other}")))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("not signed by a CA in"), "{e}");
    // A CA file that is not there or not PEM.
    let e = db::connect(&url("localhost", &role, pw, &db, "sslmode=verify-full&sslrootcert=/nonexistent/ca.crt"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/ca.crt"), "{e}");
    // sslmode=disable for a scram_users member: the server's pg_hba refuses.
    let e = db::connect(&url("localhost", &role, pw, &db, "sslmode=disable")).await.unwrap_err().to_string();
    assert!(e.contains("pg_hba.conf") || e.contains("rejects"), "{e}");
    // require: encrypted without checking the certificate.
    db::connect(&url("127.0.0.1", &role, pw, &db, "sslmode=require")).await.unwrap();
    db.client().await.batch_execute(&format!("DROP OWNED BY {role}")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_and_missing_passwords_fail_cleanly_and_passwords_come_from_files() {
    let db = TestDb::new("tlspw").await;
    let pw = "right-Horse-9";
    let role = least_privilege_role(&db, pw).await;
    let params = format!("sslmode=verify-full&sslrootcert={}", ca());
    let e = db::connect(&url("localhost", &role, "wrong", &db, &params)).await.unwrap_err().to_string();
    assert!(e.contains("wrong password for user"), "{e}");
    // No password anywhere.
    let e = db::connect(&format!("postgres://{role}@localhost:{}/{}?{params}&passfile=/nonexistent", port(), db.name))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("asks user") || e.contains("password"), "{e}");
    // A mounted secret (password_file) and a .pgpass file.
    let dir = std::env::temp_dir().join(format!("pw-{}", db.name));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), format!("{pw}\n")).unwrap();
    std::fs::write(dir.join("pgpass"), format!("# comment\nother:*:*:*:nope\nlocalhost:{}:*:{role}:{pw}\n", port()))
        .unwrap();
    let base = format!("postgres://{role}@localhost:{}/{}?{params}", port(), db.name);
    db::connect(&format!("{base}&password_file={}", dir.join("secret").display())).await.unwrap();
    db::connect(&format!("{base}&passfile={}", dir.join("pgpass").display())).await.unwrap();
    std::fs::remove_dir_all(&dir).ok();
    db.client().await.batch_execute(&format!("DROP OWNED BY {role}")).await.unwrap();
}

/// A server that answers the SSL request with "N" (no TLS), or hangs up.
async fn fake_server(answer: Option<u8>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            let mut buf = [0u8; 8];
            let _ = s.read_exact(&mut buf).await;
            if let Some(a) = answer {
                let _ = s.write_all(&[a]).await;
                let mut rest = [0u8; 64];
                let _ = s.read(&mut rest).await;
            }
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_server_without_tls_and_a_hang_up_fail_cleanly() {
    let no_tls = fake_server(Some(b'N')).await;
    let e = db::connect(&format!("postgres://u:topsecret@127.0.0.1:{no_tls}/d?sslmode=require"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not offer TLS"), "{e}");
    assert!(!e.contains("topsecret"), "{e}");
    let hang_up = fake_server(None).await;
    let e =
        db::connect(&format!("postgres://u:topsecret@127.0.0.1:{hang_up}/d?sslmode=verify-full&sslrootcert={}", ca()))
            .await
            .unwrap_err()
            .to_string();
    assert!(e.starts_with("cannot connect to PostgreSQL"), "{e}");
    assert!(!e.contains("topsecret"), "{e}");
    // The replication connection too.
    let url = format!("postgres://u:topsecret@127.0.0.1:{no_tls}/d?sslmode=require");
    let file = FileConfig::of(&[("database_url", &url)], &[("orders", Q)]).unwrap();
    let cfg = Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap();
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    let err = start_up_error(cfg, Arc::new(p)).await;
    assert!(err.contains("does not offer TLS") && !err.contains("topsecret"), "{err}");
    // Malformed settings are config errors, not panics.
    for bad in ["postgres://u@h/d?sslmode=sometimes", "postgres://u@h/d?sslcert=/x.crt", "not a url at all"] {
        let file = FileConfig::of(&[("database_url", bad)], &[("orders", Q)]).unwrap();
        let e = Config::resolve(file, &BTreeMap::new(), &Overrides::default()).unwrap_err().to_string();
        assert!(!e.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_never_appears_in_logs_status_or_errors() {
    let db = TestDb::new("tlsleak").await;
    let pw = "Leak-Canary-7731";
    let role = least_privilege_role(&db, pw).await;
    let good = url("localhost", &role, pw, &db, &format!("sslmode=verify-full&sslrootcert={}", ca()));
    let sqs_url = stack().sqs_url.clone();
    let sqs = sqs().await;
    let q = create_queue(&sqs, "leak", false, None).await;
    let run = |args: &[&str], url: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args(args)
            .env("OUTBOX_RELAY_DATABASE_URL", url)
            .env("OUTBOX_RELAY_SLOT", &db.slot)
            .env("OUTBOX_RELAY_SQS_ENDPOINT_URL", &sqs_url)
            .env("OUTBOX_RELAY_DESTINATIONS_ORDERS", &q)
            .env("OUTBOX_RELAY_METRICS_ADDR", "off")
            .env("RUST_LOG", "debug")
            .output()
            .unwrap()
    };
    let mut seen = String::new();
    for (args, u) in [
        (vec!["status", "--json"], good.clone()),
        (vec!["status"], good.clone()),
        (vec!["status"], url("localhost", &role, pw, &db, "sslmode=verify-full&sslrootcert=/nope")),
        (vec!["dead", "list"], good.clone()),
        (vec!["slot", "status"], good.clone()),
    ] {
        let out = run(&args, &u);
        seen += &String::from_utf8_lossy(&out.stdout);
        seen += &String::from_utf8_lossy(&out.stderr);
    }
    // The relay itself, streaming for a moment with debug logs, then SIGTERM.
    // Its output is drained as it comes (a full pipe would stall it).
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--log-format", "json"])
        .env("OUTBOX_RELAY_DATABASE_URL", &good)
        .env("OUTBOX_RELAY_SLOT", &db.slot)
        .env("OUTBOX_RELAY_SQS_ENDPOINT_URL", &sqs_url)
        .env("OUTBOX_RELAY_DESTINATIONS_ORDERS", &q)
        .env("OUTBOX_RELAY_METRICS_ADDR", "off")
        .env("RUST_LOG", "debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut r, &mut s);
            s
        })
    };
    let out_reader = drain(Box::new(child.stdout.take().unwrap()));
    let err_reader = drain(Box::new(child.stderr.take().unwrap()));
    let c = db.client().await;
    let streamed = tokio::time::timeout(Duration::from_secs(30), async {
        while db.confirmed_flush_lsn().await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        insert_rows(&c, "x", "orders", 20, None).await;
        while db.count("status = 'NEW'").await > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = child.wait().unwrap();
    let (stdout, stderr) = (out_reader.join().unwrap(), err_reader.join().unwrap());
    if streamed.is_err() {
        let tail: Vec<&str> = stderr.lines().filter(|l| !l.contains("\"DEBUG\"")).rev().take(40).collect();
        panic!(
            "relay did not publish within 30 s; its last log lines:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let out = std::process::Output { status, stdout: stdout.into_bytes(), stderr: stderr.into_bytes() };
    assert!(out.status.success(), "{:?}", out.status);
    seen += &String::from_utf8_lossy(&out.stdout);
    seen += &String::from_utf8_lossy(&out.stderr);
    assert!(
        seen.contains("streaming") && seen.contains("cannot connect"),
        "the output was captured: {}",
        &seen[..seen.len().min(2000)]
    );
    assert!(!seen.contains(pw), "the password leaked: {}", seen.lines().find(|l| l.contains(pw)).unwrap_or_default());
    c.batch_execute(&format!("DROP OWNED BY {role}")).await.unwrap();
}
