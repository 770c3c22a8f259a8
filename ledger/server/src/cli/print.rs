//! How the admin commands print permits and attempts for people (`--json` prints the API's JSON).

use std::time::Duration;

use super::CliError;
use crate::api::{key_carriers_text, AttemptView, KeyView, PermitView};
use atmost_ledger::error::LedgerError;
use atmost_ledger::model::CostRule;

pub(super) fn print_json(v: &serde_json::Value) -> Result<(), CliError> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(LedgerError::from)?
    );
    Ok(())
}

pub(super) fn opt<T: std::fmt::Display>(v: Option<T>, none: &str) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| none.to_string())
}

pub(super) fn print_permit(p: &PermitView) {
    println!("permit     {}", p.id);
    println!("label      {}", p.label);
    println!("status     {}", p.status);
    println!("created    {}", p.created_at);
    println!("expires    {}", p.expires_at);
    if let Some(r) = &p.revoked_at {
        println!("revoked    {r}");
    }
    let rules = &p.rules;
    println!("tools      {}", rules.tools.join(","));
    let caps: Vec<String> = rules
        .max_calls
        .iter()
        .map(|(t, n)| format!("{t}={n}"))
        .collect();
    println!(
        "max calls  {} (default {})",
        if caps.is_empty() {
            "-".to_string()
        } else {
            caps.join(" ")
        },
        opt(rules.max_calls_default, "none")
    );
    println!("budget     {}", opt(rules.budget, "no limit"));
    if let Some(name) = &rules.credential {
        println!("credential {name}");
    }
    let costs: Vec<String> = rules
        .cost
        .iter()
        .map(|(t, c)| match c {
            CostRule::Fixed(n) => format!("{t}={n}"),
            CostRule::Pointer(ptr) => format!("{t}={ptr}"),
        })
        .collect();
    println!(
        "cost       {} (default {})",
        if costs.is_empty() {
            "-".to_string()
        } else {
            costs.join(" ")
        },
        rules.cost_default
    );
    println!("dup guard  {}", rules.duplicate_guard.as_str());
    println!(
        "retention  {}",
        humantime::format_duration(Duration::from_secs(p.retention_secs))
    );
}

/// One line per attempt; the last column is where its forwarded key went (`-`: none was
/// forwarded; `none`: a value with no carrier recorded).
pub(super) fn print_attempt_row(a: &AttemptView) {
    let key_went = match (&a.forwarded_key, a.forwarded_key_carriers.is_empty()) {
        (None, _) => "-".to_string(),
        (Some(_), true) => "none".to_string(),
        (Some(_), false) => a.forwarded_key_carriers.to_list(),
    };
    println!(
        "{:<37} {:<28} {:<22} {:<24} {:>6} {} {}",
        a.id,
        a.permit_id,
        a.state.as_str(),
        a.tool,
        a.cost,
        a.created_at,
        key_went
    );
}

pub(super) fn print_attempt(a: &AttemptView) {
    println!("attempt    {}", a.id);
    println!("permit     {}", a.permit_id);
    println!("tool       {}", a.tool);
    println!("state      {}", a.state);
    println!("cost       {}", a.cost);
    println!("created    {}", a.created_at);
    println!("updated    {}", a.updated_at);
    println!("lease      {}", a.lease_expires_at);
    if let Some(r) = &a.reason {
        println!("reason     {r}");
    }
    println!(
        "receipt    {}",
        if a.has_receipt {
            "stored"
        } else if a.pruned_at.is_some() {
            "pruned"
        } else {
            "none"
        }
    );
    println!("replays    {}", a.replay_count);
    println!(
        "fwd key    {}",
        a.forwarded_key.as_deref().unwrap_or("none sent")
    );
    println!(
        "key went   {}",
        key_carriers_text(a.forwarded_key.as_deref(), a.forwarded_key_carriers)
    );
    if let Some(args) = &a.arguments {
        println!("arguments  {args}");
    }
    if let Some(c) = &a.credential {
        println!("credential {} v{}", c.name, c.version);
    }
    if let Some(ap) = &a.approval {
        println!("approval   asked {}", ap.requested_at);
        if let (Some(d), Some(by), Some(at)) = (&ap.decision, &ap.decided_by, &ap.decided_at) {
            println!(
                "decided    {d} by {by} at {at}{}",
                ap.note
                    .as_deref()
                    .map(|n| format!(" — {n}"))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(r) = &a.resolution {
        println!(
            "resolved   {} by {} at {}{}",
            if r.executed {
                "executed"
            } else {
                "not executed"
            },
            r.by,
            r.at,
            r.note
                .as_deref()
                .map(|n| format!(" — {n}"))
                .unwrap_or_default()
        );
        if let Some(answer) = &r.provider_answer {
            println!("provider   {answer}");
        }
    }
}

/// One key per line, newest first, under a header.
pub(super) fn print_keys(keys: &[KeyView]) {
    let row = |kid: &str, status: &str, created: &str, retired: &str, until: &str| {
        println!("{kid:<44} {status:<12} {created:<24} {retired:<24} {until}");
    };
    row("KID", "STATUS", "CREATED", "RETIRED", "PUBLISHED UNTIL");
    for k in keys {
        row(
            &k.kid,
            &k.status,
            &k.created_at,
            k.retired_at.as_deref().unwrap_or("-"),
            k.published_until.as_deref().unwrap_or("-"),
        );
    }
}
