//! `vnfarm-worker bench`: the whole worker on a local queue, for measuring a box without a broker.
//!
//! Work messages (the JSON the scheduler publishes, one per line of a file) go through the path a
//! delivery takes from dequeue to upload: the same [`Worker`] (engine host, storage with its retries,
//! hashes for the manifests, model cache), the same [`Worker::execute`] (skip check, `started`,
//! input fetch and decode, the engine's runs, PNG encode, outputs and manifest stored), and up to
//! `prefetch` messages in hand at once, as a session holds them. Storage is the local-directory
//! backend of `vnfarm-storage`, rooted at `--out`. What it leaves out: the AMQP consume and ack, the
//! heartbeats, cancels and yields from the control fan-out, and the publishing of events (they are
//! counted instead, [`LocalEvents`]), so also the settling of failures (dead letters, requeues).
//!
//! The queue stands in for the scheduler's dispatch: a message is dequeued once every job whose
//! output it reads (`job_output` inputs) has completed, in file order otherwise, so pipelines
//! interleave and the engine always has work while any is ready (a saturating queue).
//!
//! The report (`bench-report-<work file>.json` under `--out`, and a summary on stdout): jobs and pipelines per
//! hour over the wall time from the first dequeue to the last upload, the engine's compute time on
//! the device's clock ([`crate::engine::EngineBusy`]) and so the GPU's busy fraction, the time per
//! job outside compute, the GPU's peak memory in use (its runtime's reading, sampled every 50 ms),
//! and the cold start: process start to the engine warm and the first job taken.
//!
//! `vnfarm-worker bench workload` writes the studio's workloads as such a file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::Serialize;
use serde_json::json;
use vnfarm_proto::{BatchedJob, ImageRef, JobId, Task, WorkMessage, decode_json};
use vnfarm_storage::StorageConfig;

use crate::config::Config;
use crate::end::{Ended, JobEnd};
use crate::outbox::{LocalEvents, Outbox};
use crate::worker::Worker;

#[derive(Parser, Debug)]
#[command(
    name = "vnfarm-worker bench",
    about = "the worker on a local queue of work messages"
)]
struct BenchArgs {
    #[command(subcommand)]
    workload: Option<WorkloadCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The worker's configuration file (its storage is replaced by a directory under --out).
    #[arg(long, env = "VNFARM_CONFIG")]
    config: Option<PathBuf>,
    /// Work messages, one JSON object per line. Given more than once, the files run one after
    /// another in the same process (one report each; the cold start is the first's).
    #[arg(long)]
    work: Vec<PathBuf>,
    /// Where results (the storage root) and the report go.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum WorkloadCommand {
    /// Writes a workload: the studio's pipelines, or its mix.
    Workload(WorkloadArgs),
}

