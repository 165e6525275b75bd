//! What a check finds, as JSON for machines and as a summary for people, and the journal through
//! which each engine's process reports to the parent: one JSON record a line, a `start` before
//! every step that may crash the process, so that a crash is pinned on the step that caused it.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::environment::Environment;
use super::measure::Timing;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail,
    /// Not applicable here (a CUDA-only candidate on ROCm, a fixture folder not found), with why.
    Skip,
}

/// One check: a parity, an agreement, a candidate's run, a load.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckResult {
    /// `sdxl.cpu_parity.unet`, `sdxl.candidate.norm_kernels_fused`, …
    pub id: String,
    pub outcome: Outcome,
    pub detail: String,
    /// The measured quantity (a relative error, seconds), where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
}

impl CheckResult {
    pub fn pass(id: &str, detail: impl Into<String>, value: Option<f64>) -> Self {
        Self::new(id, Outcome::Pass, detail, value)
    }
    pub fn fail(id: &str, detail: impl Into<String>) -> Self {
        Self::new(id, Outcome::Fail, detail, None)
    }
    pub fn skip(id: &str, detail: impl Into<String>) -> Self {
        Self::new(id, Outcome::Skip, detail, None)
    }
    fn new(id: &str, outcome: Outcome, detail: impl Into<String>, value: Option<f64>) -> Self {
        Self {
            id: id.to_owned(),
            outcome,
            detail: detail.into(),
            value,
        }
    }

    /// A measured difference: `value` up to `limit` passes (a failure records no value).
    pub fn at_most(id: &str, detail: String, value: f64, limit: f64) -> Self {
        if value <= limit {
            Self::pass(id, detail, Some(value))
        } else {
            Self::fail(id, detail)
        }
    }

    /// An agreement check: `error` below `tolerance` passes.
    pub fn within(id: &str, what: &str, error: f64, tolerance: f64) -> Self {
        let detail = format!("{what}: relative error {error:.2e} (tolerance {tolerance:.0e})");
        if error < tolerance {
            Self::pass(id, detail, Some(error))
        } else {
            Self::new(id, Outcome::Fail, detail, Some(error))
        }
    }
}

/// One line of an engine process's journal.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Record {
    /// A step that may crash the process begins.
    Start {
        id: String,
    },
    Check(CheckResult),
    Timing(Timing),
    /// The engine's chosen settings (the engine's settings type as JSON) and the environment
    /// variables measured with.
    Chosen {
        settings: serde_json::Value,
        speedup: f64,
    },
    Memory(MemoryReading),
}

/// Device memory at one moment of the memory check.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemoryReading {
    pub moment: String,
    pub used_bytes: u64,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// Appends records to a journal file, flushed line by line (a crash loses no finished record).
pub struct Journal {
    file: std::fs::File,
}

impl Journal {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self { file })
    }

    pub fn write(&mut self, record: &Record) {
        let mut line = serde_json::to_string(record).expect("records serialize");
        line.push('\n');
        if let Err(e) = self
            .file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.sync_data())
        {
            // The parent then sees the step unfinished and reports it as failed.
            eprintln!("check: writing the journal failed: {e}");
        }
    }

    pub fn read(path: &Path) -> Vec<Record> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// One engine's part of the report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EngineReport {
    pub checks: Vec<CheckResult>,
    pub timings: Vec<Timing>,
    /// The settings chosen (the engine's settings as JSON), if the engine could run at all.
    pub chosen: Option<serde_json::Value>,
    /// The chosen settings' measured time against the portable preset's (> 1: faster).
    pub speedup: Option<f64>,
    /// Processes restarted after a crash, with the step each crash is pinned on.
    pub restarts: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub format: &'static str,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub seconds: f64,
    pub environment: Environment,
    /// The variables the settings chose (measured on a HIP build; none elsewhere).
    pub chosen_environment: std::collections::BTreeMap<String, String>,
    pub engines: std::collections::BTreeMap<String, EngineReport>,
    pub memory: EngineReport,
    pub verify: EngineReport,
    pub settings_file: Option<String>,
}

