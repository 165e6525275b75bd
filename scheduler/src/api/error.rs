//! The one shape of every error the API returns, whatever failed (a field of a submission, a query
//! parameter, a path segment, the token, a body over its limit, an unknown route):
//! `{"error": {"field": "job.width", "message": "..."}}`. `field` names what to fix: a dotted path
//! into the request, a query or path parameter, a header (`authorization`, `content-type`), `body`
//! for the request body as a whole, or `.` when nothing in the request is at fault (the farm is
//! unavailable).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use vnfarm_proto::http::{ErrorBody, ErrorDetail};

/// An error answered to a client. Build it with the constructor of its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub field: String,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status,
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn bad_request(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, field, message)
    }

    pub fn not_found(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, field, message)
    }

    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, field, message)
    }

    /// The farm (broker or storage) cannot serve this now; the client may retry.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, ".", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                field: self.field,
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// Answers routes that do not exist in the same shape as every other error.
pub async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found("path", format!("no route {}", uri.path()))
}

/// Answers a known path asked with a method it does not take.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method",
        format!("{} does not take {method}", uri.path()),
    )
}
