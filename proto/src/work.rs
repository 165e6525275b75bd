//! What travels on the work queues (scheduler → worker) and the heartbeat (worker → scheduler).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{JobId, WorkerId};
use crate::spec::{EditSpec, GenerateSpec, ModelFamily, Priority, UpscaleSpec};

/// One job for a worker, or a batch of jobs that share work: edits of the same input (encoded
/// once) or compatible generates (one forward pass). Its tasks are validated and complete (seeds
/// resolved, inline inputs stored). A batch is one message: acknowledged when every job in it has
/// ended, each job with its own events, outputs and manifest.
///
/// Unknown fields of the envelope are ignored (protocol 2); those of a job's spec are not: a spec
/// field changes what a job makes, so a new one comes with a new protocol version, and the
/// scheduler sends it only to workers that decode that version ([`WorkMessage::version_needed`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkMessage {
    /// The protocol version it is written in ([`crate::PROTOCOL_VERSION`]; the name is version 1's).
    pub schema_version: u32,
    pub job_id: JobId,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    pub task: Task,
    /// The other jobs of a batch, run with this one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch: Vec<BatchedJob>,
}

/// A job travelling in another job's [`WorkMessage`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BatchedJob {
    pub job_id: JobId,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    pub task: Task,
}

impl WorkMessage {
    /// Every job of the message, the first one first.
    pub fn jobs(&self) -> impl Iterator<Item = BatchedJob> + '_ {
        std::iter::once(BatchedJob {
            job_id: self.job_id,
            priority: self.priority,
            deadline: self.deadline,
            task: self.task.clone(),
        })
        .chain(self.batch.iter().cloned())
    }

    /// A message of these jobs (at least one), the first one in front.
    pub fn of(jobs: Vec<BatchedJob>) -> Option<Self> {
        let mut jobs = jobs.into_iter();
        let first = jobs.next()?;
        Some(Self {
            schema_version: crate::PROTOCOL_VERSION,
            job_id: first.job_id,
            priority: first.priority,
            deadline: first.deadline,
            task: first.task,
            batch: jobs.collect(),
        })
    }

    /// The oldest protocol version that expresses this message: 1 for every message today, since
    /// version 2 added no field to jobs. A field added to a job's spec raises it for the messages
    /// that use the field (and only for those, so workers of the previous version keep taking the
    /// rest during a rolling upgrade).
    pub fn version_needed(&self) -> u32 {
        crate::MIN_PROTOCOL_VERSION
    }

    /// The version to write this message in for a worker that decodes `protocols`: the newest both
    /// speak, or `None` when the worker decodes none that expresses the message.
    pub fn version_for(&self, protocols: &[u32]) -> Option<u32> {
        protocols
            .iter()
            .copied()
            .filter(|v| (self.version_needed()..=crate::PROTOCOL_VERSION).contains(v))
            .max()
    }

    /// Whether this build reads a work message written in `version`.
    pub fn readable(version: u32) -> bool {
        (crate::MIN_PROTOCOL_VERSION..=crate::PROTOCOL_VERSION).contains(&version)
    }
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

    /// The key of the input encodings an edit needs: its input references in prompt order
    /// (`qwen-edit:job:<id>/<n>+stored:<key>`). Edits with the same key share one encoding, so
    /// they go to the worker that holds it and travel together; workers advertise the keys of
    /// what their encode caches hold in the same terms. `None` for tasks that encode nothing.
    pub fn affinity_key(&self) -> Option<String> {
        match self {
            Task::Edit(edit) => edit.affinity_key(),
            Task::Generate(_) | Task::Upscale(_) => None,
        }
    }

    /// The SDXL checkpoint a generate names, if any.
    pub fn checkpoint(&self) -> Option<&str> {
        match self {
            Task::Generate(g) => g.checkpoint.as_deref(),
            Task::Edit(_) | Task::Upscale(_) => None,
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
    /// The protocol version it is written in (absent before version 2).
    #[serde(default = "crate::defaults::one")]
    pub schema_version: u32,
    /// The protocol versions of work messages it decodes. Workers before version 2 send none and
    /// decode version 1 only.
    #[serde(default = "version_1_only")]
    pub protocols: Vec<u32>,
    pub worker: WorkerId,
    pub state: WorkerState,
    pub models: Vec<ModelFamily>,
    /// Jobs it takes at once (its prefetch); the scheduler dispatches no more than this.
    pub slots: u32,
    /// Jobs delivered to it and not yet acknowledged.
    pub in_flight: u32,
    /// The jobs on the engine now (several for a batch).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub running: Vec<JobId>,
    /// The unsettled jobs of the message in hand: each from before its `started` event until its
    /// final event is confirmed. A started job that a worker's beats stop listing has ended there
    /// without its final event reaching the stream, and the scheduler dispatches it again. Absent
    /// from workers before this field: the scheduler then trusts their events alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holding: Option<Vec<JobId>>,
    /// The sha256 (hex) of the catalogue files its model cache holds ([`crate::catalogue`]), least
    /// recently used first: a job naming one of them needs no download there. Absent from workers
    /// before this field, and from workers without a model cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<Vec<String>>,
    /// The files of its own LoRA folders (`lora_dir`), by file name: a job may name one of them
    /// (as `<name>` or `<name>.safetensors`) without the catalogue. The scheduler refuses a LoRA
    /// name that is neither here on any worker nor in the catalogue; absent from workers before
    /// this field (and from the test-pattern engine unless it claims some), and then it refuses
    /// none, as it cannot tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loras: Option<Vec<String>>,
    /// SDXL checkpoints it holds warm, by name: jobs that name a checkpoint go only to a worker
    /// that advertises it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints: Vec<String>,
    /// How many SDXL checkpoints of the model catalogue it keeps loaded besides its own
    /// (`[engine.sdxl] catalogue_checkpoints`): above 0, a job naming a checkpoint that the
    /// catalogue holds may come here, and it fetches the file into its model cache. Absent or 0:
    /// it serves only `checkpoints` (workers before this field send none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalogue_checkpoints: Option<u32>,
    /// The most jobs it runs as one batch message (1: no batching).
    #[serde(default = "crate::defaults::one")]
    pub max_batch: u32,
    /// Device memory, when its engine runs on a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<GpuMemory>,
    /// Affinity keys of the inputs whose encodings it holds ([`crate::affinity_key`]), least
    /// recently used first.
    #[serde(default)]
    pub encode_cache: Vec<String>,
    /// The engine settings it runs: measured on its box by `vnfarm-worker check`, or presets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<SettingsInUse>,
    pub version: String,
    pub at: DateTime<Utc>,
}

/// Where a worker's kernel and layout settings came from, for the fleet view.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SettingsInUse {
    pub source: SettingsSource,
    /// `measured`: the settings file's id (the first 12 hex digits of its sha256); `presets`: each
    /// engine's preset, as `sdxl=portable qwen_edit=portable`.
    pub id: String,
    /// When the check that wrote the file ran (`measured` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<DateTime<Utc>>,
    /// What the file was measured on differs from this box in a way that only warrants a warning
    /// (another vnfarm version): what to re-run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SettingsSource {
    /// A settings file written by `vnfarm-worker check` on this box.
    Measured,
    /// Named presets (or explicit settings) from the configuration: nothing was measured.
    Presets,
}

