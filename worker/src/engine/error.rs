//! What can go wrong with a job on the engine, and why a running job is stopped.

use vnfarm_proto::ModelFamily;

/// How a job failed on the engine (the worker decides what happens to it: `crate::end`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("cancelled")]
    Cancelled(CancelReason),
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("input rejected by the engine: {0}")]
    InvalidInput(String),
    #[error("engine failure: {0}")]
    Failed(String),
    /// The device failed in a way that may have left it unusable (a CUDA/HIP error, a device-side
    /// assert): the job goes to another worker and this worker stops, to be restarted with a fresh
    /// device context.
    #[error("device failure: {0}")]
    DeviceLost(String),
    #[error("this worker has no engine for {0}")]
    Unsupported(ModelFamily),
    /// A generate named an SDXL checkpoint this worker does not hold.
    #[error("this worker does not hold the SDXL checkpoint `{0}`")]
    NoCheckpoint(String),
    /// Not started: the scheduler asked for it back (a yield, to make room for interactive work),
    /// so it goes back to the scheduler unrun.
    #[error("given back unstarted: the scheduler asked for it back")]
    Yielded,
}

impl EngineError {
    /// Whether a group of jobs that failed together with this error may owe it to one of them (a
    /// bad request, a failure the inputs provoke, memory a smaller batch would fit in), so that each
    /// job is worth running alone.
    pub(super) fn may_be_one_jobs(&self) -> bool {
        match self {
            EngineError::OutOfMemory(_) | EngineError::InvalidInput(_) | EngineError::Failed(_) => {
                true
            }
            EngineError::Cancelled(_)
            | EngineError::DeviceLost(_)
            | EngineError::Unsupported(_)
            | EngineError::NoCheckpoint(_)
            | EngineError::Yielded => false,
        }
    }
}

/// Why a running job is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// A client cancelled the job: report it cancelled.
    User,
    /// The worker is shutting down past its grace period: give the job back to the queue.
    Shutdown,
}
