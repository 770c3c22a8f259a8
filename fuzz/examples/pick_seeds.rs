//! Lists, for each state the committed `call_state_machine` seeds must reach (see
//! `tests/corpus.rs`), the smallest files of a grown corpus that reach it:
//! `cargo run --example pick_seeds -- work/call_state_machine`.
use atmost_fuzz::call_state_machine::{reached, Reached};

type Goal = (&'static str, fn(&Reached) -> bool);

const GOALS: [Goal; 10] = [
    ("dispatch and report", |r| r.dispatched && r.reports > 0),
    ("request_hold body: dispatch", |r| r.body_mode_dispatched),
    (
        "request_hold body: upstream answered first, attempt released",
        |r| r.released_after_early_answer,
    ),
    ("tools_list_limits: figures written in", |r| r.limits_edited),
    ("tools_list_limits: ledger refused", |r| r.limits_refused),
    ("tools_list_limits: no answer (failed, timed out)", |r| {
        r.limits_timed_out
    }),
    ("tools_list_limits: callout not dispatched", |r| {
        r.limits_not_dispatched
    }),
    ("tools_list_limits: asked", |r| r.limits_asked),
    (
        "answer_release at_once: answer released before its report",
        |r| r.released_unwaited,
    ),
    ("approval_hold_ms: held, then dispatched", |r| {
        r.held_for_approval && r.dispatched
    }),
];

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "work/call_state_machine".into());
    let mut runs: Vec<(usize, String, Reached)> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let data = std::fs::read(e.path()).ok()?;
            let r = std::panic::catch_unwind(|| reached(&data)).ok()?;
            Some((data.len(), e.path().display().to_string(), r))
        })
        .collect();
    runs.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    for (goal, hit) in GOALS {
        println!("{goal}:");
        for (n, p, _) in runs.iter().filter(|(_, _, r)| hit(r)).take(3) {
            println!("  {n} {p}");
        }
    }
}
