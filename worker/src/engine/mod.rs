//! Engines run the models. All of them live on one dedicated thread ([`EngineHost`]): tch tensors are
//! not `Sync`, no-grad mode is thread-local, and compute must never block the async runtime. The async
//! side sends a batch of [`EngineJob`]s (one job, or the jobs of a batch message) and awaits one
//! result per job; progress comes back on a channel, tagged with the job, and each job has its own
//! cancellation flag, which the engine checks between denoising steps.
//!
//! An engine runs the compatible jobs of a batch together (edits of one input encoded once, generates
//! of one shape in one forward pass) and the others one after another. A group that fails in a way
//! that may be one job's fault is run again job by job ([`together_or_alone`]), so a bad job fails
//! alone.
//!
//! The set of engines is closed, so [`Engine`] is an enum. The test-pattern engine is a fixture for the
//! job system and is never used in place of a model that failed to load: a worker whose configured
//! engine cannot load exits with an error.

pub mod device;
pub mod encode_cache;
pub mod esrgan;
pub mod gpu_memory;
pub mod host;
pub mod lora_dir;
pub mod qwen_edit;
pub mod sdxl;
pub mod settings;
pub mod shared_encodings;
pub mod test_pattern;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use image::{DynamicImage, RgbImage};
use serde::Deserialize;
use vnfarm_proto::{JobId, ModelFamily, ModelFileRole, SettingsInUse, StageTimings, Task};

pub use encode_cache::{AdvertisedKeys, CacheLookup, EncodeCache};
pub use esrgan::{EsrganConfig, EsrganEngine};
pub use gpu_memory::GpuMemoryProbe;
pub use host::{Answer, EngineHost, EngineLoading};
pub use lora_dir::LoraDir;
pub use qwen_edit::{QwenEditEngine, QwenEditEngineConfig};
pub use sdxl::{SdxlConfig, SdxlEngine};
use settings::EngineSettings;
pub use shared_encodings::{Fetched, SharedEncodings, SharedStore};
pub use test_pattern::{TestPatternConfig, TestPatternEngine};

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Which implementation serves the models. Unset: `tch` when a model section (`sdxl`,
    /// `qwen_edit`, `esrgan`) is configured, else `test_pattern`.
    #[serde(default)]
    pub kind: Option<EngineKind>,
    /// Model families this worker serves (and advertises in its heartbeat). Unset: every family
    /// for `test_pattern`, the configured ones for `tch`.
    #[serde(default)]
    pub models: Option<Vec<ModelFamily>>,
    #[serde(default)]
    pub test_pattern: TestPatternConfig,
    /// SDXL on libtorch, for `generate` jobs.
    #[serde(default)]
    pub sdxl: Option<SdxlConfig>,
    /// Qwen-Image-Edit-2509 on libtorch, for `edit` jobs. A worker may hold it and SDXL at once.
    #[serde(default)]
    pub qwen_edit: Option<QwenEditEngineConfig>,
    /// Real-ESRGAN on libtorch, for `upscale` jobs (and pipelines' upscales).
    #[serde(default)]
    pub esrgan: Option<EsrganConfig>,
    /// The settings file `vnfarm-worker check` wrote on this box: it decides every configured
    /// engine's settings (and sets the process variables it measured), and is refused when it was
    /// measured on another device, libtorch build or model files. Unset: each engine's `settings`
    /// (by default the portable preset).
    #[serde(default)]
    pub settings_file: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Deterministic CPU images; a fixture for exercising the job system without weights.
    TestPattern,
    /// The models, natively on libtorch.
    Tch,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::TestPattern => "test-pattern",
            EngineKind::Tch => "tch",
        }
    }
}

impl EngineConfig {
    pub fn kind(&self) -> EngineKind {
        let any_model = self.sdxl.is_some() || self.qwen_edit.is_some() || self.esrgan.is_some();
        self.kind.unwrap_or(if any_model {
            EngineKind::Tch
        } else {
            EngineKind::TestPattern
        })
    }

    /// The families with a configured model (`tch`).
    fn configured(&self) -> Vec<ModelFamily> {
        let sdxl = self.sdxl.iter().map(|_| ModelFamily::Sdxl);
        let qwen = self.qwen_edit.iter().map(|_| ModelFamily::QwenEdit);
        let esrgan = self.esrgan.iter().map(|_| ModelFamily::Esrgan);
        sdxl.chain(qwen).chain(esrgan).collect()
    }

