//! The live job registry and worker registry: a projection of the event stream plus what the scheduler
//! decided locally and has not yet seen come back (dispatches in flight).
//!
//! Invariants:
//! - A job's state only changes through [`Registry::apply`] of an event from the stream, in stream order;
//!   the first terminal event wins, later ones are kept in the history but change nothing.
//! - A job is dispatched at most once at a time: `dispatch_pending` is set when the scheduler publishes
//!   it to a worker queue and cleared when the `dispatched` event comes back.
//! - A worker's load counts jobs from the moment they are dispatched to it (not when it reports them).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::{
    EventKind, FailureKind, Heartbeat, ImageRef, JobId, JobSpec, ModelFamily, Priority, Submission,
    WorkerId, WorkerState,
};

/// How many recent events are kept for clients resuming the all-events stream.
const RECENT_EVENTS: usize = 50_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
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
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => JobState::Queued,
            "dispatched" => JobState::Dispatched,
            "running" => JobState::Running,
            "retrying" => JobState::Retrying,
            "completed" => JobState::Completed,
            "failed" => JobState::Failed,
            "cancelled" => JobState::Cancelled,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Progress {
    pub step: u32,
    pub total: u32,
}

#[derive(Clone, Debug)]
pub struct JobRecord {
    pub id: JobId,
    /// `None` for a job known only from a `failed` event (a malformed submission).
    pub submission: Option<Submission>,
    pub parent: Option<JobId>,
    pub children: Vec<JobId>,
    pub state: JobState,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub worker: Option<WorkerId>,
    pub dispatches: u32,
    pub attempts: u32,
    pub progress: Option<Progress>,
    pub outputs: Vec<String>,
    pub manifest: Option<String>,
    pub failure: Option<Failure>,
    pub events: Vec<SequencedEvent>,
    // Local decisions, not (yet) in the stream.
    pub dispatch_pending: bool,
    pub cancel_requested: bool,
    pub finishing: bool,
}

impl JobRecord {
    /// A job as its first event (`ev`) makes it known: in `state`, nothing else recorded yet.
    fn first_seen(id: JobId, state: JobState, ev: SequencedEvent) -> Self {
        let at = ev.event.at;
        Self {
            id,
            submission: None,
            parent: None,
            children: Vec::new(),
            state,
            created_at: at,
            updated_at: at,
            worker: None,
            dispatches: 0,
            attempts: 0,
            progress: None,
            outputs: Vec::new(),
            manifest: None,
            failure: None,
            events: vec![ev],
            dispatch_pending: false,
            cancel_requested: false,
            finishing: false,
        }
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

    /// The jobs whose outputs this one takes as inputs.
    pub fn dependencies(&self) -> Vec<JobId> {
        let inputs = match self.submission.as_ref().map(|s| &s.job) {
            Some(JobSpec::Edit(e)) => e.images(),
            Some(JobSpec::Upscale(u)) => vec![&u.input],
            Some(JobSpec::Generate(_) | JobSpec::Pipeline(_)) | None => Vec::new(),
        };
        inputs
            .into_iter()
            .filter_map(|input| match input {
                ImageRef::JobOutput { job, .. } => Some(*job),
                ImageRef::Stored(_) | ImageRef::Inline(_) => None,
            })
            .collect()
    }

    pub fn view(&self) -> JobView<'_> {
        JobView {
            id: self.id,
            kind: self.kind(),
            state: self.state,
            priority: self.priority(),
            parent: self.parent,
            children: &self.children,
            created_at: self.created_at,
            updated_at: self.updated_at,
            worker: self.worker.as_ref(),
            dispatches: self.dispatches,
            attempts: self.attempts,
            progress: self.progress.as_ref(),
            outputs: &self.outputs,
            manifest: self.manifest.as_deref(),
            failure: self.failure.as_ref(),
            submission: self.submission.as_ref(),
        }
    }
}

