//! The job registry and worker registry: a projection of the event stream, plus the decisions the
//! scheduler took locally and has not yet seen come back (dispatches and follow-ups in flight).
//!
//! Encapsulated: every field is private. Job state changes only through [`Registry::apply`] of an
//! event from the stream, in stream order; the local decision flags change only through the
//! decision methods ([`Registry::plan_dispatch`], [`Registry::take_follow_ups`],
//! [`Registry::request_cancel`], ...). Readers get views. A stored job changes only through the
//! store's one update function (`store::Jobs::update`), which keeps every index right, so no
//! change can forget one.
//!
//! # Layout
//!
//! - `record.rs`: the job record, its state and the local decision flags.
//! - `store.rs`: the records and the indexes the decisions use, behind the one update function.
//! - `apply.rs`: event application, in stream order; retention.
//! - `follow_ups.rs`: terms, the follow-up events the active scheduler owes, stale dispatches,
//!   cancellation.
//! - `plan.rs`: the dispatch policy, with its tests. `workers.rs`: the worker records.
//! - `eta.rs`: estimates of when waiting and running jobs start and finish: the rates learned
//!   from the stream, the queue simulation, and the order dispatch takes waiting jobs in;
//!   `eta/arrivals.rs`: how fast interactive work arrives, learned from the same stream.
//! - `names.rs`: the model names workers advertise; jobs whose named checkpoint left the farm.
//! - `people.rs`: people and their tokens' digests, from their own events in the same stream.
//! - `shares.rs`: fair share: the queue's controls (pauses) and each person's GPU time today.
//! - `testing.rs` (tests only): submissions, heartbeats and an event stream the tests share.
//! - `snapshot.rs`: the durable part, as a snapshot writes and reads it.
//!
//! Invariants:
//! - The first terminal event of a job wins; later events of a finished job change nothing and are
//!   not kept.
//! - The first `queued` event with an idempotency key (or a job id) wins: a later one is a duplicate
//!   and creates nothing, so a key makes one job however many schedulers accept it at once.
//! - A pipeline is one `queued` event: its jobs are derived from it ([`vnfarm_proto::pipeline_jobs`]),
//!   so a pipeline is either wholly known or not at all.
//! - A job is dispatched at most once at a time: `dispatch_pending` is set when the scheduler decides
//!   and cleared when the `dispatched` event comes back. A worker's load counts jobs from the moment
//!   they are dispatched to it.
//! - Cost is flat in the backlog: dispatchable jobs sit in a ready index per model, jobs waiting on
//!   an input sit under that input, follow-ups are owed by the events that cause them; nothing scans
//!   every job per event.
//! - Memory is bounded: a finished job keeps no progress history, and finished jobs are forgotten by
//!   count and age measured on event timestamps, so a restarted scheduler and a long-running one
//!   forget the same jobs.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::http::JobState;
use vnfarm_proto::{Heartbeat, JobId, ModelFamily, PersonEvent, Priority, WorkerId};

use crate::config::DispatchConfig;

mod apply;
mod eta;
mod follow_ups;
mod names;
mod people;
mod plan;
mod record;
mod shares;
mod snapshot;
mod store;
#[cfg(test)]
mod testing;
mod workers;

use record::Local;
use store::Jobs;

pub use eta::{
    EstimateWork, MadeEstimates, Outcome as EstimateOutcome, REFRESH as ESTIMATE_REFRESH, Rates,
};
pub use follow_ups::CancelRefusal;
pub use names::AdvertisedNames;
pub use people::{People, Person, token_digest};
pub use plan::{Decision, Dispatch, Plan, Yield};
pub use record::JobRecord;
pub use shares::{Held, Pause, Shares};
pub use snapshot::{Snapshot, SnapshotView};
pub use workers::{Route, WorkerRecord};

