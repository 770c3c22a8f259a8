//! Prints what a `call_state_machine` input decodes to (configuration and events):
//! `cargo run --example explain -- artifacts/call_state_machine/crash-…`.
fn main() {
    for path in std::env::args().skip(1) {
        match std::fs::read(&path) {
            Ok(data) => println!(
                "{path}:\n{}",
                atmost_fuzz::call_state_machine::explain(&data)
            ),
            Err(e) => eprintln!("{path}: {e}"),
        }
    }
}