    pub fn models(&self) -> Vec<ModelFamily> {
        match (&self.models, self.kind()) {
            (Some(models), _) => models.clone(),
            (None, EngineKind::TestPattern) => ModelFamily::ALL.to_vec(),
            (None, EngineKind::Tch) => self.configured(),
        }
    }

    /// The SDXL checkpoints this worker holds, by name (advertised in heartbeats).
    pub fn checkpoints(&self) -> Vec<String> {
        match self.kind() {
            EngineKind::TestPattern => self.test_pattern.checkpoints.clone(),
            EngineKind::Tch => self.sdxl.iter().map(SdxlConfig::name).collect(),
        }
    }

    /// Every file the configured engines load (what the worker starts hashing at once); jobs may
    /// add their LoRAs.
    pub fn files(&self) -> Vec<UsedFile> {
        match self.kind() {
            EngineKind::TestPattern => self.test_pattern.files(),
            EngineKind::Tch => {
                let sdxl = self.sdxl.iter().flat_map(SdxlConfig::files);
                let qwen = self.qwen_edit.iter().flat_map(QwenEditEngineConfig::files);
                let esrgan = self.esrgan.iter().flat_map(EsrganConfig::files);
                sdxl.chain(qwen).chain(esrgan).collect()
            }
        }
    }

    /// The GPU the models run on, if any: the first configured model's `cuda:N`.
    pub fn gpu(&self) -> Option<usize> {
        if self.kind() == EngineKind::TestPattern {
            return None;
        }
        let sdxl = self.sdxl.iter().map(|c| c.device.as_str());
        let qwen = self.qwen_edit.iter().map(|c| c.device.as_str());
        sdxl.chain(qwen)
            .find_map(|name| match device::parse_device(name) {
                Ok(tch::Device::Cuda(n)) => Some(n),
                Ok(_) | Err(_) => None,
            })
    }