/// How many recent events are kept for clients resuming the all-events stream.
const RECENT_EVENTS: usize = 20_000;
/// Interactive jobs dispatched in a row, at most, while a batch job could go (starvation freedom).
pub const INTERACTIVE_BURST: u32 = 4;

/// How long finished jobs stay in memory.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// Finished top-level jobs kept (a pipeline counts once, with its jobs).
    pub max_jobs: usize,
    /// Finished jobs older than this (by their final event's time) are forgotten.
    pub max_age: chrono::Duration,
}

impl Retention {
    /// The configuration's `retain_jobs` and `retain_age_s`.
    pub fn of(config: &crate::config::Config) -> Self {
        Self {
            max_jobs: config.retain_jobs,
            max_age: chrono::Duration::seconds(config.retain_age_s.min(i64::MAX as u64) as i64),
        }
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            max_jobs: 10_000,
            max_age: chrono::Duration::days(7),
        }
    }
}

/// Why an unfinished job is not moving: the facts the API puts in words.
#[derive(Clone, Debug, PartialEq)]
pub enum Blocker {
    /// A worker failed it transiently; it runs again.
    Retrying,
    /// Sent to a worker (the one named, when the event named one) that has not started it.
    Starting(Option<WorkerId>),
    /// A pipeline, waiting for its jobs to finish.
    PipelineJobs,
    Cancelling,
    BeingDispatched,
    /// Its input jobs that have not completed.
    Inputs(Vec<JobId>),
    /// No live worker serves its route; it runs when one does.
    NoWorker(Route),
    /// Held for these busy workers, which hold its input's encodings (for a while, then any
    /// worker).
    Holders(Vec<WorkerId>),
    /// Its owner's work may not start now: paused, at their cap, or past their quota.
    Share(Held),
    /// A free slot of a worker that serves it.
    FreeSlot,
}

#[derive(Default)]
pub struct Registry {
    retention: Retention,
    /// The records and the indexes that are functions of them.
    jobs: Jobs,
    idempotency: HashMap<String, JobId>,
    /// For each job, the waiting jobs that take its output as input.
    dependents: HashMap<JobId, Vec<JobId>>,
    /// The worker `round_robin` chose last.
    rr_cursor: Option<WorkerId>,
    /// Jobs whose follow-up (pipeline result, failed dependency) must be worked out.
    owed: BTreeSet<JobId>,
    /// Finished top-level jobs in the order they finished, with their final event's time.
    finished: VecDeque<(DateTime<Utc>, JobId)>,
    workers: BTreeMap<WorkerId, WorkerRecord>,
    /// People and their tokens (durable: part of a snapshot).
    people: People,
    /// The queue's controls and people's GPU time today (durable: part of a snapshot).
    shares: Shares,
    recent: VecDeque<SequencedEvent>,
    /// Offset of the next event to read from the stream.
    next_offset: u64,
    /// The newest event time seen: the clock retention is measured on.
    latest: Option<DateTime<Utc>>,
    /// Interactive jobs dispatched in a row while batch jobs waited (see `plan_dispatch`).
    interactive_streak: u32,
    /// How long runs took, learned from the stream (durable: part of a snapshot).
    rates: Rates,
    /// The estimates last made from `rates` and the queue.
    estimates: eta::Estimates,
}

impl Registry {
    pub fn new(retention: Retention) -> Self {
        Self {
            retention,
            ..Self::default()
        }
    }

    // ----- reading -----

    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    pub fn job(&self, id: JobId) -> Option<&JobRecord> {
        self.jobs.get(&id)
    }

    pub fn contains(&self, id: JobId) -> bool {
        self.jobs.contains_key(&id)
    }

    /// The job an idempotency key names.
    pub fn resolve_key(&self, key: &str) -> Option<JobId> {
        self.idempotency.get(key).copied()
    }

    /// Jobs in memory, newest first.
    pub fn jobs_newest_first(&self) -> impl Iterator<Item = &JobRecord> {
        self.jobs.newest_first()
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.len() == 0
    }

