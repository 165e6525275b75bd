//! What the active scheduler owes and decides beyond dispatch: terms, follow-up events (a
//! pipeline's outcome, a failed input's dependents, a cancel that came back unrun), stale
//! dispatches and cancellation.

use std::time::Duration;

use chrono::{DateTime, Utc};
use vnfarm_proto::http::JobState;
use vnfarm_proto::{EventKind, FailureKind, JobId};

use super::Registry;
use super::record::JobRecord;

/// Why a cancellation was refused.
#[derive(Debug)]
pub enum CancelRefusal {
    NotFound,
    Finished(JobState),
}
impl Registry {
    /// Starts a term as the active scheduler: forgets local decisions of an earlier term (they
    /// were lost with its connection), recounts worker loads from the job states, and owes every
    /// unfinished job a follow-up check. O(jobs), once per takeover.
    pub fn begin_term(&mut self) {
        let active: Vec<JobId> = self.jobs.active().iter().copied().collect();
        for w in self.workers.values_mut() {
            w.clear_assignments();
        }
        for id in &active {
            self.set_local(*id, |l| {
                l.dispatch_pending = false;
                l.finishing = false;
                l.hold_until = None;
            });
            let job = &self.jobs[id];
            if matches!(
                job.state,
                JobState::Dispatched | JobState::Running | JobState::Retrying
            ) && let Some(w) = job.worker.clone()
            {
                let lead = job.batch.unwrap_or(*id);
                self.worker_mut(&w).assign(*id, lead);
            }
        }
        self.owed = active.into_iter().collect();
    }

    /// A standby does not act on follow-ups: it drops them, and works them all out if it takes over
    /// ([`Registry::begin_term`]).
    pub fn drop_follow_ups(&mut self) {
        self.owed.clear();
    }

    /// Events the scheduler owes now: finished pipelines, jobs whose input failed. Each is handed
    /// out once (until a new term).
    pub fn take_follow_ups(&mut self) -> Vec<(JobId, EventKind)> {
        let owed = std::mem::take(&mut self.owed);
        let mut out = Vec::new();
        for id in owed {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            if job.local.finishing || job.state.is_terminal() {
                continue;
            }
            let event = if job.is_pipeline() {
                self.pipeline_outcome(job)
            } else if job.state == JobState::Queued && !job.local.dispatch_pending {
                job.dependencies()
                    .iter()
                    .filter_map(|d| self.jobs.get(d))
                    .find(|dep| matches!(dep.state, JobState::Failed | JobState::Cancelled))
                    .map(|dep| EventKind::Failed {
                        failure: FailureKind::DependencyFailed,
                        message: format!("input job {} did not complete", dep.id),
                        retryable: false,
                    })
                    // A cancel asked while the job was out, which came back unrun: it ends here.
                    .or_else(|| {
                        job.local.cancel_requested.then(|| EventKind::Cancelled {
                            reason: "cancelled by request".into(),
                            by: job.local.cancelled_by.clone(),
                        })
                    })
            } else {
                None
            };
            if let Some(event) = event {
                self.set_local(id, |l| l.finishing = true);
                out.push((id, event));
            }
        }
        out
    }

    fn pipeline_outcome(&self, job: &JobRecord) -> Option<EventKind> {
        let children: Vec<&JobRecord> = job.children.iter().filter_map(|c| self.job(*c)).collect();
        if children.is_empty() || children.len() != job.children.len() {
            return Some(EventKind::Failed {
                failure: FailureKind::InvalidSpec,
                message: "the pipeline's jobs could not be derived from its spec".into(),
                retryable: false,
            });
        }
        if children.iter().all(|c| c.state == JobState::Completed) {
            return Some(EventKind::Completed {
                outputs: children
                    .iter()
                    .flat_map(|c| c.outputs.iter().cloned())
                    .collect(),
                manifest: children
                    .first()
                    .and_then(|c| c.manifest.clone())
                    .unwrap_or_default(),
                worker: None,
                timings: Default::default(),
            });
        }
        let bad = children
            .iter()
            .find(|c| matches!(c.state, JobState::Failed | JobState::Cancelled))?;
        Some(if job.local.cancel_requested {
            EventKind::Cancelled {
                reason: "pipeline cancelled".into(),
                by: job.local.cancelled_by.clone(),
            }
        } else {
            EventKind::Failed {
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
            }
        })
    }

    /// A follow-up could not be published: owe it again.
    pub fn follow_up_failed(&mut self, id: JobId) {
        if self
            .jobs
            .update(id, |j| j.local.finishing = false)
            .is_some()
        {
            self.owed.insert(id);
        }
    }

    /// Jobs in `dispatched` for longer than `threshold`; each is reported once until its state
    /// changes (see `Scheduler::requeue_stale`).
    pub fn stale_dispatches(&mut self, now: DateTime<Utc>, threshold: Duration) -> Vec<JobId> {
        let threshold = chrono::Duration::from_std(threshold).unwrap_or(chrono::Duration::MAX);
        let stale: Vec<JobId> = self
            .jobs
            .awaiting_start()
            .iter()
            .filter(|id| now - self.jobs[id].updated_at > threshold)
            .copied()
            .collect();
        for id in &stale {
            // Pending until the requeue comes back, so it is not reported twice.
            self.set_local(*id, |l| l.dispatch_pending = true);
        }
        stale
    }

    /// Marks a job (and a pipeline's unfinished jobs) for cancellation by the person `by`.
    /// Returns each job to cancel with whether the scheduler itself must report it cancelled (it
    /// is on no worker).
    pub fn request_cancel(
        &mut self,
        id: JobId,
        by: &str,
    ) -> Result<Vec<(JobId, bool)>, CancelRefusal> {
        let job = self.jobs.get(&id).ok_or(CancelRefusal::NotFound)?;
        if job.state.is_terminal() {
            return Err(CancelRefusal::Finished(job.state));
        }
        let mut ids = job.children.clone();
        ids.push(id);
        let mut targets = Vec::new();
        for t in ids {
            let Some(j) = self.jobs.get(&t) else { continue };
            if j.state.is_terminal() {
                continue;
            }
            let here = j.state == JobState::Queued && !j.local.dispatch_pending || j.is_pipeline();
            self.set_local(t, |l| {
                l.cancel_requested = true;
                l.cancelled_by = Some(by.to_owned());
            });
            targets.push((t, here));
        }
        Ok(targets)
    }
}
