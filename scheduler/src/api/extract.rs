//! Extractors whose rejections are [`ApiError`]s naming the field: path parameters, query strings
//! decoded strictly (unknown parameters refused), request bodies within their route's size limit.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Path parameters decoded as `T` (handlers parse ids themselves, to name the parameter); a path
/// that does not decode at all (bad percent-encoding) is refused naming `path`.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| ApiError::new(e.status(), "path", e.body_text()))
    }
}

/// A query string decoded as `T`; the error names the parameter.
#[derive(Debug)]
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        decode_query(parts.uri.query().unwrap_or("")).map(Query)
    }
}

/// Decodes a query string strictly; the error names the parameter at fault.
pub fn decode_query<T: DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // An unknown or missing parameter fails outside any field: its name is in the message.
        let named = ["unknown field `", "missing field `"]
            .iter()
            .find_map(|prefix| message.strip_prefix(prefix));
        let field = match named {
            Some(rest) if path == "." => rest.split('`').next().unwrap_or(".").to_owned(),
            _ => path,
        };
        ApiError::bad_request(field, message)
    })
}

/// The request body, refused with 413 (field `body`) beyond the route's `DefaultBodyLimit`.
#[derive(Debug)]
pub struct Body(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(request, state)
            .await
            .map(Body)
            .map_err(|e| {
                let status = e.status();
                if status == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::new(
                        status,
                        "body",
                        "the request body is larger than this route takes",
                    )
                } else {
                    ApiError::new(status, "body", e.body_text())
                }
            })
    }
}