    /// People and their tokens.
    pub fn people(&self) -> &People {
        &self.people
    }

    /// Applies a person's event read from the stream at `seq`; returns whether it changed
    /// anything. A cancel request names its person on the job (the first one wins, as the first
    /// terminal event does); a job finished before it is left as it is. A move to the front
    /// moves a job that is still queued.
    pub fn apply_person(&mut self, seq: u64, ev: &PersonEvent) -> bool {
        use vnfarm_proto::PersonEventKind as K;
        self.next_offset = self.next_offset.max(seq + 1);
        self.latest = self.latest.max(Some(ev.at));
        match &ev.kind {
            K::MovedToFront { job_id } => self
                .jobs
                .update(*job_id, |job| {
                    let queued = job.state == JobState::Queued;
                    if queued {
                        job.front = Some((seq, ev.person.clone()));
                    }
                    queued
                })
                .unwrap_or(false),
            K::FarmPaused | K::FarmResumed | K::WorkPaused { .. } | K::WorkResumed { .. } => {
                self.apply_control(ev)
            }
            vnfarm_proto::PersonEventKind::CancelRequested { job_id } => self
                .jobs
                .update(*job_id, |job| {
                    let first = job.cancelled_by.is_none() && !job.state.is_terminal();
                    if first {
                        job.cancelled_by = Some(ev.person.clone());
                    }
                    first
                })
                .unwrap_or(false),
            vnfarm_proto::PersonEventKind::TokenCreated { .. }
            | vnfarm_proto::PersonEventKind::TokenRevoked { .. } => self.people.apply(ev),
        }
    }

    pub fn workers(&self) -> impl Iterator<Item = &WorkerRecord> {
        self.workers.values()
    }

    pub fn worker(&self, id: &WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(id)
    }

    /// Recent events after `seq`, for a client resuming the all-events stream.
    pub fn recent_after(&self, seq: u64) -> Vec<SequencedEvent> {
        let start = self.recent.partition_point(|e| e.seq <= seq);
        self.recent.range(start..).cloned().collect()
    }

    /// Jobs in memory by state.
    pub fn count(&self, state: JobState) -> usize {
        self.jobs.count(state)
    }

    /// Queued jobs of a model and priority.
    pub fn backlog(&self, model: ModelFamily, priority: Priority) -> usize {
        self.jobs.backlog(model, priority)
    }

    /// Why an unfinished job is where it is (`None` for a finished or running one).
    pub fn blocker(
        &self,
        job: &JobRecord,
        timeout: Duration,
        dispatch: &DispatchConfig,
    ) -> Option<Blocker> {
        match job.state {
            JobState::Completed | JobState::Failed | JobState::Cancelled => None,
            JobState::Running | JobState::Unknown => None,
            JobState::Retrying => Some(Blocker::Retrying),
            JobState::Dispatched => Some(Blocker::Starting(job.worker.clone())),
            JobState::Queued if job.is_pipeline() => Some(Blocker::PipelineJobs),
            JobState::Queued if job.local.cancel_requested => Some(Blocker::Cancelling),
            JobState::Queued if job.local.dispatch_pending => Some(Blocker::BeingDispatched),
            JobState::Queued if job.local.unmet > 0 => Some(Blocker::Inputs(
                job.dependencies()
                    .into_iter()
                    .filter(|d| {
                        self.jobs
                            .get(d)
                            .is_some_and(|j| j.state != JobState::Completed)
                    })
                    .collect(),
            )),
            JobState::Queued => {
                let route = job.route()?;
                if let Some(held) = self.held(job.owner(), dispatch, Utc::now().date_naive()) {
                    return Some(Blocker::Share(held));
                }
                if !self.workers.values().any(|w| w.serves(&route, timeout)) {
                    return Some(Blocker::NoWorker(route));
                }
                if job.local.hold_until.is_some() {
                    let holders = job
                        .group_key()
                        .map(|key| {
                            self.workers
                                .values()
                                .filter(|w| w.holds(&key))
                                .map(|w| w.id().clone())
                                .collect()
                        })
                        .unwrap_or_default();
                    return Some(Blocker::Holders(holders));
                }
                Some(Blocker::FreeSlot)
            }
        }
    }

