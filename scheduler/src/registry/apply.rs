//! Applying the event stream: each event changes one job, in stream order; the first terminal
//! event wins; finished jobs are forgotten by count and age.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use vnfarm_proto::catalogue::ContentHash;
use vnfarm_proto::event::{SequencedEvent, StageTimings};
use vnfarm_proto::http::{Failure, JobState, Progress};
use vnfarm_proto::{EventKind, ImageRef, JobId, JobSpec, WorkerId};

use super::record::JobRecord;
use super::{RECENT_EVENTS, Registry};

impl Registry {
    /// Applies one event read from the stream at `ev.seq`. Returns whether it was part of a job's
    /// history: false for a duplicate submission, a late event of a finished job and an event of a
    /// job not known (forgotten); clients are not shown those.
    pub fn apply(&mut self, ev: SequencedEvent) -> bool {
        self.next_offset = self.next_offset.max(ev.seq + 1);
        self.latest = self.latest.max(Some(ev.event.at));
        let recent = ev.clone();
        let applied = if matches!(ev.event.kind, EventKind::Queued { .. }) {
            self.apply_queued(ev)
        } else {
            self.apply_change(ev)
        };
        if applied {
            self.recent.push_back(recent);
            if self.recent.len() > RECENT_EVENTS {
                self.recent.pop_front();
            }
        }
        self.forget_expired();
        applied
    }

    /// A stream offset with nothing to apply (a marker, an undecodable event).
    pub fn skip(&mut self, seq: u64) {
        self.next_offset = self.next_offset.max(seq + 1);
    }

    fn apply_queued(&mut self, ev: SequencedEvent) -> bool {
        let EventKind::Queued {
            submission,
            parent,
            children,
            owner,
            files,
        } = ev.event.kind
        else {
            unreachable!("apply_queued is called for queued events only")
        };
        let id = ev.event.job_id;
        if self.jobs.contains_key(&id) {
            return false; // a resubmission of a known id
        }
        if let Some(key) = &submission.idempotency_key
            && let Some(first) = self.idempotency.get(key)
        {
            tracing::info!(job_id = %id, first = %first, "duplicate submission of an idempotency key ignored");
            return false;
        }
        let derived = vnfarm_proto::pipeline_jobs(&submission, &children);
        let at = ev.event.at;
        let mut record = JobRecord::new(id, JobState::Queued, ev.seq, at);
        if let Some(key) = &submission.idempotency_key {
            self.idempotency.insert(key.clone(), id);
        }
        record.submission = Some(*submission);
        record.parent = parent;
        record.children = children.clone();
        record.owner = owner.clone();
        record.files = files.clone();
        self.rates.queued(&record, at);
        self.insert(record);
        let Some(jobs) = derived else {
            tracing::error!(job_id = %id, children = children.len(), "a pipeline event that does not match its spec; the pipeline fails");
            self.owed.insert(id);
            return true;
        };
        for (child_id, child) in children.into_iter().zip(jobs) {
            if self.jobs.contains_key(&child_id) {
                continue; // written as its own event by an older scheduler
            }
            let mut record = JobRecord::new(child_id, JobState::Queued, ev.seq, at);
            record.files = named_files(&child.job, &files);
            record.submission = Some(child);
            record.parent = Some(id);
            record.owner = owner.clone();
            self.rates.queued(&record, at);
            self.insert(record);
        }
        true
    }

    pub(super) fn job_state(&self, id: JobId) -> Option<JobState> {
        self.jobs.get(&id).map(|j| j.state)
    }

    /// Adds a new queued job and links it to its inputs.
    pub(super) fn insert(&mut self, mut record: JobRecord) {
        let id = record.id;
        for dep in record.dependencies() {
            match self.job_state(dep) {
                Some(JobState::Completed) => {}
                Some(JobState::Failed | JobState::Cancelled) => {
                    self.owed.insert(id);
                }
                Some(_) => {
                    record.local.unmet += 1;
                    self.dependents.entry(dep).or_default().push(id);
                }
                // Forgotten long ago, or never a job here: its outputs are in storage or the
                // worker reports the input missing.
                None => {}
            }
        }
        self.jobs.insert(record);
    }

