//! A job as the registry holds it: its state, what the stream said of it, and the local decision
//! flags of the active scheduler.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vnfarm_proto::catalogue::ContentHash;
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::http::{Failure, JobState, Progress};
use vnfarm_proto::{
    Event, EventKind, ImageRef, JobId, JobSpec, ModelFamily, Priority, Submission, WorkerId,
};

use super::Route;

/// A job's place in its owner's queue (see [`JobRecord::queue_key`]).
pub(super) type QueueKey = (u8, u64, JobId);

/// Decisions taken locally and not yet confirmed by the stream. Not part of a snapshot.
#[derive(Clone, Debug, Default)]
pub(super) struct Local {
    pub(super) dispatch_pending: bool,
    pub(super) cancel_requested: bool,
    /// Who asked for the cancel, for the `cancelled` event this scheduler may owe.
    pub(super) cancelled_by: Option<String>,
    /// A follow-up event (pipeline finished, dependency failed) was handed out for publishing.
    pub(super) finishing: bool,
    /// Inputs of this job not yet completed.
    pub(super) unmet: u32,
    /// Waiting for the busy worker that holds its input's encodings, until then.
    pub(super) hold_until: Option<Instant>,
    /// Waited once for that worker in vain: any worker may take it now.
    pub(super) hold_expired: bool,
    /// Released from its hold to a worker that had nothing else to do.
    pub(super) idle_release: bool,
    /// Its worker's beats stopped listing it while it ran, and the event that ends the run here
    /// was handed out for publishing (see `Registry::unheld_runs`).
    pub(super) recovering: bool,
    /// For an edit: whether the worker it was last dispatched to listed its input's encodings in
    /// its latest beat then (what its run pays for its input; not known after a restart).
    pub(super) encodings_held: Option<bool>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub(super) id: JobId,
    /// `None` for a job known only from a `failed` event (a submission too broken to queue).
    pub(super) submission: Option<Submission>,
    pub(super) parent: Option<JobId>,
    pub(super) children: Vec<JobId>,
    /// The person who submitted it (a pipeline's jobs: the pipeline's); `None` is
    /// [`vnfarm_proto::people::ADMIN`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) owner: Option<String>,
    /// The person who asked for its cancel (from its `cancelled` event or, for a job a worker
    /// stopped, their `cancel_requested` event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) cancelled_by: Option<String>,
    /// The stream offset of the event that last moved it to the front of the queue, and who
    /// moved it: it goes before every unmoved job of its class, the latest move first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) front: Option<(u64, String)>,
    pub(super) state: JobState,
    pub(super) created_at: DateTime<Utc>,
    pub(super) updated_at: DateTime<Utc>,
    pub(super) worker: Option<WorkerId>,
    /// The first job of the batch message it was last dispatched in, when it shared one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) batch: Option<JobId>,
    pub(super) dispatches: u32,
    pub(super) attempts: u32,
    pub(super) progress: Option<Progress>,
    pub(super) outputs: Vec<String>,
    pub(super) manifest: Option<String>,
    pub(super) failure: Option<Failure>,
    /// The catalogue files its LoRA names stood for at acceptance, by the name (a pipeline's
    /// covers its jobs'): the workers whose model cache holds them are preferred.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) files: BTreeMap<String, ContentHash>,
    /// Offset of the event that made the job known: its own `queued`, or its pipeline's.
    pub(super) first_seq: u64,
    /// The events after that one. While the job runs only its latest `progress` is kept; once it
    /// has ended, none.
    pub(super) history: Vec<SequencedEvent>,
    #[serde(skip)]
    pub(super) local: Local,
}

impl JobRecord {
    pub(super) fn new(id: JobId, state: JobState, seq: u64, at: DateTime<Utc>) -> Self {
        Self {
            id,
            submission: None,
            parent: None,
            children: Vec::new(),
            owner: None,
            cancelled_by: None,
            front: None,
            state,
            created_at: at,
            updated_at: at,
            worker: None,
            batch: None,
            dispatches: 0,
            attempts: 0,
            progress: None,
            outputs: Vec::new(),
            manifest: None,
            failure: None,
            files: BTreeMap::new(),
            first_seq: seq,
            history: Vec::new(),
            local: Local::default(),
        }
    }

    pub fn id(&self) -> JobId {
        self.id
    }

    pub fn state(&self) -> JobState {
        self.state
    }

    pub fn parent(&self) -> Option<JobId> {
        self.parent
    }

    pub fn children(&self) -> &[JobId] {
        &self.children
    }

    /// The person who submitted it ([`vnfarm_proto::people::ADMIN`] when no person's token did).
    pub fn owner(&self) -> &str {
        self.owner.as_deref().unwrap_or(vnfarm_proto::people::ADMIN)
    }

    /// Who asked for its cancel, when someone did and the stream says who.
    /// The stream offset of the event that last moved it to the front.
    pub fn moved_at(&self) -> Option<u64> {
        self.front.as_ref().map(|(seq, _)| *seq)
    }

    /// Who last moved it to the front of the queue.
    pub fn moved_by(&self) -> Option<&str> {
        self.front.as_ref().map(|(_, by)| by.as_str())
    }

    pub fn cancelled_by(&self) -> Option<&str> {
        self.cancelled_by.as_deref()
    }

    pub fn submission(&self) -> Option<&Submission> {
        self.submission.as_ref()
    }

