//! The schema of the relay and the consumer library, in one place: every
//! migration in order (the SQL files beside this crate), and the runner
//! both `outbox-relay migrate` and `outbox_consumer::migrate` use. Each
//! migration runs once, recorded in `outbox_relay_migrations`.

use tokio_postgres::Client;

/// Which part of the schema a migration belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The outbox table, its publication and the relay's own records.
    Relay,
    /// The jobs table and the consumer's protocol functions.
    Jobs,
}

/// One migration: its version (the order), a name, its SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub part: Part,
    pub sql: &'static str,
}

const fn m(version: i32, name: &'static str, part: Part, sql: &'static str) -> Migration {
    Migration { version, name, part, sql }
}

/// Every migration, in order.
pub const ALL: &[Migration] = &[
    m(1, "outbox", Part::Relay, include_str!("../0001_outbox.sql")),
    m(2, "publication", Part::Relay, include_str!("../0002_publication.sql")),
    m(3, "spool", Part::Relay, include_str!("../0003_spool.sql")),
    m(4, "jobs", Part::Jobs, include_str!("../0004_jobs.sql")),
    m(5, "published", Part::Relay, include_str!("../0005_published.sql")),
    m(6, "job protocol", Part::Jobs, include_str!("../0006_job_protocol.sql")),
    m(7, "runs survive id reuse", Part::Relay, include_str!("../0007_runs_reuse.sql")),
    m(8, "publish updates", Part::Relay, include_str!("../0008_publish_updates.sql")),
    m(9, "durable slot hand-off", Part::Relay, include_str!("../0009_handoffs.sql")),
    m(10, "runs list the table path's event ids", Part::Relay, include_str!("../0010_runs_event_ids.sql")),
    m(11, "delayed delivery", Part::Relay, include_str!("../0011_deliver_at.sql")),
    m(12, "job trace context", Part::Jobs, include_str!("../0012_job_trace.sql")),
    m(13, "FIFO rows in the table keep their commit order", Part::Relay, include_str!("../0013_commit_order.sql")),
    m(14, "mapped tables known by their oid", Part::Relay, include_str!("../0014_sources.sql")),
    m(15, "replays", Part::Relay, include_str!("../0015_replays.sql")),
    m(16, "replays from the archive", Part::Relay, include_str!("../0016_replay_archive.sql")),
];

/// The migrations of one part, in order.
pub fn of(part: Part) -> impl Iterator<Item = &'static Migration> {
    ALL.iter().filter(move |m| m.part == part)
}

/// Apply those of `migrations` not recorded yet in `outbox_relay_migrations`,
/// in order, in one transaction under an advisory lock so concurrent deploys
/// do not race. Returns the versions applied now.
pub async fn apply<'a>(
    client: &mut Client,
    migrations: impl IntoIterator<Item = &'a Migration>,
) -> Result<Vec<i32>, tokio_postgres::Error> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
                 version int PRIMARY KEY,
                 name text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock(hashtext('outbox_relay_migrations'))", &[]).await?;
    let mut applied = Vec::new();
    for m in migrations {
        let done =
            tx.query_opt("SELECT 1 FROM outbox_relay_migrations WHERE version = $1", &[&m.version]).await?.is_some();
        if done {
            continue;
        }
        tx.batch_execute(m.sql).await?;
        tx.execute("INSERT INTO outbox_relay_migrations (version, name) VALUES ($1, $2)", &[&m.version, &m.name])
            .await?;
        applied.push(m.version);
    }
    tx.commit().await?;
    Ok(applied)
}

/// Those of [`ALL`] not recorded yet (none written: `migrate --dry-run`).
pub async fn pending(client: &Client) -> Result<Vec<&'static Migration>, tokio_postgres::Error> {
    let recorded = client.query_one("SELECT to_regclass('outbox_relay_migrations') IS NOT NULL", &[]).await?.get(0);
    let applied: Vec<i32> = if recorded {
        client.query("SELECT version FROM outbox_relay_migrations", &[]).await?.iter().map(|r| r.get(0)).collect()
    } else {
        Vec::new()
    };
    Ok(ALL.iter().filter(|m| !applied.contains(&m.version)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_run_one_to_n_in_order() {
        for (i, m) in ALL.iter().enumerate() {
            assert_eq!(m.version, i as i32 + 1, "{}", m.name);
        }
    }

    /// Each SQL file of this directory is a migration, and each migration's
    /// file name starts with its version.
    #[test]
    fn every_sql_file_is_listed() {
        let dir = env!("CARGO_MANIFEST_DIR");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|f| f.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(files.len(), ALL.len());
        for (f, m) in files.iter().zip(ALL) {
            assert!(f.starts_with(&format!("{:04}_", m.version)), "{f} is not migration {}", m.version);
        }
    }

    /// An applied migration's SQL never changes (a server that applied it
    /// would not have what a new one gets): each is held to the FNV-1a hash
    /// it had when it was written. A new migration adds its line here.
    #[test]
    fn applied_migrations_never_change() {
        fn fnv1a(s: &str) -> u64 {
            s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
        }
        let frozen: &[(i32, u64)] = &[
            (1, 0x334eb6d36c59b697),
            (2, 0x44449cf183e46a83),
            (3, 0xaf90dabde6ee8ea2),
            (4, 0x8117e759074b4440),
            (5, 0x196c86f216360c19),
            (6, 0xda2acb27d0015c8a),
            (7, 0x5c6abaedee8bec72),
            (8, 0x6acdca99a880c127),
            (9, 0x9d7c1cfba90a14e8),
            (10, 0x38d01030995f7bb9),
            (11, 0x69c5f980b0c48f0e),
            (12, 0x925d51b5bd2b6144),
            (13, 0x64ef79bc3dbb5490),
            (14, 0xe2a8dac5ec1f6917),
            (15, 0x6bea7faba83aa09b),
            (16, 0x45f97a92c8bda762),
        ];
        let now: Vec<(i32, u64)> = ALL.iter().map(|m| (m.version, fnv1a(m.sql))).collect();
        assert_eq!(now, frozen, "a migration's SQL changed: write a new migration instead");
    }
}