#[derive(Args, Debug, Clone)]
struct WorkloadArgs {
    /// `studio`: pipelines of 1 SDXL base + 3 Qwen edits of it (one batch message) + 1 upscale of
    /// it. `mix`: rounds of a generate batch of 2, a plain generate, 4 edits of one input (one
    /// batch message) and an upscale.
    #[arg(long, default_value = "studio")]
    kind: WorkloadKind,
    /// Pipelines (studio) or rounds (mix).
    #[arg(long, default_value_t = 4)]
    count: u32,
    /// The SDXL base's side (square).
    #[arg(long, default_value_t = 1024)]
    side: u32,
    #[arg(long, default_value_t = 20)]
    steps: u32,
    #[arg(long, default_value_t = 4)]
    edit_steps: u32,
    /// The upscale's factor.
    #[arg(long, default_value_t = 2)]
    scale: u32,
    /// The edits' output side (square); unset, the model's default (about a megapixel at the
    /// input's aspect ratio), as the studio submits them.
    #[arg(long)]
    edit_side: Option<u32>,
    #[arg(long)]
    out: PathBuf,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum WorkloadKind {
    Studio,
    Mix,
}

/// `vnfarm-worker bench ...` (`args[0]` is `bench`).
pub fn main(args: &[String]) -> ExitCode {
    let main_started = Instant::now();
    let args = match BenchArgs::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 64 } else { 0 });
        }
    };
    if let Some(WorkloadCommand::Workload(w)) = &args.workload {
        return match write_workload(w) {
            Ok(n) => {
                println!("{n} work messages written to {}", w.out.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("vnfarm-worker bench workload: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let (false, Some(out)) = (args.run.work.is_empty(), args.run.out.clone()) else {
        eprintln!("vnfarm-worker bench: --work FILE and --out DIR are required");
        return ExitCode::from(64);
    };
    let config = match Config::load(args.run.config.as_deref(), vnfarm_config::process_env()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vnfarm-worker bench: configuration error: {e}");
            return ExitCode::from(64);
        }
    };
    let mut phases = Vec::new();
    for work in &args.run.work {
        match read_work(work) {
            Ok(m) => phases.push((phase_name(work), m)),
            Err(e) => {
                eprintln!("vnfarm-worker bench: {e:#}");
                return ExitCode::from(64);
            }
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    for note in crate::tuning::apply_environment(config.engine.settings_file.as_deref()) {
        tracing::info!("{note}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vnfarm-worker bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, phases, &out, main_started)) {
        Ok((reports, worker)) => {
            for report in &reports {
                print!("{}", report.summary());
            }
            let code = if reports.iter().all(|r| r.failed == 0) {
                0
            } else {
                1
            };
            // The engine thread still holds the models' device tensors. Dropping the worker lets
            // that thread free them while the process exits and libtorch's CUDA allocator is torn
            // down beside it, which aborted one H200 run ("invalid device pointer" in a tensor's
            // destructor) after its reports were written. The process ends here instead, the
            // engine idle and nothing freed.
            std::mem::forget(worker);
            std::process::exit(code)
        }
        Err(e) => {
            eprintln!("vnfarm-worker bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A work file's name without its extension, naming its report.
fn phase_name(work: &Path) -> String {
    work.file_stem()
        .map_or_else(|| "work".to_owned(), |s| s.to_string_lossy().into_owned())
}

/// One line of the work file, decoded, with the jobs whose outputs it reads.
struct Queued {
    line: usize,
    message: WorkMessage,
    needs: Vec<JobId>,
}

fn read_work(path: &Path) -> anyhow::Result<Vec<Queued>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut queued = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let message: WorkMessage = decode_json(line.as_bytes()).map_err(|e| {
            anyhow::anyhow!("{}:{}: not a work message: {e}", path.display(), i + 1)
        })?;
        let own: HashSet<JobId> = message.jobs().map(|j| j.job_id).collect();
        let mut needs: Vec<JobId> = message
            .jobs()
            .flat_map(|j| reads(&j.task))
            .filter(|id| !own.contains(id))
            .collect();
        needs.sort();
        needs.dedup();
        queued.push(Queued {
            line: i + 1,
            message,
            needs,
        });
    }
    anyhow::ensure!(!queued.is_empty(), "{}: no work messages", path.display());
    Ok(queued)
}

/// The jobs whose outputs a task reads.
fn reads(task: &Task) -> Vec<JobId> {
    let refs: Vec<&ImageRef> = match task {
        Task::Generate(_) => Vec::new(),
        Task::Edit(e) => e.images(),
        Task::Upscale(u) => vec![&u.input],
    };
    refs.into_iter()
        .filter_map(|r| match r {
            ImageRef::JobOutput { job, .. } => Some(*job),
            ImageRef::Stored(_) | ImageRef::Inline(_) => None,
        })
        .collect()
}

/// How one job ended, as the report lists it.
#[derive(Debug, Serialize)]
pub struct JobRecord {
    pub job_id: JobId,
    pub kind: &'static str,
    /// The message's line in the work file.
    pub line: usize,
    /// `completed`, `finished_before`, `cancelled_before` or `failed`.
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Seconds from the first dequeue: its message dequeued, and its end (stored).
    pub dequeued_s: f64,
    pub ended_s: f64,
    pub outputs: Vec<String>,
    /// The stages the worker timed (`download`, `denoise`, `encode_png`, `upload`, ...).
    pub timings: BTreeMap<String, f64>,
}

/// What one run of the benchmark measured.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The work file's name.
    pub phase: String,
    pub engine: &'static str,
    /// Messages handled at once (the configuration's `prefetch`).
    pub in_flight: usize,
    pub messages: usize,
    pub jobs: usize,
    pub completed: usize,
    pub failed: usize,
    pub by_kind: BTreeMap<&'static str, usize>,
    /// Pipelines (a generate whose output other jobs read) whose every job completed.
    pub pipelines: usize,
    /// The first dequeue to the last job stored.
    pub wall_s: f64,
    pub jobs_per_hour: f64,
    pub pipelines_per_hour: f64,
    /// The engine's runs in that time, and their compute time on each clock.
    pub engine_runs: u64,
    pub compute_host_s: f64,
    pub compute_device_s: Option<f64>,
    /// Device compute ÷ wall time (host compute where there is no device reading).
    pub busy_fraction: f64,
    pub busy_clock: &'static str,
    /// (wall − compute) ÷ jobs.
    pub outside_compute_per_job_s: f64,
    /// Mean seconds per job of each timed stage.
    pub stage_means_s: BTreeMap<String, f64>,
    /// The device's memory in use (total − free), peak over the run and at the start.
    pub gpu_used_peak_mib: Option<f64>,
    pub gpu_used_ready_mib: Option<f64>,
    /// Process `main` to the engine loaded and warm, and to the first job taken.
    pub main_to_ready_s: f64,
    pub main_to_first_dequeue_s: f64,
    /// Wall-clock time (Unix seconds) of the first dequeue, for timing against the process start
    /// as a shell sees it.
    pub first_dequeue_unix_s: f64,
    /// Events of the runs by kind (`started`, `progress`), as they would have been published.
    pub events: BTreeMap<&'static str, u64>,
    pub job_records: Vec<JobRecord>,
}

impl Report {
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let mem = |m: Option<f64>| m.map_or("-".to_owned(), |m| format!("{m:.0} MiB"));
        s.push_str(&format!(
            "bench {}: {} jobs ({} completed, {} failed) in {} messages, {} at once, engine {}\n",
            self.phase,
            self.jobs,
            self.completed,
            self.failed,
            self.messages,
            self.in_flight,
            self.engine
        ));
        s.push_str(&format!(
            "wall {:.2} s: {:.0} jobs/h, {} pipelines ({:.1}/h)\n",
            self.wall_s, self.jobs_per_hour, self.pipelines, self.pipelines_per_hour
        ));
        s.push_str(&format!(
            "compute {:.2} s ({} clock, {} runs): busy {:.1} %, {:.3} s per job outside compute\n",
            self.compute_device_s.unwrap_or(self.compute_host_s),
            self.busy_clock,
            self.engine_runs,
            100.0 * self.busy_fraction,
            self.outside_compute_per_job_s
        ));
        s.push_str(&format!(
            "gpu used: peak {}, at ready {}; main to ready {:.2} s, to first job {:.2} s\n",
            mem(self.gpu_used_peak_mib),
            mem(self.gpu_used_ready_mib),
            self.main_to_ready_s,
            self.main_to_first_dequeue_s
        ));
        for (stage, mean) in &self.stage_means_s {
            s.push_str(&format!("  {stage}: {mean:.3} s per job\n"));
        }
        s
    }
}

/// The device's memory in use, sampled on a thread of its own until stopped.
struct MemorySampler {
    stop: Arc<AtomicBool>,
    peak_bytes: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MemorySampler {
    fn start(worker: &Worker) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak_bytes = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, peak, worker) = (stop.clone(), peak_bytes.clone(), worker.clone());
            std::thread::Builder::new()
                .name("bench-memory".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(m) = worker.engine().gpu_memory() {
                            peak.fetch_max(m.total_bytes - m.free_bytes, Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                })
                .ok()
        };
        Self {
            stop,
            peak_bytes,
            thread,
        }
    }

    fn finish(mut self) -> Option<f64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let peak = self.peak_bytes.load(Ordering::Relaxed);
        (peak > 0).then(|| peak as f64 / f64::from(1 << 20))
    }
}

/// Loads the worker, waits for its engine to be warm, then runs each queue to the end in turn.
async fn run(
    mut config: Config,
    phases: Vec<(String, Vec<Queued>)>,
    out: &Path,
    main_started: Instant,
) -> anyhow::Result<(Vec<Report>, Worker)> {
    config.storage = StorageConfig::Local {
        root: out.join("storage"),
    };
    let in_flight = usize::from(config.prefetch);
    let (worker, loading) = crate::assemble(config).await?;
    loading.finished().await.context("loading the engine")?;
    worker.lifecycle().engine_ready();
    let ready = main_started.elapsed();
    let ready_memory = worker
        .engine()
        .gpu_memory()
        .map(|m| (m.total_bytes - m.free_bytes) as f64 / f64::from(1 << 20));
    tracing::info!(seconds = ready.as_secs_f64(), "engine warm; taking work");
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut reports = Vec::new();
    for (phase, queue) in phases {
        let mut report = run_phase(&worker, in_flight, queue, main_started).await;
        report.phase = phase;
        report.main_to_ready_s = ready.as_secs_f64();
        report.gpu_used_ready_mib = ready_memory;
        let path = out.join(format!("bench-report-{}.json", report.phase));
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&report).expect("reports serialize to JSON"),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        tracing::info!(phase = report.phase, path = %path.display(), "phase done");
        reports.push(report);
    }
    Ok((reports, worker))
}

/// Runs one queue to the end on the warm worker.
async fn run_phase(
    worker: &Worker,
    in_flight: usize,
    queue: Vec<Queued>,
    main_started: Instant,
) -> Report {
    let messages = queue.len();
    let sampler = MemorySampler::start(worker);
    let busy_before = worker.engine().busy().totals();
    let events = LocalEvents::default();
    let outbox = Outbox::Local(events.clone());
    let first = Instant::now();
    let first_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());

    let pipelines = pipelines_of(&queue);
    let mut waiting: Vec<Queued> = queue;
    let listed: HashSet<JobId> = waiting
        .iter()
        .flat_map(|q| q.message.jobs().map(|j| j.job_id))
        .collect();
    let mut completed: HashSet<JobId> = HashSet::new();
    let mut records: Vec<JobRecord> = Vec::new();
    let mut running = FuturesUnordered::new();
    loop {
        // A message is ready when every job it reads from completed (or is not in the file: its
        // output is expected in storage already).
        while running.len() < in_flight {
            let Some(at) = waiting.iter().position(|q| {
                q.needs
                    .iter()
                    .all(|id| completed.contains(id) || !listed.contains(id))
            }) else {
                break;
            };
            let queued = waiting.remove(at);
            let dequeued = first.elapsed();
            let (worker, outbox) = (worker.clone(), outbox.clone());
            running.push(async move {
                let ends = worker.run_local(&outbox, &queued.message).await;
                (queued, dequeued, ends)
            });
        }
        let Some((queued, dequeued, ends)) = running.next().await else {
            break;
        };
        let ended = first.elapsed();
        let jobs: Vec<BatchedJob> = queued.message.jobs().collect();
        for (job, end) in jobs.iter().zip(ends) {
            let mut record = JobRecord {
                job_id: job.job_id,
                kind: job.task.kind_name(),
                line: queued.line,
                outcome: "failed",
                error: None,
                dequeued_s: dequeued.as_secs_f64(),
                ended_s: ended.as_secs_f64(),
                outputs: Vec::new(),
                timings: BTreeMap::new(),
            };
            match end {
                Ok(Ended::Completed(done)) => {
                    completed.insert(job.job_id);
                    record.outcome = "completed";
                    record.outputs = done.outputs;
                    record.timings = done.timings.0;
                }
                Ok(Ended::FinishedBefore(_)) => {
                    completed.insert(job.job_id);
                    record.outcome = "finished_before";
                }
                Ok(Ended::CancelledBefore) => record.outcome = "cancelled_before",
                Err(e) => {
                    tracing::warn!(job_id = %job.job_id, error = %e, "job failed");
                    record.error = Some(e.to_string());
                }
            }
            records.push(record);
        }
    }
    let wall = records
        .iter()
        .map(|r| r.ended_s)
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let peak = sampler.finish();
    let busy = worker.engine().busy().totals();
    for q in &waiting {
        for job in q.message.jobs() {
            records.push(JobRecord {
                job_id: job.job_id,
                kind: job.task.kind_name(),
                line: q.line,
                outcome: "failed",
                error: Some("never ready: a job it reads from did not complete".into()),
                dequeued_s: wall,
                ended_s: wall,
                outputs: Vec::new(),
                timings: BTreeMap::new(),
            });
        }
    }
    let runs = busy.runs - busy_before.runs;
    let host = (busy.host - busy_before.host).as_secs_f64();
    let device = match (busy.device, busy_before.device) {
        (Some(after), Some(before)) => Some((after - before).as_secs_f64()),
        (Some(after), None) if busy_before.runs == 0 => Some(after.as_secs_f64()),
        _ => None,
    };
    let compute = device.unwrap_or(host);
    let jobs = records.len();
    let done = |r: &JobRecord| matches!(r.outcome, "completed" | "finished_before");
    let completed_n = records.iter().filter(|r| done(r)).count();
    let mut by_kind = BTreeMap::new();
    for r in &records {
        *by_kind.entry(r.kind).or_insert(0) += 1;
    }
    let mut stage_sums: BTreeMap<String, f64> = BTreeMap::new();
    for r in &records {
        for (stage, s) in &r.timings {
            *stage_sums.entry(stage.clone()).or_default() += s;
        }
    }
    let stage_means_s = stage_sums
        .into_iter()
        .map(|(k, v)| (k, v / completed_n.max(1) as f64))
        .collect();
    let done_ids: HashSet<JobId> = records
        .iter()
        .filter(|r| done(r))
        .map(|r| r.job_id)
        .collect();
    let pipelines = pipelines
        .iter()
        .filter(|(base, rest)| done_ids.contains(base) && rest.iter().all(|j| done_ids.contains(j)))
        .count();
    let per_hour = |n: usize| n as f64 * 3600.0 / wall;
    Report {
        phase: String::new(),
        engine: worker.engine().name(),
        in_flight,
        messages,
        jobs,
        completed: completed_n,
        failed: jobs - completed_n,
        by_kind,
        pipelines,
        wall_s: wall,
        jobs_per_hour: per_hour(completed_n),
        pipelines_per_hour: per_hour(pipelines),
        engine_runs: runs,
        compute_host_s: host,
        compute_device_s: device,
        busy_fraction: compute / wall,
        busy_clock: if device.is_some() { "device" } else { "host" },
        outside_compute_per_job_s: (wall - compute) / jobs.max(1) as f64,
        stage_means_s,
        gpu_used_peak_mib: peak,
        gpu_used_ready_mib: None,
        main_to_ready_s: 0.0,
        main_to_first_dequeue_s: (first - main_started).as_secs_f64(),
        first_dequeue_unix_s: first_unix,
        events: events.counts(),
        job_records: records,
    }
}

/// Pipelines: each generate that other jobs of the queue read from, with those jobs.
fn pipelines_of(queue: &[Queued]) -> HashMap<JobId, Vec<JobId>> {
    let generates: HashSet<JobId> = queue
        .iter()
        .flat_map(|q| q.message.jobs())
        .filter(|j| matches!(j.task, Task::Generate(_)))
        .map(|j| j.job_id)
        .collect();
    let mut pipelines: HashMap<JobId, Vec<JobId>> = HashMap::new();
    for job in queue.iter().flat_map(|q| q.message.jobs()) {
        for base in reads(&job.task) {
            if generates.contains(&base) {
                pipelines.entry(base).or_default().push(job.job_id);
            }
        }
    }
    pipelines
}

impl Worker {
    /// Runs one work message as a delivery of it runs ([`Worker::execute`]), its events to
    /// `outbox`; each job's end, in the message's order. Nothing is acked or published.
    pub(crate) async fn run_local(&self, outbox: &Outbox, message: &WorkMessage) -> Vec<JobEnd> {
        let jobs: Vec<BatchedJob> = message.jobs().collect();
        self.metrics().batch_jobs.observe(jobs.len() as f64);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        self.execute(outbox, &jobs, 1, tx).await;
        let mut ends: Vec<Option<JobEnd>> = jobs.iter().map(|_| None).collect();
        while let Some((i, end)) = rx.recv().await {
            if let Some(slot) = ends.get_mut(i) {
                *slot = Some(end);
            }
        }
        self.hand()
            .release(&jobs.iter().map(|j| j.job_id).collect::<Vec<_>>());
        ends.into_iter()
            .map(|e| {
                e.unwrap_or_else(|| {
                    Err(crate::end::JobError::Engine(
                        crate::engine::EngineError::Failed("no end for the job".into()),
                    ))
                })
            })
            .collect()
    }
}

/// Writes a workload file; returns how many messages it holds.
fn write_workload(w: &WorkloadArgs) -> anyhow::Result<usize> {
    let messages = workload(w)?;
    let mut text = String::new();
    for m in &messages {
        text.push_str(&serde_json::to_string(m).expect("work messages serialize to JSON"));
        text.push('\n');
    }
    std::fs::write(&w.out, text).with_context(|| format!("writing {}", w.out.display()))?;
    Ok(messages.len())
}

const PROMPTS: [&str; 4] = [
    "1girl, silver hair, school uniform, classroom, window light",
    "1boy, black hair, hoodie, rooftop at dusk",
    "1girl, long red hair, maid outfit, cafe interior",
    "2girls, twin tails, festival, night, lanterns",
];
const INSTRUCTIONS: [&str; 4] = [
    "make her smile",
    "make her angry",
    "make her cry",
    "close her eyes",
];

/// The messages of a workload, as the scheduler would dispatch them (a pipeline's edits of one
/// input coalesced into one batch message, as `affinity` does).
fn workload(w: &WorkloadArgs) -> anyhow::Result<Vec<WorkMessage>> {
    let mut out = Vec::new();
    let mut seed = 1000u64;
    let mut next_seed = || {
        seed += 1;
        seed
    };
    let generate = |prompt: &str, width: u32, height: u32, seed: u64| {
        json!({
            "kind": "generate", "prompt": prompt, "negative_prompt": "lowres, bad anatomy",
            "width": width, "height": height, "steps": w.steps, "cfg": 4.5, "sampler": "euler",
            "seed": seed, "count": 1,
        })
    };
    let edit = |of: JobId, instruction: &str, seed: u64| {
        let mut task = json!({
            "kind": "edit", "inputs": [{"job_output": {"job": of, "index": 0}}],
            "instruction": instruction, "steps": w.edit_steps, "cfg": 1.0, "seed": seed,
        });
        if let Some(side) = w.edit_side {
            task["width"] = json!(side);
            task["height"] = json!(side);
        }
        task
    };
    let upscale = |of: JobId| json!({"kind": "upscale", "input": {"job_output": {"job": of, "index": 0}}, "scale": w.scale});
    let message = |tasks: Vec<(JobId, serde_json::Value)>| -> anyhow::Result<WorkMessage> {
        let mut jobs = tasks
            .into_iter()
            .map(|(id, task)| json!({"job_id": id, "priority": "batch", "task": task}));
        let mut first = jobs.next().expect("a message has a job");
        first["schema_version"] = json!(vnfarm_proto::PROTOCOL_VERSION);
        let batch: Vec<_> = jobs.collect();
        if !batch.is_empty() {
            first["batch"] = json!(batch);
        }
        decode_json(first.to_string().as_bytes())
            .map_err(|e| anyhow::anyhow!("a workload message does not decode: {e}"))
    };
    for n in 0..w.count as usize {
        let prompt = PROMPTS[n % PROMPTS.len()];
        match w.kind {
            WorkloadKind::Studio => {
                let base = JobId::new();
                out.push(message(vec![(
                    base,
                    generate(prompt, w.side, w.side, next_seed()),
                )])?);
                out.push(message(
                    INSTRUCTIONS[..3]
                        .iter()
                        .map(|i| (JobId::new(), edit(base, i, next_seed())))
                        .collect(),
                )?);
                out.push(message(vec![(JobId::new(), upscale(base))])?);
            }
            WorkloadKind::Mix => {
                let pair = (JobId::new(), JobId::new());
                out.push(message(vec![
                    (pair.0, generate(prompt, w.side, w.side, next_seed())),
                    (pair.1, generate(prompt, w.side, w.side, next_seed())),
                ])?);
                let (portrait_w, portrait_h) = portrait(w.side);
                out.push(message(vec![(
                    JobId::new(),
                    generate(prompt, portrait_w, portrait_h, next_seed()),
                )])?);
                out.push(message(
                    INSTRUCTIONS
                        .iter()
                        .map(|i| (JobId::new(), edit(pair.0, i, next_seed())))
                        .collect(),
                )?);
                out.push(message(vec![(JobId::new(), upscale(pair.1))])?);
            }
        }
    }
    Ok(out)
}

/// The studio's portrait size for a square side (832×1216 for 1024), multiples of 8.
fn portrait(side: u32) -> (u32, u32) {
    let w = (side * 13 / 16) / 8 * 8;
    let h = (side * 19 / 16) / 8 * 8;
    (w.max(8), h.max(8))
}
