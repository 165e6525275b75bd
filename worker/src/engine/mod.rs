//! Engines run the models. All of them live on one dedicated thread ([`EngineHost`]): tch tensors are
//! not `Sync`, no-grad mode is thread-local, and compute must never block the async runtime. The async
//! side sends an [`EngineJob`] and awaits the reply; progress comes back on a channel and cancellation
//! is a flag the engine checks between denoising steps.
//!
//! The set of engines is closed, so [`Engine`] is an enum. The test-pattern engine is a fixture for the
//! job system and is never used in place of a model that failed to load: a worker whose configured
//! engine cannot load exits with an error.

pub mod device;
pub mod esrgan;
pub mod qwen_edit;
pub mod sdxl;
pub mod test_pattern;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use image::{DynamicImage, RgbImage};
use serde::Deserialize;
use vnfarm_proto::{JobId, ModelFamily, StageTimings, Task};

pub use esrgan::{EsrganConfig, EsrganEngine};
pub use qwen_edit::{QwenEditEngine, QwenEditEngineConfig};
pub use sdxl::{SdxlConfig, SdxlEngine};
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
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Deterministic CPU images; a fixture for exercising the job system without weights.
    TestPattern,
    /// The models, natively on libtorch.
    Tch,
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

/// One unit of work for an engine: a task with its decoded input images, in the task's order.
#[derive(Debug)]
pub struct EngineJob {
    pub job_id: JobId,
    pub task: Task,
    pub inputs: Vec<InputImage>,
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
    pub timings: StageTimings,
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
}

/// Why a running job is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// A client cancelled the job: report it cancelled.
    User,
    /// The worker is shutting down past its grace period: give the job back to the queue.
    Shutdown,
}

/// A cancellation flag shared between the async side and the engine thread.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicU8>);

impl Cancel {
    pub fn request(&self, reason: CancelReason) {
        let code = match reason {
            CancelReason::User => 1,
            CancelReason::Shutdown => 2,
        };
        // Keep the first reason: a user cancel is not turned into a requeue.
        let _ = self
            .0
            .compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn requested(&self) -> Option<CancelReason> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            1 => Some(CancelReason::User),
            _ => Some(CancelReason::Shutdown),
        }
    }

    /// `Err(Cancelled)` when cancellation was requested; engines call it between steps.
    pub fn check(&self) -> Result<(), EngineError> {
        match self.requested() {
            Some(reason) => Err(EngineError::Cancelled(reason)),
            None => Ok(()),
        }
    }
}

/// Step progress reported by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub step: u32,
    pub total: u32,
}

/// The closed set of engines.
pub enum Engine {
    TestPattern(TestPatternEngine),
    /// The models on libtorch; one per family as they are implemented.
    Tch {
        sdxl: Option<Box<SdxlEngine>>,
        qwen_edit: Option<Box<QwenEditEngine>>,
        esrgan: Option<Box<EsrganEngine>>,
    },
}

impl Engine {
    /// Loads the configured engines; `cache_keys` receives the keys of the encode caches.
    pub fn load(
        config: &EngineConfig,
        cache_keys: Arc<Mutex<Vec<String>>>,
    ) -> anyhow::Result<Self> {
        match config.kind() {
            EngineKind::TestPattern => Ok(Engine::TestPattern(TestPatternEngine::new(
                config.test_pattern.clone(),
            ))),
            EngineKind::Tch => Ok(Engine::Tch {
                sdxl: config
                    .sdxl
                    .as_ref()
                    .map(|c| SdxlEngine::load(c).map(Box::new))
                    .transpose()?,
                qwen_edit: config
                    .qwen_edit
                    .as_ref()
                    .map(|c| QwenEditEngine::load(c, cache_keys).map(Box::new))
                    .transpose()?,
                esrgan: config
                    .esrgan
                    .as_ref()
                    .map(|c| EsrganEngine::load(c).map(Box::new))
                    .transpose()?,
            }),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Engine::TestPattern(_) => "test-pattern",
            Engine::Tch { .. } => "tch",
        }
    }