    pub fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }

    pub fn updated_at(&self) -> DateTime<Utc> {
        self.updated_at
    }

    /// The worker it was last sent to or ran on.
    pub fn worker(&self) -> Option<&WorkerId> {
        self.worker.as_ref()
    }

    pub fn dispatches(&self) -> u32 {
        self.dispatches
    }

    /// Runs started, on any worker.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    pub fn progress(&self) -> Option<&Progress> {
        self.progress.as_ref()
    }

    pub fn outputs(&self) -> &[String] {
        &self.outputs
    }

    pub fn manifest(&self) -> Option<&str> {
        self.manifest.as_deref()
    }

    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }

    pub fn kind(&self) -> &'static str {
        self.submission
            .as_ref()
            .map_or("unknown", |s| s.job.kind_name())
    }

    pub fn model(&self) -> Option<ModelFamily> {
        self.submission.as_ref().and_then(|s| s.job.model())
    }

    pub fn priority(&self) -> Priority {
        self.submission
            .as_ref()
            .map_or(Priority::Batch, |s| s.priority)
    }

    /// When the job started running most recently.
    pub fn started_at(&self) -> Option<DateTime<Utc>> {
        self.history
            .iter()
            .rev()
            .find(|e| matches!(e.event.kind, EventKind::Started { .. }))
            .map(|e| e.event.at)
    }

    /// The jobs whose outputs this one takes as inputs.
    pub fn dependencies(&self) -> Vec<JobId> {
        let inputs = match self.submission.as_ref().map(|s| &s.job) {
            Some(JobSpec::Edit(e)) => e.images(),
            Some(JobSpec::Upscale(u)) => vec![&u.input],
            Some(JobSpec::Generate(_) | JobSpec::Pipeline(_)) | None => Vec::new(),
        };
        let mut deps: Vec<JobId> = inputs
            .into_iter()
            .filter_map(|input| match input {
                ImageRef::JobOutput { job, .. } => Some(*job),
                ImageRef::Stored(_) | ImageRef::Inline(_) => None,
            })
            .collect();
        deps.sort();
        deps.dedup();
        deps
    }

    /// The job's events in order, its `queued` event first (rebuilt from the submission, which is
    /// kept once).
    pub fn events(&self) -> Vec<SequencedEvent> {
        let queued = self.submission.as_ref().map(|s| SequencedEvent {
            seq: self.first_seq,
            event: Event {
                schema_version: vnfarm_proto::PROTOCOL_VERSION,
                job_id: self.id,
                at: self.created_at,
                kind: EventKind::Queued {
                    submission: Box::new(s.clone()),
                    parent: self.parent,
                    children: self.children.clone(),
                    owner: self.owner.clone(),
                    files: self.files.clone(),
                },
            },
        });
        queued
            .into_iter()
            .chain(self.history.iter().cloned())
            .collect()
    }

    pub(super) fn is_pipeline(&self) -> bool {
        matches!(
            self.submission.as_ref().map(|s| &s.job),
            Some(JobSpec::Pipeline(_))
        )
    }

    pub(super) fn rank(&self) -> (u8, JobId) {
        (u8::from(self.priority() != Priority::Interactive), self.id)
    }

    /// Its place in its owner's queue: interactive first, then jobs moved to the front (the
    /// latest move first), then oldest.
    pub(super) fn queue_key(&self) -> QueueKey {
        let front = self
            .front
            .as_ref()
            .map_or(u64::MAX, |(seq, _)| u64::MAX - 1 - seq);
        (self.rank().0, front, self.id)
    }

    /// On a worker, or about to be: counts against its owner's cap of jobs at once.
    pub(super) fn occupies(&self) -> bool {
        !self.is_pipeline()
            && (matches!(self.state, JobState::Dispatched | JobState::Running)
                || (self.local.dispatch_pending && !self.state.is_terminal()))
    }

    /// Queued with nothing in its way but a worker: in the ready index, or held for its input's
    /// holder.
    pub(super) fn waiting(&self) -> bool {
        self.state == JobState::Queued
            && !self.local.dispatch_pending
            && !self.local.cancel_requested
            && !self.local.finishing
            && self.local.unmet == 0
            && self.model().is_some()
    }

    /// The workers that may run it.
    pub(super) fn route(&self) -> Option<Route> {
        let sub = self.submission.as_ref()?;
        let checkpoint = match &sub.job {
            JobSpec::Generate(g) => g.checkpoint.clone(),
            _ => None,
        };
        Some(Route {
            model: sub.job.model()?,
            catalogue: checkpoint.as_ref().and_then(|c| self.files.get(c).cloned()),
            checkpoint,
        })
    }

    /// The key of the jobs it may share a message with: edits of the same inputs, or generates
    /// that can share a forward pass.
    pub(super) fn group_key(&self) -> Option<String> {
        match &self.submission.as_ref()?.job {
            JobSpec::Edit(e) => e.affinity_key(),
            JobSpec::Generate(g) => Some(g.batch_key()),
            JobSpec::Upscale(_) | JobSpec::Pipeline(_) => None,
        }
    }

    /// The catalogue files it needs, by hash.
    pub(super) fn needs_files(&self) -> impl Iterator<Item = &ContentHash> {
        self.files.values()
    }

    pub(super) fn awaiting_start(&self) -> bool {
        self.state == JobState::Dispatched && !self.local.dispatch_pending
    }
}
