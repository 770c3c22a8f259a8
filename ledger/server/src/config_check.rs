//! `atmost config check FILE`: the filter's plugin configuration, checked offline with the
//! filter's own parser, so the answer is the one Envoy's `on_configure` would give.

use std::io::Read;
use std::path::Path;

use atmost_config::{PluginConfig, ToolSet};

fn tools(set: &ToolSet) -> String {
    match set {
        ToolSet::All => "*".to_string(),
        ToolSet::Only(names) => names.join(","),
    }
}

/// What a check found: `Ok` with a one-line summary, or the filter's own error line.
pub fn check_bytes(bytes: &[u8]) -> Result<String, String> {
    match PluginConfig::parse(bytes) {
        Ok(PluginConfig::Gateway(config)) => Ok(format!(
            "ok: ledger cluster `{}`, permit header `{}`, governed tools {}, denial format {:?}",
            config.ledger.cluster,
            config.permit_header,
            tools(&config.governed_tools),
            config.denial_format
        )),
        Ok(PluginConfig::Verify(config)) => Ok(format!(
            "ok: role verify, {} inline key(s), key set {}, governed tools {}, denial format {:?}",
            config.keys.len(),
            match &config.jwks {
                Some(j) => format!("fetched from cluster `{}` at `{}`", j.cluster, j.path),
                None => "not fetched".to_string(),
            },
            tools(&config.governed_tools),
            config.denial_format
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads FILE (`-` for standard input) and checks it.
pub fn check_file(path: &Path) -> Result<String, String> {
    let mut bytes = Vec::new();
    let read = if path == Path::new("-") {
        std::io::stdin().read_to_end(&mut bytes).map(|_| ())
    } else {
        std::fs::read(path).map(|b| bytes = b)
    };
    read.map_err(|e| format!("atmost: cannot read {}: {e}", path.display()))?;
    check_bytes(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_config_is_summarised() {
        let ok = check_bytes(
            br#"{"ledger":{"cluster":"atmost_ledger","service_token":"t"},"upstream_key":{"mode":"off"}}"#,
        );
        assert!(
            ok.as_deref().is_ok_and(|s| s.contains("atmost_ledger")),
            "{ok:?}"
        );
    }

    #[test]
    fn a_bad_config_gives_the_filters_error_naming_the_field() {
        let bad = check_bytes(
            br#"{"ledger":{"cluster":"atmost_ledger","service_token":"t","timeout_ms":0},"upstream_key":{"mode":"off"}}"#,
        );
        let line = bad.err().unwrap_or_default();
        assert!(line.contains("field `ledger.timeout_ms`"), "{line}");
    }

    #[test]
    fn a_verifiers_config_is_checked_by_the_same_parser() {
        let ok = check_bytes(br#"{"role":"verify","verify":{"jwks":{"cluster":"atmost_ledger"}}}"#);
        assert!(
            ok.as_deref()
                .is_ok_and(|s| s.contains("role verify") && s.contains("atmost_ledger")),
            "{ok:?}"
        );
        let bad = check_bytes(
            br#"{"role":"verify","verify":{"jwks":{"cluster":"l"}},"upstream_key":{"mode":"off"}}"#,
        );
        let line = bad.err().unwrap_or_default();
        assert!(line.contains("field `upstream_key`"), "{line}");
    }
}
