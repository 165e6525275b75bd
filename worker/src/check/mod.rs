//! `vnfarm-worker check`: the box checks and tunes itself with the worker's own configuration and
//! model files, and writes what it measured.
//!
//! - [`environment`]: libtorch, the GPU backend, the device, memory, driver and kernel facts, the
//!   ROCm variables, the SDPA kernel libtorch picks at each engine's attention shapes;
//! - [`sdxl`], [`qwen`], [`esrgan`]: each engine on the device against a CPU copy, then every
//!   candidate setting against the portable path, then speed at the studio's sizes;
//! - [`measure`]: timing (first call apart, medians) and agreement;
//! - [`report`]: the JSON report, the readable summary, and the journal of each engine's process.
//!
//! Each engine runs in a process of its own (`vnfarm-worker check-engine`) that writes a journal
//! line before every step that may crash (a kernel compiler, a HIP solver) and one after. When the
//! process dies or hangs, the parent marks the step it died in as failed, with the reason, and runs
//! the engine again skipping that step, so no candidate can fail the command. A last process loads
//! the engines from the written settings file exactly as the worker does (fingerprint checked,
//! warm-up run) and measures the device memory with the largest decode: the proof that a worker
//! can start from the state the check leaves the GPU in.
//!
//! Outputs, in `--out` (default `vnfarm-check/`): `report.json`, `summary.txt` (PASS / FAIL / SKIP
//! per check) and `settings.json`, the file for `engine.settings_file`.

pub mod environment;
pub mod esrgan;
pub mod measure;
pub mod qwen;
pub mod report;
pub mod sdxl;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tch::{Device, Kind};

use crate::Config;
use crate::engine::settings;
use crate::tuning::fingerprint::{self, DeviceIdentity};
use crate::tuning::{self, BoxSettings, file::Fingerprint};
use environment::Environment;
use measure::{Repeats, Timing};
use report::{CheckResult, EngineReport, Journal, MemoryReading, Outcome, Record, Report};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "vnfarm-worker check",
    about = "Check and tune this box for the worker's configuration"
)]
pub struct CheckArgs {
    /// The worker's configuration (else VNFARM_CONFIG; VNFARM_* variables override).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where the report, the summary and the settings file go.
    #[arg(long, default_value = "vnfarm-check")]
    pub out: PathBuf,
    /// Small sizes and few repeats: for CI and tiny models, not for choosing a box's settings.
    #[arg(long)]
    pub quick: bool,
    /// Timed runs per measurement (the median is kept).
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Longest one engine's process may run before it is stopped and its step marked failed.
    #[arg(long, default_value_t = 900)]
    pub engine_timeout_s: u64,
    /// After writing the settings file, time a whole SDXL generate (20 steps, 1024², cfg 4.5) under
    /// the portable preset, the CUDA preset and the measured settings, in the worker's own load.
    #[arg(long)]
    pub compare: bool,
    /// The model crate's fixture folder (`worker/models/fixtures` in a checkout,
    /// `/usr/share/vnfarm/fixtures` in the images): the tiny SDXL is run on the device against
    /// diffusers' image. Unset: that check is skipped.
    #[arg(long)]
    pub fixtures: Option<PathBuf>,
    /// A process variable to measure as a candidate (`KEY=VALUE`; repeatable). On a HIP build the
    /// ROCm variables that change speed are candidates already.
    #[arg(long = "env-candidate")]
    pub env_candidates: Vec<String>,
}

/// The internal per-engine entry (`vnfarm-worker check-engine`).
#[derive(Debug, Clone, Parser)]
#[command(name = "vnfarm-worker check-engine", hide = true)]
pub struct EngineArgs {
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub engine: String,
    #[arg(long)]
    pub journal: PathBuf,
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
    #[arg(long)]
    pub quick: bool,
    #[arg(long)]
    pub repeats: Option<usize>,
    /// For `verify`: the settings file to load the engines from.
    #[arg(long)]
    pub settings_file: Option<PathBuf>,
    /// For `verify`: compare whole generates under the presets and the measured settings.
    #[arg(long)]
    pub compare: bool,
    #[arg(long)]
    pub fixtures: Option<PathBuf>,
}

