use clap::{CommandFactory, Parser};

use super::*;
use atmost_ledger::model::{CostRule, GuardMode};

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
    let cli = Cli::try_parse_from([
        "atmost",
        "--admin-token",
        "admin",
        "ledger",
        "--service-token",
        "svc",
        "--listen",
        "127.0.0.1:1",
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--reconcile-rules",
        rules.to_str().unwrap(),
    ])
    .unwrap();
    match run(cli) {
        Err(CliError::Usage(m)) => {
            assert!(m.contains(rules.to_str().unwrap()), "{m}");
            assert!(m.contains("unknown field `token`"), "{m}");
        }
        other => panic!("expected a usage error, got {other:?}"),
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("rules.json")],
        "no store is opened before the rules are checked"
    );
}
