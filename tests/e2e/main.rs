//! End-to-end tests: the real scheduler and workers against a real RabbitMQ and a real S3 server (see
//! `tests/lib.rs`): as child processes where a test kills, signals or restarts them or reads their
//! logs, in the test's own process otherwise. `engines.rs` holds the tiny model engines' settings.

mod batches;
mod bench;
mod catalogue;
mod check;
mod checkpoints;
mod cli;
mod deploy;
mod engines;
mod esrgan;
mod estimates;
mod failures;
mod fleet;
mod intake;
mod logs;
mod names;
mod observability;
mod outages;
mod people;
mod permissions;
mod pipeline;
mod processes;
mod provenance;
mod queue;
mod qwen;
mod redelivery;
mod sdxl;
mod upgrade;
mod web;

/// The model crate's fixture files that are written at test time from other fixtures (its own
/// tests' helper), for the workers' model paths.
#[path = "../../worker/models/tests/support/derived.rs"]
mod derived;

use std::time::Duration;

/// Generous bound for one job or pipeline on a loaded 2-core CI machine; tests wait for conditions,
/// this only bounds how long a broken build hangs.
pub const FINISH: Duration = Duration::from_secs(90);