/// How much to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    pub quick: bool,
    pub repeats: Repeats,
    /// The model crate's fixture folder, for the tiny models' parity on the device.
    pub fixtures: Option<PathBuf>,
}

impl Plan {
    fn new(quick: bool, repeats: Option<usize>, fixtures: Option<PathBuf>) -> Self {
        let timed = repeats.unwrap_or(if quick { 2 } else { 5 });
        Plan {
            quick,
            repeats: Repeats {
                warm: if quick { 0 } else { 2 },
                timed,
            },
            fixtures,
        }
    }
}

/// The relative error a device's output may have against a CPU copy in fp32, by the device's
/// dtype: bf16 keeps 8 bits of mantissa (a network's outputs move by about 1e-2); fp32 on a GPU
/// may run convolutions in TF32.
pub fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Float | Kind::Double => 5e-3,
        _ => 6e-2,
    }
}

/// The files of a bundled fixture under `--fixtures` (`relative` paths), or `None` after recording
/// check `id` as skipped: without a fixture folder, or when it lacks one of them (`what` names the
/// fixture).
pub fn fixture_files<const N: usize>(
    plan: &Plan,
    step: &mut Step,
    id: &str,
    what: &str,
    relative: [&str; N],
) -> Option<[PathBuf; N]> {
    let Some(root) = &plan.fixtures else {
        step.record(CheckResult::skip(id, "no fixture folder (--fixtures)"));
        return None;
    };
    let files = relative.map(|r| root.join(r));
    if files.iter().any(|f| !f.exists()) {
        step.record(CheckResult::skip(
            id,
            format!("no {what} fixture under {}", root.display()),
        ));
        return None;
    }
    Some(files)
}

/// A step id at which an engine process aborts (tests of the crash handling only).
pub const ABORT_AT_VAR: &str = "VNFARM_TEST_CHECK_ABORT_AT";

/// An engine process's steps, recorded in its journal.
pub struct Step {
    journal: Journal,
    skip: HashSet<String>,
}

impl Step {
    pub fn new(journal: Journal, skip: impl IntoIterator<Item = String>) -> Self {
        Self {
            journal,
            skip: skip.into_iter().collect(),
        }
    }

    /// Whether the parent asked to skip `id` (it crashed this process before).
    pub fn skipped(&self, id: &str) -> bool {
        self.skip.contains(id)
    }

    /// Whether candidate `id` is to be tried: not where its settings need the C++ shims and this
    /// binary was built without them (recorded as a skip), nor where the parent asked to skip it.
    pub fn can_try(&mut self, id: &str, needs_shims: bool) -> bool {
        if needs_shims && !vnfarm_models::nn::ops::BUILT_IN {
            self.record(CheckResult::skip(
                id,
                "needs the C++ shims, which this binary was built without",
            ));
            return false;
        }
        !self.skipped(id)
    }

    pub fn start(&mut self, id: &str) {
        self.journal.write(&Record::Start { id: id.to_owned() });
        // Fault injection for tests: the process dies here as a crashing kernel compiler or solver
        // would take it down, to prove the parent survives it.
        if std::env::var_os(ABORT_AT_VAR).is_some_and(|at| at == id) {
            eprintln!("check-engine: {ABORT_AT_VAR}={id}: aborting");
            std::process::abort();
        }
    }

    pub fn record(&mut self, result: CheckResult) {
        self.journal.write(&Record::Check(result));
    }

    pub fn timing(&mut self, timing: Timing) {
        self.journal.write(&Record::Timing(timing));
    }

    pub fn chosen(&mut self, settings: serde_json::Value, speedup: f64) {
        self.journal.write(&Record::Chosen { settings, speedup });
    }

