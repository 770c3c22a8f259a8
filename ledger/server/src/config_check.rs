//! `atmost config check FILE`: the filter's plugin configuration, checked offline with the
//! filter's own parser, so the answer is the one Envoy's `on_configure` would give.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use atmost_config::{Config, PluginConfig, ToolSet, UpgradeRoutes};

/// What the check knows of the deployment around the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// The ledger's `--lease`.
    pub lease: Duration,
    /// The timeout of the Envoy route the filter governs.
    pub route_timeout: Duration,
}

/// A "not executed" is safe only if the lease outlasts every way the call may still run:
/// the filter waiting for the ledger, then the upstream for the route's whole timeout
/// (docs/design.md, the lease), and, when reports ride (`report_ride_ms`), the report's
/// wait for the next call, the tick after it and its own batch's callout.
fn check_lease(timing: &Timing, config: &Config) -> Result<(), String> {
    let callout_timeout_ms = config.ledger.timeout_ms;
    let callout = Duration::from_millis(callout_timeout_ms);
    let ride = match config.report_ride_ms {
        0 => Duration::ZERO,
        ms => Duration::from_millis(ms + config.report_interval_ms + callout_timeout_ms),
    };
    let needed = callout + timing.route_timeout + ride;
    if timing.lease > needed {
        return Ok(());
    }
    let ride_term = if ride.is_zero() {
        String::new()
    } else {
        format!(
            " + a riding report's wait {} (report_ride_ms, report_interval_ms, ledger.timeout_ms)",
            humantime::format_duration(ride)
        )
    };
    Err(format!(
        "atmost: the ledger's lease {} does not exceed ledger.timeout_ms {} ms + the route timeout {}{ride_term} \
         ({}): a call still running when its lease ends is recorded uncertain; raise --lease above {} \
         (or give the check the lease and route timeout you run with: --lease, --route-timeout)",
        humantime::format_duration(timing.lease),
        callout_timeout_ms,
        humantime::format_duration(timing.route_timeout),
        humantime::format_duration(needed),
        humantime::format_duration(needed),
    ))
}

fn tools(set: &ToolSet) -> String {
    match set {
        ToolSet::All => "*".to_string(),
        ToolSet::Only(names) => names.join(","),
    }
}

/// Where an upgrade passes, as the summary says it: every other one is refused.
fn upgrades(routes: &UpgradeRoutes) -> String {
    match routes.names() {
        [] => "upgrades refused on every route".to_string(),
        names => format!("upgrades only on route(s) {}", names.join(",")),
    }
}

