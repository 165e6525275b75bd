//! The fleet benchmark (issue 9, DESIGN §5): one workload run against the `affinity` policy and
//! the two baselines, `least_loaded` (one job per message, what dispatch did before) and
//! `round_robin`, each on a fresh farm of test-pattern workers whose stage delays follow a measured
//! profile, on the real RabbitMQ and S3 server. `fleet-bench` (a program) prints the comparison;
//! the e2e test `fleet::every_policy_completes_the_workload_and_affinity_encodes_less` runs a short form.
//!
//! The workload: a backlog of batch work submitted at once (pipelines of a base and 3–10 edits,
//! generates, bursts of edits of one uploaded image sent one by one, edits of earlier outputs),
//! and interactive work arriving through the run. Throughput is jobs over the time to drain it
//! all; latency is `queued` to `completed` per job, by priority.

mod accuracy;
mod fair;
mod report;
mod workload;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use vnfarm_proto::{EventKind, JobId, JobSpec, Priority, SequencedEvent};

pub use accuracy::{AccuracyReport, render_accuracy, run_estimates};
pub use fair::{FairConfig, FairReport, run_fair_share};
pub use report::{PolicyReport, render};
pub use workload::{Item, Shape, Workload};

use crate::{Farm, WorkerOptions, wait_for};

/// Stage delays of one kind of GPU box, from measurements, scaled down by `scale` so a run takes
/// seconds. The test-pattern engine sleeps them: a generate `steps × generate_step_ms`, an edit
/// `encode_ms` on an encode-cache miss then `steps × edit_step_ms`, every image `decode_ms`.
#[derive(Clone, Copy, Debug)]
pub struct Profile {
    pub name: &'static str,
    /// Where the numbers come from.
    pub source: &'static str,
    pub generate_step_ms: f64,
    pub edit_step_ms: f64,
    pub encode_ms: f64,
    pub decode_ms: f64,
    /// What a job beyond the first adds to a batch's step (1: no batch gain).
    pub batch_step_cost: f64,
}

/// H200: SDXL 1024², 20 steps at ≈ 125 ms (docs/performance.md, SDXL full pipeline); Qwen edit
/// 1024², 4 steps at 364 ms, input encode 72 ms + VAE encode 24 ms, VAE decode 37 ms (Qwen vs
/// diffusers, run 2). Micro-batching variants of one input gained nothing measurable at 8 k
/// tokens (10 variants 15.16 s vs 10 × 1.55 s), so no batch gain.
pub const H200: Profile = Profile {
    name: "h200",
    source: "docs/performance.md: SDXL pipeline and Qwen edit runs on the H200",
    generate_step_ms: 125.0,
    edit_step_ms: 364.0,
    encode_ms: 96.0,
    decode_ms: 37.0,
    batch_step_cost: 1.0,
};

/// Strix Halo (Radeon 8060S, ROCm), the studio's Python session (DESIGN §1): SDXL 1024² 20 steps
/// ≈ 1.15 s/step + decode, Qwen edit 53 s with flash attention (4 steps), the shared encode 2–4 %
/// of an edit (3 % taken: 1.6 s). Batch gain unmeasured there: none assumed.
pub const STRIX_HALO: Profile = Profile {
    name: "strix-halo",
    source: "docs/DESIGN.md §1: the studio's Python session on a Strix Halo box",
    generate_step_ms: 1150.0,
    edit_step_ms: 12_600.0,
    encode_ms: 1_600.0,
    decode_ms: 1_000.0,
    batch_step_cost: 1.0,
};

/// KiB of a Qwen edit's encodings of a 1024² input in bf16 (VAE latents 0.5 MiB, vision features
/// 1.3 MiB), what workers publish and fetch.
const ENCODING_KIB: f64 = 2048.0;

/// A profile's delays divided by `scale`, as whole milliseconds (at least 1).
fn scaled(ms: f64, scale: f64) -> u64 {
    ((ms / scale).round() as u64).max(1)
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub profile: Profile,
    /// Real time per profile time: 20 makes a 1.5 s H200 edit 75 ms.
    pub scale: f64,
    pub workers: usize,
    /// Batch work submitted at the start.
    pub backlog_items: usize,
    /// Interactive work arriving during the run.
    pub interactive_items: usize,
    /// Over how long the interactive work arrives.
    pub arrival_seconds: f64,
    pub seed: u64,
    /// Items of mixed sizes (three resolution classes) and steps, on workers whose step times
    /// grow with the area (`area_scaling` 1); otherwise every item is 256² with 20 or 4 steps.
    pub mixed: bool,
}

