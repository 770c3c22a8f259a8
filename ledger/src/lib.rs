//! The atmost ledger as a library: permits, attempts and receipts for the atmost Envoy filter.
//!
//! The promise is at most N dispatches per tool under one permit and one dispatch per
//! idempotency key; an outcome that is unknown stays `uncertain` until someone resolves it.
//! This crate holds the records ([`model`]), what a permit may ask for ([`policy`]), the pure
//! decisions on them ([`decide`]), the stores that keep them ([`store`]: SQLite and
//! PostgreSQL, each behind a cargo feature), and the signing keys ([`keys`]) with what is signed with them: dispatches ([`signing`]) and
//! exported receipts ([`receipts`]). The
//! server (HTTP APIs, reconciliation inbox, reconciler, the `atmost` command line) is the
//! `atmost-ledger-server` crate in `ledger/server/`.

pub mod clock;
pub mod credentials;
pub mod decide;
pub mod error;
pub mod keys;
pub mod model;
pub mod policy;
pub mod receipts;
pub mod signing;
pub mod store;
pub mod token;

#[cfg(test)]
mod decide_tests;
