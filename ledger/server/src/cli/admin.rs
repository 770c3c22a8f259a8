//! The admin commands (`permit …`, `attempts …`, `keys …`, `inbox …`): each one request, its
//! answer printed.

use super::args::{
    ApprovalCommand, AttemptsCommand, CredentialCommand, InboxCommand, KeysCommand, PermitCommand,
    SessionsCommand,
};
use super::client::{urlencode, Client};
use super::print::{opt, print_attempt, print_attempt_row, print_json, print_keys, print_permit};
use super::CliError;
use crate::api::{
    AttemptListResponse, AttemptResponse, CreatePermitResponse, KeyListResponse, KeyRotateResponse,
    PermitListResponse, PermitResponse, PermitShowResponse, ReceiptExportResponse,
    SessionsRevokeResponse,
};
use crate::approvals::{ApprovalListResponse, DecisionBody};
use atmost_ledger::decide::ResolveInput;
use atmost_ledger::model::AttemptState;

pub(super) fn run_permit(c: &Client, json: bool, cmd: PermitCommand) -> Result<(), CliError> {
    match cmd {
        PermitCommand::Create(a) => {
            let req = a.into_request();
            let (resp, raw): (CreatePermitResponse, _) =
                c.post(crate::api::ADMIN_PERMITS_PATH, &req)?;
            if json {
                return print_json(&raw);
            }
            print_permit(&resp.permit);
            println!();
            println!("token (shown once; store it now, the ledger keeps only its hash):");
            println!("{}", resp.token);
        }
        PermitCommand::Show { id } => {
            let (resp, raw): (PermitShowResponse, _) =
                c.get(&format!("/admin/v1/permits/{}", urlencode(&id)), &[])?;
            if json {
                return print_json(&raw);
            }
            print_permit(&resp.permit);
            println!();
            println!("usage per tool:");
            if resp.usage.is_empty() {
                println!("  (no calls)");
            }
            for (tool, u) in &resp.usage {
                println!(
                    "  {tool:<30} calls_made {:<6} limit {}",
                    u.calls_made,
                    opt(u.limit, "none")
                );
            }
            let b = &resp.budget;
            println!(
                "budget: budget {}  spent {}  reserved {}  left {}",
                opt(b.budget, "none"),
                b.spent,
                b.reserved,
                opt(b.left, "unlimited")
            );
            let counts: Vec<String> = resp
                .attempts
                .iter()
                .map(|(s, n)| format!("{s}={n}"))
                .collect();
            println!("attempts: {}", counts.join(" "));
        }
        PermitCommand::List => {
            let (resp, raw): (PermitListResponse, _) =
                c.get(crate::api::ADMIN_PERMITS_PATH, &[])?;
            if json {
                return print_json(&raw);
            }
            println!("{:<28} {:<8} {:<26} LABEL", "ID", "STATUS", "EXPIRES");
            for p in &resp.permits {
                println!(
                    "{:<28} {:<8} {:<26} {}",
                    p.id, p.status, p.expires_at, p.label
                );
            }
        }
        PermitCommand::Revoke { id } => {
            let (resp, raw): (PermitResponse, _) = c.post(
                &format!("/admin/v1/permits/{}/revoke", urlencode(&id)),
                &serde_json::json!({}),
            )?;
            if json {
                return print_json(&raw);
            }
            println!(
                "permit {} revoked at {}",
                resp.permit.id,
                resp.permit.revoked_at.unwrap_or_default()
            );
        }
    }
    Ok(())
}

pub(super) fn run_approval(c: &Client, json: bool, cmd: ApprovalCommand) -> Result<(), CliError> {
    let (id, note, verb) = match cmd {
        ApprovalCommand::List { state, permit } => {
            let q = attempt_query(state, permit, None);
            let (resp, raw): (ApprovalListResponse, _) =
                c.get(crate::approvals::ADMIN_APPROVALS_PATH, &q)?;
            if json {
                return print_json(&raw);
            }
            println!(
                "{:<37} {:<28} {:<22} {:<24} {:>6} {:<24} LAPSES",
                "ID", "PERMIT", "STATE", "TOOL", "COST", "ASKED"
            );
            for a in &resp.approvals {
                println!(
                    "{:<37} {:<28} {:<22} {:<24} {:>6} {:<24} {}",
                    a.id,
                    a.permit_id,
                    a.state.as_str(),
                    a.tool,
                    a.cost,
                    a.created_at,
                    a.lease_expires_at
                );
            }
            return Ok(());
        }
        ApprovalCommand::Approve { id, note } => (id, note, "approve"),
        ApprovalCommand::Reject { id, note } => (id, note, "reject"),
    };
    let (resp, raw): (AttemptResponse, _) = c.post(
        &format!("/admin/v1/approvals/{}/{verb}", urlencode(&id)),
        &DecisionBody { note },
    )?;
    if json {
        return print_json(&raw);
    }
    println!("attempt {} is now {}", resp.attempt.id, resp.attempt.state);
    print_attempt(&resp.attempt);
    Ok(())
}

