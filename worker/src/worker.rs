//! The worker's shared state: identity, storage, the engine host, metrics, the jobs in hand (those of
//! the message being handled, each with its cancellation flag) and which of them are on the engine,
//! and which jobs were cancelled. Cheap to clone (one `Arc`).

use std::collections::{HashSet, VecDeque};
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use vnfarm_proto::topology::Topology;
use vnfarm_proto::{JobId, WorkerId};
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::engine::{Cancel, CancelReason, EngineHost};
use crate::metrics::Metrics;
use crate::provenance::FileHashes;

mod device_loss;
mod lifecycle;

pub use device_loss::DeviceLoss;
pub use lifecycle::Lifecycle;

/// How many cancelled job ids a worker remembers (to skip them if they arrive later).
const CANCELLED_MEMORY: usize = 10_000;

#[derive(Clone)]
pub struct Worker(Arc<Inner>);

pub struct Inner {
    pub config: Config,
    pub id: WorkerId,
    pub topology: Topology,
    pub storage: Storage,
    pub engine: EngineHost,
    /// The sha256 of the model files, for manifests.
    pub hashes: FileHashes,
    pub metrics: Metrics,
    status: Mutex<Status>,
    lifecycle: Lifecycle,
    device_loss: DeviceLoss,
}

struct Status {
    /// The unsettled jobs of the message in hand, with their cancellation flags.
    in_hand: Vec<(JobId, Cancel)>,
    /// Those of them on the engine now.
    running: Vec<JobId>,
    cancelled: HashSet<JobId>,
    cancelled_order: VecDeque<JobId>,
}

impl Deref for Worker {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl Worker {
    pub fn new(
        config: Config,
        storage: Storage,
        engine: EngineHost,
        hashes: FileHashes,
        metrics: Metrics,
    ) -> Self {
        let id = config.worker_id();
        let topology = config.amqp.topology();
        let status = Status {
            in_hand: Vec::new(),
            running: Vec::new(),
            cancelled: HashSet::new(),
            cancelled_order: VecDeque::new(),
        };
        Self(Arc::new(Inner {
            config,
            id,
            topology,
            storage,
            engine,
            hashes,
            metrics,
            status: Mutex::new(status),
            lifecycle: Lifecycle::default(),
            device_loss: DeviceLoss::default(),
        }))
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Warming, ready, draining, as the heartbeats say.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// The jobs on the engine now.
    pub fn running(&self) -> Vec<JobId> {
        self.status().running.clone()
    }

    /// The unsettled jobs of the message in hand.
    pub fn in_hand(&self) -> Vec<JobId> {
        self.status().in_hand.iter().map(|(id, _)| *id).collect()
    }

    /// Takes the jobs of a message in hand, each with a fresh cancellation flag (already raised for
    /// a job cancelled before it came).
    pub(crate) fn take_in_hand(&self, jobs: &[JobId]) -> Vec<Cancel> {
        let mut status = self.status();
        let cancels: Vec<Cancel> = jobs
            .iter()
            .map(|id| {
                let cancel = Cancel::default();
                if status.cancelled.contains(id) {
                    cancel.request(CancelReason::User);
                }
                cancel
            })
            .collect();
        status.in_hand = jobs.iter().copied().zip(cancels.iter().cloned()).collect();
        status.running.clear();
        cancels
    }

    /// The message in hand is settled (or abandoned).
    pub(crate) fn drop_in_hand(&self) {
        let mut status = self.status();
        status.in_hand.clear();
        status.running.clear();
    }

    /// A job of the message in hand is settled.
    pub(crate) fn settled(&self, job_id: JobId) {
        let mut status = self.status();
        status.in_hand.retain(|(id, _)| *id != job_id);
        status.running.retain(|id| *id != job_id);
    }

    pub(crate) fn set_running(&self, running: Vec<JobId>) {
        self.status().running = running;
    }

    /// The engine has answered this job.
    pub(crate) fn off_engine(&self, job_id: JobId) {
        self.status().running.retain(|id| *id != job_id);
    }

    /// The scheduler asks for these jobs back, should they not have started on the engine (to make
    /// room for interactive work): the engine host gives back those whose run has not begun. Jobs
    /// not in hand here are not this worker's: ignored. Returns how many are in hand.
    pub fn yield_jobs(&self, jobs: &[JobId]) -> usize {
        let status = self.status();
        let mut asked = 0;
        for (id, cancel) in &status.in_hand {
            if jobs.contains(id) {
                cancel.request_yield();
                asked += 1;
            }
        }
        asked
    }

    /// Records a cancellation; stops the job if it is in hand here.
    pub fn cancel(&self, job_id: JobId) {
        let mut status = self.status();
        if status.cancelled.insert(job_id) {
            status.cancelled_order.push_back(job_id);
            if status.cancelled_order.len() > CANCELLED_MEMORY
                && let Some(old) = status.cancelled_order.pop_front()
            {
                status.cancelled.remove(&old);
            }
        }
        for (id, cancel) in &status.in_hand {
            if *id == job_id {
                cancel.request(CancelReason::User);
            }
        }
    }

    pub fn is_cancelled(&self, job_id: JobId) -> bool {
        self.status().cancelled.contains(&job_id)
    }

    /// The device-loss latch, set by a job's `DeviceLost` failure.
    pub fn device_loss(&self) -> &DeviceLoss {
        &self.device_loss
    }

    /// Interrupts the jobs in hand so that they go back to the queue (shutdown past the grace
    /// period).
    pub fn interrupt_for_shutdown(&self) {
        for (_, cancel) in &self.status().in_hand {
            cancel.request(CancelReason::Shutdown);
        }
    }
}
