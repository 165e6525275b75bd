//! The test-pattern engine: deterministic CPU images for exercising the job system without libtorch or
//! weights. Every field of the task and the seed change the image (the spec is hashed into it), and
//! each stage sleeps for a configurable time so scheduling can be measured against realistic shapes:
//! a generate "denoises" for `steps × step_ms` per image, an edit "encodes" its inputs and denoises
//! for `steps × edit_step_ms`, every image "decodes".
//!
//! It simulates what the models' engines gain from batches, so that the fleet's dispatch can be
//! measured: edits of one input share one encoding, kept in an encode cache (by affinity key, least
//! recently used first out) and paid only on a miss; and compatible jobs denoise together, a step
//! of `n` jobs costing `step_ms × (1 + (n − 1) × batch_step_cost)`, split evenly across their
//! timings. Only the job that encoded reports an `encode` timing, so encodes can be counted from
//! `completed` events. Without a batch gain (`batch_step_cost` 1) the jobs of a message run one
//! after another ([`TestPatternEngine::runs`]), as a real engine with nothing to gain would.
//!
//! It is a fixture, never a stand-in for a model.

use std::time::{Duration, Instant};

use image::{DynamicImage, Rgb, RgbImage};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

use vnfarm_proto::{
    EditSpec, GpuMemory, JobId, LoraRef, ModelFileRole, Sampler, StageTimings, Task,
};

use super::{
    AdvertisedKeys, CacheLookup, CancelReason, EncodeCache, EngineError, EngineJob, EngineOutput,
    Fetched, OutputImage, Progress, SharedEncodings, SharedStore, UsedFile, all_cancelled,
    content_key, groups,
};
use crate::engine::shared_encodings::hex_sha256;

/// The `[engine.test_pattern]` table; a key left out is [`TestPatternConfig::default`]'s.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TestPatternConfig {
    /// Sleep per denoising step, in milliseconds.
    pub step_ms: u64,
    /// Sleep per denoising step of an edit (the edit model's steps cost differently). Unset:
    /// `step_ms`.
    pub edit_step_ms: Option<u64>,
    /// Sleep for encoding an edit's inputs (on a cache miss).
    pub encode_ms: u64,
    /// Sleep for decoding each output image.
    pub decode_ms: u64,
    /// Input sets whose encodings it keeps, least recently used first out.
    pub encode_cache_entries: usize,
    /// Size of the encodings it publishes to shared storage and fetches from there (KiB); the
    /// default is about what Qwen-Image-Edit's encodings of a 1024² input weigh in bf16 (VAE
    /// latents 0.5 MiB, vision features 1.3 MiB). Fetches take the real storage's time.
    pub encoding_kib: u32,
    /// What each job beyond the first adds to a batch's denoising step, as a fraction of one job's
    /// step: 1 is no gain (n jobs take n times as long), 0 makes the extra jobs free. Set from
    /// measured profiles by the fleet benchmark.
    pub batch_step_cost: f64,
    /// How the step and decode sleeps grow with the output's area: they are multiplied by its
    /// megapixels (2^20 pixels) to this power, so `step_ms` is a 1-megapixel step. 0 (the
    /// default): every size costs the same; 1: proportional to the pixels, as a real model's
    /// step roughly is (the fleet benchmark's estimate accuracy uses it for a mixed workload).
    pub area_scaling: f64,
    /// Sleep for "loading and warming up" before it takes jobs (the worker heartbeats `warming`
    /// meanwhile).
    pub load_ms: u64,
    /// SDXL checkpoints it claims to hold (advertised in heartbeats); a generate naming another one
    /// fails as it would on an SDXL worker.
    pub checkpoints: Vec<String>,
    /// Catalogue checkpoints it claims to keep loaded (advertised in heartbeats, as
    /// `engine.sdxl.catalogue_checkpoints`): above 0, a generate naming a catalogue checkpoint
    /// that the worker fetched for it runs, and its manifest names that file.
    pub catalogue_checkpoints: u32,
    /// LoRA file names it claims to hold (advertised in heartbeats, as a worker lists its
    /// `lora_dir`), so a farm of test-pattern workers can refuse names that exist nowhere. Unset:
    /// it advertises none and takes any name (the scheduler cannot tell which exist).
    pub loras: Option<Vec<String>>,
    /// Files it claims every image is made from, as checkpoints: their real sha256 and size go
    /// into manifests, so tests can check provenance end to end. Unset: none (it loads no file,
    /// and its manifests say so).
    pub model_files: Vec<PathBuf>,
    /// Fault injection for tests of the job system: a generate with exactly this prompt fails as a
    /// device failure would (the job is given back, the worker exits with an error).
    pub device_failure_prompt: Option<String>,
    /// A GPU of this many MiB it claims to run on, with `gpu_memory_used_mib` of it in use:
    /// heartbeats and `vnfarm_worker_gpu_memory_bytes` report it as a real engine reports its
    /// device (for tests of the metrics, dashboards and alerts). Unset: no GPU, as before.
    pub gpu_memory_mib: Option<u64>,
    pub gpu_memory_used_mib: u64,
}

