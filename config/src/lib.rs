//! The plugin configuration: the JSON in the Wasm filter's `configuration`. A crate of its
//! own so the ledger's `atmost config check` runs the filter's parser without the filter.
//!
//! Parsing and checking happen in one pass over the JSON so that every error names the
//! field it is about (`ledger.timeout_ms`, `upstream_key.secret`, …). Unknown fields are
//! refused, so a typo is an error and not a silently ignored setting. Error messages never
//! echo a field's value (some are secrets).
//!
//! Where each thing is: the defaults and bounds in [`bounds`], the enumerations in
//! [`choices`], reading JSON in `reader`, the gateway's configuration in `gateway`, the
//! verifier's in `verify`, `upgrade_routes` in `upgrade`.

pub mod bounds;
pub mod choices;
mod gateway;
mod reader;
#[cfg(test)]
mod tests;
mod upgrade;
mod upstream_secret;
mod verify;

use serde_json::Value;

pub use bounds::*;
pub use choices::{
    AnswerRelease, CompletionReports, DenialFormat, RequestHold, Role, UpstreamKeyMode,
};
pub use gateway::{Config, LedgerConfig, UpstreamKey};
use reader::{err, json_object, Obj};
pub use reader::{ConfigError, ToolSet};
pub use upgrade::{UpgradeRoutes, MAX_ROUTE_NAME_BYTES, MAX_UPGRADE_ROUTES, REFUSED_ROUTE_NAMES};
pub use upstream_secret::UpstreamSecret;
pub use verify::{JwksSource, VerifyConfig, VerifyKey};
pub use verify::{
    DEFAULT_MAX_SKEW_S, DEFAULT_REFRESH_MS, DEFAULT_REPLAY_CACHE_ENTRIES, GATEWAY_ONLY_FIELDS,
    MAX_INLINE_KEYS, MAX_REPLAY_CACHE_ENTRIES, MAX_SKEW_S, MIN_REPLAY_CACHE_ENTRIES,
};

/// What one plugin instance is, by its `role` (`"gateway"` by default, or `"verify"`).
#[derive(Debug, Clone, PartialEq)]
pub enum PluginConfig {
    /// `role: "gateway"` (or no `role`): asks the ledger before a governed call goes out.
    Gateway(Config),
    /// `role: "verify"`: in front of a tool server, refuses governed calls without a valid
    /// dispatch signature.
    Verify(VerifyConfig),
}

impl PluginConfig {
    /// Parses and checks a configuration of either role; `*_env` secrets are read from the
    /// process environment.
    pub fn parse(bytes: &[u8]) -> Result<PluginConfig, ConfigError> {
        PluginConfig::parse_with_env(bytes, &|name| std::env::var(name).ok())
    }

    /// [`PluginConfig::parse`] with the environment given.
    pub fn parse_with_env(
        bytes: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PluginConfig, ConfigError> {
        let root = json_object(bytes)?;
        let Value::Object(map) = &root else {
            return Err(err("", "must be a JSON object"));
        };
        let top = Obj { path: "", map };
        match top.choice::<Role>("role")? {
            Role::Gateway => Config::parse_with_env(bytes, env).map(PluginConfig::Gateway),
            Role::Verify => verify::parse(&top, env).map(PluginConfig::Verify),
        }
    }
}