    /// Changes a job's local decision flags (through the store, which keeps the indexes right).
    fn set_local(&mut self, id: JobId, f: impl FnOnce(&mut Local)) {
        self.jobs.update(id, |job| f(&mut job.local));
    }

    fn worker_mut(&mut self, id: &WorkerId) -> &mut WorkerRecord {
        self.workers
            .entry(id.clone())
            .or_insert_with(|| WorkerRecord::new(id.clone()))
    }

    pub fn heartbeat(&mut self, hb: Heartbeat) {
        self.heartbeat_at(hb, Instant::now());
    }

    fn heartbeat_at(&mut self, hb: Heartbeat, now: Instant) {
        let id = hb.worker.clone();
        // Started here, by the stream: what the beat should list as held.
        let running: Vec<JobId> = self.workers.get(&id).map_or_else(Vec::new, |w| {
            w.assigned()
                .filter(|job| {
                    self.jobs.get(job).is_some_and(|j| {
                        j.state == JobState::Running && j.worker.as_ref() == Some(&id)
                    })
                })
                .collect()
        });
        let w = self.worker_mut(&id);
        w.heartbeat(hb, now);
        w.check_held(&running, now);
    }

    /// Runs that ended on their worker without their final event reaching the stream (a broker
    /// can lose a confirmed message in a stream leader's fail-over): jobs started on a worker
    /// whose beats have not listed them among the jobs it holds for `grace`. Each is handed out
    /// once, with its count of dispatches, until an event of it comes back or
    /// [`Registry::recovery_failed`]; the scheduler republishes `completed` from the run's manifest
    /// or, without one, requeues that dispatch.
    pub fn unheld_runs(&mut self, grace: Duration) -> Vec<(JobId, u32)> {
        let unheld: Vec<JobId> = self
            .workers
            .values()
            .flat_map(|w| w.unheld_for(grace))
            .collect();
        let mut runs = Vec::new();
        for id in unheld {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            if job.state != JobState::Running || job.local.recovering {
                continue;
            }
            runs.push((id, job.dispatches));
            self.set_local(id, |l| l.recovering = true);
        }
        runs
    }

    /// The recovery of a run could not be published: hand it out again.
    pub fn recovery_failed(&mut self, id: JobId) {
        self.set_local(id, |l| l.recovering = false);
    }

    fn unassign(&mut self, job: JobId) {
        for w in self.workers.values_mut() {
            w.unassign(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::{EventKind, FailureKind};

    use super::testing::*;
    use super::*;

    #[test]
    fn first_terminal_event_wins_and_late_events_are_not_kept() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        s.complete(&mut r, id);
        s.fail(&mut r, id);
        s.complete(&mut r, id);
        let job = r.job(id).unwrap();
        assert_eq!(job.state(), JobState::Completed);
        assert_eq!(job.events().len(), 2, "queued and completed");
        assert_eq!(r.count(JobState::Completed), 1);
    }

    #[test]
    fn a_pipeline_is_one_event_and_finishes_with_its_jobs() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let p = s.queue(&mut r, pipeline(2));
        let children = r.job(p).unwrap().children().to_vec();
        assert_eq!(children.len(), 3, "base and two edits from the one event");
        let (base, e1, e2) = (children[0], children[1], children[2]);
        assert_eq!(r.job(e1).unwrap().parent(), Some(p));
        r.heartbeat(worker("a", 8));
        assert_eq!(
            r.plan_ll().iter().map(|(j, _)| *j).collect::<Vec<_>>(),
            vec![base],
            "the edits wait for their base"
        );
        s.complete(&mut r, base);
        assert!(r.take_follow_ups().is_empty());
        assert_eq!(r.plan_ll().len(), 2, "the base's edits are ready");
        s.complete(&mut r, e1);
        assert!(r.take_follow_ups().is_empty());
        s.fail(&mut r, e2);
        let f = r.take_follow_ups();
        assert!(
            matches!(&f[..], [(id, EventKind::Failed { failure: FailureKind::DependencyFailed, .. })] if *id == p),
            "{f:?}"
        );
        assert!(r.take_follow_ups().is_empty(), "a follow-up is owed once");
    }

    #[test]
    fn a_failed_input_fails_the_jobs_waiting_on_it() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let base = s.queue(&mut r, generate());
        let edit = s.queue(&mut r, edit_of(base));
        s.fail(&mut r, base);
        let f = r.take_follow_ups();
        assert!(
            matches!(&f[..], [(id, EventKind::Failed { .. })] if *id == edit),
            "{f:?}"
        );
        // An edit queued after its input failed is owed the same.
        let late = s.queue(&mut r, edit_of(base));
        let f = r.take_follow_ups();
        assert!(matches!(&f[..], [(id, _)] if *id == late), "{f:?}");
    }