impl Default for TestPatternConfig {
    fn default() -> Self {
        Self {
            step_ms: 20,
            edit_step_ms: None,
            encode_ms: 30,
            decode_ms: 30,
            encode_cache_entries: 32,
            encoding_kib: 2048,
            batch_step_cost: 1.0,
            area_scaling: 0.0,
            load_ms: 0,
            checkpoints: Vec::new(),
            catalogue_checkpoints: 0,
            loras: None,
            model_files: Vec::new(),
            device_failure_prompt: None,
            gpu_memory_mib: None,
            gpu_memory_used_mib: 0,
        }
    }
}

impl TestPatternConfig {
    /// The simulated GPU's memory (`gpu_memory_mib`), if it claims one.
    pub fn gpu_memory(&self) -> Option<GpuMemory> {
        let total = self.gpu_memory_mib? << 20;
        Some(GpuMemory {
            total_bytes: total,
            free_bytes: total - (self.gpu_memory_used_mib << 20),
            reserved_bytes: None,
        })
    }

    /// The files it claims (`model_files`).
    pub fn files(&self) -> Vec<UsedFile> {
        self.model_files
            .iter()
            .map(|p| UsedFile::named_by_file(p, ModelFileRole::Checkpoint))
            .collect()
    }

    pub fn validate(&self) -> Result<(), String> {
        for (name, ms) in [
            ("step_ms", self.step_ms),
            ("edit_step_ms", self.edit_step_ms.unwrap_or_default()),
            ("encode_ms", self.encode_ms),
            ("decode_ms", self.decode_ms),
            ("load_ms", self.load_ms),
        ] {
            if ms > 60_000 {
                return Err(format!("engine.test_pattern.{name}: at most 60000"));
            }
        }
        if !(1..=100_000).contains(&self.encode_cache_entries) {
            return Err("engine.test_pattern.encode_cache_entries: must be 1..=100000".into());
        }
        if !(1..=65_536).contains(&self.encoding_kib) {
            return Err("engine.test_pattern.encoding_kib: must be 1..=65536".into());
        }
        if !(0.0..=1.0).contains(&self.batch_step_cost) {
            return Err("engine.test_pattern.batch_step_cost: must be within 0..=1".into());
        }
        if !(0.0..=2.0).contains(&self.area_scaling) {
            return Err("engine.test_pattern.area_scaling: must be within 0..=2".into());
        }
        match self.gpu_memory_mib {
            Some(total) if total > 1 << 24 => {
                return Err("engine.test_pattern.gpu_memory_mib: at most 16777216 (16 TiB)".into());
            }
            Some(total) if self.gpu_memory_used_mib > total => {
                return Err(
                    "engine.test_pattern.gpu_memory_used_mib: more than gpu_memory_mib".into(),
                );
            }
            Some(_) | None => {}
        }
        if self.catalogue_checkpoints > super::sdxl::MAX_CATALOGUE_CHECKPOINTS {
            return Err(format!(
                "engine.test_pattern.catalogue_checkpoints: at most {}",
                super::sdxl::MAX_CATALOGUE_CHECKPOINTS
            ));
        }
        if self.checkpoints.iter().any(|c| c.trim().is_empty()) {
            return Err("engine.test_pattern.checkpoints: names must not be empty".into());
        }
        Ok(())
    }
}

pub struct TestPatternEngine {
    config: TestPatternConfig,
    /// Keyed by the inputs' affinity key (their content key for inputs without one).
    cache: EncodeCache<()>,
    /// Where encodings are published and fetched (`encoding_kib` of bytes derived from the key).
    shared: Option<SharedStore>,
}

/// Jobs that denoise together: the same kind and shape, and for edits the same inputs (and LoRA
/// set, which the model fuses per call).
#[derive(Debug, PartialEq)]
enum Shape {
    Generate {
        checkpoint: Option<String>,
        size: (u32, u32),
        steps: u32,
        sampler: Sampler,
        guided: bool,
    },
    Edit {
        inputs: String,
        size: Option<(u32, u32)>,
        steps: u32,
        guided: bool,
        loras: Vec<LoraRef>,
    },
    Alone(JobId),
}