impl Report {
    pub fn all_checks(&self) -> impl Iterator<Item = &CheckResult> {
        self.engines
            .values()
            .chain([&self.memory, &self.verify])
            .flat_map(|e| e.checks.iter())
    }

    /// The readable summary: the environment, then PASS / FAIL / SKIP per check, the timings, and
    /// what was chosen.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let env = &self.environment;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        out += &format!("vnfarm check ({}), {:.0} s\n\n", env.vnfarm, self.seconds);
        out += &format!("libtorch    {} ({})\n", env.libtorch, env.backend.name());
        out += &format!(
            "device      {} ({}), {} GPU(s) visible\n",
            env.device.name, env.device.arch, env.gpus_visible
        );
        out += &format!(
            "memory      system {:.1} GiB; device {}; unified {}\n",
            gib(env.memory.system_bytes),
            match (env.memory.device_total_bytes, env.memory.device_free_bytes) {
                (Some(t), Some(f)) => format!("{:.1} GiB, {:.1} GiB free", gib(t), gib(f)),
                _ => "not reported".into(),
            },
            env.memory
                .unified
                .map_or("unknown".to_owned(), |u| u.to_string())
        );
        out += &format!("kernel      {}\n", env.kernel);
        out += &format!("driver      {}\n", env.driver.describe());
        if !env.boot_parameters.is_empty() {
            out += &format!("boot        {}\n", env.boot_parameters.join(" "));
        }
        for node in &env.device_nodes {
            out += &format!(
                "node        {} {}\n",
                node.path,
                match (node.present, node.accessible) {
                    (true, true) => "present, accessible",
                    (true, false) => "present, NOT accessible (groups video/render?)",
                    (false, _) => "absent",
                }
            );
        }
        out += &format!("groups      {}\n", env.groups.join(" "));
        for v in &env.variables {
            out += &format!(
                "variable    {}={}\n",
                v.name,
                v.value.as_deref().unwrap_or("(unset)")
            );
        }
        for s in &env.sdpa {
            out += &format!("sdpa        {}: {}\n", s.shape, s.backend);
        }
        out += "\n";
        for c in self.all_checks() {
            let tag = match c.outcome {
                Outcome::Pass => "PASS",
                Outcome::Fail => "FAIL",
                Outcome::Skip => "SKIP",
            };
            out += &format!("{tag}  {:<44} {}\n", c.id, c.detail);
        }
        out += "\n";
        for (name, e) in &self.engines {
            for t in &e.timings {
                out += &timing_line(t);
            }
            match (&e.chosen, e.speedup) {
                (Some(chosen), Some(x)) => {
                    out += &format!("chosen {name}: {chosen} ({x:.3}x the portable preset)\n\n")
                }
                (Some(chosen), None) => out += &format!("chosen {name}: {chosen}\n\n"),
                (None, _) => out += &format!("chosen {name}: nothing (the engine did not run)\n\n"),
            }
            for r in &e.restarts {
                out += &format!("restart {name}: {r}\n");
            }
        }
        for t in &self.verify.timings {
            out += &timing_line(t);
        }
        if !self.chosen_environment.is_empty() {
            for (k, v) in &self.chosen_environment {
                out += &format!("environment {k}={v}\n");
            }
        }
        match &self.settings_file {
            Some(path) => out += &format!("settings file: {path}\n"),
            None => out += "settings file: not written (no engine ran)\n",
        }
        let failed = self
            .all_checks()
            .filter(|c| c.outcome == Outcome::Fail)
            .count();
        let passed = self
            .all_checks()
            .filter(|c| c.outcome == Outcome::Pass)
            .count();
        out += &format!("{passed} checks passed, {failed} failed\n");
        out
    }
}

/// One `time` line of the summary.
fn timing_line(t: &Timing) -> String {
    format!(
        "time  {:<36} {:<28} median {:>9.4} s  first {:>9.4} s\n",
        t.id, t.candidate, t.median_s, t.first_s
    )
}
