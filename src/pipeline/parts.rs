//! What every pipeline is made of and sends through: built once at
//! start-up, shared by both sources (the stream's sessions and every table
//! lane).

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::publish::Publisher;

use super::destinations::Destinations;
use super::settings::Settings;

pub struct Parts {
    pub settings: Settings,
    /// Every destination, with its queue and its lane's state (outliving
    /// sessions: streaming or spooling); more are looked up on first use
    /// with a queue-URL template.
    pub destinations: Destinations,
    pub publisher: Arc<dyn Publisher>,
    pub metrics: Arc<Metrics>,
}
