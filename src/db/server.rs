//! The server as start-up sees it: a supported major, the primary, and where
//! it runs (self-managed or a managed service), for the fixes it advises.

use tokio_postgres::Client;

use super::DbError;

/// Majors the relay supports: row-filtered publications (shards) and the
/// replication views it reads need 15; failover slots need 17.
pub const MIN_SERVER_VERSION: i32 = 150_000;
pub const FAILOVER_SERVER_VERSION: i32 = 170_000;

/// Whether a server of `version_num` (`server_version_num`) can run the relay
/// as configured; the refusal says why and what to do.
pub fn server_support(version_num: i32, shown: &str, failover: bool) -> Result<(), String> {
    if version_num < MIN_SERVER_VERSION {
        return Err(format!(
            "PostgreSQL {shown} is not supported: the relay needs PostgreSQL 15 or newer (15, 16, 17 and 18 are tested); upgrade the server"
        ));
    }
    if failover && version_num < FAILOVER_SERVER_VERSION {
        return Err(format!(
            "failover = true needs PostgreSQL 17 or newer (failover slots); this server is {shown}: set failover = false (a promoted standby then gets a new slot and the table catch-up)"
        ));
    }
    Ok(())
}

/// The server: a supported major, the primary (not a standby), and failover
/// slots only where they exist. Returns `server_version_num`.
pub async fn check_server(client: &Client, server: &str, failover: bool) -> Result<i32, DbError> {
    let r = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version'), pg_is_in_recovery()",
            &[],
        )
        .await?;
    let (num, shown, recovery): (i32, String, bool) = (r.get(0), r.get(1), r.get(2));
    server_support(num, &shown, failover).map_err(DbError::Check)?;
    if recovery {
        return Err(DbError::Check(format!(
            "{server} is a standby (in recovery): the relay writes to the outbox and streams from the primary; give the primary's address, or every server (postgres://USER@primary,standby/DB) and the primary is taken"
        )));
    }
    Ok(num)
}

/// Where PostgreSQL runs, as far as the fixes for CDC differ: managed
/// services forbid `ALTER ROLE … REPLICATION` and `ALTER SYSTEM`, and grant
/// replication through a role or a flag of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    SelfManaged,
    /// Amazon RDS and Aurora (`rds.logical_replication` is defined).
    Rds,
    /// Google Cloud SQL (`cloudsql.logical_decoding`).
    CloudSql,
    /// Azure Database for PostgreSQL flexible server (`azure.extensions`).
    Azure,
}

impl Platform {
    /// Told by the settings only these services define.
    pub async fn detect(client: &Client) -> Result<Platform, DbError> {
        let r = client
            .query_one(
                "SELECT current_setting('rds.logical_replication', true) IS NOT NULL,
                        current_setting('cloudsql.logical_decoding', true) IS NOT NULL,
                        current_setting('azure.extensions', true) IS NOT NULL",
                &[],
            )
            .await?;
        Ok(match (r.get(0), r.get(1), r.get(2)) {
            (true, _, _) => Platform::Rds,
            (_, true, _) => Platform::CloudSql,
            (_, _, true) => Platform::Azure,
            _ => Platform::SelfManaged,
        })
    }

    /// How to let `user` open a replication connection here.
    pub fn replication_fix(self, user: &str) -> String {
        match self {
            Platform::SelfManaged => format!("ALTER ROLE {user} REPLICATION"),
            Platform::Rds => format!(
                "GRANT rds_replication TO {user} (RDS and Aurora: the master user cannot be given REPLICATION; membership of rds_replication is what allows it)"
            ),
            Platform::CloudSql => {
                format!("ALTER ROLE {user} WITH REPLICATION, as a cloudsqlsuperuser (Cloud SQL; the cloudsql.logical_decoding flag must be on)")
            }
            Platform::Azure => format!("ALTER ROLE {user} REPLICATION, as a member of azure_pg_admin (Azure flexible server)"),
        }
    }

    /// How to make `wal_level` logical here.
    pub fn wal_level_fix(self) -> &'static str {
        match self {
            Platform::SelfManaged => "run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL",
            Platform::Rds => {
                "set rds.logical_replication = 1 in the instance's DB parameter group (Aurora: the DB cluster parameter group) and reboot"
            }
            Platform::CloudSql => "set the cloudsql.logical_decoding flag to on (the instance restarts)",
            Platform::Azure => "set the server parameter wal_level to logical and restart the server",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_majors_and_failover_slots() {
        assert!(server_support(140_012, "14.12", false).unwrap_err().contains("needs PostgreSQL 15 or newer"));
        assert!(server_support(150_008, "15.8", false).is_ok());
        assert!(server_support(160_004, "16.4", true).unwrap_err().contains("failover = true needs PostgreSQL 17"));
        assert!(server_support(170_010, "17.10", true).is_ok());
        assert!(server_support(180_004, "18.4", true).is_ok());
    }
}
