use clap::{CommandFactory, Parser};

use super::*;
use crate::model::{CostRule, GuardMode};

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
