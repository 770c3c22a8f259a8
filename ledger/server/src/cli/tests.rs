use clap::{CommandFactory, Parser};

use super::*;
use atmost_ledger::model::{CostRule, GuardMode};
use std::path::Path;
use std::time::Duration;

#[test]
fn cli_definition_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn global_client_flags_go_before_or_after_the_command() {
    let cli = Cli::try_parse_from([
        "atmost",
        "--ledger",
        "http://127.0.0.1:1",
        "--json",
        "permit",
        "create",
        "--label",
        "x",
        "--expires",
        "1h",
        "--tools",
        "a,b",
        "--max-calls",
        "a=1",
        "--max-calls",
        "b=2",
        "--cost",
        "a=/amount",
        "--cost",
        "b=3",
        "--duplicate-guard",
        "enforce",
    ])
    .unwrap();
    assert!(cli.client.json);
    let Command::Permit {
        command: PermitCommand::Create(c),
    } = cli.command
    else {
        panic!("not create")
    };
    assert_eq!(c.tools, vec!["a", "b"]);
    assert_eq!(
        c.max_calls,
        vec![("a".to_string(), 1), ("b".to_string(), 2)]
    );
    assert_eq!(c.cost[0].1, CostRule::Pointer("/amount".into()));
    assert_eq!(c.cost[1].1, CostRule::Fixed(3));
    assert_eq!(c.duplicate_guard, Some(GuardMode::Enforce));

    let cli = Cli::try_parse_from([
        "atmost",
        "attempts",
        "list",
        "--state",
        "uncertain",
        "--json",
    ])
    .unwrap();
    assert!(cli.client.json);
    assert!(Cli::try_parse_from(["atmost", "attempts", "resolve", "att_1"]).is_err());
    assert!(Cli::try_parse_from([
        "atmost",
        "attempts",
        "resolve",
        "att_1",
        "--executed",
        "--not-executed"
    ])
    .is_err());
    assert!(Cli::try_parse_from([
        "atmost",
        "attempts",
        "resolve",
        "att_1",
        "--not-executed",
        "--receipt",
        "f"
    ])
    .is_err());
    assert!(Cli::try_parse_from([
        "atmost",
        "permit",
        "create",
        "--label",
        "x",
        "--expires",
        "1h",
        "--max-calls",
        "a"
    ])
    .is_err());
}

#[test]
fn a_bad_reconcile_rule_file_stops_the_ledger_before_it_listens() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.json");
    // A credential written into the rule file is refused: credentials come from env or file.
    std::fs::write(
        &rules,
        r#"{"rules": [{"name": "p", "tool": "pay", "server": {"url": "http://127.0.0.1:1/mcp", "token": "s3cret"},
            "lookup": {"tool": "lookup"}, "answer": {"pointer": "/s", "executed": [1], "not_executed": [0]}}]}"#,
    )
    .unwrap();
    let m = refused_before_the_store(
        dir.path(),
        &rules,
        &["--admin-token", "admin-token-of-32-bytes-or-more-0"],
        &["--reconcile-rules", rules.to_str().unwrap()],
    );
    assert!(m.contains(rules.to_str().unwrap()), "{m}");
    assert!(m.contains("unknown field `token`"), "{m}");
}

/// Runs `atmost ledger` on the data directory `dir`, which holds only `file`, with `global`
/// flags before the command and `args` after the usual ones: the ledger must refuse to start
/// with a usage error (returned), before it opens a store there.
fn refused_before_the_store(dir: &Path, file: &Path, global: &[&str], args: &[&str]) -> String {
    let mut argv = vec!["atmost"];
    argv.extend_from_slice(global);
    argv.extend([
        "ledger",
        "--service-token",
        "service-token-of-32-bytes-or-more",
        "--listen",
        "127.0.0.1:1",
        "--data-dir",
        dir.to_str().unwrap(),
    ]);
    argv.extend_from_slice(args);
    let message = match run(Cli::try_parse_from(argv).unwrap()) {
        Err(CliError::Usage(m)) => m,
        other => panic!("expected a usage error, got {other:?}"),
    };
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![file.file_name().unwrap().to_os_string()],
        "no store is opened before {} is read ({message})",
        file.display()
    );
    message
}

#[test]
fn tls_needs_both_files_and_the_client_takes_a_ca_file() {
    let only_cert = Cli::try_parse_from([
        "atmost",
        "ledger",
        "--service-token",
        "s",
        "--tls-cert-file",
        "ledger.pem",
    ]);
    assert!(
        only_cert.is_err(),
        "a certificate without its key is refused"
    );
    let only_key = Cli::try_parse_from([
        "atmost",
        "ledger",
        "--service-token",
        "s",
        "--tls-key-file",
        "ledger.key",
    ]);
    assert!(
        only_key.is_err(),
        "a key without its certificate is refused"
    );
    let cli = Cli::try_parse_from([
        "atmost",
        "ledger",
        "--service-token",
        "s",
        "--tls-cert-file",
        "ledger.pem",
        "--tls-key-file",
        "ledger.key",
    ])
    .unwrap();
    let Command::Ledger(args) = cli.command else {
        panic!("not ledger")
    };
    assert_eq!(args.tls_cert_file.as_deref(), Some(Path::new("ledger.pem")));
    assert_eq!(args.tls_key_file.as_deref(), Some(Path::new("ledger.key")));

    let cli = Cli::try_parse_from([
        "atmost",
        "permit",
        "list",
        "--ledger",
        "https://127.0.0.1:8081",
        "--ledger-ca-file",
        "ca.pem",
    ])
    .unwrap();
    assert_eq!(
        cli.client.ledger_ca_file.as_deref(),
        Some(Path::new("ca.pem"))
    );
}