impl RunConfig {
    pub fn quick() -> Self {
        Self {
            profile: H200,
            scale: 20.0,
            workers: 4,
            backlog_items: 12,
            interactive_items: 8,
            arrival_seconds: 4.0,
            seed: 7,
            mixed: false,
        }
    }
}

/// A dispatch set-up the benchmark compares: a policy, its batch limit, and whether the workers
/// share encodings through storage.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    /// How the report names it.
    pub name: &'static str,
    pub policy: &'static str,
    pub max_batch: u32,
    /// `shared_encodings.enabled` of the workers (on by default).
    pub shared_encodings: bool,
}

/// The affinity policy with coalescing (batch messages of up to 8 jobs) and without (one job per
/// message: same-input edits still go to the holder, one after another), then the baselines; the
/// default and least-loaded dispatch also with workers that do not share encodings (each encodes
/// what its own cache misses, as before step 4b's shared tier).
pub const VARIANTS: [Variant; 6] = [
    Variant {
        name: "affinity, max_batch 8 (default)",
        policy: "affinity",
        max_batch: 8,
        shared_encodings: true,
    },
    Variant {
        name: "affinity, max_batch 8, unshared",
        policy: "affinity",
        max_batch: 8,
        shared_encodings: false,
    },
    Variant {
        name: "affinity, max_batch 1",
        policy: "affinity",
        max_batch: 1,
        shared_encodings: true,
    },
    Variant {
        name: "least_loaded",
        policy: "least_loaded",
        max_batch: 1,
        shared_encodings: true,
    },
    Variant {
        name: "least_loaded, unshared",
        policy: "least_loaded",
        max_batch: 1,
        shared_encodings: false,
    },
    Variant {
        name: "round_robin",
        policy: "round_robin",
        max_batch: 1,
        shared_encodings: true,
    },
];

/// Runs the workload against one dispatch set-up on a fresh farm and measures it.
pub async fn run_policy(
    variant: Variant,
    config: &RunConfig,
    workload: &Workload,
) -> anyhow::Result<PolicyReport> {
    let mut farm = start_farm(variant, config).await?;
    run_workload(variant, config, workload, &mut farm).await
}

/// A fresh farm of `config.workers` test-pattern workers with the profile's (scaled) delays and
/// a scheduler dispatching as `variant` says.
async fn start_farm(variant: Variant, config: &RunConfig) -> anyhow::Result<Farm> {
    let policy = variant.policy;
    let mut farm = Farm::new(&format!("fleet-{policy}")).await?;
    // The scheduler's waits are scaled like the work: an edit waits up to about six edits of
    // the profile for the worker holding its input (9 s on the H200; the default is 3 s).
    let p = config.profile;
    let edit_ms = 4.0 * p.edit_step_ms + p.encode_ms + p.decode_ms;
    for (key, value) in [
        ("POLICY", policy.to_owned()),
        ("MAX_BATCH", variant.max_batch.to_string()),
        (
            "AFFINITY_WAIT_MS",
            scaled(6.0 * edit_ms, config.scale).to_string(),
        ),
        ("COALESCE_WINDOW_MS", scaled(50.0, config.scale).to_string()),
    ] {
        farm.scheduler_env
            .push((format!("VNFARM_DISPATCH__{key}"), value));
    }
    farm.start_scheduler().await?;
    let env = |k: &str, v: String| (format!("VNFARM_ENGINE__TEST_PATTERN__{k}"), v);
    for n in 0..config.workers {
        let options = WorkerOptions {
            step_ms: scaled(p.generate_step_ms, config.scale),
            extra_env: vec![
                env(
                    "EDIT_STEP_MS",
                    scaled(p.edit_step_ms, config.scale).to_string(),
                ),
                env("ENCODE_MS", scaled(p.encode_ms, config.scale).to_string()),
                env("DECODE_MS", scaled(p.decode_ms, config.scale).to_string()),
                env("BATCH_STEP_COST", p.batch_step_cost.to_string()),
                env(
                    "AREA_SCALING",
                    if config.mixed { "1" } else { "0" }.to_owned(),
                ),
                // Encodings shrink with the time scale (bandwidth time); the storage round trip
                // itself is not scaled, which overcharges fetches.
                env(
                    "ENCODING_KIB",
                    ((ENCODING_KIB / config.scale).round() as u64)
                        .max(1)
                        .to_string(),
                ),
                (
                    "VNFARM_SHARED_ENCODINGS__ENABLED".into(),
                    variant.shared_encodings.to_string(),
                ),
                ("VNFARM_PREFETCH".into(), "1".into()),
            ],
        };
        farm.start_worker(&format!("w{n}"), options).await?;
    }
    Ok(farm)
}