    fn apply_change(&mut self, ev: SequencedEvent) -> bool {
        let id = ev.event.job_id;
        let at = ev.event.at;
        let Some(entry) = self.jobs.entry(id) else {
            return self.apply_to_unknown(ev);
        };
        if entry.get().state.is_terminal() {
            return false; // the first terminal event won
        }
        let seq = ev.seq;
        let completed = match &ev.event.kind {
            EventKind::Completed { timings, .. } => Some(timings.clone()),
            _ => None,
        };
        let change = entry.update(|job| job.apply(ev));
        if let Some(timings) = completed
            && change.terminal
            && let Some(job) = self.jobs.get(&id)
        {
            self.rates.learn(job, at, &timings);
        }
        if change.gpu_seconds.is_some() || change.dispatched {
            let owner = self.jobs[&id].owner().to_owned();
            if let Some(seconds) = change.gpu_seconds {
                self.shares.charge(&owner, at, seconds);
            }
            if change.dispatched {
                self.shares.serve(&owner, seq);
            }
        }
        if let Some((w, lead)) = change.assign {
            let key = self.jobs[&id].submission().and_then(|s| match &s.job {
                vnfarm_proto::JobSpec::Edit(e) => e.affinity_key(),
                _ => None,
            });
            let held = key.map(|k| self.workers.get(&w).is_some_and(|wk| wk.has_encodings(&k)));
            self.worker_mut(&w).assign(id, lead);
            if held.is_some() {
                self.jobs.update(id, |job| job.local.encodings_held = held);
            }
        }
        if change.unassign {
            self.unassign(id);
        }
        if let Some((w, images)) = change.made {
            let now = Instant::now();
            let keys = self.worker_mut(&w);
            for index in 0..images as u32 {
                let input = ImageRef::JobOutput { job: id, index };
                if let Some(key) = vnfarm_proto::EditSpec::affinity_key_of(&[&input]) {
                    keys.keys.insert(key, now);
                }
            }
        }
        if change.terminal {
            self.finish(id, at);
        }
        if change.owe_cancel {
            self.owed.insert(id);
        }
        true
    }

    /// An event of a job not in memory. Only a failure can name a job never queued (a submission
    /// too broken to queue); events of forgotten jobs change nothing.
    fn apply_to_unknown(&mut self, ev: SequencedEvent) -> bool {
        let EventKind::Failed {
            failure, message, ..
        } = &ev.event.kind
        else {
            return false;
        };
        let (id, at) = (ev.event.job_id, ev.event.at);
        let mut record = JobRecord::new(id, JobState::Failed, ev.seq, at);
        record.failure = Some(Failure {
            kind: *failure,
            message: message.clone(),
        });
        record.history.push(ev);
        self.insert(record);
        self.finished.push_back((at, id));
        true
    }

    /// A job reached its final state: its pipeline and the jobs waiting on it learn of it.
    fn finish(&mut self, id: JobId, at: DateTime<Utc>) {
        let job = &self.jobs[&id];
        let completed = job.state == JobState::Completed;
        let parent = job.parent.filter(|p| self.jobs.is_active(p));
        if let Some(p) = parent {
            self.owed.insert(p);
        } else {
            // Top-level (or orphaned) jobs are forgotten on their own; a pipeline's go with it.
            self.finished.push_back((at, id));
        }
        for waiting in self.dependents.remove(&id).unwrap_or_default() {
            if !self.jobs.is_active(&waiting) {
                continue;
            }
            if completed {
                self.jobs
                    .update(waiting, |w| w.local.unmet = w.local.unmet.saturating_sub(1));
            } else {
                self.owed.insert(waiting);
            }
        }
    }

    /// Forgets finished jobs beyond the retention count or age.
    fn forget_expired(&mut self) {
        let Some(now) = self.latest else { return };
        while let Some(&(at, id)) = self.finished.front() {
            let too_many = self.finished.len() > self.retention.max_jobs;
            let too_old = now - at > self.retention.max_age;
            if !(too_many || too_old) {
                break;
            }
            self.finished.pop_front();
            self.forget(id);
        }
    }

    fn forget(&mut self, id: JobId) {
        let Some(entry) = self.jobs.entry(id) else {
            return;
        };
        if !entry.get().state.is_terminal() {
            return;
        }
        let job = entry.remove();
        if let Some(key) = job
            .submission
            .as_ref()
            .and_then(|s| s.idempotency_key.as_ref())
            && self.idempotency.get(key) == Some(&id)
        {
            self.idempotency.remove(key);
        }
        self.dependents.remove(&id);
        for &child in &job.children {
            self.forget(child);
        }
    }
}

/// What an event did to a job that reaches beyond its record: the worker loads and held images
/// the registry keeps, and the follow-ups it owes.
#[derive(Default)]
struct Change {
    /// Dispatched to this worker, in the message this job names.
    assign: Option<(WorkerId, JobId)>,
    /// Off its worker (finished, failed for good or returned).
    unassign: bool,
    /// A generate completed on this worker with this many images: the worker holds them.
    made: Option<(WorkerId, usize)>,
    /// Cancelled while it was out and come back unrun: no worker has it now to report the cancel.
    owe_cancel: bool,
    /// It reached its final state.
    terminal: bool,
    /// A run of it ended, having taken this much GPU time (seconds), charged to its owner.
    gpu_seconds: Option<f64>,
    /// It was dispatched: its owner was served.
    dispatched: bool,
}

/// Stages a worker reports that run on its host, not its GPU: not charged as GPU time.
const HOST_STAGES: [&str; 3] = ["download", "encode_png", "upload"];

/// The GPU time a run took: the model stages its `completed` event reports, or, without them,
/// its time from `started` to `at`.
fn gpu_seconds(timings: Option<&StageTimings>, started: DateTime<Utc>, at: DateTime<Utc>) -> f64 {
    let reported: f64 = timings
        .map(|t| {
            t.0.iter()
                .filter(|(stage, _)| !HOST_STAGES.contains(&stage.as_str()))
                .map(|(_, s)| s.max(0.0))
                .sum()
        })
        .unwrap_or(0.0);
    if reported > 0.0 {
        reported
    } else {
        (at - started).num_milliseconds().max(0) as f64 / 1000.0
    }
}

