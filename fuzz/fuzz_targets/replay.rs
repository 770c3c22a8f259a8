#![no_main]
//! See `atmost_fuzz::replay` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::replay::check(data));