impl Shape {
    fn of(job: &EngineJob) -> Self {
        match &job.task {
            Task::Generate(g) => Shape::Generate {
                checkpoint: g.checkpoint.clone(),
                size: (g.width, g.height),
                steps: g.steps,
                sampler: g.sampler,
                guided: g.cfg > 1.0,
            },
            Task::Edit(e) => Shape::Edit {
                inputs: cache_key(job),
                size: e.width.zip(e.height),
                steps: e.steps,
                guided: e.cfg > 1.0,
                loras: e.loras.clone(),
            },
            Task::Upscale(_) => Shape::Alone(job.job_id),
        }
    }
}

/// The encode cache's key of an edit's inputs: their affinity key, else their content.
fn cache_key(job: &EngineJob) -> String {
    job.task
        .affinity_key()
        .unwrap_or_else(|| content_key(&job.inputs))
}

/// Milliseconds of one denoising step of `n` jobs together.
fn step_cost_ms(step_ms: f64, n: usize, batch_step_cost: f64) -> f64 {
    step_ms * (1.0 + n.saturating_sub(1) as f64 * batch_step_cost)
}

/// The output's area of a job, in pixels (an upscale's from its input and scale).
fn output_pixels(job: &EngineJob) -> f64 {
    let input = || {
        job.inputs
            .first()
            .map(|i| (i.image.width(), i.image.height()))
    };
    let (w, h) = match &job.task {
        Task::Generate(g) => (g.width, g.height),
        Task::Edit(e) => e.width.zip(e.height).or_else(input).unwrap_or((1024, 1024)),
        Task::Upscale(u) => input().map_or((1024, 1024), |(w, h)| (w * u.scale, h * u.scale)),
    };
    f64::from(w) * f64::from(h)
}

/// One job's result as the batch builds it.
#[derive(Default)]
struct Run {
    images: Vec<DynamicImage>,
    seeds: Vec<Option<u64>>,
    timings: StageTimings,
    encode_cache: Option<CacheLookup>,
    error: Option<EngineError>,
}

impl Run {
    fn live(&self) -> bool {
        self.error.is_none()
    }
}

/// 32 bytes that depend on every field of the task and on the image index.
fn fingerprint(task: &Task, index: u32) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(task).expect("tasks serialize to JSON"));
    h.update(index.to_le_bytes());
    h.finalize().into()
}

/// Sleeps `ms` in slices, so that a stop is noticed within ~10 ms; `stop` says whether (and why)
/// to stop.
fn sleep_unless(ms: f64, stop: impl Fn() -> Option<CancelReason>) -> Result<(), EngineError> {
    let deadline = Instant::now() + Duration::from_secs_f64(ms.max(0.0) / 1000.0);
    loop {
        if let Some(reason) = stop() {
            return Err(EngineError::Cancelled(reason));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(());
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(10)));
    }
}

/// Gradient background, diagonal stripes and a checker block, all parameterized by `fp`.
fn pattern(width: u32, height: u32, fp: &[u8; 32]) -> RgbImage {
    let c0 = [fp[0], fp[1], fp[2]];
    let c1 = [fp[3], fp[4], fp[5]];
    let stripe = [fp[6], fp[7], fp[8]];
    let period = 16 + u32::from(fp[9]) % 48;
    let cell = 32 + u32::from(fp[10]) % 96;
    RgbImage::from_fn(width, height, |x, y| {
        let t = (x + y) as f32 / (width + height).max(1) as f32;
        let mut px = [0u8; 3];
        for c in 0..3 {
            px[c] = (f32::from(c0[c]) * (1.0 - t) + f32::from(c1[c]) * t) as u8;
        }
        if (x + 2 * y) % period < period / 4 {
            px = stripe;
        }
        if (x / cell + y / cell) % 2 == 0 && x < cell * 2 && y < cell * 2 {
            px = [255 - px[0], 255 - px[1], 255 - px[2]];
        }
        Rgb(px)
    })
}

/// An edit's output: the first input at the requested size (else its own), blended with the
/// task's pattern. (The model's default size differs: this is a fixture for the job system.)
fn edited(input: &RgbImage, spec: &EditSpec, task: &Task) -> RgbImage {
    let (w, h) = spec
        .width
        .zip(spec.height)
        .unwrap_or((input.width(), input.height()));
    let overlay = pattern(w, h, &fingerprint(task, 0));
    let mut out = if (w, h) == (input.width(), input.height()) {
        input.clone()
    } else {
        image::imageops::resize(input, w, h, image::imageops::FilterType::Triangle)
    };
    for (o, p) in out.pixels_mut().zip(overlay.pixels()) {
        for c in 0..3 {
            o[c] = ((u16::from(o[c]) + u16::from(p[c])) / 2) as u8;
        }
    }
    out
}