impl JobRecord {
    /// Applies one event of this job, not yet finished, to its record.
    fn apply(&mut self, ev: SequencedEvent) -> Change {
        let id = self.id;
        let mut change = Change::default();
        if let EventKind::Requeued {
            dispatch: Some(n), ..
        } = &ev.event.kind
            && *n != self.dispatches
        {
            // It returns a dispatch the job has left since: the job keeps its new one.
            return change;
        }
        self.updated_at = ev.event.at;
        // A run ends: charged to its owner (a requeue of a job that never started charges none).
        if self.state == JobState::Running
            && let Some(started) = self.started_at()
        {
            change.gpu_seconds = match &ev.event.kind {
                EventKind::Completed { timings, .. } => {
                    Some(gpu_seconds(Some(timings), started, ev.event.at))
                }
                EventKind::Failed { .. }
                | EventKind::Cancelled { .. }
                | EventKind::Requeued { .. } => Some(gpu_seconds(None, started, ev.event.at)),
                _ => None,
            };
        }
        match &ev.event.kind {
            EventKind::Queued { .. } => unreachable!("handled by apply_queued"),
            EventKind::Dispatched { worker, batch, .. } => {
                if self.state == JobState::Queued {
                    self.state = JobState::Dispatched;
                }
                self.local.dispatch_pending = false;
                self.dispatches += 1;
                change.dispatched = true;
                self.worker = worker.clone();
                self.batch = *batch;
                change.assign = worker.clone().map(|w| (w, batch.unwrap_or(id)));
            }
            EventKind::Requeued { reason, .. } => {
                if reason == vnfarm_proto::event::YIELDED_REASON {
                    // Asked back by the scheduler: that dispatch does not count towards the limit.
                    self.dispatches = self.dispatches.saturating_sub(1);
                }
                self.state = JobState::Queued;
                self.local.dispatch_pending = false;
                self.local.recovering = false;
                self.worker = None;
                self.progress = None;
                change.unassign = true;
                change.owe_cancel = self.local.cancel_requested;
            }
            EventKind::Started { worker, .. } => {
                self.state = JobState::Running;
                self.local.recovering = false;
                // Every run counts, on whichever worker: the message's own delivery count starts
                // again at each dispatch.
                self.attempts += 1;
                self.worker = Some(worker.clone());
                self.progress = None;
            }
            EventKind::Progress { step, total } => {
                self.progress = Some(Progress {
                    step: *step,
                    total: *total,
                });
            }
            EventKind::Completed {
                outputs,
                manifest,
                worker,
                ..
            } => {
                self.state = JobState::Completed;
                self.outputs = outputs.clone();
                self.manifest = Some(manifest.clone());
                if worker.is_some() {
                    self.worker = worker.clone();
                }
                change.unassign = true;
                // Its worker holds the images it made: edits of them go there first.
                if let Some(w) = worker
                    && matches!(
                        self.submission.as_ref().map(|s| &s.job),
                        Some(JobSpec::Generate(_))
                    )
                {
                    change.made = Some((w.clone(), outputs.len()));
                }
            }
            EventKind::Failed {
                failure,
                message,
                retryable,
            } => {
                self.failure = Some(Failure {
                    kind: *failure,
                    message: message.clone(),
                });
                self.state = if *retryable {
                    JobState::Retrying
                } else {
                    JobState::Failed
                };
                change.unassign = !retryable;
            }
            EventKind::Cancelled { by, .. } => {
                self.state = JobState::Cancelled;
                if self.cancelled_by.is_none() {
                    self.cancelled_by.clone_from(by);
                }
                change.unassign = true;
            }
        }
        // Keep one progress event while running (a resuming client needs the latest), none after.
        if matches!(ev.event.kind, EventKind::Progress { .. })
            && let Some(last) = self.history.last_mut()
            && matches!(last.event.kind, EventKind::Progress { .. })
        {
            *last = ev;
        } else {
            self.history.push(ev);
        }
        change.terminal = self.state.is_terminal();
        if change.terminal {
            self.history
                .retain(|e| !matches!(e.event.kind, EventKind::Progress { .. }));
            self.history.shrink_to_fit();
        }
        change
    }
}

/// The entries of `files` that a pipeline's job names: its LoRAs and a generate's checkpoint.
fn named_files(
    job: &JobSpec,
    files: &BTreeMap<String, ContentHash>,
) -> BTreeMap<String, ContentHash> {
    let (loras, checkpoint) = match job {
        JobSpec::Generate(g) => (&g.loras, g.checkpoint.as_ref()),
        JobSpec::Edit(e) => (&e.loras, None),
        JobSpec::Upscale(_) | JobSpec::Pipeline(_) => {
            return BTreeMap::new();
        }
    };
    loras
        .iter()
        .map(|l| &l.name)
        .chain(checkpoint)
        .filter_map(|name| Some((name.clone(), files.get(name)?.clone())))
        .collect()
}