/// Submits the workload to `farm`, waits for all of it and measures it.
async fn run_workload(
    variant: Variant,
    config: &RunConfig,
    workload: &Workload,
    farm: &mut Farm,
) -> anyhow::Result<PolicyReport> {
    let made = workload::submit(farm, workload).await?;
    let all: Vec<JobId> = made.iter().flat_map(|m| m.top.iter().copied()).collect();
    let expected = all.len();
    wait_for(
        "every job of the workload to finish",
        Duration::from_secs(600),
        || async {
            let terminal = finished_count(farm, &all).await.ok()?;
            (terminal == expected).then_some(())
        },
    )
    .await
    .with_context(|| farm.worker_logs())?;
    let metrics = farm.scheduler_metrics().await?;
    let log = crate::stream::read_all(farm).await?;
    if log.undecodable > 0 {
        bail!(
            "{} undecodable messages in the event stream",
            log.undecodable
        );
    }
    let report = report::measure(variant.name, &log.events, &metrics, config.workers)?;
    if report.completed != report.jobs {
        let logs = farm.keep_logs();
        bail!(
            "{}: {} of {} jobs completed (logs kept in {})",
            variant.name,
            report.completed,
            report.jobs,
            logs.display()
        );
    }
    Ok(report)
}

/// How many of `ids` are in a terminal state, counting until the first that is not.
async fn finished_count(farm: &Farm, ids: &[JobId]) -> anyhow::Result<usize> {
    let mut n = 0;
    for id in ids {
        if farm.job(id).await?.state.is_terminal() {
            n += 1;
        } else {
            return Ok(n);
        }
    }
    Ok(n)
}

/// Every job of a run: what it was, when it was queued, started and ended, where it ran.
#[derive(Debug, Default, Clone)]
struct JobTimes {
    kind: &'static str,
    priority: Option<Priority>,
    affinity_key: Option<String>,
    queued: Option<DateTime<Utc>>,
    started: Option<DateTime<Utc>>,
    ended: Option<DateTime<Utc>>,
    completed: bool,
    worker: Option<String>,
    encoded: bool,
    /// Its input's encodings came from shared storage, in this many seconds.
    fetched: Option<f64>,
    batch: Option<JobId>,
}

/// Folds the event log into one record per job (pipelines themselves are left out: their jobs
/// are counted).
fn jobs_of(events: &[SequencedEvent]) -> BTreeMap<JobId, JobTimes> {
    let mut jobs: BTreeMap<JobId, JobTimes> = BTreeMap::new();
    for ev in events {
        let id = ev.event.job_id;
        let at = ev.event.at;
        match &ev.event.kind {
            EventKind::Queued {
                submission,
                children,
                ..
            } => {
                if matches!(submission.job, JobSpec::Pipeline(_)) {
                    let derived = vnfarm_proto::pipeline_jobs(submission, children);
                    for (child, spec) in children.iter().zip(derived.into_iter().flatten()) {
                        let j = jobs.entry(*child).or_default();
                        j.kind = spec.job.kind_name();
                        j.priority = Some(submission.priority);
                        j.affinity_key = match &spec.job {
                            JobSpec::Edit(e) => e.affinity_key(),
                            _ => None,
                        };
                        j.queued = Some(at);
                    }
                    continue;
                }
                let j = jobs.entry(id).or_default();
                j.kind = submission.job.kind_name();
                j.priority = Some(submission.priority);
                j.affinity_key = match &submission.job {
                    JobSpec::Edit(e) => e.affinity_key(),
                    _ => None,
                };
                j.queued = Some(at);
            }
            EventKind::Dispatched { batch, .. } => {
                if let Some(j) = jobs.get_mut(&id) {
                    j.batch = *batch;
                }
            }
            EventKind::Started { worker, .. } => {
                if let Some(j) = jobs.get_mut(&id) {
                    j.started.get_or_insert(at);
                    j.worker = Some(worker.to_string());
                }
            }
            EventKind::Completed {
                timings, worker, ..
            } => {
                if let Some(j) = jobs.get_mut(&id) {
                    j.ended.get_or_insert(at);
                    j.completed = true;
                    j.encoded |= timings.0.get("encode").is_some_and(|s| *s > 0.0);
                    if let Some(s) = timings.0.get("fetch_encodings") {
                        j.fetched = Some(*s);
                    }
                    if let Some(w) = worker {
                        j.worker = Some(w.to_string());
                    }
                }
            }
            EventKind::Failed {
                retryable: false, ..
            }
            | EventKind::Cancelled { .. } => {
                if let Some(j) = jobs.get_mut(&id) {
                    j.ended.get_or_insert(at);
                }
            }
            _ => {}
        }
    }
    jobs
}
