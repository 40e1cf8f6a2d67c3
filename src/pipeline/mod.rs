//! The stages both sources share: route → lane (batch, send, reconcile) →
//! settle → watermark, within the unsettled budget.

pub mod archive;
pub mod assemble;
pub mod batch;
pub mod budget;
pub mod destinations;
pub mod intake;
pub mod lane;
pub mod owed;
pub mod parts;
pub mod route;
pub mod settings;
pub mod settle;
pub mod watermark;
