//! Job events: every state change of a job, as published to `vnfarm.events` and kept in the
//! `vnfarm.events.log` stream.
//!
//! An event's sequence number is its offset in the stream: global, strictly increasing, and the
//! position a client resumes from. It is assigned by the broker, so it is absent on the wire to the
//! exchange and present ([`SequencedEvent`]) wherever events are read back.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::catalogue::ContentHash;
use crate::ids::{JobId, WorkerId};
use crate::spec::Submission;

/// Events are written only by vnfarm's own binaries. They are not `deny_unknown_fields`: serde cannot
/// combine that with the flattened `kind`, and a newer writer's extra field is harmless to an older reader.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    /// The protocol version it is written in (absent before version 2).
    #[serde(default = "crate::defaults::one")]
    pub schema_version: u32,
    pub job_id: JobId,
    pub at: DateTime<Utc>,
    #[serde(flatten)]
    pub kind: EventKind,
}

impl Event {
    pub fn now(job_id: JobId, kind: EventKind) -> Self {
        Self {
            schema_version: crate::PROTOCOL_VERSION,
            job_id,
            at: Utc::now(),
            kind,
        }
    }

    /// Routing key on the event exchange: `job.<id>.<event>`.
    pub fn routing_key(&self) -> String {
        format!("job.{}.{}", self.job_id, self.kind.name())
    }
}

/// An event with its position in the event stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SequencedEvent {
    pub seq: u64,
    #[serde(flatten)]
    pub event: Event,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// Accepted. Carries the whole validated submission, so the stream alone can rebuild the job.
    Queued {
        submission: Box<Submission>,
        /// The pipeline this job belongs to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<JobId>,
        /// For a pipeline: its jobs, in order (base, edits, upscales).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        children: Vec<JobId>,
        /// The person whose token submitted it; a pipeline's jobs are theirs too. Absent: `admin`
        /// (the configuration's `api_token`, an open loopback API, the intake queue, or a
        /// scheduler from before owners).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
        /// The model catalogue's files its LoRA and checkpoint names (and `sha256:` references)
        /// stood for when it was accepted, by the name: the scheduler prefers workers whose model
        /// cache holds them, and sends a checkpoint found here only to workers that serve the
        /// catalogue's checkpoints (DESIGN §7b). A worker resolves the names itself when it
        /// fetches. Absent before this field, and for names the catalogue does not hold.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        files: BTreeMap<String, ContentHash>,
    },
    /// Handed to a queue; `worker` is set when it went to one worker's own queue.
    Dispatched {
        queue: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<WorkerId>,
        /// The first job of the batch message it travels in, when it shares one with others; the
        /// message holds one of the worker's slots until every job in it has ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        batch: Option<JobId>,
        /// The dispatching scheduler's term: the stream offset (plus one) of the marker it began
        /// leading with, so a later leader's term is larger. Absent before protocol 2. A term's
        /// dispatches appearing after a later term's first one would mean two schedulers dispatched
        /// at once (the fault tests' audit checks that none do).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        term: Option<u64>,
    },
    /// Back in the scheduler's backlog, to be dispatched again (its message came back from a worker
    /// queue: the worker died or stalled, or gave it back; `reason` is [`YIELDED_REASON`] for a job
    /// the scheduler asked back unstarted, which does not count as a dispatch).
    Requeued {
        reason: String,
        /// The dispatch it returns, by the job's count of dispatches then: a job dispatched again
        /// since keeps its new dispatch. Absent: whatever dispatch the job is in (every requeue
        /// before this field, and those that come back from the broker).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dispatch: Option<u32>,
    },
    /// A worker began it. `attempt` counts deliveries (1 for the first).
    Started {
        worker: WorkerId,
        attempt: u32,
    },
    Progress {
        step: u32,
        total: u32,
    },
    Completed {
        /// Object keys of the outputs, in order.
        outputs: Vec<String>,
        manifest: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<WorkerId>,
        #[serde(default)]
        timings: StageTimings,
    },
    Failed {
        failure: FailureKind,
        message: String,
        /// True when the job will be tried again; false makes this event final.
        retryable: bool,
    },
    Cancelled {
        reason: String,
        /// The person who cancelled it, when a scheduler wrote the event (a job in its hands).
        /// A worker stopping a job writes none: the cancel request it hears is a version 1 control
        /// message, which has no field for it; the person's `cancel_requested` event before it
        /// names them ([`crate::people::PersonEventKind::CancelRequested`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
}

