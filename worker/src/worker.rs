//! The worker's shared state: identity, storage, the engine host, metrics, what is running now and
//! which jobs were cancelled. Cheap to clone (one `Arc`).

use std::collections::{HashSet, VecDeque};
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use vnfarm_proto::topology::Topology;
use vnfarm_proto::{JobId, WorkerId, WorkerState};
use vnfarm_storage::Storage;

use crate::config::Config;
use crate::engine::{Cancel, CancelReason, EngineHost};
use crate::metrics::Metrics;

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
    pub metrics: Metrics,
    status: Mutex<Status>,
    /// Cancelled when the device failed (see [`Worker::device_lost`]); the reason is kept for the
    /// exit status.
    pub fatal: tokio_util::sync::CancellationToken,
    fatal_reason: Mutex<Option<String>>,
}

struct Status {
    state: WorkerState,
    running: Option<(JobId, Cancel)>,
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
    pub fn new(config: Config, storage: Storage, engine: EngineHost, metrics: Metrics) -> Self {
        let id = config.worker_id();
        let topology = config.amqp.topology();
        let status = Status {
            state: WorkerState::Ready,
            running: None,
            cancelled: HashSet::new(),
            cancelled_order: VecDeque::new(),
        };
        Self(Arc::new(Inner {
            config,
            id,
            topology,
            storage,
            engine,
            metrics,
            status: Mutex::new(status),
            fatal: tokio_util::sync::CancellationToken::new(),
            fatal_reason: Mutex::new(None),
        }))
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn state(&self) -> WorkerState {
        self.status().state
    }

    pub fn set_state(&self, state: WorkerState) {
        self.status().state = state;
    }

    pub fn running(&self) -> Option<JobId> {
        self.status().running.as_ref().map(|(id, _)| *id)
    }

    pub(crate) fn set_running(&self, running: Option<(JobId, Cancel)>) {
        self.status().running = running;
    }

    /// Records a cancellation; stops the job if it is running here.
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
        if let Some((id, cancel)) = &status.running
            && *id == job_id
        {
            cancel.request(CancelReason::User);
        }
    }

    pub fn is_cancelled(&self, job_id: JobId) -> bool {
        self.status().cancelled.contains(&job_id)
    }

    /// The device failed: stop taking jobs and exit with an error once the job in hand is given
    /// back, so that a supervisor restarts the worker with a fresh device context.
    pub fn device_lost(&self, reason: &str) {
        tracing::error!(%reason, "device failure: this worker stops taking jobs and exits");
        self.fatal_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| reason.to_owned());
        self.fatal.cancel();
    }

    /// Why the worker must exit with an error, if it must.
    pub fn fatal_reason(&self) -> Option<String> {
        self.fatal_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Interrupts the running job so that it goes back to the queue (shutdown past the grace period).
    pub fn interrupt_for_shutdown(&self) {
        if let Some((_, cancel)) = &self.status().running {
            cancel.request(CancelReason::Shutdown);
        }
    }
}
