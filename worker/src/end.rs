//! How a job of a message ended here, handed from running it ([`crate::execute`]) to settling it
//! ([`crate::job`]): without failing ([`Ended`]), or with a [`JobError`], which the failure
//! taxonomy classifies once, in [`JobError::disposition`]: dead-letter (permanent), retry
//! (transient), report cancelled, give back (shutdown), yield, or abandon (the broker is gone, so
//! the message will be redelivered anyway).

use vnfarm_bus::PublishError;
use vnfarm_proto::{FailureKind, Manifest, StageTimings};
use vnfarm_storage::StorageError;

use crate::engine::{CancelReason, EngineError};

/// A job run to the end here: its outputs and manifest are stored.
#[derive(Debug)]
pub(crate) struct Done {
    pub outputs: Vec<String>,
    pub manifest: String,
    pub timings: StageTimings,
}

/// How a job of a message ended here without failing, before its message is settled.
#[derive(Debug)]
pub(crate) enum Ended {
    Completed(Done),
    /// An earlier delivery finished it: its stored manifest.
    FinishedBefore(Box<Manifest>),
    CancelledBefore,
}

/// How a job of a message ended here: the failures are settled by their [`Disposition`].
pub(crate) type JobEnd = Result<Ended, JobError>;

/// Every way a job can fail here. Each has one [`Disposition`] ([`JobError::disposition`]).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("invalid job: {0}")]
    InvalidSpec(String),
    #[error("bad input image: {0}")]
    BadInput(String),
    #[error("deadline passed before the job started")]
    DeadlineExceeded,
    #[error(transparent)]
    Storage(StorageError),
    #[error(transparent)]
    Engine(EngineError),
    #[error("broker lost: {0}")]
    Broker(#[from] PublishError),
}

/// What happens to a job after a failure.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Permanent: to the dead-letter exchange with a final `failed` event.
    DeadLetter(FailureKind),
    /// Transient: a `failed` event with `retryable`, then back to the queue.
    Retry(FailureKind),
    Cancelled,
    /// Shutdown interrupted it: back to the queue without an event.
    GiveBack,
    /// The scheduler asked for it back before it started (to make room for interactive work): to
    /// the scheduler without an event, not counted as a failure.
    Yield,
    /// The broker connection is gone: nothing can be settled; the broker redelivers.
    Abandon,
}

impl JobError {
    /// The one place that decides: an exhaustive `match` with no `_` arm, so a new error cannot
    /// be added without deciding what happens to its job.
    pub(crate) fn disposition(&self) -> Disposition {
        match self {
            JobError::Malformed(_) => Disposition::DeadLetter(FailureKind::Malformed),
            JobError::InvalidSpec(_) => Disposition::DeadLetter(FailureKind::InvalidSpec),
            JobError::BadInput(_) => Disposition::DeadLetter(FailureKind::BadInput),
            JobError::DeadlineExceeded => Disposition::DeadLetter(FailureKind::DeadlineExceeded),
            JobError::Storage(StorageError::NotFound { .. }) => {
                Disposition::DeadLetter(FailureKind::BadInput)
            }
            JobError::Storage(StorageError::InvalidKey { .. }) => {
                Disposition::DeadLetter(FailureKind::InvalidSpec)
            }
            JobError::Storage(StorageError::Unavailable { .. }) => {
                Disposition::Retry(FailureKind::Storage)
            }
            JobError::Engine(EngineError::Cancelled(CancelReason::User)) => Disposition::Cancelled,
            JobError::Engine(EngineError::Cancelled(CancelReason::Shutdown)) => {
                Disposition::GiveBack
            }
            JobError::Engine(EngineError::Yielded) => Disposition::Yield,
            JobError::Engine(EngineError::OutOfMemory(_)) => {
                Disposition::Retry(FailureKind::OutOfMemory)
            }
            JobError::Engine(EngineError::InvalidInput(_)) => {
                Disposition::DeadLetter(FailureKind::BadInput)
            }
            JobError::Engine(EngineError::Failed(_)) => {
                Disposition::DeadLetter(FailureKind::Engine)
            }
            // Not the job's fault: another worker tries it (this one stops, see `DeviceLoss`).
            JobError::Engine(EngineError::DeviceLost(_)) => Disposition::Retry(FailureKind::Engine),
            // The scheduler routed it to a worker that does not hold its model or checkpoint.
            JobError::Engine(EngineError::Unsupported(_) | EngineError::NoCheckpoint(_)) => {
                Disposition::DeadLetter(FailureKind::NoWorker)
            }
            JobError::Broker(_) => Disposition::Abandon,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use chrono::Utc;
    use vnfarm_proto::manifest::{ManifestOutput, Versions};
    use vnfarm_proto::topology::output_key;
    use vnfarm_proto::{JobId, SCHEMA_VERSION, decode_json};

    /// The manifest an earlier run of `job_id` stored: two outputs, made by `w-first`.
    pub(crate) fn manifest(job_id: JobId) -> Manifest {
        let mut timings = StageTimings::default();
        timings.add("denoise", 1.5);
        Manifest {
            schema_version: SCHEMA_VERSION,
            job_id,
            task: decode_json(br#"{"kind": "generate", "prompt": "a lighthouse"}"#)
                .expect("a valid task"),
            outputs: (0..2)
                .map(|n| ManifestOutput {
                    key: output_key(job_id, n),
                    width: 512,
                    height: 512,
                    seed: Some(7 + u64::from(n)),
                    sha256: "00".repeat(32),
                })
                .collect(),
            worker: "w-first".parse().expect("a valid worker id"),
            attempt: 1,
            engine: "test-pattern".into(),
            model_files: Vec::new(),
            timings,
            versions: Versions {
                vnfarm: "0.0.0".into(),
            },
            finished_at: Utc::now(),
        }
    }

    #[test]
    fn every_error_has_one_disposition() {
        let unavailable = StorageError::Unavailable {
            op: "put",
            key: "k".into(),
            message: "down".into(),
        };
        assert_eq!(
            JobError::Storage(unavailable).disposition(),
            Disposition::Retry(FailureKind::Storage)
        );
        assert_eq!(
            JobError::BadInput("x".into()).disposition(),
            Disposition::DeadLetter(FailureKind::BadInput)
        );
        assert_eq!(
            JobError::Storage(StorageError::NotFound { key: "k".into() }).disposition(),
            Disposition::DeadLetter(FailureKind::BadInput)
        );
        assert_eq!(
            JobError::Engine(EngineError::Cancelled(CancelReason::Shutdown)).disposition(),
            Disposition::GiveBack
        );
        assert_eq!(
            JobError::Engine(EngineError::Cancelled(CancelReason::User)).disposition(),
            Disposition::Cancelled
        );
        assert_eq!(
            JobError::Engine(EngineError::OutOfMemory("x".into())).disposition(),
            Disposition::Retry(FailureKind::OutOfMemory)
        );
        assert_eq!(
            JobError::Engine(EngineError::DeviceLost("CUDA error".into())).disposition(),
            Disposition::Retry(FailureKind::Engine),
            "a device failure is not the job's fault"
        );
        assert_eq!(
            JobError::Engine(EngineError::Failed("bug".into())).disposition(),
            Disposition::DeadLetter(FailureKind::Engine)
        );
        assert_eq!(
            JobError::Engine(EngineError::NoCheckpoint("pony".into())).disposition(),
            Disposition::DeadLetter(FailureKind::NoWorker),
            "misrouted: no worker of this one's kind can run it"
        );
    }
}
