//! The admins: who may call the admin API and sign in to the inbox, each under a name.
//!
//! Two sources, either or both: `--admin-token`, one shared token, which is the admin named
//! [`SHARED_ADMIN_NAME`]; and `--admin-tokens-file`, one admin a line, `NAME SHA256` (the
//! lowercase hex SHA-256 of that admin's token, so the file holds no secret), read again when
//! it changes. A presented token is hashed once and its hash compared with every admin's in
//! constant time.
//!
//! A hash cannot show how long its token is: the 32 bytes the ledger asks of every token are
//! checked where a token is seen whole (`atmost admin-token line`, which makes a file's line,
//! and `--admin-token`), not in the file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use thiserror::Error;
use tokio::task::JoinHandle;

use crate::file_watch::{spawn_looks, Swapped, WatchedFiles};
use crate::metrics::Metrics;
use atmost_ledger::token;

/// The name of the admin whose token is `--admin-token`.
pub const SHARED_ADMIN_NAME: &str = "admin";
/// Longest admin name, in bytes.
pub const MAX_ADMIN_NAME_BYTES: usize = 64;

/// Whether `name` may name an admin: 1 to [`MAX_ADMIN_NAME_BYTES`] bytes of `A-Z a-z 0-9 . _ @ -`
/// (so it fits a log field, a cookie and a resolution's `by` as it is).
pub fn valid_admin_name(name: &str) -> bool {
    (1..=MAX_ADMIN_NAME_BYTES).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
}

/// The lowercase hex SHA-256 of `token`, as a tokens file holds it.
pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The tokens file's line of the admin `name` whose token is `token`.
pub fn tokens_file_line(name: &str, token: &str) -> String {
    format!("{name} {}", token_sha256(token))
}

fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// One admin: its name and the SHA-256 of its token.
#[derive(Clone, PartialEq, Eq)]
struct Admin {
    name: String,
    token_sha256: String,
    /// The `--admin-token`, which several people may hold.
    shared: bool,
}

/// Who presented a token that authenticated. Handlers find it among the request's extensions
/// (crate::access::require_admin puts it there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthenticatedAdmin {
    /// The admin's name, logged with what it does.
    pub name: String,
    /// Which token of that admin it was (derived from the token's hash, never the token): an
    /// inbox session keeps it, and ends when the admin's token changes or the admin goes.
    pub credential: String,
    /// Signed in with the shared `--admin-token`: the name says nothing of the person.
    pub shared: bool,
}

impl Admin {
    fn authenticated(&self) -> AuthenticatedAdmin {
        AuthenticatedAdmin {
            name: self.name.clone(),
            credential: credential_of(&self.token_sha256),
            shared: self.shared,
        }
    }
}

/// The credential id of a token's hash: short, and not the hash itself, so a cookie does not
/// carry what a tokens file holds.
fn credential_of(token_sha256: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"atmost admin credential\0")
        .chain_update(token_sha256.as_bytes())
        .finalize();
    hex::encode(&digest[..8])
}

/// The tokens given on the command line, which a tokens file is checked against.
#[derive(Clone)]
pub struct FixedTokens {
    /// `--admin-token`, the admin named [`SHARED_ADMIN_NAME`], if given.
    pub admin_token: Option<String>,
    /// `--service-token`: no admin may hold it.
    pub service_token: String,
}

impl std::fmt::Debug for FixedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixedTokens")
            .field(
                "admin_token",
                &self.admin_token.as_ref().map(|_| "<redacted>"),
            )
            .field("service_token", &"<redacted>")
            .finish()
    }
}

