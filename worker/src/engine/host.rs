//! The engine thread and the channel to it. The engine loads on that thread while the worker already
//! runs (its heartbeats say `warming`); batches sent before it is ready wait in the channel.
//!
//! A message's jobs run in the engine's runs ([`Engine::runs`]), one run after another, and each
//! job's result goes back as soon as its run ends, so the worker stores and reports it while the
//! next run denoises. Before each run, jobs the scheduler asked back (a yield) are answered
//! [`EngineError::Yielded`] unrun. After a device failure the rest of the message does not run here.
//!
//! A panic inside an engine fails only the batch it ran (each of its jobs is tried once more alone,
//! so a panic one job provokes fails that job alone): the engines keep no state a half-run job
//! could corrupt (the weights are only read), so the thread goes on serving.

use std::sync::{Arc, OnceLock};
use std::thread;

use vnfarm_proto::{GpuMemory, ModelFamily, SettingsInUse};

use super::{
    AdvertisedKeys, AdvertisedLoras, Engine, EngineBusy, EngineConfig, EngineError, EngineJob,
    EngineKind, EngineOutput, GpuMemoryProbe, Progress, SharedEncodings, panic_message,
};

/// A job's result, tagged with its index in the message.
pub type Answer = (usize, Result<EngineOutput, EngineError>);

struct Request {
    jobs: Vec<EngineJob>,
    progress: tokio::sync::mpsc::UnboundedSender<(usize, Progress)>,
    answers: tokio::sync::mpsc::UnboundedSender<Answer>,
}