/// What a check found: `Ok` with a one-line summary, or the filter's own error line (or
/// the lease's, see [`check_lease`]).
pub fn check_bytes(bytes: &[u8], timing: &Timing) -> Result<String, String> {
    match PluginConfig::parse(bytes) {
        Ok(PluginConfig::Gateway(config)) => {
            check_lease(timing, &config).map(|()| {
                format!(
            "ok: ledger cluster `{}`, permit header `{}`, governed tools {}, denial format {:?}, {}",
            config.ledger.cluster,
            config.permit_header,
            tools(&config.governed_tools),
            config.denial_format,
            upgrades(&config.upgrade_routes)
        )
            })
        }
        Ok(PluginConfig::Verify(config)) => Ok(format!(
            "ok: role verify, serving {}, {} inline key(s), key set {}, refusals {}, governed tools {}, denial format {:?}, {}",
            config.authorities.join(","),
            config.keys.len(),
            match &config.jwks {
                Some(j) => format!("fetched from cluster `{}` at `{}`", j.cluster, j.path),
                None => "not fetched".to_string(),
            },
            match config.refusal_key {
                Some(_) => "proven",
                None => "unproven (no refusal_key)",
            },
            tools(&config.governed_tools),
            config.denial_format,
            upgrades(&config.upgrade_routes)
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads FILE (`-` for standard input) and checks it.
pub fn check_file(path: &Path, timing: &Timing) -> Result<String, String> {
    let mut bytes = Vec::new();
    let read = if path == Path::new("-") {
        std::io::stdin().read_to_end(&mut bytes).map(|_| ())
    } else {
        std::fs::read(path).map(|b| bytes = b)
    };
    read.map_err(|e| format!("atmost: cannot read {}: {e}", path.display()))?;
    check_bytes(&bytes, timing)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults of `atmost config check`.
    const SHIPPED: Timing = Timing {
        lease: Duration::from_secs(300),
        route_timeout: Duration::from_secs(120),
    };

    const GATEWAY: &[u8] =
        br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc-token-0123456789abcdef0123456789","timeout_ms":1000},"upstream_key":{"mode":"off"}}"#;

    #[test]
    fn a_lease_that_does_not_exceed_the_callout_and_route_timeouts_is_refused() {
        let at = |lease_ms: u64, route_s: u64| Timing {
            lease: Duration::from_millis(lease_ms),
            route_timeout: Duration::from_secs(route_s),
        };
        assert!(check_bytes(GATEWAY, &SHIPPED).is_ok());
        assert!(check_bytes(GATEWAY, &at(16_001, 15)).is_ok());
        for refused in [at(16_000, 15), at(10_000, 15), at(120_000, 120)] {
            let line = check_bytes(GATEWAY, &refused).err().unwrap_or_default();
            assert!(
                line.contains("ledger.timeout_ms 1000 ms") && line.contains("route timeout"),
                "{refused:?}: {line}"
            );
        }
        let line = check_bytes(GATEWAY, &at(60_000, 120))
            .err()
            .unwrap_or_default();
        assert!(
            line.contains("lease 1m")
                && line.contains("route timeout 2m")
                && line.contains("2m 1s"),
            "{line}"
        );
    }

    #[test]
    fn a_riding_reports_wait_counts_against_the_lease() {
        const RIDING: &[u8] =
            br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc-token-0123456789abcdef0123456789","timeout_ms":1000},"upstream_key":{"mode":"off"},"answer_release":"at_once","report_ride_ms":2000}"#;
        let at = |lease_ms: u64| Timing {
            lease: Duration::from_millis(lease_ms),
            route_timeout: Duration::from_secs(15),
        };
        // 1 s + 15 s without riding; with it, 2 s of wait, a 200 ms tick and 1 s of callout.
        assert!(check_bytes(GATEWAY, &at(16_001)).is_ok());
        assert!(check_bytes(RIDING, &at(19_201)).is_ok());
        let line = check_bytes(RIDING, &at(19_200)).err().unwrap_or_default();
        assert!(
            line.contains("a riding report's wait 3s 200ms") && line.contains("(19s 200ms)"),
            "{line}"
        );
    }

    #[test]
    fn the_summary_says_where_upgrades_pass() {
        let none = check_bytes(GATEWAY, &SHIPPED);
        assert!(
            none.as_deref()
                .is_ok_and(|s| s.ends_with("upgrades refused on every route")),
            "{none:?}"
        );
        let listed = check_bytes(
            br#"{"role":"verify","verify":{"jwks":{"cluster":"c"},"authorities":["t:8000"]},"upgrade_routes":["chat-ws","events"]}"#,
            &SHIPPED,
        );
        assert!(
            listed
                .as_deref()
                .is_ok_and(|s| s.ends_with("upgrades only on route(s) chat-ws,events")),
            "{listed:?}"
        );
    }

    #[test]
    fn a_valid_config_is_summarised() {
        let ok = check_bytes(
            br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"off"}}"#,
            &SHIPPED,
        );
        assert!(
            ok.as_deref().is_ok_and(|s| s.contains("atmost_ledger")),
            "{ok:?}"
        );
    }

    #[test]
    fn a_bad_config_gives_the_filters_error_naming_the_field() {
        let bad = check_bytes(
            br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc-token-0123456789abcdef0123456789","timeout_ms":0},"upstream_key":{"mode":"off"}}"#,
            &SHIPPED,
        );
        let line = bad.err().unwrap_or_default();
        assert!(line.contains("field `ledger.timeout_ms`"), "{line}");
    }

    #[test]
    fn a_verifiers_config_is_checked_by_the_same_parser() {
        let ok = check_bytes(
            br#"{"role":"verify","verify":{"jwks":{"cluster":"atmost_ledger"},"authorities":["payments:8000"]}}"#,
            &SHIPPED,
        );
        assert!(
            ok.as_deref().is_ok_and(|s| s.contains("role verify")
                && s.contains("atmost_ledger")
                && s.contains("serving payments:8000")
                && s.contains("refusals unproven")),
            "{ok:?}"
        );
        let unbound = check_bytes(
            br#"{"role":"verify","verify":{"jwks":{"cluster":"atmost_ledger"}}}"#,
            &SHIPPED,
        );
        let line = unbound.err().unwrap_or_default();
        assert!(line.contains("field `verify.authorities`"), "{line}");
        let bad = check_bytes(
            br#"{"role":"verify","verify":{"jwks":{"cluster":"l"}},"upstream_key":{"mode":"off"}}"#,
            &SHIPPED,
        );
        let line = bad.err().unwrap_or_default();
        assert!(line.contains("field `upstream_key`"), "{line}");
    }
}
