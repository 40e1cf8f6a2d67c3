//! The table path's connections: a pool of at most `max_table_connections`,
//! shared by every table lane. A lane checks one out for a round (claim,
//! send, mark, commit) and gives it back, so a thousand destinations with
//! rows waiting take turns on a few connections instead of opening one
//! each; a lane waits its turn (first come, first served) while all are in
//! use. A connection that failed a round is dropped, not given back, and one
//! unused for a while is closed.

use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use tokio::sync::watch;
use tokio_postgres::Client;

use super::{Db, DbError};

/// Opens connections to the relay's database ([`Db::connect`]: its hosts,
/// TLS and deadlines) and takes back only those still open.
pub struct Connector(Db);

impl managed::Manager for Connector {
    type Type = Client;
    type Error = DbError;

    async fn create(&self) -> Result<Client, DbError> {
        self.0.connect().await
    }

    async fn recycle(&self, c: &mut Client, _: &Metrics) -> RecycleResult<DbError> {
        if c.is_closed() {
            return Err(RecycleError::message("the connection closed"));
        }
        Ok(())
    }
}

/// A connection checked out of the [`Pool`], given back when dropped.
pub type Pooled = managed::Object<Connector>;

#[derive(Clone)]
pub struct Pool(managed::Pool<Connector>);

/// A connection unused for this long is closed.
const IDLE_CLOSE: Duration = Duration::from_secs(30);

impl Pool {
    pub fn new(db: Db, max: usize) -> Pool {
        let pool = managed::Pool::builder(Connector(db)).max_size(max).build().expect("no runtime-bound timeouts set");
        Pool(pool)
    }

    /// A connection, once one is free (or `None`, logged, when a new one
    /// cannot be made; `None` too if `stop` turns true meanwhile).
    pub async fn checkout(&self, stop: &mut watch::Receiver<bool>) -> Option<Pooled> {
        let got = tokio::select! {
            got = self.0.get() => got,
            _ = stop.wait_for(|s| *s) => return None,
        };
        match got {
            Ok(c) => Some(c),
            Err(managed::PoolError::Backend(e)) => {
                tracing::warn!(error = %e, "table path cannot connect; retrying");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "table path: no connection from the pool; retrying");
                None
            }
        }
    }

    /// Drop `c` instead of giving it back (its round failed).
    pub fn discard(c: Pooled) {
        drop(managed::Object::take(c));
    }

    /// Close the connections unused for a while.
    pub fn close_idle(&self) {
        self.0.retain(|_, m| m.last_used() < IDLE_CLOSE);
    }

    /// Connections open now (in use or idle).
    pub fn open(&self) -> usize {
        self.0.status().size
    }
}