pub(super) fn run_attempts(c: &Client, json: bool, cmd: AttemptsCommand) -> Result<(), CliError> {
    match cmd {
        AttemptsCommand::List {
            state,
            permit,
            limit,
        } => {
            let q = attempt_query(state, permit, limit);
            let (resp, raw): (AttemptListResponse, _) =
                c.get(crate::api::ADMIN_ATTEMPTS_PATH, &q)?;
            if json {
                return print_json(&raw);
            }
            println!(
                "{:<37} {:<28} {:<22} {:<24} {:>6} CREATED",
                "ID", "PERMIT", "STATE", "TOOL", "COST"
            );
            for a in &resp.attempts {
                print_attempt_row(a);
            }
        }
        AttemptsCommand::Export {
            state,
            permit,
            limit,
        } => {
            let q = attempt_query(state, permit, limit);
            let (resp, raw): (ReceiptExportResponse, _) =
                c.get(crate::api::ADMIN_ATTEMPTS_EXPORT_PATH, &q)?;
            if json {
                return print_json(&raw);
            }
            for jws in &resp.receipts {
                println!("{jws}");
            }
        }
        AttemptsCommand::Show { id } => {
            let (resp, raw): (AttemptResponse, _) =
                c.get(&format!("/admin/v1/attempts/{}", urlencode(&id)), &[])?;
            if json {
                return print_json(&raw);
            }
            print_attempt(&resp.attempt);
        }
        AttemptsCommand::Resolve(a) => {
            let receipt = match a.receipt.as_ref() {
                None => None,
                Some(p) if p.as_os_str() == "-" => {
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                    Some(s)
                }
                Some(p) => Some(std::fs::read_to_string(p)?),
            };
            let by =
                a.by.or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
                    .unwrap_or_else(|| "cli".to_string());
            let input = ResolveInput {
                executed: a.executed,
                receipt,
                note: a.note,
                by,
                source: Default::default(),
            };
            let (resp, raw): (AttemptResponse, _) = c.post(
                &format!("/admin/v1/attempts/{}/resolve", urlencode(&a.id)),
                &input,
            )?;
            if json {
                return print_json(&raw);
            }
            println!("attempt {} is now {}", resp.attempt.id, resp.attempt.state);
            print_attempt(&resp.attempt);
        }
    }
    Ok(())
}

/// The query of `attempts list` and `attempts export`.
fn attempt_query(
    state: Option<AttemptState>,
    permit: Option<String>,
    limit: Option<u32>,
) -> Vec<(&'static str, String)> {
    let mut q = Vec::new();
    if let Some(s) = state {
        q.push(("state", s.as_str().to_string()));
    }
    if let Some(p) = permit {
        q.push(("permit", p));
    }
    if let Some(l) = limit {
        q.push(("limit", l.to_string()));
    }
    q
}

pub(super) fn run_keys(c: &Client, json: bool, cmd: KeysCommand) -> Result<(), CliError> {
    match cmd {
        KeysCommand::List => {
            let (resp, raw): (KeyListResponse, _) = c.get(crate::api::ADMIN_KEYS_PATH, &[])?;
            if json {
                return print_json(&raw);
            }
            print_keys(&resp.keys);
        }
        KeysCommand::Rotate => {
            let (resp, raw): (KeyRotateResponse, _) =
                c.post(crate::api::ADMIN_KEYS_ROTATE_PATH, &serde_json::json!({}))?;
            if json {
                return print_json(&raw);
            }
            println!("key {} signs from now on", resp.key.kid);
            if let Some(r) = &resp.retired {
                println!(
                    "key {} retired at {}, published until {}",
                    r.kid,
                    r.retired_at.as_deref().unwrap_or("-"),
                    r.published_until.as_deref().unwrap_or("-")
                );
            }
        }
    }
    Ok(())
}

pub(super) fn run_inbox(c: &Client, json: bool, cmd: InboxCommand) -> Result<(), CliError> {
    match cmd {
        InboxCommand::Sessions {
            command: SessionsCommand::Revoke { all: _ },
        } => {
            let (resp, raw): (SessionsRevokeResponse, _) = c.post(
                crate::api::ADMIN_INBOX_SESSIONS_REVOKE_PATH,
                &serde_json::json!({}),
            )?;
            if json {
                return print_json(&raw);
            }
            println!(
                "{} inbox session(s) ended; everyone signs in again",
                resp.revoked
            );
        }
    }
    Ok(())
}

pub(super) fn run_credential(
    c: &Client,
    json: bool,
    cmd: CredentialCommand,
) -> Result<(), CliError> {
    use crate::credentials::{CredentialListResponse, CredentialResponseBody};
    let show = |v: &atmost_ledger::credentials::CredentialView| {
        println!(
            "{:<24} v{:<5} {:<20} {:<7} {:<24} {}",
            v.name,
            v.version,
            v.header,
            v.form.as_str(),
            v.routes.join(","),
            v.created_at
        )
    };
    match cmd {
        CredentialCommand::Set(a) => {
            let text = if a.secret_file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())?
            } else {
                std::fs::read_to_string(&a.secret_file)?
            };
            let secret = text
                .strip_suffix('\n')
                .map(|s| s.strip_suffix('\r').unwrap_or(s))
                .unwrap_or(&text);
            let body = serde_json::json!({
                "header": a.header, "form": a.form, "routes": a.route, "secret": secret,
            });
            let (resp, raw): (CredentialResponseBody, _) = c.put(
                &format!(
                    "{}/{}",
                    crate::api::ADMIN_CREDENTIALS_PATH,
                    urlencode(&a.name)
                ),
                &body,
            )?;
            if json {
                return print_json(&raw);
            }
            show(&resp.credential);
        }
        CredentialCommand::List => {
            let (resp, raw): (CredentialListResponse, _) =
                c.get(crate::api::ADMIN_CREDENTIALS_PATH, &[])?;
            if json {
                return print_json(&raw);
            }
            println!(
                "{:<24} {:<6} {:<20} {:<7} {:<24} CREATED",
                "NAME", "VER", "HEADER", "FORM", "ROUTE"
            );
            for v in &resp.credentials {
                show(v);
            }
        }
    }
    Ok(())
}
