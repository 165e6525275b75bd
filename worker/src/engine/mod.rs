//! Engines run the models. All of them live on one dedicated thread ([`EngineHost`]): tch tensors are
//! not `Sync`, no-grad mode is thread-local, and compute must never block the async runtime. They
//! load on a thread each, at once, and warm up on that thread one after another ([`Engine::load`]). The async
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
//!
//! - `config.rs`: the `[engine]` section; `settings.rs`: which settings the engines run;
//! - `job.rs`: what an engine is handed and answers; `error.rs`, `cancel.rs`: how a job fails or
//!   is stopped; `files.rs`: the files its images are made from;
//! - `batch.rs`: running a batch's jobs together or alone; `host.rs`: the engine thread;
//! - one file per engine (`sdxl.rs`, `qwen_edit.rs`, `esrgan.rs`, `test_pattern.rs`) and their
//!   helpers (`device.rs`, `lora_dir.rs`, `catalogue_checkpoints.rs`, `encode_cache.rs`,
//!   `shared_encodings.rs`, `gpu_memory.rs`).

pub mod batch;
pub mod busy;
pub mod cancel;
pub mod catalogue_checkpoints;
pub mod config;
pub mod device;
pub mod encode_cache;
pub mod error;
pub mod esrgan;
pub mod files;
pub mod gpu_memory;
pub mod host;
pub mod job;
pub mod lora_dir;
pub mod qwen_edit;
pub mod sdxl;
pub mod settings;
pub mod shared_encodings;
pub mod test_pattern;

use vnfarm_proto::{ModelFamily, SettingsInUse, Task};

pub(crate) use batch::{Runnable, answered};
pub use batch::{groups, together_or_alone};
pub use busy::{BusyTotals, EngineBusy};
pub use cancel::{Cancel, all_cancelled};
pub use catalogue_checkpoints::{FetchedCheckpoint, LoadedCheckpoints};
pub use config::{EngineConfig, EngineKind};
pub use encode_cache::{AdvertisedKeys, CacheLookup, EncodeCache};
pub use error::{CancelReason, EngineError};
pub use esrgan::{EsrganConfig, EsrganEngine};
pub use files::{UsedFile, weight_files};
pub use gpu_memory::GpuMemoryProbe;
pub use host::{Answer, EngineHost, EngineLoading};
pub use job::{EngineJob, EngineOutput, InputImage, OutputImage, Progress, content_key};
pub use lora_dir::{AdvertisedLoras, FetchedLoras, LoraDir};
pub use qwen_edit::{QwenEditEngine, QwenEditEngineConfig};
pub use sdxl::{SdxlConfig, SdxlEngine};
use settings::EngineSettings;
pub use shared_encodings::{Fetched, SharedEncodings, SharedStore};
pub use test_pattern::{TestPatternConfig, TestPatternEngine};

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
                // Each engine's files are read and copied to the device on a thread of its own,
                // all at once: that is most of a cold start, and the engines share nothing while
                // loading (the loader's pinned staging buffers are a pool). The warm-ups follow
                // one after another on this thread, with no load beside them: a warm-up may
                // capture CUDA graphs (SDXL's `cuda_graphs`), and a capture fails when another
                // thread allocates device memory meanwhile (libtorch captures in CUDA's global
                // mode).
                let started = std::time::Instant::now();
                let (sdxl, qwen_edit, esrgan) = std::thread::scope(|scope| {
                    let (sdxl_settings, qwen_settings, esrgan_settings) =
                        (chosen.sdxl, chosen.qwen_edit, chosen.esrgan);
                    let sdxl = config.sdxl.as_ref().map(|c| {
                        scope.spawn(move || SdxlEngine::load_cold(c, sdxl_settings))
                    });
                    let qwen_edit = config.qwen_edit.as_ref().map(|c| {
                        scope.spawn(move || {
                            QwenEditEngine::load_cold(c, qwen_settings, cache_keys, shared)
                        })
                    });
                    let esrgan = config.esrgan.as_ref().map(|c| {
                        scope.spawn(move || EsrganEngine::load_cold(c, esrgan_settings))
                    });
                    (
                        joined("SDXL", sdxl),
                        joined("Qwen-Image-Edit", qwen_edit),
                        joined("Real-ESRGAN", esrgan),
                    )
                });
                let (sdxl, qwen_edit, esrgan) = (sdxl?, qwen_edit?, esrgan?);
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    "engines loaded"
                );
                if let Some(e) = &sdxl {
                    e.warm_up()?;
                }
                if let Some(e) = &qwen_edit {
                    e.warm_up()?;
                }
                if let Some(e) = &esrgan {
                    e.warm_up()?;
                }
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    "engines loaded and warm"
                );
                Ok(Engine::Tch {
                    sdxl: sdxl.map(Box::new),
                    qwen_edit: qwen_edit.map(Box::new),
                    esrgan: esrgan.map(Box::new),
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
                                fetched: job.fetched.clone(),
                                checkpoint: job.checkpoint.clone(),
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
    pub fn files(&self, job: &EngineJob) -> Vec<UsedFile> {
        match self {
            Engine::TestPattern(e) => e.files(job),
            Engine::Tch {
                sdxl,
                qwen_edit,
                esrgan,
                ..
            } => match &job.task {
                Task::Generate(_) => sdxl.as_ref().map(|e| e.files(job)).unwrap_or_default(),
                Task::Edit(_) => qwen_edit.as_ref().map(|e| e.files(job)).unwrap_or_default(),
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
                output.files = self.files(job);
            }
        }
        results
    }
}

/// A loader thread's engine, if one was started; its panic (a libtorch failure tch reports by
/// panicking) is a load error naming the model.
fn joined<T>(
    model: &str,
    loader: Option<std::thread::ScopedJoinHandle<'_, anyhow::Result<T>>>,
) -> anyhow::Result<Option<T>> {
    let Some(loader) = loader else {
        return Ok(None);
    };
    match loader.join() {
        Ok(loaded) => loaded.map(Some),
        Err(panic) => anyhow::bail!(
            "loading {model}: the loader panicked: {}",
            panic_message(&*panic)
        ),
    }
}

/// What a panic said (its `String` or `&str` payload).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|m| m.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

fn unsupported(jobs: &[&EngineJob], model: ModelFamily) -> Vec<Result<EngineOutput, EngineError>> {
    jobs.iter()
        .map(|_| Err(EngineError::Unsupported(model)))
        .collect()
}
