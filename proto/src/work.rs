//! What travels on the work queues (scheduler → worker) and the heartbeat (worker → scheduler).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{JobId, WorkerId};
use crate::spec::{EditSpec, GenerateSpec, ModelFamily, Priority, UpscaleSpec};

/// One job for a worker. Its `task` is validated and complete (seeds resolved, inline inputs stored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkMessage {
    pub schema_version: u32,
    pub job_id: JobId,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    pub task: Task,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Task {
    Generate(GenerateSpec),
    Edit(EditSpec),
    Upscale(UpscaleSpec),
}

impl Task {
    pub fn model(&self) -> ModelFamily {
        match self {
            Task::Generate(_) => ModelFamily::Sdxl,
            Task::Edit(_) => ModelFamily::QwenEdit,
            Task::Upscale(_) => ModelFamily::Esrgan,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            Task::Generate(_) => "generate",
            Task::Edit(_) => "edit",
            Task::Upscale(_) => "upscale",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Loading models and warming up; takes no jobs yet.
    Warming,
    Ready,
    /// Finishing the job in hand before it exits; takes no new ones.
    Draining,
}

/// Sent by every worker every few seconds on `worker.<id>.heartbeat`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Heartbeat {
    pub worker: WorkerId,
    pub state: WorkerState,
    pub models: Vec<ModelFamily>,
    /// Jobs it takes at once (its prefetch); the scheduler dispatches no more than this.
    pub slots: u32,
    /// Jobs delivered to it and not yet acknowledged.
    pub in_flight: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<JobId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes: Option<u64>,
    /// Input keys whose encodings the worker holds (for affinity).
    #[serde(default)]
    pub encode_cache: Vec<String>,
    pub version: String,
    pub at: DateTime<Utc>,
}

/// Published on `control.cancel`: every worker stops this job if it has it, or skips it when it comes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    pub job_id: JobId,
}
