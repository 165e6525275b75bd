//! Names of everything on the broker (DESIGN §4) and the object keys of results (DESIGN §7).
//!
//! All names take a prefix (`vnfarm` in production) so that tests can run side by side on one broker.

use crate::ids::{JobId, WorkerId};

/// The broker names of one vnfarm installation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    prefix: String,
}

impl Default for Topology {
    fn default() -> Self {
        Self::new("vnfarm")
    }
}

impl Topology {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Quorum queue of submissions; consumed by the scheduler.
    pub fn intake_queue(&self) -> String {
        format!("{}.intake", self.prefix)
    }

    /// A worker's own quorum queue: the scheduler pushes jobs here when the worker has a free slot.
    /// Messages that wait too long (the worker died or stalled) dead-letter to the redispatch queue.
    pub fn worker_queue(&self, worker: &WorkerId) -> String {
        format!("{}.worker.{}", self.prefix, worker)
    }

    /// Quorum queue of jobs that came back from a worker queue (expired, or over the delivery
    /// limit) or that a worker gave back; the scheduler consumes it and dispatches them again or
    /// fails them.
    pub fn redispatch_queue(&self) -> String {
        format!("{}.redispatch", self.prefix)
    }

    /// Fanout exchange bound to the redispatch queue: how a worker gives a job back. A worker
    /// may write here and not to the default exchange, which reaches every queue. (The broker's
    /// own dead-lettering of worker queues goes through the default exchange; permissions do not
    /// apply to it.)
    pub fn give_back_exchange(&self) -> String {
        format!("{}.give-back", self.prefix)
    }

    /// Fanout exchange bound to the intake queue: how a front end that may write nothing else
    /// submits (`deploy/rabbitmq/definitions.json`, user `vnfarm-submitter`).
    pub fn submissions_exchange(&self) -> String {
        format!("{}.submissions", self.prefix)
    }

    /// Topic exchange of events (`job.<id>.<event>`), heartbeats (`worker.<id>.heartbeat`) and
    /// control messages (`control.cancel`).
    pub fn events_exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }

    /// Stream of job events: the durable job history.
    pub fn events_stream(&self) -> String {
        format!("{}.events.log", self.prefix)
    }

    /// Quorum queue holding the scheduler leader token: the scheduler that holds it (unacked) is the
    /// active one; single-active-consumer hands it to a standby when the holder's connection dies.
    pub fn leader_queue(&self) -> String {
        format!("{}.scheduler.leader", self.prefix)
    }

    /// Stream of registry snapshots written by the active scheduler; a starting scheduler loads
    /// the latest and replays the event stream only after it.
    pub fn snapshot_stream(&self) -> String {
        format!("{}.scheduler.snapshots", self.prefix)
    }

    /// Fanout exchange of permanently failed messages.
    pub fn dead_exchange(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// Queue that keeps dead messages, with the reason in headers, for operators.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// Quorum queue bound to the dead-letter exchange beside [`Topology::dead_queue`]: the active
    /// scheduler reads it to give every message the broker dead-lettered (a delivery limit
    /// reached) the `failed` event its client reads. Messages vnfarm dead-lettered itself already
    /// have theirs.
    pub fn dead_watch_queue(&self) -> String {
        format!("{}.scheduler.dead-watch", self.prefix)
    }
}

pub const HEARTBEAT_ROUTING_PATTERN: &str = "worker.*.heartbeat";
pub const CANCEL_ROUTING_KEY: &str = "control.cancel";
/// [`crate::YieldRequest`]s: the active scheduler asks a worker for the unstarted jobs of its
/// message back, to make room for interactive work.
pub const YIELD_ROUTING_KEY: &str = "control.yield";
/// Binding of the event stream: job events and scheduler markers.
pub const JOB_EVENTS_PATTERN: &str = "job.#";
pub const MARKER_ROUTING_PREFIX: &str = "marker";
/// Events of people's tokens (`people.<name>.<event>`, [`crate::people::PersonEvent`]); the
/// event stream is bound to `people.#` too, so they are in the same order as job events.
pub const PEOPLE_ROUTING_PREFIX: &str = "people";

pub fn heartbeat_routing_key(worker: &WorkerId) -> String {
    format!("worker.{worker}.heartbeat")
}

/// Message headers vnfarm sets on dead-lettered messages.
pub const HEADER_REASON: &str = "x-vnfarm-reason";
pub const HEADER_FAILURE: &str = "x-vnfarm-failure";
pub const HEADER_JOB_ID: &str = "x-vnfarm-job-id";
/// On a job a worker gives back because the scheduler asked for it (a yield): not a failure, and
/// not counted against the job's dispatches.
pub const HEADER_YIELDED: &str = "x-vnfarm-yielded";

/// Key of output image `n` of a job. Derived from the job id alone, so a re-run overwrites.
pub fn output_key(job: JobId, n: u32) -> String {
    format!("results/{job}/{n}.png")
}

pub fn manifest_key(job: JobId) -> String {
    format!("results/{job}/manifest.json")
}

/// Key of an input uploaded inline, content-addressed by its sha256.
pub fn input_key(sha256_hex: &str, extension: &str) -> String {
    format!("inputs/{sha256_hex}.{extension}")
}
