//! The test-pattern engine: deterministic CPU images for exercising the job system without libtorch or
//! weights. Every field of the task and the seed change the image (the spec is hashed into it), and
//! each stage sleeps for a configurable time so scheduling can be measured against realistic shapes:
//! a generate "denoises" for `steps × step_ms`, an edit first "encodes" its input, every job "decodes".
//!
//! It is a fixture, never a stand-in for a model.

use std::time::{Duration, Instant};

use image::{DynamicImage, Rgb, RgbImage};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use vnfarm_proto::{StageTimings, Task};

use super::{Cancel, EngineError, EngineJob, EngineOutput, Progress};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TestPatternConfig {
    /// Sleep per denoising step, in milliseconds.
    #[serde(default = "default_step_ms")]
    pub step_ms: u64,
    /// Sleep for encoding an edit's input.
    #[serde(default = "default_encode_ms")]
    pub encode_ms: u64,
    /// Sleep for decoding each output image.
    #[serde(default = "default_decode_ms")]
    pub decode_ms: u64,
    /// Fault injection for tests of the job system: a generate with exactly this prompt fails as a
    /// device failure would (the job is given back, the worker exits with an error).
    #[serde(default)]
    pub device_failure_prompt: Option<String>,
}

fn default_step_ms() -> u64 {
    20
}
fn default_encode_ms() -> u64 {
    30
}
fn default_decode_ms() -> u64 {
    30
}

impl Default for TestPatternConfig {
    fn default() -> Self {
        Self {
            step_ms: default_step_ms(),
            encode_ms: default_encode_ms(),
            decode_ms: default_decode_ms(),
            device_failure_prompt: None,
        }
    }
}

impl TestPatternConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (name, ms) in [
            ("step_ms", self.step_ms),
            ("encode_ms", self.encode_ms),
            ("decode_ms", self.decode_ms),
        ] {
            if ms > 60_000 {
                return Err(format!("engine.test_pattern.{name}: at most 60000"));
            }
        }
        Ok(())
    }
}

pub struct TestPatternEngine {
    config: TestPatternConfig,
}

/// 32 bytes that depend on every field of the task and on the image index.
fn fingerprint(task: &Task, index: u32) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(task).expect("tasks serialize to JSON"));
    h.update(index.to_le_bytes());
    h.finalize().into()
}

fn sleep_checked(ms: u64, cancel: &Cancel) -> Result<(), EngineError> {
    // Sleep in slices so that cancellation is noticed within ~10 ms.
    let deadline = Instant::now() + Duration::from_millis(ms);
    loop {
        cancel.check()?;
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

impl TestPatternEngine {
    pub fn new(config: TestPatternConfig) -> Self {
        Self { config }
    }

    fn denoise(
        &self,
        steps: u32,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<(), EngineError> {
        for step in 1..=steps {
            sleep_checked(self.config.step_ms, cancel)?;
            progress(Progress { step, total: steps });
        }
        Ok(())
    }

    pub fn run(
        &mut self,
        job: EngineJob,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<EngineOutput, EngineError> {
        let mut timings = StageTimings::default();
        let mut images = Vec::new();
        let mut seeds = Vec::new();
        match &job.task {
            Task::Generate(g) => {
                if self.config.device_failure_prompt.as_deref() == Some(g.prompt.as_str()) {
                    self.denoise(1, progress, cancel)?;
                    return Err(EngineError::DeviceLost(
                        "injected by engine.test_pattern.device_failure_prompt".into(),
                    ));
                }
                let seed = g.seed.ok_or_else(|| {
                    EngineError::InvalidInput("generate without a resolved seed".into())
                })?;
                for n in 0..g.count {
                    let started = Instant::now();
                    self.denoise(g.steps, progress, cancel)?;
                    timings.add("denoise", started.elapsed().as_secs_f64());
                    let started = Instant::now();
                    sleep_checked(self.config.decode_ms, cancel)?;
                    images.push(DynamicImage::ImageRgb8(pattern(
                        g.width,
                        g.height,
                        &fingerprint(&job.task, n),
                    )));
                    timings.add("decode", started.elapsed().as_secs_f64());
                    seeds.push(Some(seed + u64::from(n)));
                }
            }
            Task::Edit(e) => {
                let input = job.inputs.first().map(|i| &i.image).ok_or_else(|| {
                    EngineError::InvalidInput("edit without an input image".into())
                })?;
                let started = Instant::now();
                sleep_checked(self.config.encode_ms, cancel)?;
                timings.add("encode", started.elapsed().as_secs_f64());
                let started = Instant::now();
                self.denoise(e.steps, progress, cancel)?;
                timings.add("denoise", started.elapsed().as_secs_f64());
                let started = Instant::now();
                sleep_checked(self.config.decode_ms, cancel)?;
                // The requested output size, else the first input's (the model's default differs:
                // this is a fixture for the job system, not a model).
                let (w, h) = e
                    .width
                    .zip(e.height)
                    .unwrap_or((input.width(), input.height()));
                let overlay = pattern(w, h, &fingerprint(&job.task, 0));
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
                images.push(DynamicImage::ImageRgb8(out));
                seeds.push(e.seed);
                timings.add("decode", started.elapsed().as_secs_f64());
            }
            Task::Upscale(u) => {
                let input = job.inputs.first().map(|i| &i.image).ok_or_else(|| {
                    EngineError::InvalidInput("upscale without an input image".into())
                })?;
                let (w, h) = (input.width() * u.scale, input.height() * u.scale);
                let started = Instant::now();
                self.denoise(1, progress, cancel)?;
                let mut out =
                    image::imageops::resize(input, w, h, image::imageops::FilterType::Triangle);
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
                images.push(DynamicImage::ImageRgb8(out));
                seeds.push(None);
                timings.add("upscale", started.elapsed().as_secs_f64());
            }
        }
        Ok(EngineOutput {
            images,
            seeds,
            timings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnfarm_proto::{GenerateSpec, JobId, Sampler};

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
        })
    }

    fn run(task: Task) -> Vec<DynamicImage> {
        let mut engine = TestPatternEngine::new(TestPatternConfig {
            step_ms: 0,
            encode_ms: 0,
            decode_ms: 0,
            device_failure_prompt: None,
        });
        let mut steps = Vec::new();
        let out = engine
            .run(
                EngineJob {
                    job_id: JobId::new(),
                    task,
                    inputs: Vec::new(),
                },
                &mut |p| steps.push(p),
                &Cancel::default(),
            )
            .unwrap();
        assert_eq!(
            steps.len(),
            4,
            "two images of two steps each report four steps"
        );
        out.images
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
    fn cancellation_stops_between_steps() {
        let mut engine = TestPatternEngine::new(TestPatternConfig {
            step_ms: 1,
            encode_ms: 0,
            decode_ms: 0,
            device_failure_prompt: None,
        });
        let cancel = Cancel::default();
        cancel.request(super::super::CancelReason::User);
        let r = engine.run(
            EngineJob {
                job_id: JobId::new(),
                task: generate(1, "x"),
                inputs: Vec::new(),
            },
            &mut |_| {},
            &cancel,
        );
        assert!(matches!(
            r,
            Err(EngineError::Cancelled(super::super::CancelReason::User))
        ));
    }
}
