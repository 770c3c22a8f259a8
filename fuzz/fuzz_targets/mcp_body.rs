#![no_main]
//! See `atmost_fuzz::mcp_body` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::mcp_body::check(data));