/// The `requeued` reason of a job its worker gave back unstarted because the scheduler asked (a
/// yield, to make room for interactive work).
pub const YIELDED_REASON: &str = "yielded unstarted, to make room for interactive work";

impl EventKind {
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Queued { .. } => "queued",
            EventKind::Dispatched { .. } => "dispatched",
            EventKind::Requeued { .. } => "requeued",
            EventKind::Started { .. } => "started",
            EventKind::Progress { .. } => "progress",
            EventKind::Completed { .. } => "completed",
            EventKind::Failed { .. } => "failed",
            EventKind::Cancelled { .. } => "cancelled",
        }
    }

    /// Whether this event ends the job: nothing after it changes the job's state.
    pub fn is_terminal(&self) -> bool {
        match self {
            EventKind::Completed { .. } | EventKind::Cancelled { .. } => true,
            EventKind::Failed { retryable, .. } => !retryable,
            EventKind::Queued { .. }
            | EventKind::Dispatched { .. }
            | EventKind::Requeued { .. }
            | EventKind::Started { .. }
            | EventKind::Progress { .. } => false,
        }
    }
}

/// Why a job failed. Workers and the scheduler classify every error into one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The message could not be decoded, was too large, or named an unknown schema version.
    Malformed,
    /// The spec decoded but broke a bound.
    InvalidSpec,
    /// The input image is missing, undecodable or too large.
    BadInput,
    /// Not started before its deadline.
    DeadlineExceeded,
    /// Storage could not be reached or refused the request.
    Storage,
    /// The engine ran out of device memory.
    OutOfMemory,
    /// The engine failed in another way.
    Engine,
    /// Delivered more times than the queue's delivery limit allows (a worker died on it each time).
    DeliveryLimit,
    /// No worker holds the model this job needs.
    NoWorker,
    /// A job this one depends on failed or was cancelled.
    DependencyFailed,
    /// A kind a newer build added, read by this one (an event or a job view from a newer worker or
    /// scheduler during a rolling upgrade). This build never writes it, nor documents it.
    #[serde(other)]
    #[schemars(skip)]
    Unknown,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Malformed => "malformed",
            FailureKind::InvalidSpec => "invalid_spec",
            FailureKind::BadInput => "bad_input",
            FailureKind::DeadlineExceeded => "deadline_exceeded",
            FailureKind::Storage => "storage",
            FailureKind::OutOfMemory => "out_of_memory",
            FailureKind::Engine => "engine",
            FailureKind::DeliveryLimit => "delivery_limit",
            FailureKind::NoWorker => "no_worker",
            FailureKind::DependencyFailed => "dependency_failed",
            FailureKind::Unknown => "unknown",
        }
    }
}

/// Seconds spent per stage (`download`, `encode`, `denoise`, `decode`, `upload`, ...).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct StageTimings(pub BTreeMap<String, f64>);

impl StageTimings {
    pub fn add(&mut self, stage: &str, seconds: f64) {
        *self.0.entry(stage.to_owned()).or_default() += seconds;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_route() {
        let id = JobId::new();
        let ev = Event::now(
            id,
            EventKind::Failed {
                failure: FailureKind::BadInput,
                message: "not a PNG".into(),
                retryable: false,
            },
        );
        assert_eq!(ev.routing_key(), format!("job.{id}.failed"));
        let json = serde_json::to_string(&ev).unwrap();
        assert!(json.contains("\"event\":\"failed\""), "{json}");
        let back: Event = crate::decode_json(json.as_bytes()).unwrap();
        assert_eq!(back, ev);
        assert!(back.kind.is_terminal());
        let seq = SequencedEvent { seq: 9, event: ev };
        let json = serde_json::to_value(&seq).unwrap();
        assert_eq!(json["seq"], 9);
        assert_eq!(json["failure"], "bad_input");
    }

    #[test]
    fn retryable_failures_are_not_terminal() {
        let kind = EventKind::Failed {
            failure: FailureKind::Storage,
            message: "S3 down".into(),
            retryable: true,
        };
        assert!(!kind.is_terminal());
    }
}
