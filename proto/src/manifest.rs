//! `results/<job_id>/manifest.json`: what was made, from what, by whom, and how long each stage took.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::event::{EventKind, StageTimings};
use crate::ids::{JobId, WorkerId};
use crate::work::Task;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    pub job_id: JobId,
    pub task: Task,
    pub outputs: Vec<ManifestOutput>,
    pub worker: WorkerId,
    pub attempt: u32,
    /// The engine that ran the job, and every model and LoRA file that made its images (empty for
    /// the test-pattern engine, which loads none, unless it is configured to claim some).
    pub engine: String,
    pub model_files: Vec<ModelFile>,
    pub timings: StageTimings,
    pub versions: Versions,
    pub finished_at: DateTime<Utc>,
}

impl Manifest {
    /// The `completed` event of the run that wrote this manifest, as that run published it:
    /// credited to the worker that made the outputs, whoever republishes it (a worker that gets
    /// the job again, or the scheduler when the run's own event never reached the stream).
    pub fn completed(self) -> EventKind {
        EventKind::Completed {
            outputs: self.outputs.into_iter().map(|o| o.key).collect(),
            manifest: crate::topology::manifest_key(self.job_id),
            worker: Some(self.worker),
            timings: self.timings,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestOutput {
    pub key: String,
    pub width: u32,
    pub height: u32,
    pub seed: Option<u64>,
    pub sha256: String,
}

/// A file a job's images were made from. `size`, `path` and `role` came with provenance (step 5):
/// manifests written before decode with `size` 0 and no path or role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelFile {
    /// The name the job or the configuration knows it by: a LoRA's name, else the file's name.
    pub name: String,
    /// Hex sha256 of the file's bytes, as they were when the image was made.
    pub sha256: String,
    /// Bytes.
    #[serde(default)]
    pub size: u64,
    /// Where the worker read it (canonical).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<ModelFileRole>,
    /// For a safetensors file: hex sha256 of its tensor data, the bytes after its header. A1111
    /// names LoRAs by its first 12 digits (civitai's "AutoV3"), so a renamed or re-headed copy
    /// keeps its hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_sha256: Option<String>,
    /// A LoRA's strength: the job's weight, or the configured one for a LoRA fused at load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<f32>,
}

/// What a model file is to the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModelFileRole {
    /// A single-file checkpoint (SDXL), or a file the test-pattern engine claims.
    Checkpoint,
    /// A weight file of a diffusers folder.
    Component,
    Transformer,
    TextEncoder,
    Vae,
    /// A LoRA, fused at load or applied for the job.
    Lora,
    /// An upscaler's network (Real-ESRGAN).
    Upscaler,
}

impl ModelFileRole {
    pub const ALL: [ModelFileRole; 7] = [
        ModelFileRole::Checkpoint,
        ModelFileRole::Component,
        ModelFileRole::Transformer,
        ModelFileRole::TextEncoder,
        ModelFileRole::Vae,
        ModelFileRole::Lora,
        ModelFileRole::Upscaler,
    ];

    /// The name it has on the wire (`text_encoder`).
    pub fn as_str(self) -> &'static str {
        match self {
            ModelFileRole::Checkpoint => "checkpoint",
            ModelFileRole::Component => "component",
            ModelFileRole::Transformer => "transformer",
            ModelFileRole::TextEncoder => "text_encoder",
            ModelFileRole::Vae => "vae",
            ModelFileRole::Lora => "lora",
            ModelFileRole::Upscaler => "upscaler",
        }
    }
}

impl std::str::FromStr for ModelFileRole {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|r| r.as_str()).collect();
                format!("{name:?} is not a role ({})", names.join(", "))
            })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Versions {
    pub vnfarm: String,
}
