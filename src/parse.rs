//! Reading what a client and an upstream send, in plain Rust: the request body as an MCP
//! message ([`mcp`]) on top of a JSON reader that refuses what parsers disagree on
//! ([`strict_json`], [`fold`]), the headers that say how to decode it ([`body_encoding`]),
//! the idempotency key and where it may come from ([`idempotency`], [`key_rewrite`]), the
//! call's fingerprint ([`fingerprint`]), JSON text read in place ([`json_text`]) and an
//! upstream's event stream ([`sse`]).

pub mod body_encoding;
pub mod fingerprint;
pub mod fold;
mod fold_table;
pub mod idempotency;
pub mod json_text;
pub mod key_rewrite;
pub mod mcp;
pub mod sse;
pub mod strict_json;
