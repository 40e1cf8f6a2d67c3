//! The stages both sources share: route → lane (batch, send, reconcile) →
//! settle → watermark, within the unsettled budget.

pub mod batch;
pub mod budget;
pub mod lane;
pub mod route;
pub mod settle;
pub mod watermark;