impl TestPatternEngine {
    pub fn new(
        config: TestPatternConfig,
        cache_keys: AdvertisedKeys,
        shared: Option<SharedEncodings>,
    ) -> Self {
        let cache = EncodeCache::new(config.encode_cache_entries, cache_keys);
        let fingerprint = hex_sha256(&[b"test_pattern", &config.encoding_kib.to_le_bytes()]);
        let shared = shared.map(|s| s.for_model("test_pattern", &fingerprint[..16]));
        Self {
            config,
            cache,
            shared,
        }
    }

    /// The files every image is claimed to be made from.
    /// The files it claims a job's images are made from: the catalogue checkpoint fetched for
    /// the job, in place of its own claimed files (as an SDXL engine runs on that checkpoint).
    pub fn files(&self, job: &EngineJob) -> Vec<UsedFile> {
        match &job.checkpoint {
            Some(fetched) => vec![fetched.used_file()],
            None => self.config.files(),
        }
    }

    /// The engine as the worker loads it: after `load_ms` of simulated loading.
    pub fn load(
        config: TestPatternConfig,
        cache_keys: AdvertisedKeys,
        shared: Option<SharedEncodings>,
    ) -> Self {
        std::thread::sleep(Duration::from_millis(config.load_ms));
        Self::new(config, cache_keys, shared)
    }

    /// The simulated encodings of `key`: `encoding_kib` KiB that only that key gives.
    fn encodings(&self, key: &str) -> Vec<u8> {
        let seed: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        seed.iter()
            .copied()
            .cycle()
            .take(self.config.encoding_kib as usize * 1024)
            .collect()
    }

    /// The encodings of `key` from shared storage, if published there and intact.
    fn fetch(&self, key: &str) -> bool {
        let Some(shared) = &self.shared else {
            return false;
        };
        match shared.fetch(key) {
            Fetched::Found(bytes) if bytes[..] == self.encodings(key)[..] => true,
            Fetched::Found(_) => {
                shared.unusable(key, "not the bytes of this key");
                false
            }
            Fetched::Missing | Fetched::Failed => false,
        }
    }

    /// How a message's jobs run (see `Engine::runs`): each group of compatible jobs together when
    /// a batch step gains something (`batch_step_cost` < 1), else each job alone.
    pub fn runs(&self, jobs: &[&EngineJob]) -> Vec<Vec<usize>> {
        let together = groups(jobs, Shape::of);
        if self.config.batch_step_cost < 1.0 {
            return together;
        }
        together.into_iter().flatten().map(|i| vec![i]).collect()
    }