    pub fn validate(&self) -> Result<(), String> {
        let models = self.models();
        if models.is_empty() {
            return Err(match self.kind() {
                EngineKind::TestPattern => {
                    "engine.models: a worker must serve at least one model family".into()
                }
                EngineKind::Tch => "engine: the tch engine needs a model section \
                                    (engine.sdxl.checkpoint = \"/path/to/model.safetensors\", \
                                    engine.qwen_edit or engine.esrgan)"
                    .into(),
            });
        }
        if self.kind() == EngineKind::Tch {
            let configured = self.configured();
            if let Some(missing) = models.iter().find(|m| !configured.contains(m)) {
                return Err(format!(
                    "engine.models: `{}` has no model configured for the tch engine \
                     (configured: {})",
                    missing.as_str(),
                    configured
                        .iter()
                        .map(|m| m.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        if self.settings_file.is_some() {
            let named = [
                (
                    "sdxl",
                    self.sdxl.as_ref().is_some_and(|c| c.settings.is_some()),
                ),
                (
                    "qwen_edit",
                    self.qwen_edit
                        .as_ref()
                        .is_some_and(|c| c.settings.is_some()),
                ),
                (
                    "esrgan",
                    self.esrgan.as_ref().is_some_and(|c| c.settings.is_some()),
                ),
            ];
            if let Some((engine, _)) = named.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "engine.{engine}.settings: engine.settings_file decides the settings; \
                     remove one of the two"
                ));
            }
        }
        if let Some(sdxl) = &self.sdxl {
            sdxl.validate()?;
        }
        if let Some(qwen) = &self.qwen_edit {
            qwen.validate()?;
        }
        if let Some(esrgan) = &self.esrgan {
            esrgan.validate()?;
        }
        self.test_pattern.validate()
    }
}

/// One unit of work for an engine: a task with its decoded input images, in the task's order, and
/// the job's own cancellation flag.
#[derive(Debug)]
pub struct EngineJob {
    pub job_id: JobId,
    pub task: Task,
    pub inputs: Vec<InputImage>,
    pub cancel: Cancel,
}

/// A decoded input image and the sha256 (hex) of the bytes it was decoded from: the key of its
/// encodings in an engine's cache.
#[derive(Debug, Clone)]
pub struct InputImage {
    /// 8-bit RGB, alpha flattened onto white: what the generative models take.
    pub image: RgbImage,
    /// The image as stored, for tasks that keep its layout (upscales), when that layout is not
    /// 8-bit RGB (alpha, greyscale, 16-bit samples); `None` otherwise.
    pub stored: Option<DynamicImage>,
    pub sha256: String,
}

/// The content key of an input set: the model family, then each input's sha256 in prompt order.
pub fn content_key(inputs: &[InputImage]) -> String {
    let shas: Vec<&str> = inputs.iter().map(|i| i.sha256.as_str()).collect();
    format!("{}:{}", ModelFamily::QwenEdit.as_str(), shas.join("+"))
}

impl InputImage {
    /// The image in its stored layout (for upscales): `stored`, else the RGB8 image.
    pub fn into_stored(self) -> DynamicImage {
        self.stored.unwrap_or(DynamicImage::ImageRgb8(self.image))
    }
}

#[derive(Debug)]
pub struct EngineOutput {
    /// In the layout the engine made: 8-bit RGB, or an upscale's input layout.
    pub images: Vec<DynamicImage>,
    /// Seed of each image, where the model uses one.
    pub seeds: Vec<Option<u64>>,
    /// Per stage. In a batch, a shared stage's time is split across the jobs that shared it, except
    /// `encode`, which only the job that encoded the inputs reports.
    pub timings: StageTimings,
    /// For a job that encodes inputs (an edit): whether the encodings were in the cache.
    pub encode_cache: Option<CacheLookup>,
    /// The model and LoRA files that made the images ([`Engine::files`]; the engines leave it
    /// empty and [`Engine::run_batch`] fills it in).
    pub files: Vec<UsedFile>,
}

/// A file a job's images were made from, as the engine read it (hashed later, for the manifest).
#[derive(Clone, Debug, PartialEq)]
pub struct UsedFile {
    /// A LoRA's name as the job names it; else the file's name.
    pub name: String,
    pub path: PathBuf,
    pub role: ModelFileRole,
    /// A LoRA's strength (the job's weight, or the configured one for a LoRA fused at load).
    pub strength: Option<f32>,
}

impl UsedFile {
    /// A file known by its own name.
    pub fn named_by_file(path: &Path, role: ModelFileRole) -> Self {
        Self {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_owned(),
            role,
            strength: None,
        }
    }
}

/// The weight files of a diffusers folder (every `.safetensors`, `.bin`, `.pth`, `.ckpt` or `.sft`
/// under it, sorted), as `Component`s. A folder that holds a component twice (a full and an
/// `fp16` variant) lists both: the manifest names what the folder held, which pins it down.
pub fn weight_files(dir: &Path) -> Vec<UsedFile> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        // An unreadable folder fails the load itself; here it only lists nothing.
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| {
                ["safetensors", "bin", "pth", "ckpt", "sft"]
                    .iter()
                    .any(|w| e == *w)
            }) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
        .into_iter()
        .map(|path| {
            let name = path
                .strip_prefix(dir)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            UsedFile {
                name,
                path,
                role: ModelFileRole::Component,
                strength: None,
            }
        })
        .collect()
}

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
    fn may_be_one_jobs(&self) -> bool {
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

/// A cancellation flag shared between the async side and the engine thread, with a separate flag
/// for a yield: the scheduler asked for the job back if it has not started yet. Engines never see
/// a yield (a job on the engine runs to its end); the engine host checks it between the runs of a
/// message.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicU8>);

/// The bit of [`Cancel`] that records a yield request; the low bits hold the cancel reason.
const YIELD_BIT: u8 = 0x10;

impl Cancel {
    pub fn request(&self, reason: CancelReason) {
        let code = match reason {
            CancelReason::User => 1,
            CancelReason::Shutdown => 2,
        };
        // Keep the first reason: a user cancel is not turned into a requeue.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                (now & !YIELD_BIT == 0).then_some(now | code)
            });
    }

    pub fn requested(&self) -> Option<CancelReason> {
        match self.0.load(Ordering::SeqCst) & !YIELD_BIT {
            0 => None,
            1 => Some(CancelReason::User),
            _ => Some(CancelReason::Shutdown),
        }
    }

    /// The scheduler asks for the job back, should it not have started.
    pub fn request_yield(&self) {
        self.0.fetch_or(YIELD_BIT, Ordering::SeqCst);
    }

    /// A yield was asked for and no cancel (which wins: it settles the job for good).
    pub fn yield_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) == YIELD_BIT
    }

    /// `Err(Cancelled)` when cancellation was requested; engines call it between steps.
    pub fn check(&self) -> Result<(), EngineError> {
        match self.requested() {
            Some(reason) => Err(EngineError::Cancelled(reason)),
            None => Ok(()),
        }
    }
}