/// The protocol versions this build's workers decode, for their heartbeats.
pub fn decodable_protocols() -> Vec<u32> {
    (crate::MIN_PROTOCOL_VERSION..=crate::PROTOCOL_VERSION).collect()
}

fn version_1_only() -> Vec<u32> {
    vec![1]
}

/// A GPU's memory as the device and libtorch's caching allocator see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuMemory {
    pub total_bytes: u64,
    /// Free on the device (every process's use counted).
    pub free_bytes: u64,
    /// Held by this process's allocator, in use or cached, where libtorch reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
}

/// Published on `control.cancel`: every worker stops this job if it has it, or skips it when it comes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRequest {
    /// The protocol version it is written in. Control messages reach every worker, so they are
    /// written in the oldest version any worker reads ([`crate::MIN_PROTOCOL_VERSION`]): version 1,
    /// which has no field for it (its readers refuse unknown fields).
    #[serde(
        default = "crate::defaults::one",
        skip_serializing_if = "crate::defaults::is_one"
    )]
    pub schema_version: u32,
    pub job_id: JobId,
}

impl CancelRequest {
    pub fn new(job_id: JobId) -> Self {
        Self {
            schema_version: crate::MIN_PROTOCOL_VERSION,
            job_id,
        }
    }
}

/// Published on `control.yield`: the worker gives back the jobs of its message named here that have
/// not started on its engine (the one running finishes), so that it frees up for interactive work
/// sooner. Other workers ignore it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct YieldRequest {
    /// The protocol version it is written in: as for [`CancelRequest::schema_version`].
    #[serde(
        default = "crate::defaults::one",
        skip_serializing_if = "crate::defaults::is_one"
    )]
    pub schema_version: u32,
    pub worker: WorkerId,
    pub jobs: Vec<JobId>,
}

