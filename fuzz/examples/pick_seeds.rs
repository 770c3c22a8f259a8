//! Lists grown corpus files of `call_state_machine` that dispatch and report, smallest
//! first: `cargo run --example pick_seeds -- work/call_state_machine`.
fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "work/call_state_machine".into());
    let mut hits: Vec<(usize, String)> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let data = std::fs::read(e.path()).ok()?;
            let (d, r) = atmost_fuzz::call_state_machine::reach(&data);
            (d && r > 0).then(|| (data.len(), e.path().display().to_string()))
        })
        .collect();
    hits.sort();
    for (n, p) in hits.iter().take(5) {
        println!("{n} {p}");
    }
}