/// Whether work that jobs share should stop: only when every one of them was cancelled (a job
/// cancelled alone rides along and its result is discarded). Shutdown reaches every job at once.
pub fn all_cancelled<'a>(cancels: impl IntoIterator<Item = &'a Cancel>) -> Option<CancelReason> {
    let mut reason = None;
    for cancel in cancels {
        match (cancel.requested(), reason) {
            (None, _) => return None,
            (Some(CancelReason::Shutdown), _) => reason = Some(CancelReason::Shutdown),
            (Some(CancelReason::User), None) => reason = Some(CancelReason::User),
            (Some(CancelReason::User), Some(_)) => {}
        }
    }
    reason
}

/// A batch's result slots (one per job, `None` until answered), with the jobs that can run and
/// what `prepare` made of each; a job `prepare` refuses is answered with its error.
pub(crate) struct Runnable<P> {
    pub results: Vec<Option<Result<EngineOutput, EngineError>>>,
    /// Indices into the batch of the jobs that can run, in order.
    pub runnable: Vec<usize>,
    /// What `prepare` made of each runnable job, in the same order.
    pub prepared: Vec<P>,
}

impl<P> Runnable<P> {
    pub fn of(
        jobs: &[&EngineJob],
        mut prepare: impl FnMut(&EngineJob) -> Result<P, EngineError>,
    ) -> Self {
        let mut out = Self {
            results: jobs.iter().map(|_| None).collect(),
            runnable: Vec::new(),
            prepared: Vec::new(),
        };
        for (i, job) in jobs.iter().enumerate() {
            match prepare(job) {
                Ok(p) => {
                    out.runnable.push(i);
                    out.prepared.push(p);
                }
                Err(e) => out.results[i] = Some(Err(e)),
            }
        }
        out
    }
}

/// The results of a batch, a job left unanswered failing (a bug, said so, rather than a lost job).
pub(crate) fn answered(
    results: Vec<Option<Result<EngineOutput, EngineError>>>,
) -> Vec<Result<EngineOutput, EngineError>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Failed("the engine skipped the job".into()))))
        .collect()
}

/// Step progress reported by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub step: u32,
    pub total: u32,
}

