//! `slot create` (with the catch-up of older rows) and `slot drop`.

use super::status::slot_status;
use super::OpsError;
use crate::config::Config;
use crate::db::{self, Db};
use crate::pipeline::budget::Memory;
use crate::pipeline::settings::SlotSettings;
use crate::source::cdc::{
    connect_replication, create_slot_exporting, hand_off_begins, hand_off_done, hand_to_table, import_snapshot,
};

/// What `slot create` did.
#[derive(Debug, serde::Serialize)]
pub struct SlotCreated {
    pub slot: String,
    pub consistent_point: String,
    /// NEW rows committed before the slot existed, handed to the table path
    /// (the slot will never stream them).
    pub handed_to_table: u64,
}

/// Create the slot with an exported snapshot. The NEW rows that snapshot sees
/// are exactly the rows the slot will never stream: they get a
/// `next_attempt_at`, so the relay's table path publishes them.
pub async fn slot_create(config: &Config) -> Result<SlotCreated, OpsError> {
    let db = Db::of(config);
    let sql = db.connect().await?;
    db::server::check_server(&sql, &db.server(), config.failover).await?;
    let destinations: Vec<String> = config.destinations.keys().cloned().collect();
    let exists =
        sql.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&config.publication]).await?.is_some();
    if !exists {
        // A relay's own shard: a publication filtered to its destinations.
        crate::source::cdc::publication::check_shard(&sql, &config.publication, &destinations).await?;
        let list: Vec<String> = destinations.iter().map(|d| format!("'{}'", d.replace('\'', "''"))).collect();
        sql.batch_execute(&format!(
            "CREATE PUBLICATION \"{}\" FOR TABLE outbox WHERE (destination IN ({})) WITH (publish = 'insert')",
            config.publication.replace('"', ""),
            list.join(", ")
        ))
        .await?;
    }
    crate::source::cdc::publication::check_cdc_prerequisites(&sql, &config.publication).await?;
    let sharded = crate::source::cdc::publication::check_shard(&sql, &config.publication, &destinations).await?;
    if slot_status(&sql, &config.slot).await?.exists {
        return Err(OpsError::Refused(format!("slot {:?} already exists", config.slot)));
    }
    let mut repl = connect_replication(&db, &SlotSettings::of(config), Memory::of(config)).await?;
    let created = async {
        hand_off_begins(&sql, &config.slot).await?;
        let (consistent, snapshot) = create_slot_exporting(&mut repl, &config.slot, config.failover).await?;
        let snap = db.connect().await?;
        import_snapshot(&snap, &snapshot).await?;
        let handed = hand_to_table(snap, sharded.then(|| destinations.clone()), consistent).await?;
        hand_off_done(&sql, &config.slot).await?;
        Ok::<_, OpsError>((consistent, handed))
    }
    .await;
    repl.abort();
    let (consistent, handed) = created?;
    Ok(SlotCreated { slot: config.slot.clone(), consistent_point: consistent.to_string(), handed_to_table: handed })
}

/// Drop the slot; refused while a relay reads it.
pub async fn slot_drop(config: &Config) -> Result<(), OpsError> {
    let db = Db::of(config);
    let sql = db.connect().await?;
    let s = slot_status(&sql, &config.slot).await?;
    if !s.exists {
        return Err(OpsError::Refused(format!("slot {:?} does not exist", config.slot)));
    }
    if s.active == Some(true) {
        return Err(OpsError::Refused(format!(
            "slot {:?} is in use by pid {}: stop the relay reading it first",
            config.slot,
            s.active_pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
        )));
    }
    sql.execute("SELECT pg_drop_replication_slot($1)", &[&config.slot]).await?;
    Ok(())
}
