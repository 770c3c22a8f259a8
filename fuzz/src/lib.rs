//! Fuzz entry points of the atmost filter. Each module has one `check(data: &[u8])` that the
//! matching target in `fuzz_targets/` calls, and that `tests/` replays on the committed
//! corpora and regression inputs: a crash a fuzzer finds becomes a plain `#[test]`.
//!
//! A check panics (the fuzzer's crash) when the filter panics, or when an invariant the
//! filter promises does not hold. The filter itself must never panic: in Envoy a panic
//! kills the Wasm VM and every request on it.

pub mod call_state_machine;
pub mod fingerprint;
pub mod mcp_body;
pub mod plain;
pub mod plugin_config;
pub mod plugin_config_structured;
pub mod replay;
pub mod sse;
pub mod util;