/// A job as the HTTP API shows it.
#[derive(Debug, Serialize)]
pub struct JobView<'a> {
    pub id: JobId,
    pub kind: &'static str,
    pub state: JobState,
    pub priority: Priority,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<JobId>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub children: &'a [JobId],
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub worker: Option<&'a WorkerId>,
    pub dispatches: u32,
    pub attempts: u32,
    pub progress: Option<&'a Progress>,
    pub outputs: &'a [String],
    pub manifest: Option<&'a str>,
    pub failure: Option<&'a Failure>,
    pub submission: Option<&'a Submission>,
}

#[derive(Clone, Debug)]
pub struct WorkerRecord {
    pub id: WorkerId,
    pub last_heartbeat: Option<(Instant, Heartbeat)>,
    /// Jobs dispatched to it and not yet finished or returned.
    pub assigned: BTreeSet<JobId>,
}

impl WorkerRecord {
    pub fn alive(&self, timeout: Duration) -> bool {
        self.last_heartbeat
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < timeout)
    }

    /// Ready, recently heard from, and serving `model`, with a free slot.
    pub fn can_take(&self, model: ModelFamily, timeout: Duration) -> bool {
        match &self.last_heartbeat {
            Some((at, hb)) => {
                at.elapsed() < timeout
                    && hb.state == WorkerState::Ready
                    && hb.models.contains(&model)
                    && (self.assigned.len() as u32) < hb.slots
            }
            None => false,
        }
    }
}

/// Something the scheduler must publish because of what the registry now holds.
#[derive(Debug, Clone, PartialEq)]
pub enum FollowUp {
    Event(JobId, EventKind),
}

#[derive(Default)]
pub struct Registry {
    pub jobs: BTreeMap<JobId, JobRecord>,
    /// Jobs not in a terminal state.
    pub active: BTreeSet<JobId>,
    pub idempotency: HashMap<String, JobId>,
    pub workers: BTreeMap<WorkerId, WorkerRecord>,
    pub recent: VecDeque<SequencedEvent>,
    /// Offset of the next event to read from the stream.
    pub next_offset: u64,
}

impl Registry {
    pub fn worker_mut(&mut self, id: &WorkerId) -> &mut WorkerRecord {
        self.workers
            .entry(id.clone())
            .or_insert_with(|| WorkerRecord {
                id: id.clone(),
                last_heartbeat: None,
                assigned: BTreeSet::new(),
            })
    }

    pub fn heartbeat(&mut self, hb: Heartbeat) {
        let w = self.worker_mut(&hb.worker.clone());
        w.last_heartbeat = Some((Instant::now(), hb));
    }

    fn unassign(&mut self, job: JobId) {
        for w in self.workers.values_mut() {
            w.assigned.remove(&job);
        }
    }

