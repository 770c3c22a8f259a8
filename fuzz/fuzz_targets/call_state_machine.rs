#![no_main]
//! See `atmost_fuzz::call_state_machine` for what this target asserts.

libfuzzer_sys::fuzz_target!(|data: &[u8]| atmost_fuzz::call_state_machine::check(data));
