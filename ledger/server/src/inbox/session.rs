//! The inbox's sessions: signed cookies, each also recorded in the store.
//!
//! Signing in with an admin's token (crate::admins) gives a cookie holding the person's name,
//! the admin whose token it was and which token (its credential id), the session's id,
//! expiry and CSRF token, signed (HMAC-SHA256) with a key derived from the service token,
//! and records the session in the store (a SHA-256 of its id, admin, credential and name). A
//! request's session must be all three: a cookie this ledger signed, an admin still holding
//! that token, and a session the store still holds. Signing out deletes it from the store,
//! `atmost inbox sessions revoke --all` deletes every one, so a copied cookie stops working
//! on every replica at once; an admin removed from the tokens file, or whose token changed,
//! loses its sessions at the next page. Its expiry is checked against the ledger's clock,
//! whatever the browser keeps.
//! The sign-in form has a CSRF token of its own, in a short-lived cookie signed the same way.

use std::time::Duration;

use axum::http::{header, HeaderMap};
use axum_extra::extract::cookie::{Cookie, Key, SameSite, SignedCookieJar};
use sha2::{Digest, Sha256, Sha512};

use atmost_ledger::clock::Millis;
use atmost_ledger::token;

/// The session cookie.
pub const SESSION_COOKIE: &str = "atmost_session";
/// The sign-in form's CSRF cookie.
pub const SIGN_IN_COOKIE: &str = "atmost_sign_in";
/// Both cookies go to the inbox's pages only.
pub const COOKIE_PATH: &str = "/admin/";
/// How long a sign-in form may be sent after it was shown, in milliseconds.
pub const SIGN_IN_FORM_MS: Millis = 15 * 60 * 1000;
/// Longest name a person may sign in with, in characters.
pub const MAX_NAME_CHARS: usize = 64;

/// The signing key of the inbox's cookies, derived from `service_token`: a secret every
/// replica of one ledger shares, whoever its admins are. The key alone does not make a
/// session: a cookie re-signed to name another admin or person names no session the store
/// holds ([`Session::id_hash`]).
pub fn key(service_token: &str) -> Option<Key> {
    let derived = Sha512::new()
        .chain_update(b"atmost inbox sessions, named admins\0")
        .chain_update(service_token.as_bytes())
        .finalize();
    Key::try_from(derived.as_slice()).ok()
}

/// A signed-in person.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Who resolves (recorded as the resolution's `by`): a named admin's name, or the name
    /// typed at sign-in with the shared `--admin-token`.
    pub name: String,
    /// The admin whose token signed in.
    pub admin: String,
    /// Which token of that admin ([`crate::admins::AuthenticatedAdmin::credential`]): the
    /// session ends once the admin holds another, or is gone.
    pub credential: String,
    /// Random; the store holds a hash of it ([`Session::id_hash`]) while the session is open.
    pub id: String,
    /// Every state-changing form of the session must carry it.
    pub csrf: String,
    pub expires_at_ms: Millis,
}

/// What a request's cookie says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presented {
    /// No session cookie, or one that is not ours (bad signature, unreadable).
    None,
    /// A genuine session past its expiry.
    Expired,
    Valid(Session),
}

impl Session {
    fn encode(&self) -> String {
        format!(
            "{}.{}.{}.{}.{}.{}",
            self.expires_at_ms,
            self.csrf,
            self.id,
            hex::encode(self.name.as_bytes()),
            hex::encode(self.admin.as_bytes()),
            self.credential
        )
    }

    fn decode(value: &str) -> Option<Session> {
        let mut parts = value.splitn(6, '.');
        let expires_at_ms = parts.next()?.parse().ok()?;
        let csrf = parts.next()?.to_string();
        let id = parts.next()?.to_string();
        let name = String::from_utf8(hex::decode(parts.next()?).ok()?).ok()?;
        let admin = String::from_utf8(hex::decode(parts.next()?).ok()?).ok()?;
        let credential = parts.next()?.to_string();
        (!id.is_empty()).then_some(Session {
            name,
            admin,
            credential,
            id,
            csrf,
            expires_at_ms,
        })
    }

    /// What the store keeps of the session: a SHA-256 of its id with its admin, credential and
    /// name, so a cookie naming anything else than what signed in names no open session.
    pub fn id_hash(&self) -> String {
        let mut digest = Sha256::new();
        // None of the four holds a NUL (names exclude control characters, the rest is hex or
        // [A-Za-z0-9._@-]): the separators keep them apart.
        for part in [&self.id, &self.admin, &self.credential, &self.name] {
            digest.update(part.as_bytes());
            digest.update([0u8]);
        }
        hex::encode(digest.finalize())
    }

