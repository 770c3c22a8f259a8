#![no_main]
//! See `atmost_fuzz::fingerprint` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::fingerprint::check(data));
