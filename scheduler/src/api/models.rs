//! The model catalogue over HTTP (DESIGN §7b): `GET /v1/models` lists its names, and
//! `POST /v1/models/loras?name=N` adds a LoRA under a new name (the page's upload).
//!
//! An upload is the file as the raw body (`application/octet-stream`). It is streamed to a
//! temporary file as it arrives (never held in memory; at most `lora_upload_max_bytes`), then
//! checked: a safetensors header, tensors named as LoRA weights, a catalogue name that is free or
//! already names these very bytes. It is stored by the code `vnfarm models push` runs
//! (`vnfarm_storage::Catalogue::push`: the blob by its sha256, then the entry), so both ways
//! give the same catalogue. A name that points at other bytes is refused (409): an upload adds,
//! it never changes what other people's jobs get; replacing stays with `vnfarm models push`,
//! which needs the bucket's keys.

use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use futures::StreamExt;
use schemars::JsonSchema;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use vnfarm_proto::ModelFileRole;
use vnfarm_proto::catalogue::{CatalogueEntry, ContentHash};
use vnfarm_proto::http::ModelList;
use vnfarm_storage::{Catalogue, CatalogueError};

use super::Api;
use super::error::ApiError;
use super::extract::Query;

/// `POST /v1/models/loras` query.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraUploadQuery {
    /// The catalogue name jobs will give in `loras[].name`: `[A-Za-z0-9._-]`, not starting with
    /// `.` (a `.safetensors` ending is dropped).
    pub name: String,
}

/// `GET /v1/models`.
pub async fn list(State(api): State<Api>) -> Result<Json<ModelList>, ApiError> {
    let catalogue = Catalogue::new(api.scheduler.storage().clone());
    let models = catalogue.list().await.map_err(catalogue_error)?;
    Ok(Json(ModelList { models }))
}

/// `POST /v1/models/loras?name=N`.
pub async fn upload_lora(
    State(api): State<Api>,
    Query(query): Query<LoraUploadQuery>,
    request: Request,
) -> Result<(StatusCode, Json<CatalogueEntry>), ApiError> {
    let name = query
        .name
        .strip_suffix(".safetensors")
        .unwrap_or(&query.name)
        .to_owned();
    if name.is_empty() || !vnfarm_proto::spec::is_file_name(&name) {
        return Err(ApiError::invalid(
            "name",
            format!("{name:?} is not a catalogue name ([A-Za-z0-9._-], not starting with '.')"),
        ));
    }
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if !content_type.starts_with("application/octet-stream") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type",
            format!("{content_type:?}: send the LoRA file as the body (application/octet-stream)"),
        ));
    }
    let max = api.scheduler.config().lora_upload_max_bytes;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(too_large(max));
    }
    let part = TempFile::new();
    let (sha256, size) = receive(request, &part.0, max).await?;
    if size == 0 {
        return Err(ApiError::invalid("file", "the file is empty"));
    }
    check_lora(&part.0).await?;
    let catalogue = Catalogue::new(api.scheduler.storage().clone());
    match catalogue.entry(&name).await.map_err(catalogue_error)? {
        Some(entry) if entry.sha256 == sha256 && entry.role == ModelFileRole::Lora => {
            return Ok((StatusCode::OK, Json(entry)));
        }
        Some(entry) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "name",
                format!(
                    "`{name}` already names another file in the model catalogue (a {}, \
                     sha256:{}); choose another name",
                    entry.role.as_str(),
                    entry.sha256
                ),
            ));
        }
        None => {}
    }
    let entry = catalogue
        .push(&part.0, ModelFileRole::Lora, Some(&name))
        .await
        .map_err(catalogue_error)?;
    tracing::info!(name = entry.name, sha256 = %entry.sha256, size = entry.size, "LoRA uploaded into the model catalogue");
    Ok((StatusCode::CREATED, Json(entry)))
}

/// Streams the body into `path`, hashing it; refused (413) past `max` bytes.
async fn receive(request: Request, path: &Path, max: u64) -> Result<(ContentHash, u64), ApiError> {
    let failed = |e: std::io::Error| {
        tracing::warn!(path = %path.display(), error = %e, "cannot write an uploaded LoRA to a temporary file");
        ApiError::unavailable(format!("cannot keep the upload on the scheduler: {e}"))
    };
    let mut file = tokio::fs::File::create(path).await.map_err(failed)?;
    let mut body = request.into_body().into_data_stream();
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::bad_request("body", format!("the upload broke off: {e}")))?;
        size += chunk.len() as u64;
        if size > max {
            return Err(too_large(max));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(failed)?;
    }
    file.flush().await.map_err(failed)?;
    let sha256 = ContentHash::try_from(hex::encode(hasher.finalize()))
        .expect("a sha256 digest is 64 hex digits");
    Ok((sha256, size))
}

/// Refuses a file that is not a safetensors file of LoRA weights (a checkpoint, an archive).
async fn check_lora(path: &Path) -> Result<(), ApiError> {
    let path = path.to_path_buf();
    let counted = tokio::task::spawn_blocking(move || vnfarm_storage::lora_tensors(&path))
        .await
        .map_err(|e| ApiError::unavailable(format!("the check of the upload failed: {e}")))?;
    match counted {
        Ok(0) => Err(ApiError::invalid(
            "file",
            "the file has no LoRA tensors (names with lora_down/lora_up or lora_A/lora_B); \
             is it a checkpoint? Those are pushed with `vnfarm models push --role checkpoint`",
        )),
        Ok(_) => Ok(()),
        Err(reason) => Err(ApiError::invalid(
            "file",
            format!("not a safetensors file: {reason}"),
        )),
    }
}

fn too_large(max: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body",
        format!("the file is larger than lora_upload_max_bytes ({max} bytes)"),
    )
}

fn catalogue_error(e: CatalogueError) -> ApiError {
    match e {
        CatalogueError::NotSafetensors { .. } => {
            ApiError::invalid("file", "not a safetensors file")
        }
        CatalogueError::BadName { name } => ApiError::invalid(
            "name",
            format!("{name:?} is not a catalogue name ([A-Za-z0-9._-], not starting with '.')"),
        ),
        e @ (CatalogueError::Storage(_)
        | CatalogueError::File { .. }
        | CatalogueError::BadEntry { .. }) => {
            tracing::warn!(error = %e, "the model catalogue failed");
            ApiError::unavailable(format!("the model catalogue: {e}"))
        }
    }
}

/// A temporary file of the system's temporary directory, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new() -> Self {
        Self(std::env::temp_dir().join(format!("vnfarm-lora-upload-{}.part", uuid::Uuid::new_v4())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.0.display(), error = %e, "cannot remove an upload's temporary file");
        }
    }
}
