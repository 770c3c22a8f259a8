//! `atmost`: the ledger server (`atmost ledger`) and its admin CLI (`atmost permit …`, `atmost attempts …`).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = atmost_ledger::cli::Cli::parse();
    match atmost_ledger::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("atmost: {e}");
            ExitCode::FAILURE
        }
    }
}
