//! Images for browsers: signed links to outputs and inputs, the objects behind them, thumbnails.
//!
//! A job's view carries, for each output, a `url` and a `thumbnail_url` signed by the scheduler
//! ([`UrlSigner`](super::auth::UrlSigner)), so `<img src>` works without the token. Behind the
//! `url`, storage decides: an S3 bucket answers with a redirect to a presigned URL of the object
//! (the browser fetches the bytes from S3, not through the scheduler); a local directory is
//! streamed by the scheduler. Thumbnails (JPEG, at most 320 px a side) are made on first request
//! on a blocking thread and kept in storage under `thumbnails/`.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use vnfarm_storage::StorageError;

use super::Api;
use super::auth::Signed;
use super::error::ApiError;
use super::extract::{Path, Query};
use crate::images;

/// Where a browser fetches one image.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageLinks {
    /// The object's key in storage (`results/<job>/<n>.png`, `inputs/<sha256>.<ext>`).
    pub key: String,
    /// The image, relative to the API's base URL; signed, valid for `url_ttl_s`. With S3 storage
    /// it redirects to a presigned URL of the bucket.
    pub url: String,
    /// A JPEG of at most 320 pixels a side, relative and signed like `url`.
    pub thumbnail_url: String,
}

impl Api {
    /// Signed links to the images stored under `keys`.
    pub fn image_links(&self, keys: &[String]) -> Vec<ImageLinks> {
        keys.iter()
            .map(|key| ImageLinks {
                key: key.clone(),
                url: self.signer.sign(&format!("/v1/files/{key}")),
                thumbnail_url: self.signer.sign(&format!("/v1/thumbnails/{key}")),
            })
            .collect()
    }
}

/// Only images the farm made or accepted are served.
fn check_servable(key: &str) -> Result<(), ApiError> {
    let image = [".png", ".jpg", ".webp"]
        .iter()
        .any(|ext| key.ends_with(ext));
    if !(key.starts_with("results/") || key.starts_with("inputs/")) || !image {
        return Err(ApiError::not_found(
            "key",
            format!("{key:?} is not an image under results/ or inputs/"),
        ));
    }
    Ok(())
}

fn content_type(key: &str) -> &'static str {
    if key.ends_with(".jpg") {
        "image/jpeg"
    } else if key.ends_with(".webp") {
        "image/webp"
    } else {
        "image/png"
    }
}

fn storage_error(api: &Api, op: &'static str, e: StorageError) -> ApiError {
    match e {
        StorageError::NotFound { key } => ApiError::not_found("key", format!("{key} not found")),
        StorageError::InvalidKey { key, reason } => {
            ApiError::bad_request("key", format!("{key:?}: {reason}"))
        }
        e @ StorageError::Unavailable { .. } => {
            api.scheduler.metrics().storage_error(op, &e);
            ApiError::unavailable(e.to_string())
        }
    }
}

/// How long a browser may cache what a signed URL returned: objects under a key do not change
/// (a re-run writes the same image), but the URL's signature expires.
fn cache_control(api: &Api) -> String {
    format!("private, max-age={}", api.signer.ttl().as_secs())
}

/// `GET /v1/files/{key}` (signed).
pub async fn file(
    State(api): State<Api>,
    Path(key): Path<String>,
    Query(signed): Query<Signed>,
) -> Result<Response, ApiError> {
    api.signer.verify(&format!("/v1/files/{key}"), &signed)?;
    check_servable(&key)?;
    let presigned = api
        .scheduler
        .storage()
        .presigned_get(&key, api.signer.ttl())
        .await
        .map_err(|e| storage_error(&api, "presign", e))?;
    if let Some(url) = presigned {
        return Ok((StatusCode::FOUND, [(header::LOCATION, url)]).into_response());
    }
    let bytes = api
        .scheduler
        .storage()
        .get(&key)
        .await
        .map_err(|e| storage_error(&api, "get", e))?;
    Ok((
        [
            (header::CONTENT_TYPE, content_type(&key).to_owned()),
            (header::CACHE_CONTROL, cache_control(&api)),
        ],
        bytes,
    )
        .into_response())
}

