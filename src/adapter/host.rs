//! Thin wrappers over proxy-wasm hostcalls that never unwrap: a failed hostcall is
//! logged or treated as "absent".

use crate::call::reply::LocalReply;
use crate::call::Level;
use crate::ledger_client::LedgerReply;
use crate::stats::Stat;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};
use std::collections::HashMap;
use std::time::Duration;

pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Debug => LogLevel::Debug,
        Level::Info => LogLevel::Info,
        Level::Warn => LogLevel::Warn,
        Level::Error => LogLevel::Error,
    };
    let _ = hostcalls::log(level, message);
}

pub fn headers(map: MapType) -> Vec<(String, Vec<u8>)> {
    hostcalls::get_map_bytes(map).unwrap_or_default()
}

/// The first value of one header (`name` lowercase), if present.
pub fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

pub fn buffer(kind: BufferType, len: usize) -> Vec<u8> {
    if len == 0 {
        return Vec::new();
    }
    match hostcalls::get_buffer(kind, 0, len) {
        Ok(Some(b)) => b,
        _ => Vec::new(),
    }
}

/// `None` when the host refused: the caller must not let the request go on unedited.
pub fn remove_header(map: MapType, name: &str) -> Option<()> {
    if hostcalls::remove_map_value(map, name).is_err() {
        log(
            Level::Error,
            &format!("atmost: could not remove header `{name}`"),
        );
        return None;
    }
    Some(())
}

/// `None` when the host refused: the caller must not let the request go on unedited.
pub fn set_header(map: MapType, name: &str, value: &str) -> Option<()> {
    if hostcalls::set_map_value(map, name, Some(value)).is_err() {
        log(
            Level::Error,
            &format!("atmost: could not set header `{name}`"),
        );
        return None;
    }
    Some(())
}

/// Takes a value of shared data that `accept` turns into something: empties the key with a
/// compare-and-swap on the version it read, so of several workers' VMs racing for the same
/// value exactly one gets it. A value `accept` refuses is left in place.
pub fn take_shared<T>(key: &str, accept: impl FnOnce(&[u8]) -> Option<T>) -> Option<T> {
    let (value, cas) = match hostcalls::get_shared_data(key) {
        Ok((Some(v), cas)) => (v, cas),
        _ => return None,
    };
    let taken = accept(&value)?;
    match hostcalls::set_shared_data(key, Some(&[]), cas) {
        Ok(()) => Some(taken),
        Err(_) => None,
    }
}

pub fn set_shared(key: &str, value: &[u8]) {
    if hostcalls::set_shared_data(key, Some(value), None).is_err() {
        log(
            Level::Warn,
            &format!("atmost: could not store shared data `{key}`"),
        );
    }
}

/// The name of the route Envoy picked for the current request (`xds.route_name`), when it
/// has one: a request that matched no route, or a route without a name, gives `None`.
pub fn route_name() -> Option<String> {
    match hostcalls::get_property(vec!["xds", "route_name"]) {
        Ok(Some(bytes)) if !bytes.is_empty() => String::from_utf8(bytes).ok(),
        _ => None,
    }
}

pub fn property_int(path: &[&str]) -> Option<u64> {
    match hostcalls::get_property(path.to_vec()) {
        Ok(v) => crate::call::outcome::decode_int(v.as_deref()),
        Err(_) => None,
    }
}

pub fn dispatch(
    cluster: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout_ms: u64,
) -> Option<u32> {
    let hs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match hostcalls::dispatch_http_call(
        cluster,
        hs,
        Some(body),
        Vec::new(),
        Duration::from_millis(timeout_ms),
    ) {
        Ok(token) => Some(token),
        Err(status) => {
            log(
                Level::Warn,
                &format!("atmost: dispatch_http_call to cluster `{cluster}` failed: {status:?}"),
            );
            None
        }
    }
}

/// Reads a callout's answer ([`LedgerReply::from_callout`]).
pub fn callout_reply(num_headers: usize, body_size: usize) -> LedgerReply {
    LedgerReply::from_callout(
        num_headers,
        || header(MapType::HttpCallResponseHeaders, ":status"),
        || buffer(BufferType::HttpCallResponseBody, body_size),
    )
}

/// `send_http_response` with `reply`; the request ends here.
pub fn send_local_reply(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if hostcalls::send_http_response(reply.status, headers, Some(&reply.body)).is_err() {
        log(Level::Error, "atmost: could not send a local reply");
    }
}

/// Counter ids, defined once per VM.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: HashMap<Stat, u32>,
}

impl Metrics {
    pub fn define() -> Metrics {
        let mut ids = HashMap::new();
        for stat in Stat::all() {
            match hostcalls::define_metric(MetricType::Counter, &stat.name()) {
                Ok(id) => {
                    ids.insert(stat, id);
                }
                Err(_) => log(
                    Level::Warn,
                    &format!("atmost: could not define metric {}", stat.name()),
                ),
            }
        }
        Metrics { ids }
    }

    pub fn inc(&self, stat: Stat) {
        if let Some(id) = self.ids.get(&stat) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
}

/// Unix milliseconds by Envoy's clock.
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
