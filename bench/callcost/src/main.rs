//! `atmost-bench-callcost N`: N governed `tools/call`s through the filter's state machine
//! (request → authorize answer → dispatch → JSON response → completed report), natively.
//! `atmost-bench-callcost verify N`: N signed governed `tools/call`s through the verifier's
//! machine (`role: "verify"`: headers, body, signature check, replay cache).
//!
//! `make bench` runs it under callgrind twice (N and N + 1000) and reports the difference
//! per call: instructions are deterministic where wall time on a shared machine is not,
//! so a change to the filter's parsing, fingerprinting or reporting shows up exactly. It
//! is built with the same `opt-level = "s"` as the wasm module (profile `callcost`).

use std::process::ExitCode;
use std::rc::Rc;

use atmost_config::Config;

mod one_call;
mod one_verify;
use one_call::{one_call, CONFIG};
use one_verify::SignedCall;

fn usage() -> ExitCode {
    eprintln!("usage: atmost-bench-callcost [verify] N");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (verify, count) = match args.as_slice() {
        [n] => (false, n),
        [mode, n] if mode == "verify" => (true, n),
        _ => return usage(),
    };
    let Ok(n) = count.parse::<usize>() else {
        return usage();
    };
    if verify {
        let Some(mut signed) = SignedCall::new().filter(SignedCall::check) else {
            eprintln!("atmost-bench-callcost: cannot make a signed call that verifies");
            return ExitCode::FAILURE;
        };
        for _ in 0..n {
            if !signed.one_verify() {
                eprintln!("atmost-bench-callcost: the signed call was not let through verified");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
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
