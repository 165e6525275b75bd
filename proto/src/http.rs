//! The HTTP API's contract (DESIGN §7a): the job view (and the archived job's, for a completed job
//! past the registry's retention), job states, the worker view and the one error body. The
//! scheduler encodes these types and its clients (the command line, the tests) decode them. A
//! reader ignores fields it does not know, reads a job state or failure kind it does not know as
//! `Unknown`, and a recorded submission or task it cannot read as none, so a newer scheduler still
//! serves an older client. (What a client *sends*, the submission, is strict: see `spec`.)

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{FailureKind, Heartbeat, JobId, Priority, Role, Submission, Task, WorkerId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Dispatched,
    Running,
    /// A worker failed it transiently; it will run again.
    Retrying,
    Completed,
    Failed,
    Cancelled,
    /// A state a newer scheduler added, read by this build; treated as unfinished. This build's
    /// scheduler never writes it (nor does the API document it).
    #[serde(other)]
    #[schemars(skip)]
    Unknown,
}

impl JobState {
    /// The states this build's scheduler puts jobs in.
    pub const ALL: [JobState; 7] = [
        JobState::Queued,
        JobState::Dispatched,
        JobState::Running,
        JobState::Retrying,
        JobState::Completed,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        match self {
            JobState::Completed | JobState::Failed | JobState::Cancelled => true,
            JobState::Queued
            | JobState::Dispatched
            | JobState::Running
            | JobState::Retrying
            | JobState::Unknown => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Dispatched => "dispatched",
            JobState::Running => "running",
            JobState::Retrying => "retrying",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Unknown => "unknown",
        }
    }

    /// One of [`JobState::ALL`] by its name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Progress {
    pub step: u32,
    pub total: u32,
}

/// A job as the HTTP API shows it.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct JobView {
    pub id: JobId,
    pub kind: String,
    pub state: JobState,
    pub priority: Priority,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<JobId>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<JobId>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The person who submitted it (a pipeline's jobs: the pipeline's); `admin` for jobs of the
    /// configuration's token, an open loopback API or the intake queue. Absent from an older
    /// scheduler's answers, whose jobs were all `admin`'s.
    #[serde(default = "admin")]
    pub owner: String,
    /// Who asked for its cancel (a cancelled job, or one being cancelled), when the stream says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled_by: Option<String>,
    /// Who last moved it to the front of the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_by: Option<String>,
    pub worker: Option<WorkerId>,
    pub dispatches: u32,
    /// Runs started, on any worker.
    pub attempts: u32,
    pub progress: Option<Progress>,
    pub outputs: Vec<String>,
    pub manifest: Option<String>,
    pub failure: Option<Failure>,
    /// Why a job that is not finished is not moving, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// When a waiting or running job is expected to start and finish, from its place in the queue
    /// and the rates the farm measured (DESIGN §5, "Estimates"). Absent for a finished job, and
    /// while there is no basis for one: then `no_estimate` says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Estimate>,
    /// Why an unfinished job has no `estimate` (no run of its model and size measured yet, no
    /// live worker serves it, it waits behind a job without one, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_estimate: Option<String>,
    /// The submission as the scheduler recorded it. One this build cannot decode (a field or a job
    /// kind a newer scheduler accepts; a submission is decoded strictly) reads as none rather than
    /// failing the whole view.
    #[serde(default, deserialize_with = "readable")]
    pub submission: Option<Submission>,
}

/// A job's expected start and finish, made by the scheduler at `made_at`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Estimate {
    /// When it starts (a running job: when it started on its engine, as far as the scheduler can
    /// tell).
    pub start_at: DateTime<Utc>,
    pub finish_at: DateTime<Utc>,
    /// What the estimate rests on, in words: the measured rate used (model, resolution class,
    /// worker, how many runs) and the job's place in the queue.
    pub basis: String,
    /// When the scheduler made it (estimates are remade at most a few times a second).
    pub made_at: DateTime<Utc>,
}

fn admin() -> String {
    crate::people::ADMIN.into()
}