    /// Whether a form's CSRF token is this session's (compared in constant time).
    pub fn csrf_matches(&self, presented: &str) -> bool {
        !presented.is_empty() && token::secrets_equal(presented, &self.csrf)
    }
}

/// A name a person may sign in with: 1 to [`MAX_NAME_CHARS`] characters, no control
/// characters, surrounding spaces trimmed.
pub fn valid_name(name: &str) -> Option<String> {
    let name = name.trim();
    (!name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && !name.chars().any(char::is_control))
    .then(|| name.to_string())
}

/// Reads the session a request presents.
pub fn presented(headers: &HeaderMap, key: &Key, now: Millis) -> Presented {
    let jar = SignedCookieJar::from_headers(headers, key.clone());
    match jar
        .get(SESSION_COOKIE)
        .and_then(|c| Session::decode(c.value()))
    {
        None => Presented::None,
        Some(s) if now >= s.expires_at_ms => Presented::Expired,
        Some(s) => Presented::Valid(s),
    }
}

/// The sign-in form's CSRF token a request presents in its cookie, if it is still valid.
pub fn sign_in_token(headers: &HeaderMap, key: &Key, now: Millis) -> Option<String> {
    let jar = SignedCookieJar::from_headers(headers, key.clone());
    let cookie = jar.get(SIGN_IN_COOKIE)?;
    let (expires, csrf) = cookie.value().split_once('.')?;
    let expires: Millis = expires.parse().ok()?;
    (now < expires).then(|| csrf.to_string())
}

/// Whether the page was reached over TLS: the ledger listens on plain HTTP, so that means a
/// TLS-terminating proxy in front of it that says so (`X-Forwarded-Proto: https` or
/// `Forwarded: proto=https`), or the operator's word (`--inbox-secure-cookies`).
pub fn over_tls(headers: &HeaderMap, always: bool) -> bool {
    let says_https = |name: header::HeaderName, prefix: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split([',', ';'])
                    .any(|part| part.trim().eq_ignore_ascii_case(&format!("{prefix}https")))
            })
        })
    };
    always
        || says_https(header::HeaderName::from_static("x-forwarded-proto"), "")
        || says_https(header::FORWARDED, "proto=")
}

fn cookie(name: &'static str, value: String, max_age_secs: i64, secure: bool) -> Cookie<'static> {
    Cookie::build((name, value))
        .path(COOKIE_PATH)
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(secure)
        .max_age(cookie::time::Duration::seconds(max_age_secs.max(0)))
        .build()
}

/// The cookie of a new session.
pub fn session_cookie(s: &Session, now: Millis, secure: bool) -> Cookie<'static> {
    let secs = s.expires_at_ms.saturating_sub(now) / 1000;
    cookie(SESSION_COOKIE, s.encode(), secs, secure)
}

/// The sign-in form's cookie holding `csrf` until [`SIGN_IN_FORM_MS`] from now.
pub fn sign_in_cookie(csrf: &str, now: Millis, secure: bool) -> Cookie<'static> {
    let value = format!("{}.{csrf}", now.saturating_add(SIGN_IN_FORM_MS));
    cookie(SIGN_IN_COOKIE, value, SIGN_IN_FORM_MS / 1000, secure)
}

