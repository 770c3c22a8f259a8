//! Signing in and out of the inbox, and the gate every other page passes: a signed-in
//! session, and for a form that changes state, the session's CSRF token.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use axum_extra::extract::cookie::Key;
use serde::Deserialize;
use tracing::{error, info, warn};

use super::pages::{html, key_failed, message, store_failed, Nav, SignInPage};
use super::session::{self, Presented, Session};
use crate::access::{failed_authentication, Peer};
use crate::auth_limit::Verdict;
use crate::state::{AppState, Shared};
use atmost_ledger::clock;
use atmost_ledger::token;

/// The sign-in and sign-out routes (merged into the inbox's).
pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/admin/sign-in", get(sign_in_page).post(sign_in))
        .route("/admin/sign-out", post(sign_out))
}

fn session_key(state: &AppState) -> Option<Key> {
    let key = session::key(&state.config.service_token);
    if key.is_none() {
        error!(bug = true, "inbox: no session key could be derived");
    }
    key
}

/// The sign-in page, with a fresh CSRF token for its form (and the cookie that holds it).
pub(super) fn sign_in_form(
    state: &AppState,
    headers: &HeaderMap,
    status: StatusCode,
    message: Option<&str>,
    name: &str,
) -> Response {
    let Some(key) = session_key(state) else {
        return key_failed();
    };
    let csrf = match token::random_hex(32) {
        Ok(c) => c,
        Err(e) => return store_failed(state, "random", &e),
    };
    let secure = session::over_tls(headers, state.config.inbox.secure_cookies);
    let now = state.clock.now_ms();
    let jar = session::jar(&key, vec![session::sign_in_cookie(&csrf, now, secure)]);
    let page = SignInPage {
        nav: None,
        message: message.map(str::to_string),
        csrf,
        name: name.to_string(),
    };
    (jar, html(status, &page)).into_response()
}

/// The signed-in session of a request, or the response that refuses it: the sign-in page
/// (HTTP 401), saying so when the session has expired or was ended. (The refusal is the
/// response itself, returned at once by the handler; boxing it would buy nothing.)
#[allow(clippy::result_large_err)]
pub(super) async fn signed_in(state: &AppState, headers: &HeaderMap) -> Result<Session, Response> {
    let Some(key) = session_key(state) else {
        return Err(key_failed());
    };
    let now = state.clock.now_ms();
    match session::presented(headers, &key, now) {
        Presented::Valid(s) if !admin_holds(state, &s) => {
            warn!(by = %s.name, admin = %s.admin,
                "inbox: session refused: its admin was removed or holds another token now");
            Err(sign_in_form(
                state,
                headers,
                StatusCode::UNAUTHORIZED,
                Some("Your session has ended: the admin token it was signed in with is no longer in force. Sign in again."),
                "",
            ))
        }
        Presented::Valid(s) => match state.store.inbox_session_open(&s.id_hash(), now).await {
            Ok(true) => Ok(s),
            Ok(false) => Err(sign_in_form(
                state,
                headers,
                StatusCode::UNAUTHORIZED,
                Some("Your session has ended: it was signed out or revoked. Sign in again."),
                "",
            )),
            Err(e) => Err(store_failed(state, "inbox_session", &e)),
        },
        Presented::Expired => Err(sign_in_form(
            state,
            headers,
            StatusCode::UNAUTHORIZED,
            Some("Your session has expired. Sign in again."),
            "",
        )),
        Presented::None => Err(sign_in_form(
            state,
            headers,
            StatusCode::UNAUTHORIZED,
            None,
            "",
        )),
    }
}

/// Whether the admin a session was signed in with still holds the token it was signed in
/// with (crate::admins: the tokens file may have changed since).
fn admin_holds(state: &AppState, s: &Session) -> bool {
    state
        .config
        .admins
        .credential_of(&s.admin)
        .is_some_and(|credential| credential == s.credential)
}

async fn sign_in_page(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(key) = session_key(&state) {
        let now = state.clock.now_ms();
        if let Presented::Valid(s) = session::presented(&headers, &key, now) {
            if !admin_holds(&state, &s) {
                return sign_in_form(&state, &headers, StatusCode::OK, None, "");
            }
            if let Ok(true) = state.store.inbox_session_open(&s.id_hash(), now).await {
                return Redirect::to("/admin/").into_response();
            }
        }
    }
    sign_in_form(&state, &headers, StatusCode::OK, None, "")
}

#[derive(Debug, Deserialize)]
struct SignInForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    token: String,
    #[serde(default)]
    csrf: String,
}

