//! The webhook's secret and the `atmost-signature` header it signs each request with
//! (docs/approvals.md, "Webhook").

use std::path::Path;

use ring::hmac;

/// The request header that carries the signature.
pub const SIGNATURE_HEADER: &str = "atmost-signature";

/// Shortest secret accepted, in bytes (as `--tool-refusal-keys`'s keys).
pub const MIN_SECRET_BYTES: usize = 32;

/// The HMAC-SHA256 key of `--approval-webhook-secret-file`. Never shown.
#[derive(Clone)]
pub struct WebhookSecret {
    key: hmac::Key,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(redacted)")
    }
}

impl WebhookSecret {
    /// The secret of a file's bytes, one trailing `\n` removed (what `echo` or an editor
    /// adds); the rest, a `\r` included, is the secret.
    pub fn from_file_bytes(bytes: &[u8]) -> Result<WebhookSecret, String> {
        let secret = bytes.strip_suffix(b"\n").unwrap_or(bytes);
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the secret is {} bytes long; it must be at least {MIN_SECRET_BYTES} (make one with `openssl rand -hex 32`)",
                secret.len()
            ));
        }
        Ok(WebhookSecret {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        })
    }

    /// [`WebhookSecret::from_file_bytes`] of the file at `path`; the error names the flag and
    /// the file.
    pub fn read(path: &Path) -> Result<WebhookSecret, String> {
        let at_fault =
            |e: String| format!("--approval-webhook-secret-file {}: {e}", path.display());
        let bytes = std::fs::read(path).map_err(|e| at_fault(e.to_string()))?;
        WebhookSecret::from_file_bytes(&bytes).map_err(at_fault)
    }

    /// The `atmost-signature` value of `body` sent at `unix_seconds`: `t=SECONDS,v1=HEX`, the
    /// lowercase hex HMAC-SHA256 of `SECONDS.BODY`. The time is signed with the body, so a
    /// receiver that refuses an old `t` refuses a replayed request too.
    pub fn signature(&self, unix_seconds: i64, body: &[u8]) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(unix_seconds.to_string().as_bytes());
        ctx.update(b".");
        ctx.update(body);
        format!("t={unix_seconds},v1={}", hex::encode(ctx.sign().as_ref()))
    }
}