/// The jobs of a batch in groups: each group holds the indices of jobs with equal `key`, in
/// order, and the groups come in the order of their first job.
pub fn groups<K: PartialEq>(jobs: &[&EngineJob], key: impl Fn(&EngineJob) -> K) -> Vec<Vec<usize>> {
    let mut groups: Vec<(K, Vec<usize>)> = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let k = key(job);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(i),
            None => groups.push((k, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// Runs `group` (indices into `jobs`) together with `run`, which answers one output per job in the
/// group's order. When the group fails in a way that may be one job's fault, each job runs alone,
/// so that only that job fails; a cancelled group reports each job with its own reason.
pub fn together_or_alone(
    jobs: &[&EngineJob],
    group: &[usize],
    mut run: impl FnMut(&[usize]) -> Result<Vec<EngineOutput>, EngineError>,
) -> Vec<(usize, Result<EngineOutput, EngineError>)> {
    let own = |i: usize, e: &EngineError| match e {
        EngineError::Cancelled(reason) => {
            EngineError::Cancelled(jobs[i].cancel.requested().unwrap_or(*reason))
        }
        other => other.clone(),
    };
    match run(group) {
        Ok(outputs) if outputs.len() == group.len() => group
            .iter()
            .copied()
            .zip(outputs.into_iter().map(Ok))
            .collect(),
        Ok(outputs) => {
            let e = EngineError::Failed(format!(
                "the engine answered {} outputs for {} jobs",
                outputs.len(),
                group.len()
            ));
            group.iter().map(|&i| (i, Err(e.clone()))).collect()
        }
        Err(e) if group.len() > 1 && e.may_be_one_jobs() => {
            tracing::warn!(jobs = group.len(), error = %e, "a batch failed; running its jobs one by one");
            group
                .iter()
                .map(|&i| {
                    let alone = run(&[i]).and_then(|mut outputs| {
                        outputs.pop().ok_or_else(|| {
                            EngineError::Failed("the engine answered no output".into())
                        })
                    });
                    (i, alone.map_err(|e| own(i, &e)))
                })
                .collect()
        }
        Err(e) => group.iter().map(|&i| (i, Err(own(i, &e)))).collect(),
    }
}

/// The closed set of engines.
pub enum Engine {
    TestPattern(Box<TestPatternEngine>),
    /// The models on libtorch; one per family as they are implemented.
    Tch {
        sdxl: Option<Box<SdxlEngine>>,
        qwen_edit: Option<Box<QwenEditEngine>>,
        esrgan: Option<Box<EsrganEngine>>,
        settings: SettingsInUse,
    },
}

impl Engine {
    /// Loads the configured engines; `cache_keys` receives the affinity keys of what their encode
    /// caches hold; `shared`, where set, is where the engines that encode inputs publish and fetch
    /// encodings.
    pub fn load(
        config: &EngineConfig,
        cache_keys: AdvertisedKeys,
        shared: Option<SharedEncodings>,
    ) -> anyhow::Result<Self> {
        match config.kind() {
            EngineKind::TestPattern => Ok(Engine::TestPattern(Box::new(TestPatternEngine::load(
                config.test_pattern.clone(),
                cache_keys,
                shared,
            )))),
            EngineKind::Tch => {
                let chosen = EngineSettings::choose(config)?;
                Ok(Engine::Tch {
                    sdxl: config
                        .sdxl
                        .as_ref()
                        .map(|c| SdxlEngine::load(c, chosen.sdxl).map(Box::new))
                        .transpose()?,
                    qwen_edit: config
                        .qwen_edit
                        .as_ref()
                        .map(|c| {
                            QwenEditEngine::load(c, chosen.qwen_edit, cache_keys, shared)
                                .map(Box::new)
                        })
                        .transpose()?,
                    esrgan: config
                        .esrgan
                        .as_ref()
                        .map(|c| EsrganEngine::load(c, chosen.esrgan).map(Box::new))
                        .transpose()?,
                    settings: chosen.in_use,
                })
            }
        }
    }

    /// The settings the engines run, for the heartbeat (none for the test-pattern engine).
    pub fn settings_in_use(&self) -> Option<SettingsInUse> {
        match self {
            Engine::TestPattern(_) => None,
            Engine::Tch { settings, .. } => Some(settings.clone()),
        }
    }

    /// Runs a batch: one result per job, in order. `progress` gets the job's index.
    fn run_batch(
        &mut self,
        jobs: &[&EngineJob],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Vec<Result<EngineOutput, EngineError>> {
        let (sdxl, qwen_edit, esrgan) = match self {
            Engine::TestPattern(e) => {
                let results = e.run_batch(jobs, progress);
                return self.with_files(jobs, results);
            }
            Engine::Tch {
                sdxl,
                qwen_edit,
                esrgan,
                ..
            } => (sdxl, qwen_edit, esrgan),
        };
        // Each family's jobs go to its engine; a family without one fails its jobs.
        let mut results: Vec<Option<Result<EngineOutput, EngineError>>> =
            jobs.iter().map(|_| None).collect();
        for family in groups(jobs, |j| j.task.model()) {
            let model = jobs[family[0]].task.model();
            let members: Vec<&EngineJob> = family.iter().map(|&i| jobs[i]).collect();
            let mut progress = |k: usize, p: Progress| progress(family[k], p);
            let answers = match model {
                ModelFamily::Sdxl => match sdxl {
                    Some(e) => e.run_batch(&members, &mut progress),
                    None => unsupported(&members, model),
                },
                ModelFamily::QwenEdit => match qwen_edit {
                    Some(e) => e.run_batch(&members, &mut progress),
                    None => unsupported(&members, model),
                },
                // Upscales share nothing: one after another, each with its own cancel.
                ModelFamily::Esrgan => match esrgan {
                    Some(e) => members
                        .iter()
                        .enumerate()
                        .map(|(k, job)| {
                            let owned = EngineJob {
                                job_id: job.job_id,
                                task: job.task.clone(),
                                inputs: job.inputs.clone(),
                                cancel: job.cancel.clone(),
                            };
                            e.run(owned, &mut |p| progress(k, p), &job.cancel)
                        })
                        .collect(),
                    None => unsupported(&members, model),
                },
            };
            for (&i, answer) in family.iter().zip(answers) {
                results[i] = Some(answer);
            }
        }
        let results = answered(results);
        self.with_files(jobs, results)
    }

    /// How a message's jobs run: in runs, one after another, each run's jobs together (they
    /// finish together). Jobs share a run only where running them together gains something: a
    /// step of several jobs costs less than their steps one after another. Where it gains nothing,
    /// each job is a run of its own, so it is reported as soon as it is done and the host can give
    /// the unstarted rest back between runs; edits of one input still encode it once (the encode
    /// cache keeps it from one run to the next).
    fn runs(&self, jobs: &[&EngineJob]) -> Vec<Vec<usize>> {
        let (sdxl, qwen_edit) = match self {
            Engine::TestPattern(e) => return e.runs(jobs),
            Engine::Tch {
                sdxl, qwen_edit, ..
            } => (sdxl, qwen_edit),
        };
        let mut runs = Vec::new();
        for family in groups(jobs, |j| j.task.model()) {
            // The engines' own forward sizes: a run is at most one forward's worth of jobs.
            let together = match jobs[family[0]].task.model() {
                ModelFamily::Sdxl => sdxl.as_ref().map_or(1, |e| e.max_batch()),
                ModelFamily::QwenEdit => qwen_edit.as_ref().map_or(1, |e| e.max_batch()),
                ModelFamily::Esrgan => 1,
            };
            runs.extend(family.chunks(together.max(1)).map(<[usize]>::to_vec));
        }
        runs
    }

    /// The files a job's images are made from: what the engine of its family loaded, and the
    /// job's own LoRAs.
    pub fn files(&self, task: &Task) -> Vec<UsedFile> {
        match self {
            Engine::TestPattern(e) => e.files(),
            Engine::Tch {
                sdxl,
                qwen_edit,
                esrgan,
                ..
            } => match task {
                Task::Generate(_) => sdxl.as_ref().map(|e| e.files(task)).unwrap_or_default(),
                Task::Edit(_) => qwen_edit
                    .as_ref()
                    .map(|e| e.files(task))
                    .unwrap_or_default(),
                Task::Upscale(_) => esrgan.as_ref().map(|e| e.files()).unwrap_or_default(),
            },
        }
    }

    fn with_files(
        &self,
        jobs: &[&EngineJob],
        mut results: Vec<Result<EngineOutput, EngineError>>,
    ) -> Vec<Result<EngineOutput, EngineError>> {
        for (job, result) in jobs.iter().zip(&mut results) {
            if let Ok(output) = result {
                output.files = self.files(&job.task);
            }
        }
        results
    }
}

fn unsupported(jobs: &[&EngineJob], model: ModelFamily) -> Vec<Result<EngineOutput, EngineError>> {
    jobs.iter()
        .map(|_| Err(EngineError::Unsupported(model)))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn job(task: Task) -> EngineJob {
        EngineJob {
            job_id: JobId::new(),
            task,
            inputs: Vec::new(),
            cancel: Cancel::default(),
        }
    }

    /// An edit of the stored image `input` (a blank 32×32 image with `input`'s hash as its sha256).
    pub(crate) fn edit(input: &str, instruction: &str) -> EngineJob {
        use sha2::{Digest, Sha256};
        let mut job = job(Task::Edit(vnfarm_proto::EditSpec {
            input: Some(vnfarm_proto::ImageRef::Stored(input.into())),
            inputs: Vec::new(),
            instruction: instruction.into(),
            width: None,
            height: None,
            steps: 4,
            cfg: 1.0,
            seed: Some(3),
            loras: Vec::new(),
        }));
        job.inputs.push(InputImage {
            image: image::RgbImage::new(32, 32),
            stored: None,
            sha256: hex::encode(Sha256::digest(input.as_bytes())),
        });
        job
    }

    #[test]
    fn a_yield_is_no_cancel_and_a_cancel_overrides_it() {
        let c = Cancel::default();
        c.request_yield();
        assert!(c.yield_requested());
        assert_eq!(c.requested(), None, "engines never see a yield");
        assert!(c.check().is_ok());
        c.request(CancelReason::User);
        assert_eq!(c.requested(), Some(CancelReason::User));
        assert!(
            !c.yield_requested(),
            "a cancelled job is settled as cancelled, not given back"
        );
        let c = Cancel::default();
        c.request(CancelReason::Shutdown);
        c.request_yield();
        assert_eq!(c.requested(), Some(CancelReason::Shutdown));
        assert!(!c.yield_requested());
    }

    fn output() -> EngineOutput {
        EngineOutput {
            images: Vec::new(),
            seeds: Vec::new(),
            timings: StageTimings::default(),
            encode_cache: None,
            files: Vec::new(),
        }
    }

    fn generate() -> Task {
        vnfarm_proto::decode_json(br#"{"kind": "generate", "prompt": "a lighthouse", "seed": 1}"#)
            .expect("a valid task")
    }

    #[test]
    fn a_group_that_fails_together_runs_again_job_by_job() {
        let jobs: Vec<EngineJob> = (0..3).map(|_| job(generate())).collect();
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let mut calls = Vec::new();
        let results = together_or_alone(&refs, &[0, 1, 2], |members| {
            calls.push(members.to_vec());
            if members.contains(&1) {
                Err(EngineError::InvalidInput("job 1's prompt".into()))
            } else {
                Ok(members.iter().map(|_| output()).collect())
            }
        });
        assert_eq!(calls, [vec![0, 1, 2], vec![0], vec![1], vec![2]]);
        let ok: Vec<(usize, bool)> = results.iter().map(|(i, r)| (*i, r.is_ok())).collect();
        assert_eq!(ok, [(0, true), (1, false), (2, true)]);
    }

    #[test]
    fn a_cancelled_or_lost_group_is_not_run_again() {
        let jobs: Vec<EngineJob> = (0..2).map(|_| job(generate())).collect();
        jobs[0].cancel.request(CancelReason::User);
        jobs[1].cancel.request(CancelReason::Shutdown);
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let mut calls = 0;
        let results = together_or_alone(&refs, &[0, 1], |_| {
            calls += 1;
            Err(EngineError::Cancelled(CancelReason::Shutdown))
        });
        assert_eq!(calls, 1);
        assert!(matches!(
            results[0].1,
            Err(EngineError::Cancelled(CancelReason::User))
        ));
        assert!(matches!(
            results[1].1,
            Err(EngineError::Cancelled(CancelReason::Shutdown))
        ));
        let results = together_or_alone(&refs, &[0, 1], |_| {
            calls += 1;
            Err(EngineError::DeviceLost("CUDA error".into()))
        });
        assert_eq!(calls, 2, "a device failure is nobody's job's fault");
        assert!(
            results
                .iter()
                .all(|(_, r)| matches!(r, Err(EngineError::DeviceLost(_))))
        );
    }

    #[test]
    fn shared_work_stops_only_when_every_job_is_cancelled() {
        let (a, b) = (Cancel::default(), Cancel::default());
        assert_eq!(all_cancelled([&a, &b]), None);
        a.request(CancelReason::User);
        assert_eq!(all_cancelled([&a, &b]), None);
        b.request(CancelReason::User);
        assert_eq!(all_cancelled([&a, &b]), Some(CancelReason::User));
        let c = Cancel::default();
        c.request(CancelReason::Shutdown);
        assert_eq!(all_cancelled([&a, &c]), Some(CancelReason::Shutdown));
    }

    #[test]
    fn groups_keep_the_order_of_their_first_job() {
        let jobs: Vec<EngineJob> = (0..5).map(|_| job(generate())).collect();
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let keys = ["b", "a", "b", "c", "a"];
        let index = |j: &EngineJob| refs.iter().position(|r| r.job_id == j.job_id).unwrap();
        assert_eq!(
            groups(&refs, |j| keys[index(j)]),
            [vec![0, 2], vec![1, 4], vec![3]]
        );
    }
}
