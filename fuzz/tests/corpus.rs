//! Replays the committed seed corpora (`corpus/<target>/`) and every input a fuzzer ever
//! crashed on (`regressions/<target>/`) through the same checks the fuzz targets run.
//! Plain `cargo test`: no nightly flags, no libFuzzer.

use std::fs;
use std::path::Path;

const TARGETS: [(&str, fn(&[u8])); 7] = [
    ("mcp_body", atmost_fuzz::mcp_body::check),
    ("fingerprint", atmost_fuzz::fingerprint::check),
    ("sse", atmost_fuzz::sse::check),
    ("plugin_config", atmost_fuzz::plugin_config::check),
    (
        "plugin_config_structured",
        atmost_fuzz::plugin_config_structured::check,
    ),
    ("call_state_machine", atmost_fuzz::call_state_machine::check),
    ("replay", atmost_fuzz::replay::check),
];

fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out: Vec<_> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn replay_dir(kind: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind);
    let mut n = 0;
    for (target, check) in TARGETS {
        for f in files(&root.join(target)) {
            let data = fs::read(&f).unwrap_or_default();
            eprintln!(
                "{kind}/{target}/{}",
                f.file_name()
                    .map(|s| s.to_string_lossy())
                    .unwrap_or_default()
            );
            check(&data);
            n += 1;
        }
    }
    n
}

#[test]
fn seed_corpora_pass() {
    assert!(replay_dir("corpus") > 0, "no seed corpus found");
}

#[test]
fn regressions_pass() {
    replay_dir("regressions");
}

#[test]
fn every_target_has_seeds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, _) in TARGETS {
        assert!(
            !files(&root.join(target)).is_empty(),
            "corpus/{target} is empty"
        );
    }
}

/// What each committed seed of the state machine reaches.
fn state_machine_seeds() -> Vec<atmost_fuzz::call_state_machine::Reached> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/call_state_machine");
    files(&root)
        .iter()
        .map(|f| atmost_fuzz::call_state_machine::reached(&fs::read(f).unwrap_or_default()))
        .collect()
}

/// The state machine's seeds reach a dispatch and an outcome report, so every fuzz run
/// starts from inputs that get past the ledger.
#[test]
fn state_machine_seeds_reach_dispatch() {
    assert!(
        state_machine_seeds()
            .iter()
            .any(|r| r.dispatched && r.reports > 0),
        "no seed in corpus/call_state_machine dispatches and reports"
    );
}

/// `request_hold: body`: a seed sends a governed call's body after its dispatch, and one has
/// the upstream answer before the decision, the dispatch that follows released.
#[test]
fn state_machine_seeds_reach_request_hold_body() {
    let seeds = state_machine_seeds();
    assert!(
        seeds.iter().any(|r| r.body_mode_dispatched),
        "no seed in corpus/call_state_machine dispatches under request_hold: body"
    );
    assert!(
        seeds.iter().any(|r| r.released_after_early_answer),
        "no seed in corpus/call_state_machine has the upstream answer before the decision under request_hold: body"
    );
}

/// `approval_hold_ms`: a seed has the ledger answer `approval_required`, the call held open,
/// and the ledger's next answer dispatch it.
#[test]
fn state_machine_seeds_reach_a_held_call_dispatched() {
    assert!(
        state_machine_seeds()
            .iter()
            .any(|r| r.held_for_approval && r.dispatched),
        "no seed in corpus/call_state_machine holds a call for approval and then dispatches it"
    );
}

/// `answer_release: at_once`: a seed has an answer go on before its report was acknowledged.
#[test]
fn state_machine_seeds_reach_an_answer_released_before_its_report() {
    assert!(
        state_machine_seeds().iter().any(|r| r.released_unwaited),
        "no seed in corpus/call_state_machine releases an answer under answer_release: at_once"
    );
}

/// `tools_list_limits`: seeds make the limits callout of a `tools/list` answer and reach
/// each end of it: the figures written in, the ledger refusing, no answer, no dispatch.
#[test]
fn state_machine_seeds_reach_each_end_of_a_limits_callout() {
    let seeds = state_machine_seeds();
    type Goal = (
        &'static str,
        fn(&atmost_fuzz::call_state_machine::Reached) -> bool,
    );
    let goals: [Goal; 4] = [
        ("figures written in", |r| r.limits_edited),
        ("refused by the ledger", |r| r.limits_refused),
        ("failed or timed out", |r| r.limits_timed_out),
        ("not dispatched", |r| r.limits_not_dispatched),
    ];
    let missed: Vec<&str> = goals
        .iter()
        .filter(|(_, hit)| !seeds.iter().any(hit))
        .map(|(name, _)| *name)
        .collect();
    assert!(
        missed.is_empty(),
        "no seed in corpus/call_state_machine reaches a limits callout {missed:?}"
    );
}