/// `GET /v1/thumbnails/{key}` (signed).
pub async fn thumbnail(
    State(api): State<Api>,
    Path(key): Path<String>,
    Query(signed): Query<Signed>,
) -> Result<Response, ApiError> {
    api.signer
        .verify(&format!("/v1/thumbnails/{key}"), &signed)?;
    check_servable(&key)?;
    let storage = api.scheduler.storage();
    let cached = format!("thumbnails/{key}.jpg");
    let bytes = match storage.get(&cached).await {
        Ok(bytes) => bytes,
        Err(StorageError::NotFound { .. }) => {
            let original = storage
                .get(&key)
                .await
                .map_err(|e| storage_error(&api, "get", e))?;
            let small = tokio::task::spawn_blocking(move || images::thumbnail(&original))
                .await
                .map_err(|e| ApiError::unavailable(format!("the thumbnail task failed: {e}")))?
                .map_err(|e| {
                    ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "key",
                        format!("{key} does not decode: {e}"),
                    )
                })?;
            let small = Bytes::from(small);
            // The thumbnail is served either way; a failed store only means it is made again.
            if let Err(e) = storage.put(&cached, small.clone(), "image/jpeg").await {
                api.scheduler.metrics().storage_error("put", &e);
                tracing::warn!(key = %cached, error = %e, "thumbnail not kept");
            }
            small
        }
        Err(e) => return Err(storage_error(&api, "get", e)),
    };
    Ok((
        [
            (header::CONTENT_TYPE, "image/jpeg".to_owned()),
            (header::CACHE_CONTROL, cache_control(&api)),
        ],
        bytes,
    )
        .into_response())
}

/// The local-directory mode, through the router: signed URLs stream the file, thumbnails are made
/// and kept, uploads land under `inputs/`. (The S3 mode is the e2e test `web`, against s3s-fs.)
#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use tokio_util::sync::CancellationToken;
    use tower::ServiceExt;
    use vnfarm_storage::{Storage, StorageConfig};

    use crate::api::router;
    use crate::metrics::Metrics;
    use crate::{Config, Scheduler};
    use vnfarm_proto::http::ErrorBody;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 9]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    async fn get(app: &axum::Router, uri: &str) -> (StatusCode, String, bytes::Bytes) {
        let response = app
            .clone()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let media = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, media, body)
    }

    #[tokio::test]
    async fn local_storage_is_reachable_by_signed_urls() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(&StorageConfig::Local {
            root: dir.path().to_path_buf(),
        })
        .await
        .unwrap();
        let config = Config::load(
            None,
            [("VNFARM_API_TOKEN".to_owned(), "0123456789abcdef".to_owned())],
        )
        .unwrap();
        let scheduler = Scheduler::new(
            config,
            storage.clone(),
            Metrics::new(),
            CancellationToken::new(),
        );
        let app = router(scheduler);
        let image = png(640, 400);
        storage
            .put(
                "results/j/0.png",
                bytes::Bytes::from(image.clone()),
                "image/png",
            )
            .await
            .unwrap();
        let signer = super::super::auth::UrlSigner::new(
            Some("0123456789abcdef"),
            std::time::Duration::from_secs(60),
        );
        let (status, media, body) = get(&app, &signer.sign("/v1/files/results/j/0.png")).await;
        assert_eq!((status, media.as_str()), (StatusCode::OK, "image/png"));
        assert_eq!(body.as_ref(), image.as_slice());
        let (status, media, body) = get(&app, &signer.sign("/v1/thumbnails/results/j/0.png")).await;
        assert_eq!((status, media.as_str()), (StatusCode::OK, "image/jpeg"));
        let thumb = image::load_from_memory(&body).unwrap();
        assert_eq!((thumb.width(), thumb.height()), (320, 200));
        assert!(
            dir.path().join("thumbnails/results/j/0.png.jpg").exists(),
            "kept"
        );
        // Another object's signature, a missing object, a key outside results/ and inputs/.
        let forged = signer
            .sign("/v1/files/results/j/0.png")
            .replace("/0.png", "/1.png");
        let (status, _, body) = get(&app, &forged).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let error: ErrorBody = serde_json::from_slice(&body).unwrap();
        assert_eq!(error.error.field, "signature");
        let (status, _, _) = get(&app, &signer.sign("/v1/files/results/j/1.png")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _, _) = get(&app, &signer.sign("/v1/files/snapshots/x.png")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);

        // An upload with the token lands under inputs/ and is served by its signed URL.
        let request = |token: &str| {
            Request::post("/v1/uploads")
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .header(header::CONTENT_TYPE, "image/png")
                .body(Body::from(png(64, 48)))
                .unwrap()
        };
        let refused = app
            .clone()
            .oneshot(request("fedcba9876543210"))
            .await
            .unwrap();
        // Not the configured token: before its stream is read, this scheduler cannot tell it from
        // a person's, so it asks for a retry rather than refusing a token it may take later.
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        let response = app
            .clone()
            .oneshot(request("0123456789abcdef"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let upload: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let key = upload["key"].as_str().unwrap();
        assert!(
            key.starts_with("inputs/") && key.ends_with(".png"),
            "{upload}"
        );
        assert!(dir.path().join(key).exists());
        let (status, _, body) = get(&app, upload["url"].as_str().unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(image::load_from_memory(&body).unwrap().width(), 64);
    }
}