    #[test]
    fn the_first_queued_event_of_a_key_wins() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let first = s.queue(&mut r, keyed("k"));
        let second = s.queue(&mut r, keyed("k"));
        assert_eq!(r.resolve_key("k"), Some(first));
        assert!(!r.contains(second), "the duplicate creates nothing");
        r.heartbeat(worker("a", 8));
        assert_eq!(r.plan_ll().len(), 1);
    }

    #[test]
    fn attempts_count_every_run() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        for w in ["a", "b"] {
            r.apply(s.ev(
                id,
                EventKind::Started {
                    worker: w.parse().unwrap(),
                    attempt: 1,
                },
            ));
            r.apply(s.ev(
                id,
                EventKind::Requeued {
                    reason: "worker died".into(),
                    dispatch: None,
                },
            ));
        }
        let job = r.job(id).unwrap();
        assert_eq!(job.attempts(), 2);
    }

    #[test]
    fn finished_jobs_keep_no_progress_and_are_forgotten_by_count() {
        let mut r = Registry::new(Retention {
            max_jobs: 3,
            max_age: chrono::Duration::days(1),
        });
        let mut s = Stream::new();
        let mut ids = Vec::new();
        for _ in 0..5 {
            let id = s.queue(&mut r, keyed(&format!("k{}", ids.len())));
            for step in 1..=20 {
                r.apply(s.ev(id, EventKind::Progress { step, total: 20 }));
            }
            assert_eq!(r.job(id).unwrap().events().len(), 2, "one progress kept");
            s.complete(&mut r, id);
            assert_eq!(r.job(id).unwrap().events().len(), 2, "none once finished");
            ids.push(id);
        }
        assert_eq!(r.len(), 3);
        assert!(!r.contains(ids[0]) && !r.contains(ids[1]));
        assert_eq!(r.resolve_key("k0"), None, "forgotten keys go too");
        assert_eq!(r.count(JobState::Completed), 3);
    }

    #[test]
    fn finished_jobs_are_forgotten_by_age_on_event_time() {
        let mut r = Registry::new(Retention {
            max_jobs: 100,
            max_age: chrono::Duration::hours(1),
        });
        let mut s = Stream::new();
        let old = s.queue(&mut r, generate());
        s.complete(&mut r, old);
        s.at += chrono::Duration::hours(2);
        let new = s.queue(&mut r, generate());
        assert!(!r.contains(old));
        assert!(r.contains(new));
    }

    #[test]
    fn a_snapshot_taken_is_not_changed_by_later_events() {
        let mut r = Registry::new(Retention::default());
        let mut s = Stream::new();
        let job = s.queue(&mut r, generate());
        let view = r.snapshot();
        s.complete(&mut r, job);
        assert_eq!(r.job_state(job), Some(JobState::Completed));
        let mut bytes = Vec::new();
        view.write(&mut bytes).unwrap();
        let restored = Registry::restore(
            serde_json::from_slice(&bytes).unwrap(),
            Retention::default(),
        );
        assert_eq!(restored.job_state(job), Some(JobState::Queued));
        assert_eq!(restored.next_offset(), view.next_offset());
        assert!(restored.next_offset() < r.next_offset());
    }

    #[test]
    fn a_snapshot_restores_the_same_registry() {
        let mut r = Registry::new(Retention {
            max_jobs: 2,
            max_age: chrono::Duration::days(1),
        });
        let mut s = Stream::new();
        let base = s.queue(&mut r, keyed("base"));
        let edit = s.queue(&mut r, edit_of(base));
        let p = s.queue(&mut r, pipeline(1));
        let done = s.queue(&mut r, generate());
        s.complete(&mut r, done);
        let mut bytes = Vec::new();
        r.snapshot().write(&mut bytes).unwrap();
        let snapshot: Snapshot = serde_json::from_slice(&bytes).unwrap();
        let mut restored = Registry::restore(snapshot, r.retention);
        assert_eq!(restored.next_offset(), r.next_offset());
        assert_eq!(restored.len(), r.len());
        assert_eq!(restored.resolve_key("base"), Some(base));
        for state in JobState::ALL {
            assert_eq!(restored.count(state), r.count(state), "{state:?}");
        }
        // The same events then lead to the same decisions.
        for reg in [&mut r, &mut restored] {
            let mut s2 = Stream {
                seq: s.seq,
                at: s.at,
            };
            s2.complete(reg, base);
            reg.heartbeat(worker("a", 8));
        }
        let plan = |reg: &mut Registry| {
            let mut p: Vec<JobId> = reg.plan_ll().into_iter().map(|(j, _)| j).collect();
            p.sort();
            p
        };
        assert_eq!(plan(&mut r), plan(&mut restored));
        assert!(restored.contains(edit) && restored.contains(p));
    }

    /// A cancel request names its person on the job: the first wins, and one for a finished or an
    /// unknown job changes nothing; a scheduler's `cancelled` event names its person too.
    #[test]
    fn who_asked_for_a_cancel_is_recorded_on_the_job() {
        use vnfarm_proto::PersonEventKind;
        let mut r = Registry::default();
        let mut s = Stream::new();
        let (running, queued) = (s.queue(&mut r, generate()), s.queue(&mut r, generate()));
        let asked =
            |who: &str, job_id| PersonEvent::now(who, PersonEventKind::CancelRequested { job_id });
        assert!(r.apply_person(50, &asked("lee", running)));
        assert!(
            !r.apply_person(51, &asked("ann", running)),
            "the first asker wins"
        );
        assert!(!r.apply_person(52, &asked("lee", JobId::new())));
        assert_eq!(r.job(running).unwrap().cancelled_by(), Some("lee"));
        // The worker's `cancelled` names no one; the request did.
        r.apply(s.ev(
            running,
            EventKind::Cancelled {
                reason: "cancelled by request".into(),
                by: None,
            },
        ));
        assert_eq!(r.job(running).unwrap().cancelled_by(), Some("lee"));
        r.apply(s.ev(
            queued,
            EventKind::Cancelled {
                reason: "cancelled by request".into(),
                by: Some("ann".into()),
            },
        ));
        assert_eq!(r.job(queued).unwrap().cancelled_by(), Some("ann"));
        assert!(!r.apply_person(53, &asked("lee", queued)), "finished");
        assert_eq!(r.job(queued).unwrap().cancelled_by(), Some("ann"));
    }

    /// A pipeline's jobs are its owner's, also after a snapshot; a job queued without an owner is
    /// the admin's.
    #[test]
    fn a_pipelines_jobs_are_its_owners() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let p = s.queue_as(&mut r, pipeline(2), Some("ann"));
        let admins = s.queue(&mut r, generate());
        let mut bytes = Vec::new();
        r.snapshot().write(&mut bytes).unwrap();
        let restored = Registry::restore(
            serde_json::from_slice(&bytes).unwrap(),
            Retention::default(),
        );
        for reg in [&r, &restored] {
            let pipeline = reg.job(p).unwrap();
            assert_eq!(pipeline.owner(), "ann");
            assert_eq!(pipeline.children().len(), 3);
            for c in pipeline.children() {
                assert_eq!(reg.job(*c).unwrap().owner(), "ann");
            }
            assert_eq!(reg.job(admins).unwrap().owner(), "admin");
        }
        assert!(matches!(
            &r.job(p).unwrap().events()[0].event.kind,
            EventKind::Queued { owner: Some(o), .. } if o == "ann"
        ));
    }

    /// People come back from a snapshot (their events may have aged out of the stream), and a
    /// snapshot of a scheduler from before people restores with none.
    #[test]
    fn people_are_part_of_a_snapshot() {
        use vnfarm_proto::{PersonEventKind, Role};
        let mut r = Registry::default();
        let ev = PersonEvent::now(
            "ann",
            PersonEventKind::TokenCreated {
                role: Role::Lead,
                token_sha256: hex::encode(token_digest("ann's token")),
                by: "admin".into(),
            },
        );
        assert!(r.apply_person(7, &ev));
        assert_eq!(
            r.next_offset(),
            8,
            "a person's event moves the stream position"
        );
        let mut bytes = Vec::new();
        r.snapshot().write(&mut bytes).unwrap();
        let restored = Registry::restore(
            serde_json::from_slice(&bytes).unwrap(),
            Retention::default(),
        );
        assert_eq!(
            restored.people().identify("ann's token"),
            Some(("ann", Role::Lead))
        );
        let older: Snapshot = serde_json::from_value(serde_json::json!(
            {"next_offset": 3, "latest": null, "jobs": [], "finished": []}
        ))
        .unwrap();
        let restored = Registry::restore(older, Retention::default());
        assert_eq!(restored.people().iter().count(), 0);
    }

    #[test]
    fn cancelling_a_queued_job_takes_it_out_of_dispatch() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        assert!(matches!(&r.request_cancel(id, "ann").unwrap()[..], [(j, true)] if *j == id));
        r.heartbeat(worker("a", 1));
        assert!(r.plan_ll().is_empty());
        assert!(matches!(
            r.request_cancel(JobId::new(), "ann"),
            Err(CancelRefusal::NotFound)
        ));
    }

    #[test]
    fn a_new_term_redoes_lost_decisions() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        r.heartbeat(worker("a", 1));
        assert_eq!(r.plan_ll().len(), 1);
        // The dispatch was never published (the connection died); a new term dispatches again.
        r.begin_term();
        assert_eq!(r.plan_ll(), vec![(id, "a".parse().unwrap())]);
    }

    /// A run whose final event never reached the stream: its worker's beats stop listing it, and
    /// after the grace (counted in beats newer than the first that missed it) it is handed out
    /// once; a listed job, a job of a worker whose beats say nothing of what they hold, and a
    /// job not running are never handed out.
    #[test]
    fn a_started_job_its_worker_stops_holding_is_handed_out_once_after_the_grace() {
        let grace = Duration::from_secs(12);
        let mut r = Registry::default();
        let mut s = Stream::new();
        let (lost, held) = (s.queue(&mut r, generate()), s.queue(&mut r, generate()));
        let t0 = Instant::now();
        let beat = |holding: Option<Vec<JobId>>| Heartbeat {
            holding,
            ..worker("a", 2)
        };
        r.heartbeat_at(beat(Some(vec![])), t0);
        for id in [lost, held] {
            for kind in [
                EventKind::Dispatched {
                    queue: "q".into(),
                    worker: Some("a".parse().unwrap()),
                    batch: None,
                    term: Some(1),
                },
                EventKind::Started {
                    worker: "a".parse().unwrap(),
                    attempt: 1,
                },
            ] {
                r.apply(s.ev(id, kind));
            }
        }
        r.heartbeat_at(beat(Some(vec![lost, held])), t0 + grace / 4);
        r.heartbeat_at(beat(Some(vec![held])), t0 + grace / 2);
        r.heartbeat_at(beat(Some(vec![held])), t0 + grace);
        assert!(r.unheld_runs(grace).is_empty(), "within its grace");
        r.heartbeat_at(beat(Some(vec![held])), t0 + grace / 2 + grace);
        assert_eq!(r.unheld_runs(grace), vec![(lost, 1)]);
        assert!(r.unheld_runs(grace).is_empty(), "handed out once");
        r.recovery_failed(lost);
        assert_eq!(
            r.unheld_runs(grace),
            vec![(lost, 1)],
            "again after a failed publish"
        );

        // An older worker's beats say nothing of what it holds: its events alone are trusted.
        r.heartbeat_at(beat(None), t0 + 3 * grace);
        r.heartbeat_at(beat(None), t0 + 5 * grace);
        r.recovery_failed(lost);
        assert!(r.unheld_runs(grace).is_empty());
    }

    /// A requeue names the dispatch it returns: once the job has been dispatched again it keeps
    /// its new dispatch (a late requeue of the old one would let two workers run it).
    #[test]
    fn a_requeue_of_an_earlier_dispatch_leaves_the_job_where_it_is() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        let dispatched = |w: &str| EventKind::Dispatched {
            queue: "q".into(),
            worker: Some(w.parse().unwrap()),
            batch: None,
            term: Some(1),
        };
        let requeued = |dispatch| EventKind::Requeued {
            reason: "its worker holds it no longer".into(),
            dispatch,
        };
        r.apply(s.ev(id, dispatched("a")));
        r.apply(s.ev(id, requeued(None)));
        r.apply(s.ev(id, dispatched("b")));
        r.apply(s.ev(id, requeued(Some(1))));
        let job = r.job(id).unwrap();
        assert_eq!(
            (job.state(), job.worker()),
            (JobState::Dispatched, Some(&"b".parse().unwrap()))
        );
        r.apply(s.ev(id, requeued(Some(2))));
        assert_eq!(r.job(id).unwrap().state(), JobState::Queued);
    }

    /// A cancel that finds the job on its way to a worker only reaches the workers; if the job
    /// then comes back unrun (its worker was cut off), the scheduler itself owes its `cancelled`
    /// (the cluster test once saw such a job stay queued for good).
    #[test]
    fn a_job_cancelled_while_out_that_comes_back_is_cancelled_here() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let id = s.queue(&mut r, generate());
        r.heartbeat(worker("a", 1));
        assert_eq!(r.plan_ll().len(), 1);
        assert_eq!(
            r.request_cancel(id, "lead").unwrap(),
            vec![(id, false)],
            "pending: not here"
        );
        r.apply(s.ev(
            id,
            EventKind::Dispatched {
                queue: "q".into(),
                worker: Some("a".parse().unwrap()),
                batch: None,
                term: Some(1),
            },
        ));
        assert!(
            r.take_follow_ups().is_empty(),
            "on its worker: the worker reports the cancel"
        );
        r.apply(s.ev(
            id,
            EventKind::Requeued {
                reason: "returned from a worker queue (expired)".into(),
                dispatch: None,
            },
        ));
        let owed = r.take_follow_ups();
        assert!(
            matches!(owed.as_slice(), [(j, EventKind::Cancelled { by: Some(by), .. })] if *j == id && by == "lead"),
            "{owed:?}"
        );
        assert!(r.plan_ll().is_empty(), "and it is not dispatched again");
    }
}
