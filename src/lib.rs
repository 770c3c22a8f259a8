//! atmost filter: a proxy-wasm HTTP filter for Envoy that asks the atmost ledger before
//! any governed MCP `tools/call` goes upstream, and reports what became of every call it
//! let through.
//!
//! Everything except `adapter` is plain Rust with no proxy-wasm dependency, so it is
//! tested natively with `cargo test -p atmost-filter`. By domain:
//!
//! - [`parse`]: reading what arrives (the request body as an MCP message, the idempotency
//!   key and where it may come from, JSON text in place, an upstream's event stream);
//! - [`call`]: the per-request state machine and its parts (denials, replies, replays,
//!   receipts, outcomes, the permit's figures, resume tickets), every decision about a
//!   request or its response;
//! - [`report`]: the root context's outcome reports (the after-the-fact queue and the
//!   batch of completion reports whose responses are held);
//! - [`held_calls`]: the calls the root context holds open for a person's approval
//!   (`approval_hold_ms`), and when each asks the ledger again;
//! - [`ledger_client`]: the callouts to the ledger and reading its answers;
//! - [`stats`]: the counters;
//! - [`verify`]: the verifier at the tool (`role: "verify"`), which lets a governed call
//!   through only with a valid dispatch signature by the ledger.
//!
//! The adapter (`src/adapter/`) only exists in the `wasm32` build: it turns Envoy's
//! callbacks into calls on [`call::Call`] and [`report::Reporter`] and carries out the
//! [`call::Effect`]s and [`report::RootEffect`]s they return, with hostcalls.
//!
//! The promise is *at most N dispatches per tool under one permit* and *one dispatch per
//! idempotency key*; the remote side effect itself is not guaranteed to happen only once.

pub mod call;
pub mod held_calls;
pub mod ledger_client;
pub mod parse;
pub mod report;
pub mod stats;
pub mod verify;

#[cfg(test)]
mod test_config;

#[cfg(target_arch = "wasm32")]
mod adapter;