/// A value this build decodes strictly (a submission, a task), or none when it cannot.
fn readable<'de, D: serde::Deserializer<'de>, T: serde::de::DeserializeOwned>(
    de: D,
) -> Result<Option<T>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(de)?;
    Ok(value.and_then(|v| serde_json::from_value(v).ok()))
}

impl JobView {
    pub fn is_pipeline(&self) -> bool {
        self.kind == "pipeline"
    }
}

/// A completed job past the registry's retention, as the API answers it from the job's manifest in
/// storage: what the manifest records, which is less than a [`JobView`] (no priority, creation
/// time, dispatches or submission; a pipeline leaves no manifest, so it is never archived).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ArchivedJobView {
    pub id: JobId,
    pub kind: String,
    /// Always `completed`: only a completed job leaves a manifest.
    pub state: JobState,
    /// Always true: only a manifest is left of this job.
    pub archived: bool,
    pub worker: WorkerId,
    pub attempts: u32,
    pub outputs: Vec<String>,
    pub manifest: String,
    pub updated_at: DateTime<Utc>,
    /// What the job ran, as the manifest recorded it. One this build cannot decode (a field a newer
    /// worker writes; a task is decoded strictly) reads as none rather than failing the answer.
    #[serde(deserialize_with = "readable")]
    #[schemars(with = "Task")]
    pub task: Option<Task>,
}

/// `GET /v1/jobs/{id}` as a client reads it: a job the registry holds, or an archived one (told
/// apart by the archived answer's `archived: true`).
// Decoded once per request and read at once: the size of its variants does not matter.
#[expect(clippy::large_enum_variant)]
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum JobAnswer {
    Live(JobView),
    Archived(ArchivedJobView),
}

impl<'de> Deserialize<'de> for JobAnswer {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let value = serde_json::Value::deserialize(de)?;
        let archived = value.get("archived").and_then(serde_json::Value::as_bool) == Some(true);
        if archived {
            ArchivedJobView::deserialize(value).map(JobAnswer::Archived)
        } else {
            JobView::deserialize(value).map(JobAnswer::Live)
        }
        .map_err(D::Error::custom)
    }
}

impl JobAnswer {
    pub fn id(&self) -> JobId {
        match self {
            JobAnswer::Live(job) => job.id,
            JobAnswer::Archived(job) => job.id,
        }
    }

    pub fn state(&self) -> JobState {
        match self {
            JobAnswer::Live(job) => job.state,
            JobAnswer::Archived(job) => job.state,
        }
    }

    pub fn outputs(&self) -> &[String] {
        match self {
            JobAnswer::Live(job) => &job.outputs,
            JobAnswer::Archived(job) => &job.outputs,
        }
    }
}

/// The answer to an accepted submission.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Submitted {
    pub job_id: JobId,
}

/// `GET /v1/models`: the model catalogue's names (DESIGN §7b).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelList {
    /// Every entry, by name.
    pub models: Vec<crate::catalogue::CatalogueEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Fleet {
    pub workers: Vec<Worker>,
}

/// One worker and its last heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Worker {
    pub id: WorkerId,
    /// Heard from within the heartbeat timeout.
    pub alive: bool,
    /// `ready`, `warming`, `draining` or `gone` (silent past the heartbeat timeout).
    pub state: String,
    /// Jobs the scheduler sent it that have not finished.
    pub assigned: Vec<JobId>,
    pub heartbeat: Option<Heartbeat>,
    pub seconds_since_heartbeat: Option<f64>,
}

/// `POST /v1/tokens`: the person to give a token, and their role.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// 1-64 of `a-z`, `0-9`, `_` and `-`, starting with a letter or digit; not `admin`.
    pub name: String,
    pub role: Role,
}

/// A new token. `token` is shown in this answer only: the farm keeps its SHA-256.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct CreatedToken {
    pub name: String,
    pub role: Role,
    /// `Authorization: Bearer <token>`, for this person only.
    pub token: String,
    pub created_at: DateTime<Utc>,
}

/// `GET /v1/tokens`: everyone who has had a token, by name.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct TokenList {
    pub tokens: Vec<TokenView>,
}

