//! The engine thread and the channel to it. The engine loads on that thread while the worker already
//! runs (its heartbeats say `warming`); batches sent before it is ready wait in the channel.
//!
//! A panic inside an engine fails only the batch it ran (each of its jobs is tried once more alone,
//! so a panic one job provokes fails that job alone): the engines keep no state a half-run job
//! could corrupt (the weights are only read), so the thread goes on serving.

use std::thread;

use vnfarm_proto::{GpuMemory, ModelFamily};

use super::{
    AdvertisedKeys, Engine, EngineConfig, EngineError, EngineJob, EngineKind, EngineOutput,
    GpuMemoryProbe, Progress,
};

struct Request {
    jobs: Vec<EngineJob>,
    progress: tokio::sync::mpsc::UnboundedSender<(usize, Progress)>,
    reply: tokio::sync::oneshot::Sender<Vec<Result<EngineOutput, EngineError>>>,
}

/// The engine thread and the channel to it.
pub struct EngineHost {
    tx: std::sync::mpsc::Sender<Request>,
    name: &'static str,
    models: Vec<ModelFamily>,
    checkpoints: Vec<String>,
    cache_keys: AdvertisedKeys,
    gpu: Option<GpuMemoryProbe>,
    /// The test-pattern engine's simulated GPU, reported instead of a device's.
    simulated_gpu: Option<GpuMemory>,
}

/// The engine's loading, on its thread: resolves once it is warm (or failed to load).
pub struct EngineLoading(tokio::sync::oneshot::Receiver<anyhow::Result<()>>);

impl EngineLoading {
    pub async fn finished(self) -> anyhow::Result<()> {
        self.0
            .await
            .map_err(|_| anyhow::anyhow!("the engine thread died while loading"))?
    }
}

impl EngineHost {
    /// Starts the engine thread, which loads and warms up the engine; the host takes batches at
    /// once (they run once the engine is ready).
    pub fn start(config: EngineConfig) -> anyhow::Result<(Self, EngineLoading)> {
        let (tx, rx) = std::sync::mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let cache_keys = AdvertisedKeys::default();
        let host = Self {
            tx,
            name: config.kind().name(),
            models: config.models(),
            checkpoints: config.checkpoints(),
            cache_keys: cache_keys.clone(),
            gpu: config.gpu().map(GpuMemoryProbe::new),
            simulated_gpu: match config.kind() {
                EngineKind::TestPattern => config.test_pattern.gpu_memory(),
                EngineKind::Tch => None,
            },
        };
        thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let served = config.models();
                // A failed send means nobody waits for the answer (the worker is exiting).
                let mut engine = match Engine::load(&config, cache_keys) {
                    Ok(engine) => {
                        if ready_tx.send(Ok(())).is_err() {
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
                while let Ok(Request {
                    jobs,
                    progress,
                    reply,
                }) = rx.recv()
                {
                    let mut report = |i: usize, p: Progress| {
                        // The receiver is gone only when the message's progress forwarder stopped,
                        // which logged why; the jobs go on.
                        let _ = progress.send((i, p));
                    };
                    let results = serve(&mut engine, &served, &jobs, &mut report);
                    if reply.send(results).is_err() {
                        // The message's future was dropped (the worker is exiting); it was not
                        // acked, so the broker redelivers it.
                        tracing::debug!("engine results dropped: nobody is waiting for them");
                    }
                }
            })?;
        Ok((host, EngineLoading(ready_rx)))
    }

    /// Affinity keys of the inputs whose encodings the engines hold (for the heartbeat).
    pub fn encode_cache_keys(&self) -> Vec<String> {
        self.cache_keys.get()
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn models(&self) -> &[ModelFamily] {
        &self.models
    }

    /// SDXL checkpoints held, by name.
    pub fn checkpoints(&self) -> &[String] {
        &self.checkpoints
    }

    /// The GPU's memory now, when the engines run on one.
    pub fn gpu_memory(&self) -> Option<GpuMemory> {
        self.gpu
            .as_ref()
            .and_then(GpuMemoryProbe::read)
            .or(self.simulated_gpu)
    }

    /// Runs a batch on the engine thread: one result per job, in order. Progress arrives tagged
    /// with the job's index.
    pub async fn run_batch(
        &self,
        jobs: Vec<EngineJob>,
        progress: tokio::sync::mpsc::UnboundedSender<(usize, Progress)>,
    ) -> Vec<Result<EngineOutput, EngineError>> {
        let n = jobs.len();
        let failed = |why: &str| {
            (0..n)
                .map(|_| Err(EngineError::Failed(why.to_owned())))
                .collect()
        };
        let (reply, rx) = tokio::sync::oneshot::channel();
        if self
            .tx
            .send(Request {
                jobs,
                progress,
                reply,
            })
            .is_err()
        {
            return failed("engine thread has stopped");
        }
        rx.await
            .unwrap_or_else(|_| failed("engine thread dropped the jobs"))
    }
}

/// Runs a batch's jobs of the families this worker serves; the others fail as unsupported.
fn serve(
    engine: &mut Engine,
    served: &[ModelFamily],
    jobs: &[EngineJob],
    progress: &mut dyn FnMut(usize, Progress),
) -> Vec<Result<EngineOutput, EngineError>> {
    let mut results: Vec<Option<Result<EngineOutput, EngineError>>> =
        jobs.iter().map(|_| None).collect();
    let mut runnable = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let model = job.task.model();
        if served.contains(&model) {
            runnable.push(i);
        } else {
            results[i] = Some(Err(EngineError::Unsupported(model)));
        }
    }
    let members: Vec<&EngineJob> = runnable.iter().map(|&i| &jobs[i]).collect();
    if members.is_empty() {
        return results.into_iter().flatten().collect();
    }
    let together = guarded(|| engine.run_batch(&members, &mut |k, p| progress(runnable[k], p)));
    let answers = match together {
        Ok(answers) => answers,
        Err(panicked) if members.len() > 1 => {
            tracing::warn!(
                jobs = members.len(),
                "running the panicked batch's jobs one by one"
            );
            runnable
                .iter()
                .map(|&i| {
                    guarded(|| engine.run_batch(&[&jobs[i]], &mut |_, p| progress(i, p)))
                        .map_or_else(|e| Some(Err(e)), |mut r| r.pop())
                        .unwrap_or_else(|| Err(panicked.clone()))
                })
                .collect()
        }
        Err(panicked) => vec![Err(panicked)],
    };
    for (&i, answer) in runnable.iter().zip(answers) {
        results[i] = Some(answer);
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Failed("the engine skipped the job".into()))))
        .collect()
}

/// Runs `run`, turning a panic into [`EngineError::Failed`]. A panic (a bug, or a libtorch failure
/// outside the pipelines' own guards) must not kill the engine thread: a worker with a dead engine
/// would fail every job sent to it.
fn guarded<T>(run: impl FnOnce() -> T) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|m| m.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(%message, "the engine panicked");
        EngineError::Failed(format!("engine panicked: {message}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_fails_alone() {
        let r = guarded(|| -> u32 { panic!("index out of bounds") });
        match r {
            Err(EngineError::Failed(m)) => assert!(m.contains("index out of bounds"), "{m}"),
            other => panic!("expected Failed, got {other:?}"),
        }
        assert_eq!(
            guarded(|| 7).ok(),
            Some(7),
            "a call after a panic runs normally"
        );
    }
}
