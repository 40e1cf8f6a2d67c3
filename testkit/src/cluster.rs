//! Servers of their own for the tests that need a whole cluster (failover,
//! slot invalidation): initdb, start with settings, stop, promote, each as
//! the `postgres` user, with the binaries of the major under test.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::*;

/// One server, in a directory of its own owned by `postgres`.
pub struct Node {
    pub bin: PathBuf,
    pub data: PathBuf,
    pub port: u16,
}

pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

pub fn as_pg(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn ok(c: &mut Command, what: &str) {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Node {
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    pub fn start(&self, settings: &[String]) {
        let mut opts = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} -c wal_level=logical \
             -c max_wal_senders=20 -c max_replication_slots=20 -c hot_standby_feedback=on -c fsync=off \
             -c wal_sender_timeout=0",
            self.port,
            self.data.parent().unwrap().display()
        );
        for s in settings {
            opts.push_str(&format!(" -c {s}"));
        }
        let log = self.data.with_extension("log");
        ok(
            as_pg(&self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "start", "-o", &opts]),
            "pg_ctl start",
        );
    }

    pub fn stop(&self, mode: &str) {
        ok(as_pg(&self.bin.join("pg_ctl")).arg("-D").arg(&self.data).args(["-m", mode, "-w", "stop"]), "pg_ctl stop");
    }

    pub fn promote(&self) {
        ok(as_pg(&self.bin.join("pg_ctl")).arg("-D").arg(&self.data).args(["-w", "promote"]), "pg_ctl promote");
    }
}

impl Node {
    /// A new cluster (initdb) in `dir/name`, not started.
    pub fn init(dir: &Path, name: &str) -> Node {
        let bin = PathBuf::from(&stack().pg_bin);
        let node = Node { bin: bin.clone(), data: dir.join(name), port: free_port() };
        ok(
            as_pg(&bin.join("initdb")).arg("-D").arg(&node.data).args(["-U", "postgres", "-A", "trust", "--no-sync"]),
            "initdb",
        );
        node
    }

    /// Stop it whatever its state (for drops).
    pub fn kill(&self) {
        let _ = as_pg(&self.bin.join("pg_ctl")).arg("-D").arg(&self.data).args(["-m", "immediate", "stop"]).output();
    }
}

/// Stops its server, whatever its state, when dropped (a panicking test
/// leaves no server behind).
pub struct StopOnDrop<'a>(pub &'a Node);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.kill();
    }
}

/// A directory under the temp dir owned by `postgres`, removed when dropped.
pub struct ClusterDir(pub PathBuf);

impl ClusterDir {
    pub fn new(name: &str) -> ClusterDir {
        let dir = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            ok(Command::new("chown").arg("postgres").arg(&dir), "chown");
        }
        ClusterDir(dir)
    }
}

impl Drop for ClusterDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
