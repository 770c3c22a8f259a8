//! Command line of the `atmost` binary: the ledger server and the admin client.

mod admin;
mod args;
mod client;
mod print;
mod serve;

pub use args::{
    AdminTokenCommand, AttemptsCommand, Cli, ClientArgs, Command, ConfigCommand, CreateArgs,
    CredentialCommand, CredentialSetArgs, InboxCommand, KeysCommand, LedgerArgs, LogFormat,
    PermitCommand, ResolveArgs, SessionsCommand,
};
pub use client::Client;

use thiserror::Error;

use admin::{run_approval, run_attempts, run_credential, run_inbox, run_keys, run_permit};
use serve::run_ledger;

use atmost_ledger::error::LedgerError;

#[derive(Debug, Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("cannot reach the ledger: {0}")]
    Http(String),
    #[error("ledger answered {status}: {error}{}", message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Api {
        status: u16,
        error: String,
        message: Option<String>,
    },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A refused plugin configuration: the filter's own error line.
    #[error("{0}")]
    Config(String),
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Ledger(args) => run_ledger(*args, cli.client.admin_token.clone()),
        Command::AdminToken {
            command: AdminTokenCommand::Line { name },
        } => {
            let input = std::io::read_to_string(std::io::stdin())?;
            println!("{}", admin_token_line(&name, &input)?);
            Ok(())
        }
        Command::Permit { command } => {
            run_permit(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Approval { command } => {
            run_approval(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Attempts { command } => {
            run_attempts(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Keys { command } => run_keys(&Client::new(&cli.client)?, cli.client.json, command),
        Command::Credential { command } => {
            run_credential(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Inbox { command } => {
            run_inbox(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Config {
            command:
                ConfigCommand::Check {
                    file,
                    lease,
                    route_timeout,
                },
        } => match crate::config_check::check_file(
            &file,
            &crate::config_check::Timing {
                lease,
                route_timeout,
            },
        ) {
            Ok(summary) => {
                println!("{summary}");
                Ok(())
            }
            Err(line) => Err(CliError::Config(line)),
        },
    }
}

/// `atmost admin-token line NAME`: the tokens file's line of `name`, whose token is `input`
/// (one line; its line ending is not part of the token).
fn admin_token_line(name: &str, input: &str) -> Result<String, CliError> {
    if !crate::admins::valid_admin_name(name) {
        return Err(CliError::Usage(format!(
            "an admin's name is 1 to {} bytes of A-Z a-z 0-9 . _ @ -",
            crate::admins::MAX_ADMIN_NAME_BYTES
        )));
    }
    let token = input
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(input);
    if token.contains(['\n', '\r']) {
        return Err(CliError::Usage(
            "standard input holds more than one line: give the one token alone".into(),
        ));
    }
    // The file holds only the hash, which cannot show the token's length: checked here.
    if token.len() < serve::MIN_TOKEN_BYTES {
        return Err(CliError::Usage(format!(
            "the token on standard input is {} bytes long; it must be at least {} (make one with `openssl rand -hex 32`)",
            token.len(),
            serve::MIN_TOKEN_BYTES
        )));
    }
    Ok(crate::admins::tokens_file_line(name, token))
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[cfg(test)]
mod tests;
