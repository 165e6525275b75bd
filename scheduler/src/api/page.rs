//! The web page: plain HTML, JavaScript and CSS compiled into the binary (no build step), served
//! without the token (it holds no data; it asks for the token when the API wants one).

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../../web/index.html");
const SCRIPT: &str = include_str!("../../web/app.js");
const STYLE: &str = include_str!("../../web/app.css");

/// Images may come from the bucket's own origin (presigned URLs), everything else from here.
const POLICY: &str = "default-src 'self'; img-src 'self' data: blob: http: https:; \
                      connect-src 'self'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}
