//! The atmost ledger server: the service API the filter calls (`/v1/authorize`,
//! `/v1/outcomes`, `/v1/limits`, `/v1/credential`), the admin API, the reconciliation inbox, the reconciler and
//! the sweeper, over a store of the `atmost-ledger` library; and the `atmost` command line
//! (the server, the admin client, the offline config check).

pub mod access;
pub mod admins;
pub mod api;
pub mod approvals;
pub mod auth_limit;
pub mod cli;
pub mod config_check;
pub mod credentials;
pub mod decision_loop;
pub mod drain;
pub mod file_watch;
pub mod inbox;
pub mod metrics;
pub mod readiness;
pub mod reconcile;
pub mod redact;
pub mod reports;
pub mod resolution;
pub mod server;
pub mod signer;
pub mod state;
pub mod sweeper;
pub mod tls;
pub mod tool_refusal;
pub mod webhook;

#[cfg(test)]
mod credentials_tests;
#[cfg(test)]
mod http_tests;
