//! Engines run the models. All of them live on one dedicated thread ([`EngineHost`]): tch tensors are
//! not `Sync`, no-grad mode is thread-local, and compute must never block the async runtime. They
//! load on a thread each, at once, and warm up on the engine thread ([`load_and_warm`]). The async
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
                let started = std::time::Instant::now();
                let (mut sdxl, mut qwen_edit, mut esrgan) = (None, None, None);
                for engine in load_and_warm(config, &chosen, cache_keys, shared)? {
                    match engine {
                        Cold::Sdxl(e) => sdxl = Some(e),
                        Cold::QwenEdit(e) => qwen_edit = Some(e),
                        Cold::Esrgan(e) => esrgan = Some(e),
                    }
                }
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    "engines loaded and warm"
                );
                Ok(Engine::Tch {
                    sdxl,
                    qwen_edit,
                    esrgan,
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

/// An engine loaded, and warm once [`Cold::warm_up`] has run.
enum Cold {
    Sdxl(Box<SdxlEngine>),
    QwenEdit(Box<QwenEditEngine>),
    Esrgan(Box<EsrganEngine>),
}

impl Cold {
    fn warm_up(&self) -> anyhow::Result<()> {
        match self {
            Cold::Sdxl(e) => e.warm_up(),
            Cold::QwenEdit(e) => e.warm_up(),
            Cold::Esrgan(e) => e.warm_up(),
        }
    }
}

/// Loads the configured engines and warms them up. Each engine's files are read and copied to the
/// device on a thread of its own, all at once: that is most of a cold start, and the engines
/// share nothing while loading (the loader's pinned staging buffers are a pool), each on a stream
/// of its own ([`on_load_stream`]). Each warms up on this thread, where its jobs will run, as soon
/// as it is loaded, while the others still load; SDXL's CUDA graphs too, which libtorch captures in
/// CUDA's thread-local mode, where other threads may allocate meanwhile
/// ([`vnfarm_models::nn::cuda_graph`]). The first failure is the error, once every loader has ended.
fn load_and_warm(
    config: &EngineConfig,
    settings: &EngineSettings,
    cache_keys: AdvertisedKeys,
    shared: Option<SharedEncodings>,
) -> anyhow::Result<Vec<Cold>> {
    let (sdxl, qwen_edit, esrgan) = (settings.sdxl, settings.qwen_edit, settings.esrgan);
    // Upscales enlarge the images the farm makes: warmed at the sizes those engines warm at.
    let made = (config.sdxl.iter().flat_map(|c| c.warm_up.iter()))
        .chain(config.qwen_edit.iter().flat_map(|c| c.warm_up.iter()));
    let esrgan_config = config.esrgan.as_ref().map(|c| c.warming_at(made.copied()));
    std::thread::scope(|scope| {
        let (tx, loaded) = std::sync::mpsc::channel::<anyhow::Result<Cold>>();
        if let Some(c) = &config.sdxl {
            spawn_loader(scope, &tx, "SDXL", move || {
                on_load_stream(&c.device, || {
                    Ok(Cold::Sdxl(Box::new(SdxlEngine::load_cold(c, sdxl)?)))
                })
            });
        }
        if let Some(c) = &config.qwen_edit {
            spawn_loader(scope, &tx, "Qwen-Image-Edit", move || {
                on_load_stream(&c.device, || {
                    let e = QwenEditEngine::load_cold(c, qwen_edit, cache_keys, shared)?;
                    Ok(Cold::QwenEdit(Box::new(e)))
                })
            });
        }
        if let Some(c) = &esrgan_config {
            spawn_loader(scope, &tx, "Real-ESRGAN", move || {
                on_load_stream(&c.device, || {
                    Ok(Cold::Esrgan(Box::new(EsrganEngine::load_cold(c, esrgan)?)))
                })
            });
        }
        // The iteration ends when every loader has sent its engine (or error) and dropped its
        // sender. Each loader logs its own load's end; the warm-ups log theirs.
        drop(tx);
        warm_as_loaded(loaded, Cold::warm_up)
    })
}

/// Warms each engine as it comes from `loaded` (in the order the loads end). The first load error
/// is the error, once every load has ended; engines loaded after it are dropped unwarmed.
fn warm_as_loaded<T>(
    loaded: impl IntoIterator<Item = anyhow::Result<T>>,
    mut warm_up: impl FnMut(&T) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<T>> {
    let mut failed = None;
    let mut warm = Vec::new();
    for cold in loaded {
        match cold {
            Err(e) => {
                failed.get_or_insert(e);
            }
            Ok(_) if failed.is_some() => {}
            Ok(cold) => {
                warm_up(&cold)?;
                warm.push(cold);
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(warm),
    }
}

/// Set to `1`, cold loads run on the default stream ([`on_load_stream`]).
pub const DEFAULT_STREAM_LOADS_VAR: &str = "VNFARM_TEST_DEFAULT_STREAM_LOADS";

/// Runs a cold load on a side stream of its own when `device` names a GPU libtorch sees
/// ([`vnfarm_models::loading::stream`]): its copies then overlap the warm-ups the engine thread
/// queues meanwhile on the default stream, neither waiting for the other. Anything else loads as
/// it is, and the load reports a device it cannot use. [`DEFAULT_STREAM_LOADS_VAR`]` = 1` loads on
/// the default stream (the loads before, for a benchmark's comparison).
fn on_load_stream<T>(device: &str, load: impl FnOnce() -> T) -> T {
    if std::env::var_os(DEFAULT_STREAM_LOADS_VAR).is_some_and(|v| v == "1") {
        return load();
    }
    match device::parse_device(device) {
        Ok(d @ tch::Device::Cuda(i)) if (i as i64) < tch::Cuda::device_count() => {
            vnfarm_models::loading::stream::on_load_stream(d, load)
        }
        _ => load(),
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

/// Loads an engine on a thread of `scope`, sending it (or why it failed: a panic, such as a
/// libtorch failure tch reports by panicking, is an error naming the model) to `tx`.
fn spawn_loader<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    tx: &std::sync::mpsc::Sender<anyhow::Result<Cold>>,
    model: &'static str,
    load: impl FnOnce() -> anyhow::Result<Cold> + Send + 'scope,
) {
    let tx = tx.clone();
    scope.spawn(move || {
        let cold =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)).unwrap_or_else(|panic| {
                Err(anyhow::anyhow!(
                    "loading {model}: the loader panicked: {}",
                    panic_message(&*panic)
                ))
            });
        // The receiver is gone only after a warm-up failed; then this engine is not wanted.
        let _ = tx.send(cold);
    });
}

fn unsupported(jobs: &[&EngineJob], model: ModelFamily) -> Vec<Result<EngineOutput, EngineError>> {
    jobs.iter()
        .map(|_| Err(EngineError::Unsupported(model)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Engines warm in the order their loads end, each as it comes.
    #[test]
    fn engines_warm_as_their_loads_end() {
        let log = std::cell::RefCell::new(Vec::new());
        let loaded = ["esrgan", "sdxl", "qwen"].into_iter().map(|name| {
            log.borrow_mut().push(format!("load {name}"));
            Ok(name)
        });
        let warm = warm_as_loaded(loaded, |name| {
            log.borrow_mut().push(format!("warm {name}"));
            Ok(())
        })
        .expect("all warm");
        assert_eq!(warm, ["esrgan", "sdxl", "qwen"]);
        assert_eq!(
            log.into_inner(),
            [
                "load esrgan",
                "warm esrgan",
                "load sdxl",
                "warm sdxl",
                "load qwen",
                "warm qwen"
            ]
        );
    }

    /// A failed load is the error once the others have ended; nothing loaded after it warms.
    #[test]
    fn a_failed_load_is_the_error_and_later_engines_do_not_warm() {
        let mut warmed = Vec::new();
        let loaded = vec![
            Ok("esrgan"),
            Err(anyhow::anyhow!("loading SDXL: no such file")),
            Ok("qwen"),
        ];
        let e = warm_as_loaded(loaded, |name| {
            warmed.push(*name);
            Ok(())
        })
        .expect_err("the load failed");
        assert_eq!(e.to_string(), "loading SDXL: no such file");
        assert_eq!(warmed, ["esrgan"]);
    }

    /// A loader that panics (tch reports libtorch failures by panicking) is a load error that
    /// names the model, not a crash of the worker.
    #[test]
    fn a_loader_that_panics_is_a_load_error_naming_the_model() {
        let (tx, loaded) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            spawn_loader(scope, &tx, "SDXL", || {
                panic!("CUDA out of memory. Tried to allocate 2.00 GiB")
            });
        });
        let Err(e) = loaded.recv().expect("the loader answers") else {
            panic!("a panicked load is an error");
        };
        assert_eq!(
            e.to_string(),
            "loading SDXL: the loader panicked: CUDA out of memory. Tried to allocate 2.00 GiB"
        );
    }
}
