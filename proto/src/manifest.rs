//! `results/<job_id>/manifest.json`: what was made, from what, by whom, and how long each stage took.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::event::StageTimings;
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
    /// The engine that ran the job and the files (name → sha256) it loaded.
    pub engine: String,
    pub model_files: Vec<ModelFile>,
    pub timings: StageTimings,
    pub versions: Versions,
    pub finished_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestOutput {
    pub key: String,
    pub width: u32,
    pub height: u32,
    pub seed: Option<u64>,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelFile {
    pub name: String,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Versions {
    pub vnfarm: String,
}
