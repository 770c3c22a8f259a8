//! Credential custody over HTTP (docs/ledger.md#credentials): the admin API registers and
//! lists credentials, the filter's API hands the newest version of a permit's credential to
//! the filter, in a Dispatch answer or on `POST /v1/credential`. The secret is opened only for
//! those two answers and appears in no other answer, no log line and no metric.

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::access::{bad_request, error_response, internal, permit_of};
use crate::state::{AppState, Shared};
use atmost_ledger::credentials::{CredentialSpec, CredentialUse, CredentialView, StoredCredential};
use atmost_ledger::error::LedgerError;
use atmost_ledger::{decide, token};
use atmost_protocol::credential::{CredentialRequest, CredentialResponse, UpstreamCredential};
use atmost_protocol::ledger_error::LedgerErrorCode;

/// Answer of `PUT /admin/v1/credentials/{name}` and element of the list: never the secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialResponseBody {
    pub credential: CredentialView,
}

/// Answer of `GET /admin/v1/credentials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialListResponse {
    pub credentials: Vec<CredentialView>,
}

fn no_key() -> Response {
    error_response(
        LedgerErrorCode::CredentialKeyUnset,
        Some(
            "this ledger was started without a credential key (--credential-key-file or \
             ATMOST_CREDENTIAL_KEY): it keeps no credentials"
                .into(),
        ),
    )
}

/// The credential the permit `permit_id` names, if any, as the store holds it now.
async fn named_by(
    state: &AppState,
    permit_id: &str,
) -> Result<Option<StoredCredential>, LedgerError> {
    let name = match state.custody.name_of(permit_id) {
        Some(name) => name,
        None => {
            let Some(permit) = state.store.get_permit(permit_id).await? else {
                return Ok(None);
            };
            let name = permit.policy.rules.credential.clone();
            state.custody.remember(permit_id, name.clone());
            name
        }
    };
    let Some(name) = name else {
        return Ok(None);
    };
    match state.store.credential(&name).await? {
        Some(c) => Ok(Some(c)),
        None => Err(LedgerError::Invariant(format!(
            "permit {permit_id} names credential {name:?}, which the store does not hold"
        ))),
    }
}

/// The credential a dispatch under the permit the token names would carry, opened: read
/// before the decision, so a credential that cannot be sent (no key, another key, altered)
/// fails the authorize before anything is reserved.
pub async fn for_dispatch(
    state: &AppState,
    permit_token: &str,
) -> Result<Option<(CredentialUse, UpstreamCredential)>, LedgerError> {
    let Some(permit_id) = token::permit_id_of(permit_token) else {
        return Ok(None);
    };
    let Some(stored) = named_by(state, permit_id).await? else {
        return Ok(None);
    };
    let key = state.config.credential_key.as_ref().ok_or_else(|| {
        LedgerError::Invalid(format!(
            "permit {permit_id} names credential {:?} and this ledger has no credential key",
            stored.name
        ))
    })?;
    Ok(Some((stored.use_ref(), key.open(&stored)?)))
}

/// `PUT /admin/v1/credentials/{name}`: registers the credential, or rotates it (a new
/// version, which the next dispatch carries). 201 for a new name, 200 for a rotation.
pub async fn put_credential(
    State(state): State<Shared>,
    Path(name): Path<String>,
    body: Result<Json<CredentialSpec>, JsonRejection>,
) -> Response {
    let Some(key) = state.config.credential_key.as_ref() else {
        return no_key();
    };
    let spec = match body {
        // A rejection's text may quote the body, and so the secret: never passed on.
        Err(_) => {
            return bad_request(
                "the body must be JSON {\"header\", \"form\": \"bearer\"|\"raw\", \"routes\", \
                 \"secret\"} and nothing else",
            )
        }
        Ok(Json(spec)) => match spec.validate(&name) {
            Ok(spec) => spec,
            Err(why) => return bad_request(why),
        },
    };
    let sealed = match key.seal(&name, &spec) {
        Ok(s) => s,
        Err(e) => return internal(&state, "seal_credential", &e),
    };
    let row = StoredCredential {
        name: name.clone(),
        version: 0,
        header: spec.header.clone(),
        form: spec.form,
        routes: spec.routes.clone(),
        sealed: Some(sealed),
        created_at_ms: state.clock.now_ms(),
    };
    let stored = match state.store.put_credential(&row).await {
        Ok(s) => s,
        Err(e) => return internal(&state, "put_credential", &e),
    };
    info!(credential = %stored.name, version = stored.version, header = %stored.header,
        routes = %stored.routes.join(","), "credential registered");
    let status = if stored.version == 1 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let credential = CredentialView::from(&stored);
    (status, Json(CredentialResponseBody { credential })).into_response()
}

/// `GET /admin/v1/credentials`: the newest version of each, without secrets.
pub async fn list_credentials(State(state): State<Shared>) -> Response {
    match state.store.credentials().await {
        Ok(list) => Json(CredentialListResponse {
            credentials: list.iter().map(CredentialView::from).collect(),
        })
        .into_response(),
        Err(e) => internal(&state, "list_credentials", &e),
    }
}

/// Whether a permit may name the credential `name` (`POST /admin/v1/permits`): it must be
/// registered. `Err` is the answer to send.
pub async fn check_named(state: &AppState, name: &str) -> Result<(), Response> {
    if state.config.credential_key.is_none() {
        return Err(no_key());
    }
    match state.store.credential(name).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(bad_request(format!(
            "no credential is registered as {name:?} (atmost credential set)"
        ))),
        Err(e) => Err(internal(state, "check_credential", &e)),
    }
}

/// `POST /v1/credential`: the credential of the permit the token names, for the filter's
/// requests of a session other than a dispatched `tools/call`. 403 `permit_invalid` unless the
/// token authenticates for a permit that has not expired.
pub async fn fetch(
    State(state): State<Shared>,
    body: Result<Json<CredentialRequest>, JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(req)) => req,
        Err(_) => return bad_request("the body must be JSON {\"permit_token\"}"),
    };
    let now = state.clock.now_ms();
    let permit_id = token::permit_id_of(&req.permit_token);
    let permit = match permit_of(&state, &req.permit_token).await {
        Ok(p) => p,
        Err(e) => return internal(&state, "credential", &e),
    };
    let live = decide::authenticate(&req.permit_token, permit.as_ref())
        .filter(|p| now < p.expires_at_ms)
        .is_some();
    let permit_id = permit_id.unwrap_or("-");
    if !live {
        let code = LedgerErrorCode::PermitInvalid;
        info!(permit_id, code = code.as_str(), "credential refused");
        return error_response(code, None);
    }
    match for_dispatch(&state, &req.permit_token).await {
        Ok(found) => {
            let credential = found.map(|(used, c)| {
                info!(permit_id, credential = %used.name, version = used.version, "credential");
                c
            });
            (StatusCode::OK, Json(CredentialResponse { credential })).into_response()
        }
        Err(e) => {
            warn!(permit_id, "credential fetch failed");
            internal(&state, "credential", &e)
        }
    }
}
