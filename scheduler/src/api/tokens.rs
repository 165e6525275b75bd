//! People's tokens as resources (permission `tokens`, an admin's): create one (the token is in
//! that answer only), list them (never the tokens), revoke one. See [`crate::tokens`].

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use vnfarm_proto::decode_json;
use vnfarm_proto::http::{CreatedToken, RevokedToken, TokenList, TokenRequest, TokenView};
use vnfarm_proto::people::check_name;

use super::Api;
use super::auth::Caller;
use super::error::ApiError;
use super::extract::{Body, Path};
use crate::tokens::TokenError;

fn answer(e: TokenError) -> ApiError {
    match e {
        TokenError::Taken(_) => ApiError::new(StatusCode::CONFLICT, "name", e.to_string()),
        TokenError::NotFound(_) => ApiError::not_found("name", e.to_string()),
        TokenError::Unavailable(_) => ApiError::unavailable(e.to_string()),
    }
}

pub async fn create(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let request: TokenRequest =
        decode_json(&body).map_err(|e| ApiError::invalid(e.field, e.message))?;
    check_name(&request.name).map_err(|m| ApiError::invalid("name", m))?;
    let made = api
        .scheduler
        .create_token(&request.name, request.role, caller.name())
        .await
        .map_err(answer)?;
    tracing::info!(person = %request.name, role = %request.role, by = caller.name(), "token created");
    Ok((
        StatusCode::CREATED,
        [(header::CACHE_CONTROL, "no-store")],
        Json(CreatedToken {
            name: request.name,
            role: request.role,
            token: made.token,
            created_at: made.created_at,
        }),
    )
        .into_response())
}

pub async fn list(State(api): State<Api>) -> Json<TokenList> {
    let reg = api.scheduler.registry();
    let tokens = reg
        .people()
        .iter()
        .map(|(name, p)| TokenView {
            name: name.to_owned(),
            role: p.role(),
            created_at: p.created_at(),
            created_by: p.created_by().to_owned(),
            revoked_at: p.revoked_at(),
        })
        .collect();
    Json(TokenList { tokens })
}

pub async fn revoke(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<RevokedToken>, ApiError> {
    let revoked_at = api
        .scheduler
        .revoke_token(&name, caller.name())
        .await
        .map_err(answer)?;
    tracing::info!(person = %name, by = caller.name(), "token revoked");
    Ok(Json(RevokedToken { name, revoked_at }))
}