    /// Runs a batch: compatible jobs together, the groups one after another. One result per job.
    pub fn run_batch(
        &mut self,
        jobs: &[&EngineJob],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Vec<Result<EngineOutput, EngineError>> {
        let mut runs: Vec<Run> = jobs
            .iter()
            .map(|job| Run {
                error: self.refuse(job).err(),
                ..Run::default()
            })
            .collect();
        if let Some(injected) = jobs.iter().position(|job| self.fails_the_device(job)) {
            // Like a real device failure, it takes the whole batch down.
            let reported = sleep_unless(self.config.step_ms as f64, || {
                jobs[injected].cancel.requested()
            });
            if reported.is_ok() {
                progress(injected, Progress { step: 1, total: 1 });
            }
            let lost = EngineError::DeviceLost(
                "injected by engine.test_pattern.device_failure_prompt".into(),
            );
            return jobs.iter().map(|_| Err(lost.clone())).collect();
        }
        let live: Vec<usize> = (0..jobs.len()).filter(|&i| runs[i].live()).collect();
        let members: Vec<&EngineJob> = live.iter().map(|&i| jobs[i]).collect();
        for group in groups(&members, Shape::of) {
            let group: Vec<usize> = group.into_iter().map(|k| live[k]).collect();
            self.run_group(jobs, &group, &mut runs, progress);
        }
        runs.into_iter()
            .map(|run| match run.error {
                Some(e) => Err(e),
                None => Ok(EngineOutput {
                    images: run.images.into_iter().map(OutputImage::from).collect(),
                    seeds: run.seeds,
                    timings: run.timings,
                    encode_cache: run.encode_cache,
                    files: Vec::new(),
                }),
            })
            .collect()
    }

    /// Why this engine cannot run the job at all, if it cannot.
    fn refuse(&self, job: &EngineJob) -> Result<(), EngineError> {
        match &job.task {
            Task::Generate(g) => {
                let fetched = job.checkpoint.as_ref().is_some_and(|c| {
                    self.config.catalogue_checkpoints > 0 && g.checkpoint.as_ref() == Some(&c.name)
                });
                if let Some(name) = &g.checkpoint
                    && !self.config.checkpoints.contains(name)
                    && !fetched
                {
                    return Err(EngineError::NoCheckpoint(name.clone()));
                }
                g.seed.map(drop).ok_or_else(|| {
                    EngineError::InvalidInput("generate without a resolved seed".into())
                })
            }
            Task::Edit(_) | Task::Upscale(_) => match job.inputs.first() {
                Some(_) => Ok(()),
                None => Err(EngineError::InvalidInput(format!(
                    "{} without an input image",
                    job.task.kind_name()
                ))),
            },
        }
    }

    fn fails_the_device(&self, job: &EngineJob) -> bool {
        let Task::Generate(g) = &job.task else {
            return false;
        };
        self.config.device_failure_prompt.as_deref() == Some(g.prompt.as_str())
    }

    /// One group of compatible jobs (indices into `jobs`): encode (edits, on a miss), then each
    /// round of images denoised together and decoded.
    fn run_group(
        &mut self,
        jobs: &[&EngineJob],
        group: &[usize],
        runs: &mut [Run],
        progress: &mut dyn FnMut(usize, Progress),
    ) {
        if let Task::Upscale(_) = jobs[group[0]].task {
            for &i in group {
                if let Err(e) = self.upscale(jobs[i], &mut runs[i], &mut |p| progress(i, p)) {
                    runs[i].error = Some(e);
                }
            }
            return;
        }
        if let Task::Edit(_) = jobs[group[0]].task
            && let Err(e) = self.encode(jobs, group, runs)
        {
            for &i in group {
                let own = jobs[i].cancel.requested();
                runs[i].error = Some(match (&e, own) {
                    (EngineError::Cancelled(_), Some(reason)) => EngineError::Cancelled(reason),
                    _ => e.clone(),
                });
            }
            return;
        }
        let images = |job: &EngineJob| match &job.task {
            Task::Generate(g) => g.count,
            Task::Edit(_) | Task::Upscale(_) => 1,
        };
        let rounds = group.iter().map(|&i| images(jobs[i])).max().unwrap_or(0);
        for round in 0..rounds {
            let mut active: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&i| runs[i].live() && images(jobs[i]) > round)
                .collect();
            let (steps, step_ms) = match &jobs[group[0]].task {
                Task::Generate(g) => (g.steps, self.config.step_ms),
                Task::Edit(e) => (
                    e.steps,
                    self.config.edit_step_ms.unwrap_or(self.config.step_ms),
                ),
                Task::Upscale(_) => (1, self.config.step_ms),
            };
            let step_ms = step_ms as f64 * self.area_factor(jobs[group[0]]);
            for step in 1..=steps {
                // A job cancelled on its own leaves the batch between steps.
                active.retain(|&i| match jobs[i].cancel.check() {
                    Ok(()) => true,
                    Err(e) => {
                        runs[i].error = Some(e);
                        false
                    }
                });
                if active.is_empty() {
                    break;
                }
                let n = active.len() as f64;
                let cost = step_cost_ms(step_ms, active.len(), self.config.batch_step_cost);
                let started = Instant::now();
                // Stops early only when every job in it is cancelled; they leave at the next step.
                if sleep_unless(cost, || {
                    all_cancelled(active.iter().map(|&i| &jobs[i].cancel))
                })
                .is_ok()
                {
                    for &i in &active {
                        progress(i, Progress { step, total: steps });
                    }
                }
                let share = started.elapsed().as_secs_f64() / n;
                for &i in &active {
                    runs[i].timings.add("denoise", share);
                }
            }
            for &i in &active {
                if let Err(e) = self.decode(jobs[i], round, &mut runs[i]) {
                    runs[i].error = Some(e);
                }
            }
        }
    }

    /// The group's inputs (all the same) from the cache, else from shared storage, else encoded
    /// once for all of them (and published): the first job not cancelled reports the time and the
    /// miss (or the fetch), the others a hit.
    fn encode(
        &mut self,
        jobs: &[&EngineJob],
        group: &[usize],
        runs: &mut [Run],
    ) -> Result<(), EngineError> {
        let key = cache_key(jobs[group[0]]);
        let mut encoder = None;
        if !self.cache.contains(&key) {
            let started = Instant::now();
            let lookup = if self.fetch(&key) {
                CacheLookup::Fetched
            } else {
                sleep_unless(self.config.encode_ms as f64, || {
                    all_cancelled(group.iter().map(|&i| &jobs[i].cancel))
                })?;
                if let Some(shared) = &self.shared {
                    shared.publish(&key, self.encodings(&key));
                }
                CacheLookup::Miss
            };
            let first = group
                .iter()
                .copied()
                .find(|&i| jobs[i].cancel.requested().is_none())
                .unwrap_or(group[0]);
            runs[first]
                .timings
                .add(lookup.stage(), started.elapsed().as_secs_f64());
            self.cache.insert(
                key.clone(),
                (),
                1,
                jobs[first].task.affinity_key().as_deref(),
            );
            encoder = Some((first, lookup));
        }
        for &i in group {
            self.cache.get(&key, jobs[i].task.affinity_key().as_deref());
            runs[i].encode_cache = Some(match encoder {
                Some((by, lookup)) if by == i => lookup,
                Some(_) | None => CacheLookup::Hit,
            });
        }
        Ok(())
    }