    fn run(
        &mut self,
        job: EngineJob,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<EngineOutput, EngineError> {
        match self {
            Engine::TestPattern(e) => e.run(job, progress, cancel),
            Engine::Tch {
                sdxl,
                qwen_edit,
                esrgan,
            } => match job.task.model() {
                ModelFamily::Sdxl => match sdxl {
                    Some(e) => e.run(job, progress, cancel),
                    None => Err(EngineError::Unsupported(ModelFamily::Sdxl)),
                },
                ModelFamily::QwenEdit => match qwen_edit {
                    Some(e) => e.run(job, progress, cancel),
                    None => Err(EngineError::Unsupported(ModelFamily::QwenEdit)),
                },
                ModelFamily::Esrgan => match esrgan {
                    Some(e) => e.run(job, progress, cancel),
                    None => Err(EngineError::Unsupported(ModelFamily::Esrgan)),
                },
            },
        }
    }
}

/// Runs one job, turning a panic into [`EngineError::Failed`] for that job. A panic (a bug, or a
/// libtorch failure outside the pipeline's own guard) must not kill the engine thread: a worker with a
/// dead engine would fail every job sent to it. The engines keep no state a half-run job could
/// corrupt (the weights are only read), so the thread goes on serving.
fn guarded(
    run: impl FnOnce() -> Result<EngineOutput, EngineError>,
) -> Result<EngineOutput, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|m| m.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(%message, "the engine panicked on a job");
        Err(EngineError::Failed(format!("engine panicked: {message}")))
    })
}

struct Request {
    job: EngineJob,
    progress: tokio::sync::mpsc::UnboundedSender<Progress>,
    cancel: Cancel,
    reply: tokio::sync::oneshot::Sender<Result<EngineOutput, EngineError>>,
}

/// The engine thread and the channel to it.
pub struct EngineHost {
    tx: std::sync::mpsc::Sender<Request>,
    name: &'static str,
    models: Vec<ModelFamily>,
    cache_keys: Arc<Mutex<Vec<String>>>,
}

impl EngineHost {
    /// Starts the engine thread and loads the engine on it; fails if the engine cannot load.
    pub async fn start(config: EngineConfig) -> anyhow::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let models = config.models();
        let cache_keys = Arc::new(Mutex::new(Vec::new()));
        let engine_keys = cache_keys.clone();
        thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let served = config.models();
                // A failed send means `start` was dropped (the worker is exiting): nobody waits for
                // the answer.
                let mut engine = match Engine::load(&config, engine_keys) {
                    Ok(engine) => {
                        if ready_tx.send(Ok(engine.name())).is_err() {
                            tracing::debug!("engine loaded, but nobody is waiting for it");
                        }
                        engine
                    }
                    Err(e) => {
                        if ready_tx.send(Err(e)).is_err() {
                            tracing::debug!("engine failed to load, and nobody is waiting for it");
                        }
                        return;
                    }
                };
                // Ends when the host (the only sender) is dropped.
                while let Ok(req) = rx.recv() {
                    let Request {
                        job,
                        progress,
                        cancel,
                        reply,
                    } = req;
                    let model = job.task.model();
                    let result = if served.contains(&model) {
                        guarded(|| {
                            engine.run(
                                job,
                                &mut |p| {
                                    // The receiver is gone only when the job's progress forwarder
                                    // stopped, which logged why; the job itself goes on.
                                    let _ = progress.send(p);
                                },
                                &cancel,
                            )
                        })
                    } else {
                        Err(EngineError::Unsupported(model))
                    };
                    if reply.send(result).is_err() {
                        // The job's future was dropped (the worker is exiting); the message was not
                        // acked, so the broker redelivers it.
                        tracing::debug!("engine result dropped: nobody is waiting for it");
                    }
                }
            })?;
        let name = ready_rx
            .await
            .map_err(|_| anyhow::anyhow!("engine thread died while loading"))??;
        Ok(Self {
            tx,
            name,
            models,
            cache_keys,
        })
    }

    /// Keys of the input sets whose encodings the engines hold (for the heartbeat).
    pub fn encode_cache_keys(&self) -> Vec<String> {
        self.cache_keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn models(&self) -> &[ModelFamily] {
        &self.models
    }

    /// Runs one job on the engine thread.
    pub async fn run(
        &self,
        job: EngineJob,
        progress: tokio::sync::mpsc::UnboundedSender<Progress>,
        cancel: Cancel,
    ) -> Result<EngineOutput, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Request {
                job,
                progress,
                cancel,
                reply,
            })
            .map_err(|_| EngineError::Failed("engine thread has stopped".into()))?;
        rx.await
            .map_err(|_| EngineError::Failed("engine thread dropped the job".into()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_job_fails_alone() {
        let r = guarded(|| panic!("index out of bounds"));
        match r {
            Err(EngineError::Failed(m)) => assert!(m.contains("index out of bounds"), "{m}"),
            other => panic!("expected Failed, got {other:?}"),
        }
        let ok = guarded(|| {
            Ok(EngineOutput {
                images: Vec::new(),
                seeds: Vec::new(),
                timings: StageTimings::default(),
            })
        });
        assert!(ok.is_ok(), "a job after a panic runs normally");
    }
}