    /// Applies one event read from the stream at `seq`.
    pub fn apply(&mut self, ev: SequencedEvent) {
        self.next_offset = self.next_offset.max(ev.seq + 1);
        self.recent.push_back(ev.clone());
        if self.recent.len() > RECENT_EVENTS {
            self.recent.pop_front();
        }
        let id = ev.event.job_id;
        let at = ev.event.at;
        if let EventKind::Queued {
            submission,
            parent,
            children,
        } = &ev.event.kind
        {
            if self.jobs.contains_key(&id) {
                return; // a duplicate submission of a known id changes nothing
            }
            if let Some(key) = &submission.idempotency_key {
                self.idempotency.entry(key.clone()).or_insert(id);
            }
            let record = JobRecord {
                submission: Some((**submission).clone()),
                parent: *parent,
                children: children.clone(),
                ..JobRecord::first_seen(id, JobState::Queued, ev)
            };
            self.jobs.insert(id, record);
            self.active.insert(id);
            return;
        }
        if let std::collections::btree_map::Entry::Vacant(e) = self.jobs.entry(id) {
            // Only a failure can name a job the registry never saw (a submission too broken to queue).
            let EventKind::Failed {
                failure, message, ..
            } = &ev.event.kind
            else {
                return;
            };
            let failure = Failure {
                kind: *failure,
                message: message.clone(),
            };
            e.insert(JobRecord {
                failure: Some(failure),
                ..JobRecord::first_seen(id, JobState::Failed, ev)
            });
            return;
        }
        let kind = ev.event.kind.clone();
        let job = self.jobs.get_mut(&id).expect("checked above");
        job.events.push(ev);
        if job.state.is_terminal() {
            return;
        }
        job.updated_at = at;
        let mut unassign = false;
        match kind {
            EventKind::Queued { .. } => unreachable!("handled above"),
            EventKind::Dispatched { worker, .. } => {
                if job.state == JobState::Queued {
                    job.state = JobState::Dispatched;
                }
                job.dispatch_pending = false;
                job.dispatches += 1;
                job.worker = worker.clone();
                if let Some(w) = worker {
                    self.worker_mut(&w).assigned.insert(id);
                }
                return;
            }
            EventKind::Requeued { .. } => {
                job.state = JobState::Queued;
                job.dispatch_pending = false;
                job.worker = None;
                job.progress = None;
                unassign = true;
            }
            EventKind::Started { worker, attempt } => {
                job.state = JobState::Running;
                job.attempts = job.attempts.max(attempt);
                job.worker = Some(worker);
                job.progress = None;
            }
            EventKind::Progress { step, total } => {
                job.progress = Some(Progress { step, total });
            }
            EventKind::Completed {
                outputs,
                manifest,
                worker,
                ..
            } => {
                job.state = JobState::Completed;
                job.outputs = outputs;
                job.manifest = Some(manifest);
                if worker.is_some() {
                    job.worker = worker;
                }
                unassign = true;
            }
            EventKind::Failed {
                failure,
                message,
                retryable,
            } => {
                job.failure = Some(Failure {
                    kind: failure,
                    message,
                });
                job.state = if retryable {
                    JobState::Retrying
                } else {
                    JobState::Failed
                };
                unassign = !retryable;
            }
            EventKind::Cancelled { .. } => {
                job.state = JobState::Cancelled;
                unassign = true;
            }
        }
        if self.jobs[&id].state.is_terminal() {
            self.active.remove(&id);
        }
        if unassign {
            self.unassign(id);
        }
    }

    /// Events the scheduler owes now: finished pipelines, jobs whose dependency failed.
    pub fn follow_ups(&mut self) -> Vec<FollowUp> {
        let mut out = Vec::new();
        let active: Vec<JobId> = self.active.iter().copied().collect();
        for id in active {
            let job = &self.jobs[&id];
            if job.finishing || job.state.is_terminal() {
                continue;
            }
            let event = if !job.children.is_empty() {
                let children: Vec<&JobRecord> = job
                    .children
                    .iter()
                    .filter_map(|c| self.jobs.get(c))
                    .collect();
                if children.len() == job.children.len()
                    && children.iter().all(|c| c.state == JobState::Completed)
                {
                    let outputs = children
                        .iter()
                        .flat_map(|c| c.outputs.iter().cloned())
                        .collect();
                    let manifest = children
                        .first()
                        .and_then(|c| c.manifest.clone())
                        .unwrap_or_default();
                    Some(EventKind::Completed {
                        outputs,
                        manifest,
                        worker: None,
                        timings: Default::default(),
                    })
                } else if let Some(bad) = children
                    .iter()
                    .find(|c| matches!(c.state, JobState::Failed | JobState::Cancelled))
                {
                    if job.cancel_requested {
                        Some(EventKind::Cancelled {
                            reason: "pipeline cancelled".into(),
                        })
                    } else {
                        Some(EventKind::Failed {
                            failure: FailureKind::DependencyFailed,
                            message: format!(
                                "pipeline job {} {}",
                                bad.id,
                                if bad.state == JobState::Failed {
                                    "failed"
                                } else {
                                    "was cancelled"
                                }
                            ),
                            retryable: false,
                        })
                    }
                } else {
                    None
                }
            } else if job.state == JobState::Queued && !job.dispatch_pending {
                job.dependencies()
                    .iter()
                    .filter_map(|d| self.jobs.get(d))
                    .find(|dep| matches!(dep.state, JobState::Failed | JobState::Cancelled))
                    .map(|dep| EventKind::Failed {
                        failure: FailureKind::DependencyFailed,
                        message: format!("input job {} did not complete", dep.id),
                        retryable: false,
                    })
            } else {
                None
            };
            if let Some(event) = event {
                self.jobs
                    .get_mut(&id)
                    .expect("iterating known ids")
                    .finishing = true;
                out.push(FollowUp::Event(id, event));
            }
        }
        out
    }