/// A person's token, without the token.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct TokenView {
    pub name: String,
    pub role: Role,
    pub created_at: DateTime<Utc>,
    /// Who made it.
    pub created_by: String,
    /// Set once revoked: the token no longer opens the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
}

/// The answer to a revocation: from now on this scheduler refuses the token (401).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct RevokedToken {
    pub name: String,
    pub revoked_at: DateTime<Utc>,
}

/// `GET /v1/queue`, and the answer to pausing and resuming: the queue's controls and each
/// person's share of the farm.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct QueueView {
    /// Who asked, and their role (a page shows the controls the role holds).
    pub you: String,
    pub role: Role,
    /// Set while the whole farm is paused: nothing is dispatched; running jobs finish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub farm_paused: Option<PauseView>,
    /// Everyone with work waiting or on workers, paused, or with GPU time today, by name.
    pub people: Vec<PersonQueue>,
}

/// Who paused, and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PauseView {
    pub by: String,
    pub at: DateTime<Utc>,
}

/// One person's share of the farm.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct PersonQueue {
    pub name: String,
    /// Their jobs waiting for a worker.
    pub waiting: usize,
    /// Their jobs on workers (dispatched or running).
    pub running: usize,
    /// GPU time their runs took today (UTC), in minutes.
    pub gpu_minutes_today: f64,
    /// The most of their jobs on workers at once, if capped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Their GPU minutes per UTC day, if limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daily_gpu_minutes: Option<u32>,
    /// Set while their work is paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<PauseView>,
    /// Why their waiting work does not start now, in words: paused, at their cap, past their
    /// quota. Absent when it may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
}

