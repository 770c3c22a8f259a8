#![no_main]
//! See `atmost_fuzz::sse` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::sse::check(data));
