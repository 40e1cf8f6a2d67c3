//! What every pipeline is made of and sends through: built once at
//! start-up, shared by both sources (the stream's sessions and every table
//! lane).

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::publish::Publisher;

use super::archive::Archive;
use super::budget::Budget;
use super::destinations::Destinations;
use super::settings::Settings;

pub struct Parts {
    pub settings: Settings,
    /// The budget of unsettled events (`max_unsettled_events`,
    /// `max_unsettled_bytes`), one for the whole relay: every session's
    /// stream takes from it, and so does the table path for a huge row
    /// (through S3), so that a huge row the table sends and one the stream
    /// sends are not both held beyond it.
    pub budget: Budget,
    /// Every destination, with its queue and its lane's state (outliving
    /// sessions: streaming or spooling); more are looked up on first use
    /// with a queue-URL template.
    pub destinations: Destinations,
    pub publisher: Arc<dyn Publisher>,
    pub metrics: Arc<Metrics>,
    /// Where published events are written before they are settled (`None`:
    /// no archive).
    pub archive: Option<Arc<Archive>>,
}

impl Parts {
    pub fn new(
        settings: Settings,
        destinations: Destinations,
        publisher: Arc<dyn Publisher>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Parts { budget: settings.memory.budget(), settings, destinations, publisher, metrics, archive: None }
    }

    /// The same, archiving what it publishes in `archive`.
    pub fn archiving(self, archive: Option<Arc<Archive>>) -> Self {
        Parts { archive, ..self }
    }
}