impl YieldRequest {
    pub fn new(worker: WorkerId, jobs: Vec<JobId>) -> Self {
        Self {
            schema_version: crate::MIN_PROTOCOL_VERSION,
            worker,
            jobs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ImageRef;

    fn edit(inputs: Vec<ImageRef>, instruction: &str) -> Task {
        Task::Edit(EditSpec {
            input: None,
            inputs,
            instruction: instruction.into(),
            width: None,
            height: None,
            steps: 4,
            cfg: 1.0,
            seed: Some(1),
            loras: Vec::new(),
        })
    }

    #[test]
    fn edits_of_the_same_inputs_share_an_affinity_key_and_others_do_not() {
        let base = JobId(uuid::Uuid::from_u128(7));
        let of_base = ImageRef::JobOutput {
            job: base,
            index: 0,
        };
        let outfit = ImageRef::Stored("inputs/ab.png".into());
        let smile = edit(vec![of_base.clone()], "make her smile");
        let angry = edit(vec![of_base.clone()], "make her angry");
        assert_eq!(smile.affinity_key(), angry.affinity_key());
        assert_eq!(
            smile.affinity_key().as_deref(),
            Some(format!("qwen-edit:job:{base}/0").as_str())
        );
        let with_outfit = edit(vec![of_base.clone(), outfit.clone()], "x");
        let other_order = edit(vec![outfit, of_base], "x");
        assert_ne!(with_outfit.affinity_key(), smile.affinity_key());
        assert_ne!(with_outfit.affinity_key(), other_order.affinity_key());
        assert_eq!(
            edit(vec![ImageRef::Inline("aGk=".into())], "x").affinity_key(),
            None
        );
    }

    #[test]
    fn a_batch_message_lists_every_job_once_first_one_first() {
        let job = |n: u128| BatchedJob {
            job_id: JobId(uuid::Uuid::from_u128(n)),
            priority: Priority::Batch,
            deadline: None,
            task: edit(vec![ImageRef::Stored("inputs/a.png".into())], "x"),
        };
        assert!(WorkMessage::of(Vec::new()).is_none());
        let single = WorkMessage::of(vec![job(1)]).unwrap();
        let json = serde_json::to_value(&single).unwrap();
        assert!(
            json.get("batch").is_none(),
            "a single job's message is unchanged"
        );
        let message = WorkMessage::of(vec![job(1), job(2), job(3)]).unwrap();
        let ids: Vec<_> = message.jobs().map(|j| j.job_id.0.as_u128()).collect();
        assert_eq!(ids, [1, 2, 3]);
        let back: WorkMessage =
            serde_json::from_slice(&serde_json::to_vec(&message).unwrap()).unwrap();
        assert_eq!(back, message);
    }
}