/// The body of every error response.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    /// What to fix: a dotted path into the request body (`job.width`), a query or path parameter
    /// (`limit`, `id`), a header (`authorization`), `body`, or `.` when the request is not at fault.
    pub field: String,
    /// What is wrong, in words.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_state_a_newer_scheduler_added_reads_as_unknown() {
        let state: JobState = serde_json::from_str(r#""paused""#).unwrap();
        assert_eq!(state, JobState::Unknown);
        assert!(!state.is_terminal());
        for known in JobState::ALL {
            let json = serde_json::to_string(&known).unwrap();
            assert_eq!(json, format!("\"{}\"", known.as_str()));
            assert_eq!(serde_json::from_str::<JobState>(&json).unwrap(), known);
        }
    }

    #[test]
    fn the_documented_states_are_the_ones_the_scheduler_writes() {
        let schema = serde_json::to_string(&schemars::schema_for!(JobState)).unwrap();
        assert!(!schema.contains("unknown"), "{schema}");
        for known in JobState::ALL {
            assert!(
                schema.contains(&format!("\"{}\"", known.as_str())),
                "{schema}"
            );
        }
    }

    /// The scheduler's answer decodes as the view it encoded (the command line reads it so).
    #[test]
    fn a_job_view_decodes_as_it_was_encoded() {
        let submission: Submission = crate::decode_json(
            br#"{"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"},
                "edits": [{"instruction": "smile"}]}}"#,
        )
        .unwrap();
        let view = JobView {
            id: JobId::new(),
            kind: "pipeline".into(),
            state: JobState::Queued,
            priority: Priority::Batch,
            parent: None,
            children: vec![],
            created_at: Utc::now(),
            updated_at: Utc::now(),
            owner: "ann".into(),
            cancelled_by: None,
            moved_by: None,
            worker: None,
            dispatches: 0,
            attempts: 0,
            progress: None,
            outputs: vec![],
            manifest: None,
            failure: None,
            waiting_for: None,
            estimate: None,
            no_estimate: None,
            submission: Some(submission),
        };
        let json = serde_json::to_value(&view).unwrap();
        assert!(json.get("children").is_none() && json.get("parent").is_none());
        let back: JobView = serde_json::from_value(json).unwrap();
        assert_eq!(back.submission, view.submission);
        assert_eq!((back.id, back.state), (view.id, view.state));
        assert_eq!(back.owner, "ann");
    }

    /// What a newer scheduler may answer: a field this build does not know in the view, the error
    /// body and the answer to a submission; a job state and a failure kind it does not know; a
    /// recorded submission with a field this build's strict decoding refuses.
    #[test]
    fn an_older_client_reads_a_newer_schedulers_answers() {
        let view: JobView = serde_json::from_value(serde_json::json!({
            "id": JobId::new(), "kind": "edit", "state": "paused", "priority": "batch",
            "created_at": Utc::now(), "updated_at": Utc::now(), "worker": null,
            "dispatches": 1, "attempts": 1, "progress": null, "outputs": [], "manifest": null,
            "failure": {"kind": "quota_exceeded", "message": "over the day's quota", "owner": "ann"},
            "owner": "ann", "eta": {"start": "2026-12-02T10:00:00Z"},
            "submission": {"schema_version": 1, "job": {"kind": "generate", "prompt": "x",
                "lora_catalogue": "sha256:00"}},
        }))
        .unwrap();
        assert_eq!(view.state, JobState::Unknown);
        let failure = view.failure.unwrap();
        assert_eq!(failure.kind, FailureKind::Unknown);
        assert_eq!(failure.message, "over the day's quota");
        assert!(view.submission.is_none());
        let error: ErrorBody = serde_json::from_value(serde_json::json!({
            "error": {"field": "job.width", "message": "too wide", "hint": "≤ 2048"},
            "request_id": "r1",
        }))
        .unwrap();
        assert_eq!(error.error.field, "job.width");
        let id = JobId::new();
        let submitted: Submitted =
            serde_json::from_value(serde_json::json!({"job_id": id, "eta": null})).unwrap();
        assert_eq!(submitted.job_id, id);
    }

    /// Both answers of `GET /v1/jobs/{id}` decode as what they are; an archived one whose task
    /// this build cannot read still decodes, without it.
    #[test]
    fn a_job_answer_is_live_or_archived() {
        let id = JobId::new();
        let archived = serde_json::json!({
            "id": id, "kind": "generate", "state": "completed", "archived": true,
            "worker": "w1", "attempts": 1, "outputs": [format!("results/{id}/0.png")],
            "manifest": format!("results/{id}/manifest.json"), "updated_at": Utc::now(),
            "task": {"kind": "generate", "prompt": "x"}, "images": [],
        });
        let JobAnswer::Archived(view) = serde_json::from_value(archived.clone()).unwrap() else {
            panic!("an archived job");
        };
        assert_eq!((view.id, view.state), (id, JobState::Completed));
        assert!(matches!(view.task, Some(Task::Generate(_))));
        let mut newer = archived;
        newer["task"]["lora_catalogue"] = "sha256:00".into();
        let answer: JobAnswer = serde_json::from_value(newer).unwrap();
        assert!(matches!(
            answer,
            JobAnswer::Archived(ArchivedJobView { task: None, .. })
        ));
        assert_eq!(answer.outputs(), [format!("results/{id}/0.png")]);

        let live = serde_json::json!({
            "id": id, "kind": "edit", "state": "running", "priority": "batch",
            "created_at": Utc::now(), "updated_at": Utc::now(), "worker": "w1",
            "dispatches": 1, "attempts": 1, "progress": {"step": 2, "total": 8}, "outputs": [],
            "manifest": null, "failure": null, "images": [],
        });
        let answer: JobAnswer = serde_json::from_value(live).unwrap();
        assert!(matches!(&answer, JobAnswer::Live(job) if job.progress.is_some()));
        let JobAnswer::Live(job) = &answer else {
            unreachable!("matched above")
        };
        assert_eq!(job.owner, "admin", "an older scheduler's jobs are admin's");
        assert_eq!((answer.id(), answer.state()), (id, JobState::Running));
    }

    #[test]
    fn the_documented_failure_kinds_are_the_ones_this_build_writes() {
        let schema = serde_json::to_string(&schemars::schema_for!(FailureKind)).unwrap();
        assert!(!schema.contains("\"unknown\""), "{schema}");
        assert!(schema.contains("\"dependency_failed\""), "{schema}");
    }
}