/// The engine thread and the channel to it.
pub struct EngineHost {
    tx: std::sync::mpsc::Sender<Request>,
    name: &'static str,
    models: Vec<ModelFamily>,
    checkpoints: Vec<String>,
    catalogue_checkpoints: u32,
    loras: AdvertisedLoras,
    cache_keys: AdvertisedKeys,
    gpu: Option<GpuMemoryProbe>,
    /// The test-pattern engine's simulated GPU, reported instead of a device's.
    simulated_gpu: Option<GpuMemory>,
    /// The engines' settings, known once they have loaded.
    settings: Arc<OnceLock<SettingsInUse>>,
    /// The engine's compute time, summed over its runs.
    busy: EngineBusy,
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
    pub fn start(
        config: EngineConfig,
        shared: Option<SharedEncodings>,
    ) -> anyhow::Result<(Self, EngineLoading)> {
        let (tx, rx) = std::sync::mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let cache_keys = AdvertisedKeys::default();
        let host = Self {
            tx,
            name: config.kind().name(),
            models: config.models(),
            checkpoints: config.checkpoints(),
            catalogue_checkpoints: config.catalogue_checkpoints(),
            loras: config.advertised_loras(),
            cache_keys: cache_keys.clone(),
            gpu: config.gpu().map(GpuMemoryProbe::new),
            simulated_gpu: match config.kind() {
                EngineKind::TestPattern => config.test_pattern.gpu_memory(),
                EngineKind::Tch => None,
            },
            settings: Arc::default(),
            busy: EngineBusy::default(),
        };
        let settings = host.settings.clone();
        let busy = host.busy.clone();
        thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let served = config.models();
                // A failed send means nobody waits for the answer (the worker is exiting).
                let mut engine = match Engine::load(&config, cache_keys, shared) {
                    Ok(engine) => {
                        if let Some(in_use) = engine.settings_in_use() {
                            // Set once, by this thread alone.
                            let _ = settings.set(in_use);
                        }
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
                    answers,
                }) = rx.recv()
                {
                    let mut report = |i: usize, p: Progress| {
                        // The receiver is gone only when the message's progress forwarder stopped,
                        // which logged why; the jobs go on.
                        let _ = progress.send((i, p));
                    };
                    let mut answer = |i: usize, result| {
                        // The receiver is gone only when the message's future was dropped (the
                        // worker is exiting); it was not acked, so the broker redelivers it.
                        let _ = answers.send((i, result));
                    };
                    serve(&mut engine, &served, &busy, &jobs, &mut report, &mut answer);
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

    /// The engine's compute time so far (its runs, on the device's clock where there is one).
    pub fn busy(&self) -> &EngineBusy {
        &self.busy
    }

    /// The engines' settings and where they came from, once the engines have loaded.
    pub fn settings(&self) -> Option<SettingsInUse> {
        self.settings.get().cloned()
    }

    /// SDXL checkpoints held, by name.
    pub fn checkpoints(&self) -> &[String] {
        &self.checkpoints
    }

    /// How many catalogue checkpoints it keeps loaded (0: it serves only its own).
    pub fn catalogue_checkpoints(&self) -> u32 {
        self.catalogue_checkpoints
    }

    /// The LoRA names it advertises (blocking: reads its folders).
    pub fn lora_names(&self) -> Option<Vec<String>> {
        self.loras.names()
    }

    /// The GPU's memory now, when the engines run on one.
    pub fn gpu_memory(&self) -> Option<GpuMemory> {
        self.gpu
            .as_ref()
            .and_then(GpuMemoryProbe::read)
            .or(self.simulated_gpu)
    }

    /// Runs a message's jobs on the engine thread. Each job's result arrives, tagged with its index,
    /// as soon as the engine has it; the channel closes after the last. A job the channel closes
    /// without answering was dropped by a dead engine thread. Progress arrives tagged likewise.
    pub fn run_batch(
        &self,
        jobs: Vec<EngineJob>,
        progress: tokio::sync::mpsc::UnboundedSender<(usize, Progress)>,
    ) -> tokio::sync::mpsc::UnboundedReceiver<Answer> {
        let n = jobs.len();
        let (answers, rx) = tokio::sync::mpsc::unbounded_channel();
        if let Err(refused) = self.tx.send(Request {
            jobs,
            progress,
            answers,
        }) {
            for i in 0..n {
                let stopped = EngineError::Failed("engine thread has stopped".into());
                let _ = refused.0.answers.send((i, Err(stopped)));
            }
        }
        rx
    }
}

/// Runs a message's jobs of the families this worker serves (the others fail as unsupported), run
/// by run, answering each job when its run ends.
fn serve(
    engine: &mut Engine,
    served: &[ModelFamily],
    busy: &EngineBusy,
    jobs: &[EngineJob],
    progress: &mut dyn FnMut(usize, Progress),
    answer: &mut dyn FnMut(usize, Result<EngineOutput, EngineError>),
) {
    let mut runnable = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let model = job.task.model();
        if served.contains(&model) {
            runnable.push(i);
        } else {
            answer(i, Err(EngineError::Unsupported(model)));
        }
    }
    let members: Vec<&EngineJob> = runnable.iter().map(|&i| &jobs[i]).collect();
    let mut lost: Option<EngineError> = None;
    for run in engine.runs(&members) {
        let run: Vec<usize> = run.into_iter().map(|k| runnable[k]).collect();
        if let Some(lost) = &lost {
            // The device may be unusable: the rest go to another worker.
            for i in run {
                answer(i, Err(lost.clone()));
            }
            continue;
        }
        let (yielded, run): (Vec<usize>, Vec<usize>) = run
            .into_iter()
            .partition(|&i| jobs[i].cancel.yield_requested());
        for i in yielded {
            answer(i, Err(EngineError::Yielded));
        }
        if run.is_empty() {
            continue;
        }
        for (i, result) in busy.time(|| run_together(engine, jobs, &run, progress)) {
            if let Err(e @ EngineError::DeviceLost(_)) = &result {
                lost = Some(e.clone());
            }
            answer(i, result);
        }
    }
}

/// Runs `run` (indices into `jobs`) on the engine together; after a panic, each job once more
/// alone, so a panic one job provokes fails that job alone.
fn run_together(
    engine: &mut Engine,
    jobs: &[EngineJob],
    run: &[usize],
    progress: &mut dyn FnMut(usize, Progress),
) -> Vec<(usize, Result<EngineOutput, EngineError>)> {
    let members: Vec<&EngineJob> = run.iter().map(|&i| &jobs[i]).collect();
    let together = guarded(|| engine.run_batch(&members, &mut |k, p| progress(run[k], p)));
    let answers = match together {
        Ok(answers) => answers,
        Err(panicked) if members.len() > 1 => {
            tracing::warn!(
                jobs = members.len(),
                "running the panicked run's jobs one by one"
            );
            run.iter()
                .map(|&i| {
                    guarded(|| engine.run_batch(&[&jobs[i]], &mut |_, p| progress(i, p)))
                        .map_or_else(|e| Some(Err(e)), |mut r| r.pop())
                        .unwrap_or_else(|| Err(panicked.clone()))
                })
                .collect()
        }
        Err(panicked) => vec![Err(panicked)],
    };
    let mut answers = answers.into_iter();
    run.iter()
        .map(|&i| {
            let answer = answers
                .next()
                .unwrap_or_else(|| Err(EngineError::Failed("the engine skipped the job".into())));
            (i, answer)
        })
        .collect()
}

/// Runs `run`, turning a panic into [`EngineError::Failed`]. A panic (a bug, or a libtorch failure
/// outside the pipelines' own guards) must not kill the engine thread: a worker with a dead engine
/// would fail every job sent to it.
fn guarded<T>(run: impl FnOnce() -> T) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).map_err(|payload| {
        let message = panic_message(&*payload);
        tracing::error!(%message, "the engine panicked");
        EngineError::Failed(format!("engine panicked: {message}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::job::tests::edit;
    use crate::engine::{AdvertisedKeys, CancelReason, TestPatternConfig, TestPatternEngine};
    use std::time::{Duration, Instant};

    /// A test-pattern engine whose edit steps take `step_ms` with no batch gain.
    fn engine(step_ms: u64, batch_step_cost: f64) -> Engine {
        Engine::TestPattern(Box::new(TestPatternEngine::new(
            TestPatternConfig {
                step_ms,
                encode_ms: 0,
                decode_ms: 0,
                batch_step_cost,
                ..TestPatternConfig::default()
            },
            AdvertisedKeys::default(),
            None,
        )))
    }

    /// Serves `jobs` as a worker of `served`, returning each answer with when it came, in order.
    fn serve_all(
        engine: &mut Engine,
        served: &[ModelFamily],
        jobs: &[EngineJob],
    ) -> Vec<(usize, Result<EngineOutput, EngineError>, Instant)> {
        let mut got = Vec::new();
        serve(
            engine,
            served,
            &EngineBusy::default(),
            jobs,
            &mut |_, _| {},
            &mut |i, r| got.push((i, r, Instant::now())),
        );
        got
    }

    /// Serves edits, returning each answer's index, whether it succeeded, and when it came.
    fn answers(engine: &mut Engine, jobs: &[EngineJob]) -> Vec<(usize, bool, Instant)> {
        serve_all(engine, &[ModelFamily::QwenEdit], jobs)
            .into_iter()
            .map(|(i, r, at)| (i, r.is_ok(), at))
            .collect()
    }

    /// Edits of one input, distinct instructions.
    fn edits(n: usize) -> Vec<EngineJob> {
        (0..n)
            .map(|k| edit("inputs/a.png", &k.to_string()))
            .collect()
    }

    #[test]
    fn without_a_batch_gain_each_job_is_answered_when_it_is_done() {
        let jobs = edits(3);
        let started = Instant::now();
        let got = answers(&mut engine(10, 1.0), &jobs);
        let order: Vec<usize> = got.iter().map(|(i, _, _)| *i).collect();
        assert_eq!(order, [0, 1, 2]);
        assert!(got.iter().all(|(_, ok, _)| *ok));
        // Four steps of 10 ms each: the first answer comes after one job's steps, not three.
        let first = got[0].2 - started;
        let last = got[2].2 - started;
        assert!(
            first < Duration::from_millis(80) && last >= Duration::from_millis(120),
            "first {first:?}, last {last:?}"
        );
    }

    #[test]
    fn with_a_batch_gain_the_group_runs_together() {
        let jobs = edits(3);
        let got = answers(&mut engine(10, 0.5), &jobs);
        assert_eq!(got.len(), 3);
        let spread = got[2].2 - got[0].2;
        assert!(
            spread < Duration::from_millis(20),
            "answered together: {spread:?}"
        );
    }

    #[test]
    fn jobs_asked_back_before_their_run_are_given_back_unrun() {
        let jobs = edits(3);
        // The yield arrives while the first job runs: the first finishes, the others go back.
        jobs[1].cancel.request_yield();
        jobs[2].cancel.request_yield();
        let got = serve_all(&mut engine(0, 1.0), &[ModelFamily::QwenEdit], &jobs);
        assert!(got[0].1.is_ok(), "{:?}", got[0].1);
        for (i, r, _) in &got[1..] {
            assert!(matches!(r, Err(EngineError::Yielded)), "job {i}: {r:?}");
        }
        // A cancel wins over a yield: the job is settled as cancelled.
        let jobs = edits(2);
        jobs[1].cancel.request_yield();
        jobs[1].cancel.request(CancelReason::User);
        let got = serve_all(&mut engine(0, 1.0), &[ModelFamily::QwenEdit], &jobs);
        assert!(
            matches!(got[1].1, Err(EngineError::Cancelled(CancelReason::User))),
            "{:?}",
            got[1].1
        );
    }

    #[test]
    fn jobs_of_unserved_families_fail_and_the_others_run() {
        let jobs = vec![edit("inputs/a.png", "smile"), edit("inputs/b.png", "frown")];
        let got = serve_all(&mut engine(0, 1.0), &[ModelFamily::Sdxl], &jobs);
        assert_eq!(got.len(), 2);
        assert!(
            got.iter()
                .all(|(_, r, _)| matches!(r, Err(EngineError::Unsupported(_))))
        );
    }

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
