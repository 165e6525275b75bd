//! The wire contract of vnfarm: everything that crosses a process boundary is typed here.
//!
//! # Layout
//!
//! - [`ids`]: job and worker identifiers, validated once at the edge.
//! - [`spec`]: what a client submits (generate, edit, upscale, pipeline) and its validation (DESIGN §3).
//! - [`pipeline`]: a pipeline's jobs, derived from its spec wherever its one `queued` event is read.
//! - [`work`]: what the scheduler hands a worker over RabbitMQ, and what a worker says in its heartbeat.
//! - [`event`]: job state changes, as published to the event exchange and kept in the event stream.
//! - [`manifest`]: the `manifest.json` written beside every job's outputs.
//! - [`people`]: roles, permissions and the events of people's API tokens.
//! - [`http`]: the HTTP API's contract: the job view and states, the worker view, the error body.
//! - [`topology`]: exchange, queue and routing-key names, and the object keys of results.
//! - [`catalogue`]: the model catalogue in the bucket (content-addressed files, names pointing at
//!   them) and how a job names a file in it.
//! - [`decode`]: strict decoding of untrusted JSON, with the path of the offending field in the error.
//! - `defaults.rs`: the values optional fields of the wire types take when a message leaves them out.
//!
//! Every type that a client or a foreign producer writes rejects unknown fields and unknown schema
//! versions rather than guessing.

pub mod catalogue;
pub mod decode;
mod defaults;
pub mod event;
pub mod http;
pub mod ids;
pub mod manifest;
pub mod people;
pub mod pipeline;
pub mod spec;
pub mod topology;
pub mod work;

pub use catalogue::{CatalogueEntry, ContentHash, ModelRef};
pub use decode::{DecodeError, decode_json};
pub use event::{Event, EventKind, FailureKind, SequencedEvent, StageTimings};
pub use ids::{JobId, WorkerId};
pub use manifest::{Manifest, ModelFile, ModelFileRole};
pub use people::{Permission, PersonEvent, PersonEventKind, Role};
pub use pipeline::{pipeline_jobs, pipeline_size};
pub use spec::{
    EditSpec, GenerateSpec, ImageRef, JobSpec, LoraRef, ModelFamily, PipelineImage, PipelineSpec,
    Priority, Sampler, Submission, UpscaleSpec, ValidationError, resolution_class,
};
pub use work::{
    BatchedJob, CancelRequest, GpuMemory, Heartbeat, SettingsInUse, SettingsSource, Task,
    WorkMessage, WorkerState, YieldRequest,
};

/// The version of the client formats this build reads and writes: a [`Submission`] and a job's
/// [`Manifest`]. Submissions with any other version are rejected.
pub const SCHEMA_VERSION: u32 = 1;

/// The protocol version between vnfarm's own processes that this build writes: work messages,
/// heartbeats, events, control messages. It reads every version from [`MIN_PROTOCOL_VERSION`] up
/// to this one. The rule for what a version may change is in docs/DESIGN.md §4 ("Versions and
/// rolling upgrades"); `proto/golden/v<N>/` holds one message of every kind as version N wrote
/// them, and this build's tests decode every version it claims to read.
///
/// - 1: every type rejected unknown fields; a reader accepted only its own version.
/// - 2: every message names its version; readers ignore unknown fields outside job specs; a
///   worker advertises the versions it decodes in its heartbeat ([`Heartbeat::protocols`]) and
///   the scheduler writes each work message in a version its worker decodes.
pub const PROTOCOL_VERSION: u32 = 2;

/// The oldest protocol version this build reads (and writes, for a worker that reads no later one).
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// Largest message body the scheduler and workers accept (an 8 MiB inline image is ~10.7 MiB in base64).
pub const MAX_MESSAGE_BYTES: usize = 12 * 1024 * 1024;

/// JSON Schema of [`Submission`], for front ends. `proto/schema/submission.schema.json` is this,
/// committed; a test keeps the two equal.
pub fn submission_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Submission))
        .expect("a JSON Schema serializes to JSON")
}

#[cfg(test)]
mod schema_tests {
    /// Regenerate with `VNFARM_BLESS=1 cargo test -p vnfarm-proto`.
    #[test]
    fn committed_schema_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema/submission.schema.json");
        let fresh = serde_json::to_string_pretty(&super::submission_schema()).unwrap() + "\n";
        if std::env::var_os("VNFARM_BLESS").is_some() {
            std::fs::write(path, &fresh).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == fresh,
            "{path} is stale: run VNFARM_BLESS=1 cargo test -p vnfarm-proto"
        );
        let schema = super::submission_schema();
        assert_eq!(
            schema["additionalProperties"], false,
            "unknown fields must be rejected"
        );
    }
}
