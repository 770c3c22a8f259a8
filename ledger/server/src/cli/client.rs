//! A blocking client of the admin API.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::args::ClientArgs;
use super::CliError;
use crate::api::ErrorBody;

/// A blocking client of the admin API.
pub struct Client {
    base: String,
    token: String,
    http: reqwest::blocking::Client,
}

impl Client {
    pub fn new(args: &ClientArgs) -> Result<Self, CliError> {
        let token = args
            .admin_token
            .clone()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                CliError::Usage(
                    "the admin token is required: --admin-token or ATMOST_ADMIN_TOKEN".into(),
                )
            })?;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| CliError::Http(e.to_string()))?;
        Ok(Client {
            base: args.ledger.trim_end_matches('/').to_string(),
            token,
            http,
        })
    }

    fn send<T: DeserializeOwned>(
        &self,
        rb: reqwest::blocking::RequestBuilder,
    ) -> Result<(T, serde_json::Value), CliError> {
        let resp = rb
            .bearer_auth(&self.token)
            .send()
            .map_err(|e| CliError::Http(e.to_string()))?;
        let status = resp.status();
        let text = resp.text().map_err(|e| CliError::Http(e.to_string()))?;
        if !status.is_success() {
            let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
            return Err(CliError::Api {
                status: status.as_u16(),
                error: body
                    .as_ref()
                    .map(|b| b.error.clone())
                    .unwrap_or_else(|| text.clone()),
                message: body.and_then(|b| b.message),
            });
        }
        let raw: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CliError::Http(format!("bad JSON from ledger: {e}")))?;
        let typed = serde_json::from_value(raw.clone())
            .map_err(|e| CliError::Http(format!("unexpected answer: {e}")))?;
        Ok((typed, raw))
    }

    pub fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<(T, serde_json::Value), CliError> {
        let mut url = format!("{}{}", self.base, path);
        if !query.is_empty() {
            let qs: Vec<String> = query
                .iter()
                .map(|(k, v)| format!("{k}={}", urlencode(v)))
                .collect();
            url.push('?');
            url.push_str(&qs.join("&"));
        }
        self.send(self.http.get(url))
    }

    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(T, serde_json::Value), CliError> {
        self.send(self.http.post(format!("{}{}", self.base, path)).json(body))
    }
}

pub(super) fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
