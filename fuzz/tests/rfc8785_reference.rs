//! The filter's canonical text of every `fingerprint` corpus input (committed seeds,
//! regressions, and the corpus the fuzzer grew in `work/` when there is one) against the Python `rfc8785` package, an RFC 8785 implementation that shares
//! nothing with the filter's: not the JSON reader, not the number formatting, not the
//! language. Runs `tests/rfc8785_reference.py` with the project's virtualenv
//! (`ATMOST_PYTHON`, else `../.venv/bin/python`; `make venv-test` installs the package).

use atmost_filter::parse::fingerprint::canonical;
use atmost_filter::parse::strict_json;
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const TOOL: &str = "fuzz_tool";

fn inputs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    // work/ holds what `make fuzz` / `make fuzz-ci` grew (not committed), when present.
    for dir in [
        "corpus/fingerprint",
        "regressions/fingerprint",
        "work/fingerprint",
    ] {
        if let Ok(rd) = std::fs::read_dir(root.join(dir)) {
            out.extend(
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_file()),
            );
        }
    }
    out.sort();
    out
}

fn python() -> PathBuf {
    match std::env::var_os("ATMOST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"),
    }
}

#[test]
fn canonical_text_matches_the_python_rfc8785_package() {
    let mut lines = String::new();
    let mut read = 0;
    for path in inputs() {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        // What the filter reads from a body: a text naming a key twice is refused.
        let Ok(value) = strict_json::from_slice(text.as_bytes()) else {
            continue;
        };
        let args = match value {
            Value::Object(m) => m,
            other => Map::from_iter([("v".to_string(), other)]),
        };
        let canon = match canonical(TOOL, &args) {
            Ok(c) => c,
            Err(e) => panic!("{}: {e}", path.display()),
        };
        lines.push_str(&json!({"tool": TOOL, "input": text, "canonical": canon}).to_string());
        lines.push('\n');
        read += 1;
    }
    assert!(read > 0, "no fingerprint corpus input to compare");

    let python = python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rfc8785_reference.py");
    let mut child = match Command::new(&python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot run {} ({e}): `make venv-test` installs it, or set ATMOST_PYTHON",
            python.display()
        ),
    };
    if let Some(mut stdin) = child.stdin.take() {
        if let Err(e) = stdin.write_all(lines.as_bytes()) {
            panic!("writing to the reference: {e}");
        }
    }
    let out = match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => panic!("the reference did not finish: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the rfc8785 package disagrees:\n{stdout}"
    );
    assert!(
        stdout.contains(&format!("{read} compared, 0 different")),
        "{stdout}"
    );
}