/// Why a tokens file is refused. Each names the line at fault and never the hash on it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TokensFileError {
    #[error("line {line}: expected `NAME SHA256` (a name, a space, the token's SHA-256 in 64 lowercase hexadecimal digits)")]
    Malformed { line: usize },
    #[error("line {line}: an admin's name is 1 to 64 bytes of A-Z a-z 0-9 . _ @ -")]
    BadName { line: usize },
    #[error("line {line}: the hash must be 64 lowercase hexadecimal digits, the SHA-256 of the admin's token (`atmost admin-token line NAME` makes the line)")]
    BadHash { line: usize },
    #[error("line {line}: the name {name} is already line {first}'s")]
    DuplicateName {
        line: usize,
        name: String,
        first: usize,
    },
    #[error("line {line}: the name `admin` is --admin-token's")]
    SharedName { line: usize },
    #[error("line {line}: the same token as line {first}: one token, one admin")]
    DuplicateHash { line: usize, first: usize },
    #[error("line {line}: the token of --admin-token (the admin `admin`): one token, one admin")]
    SharedHash { line: usize },
    #[error(
        "line {line}: the service token's hash: an admin token must differ from --service-token"
    )]
    ServiceToken { line: usize },
    #[error("names no admin, and no --admin-token is given: nobody could be an admin")]
    NoAdmin,
}

/// Every admin of one reading.
#[derive(Clone, Default)]
pub struct AdminSet {
    admins: Vec<Admin>,
}

impl std::fmt::Debug for AdminSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl AdminSet {
    /// The one admin of `--admin-token` alone.
    pub fn shared(admin_token: &str) -> Self {
        AdminSet {
            admins: vec![Admin {
                name: SHARED_ADMIN_NAME.into(),
                token_sha256: token_sha256(admin_token),
                shared: true,
            }],
        }
    }

    /// The admins of a tokens file's `text`, with `--admin-token`'s if given. Blank lines and
    /// lines starting with `#` are skipped; any other line must be `NAME SHA256`.
    pub fn parse(text: &str, fixed: &FixedTokens) -> Result<Self, TokensFileError> {
        let service = token_sha256(&fixed.service_token);
        // Each admin with the line it came from (`None`: --admin-token).
        let mut read: Vec<(Option<usize>, Admin)> = fixed
            .admin_token
            .as_deref()
            .map(|t| AdminSet::shared(t).admins)
            .unwrap_or_default()
            .into_iter()
            .map(|a| (None, a))
            .collect();
        for (at, raw) in text.lines().enumerate() {
            let line = at + 1;
            let content = raw.trim();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            let mut fields = content.split_ascii_whitespace();
            let (Some(name), Some(hash), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(TokensFileError::Malformed { line });
            };
            if !valid_admin_name(name) {
                return Err(TokensFileError::BadName { line });
            }
            if !is_sha256_hex(hash) {
                return Err(TokensFileError::BadHash { line });
            }
            if hash == service {
                return Err(TokensFileError::ServiceToken { line });
            }
            for (first, other) in &read {
                if other.name == name {
                    return Err(match first {
                        Some(first) => TokensFileError::DuplicateName {
                            line,
                            name: name.into(),
                            first: *first,
                        },
                        None => TokensFileError::SharedName { line },
                    });
                }
                if other.token_sha256 == hash {
                    return Err(match first {
                        Some(first) => TokensFileError::DuplicateHash {
                            line,
                            first: *first,
                        },
                        None => TokensFileError::SharedHash { line },
                    });
                }
            }
            read.push((
                Some(line),
                Admin {
                    name: name.into(),
                    token_sha256: hash.into(),
                    shared: false,
                },
            ));
        }
        if read.is_empty() {
            return Err(TokensFileError::NoAdmin);
        }
        Ok(AdminSet {
            admins: read.into_iter().map(|(_, a)| a).collect(),
        })
    }

    /// The admins' names, in the order they were read.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.admins.iter().map(|a| a.name.as_str())
    }

    /// The admin whose token `presented` is. Hashed once, then compared with every admin's
    /// hash in constant time, all of them whatever matched.
    pub fn authenticate(&self, presented: &str) -> Option<AuthenticatedAdmin> {
        let presented = token_sha256(presented);
        let mut found = None;
        for admin in &self.admins {
            if token::secrets_equal(&presented, &admin.token_sha256) && found.is_none() {
                found = Some(admin);
            }
        }
        found.map(Admin::authenticated)
    }

    /// The credential the admin `name` holds now, `None` when there is no such admin.
    pub fn credential_of(&self, name: &str) -> Option<String> {
        self.admins
            .iter()
            .find(|a| a.name == name)
            .map(|a| credential_of(&a.token_sha256))
    }
}

/// The admins in force: the set read last, swapped whole when the tokens file changes.
#[derive(Default)]
pub struct Admins {
    current: Swapped<AdminSet>,
}