#[test]
fn the_purge_delay_is_a_duration_or_off_and_thirty_days_by_default() {
    let delay = |extra: &[&str]| {
        let mut argv = vec!["atmost", "ledger", "--service-token", "s"];
        argv.extend_from_slice(extra);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let Command::Ledger(args) = cli.command else {
            panic!("not ledger")
        };
        Ok::<_, String>(args.purge_ended_permits_after.delay())
    };
    assert_eq!(delay(&[]), Ok(Some(Duration::from_secs(30 * 86_400))));
    assert_eq!(
        delay(&["--purge-ended-permits-after", "90s"]),
        Ok(Some(Duration::from_secs(90)))
    );
    assert_eq!(delay(&["--purge-ended-permits-after", "off"]), Ok(None));
    let refused = delay(&["--purge-ended-permits-after", "soon"]).unwrap_err();
    assert!(refused.contains("or off"), "{refused}");
}

#[test]
fn an_admin_token_or_a_tokens_file_is_required_and_either_will_do() {
    let svc = "service-token-of-32-bytes-or-more";
    let adm = "admin-token-of-32-bytes-or-more-0";
    match serve::check_tokens(svc, None, false) {
        Err(CliError::Usage(m)) => assert!(
            m.contains("--admin-token (ATMOST_ADMIN_TOKEN)")
                && m.contains("--admin-tokens-file (ATMOST_ADMIN_TOKENS_FILE)"),
            "{m}"
        ),
        other => panic!("expected a usage error, got {other:?}"),
    }
    assert!(serve::check_tokens(svc, None, true).is_ok());
    assert!(serve::check_tokens(svc, Some(adm), false).is_ok());
    assert!(serve::check_tokens(svc, Some(adm), true).is_ok());
    match serve::check_tokens(svc, Some("short"), true) {
        Err(CliError::Usage(m)) => assert!(m.contains("is 5 bytes long"), "{m}"),
        other => panic!("expected a usage error, got {other:?}"),
    }
    assert!(serve::check_tokens(svc, Some(svc), true).is_err());
    match serve::check_tokens("", Some(adm), false) {
        Err(CliError::Usage(m)) => assert!(m.contains("--service-token"), "{m}"),
        other => panic!("expected a usage error, got {other:?}"),
    }
}

#[test]
fn admin_token_line_prints_the_name_and_the_tokens_sha256() {
    let cli = Cli::try_parse_from(["atmost", "admin-token", "line", "ana@example.org"]).unwrap();
    assert!(matches!(
        cli.command,
        Command::AdminToken {
            command: AdminTokenCommand::Line { ref name }
        } if name == "ana@example.org"
    ));
    let token = "t".repeat(32);
    for input in [format!("{token}\n"), format!("{token}\r\n"), token.clone()] {
        let line = admin_token_line("ana", &input).unwrap();
        assert_eq!(line, crate::admins::tokens_file_line("ana", &token));
        assert!(!line.contains(&token));
    }
    for (name, input, why) in [
        ("ana", "t".repeat(31), "is 31 bytes long"),
        ("ana", format!("{token}\n{token}\n"), "more than one line"),
        ("ana ops", token.clone(), "an admin's name"),
        ("", token.clone(), "an admin's name"),
    ] {
        match admin_token_line(name, &input) {
            Err(CliError::Usage(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("expected a usage error, got {other:?}"),
        }
    }
}

#[test]
fn a_refused_tokens_file_stops_the_ledger_before_it_listens() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admins");
    std::fs::write(&file, "# admins\nana not-a-sha256\n").unwrap();
    let m = refused_before_the_store(
        dir.path(),
        &file,
        &[],
        &["--admin-tokens-file", file.to_str().unwrap()],
    );
    assert!(m.contains(file.to_str().unwrap()), "{m}");
    assert!(m.contains("line 2:"), "{m}");
}

#[test]
fn a_webhook_secret_too_short_or_alone_stops_the_ledger_before_it_listens() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("webhook-secret");
    std::fs::write(&file, "twelve bytes\n").unwrap();
    let admin = ["--admin-token", "admin-token-of-32-bytes-or-more-0"];
    let m = refused_before_the_store(
        dir.path(),
        &file,
        &admin,
        &[
            "--approval-webhook",
            "https://hooks.example.org/atmost",
            "--approval-webhook-secret-file",
            file.to_str().unwrap(),
        ],
    );
    assert_eq!(
        m,
        format!(
            "--approval-webhook-secret-file {}: the secret is 12 bytes long; it must be at least 32 (make one with `openssl rand -hex 32`)",
            file.display()
        )
    );
    let m = refused_before_the_store(
        dir.path(),
        &file,
        &admin,
        &["--approval-webhook-secret-file", file.to_str().unwrap()],
    );
    assert!(m.contains("without --approval-webhook"), "{m}");
}
