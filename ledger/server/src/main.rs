//! `atmost`: the ledger server (`atmost ledger`), its admin CLI (`atmost permit …`,
//! `atmost attempts …`) and the offline config check (`atmost config check`).

use std::process::ExitCode;

use atmost_ledger::error::LedgerError;
use atmost_ledger_server::cli::CliError;
use clap::Parser;

/// glibc's allocator gave memory back to the kernel after the SQLite writer's groups
/// (`madvise`, with TLB shootdowns on the other core): 13 % of the writer thread's samples in a
/// profile of the ledger under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = atmost_ledger_server::cli::Cli::parse();
    if !matches!(cli.command, atmost_ledger_server::cli::Command::Ledger(_)) {
        stop_on_closed_output();
    }
    match atmost_ledger_server::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // Already the filter's own line, as Envoy would log it.
        Err(CliError::Config(line)) => {
            eprintln!("{line}");
            ExitCode::from(2)
        }
        // A database migrated by a newer release this one may not serve on: a distinct status,
        // so an orchestrator or a script can tell it from an outage (docs/postgresql.md).
        Err(e @ CliError::Ledger(LedgerError::SchemaTooNew { .. })) => {
            eprintln!("atmost: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("atmost: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The admin commands print to stdout with `println!`, which panics when the reader has gone
/// (`atmost permit list | head -1`). Rust starts every program with SIGPIPE ignored; the
/// admin commands take the default back, so a closed pipe ends them quietly, as it ends any
/// Unix tool. The server keeps it ignored: a client that hangs up must cost it one write, not
/// the process.
fn stop_on_closed_output() {
    // SAFETY: `signal` with SIG_DFL installs no handler; it runs before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