    /// What the job's output area multiplies its step and decode sleeps by (`area_scaling`).
    fn area_factor(&self, job: &EngineJob) -> f64 {
        if self.config.area_scaling == 0.0 {
            return 1.0;
        }
        (output_pixels(job) / f64::from(1u32 << 20)).powf(self.config.area_scaling)
    }

    /// Decodes image `n` of a job.
    fn decode(&self, job: &EngineJob, n: u32, run: &mut Run) -> Result<(), EngineError> {
        let started = Instant::now();
        sleep_unless(self.config.decode_ms as f64 * self.area_factor(job), || {
            job.cancel.requested()
        })?;
        match &job.task {
            Task::Generate(g) => {
                run.images.push(DynamicImage::ImageRgb8(pattern(
                    g.width,
                    g.height,
                    &fingerprint(&job.task, n),
                )));
                run.seeds.push(g.seed.map(|s| s + u64::from(n)));
            }
            Task::Edit(e) => {
                let input = &job.inputs[0].image;
                run.images
                    .push(DynamicImage::ImageRgb8(edited(input, e, &job.task)));
                run.seeds.push(e.seed);
            }
            Task::Upscale(_) => {}
        }
        run.timings.add("decode", started.elapsed().as_secs_f64());
        Ok(())
    }

    fn upscale(
        &self,
        job: &EngineJob,
        run: &mut Run,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), EngineError> {
        let Task::Upscale(u) = &job.task else {
            return Ok(());
        };
        let input = &job.inputs[0].image;
        let (w, h) = (input.width() * u.scale, input.height() * u.scale);
        let started = Instant::now();
        sleep_unless(self.config.step_ms as f64 * self.area_factor(job), || {
            job.cancel.requested()
        })?;
        progress(Progress { step: 1, total: 1 });
        let mut out = image::imageops::resize(input, w, h, image::imageops::FilterType::Triangle);
        // Mark tile seams, so tile size and overlap show in the image.
        // (Without a tile in the job, the Real-ESRGAN engine's default tiling, 1024 / 16.)
        let (tile, overlap) = (u.tile.unwrap_or(1024), u.tile_overlap.unwrap_or(16));
        let step = (tile * u.scale).max(1);
        let fp = fingerprint(&job.task, 0);
        for (x, y, px) in out.enumerate_pixels_mut() {
            if x % step < overlap.min(2) || y % step < overlap.min(2) {
                *px = Rgb([fp[0], fp[1], fp[2]]);
            }
        }
        run.images.push(DynamicImage::ImageRgb8(out));
        run.seeds.push(None);
        run.timings.add("upscale", started.elapsed().as_secs_f64());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::job::tests::{edit, job};
    use vnfarm_proto::GenerateSpec;

    fn generate(seed: u64, prompt: &str) -> Task {
        Task::Generate(GenerateSpec {
            prompt: prompt.into(),
            negative_prompt: String::new(),
            width: 256,
            height: 256,
            steps: 2,
            cfg: 4.5,
            sampler: Sampler::Euler,
            seed: Some(seed),
            count: 2,
            checkpoint: None,
            loras: Vec::new(),
        })
    }

    fn engine(config: TestPatternConfig) -> (TestPatternEngine, AdvertisedKeys) {
        let keys = AdvertisedKeys::default();
        (TestPatternEngine::new(config, keys.clone(), None), keys)
    }

    fn instant() -> TestPatternConfig {
        TestPatternConfig {
            step_ms: 0,
            encode_ms: 0,
            decode_ms: 0,
            ..TestPatternConfig::default()
        }
    }

    fn run(task: Task) -> Vec<OutputImage> {
        let (mut engine, _) = engine(instant());
        let mut steps = Vec::new();
        let mut out = engine.run_batch(&[&job(task)], &mut |_, p| steps.push(p));
        assert_eq!(
            steps.len(),
            4,
            "two images of two steps each report four steps"
        );
        out.pop().unwrap().unwrap().images
    }

    /// Runs a batch, returning each job's result and progress.
    fn run_batch(
        engine: &mut TestPatternEngine,
        jobs: &[EngineJob],
    ) -> (Vec<Result<EngineOutput, EngineError>>, Vec<Vec<Progress>>) {
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let mut progress = vec![Vec::new(); jobs.len()];
        let results = engine.run_batch(&refs, &mut |i, p| progress[i].push(p));
        (results, progress)
    }

    fn timing(out: &Result<EngineOutput, EngineError>, stage: &str) -> Option<f64> {
        out.as_ref().unwrap().timings.0.get(stage).copied()
    }

    #[test]
    fn deterministic_and_sensitive_to_every_input() {
        let a = run(generate(1, "cat"));
        assert_eq!(a, run(generate(1, "cat")));
        assert_ne!(a, run(generate(2, "cat")));
        assert_ne!(a, run(generate(1, "dog")));
        assert_ne!(a[0], a[1], "images of one job differ");
    }

    #[test]
    fn batching_never_changes_an_image() {
        let (mut e, _) = engine(instant());
        let jobs = [job(generate(1, "cat")), job(generate(5, "dog"))];
        let (results, progress) = run_batch(&mut e, &jobs);
        assert_eq!(results[0].as_ref().unwrap().images, run(generate(1, "cat")));
        assert_eq!(results[1].as_ref().unwrap().images, run(generate(5, "dog")));
        let seeds: Vec<_> = results
            .iter()
            .map(|r| r.as_ref().unwrap().seeds.clone())
            .collect();
        assert_eq!(seeds, [vec![Some(1), Some(2)], vec![Some(5), Some(6)]]);
        assert!(progress.iter().all(|p| p.len() == 4), "{progress:?}");
    }

    #[test]
    fn cancellation_stops_between_steps() {
        let (mut e, _) = engine(TestPatternConfig {
            step_ms: 1,
            ..instant()
        });
        let job = job(generate(1, "x"));
        job.cancel.request(CancelReason::User);
        let (mut results, progress) = run_batch(&mut e, std::slice::from_ref(&job));
        assert!(matches!(
            results.pop().unwrap(),
            Err(EngineError::Cancelled(CancelReason::User))
        ));
        assert!(progress[0].is_empty());
    }

    #[test]
    fn a_job_cancelled_in_a_batch_leaves_it_and_the_others_finish() {
        let (mut e, _) = engine(TestPatternConfig {
            step_ms: 1,
            ..instant()
        });
        let jobs = [edit("inputs/a.png", "smile"), edit("inputs/a.png", "frown")];
        jobs[1].cancel.request(CancelReason::User);
        let (results, progress) = run_batch(&mut e, &jobs);
        assert!(results[0].is_ok());
        assert!(matches!(
            results[1],
            Err(EngineError::Cancelled(CancelReason::User))
        ));
        assert_eq!(progress[0].len(), 4);
        assert!(progress[1].is_empty());
        // The encoding went to the job that finished, so counting encodes from completions works.
        assert!(timing(&results[0], "encode").is_some());
    }

    #[test]
    fn a_batch_of_the_same_input_encodes_once_and_a_later_one_not_at_all() {
        let (mut e, keys) = engine(TestPatternConfig {
            encode_ms: 20,
            ..instant()
        });
        let batch = [
            edit("inputs/a.png", "smile"),
            edit("inputs/a.png", "frown"),
            edit("inputs/b.png", "wave"),
        ];
        let (results, _) = run_batch(&mut e, &batch);
        let lookups: Vec<_> = results
            .iter()
            .map(|r| r.as_ref().unwrap().encode_cache)
            .collect();
        assert_eq!(
            lookups,
            [
                Some(CacheLookup::Miss),
                Some(CacheLookup::Hit),
                Some(CacheLookup::Miss)
            ]
        );
        assert!(timing(&results[0], "encode").unwrap() >= 0.02);
        assert_eq!(
            timing(&results[1], "encode"),
            None,
            "only the encoder reports it"
        );
        assert_eq!(
            keys.get(),
            [
                "qwen-edit:stored:inputs/a.png",
                "qwen-edit:stored:inputs/b.png"
            ]
        );

        let (again, _) = run_batch(&mut e, &[edit("inputs/a.png", "laugh")]);
        assert_eq!(
            again[0].as_ref().unwrap().encode_cache,
            Some(CacheLookup::Hit)
        );
        assert_eq!(timing(&again[0], "encode"), None);
        assert_eq!(
            keys.get(),
            [
                "qwen-edit:stored:inputs/b.png",
                "qwen-edit:stored:inputs/a.png"
            ],
            "most recently used last"
        );
    }

    #[test]
    fn the_cache_forgets_the_least_recently_used_input() {
        let (mut e, keys) = engine(TestPatternConfig {
            encode_cache_entries: 2,
            ..instant()
        });
        for input in ["inputs/a.png", "inputs/b.png", "inputs/c.png"] {
            run_batch(&mut e, &[edit(input, "x")]);
        }
        assert_eq!(
            keys.get(),
            [
                "qwen-edit:stored:inputs/b.png",
                "qwen-edit:stored:inputs/c.png"
            ]
        );
        let (results, _) = run_batch(&mut e, &[edit("inputs/a.png", "x")]);
        assert_eq!(
            results[0].as_ref().unwrap().encode_cache,
            Some(CacheLookup::Miss)
        );
    }

    #[test]
    fn a_step_of_n_jobs_costs_one_step_plus_the_extra_jobs_share() {
        assert_eq!(step_cost_ms(40.0, 1, 0.25), 40.0);
        assert_eq!(step_cost_ms(40.0, 4, 0.25), 70.0);
        assert_eq!(step_cost_ms(40.0, 4, 1.0), 160.0, "no gain: n steps");
        assert_eq!(step_cost_ms(40.0, 8, 0.0), 40.0, "free riders");
        assert_eq!(step_cost_ms(40.0, 0, 0.5), 40.0);
    }

    // The sleeps below are what the engine simulates, so their sums are lower bounds; the upper
    // bounds leave a loaded machine three times the expected time.
    #[test]
    fn a_batch_denoises_together_and_splits_the_time_across_its_jobs() {
        // Four edits of four 50 ms steps: 800 ms one after another, (1 + 3 × 0.25) × 200 = 350 ms
        // together. (Generates' steps would take a second each.)
        let (mut e, _) = engine(TestPatternConfig {
            step_ms: 1000,
            edit_step_ms: Some(50),
            batch_step_cost: 0.25,
            ..instant()
        });
        let jobs: Vec<EngineJob> = ["a", "b", "c", "d"]
            .iter()
            .map(|i| edit("inputs/same.png", i))
            .collect();
        let started = Instant::now();
        let (results, _) = run_batch(&mut e, &jobs);
        let wall = started.elapsed().as_secs_f64();
        assert!((0.35..0.8).contains(&wall), "{wall}");
        let shares: Vec<f64> = results
            .iter()
            .map(|r| timing(r, "denoise").unwrap())
            .collect();
        let total: f64 = shares.iter().sum();
        assert!(total >= 0.35 && total <= wall, "{shares:?}");
        for share in &shares {
            assert!((share - total / 4.0).abs() < 1e-9, "{shares:?}");
        }
    }

    #[test]
    fn incompatible_jobs_run_one_after_another() {
        let (mut e, _) = engine(TestPatternConfig {
            step_ms: 50,
            batch_step_cost: 0.0,
            ..instant()
        });
        // Different inputs: no shared step even at zero cost (2 × 4 × 50 ms).
        let started = Instant::now();
        run_batch(
            &mut e,
            &[edit("inputs/a.png", "x"), edit("inputs/b.png", "x")],
        );
        assert!(started.elapsed() >= Duration::from_millis(400));
        // The same input: 4 × 50 ms for both.
        let started = Instant::now();
        run_batch(
            &mut e,
            &[edit("inputs/c.png", "x"), edit("inputs/c.png", "y")],
        );
        assert!(started.elapsed() < Duration::from_millis(400));
    }

    #[test]
    fn a_job_is_refused_alone() {
        let (mut e, _) = engine(TestPatternConfig {
            checkpoints: vec!["nova".into()],
            ..instant()
        });
        let named = |name: &str| {
            let Task::Generate(mut g) = generate(1, "x") else {
                unreachable!()
            };
            g.checkpoint = Some(name.into());
            job(Task::Generate(g))
        };
        let jobs = [named("nova"), named("pony"), job(generate(1, "y"))];
        let (results, _) = run_batch(&mut e, &jobs);
        assert!(results[0].is_ok());
        assert!(matches!(&results[1], Err(EngineError::NoCheckpoint(c)) if c == "pony"));
        assert!(
            results[2].is_ok(),
            "a job naming no checkpoint runs anywhere"
        );
    }

    #[test]
    fn an_injected_device_failure_takes_the_batch_down() {
        let (mut e, _) = engine(TestPatternConfig {
            device_failure_prompt: Some("boom".into()),
            ..instant()
        });
        let jobs = [job(generate(1, "fine")), job(generate(1, "boom"))];
        let (results, _) = run_batch(&mut e, &jobs);
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(EngineError::DeviceLost(_))))
        );
    }

    #[test]
    fn a_simulated_gpu_is_reported_only_when_configured() {
        assert_eq!(TestPatternConfig::default().gpu_memory(), None);
        let config = TestPatternConfig {
            gpu_memory_mib: Some(24_576),
            gpu_memory_used_mib: 8_192,
            ..TestPatternConfig::default()
        };
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(
            config.gpu_memory(),
            Some(GpuMemory {
                total_bytes: 24_576 << 20,
                free_bytes: 16_384 << 20,
                reserved_bytes: None,
            })
        );
        let overfull = TestPatternConfig {
            gpu_memory_used_mib: 30_000,
            ..config
        };
        assert!(
            overfull
                .validate()
                .unwrap_err()
                .contains("gpu_memory_used_mib")
        );
    }
}