    /// Chooses up to one worker per dispatchable job: interactive before batch, oldest first, each to
    /// the least-loaded live worker serving its model. Marks the choices pending and counts them.
    pub fn plan_dispatch(&mut self, heartbeat_timeout: Duration) -> Vec<(JobId, WorkerId)> {
        let mut ready: Vec<(Priority, JobId)> = Vec::new();
        for id in &self.active {
            let job = &self.jobs[id];
            if job.state != JobState::Queued
                || job.dispatch_pending
                || job.cancel_requested
                || job.finishing
                || job.model().is_none()
            {
                continue;
            }
            // A pipeline's job waits until the pipeline itself is recorded (its commit point).
            if job.parent.is_some_and(|p| !self.jobs.contains_key(&p)) {
                continue;
            }
            let dep_done = job
                .dependencies()
                .iter()
                .filter_map(|d| self.jobs.get(d))
                .all(|dep| dep.state == JobState::Completed);
            if dep_done {
                ready.push((job.priority(), *id));
            }
        }
        ready.sort_by_key(|(p, id)| (*p != Priority::Interactive, *id));
        let mut plan = Vec::new();
        for (_, id) in ready {
            let model = self.jobs[&id].model().expect("filtered above");
            let best = self
                .workers
                .values()
                .filter(|w| w.can_take(model, heartbeat_timeout))
                .min_by_key(|w| (w.assigned.len(), w.id.clone()))
                .map(|w| w.id.clone());
            let Some(worker) = best else { continue };
            self.worker_mut(&worker).assigned.insert(id);
            self.jobs.get_mut(&id).expect("known id").dispatch_pending = true;
            plan.push((id, worker));
        }
        plan
    }

    /// Jobs in `dispatched` for longer than `threshold` (see `Scheduler::requeue_stale`).
    pub fn stale_dispatches(&mut self, now: DateTime<Utc>, threshold: Duration) -> Vec<JobId> {
        let threshold = chrono::Duration::from_std(threshold).unwrap_or(chrono::Duration::MAX);
        let mut stale = Vec::new();
        for id in &self.active {
            let job = self.jobs.get_mut(id).expect("active jobs are known");
            if job.state == JobState::Dispatched
                && !job.dispatch_pending
                && now - job.updated_at > threshold
            {
                // Marked pending until the requeue comes back, so it is not reported twice.
                job.dispatch_pending = true;
                stale.push(*id);
            }
        }
        stale
    }

    /// Undoes a planned dispatch that could not be published.
    pub fn dispatch_failed(&mut self, job: JobId, worker: &WorkerId) {
        self.worker_mut(worker).assigned.remove(&job);
        if let Some(j) = self.jobs.get_mut(&job) {
            j.dispatch_pending = false;
        }
    }

    pub fn counts_by_state(&self) -> HashMap<JobState, usize> {
        let mut counts = HashMap::new();
        for id in &self.active {
            *counts.entry(self.jobs[id].state).or_default() += 1;
        }
        counts
    }

