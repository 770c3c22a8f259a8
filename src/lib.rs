//! atmost filter: a proxy-wasm HTTP filter for Envoy that asks the atmost ledger before
//! any governed MCP `tools/call` goes upstream, and reports what became of every call it
//! let through.
//!
//! Everything except [`adapter`] is plain Rust with no proxy-wasm dependency, so it is
//! tested natively with `cargo test -p atmost-filter`. The adapter only exists in the
//! `wasm32` build: it turns Envoy's callbacks into [`call::Event`]s for the per-request
//! state machine and carries out the [`call::Effect`]s it returns.
//!
//! The promise is *at most N dispatches per tool under one permit* and *one dispatch per
//! idempotency key*; the remote side effect itself is not guaranteed to happen only once.

pub mod body_encoding;
pub mod call;
pub mod completions;
pub mod denial;
pub mod effects;
pub mod fingerprint;
pub mod fold;
mod fold_table;
pub mod idempotency;
pub mod json_text;
pub mod ledger;
pub mod mcp;
pub mod meta_key;
pub mod outcome;
pub mod permit;
pub mod permit_meta;
pub mod receipt;
pub mod replay;
pub mod reply;
pub mod reporter;
pub mod reports;
pub mod resume;
pub mod sse;
pub mod stats;
pub mod strict_json;
pub mod upstream_key;

#[cfg(test)]
mod test_config;

#[cfg(target_arch = "wasm32")]
mod adapter;
