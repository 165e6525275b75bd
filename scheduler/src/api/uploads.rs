//! `POST /v1/uploads`: an input image, as the raw body (`Content-Type: image/png`, `image/jpeg`,
//! `image/webp` or `application/octet-stream`) or as the `file` field of a `multipart/form-data`
//! form. It is verified by decoding it within the size and pixel limits and stored under `inputs/`
//! by its sha256; the answer's `image` is the reference an edit or upscale takes as its input.

use axum::Json;
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{StatusCode, header};
use schemars::JsonSchema;
use serde::Serialize;
use vnfarm_proto::ImageRef;

use super::Api;
use super::error::ApiError;
use super::extract::Body;
use super::files::ImageLinks;
use crate::images::InputFormat;
use crate::intake::InputError;

/// A stored input image.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Upload {
    /// What an edit's `input`/`inputs` or an upscale's `input` takes: `{"stored": "inputs/..."}`.
    pub image: ImageRef,
    /// Hex sha256 of the bytes.
    pub sha256: String,
    pub format: InputFormat,
    pub width: u32,
    pub height: u32,
    /// Size of the file in bytes.
    pub bytes: usize,
    /// `key` (`inputs/<sha256>.<ext>`) and where a browser fetches it.
    #[serde(flatten)]
    pub links: ImageLinks,
}

/// The image bytes of a raw or multipart body.
async fn image_bytes(api: &Api, request: Request) -> Result<bytes::Bytes, ApiError> {
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if content_type.starts_with("multipart/form-data") {
        let mut form = Multipart::from_request(request, api)
            .await
            .map_err(|e| ApiError::new(e.status(), "body", e.body_text()))?;
        while let Some(field) = form
            .next_field()
            .await
            .map_err(|e| ApiError::new(e.status(), "file", e.body_text()))?
        {
            if field.name() == Some("file") {
                return field
                    .bytes()
                    .await
                    .map_err(|e| ApiError::new(e.status(), "file", e.body_text()));
            }
        }
        return Err(ApiError::bad_request(
            "file",
            "the form has no `file` field with the image",
        ));
    }
    let raw = [
        "image/png",
        "image/jpeg",
        "image/webp",
        "application/octet-stream",
    ];
    if !raw.iter().any(|t| content_type.starts_with(t)) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type",
            format!(
                "{content_type:?}: send the image as the body ({}) or as the `file` field of multipart/form-data",
                raw.join(", ")
            ),
        ));
    }
    let Body(bytes) = Body::from_request(request, api).await?;
    Ok(bytes)
}

pub async fn upload(
    State(api): State<Api>,
    request: Request,
) -> Result<(StatusCode, Json<Upload>), ApiError> {
    let bytes = image_bytes(&api, request).await?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request("file", "the image is empty"));
    }
    let limits = api.scheduler.input_limits();
    let stored = match api.scheduler.store_input(bytes, limits).await {
        Ok(stored) => stored,
        Err(InputError::Invalid(message)) => return Err(ApiError::invalid("file", message)),
        Err(InputError::Unavailable(message)) => return Err(ApiError::unavailable(message)),
    };
    let links = api
        .image_links(std::slice::from_ref(&stored.key))
        .pop()
        .expect("one key, one link");
    Ok((
        StatusCode::CREATED,
        Json(Upload {
            image: ImageRef::Stored(stored.key),
            sha256: stored.sha256,
            format: stored.image.format,
            width: stored.image.width,
            height: stored.image.height,
            bytes: stored.size,
            links,
        }),
    ))
}
