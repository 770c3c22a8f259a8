//! The atmost ledger: permits, attempts and receipts for the atmost Envoy filter.
//!
//! The promise is at most N dispatches per tool under one permit and one dispatch per
//! idempotency key; an outcome that is unknown stays `uncertain` until someone resolves it.

pub mod clock;
pub mod decide;
pub mod error;
pub mod model;
pub mod redact;
pub mod store;
pub mod token;

pub mod api;
pub mod cli;
pub mod config_check;
#[cfg(test)]
mod decide_tests;
pub mod drain;
pub mod inbox;
pub mod metrics;
pub mod reconcile;
pub mod server;

#[cfg(test)]
mod http_tests;