/// A cookie that removes `name` from the browser.
pub fn removal(name: &'static str, secure: bool) -> Cookie<'static> {
    cookie(name, String::new(), 0, secure)
}

/// Signs cookies for a response.
pub fn jar(key: &Key, cookies: Vec<Cookie<'static>>) -> SignedCookieJar {
    cookies
        .into_iter()
        .fold(SignedCookieJar::new(key.clone()), |jar, c| jar.add(c))
}

/// A setting's span (a session's life, how long an attempt waits) in the store's milliseconds.
pub fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    /// What a browser sends back after a response that set `c` through a signed jar.
    fn signed(key: &Key, c: Cookie<'static>) -> HeaderMap {
        use axum::response::IntoResponse;
        let resp = SignedCookieJar::new(key.clone()).add(c).into_response();
        let raw: Vec<String> = resp
            .headers()
            .get_all(header::SET_COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().split(';').next().unwrap().to_string())
            .collect();
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&raw.join("; ")).unwrap(),
        );
        h
    }

    #[test]
    fn a_session_reads_back_until_it_expires() {
        let key = key("service-token").unwrap();
        let s = Session {
            name: "Ana Müller".into(),
            admin: "ana@example.org".into(),
            credential: "c4ed".into(),
            id: "5e551011".into(),
            csrf: "c0ffee".into(),
            expires_at_ms: 1_000,
        };
        let h = signed(&key, session_cookie(&s, 0, false));
        assert_eq!(presented(&h, &key, 999), Presented::Valid(s.clone()));
        assert_eq!(presented(&h, &key, 1_000), Presented::Expired);
        // Another service token's key does not accept it.
        let other = super::key("another-service-token").unwrap();
        assert_eq!(presented(&h, &other, 0), Presented::None);
        // Nor does an unsigned cookie of the same name.
        let mut forged = HeaderMap::new();
        forged.insert(
            header::COOKIE,
            HeaderValue::from_static("atmost_session=99999999999999.c0ffee.5e551011.6576696c"),
        );
        assert_eq!(presented(&forged, &key, 0), Presented::None);
        assert!(s.csrf_matches("c0ffee"));
        assert!(!s.csrf_matches("c0ffef") && !s.csrf_matches(""));
    }

    #[test]
    fn the_stored_hash_binds_the_admin_its_credential_and_the_name() {
        let s = Session {
            name: "Ana".into(),
            admin: "ana".into(),
            credential: "c4ed".into(),
            id: "5e551011".into(),
            csrf: "c0ffee".into(),
            expires_at_ms: 1_000,
        };
        for altered in [
            Session {
                admin: "bob".into(),
                ..s.clone()
            },
            Session {
                credential: "c4ee".into(),
                ..s.clone()
            },
            Session {
                name: "Bob".into(),
                ..s.clone()
            },
            Session {
                id: "5e551012".into(),
                ..s.clone()
            },
        ] {
            assert_ne!(altered.id_hash(), s.id_hash(), "{altered:?}");
        }
        // The CSRF token and the expiry are not the session's identity.
        let same = Session {
            csrf: "other".into(),
            expires_at_ms: 2_000,
            ..s.clone()
        };
        assert_eq!(same.id_hash(), s.id_hash());
    }

    #[test]
    fn cookies_are_http_only_strict_and_secure_over_tls() {
        let s = Session {
            name: "n".into(),
            admin: "admin".into(),
            credential: "c".into(),
            id: "i".into(),
            csrf: "c".into(),
            expires_at_ms: 3_600_000,
        };
        let c = session_cookie(&s, 0, true);
        assert_eq!(c.http_only(), Some(true));
        assert_eq!(c.same_site(), Some(SameSite::Strict));
        assert_eq!(c.secure(), Some(true));
        assert_eq!(c.path(), Some(COOKIE_PATH));
        assert_eq!(c.max_age(), Some(cookie::time::Duration::seconds(3600)));
        assert_eq!(session_cookie(&s, 0, false).secure(), Some(false));
        let mut h = HeaderMap::new();
        assert!(!over_tls(&h, false));
        assert!(over_tls(&h, true));
        h.insert("x-forwarded-proto", HeaderValue::from_static("HTTPS"));
        assert!(over_tls(&h, false));
        let mut h = HeaderMap::new();
        h.insert(
            header::FORWARDED,
            HeaderValue::from_static("for=1.2.3.4;proto=https"),
        );
        assert!(over_tls(&h, false));
        h.insert(header::FORWARDED, HeaderValue::from_static("proto=http"));
        assert!(!over_tls(&h, false));
    }

    #[test]
    fn the_sign_in_token_expires() {
        let key = key("service-token").unwrap();
        let h = signed(&key, sign_in_cookie("abc", 0, false));
        assert_eq!(sign_in_token(&h, &key, 1).as_deref(), Some("abc"));
        assert_eq!(sign_in_token(&h, &key, SIGN_IN_FORM_MS), None);
    }

    #[test]
    fn names() {
        assert_eq!(valid_name("  ops on call ").as_deref(), Some("ops on call"));
        assert_eq!(valid_name(""), None);
        assert_eq!(valid_name("a\u{7}b"), None);
        assert_eq!(valid_name(&"x".repeat(MAX_NAME_CHARS + 1)), None);
    }
}
