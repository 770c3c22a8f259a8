//! `atmost-bench-callcost N`: N governed `tools/call`s through the filter's state machine
//! (request → authorize answer → dispatch → JSON response → completed report), natively.
//!
//! `make bench` runs it under callgrind twice (N and N + 1000) and reports the difference
//! per call: instructions are deterministic where wall time on a shared machine is not,
//! so a change to the filter's parsing, fingerprinting or reporting shows up exactly. It
//! is built with the same `opt-level = "s"` as the wasm module (profile `callcost`).

use std::process::ExitCode;
use std::rc::Rc;

use atmost_config::Config;

mod one_call;
use one_call::{one_call, CONFIG};

fn main() -> ExitCode {
    let Some(n) = std::env::args()
        .nth(1)
        .and_then(|a| a.parse::<usize>().ok())
    else {
        eprintln!("usage: atmost-bench-callcost N");
        return ExitCode::from(2);
    };
    let config = match Config::parse(CONFIG) {
        Ok(c) => Rc::new(c),
        Err(e) => {
            eprintln!("atmost-bench-callcost: {e}");
            return ExitCode::FAILURE;
        }
    };
    for _ in 0..n {
        if !one_call(&config) {
            eprintln!("atmost-bench-callcost: the call did not reach its completed report");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