    pub fn live_workers(&self, timeout: Duration) -> HashSet<WorkerId> {
        self.workers
            .values()
            .filter(|w| w.alive(timeout))
            .map(|w| w.id.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnfarm_proto::{Event, GenerateSpec, Sampler};

    fn generate() -> Submission {
        Submission {
            schema_version: 1,
            job_id: None,
            idempotency_key: None,
            priority: Priority::Batch,
            deadline: None,
            job: JobSpec::Generate(GenerateSpec {
                prompt: "x".into(),
                negative_prompt: String::new(),
                width: 256,
                height: 256,
                steps: 1,
                cfg: 1.0,
                sampler: Sampler::Euler,
                seed: Some(1),
                count: 1,
            }),
        }
    }

    fn worker(id: &str, slots: u32) -> Heartbeat {
        Heartbeat {
            worker: id.parse().unwrap(),
            state: WorkerState::Ready,
            models: ModelFamily::ALL.to_vec(),
            slots,
            in_flight: 0,
            running: None,
            gpu_memory_bytes: None,
            encode_cache: vec![],
            version: "t".into(),
            at: Utc::now(),
        }
    }

    struct Seq(u64);
    impl Seq {
        fn ev(&mut self, id: JobId, kind: EventKind) -> SequencedEvent {
            self.0 += 1;
            SequencedEvent {
                seq: self.0,
                event: Event::now(id, kind),
            }
        }
    }

    #[test]
    fn least_loaded_dispatch_counts_at_dispatch() {
        let mut r = Registry::default();
        let mut s = Seq(0);
        r.heartbeat(worker("a", 1));
        r.heartbeat(worker("b", 2));
        let ids: Vec<JobId> = (0..4).map(|_| JobId::new()).collect();
        for id in &ids {
            r.apply(s.ev(
                *id,
                EventKind::Queued {
                    submission: Box::new(generate()),
                    parent: None,
                    children: vec![],
                },
            ));
        }
        let plan = r.plan_dispatch(Duration::from_secs(5));
        // Three slots in all: a gets one, b two; the fourth job waits.
        assert_eq!(plan.len(), 3);
        assert_eq!(plan.iter().filter(|(_, w)| w.as_str() == "a").count(), 1);
        assert!(
            r.plan_dispatch(Duration::from_secs(5)).is_empty(),
            "pending dispatches are not repeated"
        );
        // A completion frees a slot.
        let (done, w) = plan[0].clone();
        r.apply(s.ev(
            done,
            EventKind::Dispatched {
                queue: "q".into(),
                worker: Some(w),
            },
        ));
        r.apply(s.ev(
            done,
            EventKind::Completed {
                outputs: vec![],
                manifest: "m".into(),
                worker: None,
                timings: Default::default(),
            },
        ));
        let next = r.plan_dispatch(Duration::from_secs(5));
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].0, ids[3]);
    }

    #[test]
    fn first_terminal_event_wins() {
        let mut r = Registry::default();
        let mut s = Seq(0);
        let id = JobId::new();
        r.apply(s.ev(
            id,
            EventKind::Queued {
                submission: Box::new(generate()),
                parent: None,
                children: vec![],
            },
        ));
        r.apply(s.ev(
            id,
            EventKind::Completed {
                outputs: vec!["o".into()],
                manifest: "m".into(),
                worker: None,
                timings: Default::default(),
            },
        ));
        r.apply(s.ev(
            id,
            EventKind::Failed {
                failure: FailureKind::Engine,
                message: "late".into(),
                retryable: false,
            },
        ));
        r.apply(s.ev(
            id,
            EventKind::Completed {
                outputs: vec!["o".into()],
                manifest: "m".into(),
                worker: None,
                timings: Default::default(),
            },
        ));
        let job = &r.jobs[&id];
        assert_eq!(job.state, JobState::Completed);
        assert_eq!(job.events.len(), 4, "history keeps every event");
        assert!(r.active.is_empty());
    }

    #[test]
    fn pipelines_finish_with_their_children() {
        let mut r = Registry::default();
        let mut s = Seq(0);
        let (p, c1, c2) = (JobId::new(), JobId::new(), JobId::new());
        r.apply(s.ev(
            p,
            EventKind::Queued {
                submission: Box::new(generate()),
                parent: None,
                children: vec![c1, c2],
            },
        ));
        for c in [c1, c2] {
            r.apply(s.ev(
                c,
                EventKind::Queued {
                    submission: Box::new(generate()),
                    parent: Some(p),
                    children: vec![],
                },
            ));
        }
        r.apply(s.ev(
            c1,
            EventKind::Completed {
                outputs: vec!["a".into()],
                manifest: "m".into(),
                worker: None,
                timings: Default::default(),
            },
        ));
        assert!(r.follow_ups().is_empty());
        r.apply(s.ev(
            c2,
            EventKind::Failed {
                failure: FailureKind::BadInput,
                message: "x".into(),
                retryable: false,
            },
        ));
        let f = r.follow_ups();
        assert!(
            matches!(&f[..], [FollowUp::Event(id, EventKind::Failed { failure: FailureKind::DependencyFailed, .. })] if *id == p),
            "{f:?}"
        );
        assert!(r.follow_ups().is_empty(), "a follow-up is owed once");
    }
}
