//! Plugin configurations for the filter's tests.

use atmost_config::Config;
use serde_json::{json, Value};

/// The smallest accepted configuration (`hmac` upstream keys).
pub(crate) fn minimal() -> Value {
    json!({
        "ledger": {"cluster": "atmost_ledger", "service_token": "svc-token-0123456789abcdef0123456789"},
        "upstream_key": {"secret": "0123456789abcdef0123"}
    })
}

pub(crate) fn config_from(v: &Value) -> Config {
    match Config::parse(v.to_string().as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}