    /// Runs a step that may fail or panic; records only a failure (the caller records the
    /// outcome). `None` when it failed or is skipped.
    pub fn attempt<T>(&mut self, id: &str, f: impl FnOnce() -> anyhow::Result<T>) -> Option<T> {
        if self.skipped(id) {
            return None;
        }
        self.start(id);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _guard = tch::no_grad_guard();
            f()
        }));
        match result {
            Ok(Ok(value)) => Some(value),
            Ok(Err(e)) => {
                self.record(CheckResult::fail(
                    id,
                    environment::first_line(&format!("{e:#}")),
                ));
                None
            }
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "a panic".into());
                self.record(CheckResult::fail(
                    id,
                    format!("panicked: {}", environment::first_line(&why)),
                ));
                None
            }
        }
    }

    /// [`Step::attempt`] that also records the pass with the step's own words.
    pub fn run<T>(
        &mut self,
        id: &str,
        f: impl FnOnce() -> anyhow::Result<(T, String)>,
    ) -> Option<T> {
        let (value, detail) = self.attempt(id, f)?;
        self.record(CheckResult::pass(id, detail, None));
        Some(value)
    }

    /// An agreement step: `f` gives a relative error, recorded as passing below `tolerance`.
    pub fn agreement(
        &mut self,
        id: &str,
        what: &str,
        tolerance: f64,
        f: impl FnOnce() -> anyhow::Result<f64>,
    ) {
        if let Some(error) = self.attempt(id, f) {
            self.record(CheckResult::within(id, what, error, tolerance));
        }
    }

    /// Records whether a candidate that ran in `seconds` beats the best so far (`best`) by more
    /// than the noise ([`measure::KEEP_BELOW`]), and says so.
    pub fn speed(&mut self, id: &str, seconds: f64, best: f64) -> bool {
        let kept = seconds < best * measure::KEEP_BELOW;
        self.record(CheckResult::pass(
            &format!("{id}.speed"),
            format!(
                "{seconds:.4} s against {best:.4} s: {}",
                if kept { "kept" } else { "not faster, dropped" }
            ),
            Some(seconds),
        ));
        kept
    }

    /// Times `f` as one step (recorded as a timing, or as a failure).
    pub fn time<T>(
        &mut self,
        id: &str,
        candidate: &str,
        device: Device,
        repeats: Repeats,
        f: impl FnMut() -> anyhow::Result<T>,
    ) -> Option<Timing> {
        let step_id = format!("{id}.{candidate}");
        let timing = self.attempt(&step_id, || {
            measure::time(id, candidate, device, repeats, f)
        })?;
        self.timing(timing.clone());
        Some(timing)
    }
}

/// `vnfarm-worker check …`. Exits 0 whatever the checks found (the report says); 64 for a bad
/// configuration or arguments, 1 when the outputs cannot be written.
pub fn main(args: &[String]) -> ExitCode {
    let args = match CheckArgs::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 64 } else { 0 });
        }
    };
    let config = match load_config(args.config.as_deref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match run(&args, &config) {
        Ok(report) => {
            print!("{}", report.summary());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vnfarm-worker check: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&Path>) -> Result<Config, ExitCode> {
    let path = path
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("VNFARM_CONFIG").map(PathBuf::from));
    Config::load(path.as_deref(), vnfarm_config::process_env()).map_err(|e| {
        eprintln!("vnfarm-worker check: configuration error: {e}");
        ExitCode::from(64)
    })
}

/// The engines a configuration runs, by their settings-file names.
fn engines(config: &Config) -> Vec<&'static str> {
    let e = &config.engine;
    let mut out = Vec::new();
    if e.sdxl.is_some() {
        out.push("sdxl");
    }
    if e.qwen_edit.is_some() {
        out.push("qwen_edit");
    }
    if e.esrgan.is_some() {
        out.push("esrgan");
    }
    out
}

