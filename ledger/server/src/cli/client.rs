//! A blocking client of the admin API.

use std::path::Path;
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
        let mut builder = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30));
        if let Some(path) = &args.ledger_ca_file {
            builder = builder.tls_certs_only(ca_certificates(path)?);
        }
        let http = builder.build().map_err(|e| CliError::Http(e.to_string()))?;
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

    pub fn put<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(T, serde_json::Value), CliError> {
        self.send(self.http.put(format!("{}{}", self.base, path)).json(body))
    }
}

/// The CA certificates of `--ledger-ca-file`: at least one, or the file is refused.
fn ca_certificates(path: &Path) -> Result<Vec<reqwest::Certificate>, CliError> {
    let refused =
        |reason: String| CliError::Usage(format!("--ledger-ca-file {}: {reason}", path.display()));
    let pem = std::fs::read(path).map_err(|e| refused(e.to_string()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| refused(e.to_string()))?;
    if certs.is_empty() {
        return Err(refused("holds no PEM certificate".into()));
    }
    Ok(certs)
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
