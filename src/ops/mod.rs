//! What operators run beside the relay: `status`, `slot status|create|drop`,
//! `dead list|redrive`, `replay`. Each reads or changes the database directly; none
//! needs the relay to be running.

use crate::db;
use crate::source::cdc::CdcError;

mod dead;
pub mod replay;
mod slot;
mod status;

pub use dead::{dead_list, dead_redrive, format_dead, DeadFilter, DeadRow};
pub use slot::{slot_create, slot_drop, SlotCreated};
pub use status::{
    format_slot, format_status, slot_status, status, DestinationStatus, RelayReached, SlotStatus, Status, TableStatus,
    STATUS_FORMAT,
};

impl From<tokio_postgres::Error> for OpsError {
    fn from(e: tokio_postgres::Error) -> Self {
        OpsError::Pg(e)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("database: {}", db::describe(.0))]
    Pg(tokio_postgres::Error),
    #[error(transparent)]
    Cdc(#[from] CdcError),
    #[error("{0}")]
    Refused(String),
}