async fn sign_in(
    State(state): State<Shared>,
    Peer(peer): Peer,
    headers: HeaderMap,
    Form(form): Form<SignInForm>,
) -> Response {
    let Some(key) = session_key(&state) else {
        return key_failed();
    };
    let now = state.clock.now_ms();
    let form_ok = session::sign_in_token(&headers, &key, now)
        .is_some_and(|t| !form.csrf.is_empty() && token::secrets_equal(&form.csrf, &t));
    if !form_ok {
        warn!("inbox: sign-in refused: the form's CSRF token is missing, wrong or expired");
        return sign_in_form(
            &state,
            &headers,
            StatusCode::FORBIDDEN,
            Some("This sign-in form has expired or was not sent from this page. Try again."),
            &form.name,
        );
    }
    let admin = if form.token.is_empty() {
        None
    } else {
        state.config.admins.authenticate(&form.token)
    };
    let Some(admin) = admin else {
        warn!("inbox: sign-in refused: wrong admin token");
        return match failed_authentication(&state, "inbox", peer) {
            Verdict::Refuse => sign_in_form(
                &state,
                &headers,
                StatusCode::UNAUTHORIZED,
                Some("That is not the admin token."),
                &form.name,
            ),
            Verdict::TooMany { retry_after_s } => {
                let mut page = sign_in_form(
                    &state,
                    &headers,
                    StatusCode::TOO_MANY_REQUESTS,
                    Some(&format!(
                        "Too many failed sign-ins from this address. Try again in {retry_after_s} seconds."
                    )),
                    &form.name,
                );
                page.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
                page
            }
        };
    };
    // A named admin's token says who signs in; the shared --admin-token does not, so its
    // holder says it.
    let name = if admin.shared {
        session::valid_name(&form.name)
    } else {
        Some(admin.name.clone())
    };
    let Some(name) = name else {
        return sign_in_form(
            &state,
            &headers,
            StatusCode::BAD_REQUEST,
            Some("Give your name (1 to 64 characters): it is recorded with what you resolve."),
            "",
        );
    };
    let (csrf, id) = match (token::random_hex(32), token::random_hex(32)) {
        (Ok(c), Ok(i)) => (c, i),
        (Err(e), _) | (_, Err(e)) => return store_failed(&state, "random", &e),
    };
    let s = Session {
        name,
        admin: admin.name,
        credential: admin.credential,
        id,
        csrf,
        expires_at_ms: now.saturating_add(session::millis(state.config.inbox.session_ttl)),
    };
    if let Err(e) = state
        .store
        .open_inbox_session(&s.id_hash(), now, s.expires_at_ms)
        .await
    {
        return store_failed(&state, "inbox_session", &e);
    }
    let secure = session::over_tls(&headers, state.config.inbox.secure_cookies);
    info!(by = %s.name, admin = %s.admin, expires_at = %clock::rfc3339(s.expires_at_ms),
        "inbox: signed in");
    let jar = session::jar(
        &key,
        vec![
            session::session_cookie(&s, now, secure),
            session::removal(session::SIGN_IN_COOKIE, secure),
        ],
    );
    (jar, Redirect::to("/admin/")).into_response()
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// The session of a form that changes state, or the refusal: the sign-in page (HTTP 401)
/// without a valid session, HTTP 403 when the form does not carry the session's CSRF token.
#[allow(clippy::result_large_err)]
pub(super) async fn signed_in_form(
    state: &AppState,
    headers: &HeaderMap,
    csrf: &str,
) -> Result<Session, Response> {
    let s = signed_in(state, headers).await?;
    if s.csrf_matches(csrf) {
        return Ok(s);
    }
    warn!(by = %s.name, admin = %s.admin,
        "inbox: form refused: its CSRF token is missing or not the session's");
    Err(message(
        StatusCode::FORBIDDEN,
        Nav::new("inbox", &s),
        "Refused",
        "This form did not carry this session's CSRF token, so nothing was changed. Reload the page and try again.".into(),
    ))
}

async fn sign_out(
    State(state): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    let s = match signed_in_form(&state, &headers, &form.csrf).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let Some(key) = session_key(&state) else {
        return key_failed();
    };
    // Ended in the store first: the cookie is no good anywhere from now on, even a copy.
    if let Err(e) = state.store.end_inbox_session(&s.id_hash()).await {
        return store_failed(&state, "inbox_session", &e);
    }
    let secure = session::over_tls(&headers, state.config.inbox.secure_cookies);
    info!(by = %s.name, admin = %s.admin, "inbox: signed out");
    let jar = session::jar(
        &key,
        vec![session::removal(session::SESSION_COOKIE, secure)],
    );
    (jar, Redirect::to("/admin/sign-in")).into_response()
}
