#![no_main]
//! See `atmost_fuzz::plugin_config` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::plugin_config::check(data));