fn run(args: &CheckArgs, config: &Config) -> anyhow::Result<Report> {
    let started_at = chrono::Utc::now();
    let started = Instant::now();
    std::fs::create_dir_all(&args.out)?;
    let names = engines(config);
    anyhow::ensure!(
        !names.is_empty(),
        "the configuration names no model (engine.sdxl, engine.qwen_edit or engine.esrgan): nothing to check"
    );
    let device = settings::device_of(&config.engine);
    let environment = Environment::read(device);
    let env_sets = env_candidates(args, &environment);
    let bar = ProgressBar::new((names.len() * env_sets.len() + 1) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let plan_args = |engine: &str| {
        let mut a = vec!["--engine".to_owned(), engine.to_owned()];
        if let Some(c) = &args.config {
            a.extend(["--config".to_owned(), c.display().to_string()]);
        }
        if args.quick {
            a.push("--quick".into());
        }
        if let Some(r) = args.repeats {
            a.extend(["--repeats".to_owned(), r.to_string()]);
        }
        if let Some(f) = &args.fixtures {
            a.extend(["--fixtures".to_owned(), f.display().to_string()]);
        }
        a
    };
    // Each engine under each environment set; the set with the lowest total time wins.
    let mut by_set: Vec<BTreeMap<String, EngineReport>> = Vec::new();
    for (k, set) in env_sets.iter().enumerate() {
        let mut reports = BTreeMap::new();
        for name in &names {
            let label = if set.is_empty() {
                (*name).to_owned()
            } else {
                format!("{name} with {}", describe_env(set))
            };
            let dir = args.out.join(format!("work/{name}-{k}"));
            let report = run_engine(
                &plan_args(name),
                set,
                &dir,
                &label,
                &bar,
                args.engine_timeout_s,
            )?;
            reports.insert((*name).to_owned(), report);
            bar.inc(1);
        }
        by_set.push(reports);
    }
    let (best_set, mut engine_reports) = choose_environment(&env_sets, by_set);
    let chosen_environment: BTreeMap<String, String> = env_sets[best_set].iter().cloned().collect();

    // The settings file, where every engine chose something.
    let settings_path = args.out.join("settings.json");
    let all_chosen = names
        .iter()
        .all(|n| engine_reports.get(*n).is_some_and(|r| r.chosen.is_some()));
    let mut settings_file = None;
    let mut verify = EngineReport::default();
    let mut memory = EngineReport::default();
    if all_chosen {
        let chosen = |n: &str| engine_reports.get(n).and_then(|r| r.chosen.clone());
        let file = BoxSettings {
            format: tuning::file::FORMAT.into(),
            measured_at: chrono::Utc::now(),
            fingerprint: Fingerprint {
                device: DeviceIdentity::of(device),
                libtorch: fingerprint::libtorch_build(),
                vnfarm: fingerprint::vnfarm_build(),
                models: settings::model_identities(&config.engine)?,
            },
            environment: chosen_environment.clone(),
            sdxl: chosen("sdxl").map(serde_json::from_value).transpose()?,
            qwen_edit: chosen("qwen_edit")
                .map(serde_json::from_value)
                .transpose()?,
            esrgan: chosen("esrgan").map(serde_json::from_value).transpose()?,
        };
        let id = file.write(&settings_path)?;
        settings_file = Some(format!("{} (id {id})", settings_path.display()));
        // The worker's own load from the file, warm-up and the memory of the largest decode.
        let mut a = plan_args("verify");
        a.extend([
            "--settings-file".to_owned(),
            settings_path.display().to_string(),
        ]);
        if args.compare {
            a.push("--compare".into());
        }
        let dir = args.out.join("work/verify");
        let mut v = run_engine(
            &a,
            &env_sets[best_set],
            &dir,
            "verify: the worker's load from the settings file",
            &bar,
            args.engine_timeout_s,
        )?;
        memory.checks = v
            .checks
            .iter()
            .filter(|c| c.id.starts_with("memory."))
            .cloned()
            .collect();
        v.checks.retain(|c| !c.id.starts_with("memory."));
        verify = v;
    } else {
        verify.checks.push(CheckResult::fail(
            "settings_file",
            "not written: an engine could not run on this device (see its checks)",
        ));
    }
    bar.inc(1);
    bar.finish_and_clear();
    for r in engine_reports.values_mut() {
        r.timings
            .sort_by(|a, b| a.id.cmp(&b.id).then(a.candidate.cmp(&b.candidate)));
    }
    let report = Report {
        format: "vnfarm-check-report/1",
        started_at,
        seconds: started.elapsed().as_secs_f64(),
        environment,
        chosen_environment,
        engines: engine_reports,
        memory,
        verify,
        settings_file,
    };
    std::fs::write(
        args.out.join("report.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    std::fs::write(args.out.join("summary.txt"), report.summary())?;
    Ok(report)
}

/// The environment sets to measure: none besides the process's own, plus on a HIP build the ROCm
/// variables that change speed (those the operator has not set), plus `--env-candidate`s.
fn env_candidates(args: &CheckArgs, env: &Environment) -> Vec<Vec<(String, String)>> {
    let mut sets = vec![Vec::new()];
    let mut tuned: Vec<(String, String)> = Vec::new();
    if env.backend == fingerprint::Backend::Hip {
        for (k, v) in [
            ("TORCH_BLAS_PREFER_HIPBLASLT", "1"),
            ("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1"),
            ("MIOPEN_FIND_MODE", "2"),
            ("PYTORCH_MIOPEN_SUGGEST_NHWC", "1"),
        ] {
            if std::env::var_os(k).is_none() {
                tuned.push((k.to_owned(), v.to_owned()));
            }
        }
    }
    for c in &args.env_candidates {
        if let Some((k, v)) = c.split_once('=') {
            tuned.push((k.to_owned(), v.to_owned()));
        }
    }
    if !tuned.is_empty() {
        sets.push(tuned);
    }
    sets
}

fn describe_env(set: &[(String, String)]) -> String {
    set.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The environment set whose engines' chosen settings ran fastest in total (the sum over engines
/// of their measured time), and its reports; a set under which an engine failed to choose loses.
fn choose_environment(
    sets: &[Vec<(String, String)>],
    mut by_set: Vec<BTreeMap<String, EngineReport>>,
) -> (usize, BTreeMap<String, EngineReport>) {
    let total = |reports: &BTreeMap<String, EngineReport>| -> Option<f64> {
        reports.values().map(EngineReport::chosen_seconds).sum()
    };
    let mut best = 0;
    let mut notes = Vec::new();
    let base = total(&by_set[0]);
    for k in 1..by_set.len() {
        let t = total(&by_set[k]);
        let better = match (t, base) {
            (Some(t), Some(b)) => t < b * measure::KEEP_BELOW,
            (Some(_), None) => true,
            _ => false,
        };
        notes.push(CheckResult {
            id: format!("environment.{}", describe_env(&sets[k])),
            outcome: if t.is_some() {
                Outcome::Pass
            } else {
                Outcome::Fail
            },
            detail: match (t, base) {
                (Some(t), Some(b)) => format!(
                    "{t:.3} s against {b:.3} s without: {}",
                    if better {
                        "kept"
                    } else {
                        "not faster, dropped"
                    }
                ),
                _ => "an engine could not run with these variables".into(),
            },
            value: t,
        });
        if better {
            best = k;
        }
    }
    let mut chosen = by_set.swap_remove(best);
    // Recorded once, with the first engine's checks.
    if let Some(r) = chosen.values_mut().next() {
        r.checks.extend(notes);
    }
    (best, chosen)
}

impl EngineReport {
    /// The chosen candidate's measured seconds: the sum of its timings' medians (each timing
    /// under the chosen candidate's name, else the last candidate measured for that id).
    fn chosen_seconds(&self) -> Option<f64> {
        self.chosen.as_ref()?;
        let mut by_id: BTreeMap<&str, f64> = BTreeMap::new();
        for t in &self.timings {
            // Later timings of an id are of candidates measured later; the chosen one is the
            // best of them, so the minimum stands for it.
            let e = by_id.entry(t.id.as_str()).or_insert(f64::INFINITY);
            *e = e.min(t.median_s);
        }
        Some(by_id.values().sum())
    }
}

/// Runs one engine's process to completion, restarting it past a step that crashed or hung.
fn run_engine(
    child_args: &[String],
    env: &[(String, String)],
    dir: &Path,
    label: &str,
    bar: &ProgressBar,
    timeout_s: u64,
) -> anyhow::Result<EngineReport> {
    std::fs::create_dir_all(dir)?;
    let exe = std::env::current_exe()?;
    let mut skip: Vec<String> = Vec::new();
    let mut crashed: Vec<CheckResult> = Vec::new();
    let mut restarts = Vec::new();
    for attempt in 0.. {
        let journal = dir.join(format!("journal-{attempt}.jsonl"));
        let log = std::fs::File::create(dir.join(format!("log-{attempt}.txt")))?;
        let mut cmd = Command::new(&exe);
        cmd.arg("check-engine")
            .args(child_args)
            .arg("--journal")
            .arg(&journal)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if !skip.is_empty() {
            cmd.arg("--skip").arg(skip.join(","));
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let deadline = Instant::now() + Duration::from_secs(timeout_s);
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            if let Some(Record::Start { id }) = Journal::read(&journal)
                .into_iter()
                .rev()
                .find(|r| matches!(r, Record::Start { .. }))
            {
                bar.set_message(format!("{label}: {id}"));
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        let records = Journal::read(&journal);
        let ok = status.is_some_and(|s| s.success());
        if ok || attempt >= 8 {
            let mut report = collect(records);
            report.checks.splice(0..0, crashed);
            report.restarts = restarts;
            if !ok {
                report.checks.push(CheckResult::fail(
                    &format!("{}.process", label),
                    "gave up after 8 restarts",
                ));
            }
            return Ok(report);
        }
        // The step it died in: the last start without a result of the same id.
        let finished: HashSet<String> = records
            .iter()
            .filter_map(|r| match r {
                Record::Check(c) => Some(c.id.clone()),
                Record::Timing(t) => Some(format!("{}.{}", t.id, t.candidate)),
                _ => None,
            })
            .collect();
        let died_in = records.iter().rev().find_map(|r| match r {
            Record::Start { id } if !finished.contains(id) => Some(id.clone()),
            _ => None,
        });
        let why = match status {
            None => format!("did not finish within {timeout_s} s; stopped"),
            Some(s) => format!("the process died ({s})"),
        };
        match died_in {
            Some(id) if !skip.contains(&id) => {
                restarts.push(format!("{id}: {why}"));
                crashed.push(CheckResult::fail(&id, why));
                skip.push(id);
            }
            _ => {
                let mut report = collect(records);
                report.checks.splice(0..0, crashed);
                report.checks.push(CheckResult::fail(
                    &format!("{label}.process"),
                    format!("{why} outside any step (log: {})", dir.display()),
                ));
                report.restarts = restarts;
                return Ok(report);
            }
        }
    }
    unreachable!("the loop returns")
}

fn collect(records: Vec<Record>) -> EngineReport {
    let mut report = EngineReport::default();
    for r in records {
        match r {
            Record::Start { .. } => {}
            Record::Check(c) => report.checks.push(c),
            Record::Timing(t) => report.timings.push(t),
            Record::Chosen { settings, speedup } => {
                report.chosen = Some(settings);
                report.speedup = Some(speedup);
            }
            Record::Memory(m) => report.checks.push(CheckResult::pass(
                &format!("memory.{}", m.moment),
                format!(
                    "{:.2} GiB used, {:.2} GiB free of {:.2} GiB",
                    m.used_bytes as f64 / (1u64 << 30) as f64,
                    m.free_bytes as f64 / (1u64 << 30) as f64,
                    m.total_bytes as f64 / (1u64 << 30) as f64
                ),
                Some(m.free_bytes as f64),
            )),
        }
    }
    report
}

/// `vnfarm-worker check-engine …`: one engine's checks in this process.
pub fn engine_main(args: &[String]) -> ExitCode {
    let args = match EngineArgs::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(64);
        }
    };
    let config = match load_config(args.config.as_deref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let journal = match Journal::open(&args.journal) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("check-engine: opening {}: {e}", args.journal.display());
            return ExitCode::FAILURE;
        }
    };
    let mut step = Step::new(journal, args.skip.clone());
    let plan = Plan::new(args.quick, args.repeats, args.fixtures.clone());
    let e = &config.engine;
    match args.engine.as_str() {
        "sdxl" => {
            if let Some(c) = &e.sdxl {
                sdxl::run(c, &plan, &mut step);
            }
        }
        "qwen_edit" => {
            if let Some(c) = &e.qwen_edit {
                qwen::run(c, &plan, &mut step);
            }
        }
        "esrgan" => {
            if let Some(c) = &e.esrgan {
                esrgan::run(c, &plan, &mut step);
            }
        }
        "verify" => verify(
            &config,
            args.settings_file.as_deref(),
            args.compare,
            &plan,
            &mut step,
        ),
        other => {
            eprintln!("check-engine: unknown engine {other}");
            return ExitCode::from(64);
        }
    }
    ExitCode::SUCCESS
}

/// Loads the engines as the worker does from the written settings file (fingerprint verified,
/// warm-up run), then reads the device memory, runs the largest decode the configuration warms up
/// or the check measured, and reads it again.
fn verify(
    config: &Config,
    settings_file: Option<&Path>,
    compare: bool,
    plan: &Plan,
    step: &mut Step,
) {
    let mut engine_config = config.engine.clone();
    engine_config.settings_file = settings_file.map(Path::to_path_buf);
    let device = settings::device_of(&engine_config);
    let probe = match device {
        Device::Cuda(n) => Some(crate::engine::GpuMemoryProbe::new(n)),
        _ => None,
    };
    let read = |moment: &str, step: &mut Step| {
        if let Some(m) = probe.as_ref().and_then(|p| p.read()) {
            step.journal.write(&Record::Memory(MemoryReading {
                moment: moment.to_owned(),
                used_bytes: m.total_bytes - m.free_bytes,
                free_bytes: m.free_bytes,
                total_bytes: m.total_bytes,
            }));
        }
    };
    read("before_load", step);
    let Some(mut engine) = step.run("verify.load", || {
        let engine = crate::engine::Engine::load(&engine_config, Default::default(), None)?;
        let in_use = engine
            .settings_in_use()
            .map(|s| format!("{:?} {}", s.source, s.id))
            .unwrap_or_default();
        Ok((
            engine,
            format!("the engines load from the settings file and warm up ({in_use})"),
        ))
    }) else {
        return;
    };
    read("warm", step);
    if probe.is_none() {
        step.record(CheckResult::skip(
            "memory.headroom",
            "no GPU memory to measure on this device",
        ));
    }
    if let crate::engine::Engine::Tch {
        sdxl: Some(sdxl), ..
    } = &engine
    {
        let p = sdxl.pipeline();
        let mut sizes: Vec<(i64, i64)> = if plan.quick {
            vec![(160, 88)]
        } else {
            vec![(1024, 1024), (1216, 832), (1280, 720)]
        };
        sizes.extend(config.engine.sdxl.iter().flat_map(|c| {
            c.warm_up
                .iter()
                .map(|[w, h]| (i64::from(*w), i64::from(*h)))
        }));
        let (w, h) = sizes
            .into_iter()
            .max_by_key(|(w, h)| w * h)
            .unwrap_or((1024, 1024));
        let decoded = step.run("verify.largest_decode", || {
            let c = p.vae().config();
            let f = c.scale_factor();
            let z = measure::randn(
                &[1, c.latent_channels, h / f, w / f],
                1,
                p.vae_dtype(),
                p.device(),
            );
            let x = p.vae().decode(&z, vnfarm_models::sdxl::vae::Tiling::Auto);
            measure::synchronize(p.device());
            drop(x);
            Ok((
                (),
                format!("an SDXL decode at {w}x{h} beside the warm models"),
            ))
        });
        if decoded.is_some() {
            read(&format!("after_decode_{w}x{h}"), step);
        }
    }
    if compare
        && let crate::engine::Engine::Tch {
            sdxl: Some(sdxl), ..
        } = &mut engine
    {
        sdxl::compare_generates(sdxl.pipeline_mut(), plan, step);
    }
}
