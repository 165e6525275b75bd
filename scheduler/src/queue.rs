//! Queue control (DESIGN §7a, "Fair share and queue control"): pausing and resuming the farm or one
//! person's work, and moving a waiting job to the front. Each is a person's event published to the
//! stream and read back before the answer, so the answer tells the truth about this scheduler, and
//! a standby or a restarted scheduler, reading the same stream (or a snapshot of it), holds the
//! same queue. Running jobs are never touched: a pause stops dispatch, nothing else.

use vnfarm_proto::http::JobState;
use vnfarm_proto::{JobId, PersonEvent, PersonEventKind};

use crate::registry::Registry;
use crate::scheduler::Scheduler;

/// Why a queue control did not take.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("no job {0}")]
    NotFound(JobId),
    /// Only a queued job has a place in the queue.
    #[error("job {0} is {state}, not waiting in the queue", state = .1.as_str())]
    NotWaiting(JobId, JobState),
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// What a pause or resume changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    Farm,
    /// One person's work, by their name.
    Person(String),
}

impl Scheduler {
    /// Pauses (or, with `pause` false, resumes) the farm or one person's work, by `by`. Returns
    /// once this scheduler dispatches accordingly; pausing what is paused changes nothing.
    pub async fn set_paused(&self, scope: Scope, pause: bool, by: &str) -> Result<(), QueueError> {
        let is_paused = |reg: &Registry| match &scope {
            Scope::Farm => reg.shares().farm_paused().is_some(),
            Scope::Person(name) => reg.shares().paused().contains_key(name),
        };
        if is_paused(&self.registry()) == pause {
            return Ok(());
        }
        let kind = match (&scope, pause) {
            (Scope::Farm, true) => PersonEventKind::FarmPaused,
            (Scope::Farm, false) => PersonEventKind::FarmResumed,
            (Scope::Person(whose), true) => PersonEventKind::WorkPaused {
                whose: whose.clone(),
            },
            (Scope::Person(whose), false) => PersonEventKind::WorkResumed {
                whose: whose.clone(),
            },
        };
        self.publish_control(&PersonEvent::now(by, kind)).await?;
        self.read_back_event(|reg| (is_paused(reg) == pause).then_some(()))
            .await
            .ok_or_else(not_read_back)
    }

    /// Moves a queued job (or pipeline: its waiting jobs) to the front of its class, by `by`.
    /// Returns once this scheduler dispatches it first.
    pub async fn move_to_front(&self, id: JobId, by: &str) -> Result<(), QueueError> {
        let (jobs, before) = {
            let reg = self.registry();
            let job = reg.job(id).ok_or(QueueError::NotFound(id))?;
            if job.state() != JobState::Queued {
                return Err(QueueError::NotWaiting(id, job.state()));
            }
            let children: Vec<JobId> = job
                .children()
                .iter()
                .copied()
                .filter(|c| reg.job(*c).is_some_and(|j| j.state() == JobState::Queued))
                .collect();
            let jobs = if children.is_empty() {
                vec![id]
            } else {
                children
            };
            let last = *jobs.last().expect("one job at least");
            (jobs, reg.job(last).and_then(|j| j.moved_at()))
        };
        for &job_id in &jobs {
            let ev = PersonEvent::now(by, PersonEventKind::MovedToFront { job_id });
            self.publish_control(&ev).await?;
        }
        let last = *jobs.last().expect("one job at least");
        // This move (or a later one) is on the job, or it left the queue meanwhile.
        self.read_back_event(|reg| {
            reg.job(last)
                .is_none_or(|j| j.moved_at() != before || j.state() != JobState::Queued)
                .then_some(())
        })
        .await
        .ok_or_else(not_read_back)
    }

    async fn publish_control(&self, ev: &PersonEvent) -> Result<(), QueueError> {
        self.publish_person(ev)
            .await
            .map_err(|e| QueueError::Unavailable(e.to_string()))
    }
}

fn not_read_back() -> QueueError {
    QueueError::Unavailable(
        "the queue's event was confirmed but has not been read back yet; read GET /v1/queue to see whether it took".into(),
    )
}