impl std::fmt::Debug for Admins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Admins").field(&*self.current()).finish()
    }
}

impl Admins {
    pub fn new(set: AdminSet) -> Self {
        Admins {
            current: Swapped::new(set),
        }
    }

    /// The admins of `--admin-token` alone.
    pub fn shared(admin_token: &str) -> Arc<Self> {
        Arc::new(Admins::new(AdminSet::shared(admin_token)))
    }

    /// The set in force now.
    pub fn current(&self) -> Arc<AdminSet> {
        self.current.current()
    }

    /// [`AdminSet::authenticate`] on the set in force.
    pub fn authenticate(&self, presented: &str) -> Option<AuthenticatedAdmin> {
        self.current().authenticate(presented)
    }

    /// [`AdminSet::credential_of`] on the set in force.
    pub fn credential_of(&self, name: &str) -> Option<String> {
        self.current().credential_of(name)
    }
}

/// A tokens file that cannot be used.
#[derive(Debug, Error)]
pub enum AdminsFileError {
    #[error("--admin-tokens-file {path}: cannot be read: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    #[error("--admin-tokens-file {path}: {refused}")]
    Refused {
        path: PathBuf,
        refused: TokensFileError,
    },
}

fn read_set(path: &Path, fixed: &FixedTokens) -> Result<AdminSet, AdminsFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| AdminsFileError::Unreadable {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    AdminSet::parse(&text, fixed).map_err(|refused| AdminsFileError::Refused {
        path: path.to_path_buf(),
        refused,
    })
}

/// What one look at the tokens file came to.
pub type ReloadCheck = crate::file_watch::ReloadCheck<AdminsFileError>;

/// `--admin-tokens-file`: read at start, and again whenever it changes.
pub struct TokensFile {
    path: PathBuf,
    fixed: FixedTokens,
    admins: Arc<Admins>,
    /// The file as it was when last looked at (read, or refused).
    watched: WatchedFiles,
}

impl TokensFile {
    /// Reads the file once: a ledger given one does not start unless it is good.
    pub fn load(path: PathBuf, fixed: FixedTokens) -> Result<Self, AdminsFileError> {
        let watched = WatchedFiles::new(vec![path.clone()]);
        let set = read_set(&path, &fixed)?;
        Ok(TokensFile {
            path,
            fixed,
            admins: Arc::new(Admins::new(set)),
            watched,
        })
    }

    /// The admins in force, as every request sees them.
    pub fn admins(&self) -> Arc<Admins> {
        self.admins.clone()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Looks at the file once and reads it if it changed.
    pub fn check(&mut self) -> ReloadCheck {
        // Missing for a moment (being replaced): a failure once, then quiet until it is back;
        // the admins read before stay meanwhile.
        let (path, fixed, admins) = (&self.path, &self.fixed, &self.admins);
        self.watched.reload(
            |e| AdminsFileError::Unreadable {
                path: path.clone(),
                reason: e.to_string(),
            },
            || read_set(path, fixed),
            |set| admins.current.replace(set),
        )
    }
}

/// Looks at the tokens file about once a second (crate::file_watch) for as long as the
/// ledger runs; each reload and each refused file is logged, and
/// `atmost_admin_tokens_reload_failing` says whether the file on disk is the one in force.
pub fn spawn_reloader(mut file: TokensFile, metrics: Arc<Metrics>) -> JoinHandle<()> {
    spawn_looks(move || match file.check() {
        ReloadCheck::Unchanged => {}
        ReloadCheck::Reloaded => {
            metrics.admin_tokens_reload_failing.set(0);
            let set = file.admins().current();
            let names: Vec<&str> = set.names().collect();
            tracing::info!(file = %file.path().display(), admins = %names.join(","),
                "admin tokens reloaded: these admins are in force from now on");
        }
        ReloadCheck::Failed(e) => {
            metrics.admin_tokens_reload_failing.set(1);
            tracing::error!(error = %e,
                "admin tokens not reloaded: the previous admins stay in force");
        }
    })
}

#[cfg(test)]
pub(crate) mod http_tests;
#[cfg(test)]
pub(crate) mod tests;
