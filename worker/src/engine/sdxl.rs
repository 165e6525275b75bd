//! The SDXL engine: `generate` jobs on [`vnfarm_models::sdxl::pipeline::SdxlPipeline`], kept warm for the
//! worker's life.
//!
//! A job's images are denoised together, at most `max_batch` per UNet forward; image `n` of a job
//! uses seed `seed + n` whatever the batching, so an image can always be reproduced alone. Progress
//! is reported after every denoising step, cancellation is checked before every step.

use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;

use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::schedulers::PredictionType;
use vnfarm_models::schedulers::Sampler;
use vnfarm_models::sdxl::pipeline::{
    ComponentConfigs, GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline,
};
use vnfarm_models::sdxl::vae::{Tiling, VaeConfig};
use vnfarm_proto::{GenerateSpec, StageTimings, Task};

use super::device::{Dtype, engine_error, open_device, parse_device, warm_up_sizes};
use super::{Cancel, EngineError, EngineJob, EngineOutput, Progress};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SdxlConfig {
    /// A single-file checkpoint (`.safetensors` with ldm key names: A1111 / CivitAI / ComfyUI) or
    /// a diffusers pipeline folder.
    pub checkpoint: PathBuf,
    /// For a single-file checkpoint that is not SDXL base-sized: a diffusers-layout folder whose
    /// `unet/`, `vae/`, `text_encoder/`, `text_encoder_2/` and `scheduler/` hold the component
    /// `config.json` files. Unset: the SDXL base configuration.
    #[serde(default)]
    pub config_dir: Option<PathBuf>,
    /// A folder with `tokenizer/` and `tokenizer_2/`. Unset: the diffusers folder's (or
    /// `config_dir`'s) own, else the CLIP tokenizer bundled with the worker.
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// `cuda`, `cuda:N` (ROCm devices are `cuda` too) or `cpu`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Precision of the text encoders and the UNet.
    #[serde(default)]
    pub dtype: Dtype,
    /// Precision of the VAE. fp16 overflows in the SDXL VAE: use bf16 or fp32.
    #[serde(default)]
    pub vae_dtype: Dtype,
    /// `sdpa` (`scaled_dot_product_attention`) or `matmul` (plain softmax(QKᵀ)V, for backends whose
    /// fused kernels fail).
    #[serde(default)]
    pub attention: AttentionImpl,
    /// Overrides the checkpoint's own flag (`v_pred` key) and the scheduler config.
    #[serde(default)]
    pub prediction_type: Option<PredictionType>,
    /// `auto` tiles the VAE when a side exceeds `vae_tile_threshold` pixels.
    #[serde(default)]
    pub vae_tiling: VaeTiling,
    /// Pixels; the VAE's own default (1024 for SDXL) when unset.
    #[serde(default)]
    pub vae_tile_threshold: Option<u32>,
    /// `[width, height]` sizes run once (one step and a decode) before the worker takes jobs.
    #[serde(default = "default_warm_up")]
    pub warm_up: Vec<[u32; 2]>,
    /// Images per UNet forward; a job with more images runs in several batches.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum VaeTiling {
    #[default]
    Auto,
    Always,
    Never,
}

fn default_device() -> String {
    "cuda".into()
}
fn default_warm_up() -> Vec<[u32; 2]> {
    vec![[1024, 1024]]
}
fn default_max_batch() -> u32 {
    4
}

impl SdxlConfig {
    pub fn validate(&self) -> Result<(), String> {
        parse_device(&self.device).map_err(|e| format!("engine.sdxl.device: {e}"))?;
        if self.vae_dtype == Dtype::Fp16 {
            return Err(
                "engine.sdxl.vae_dtype: fp16 overflows in the SDXL VAE; use bf16 or fp32".into(),
            );
        }
        if !(1..=64).contains(&self.max_batch) {
            return Err("engine.sdxl.max_batch: must be 1..=64".into());
        }
        for [w, h] in &self.warm_up {
            if *w == 0 || *h == 0 || w % 8 != 0 || h % 8 != 0 || *w > 4096 || *h > 4096 {
                return Err(format!(
                    "engine.sdxl.warm_up: {w}x{h} is not a size the model can run \
                     (multiples of 8, at most 4096)"
                ));
            }
        }
        Ok(())
    }
}

pub struct SdxlEngine {
    pipeline: SdxlPipeline,
    max_batch: usize,
}

impl SdxlEngine {
    /// Loads the checkpoint onto the device and warms up at every configured size. Any failure
    /// (missing file, missing or misshapen tensor, no device) is an error naming what is wrong.
    pub fn load(config: &SdxlConfig) -> anyhow::Result<Self> {
        let device = open_device(&config.device, "engine.sdxl.device")?;
        let checkpoint = &config.checkpoint;
        let source = if checkpoint.is_dir() {
            ModelSource::DiffusersFolder(checkpoint.clone())
        } else if checkpoint.is_file() {
            ModelSource::SingleFile(checkpoint.clone())
        } else {
            anyhow::bail!(
                "engine.sdxl.checkpoint: {} is neither a .safetensors file nor a diffusers folder",
                checkpoint.display()
            );
        };
        let mut pc = PipelineConfig::new(source, device);
        pc.dtype = config.dtype.kind();
        pc.vae_dtype = config.vae_dtype.kind();
        pc.attention = config.attention;
        pc.prediction_type = config.prediction_type;
        pc.vae_tiling = match config.vae_tiling {
            VaeTiling::Auto => Tiling::Auto,
            VaeTiling::Always => Tiling::Always,
            VaeTiling::Never => Tiling::Never,
        };
        // Component configs: `config_dir`'s, else a diffusers folder's own, else (single file) the
        // SDXL base presets inside the pipeline.
        let config_dir = config.config_dir.as_ref();
        if let Some(dir) = config_dir.or(checkpoint.is_dir().then_some(checkpoint)) {
            pc.components = ComponentConfigs::default().fill_from_dir(dir)?;
        }
        if let Some(px) = config.vae_tile_threshold {
            let mut vae = pc.components.vae.take().unwrap_or_else(VaeConfig::sdxl);
            vae.tiling_threshold = i64::from(px);
            pc.components.vae = Some(vae);
        }
        pc.tokenizer_dir = config.tokenizer_dir.clone().or_else(|| {
            config
                .config_dir
                .clone()
                .filter(|d| d.join("tokenizer").is_dir())
        });
        let started = Instant::now();
        let pipeline = SdxlPipeline::load(&pc)
            .map_err(|e| anyhow::anyhow!("loading SDXL from {}: {e}", checkpoint.display()))?;
        tracing::info!(
            checkpoint = %checkpoint.display(),
            ?device,
            prediction = ?pipeline.info().prediction_type,
            seconds = started.elapsed().as_secs_f64(),
            "SDXL loaded"
        );
        warm_up_sizes("SDXL", &config.warm_up, |w, h| pipeline.warm_up(&[(w, h)]))?;
        Ok(Self {
            pipeline,
            max_batch: config.max_batch as usize,
        })
    }

    pub fn run(
        &mut self,
        job: EngineJob,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<EngineOutput, EngineError> {
        let Task::Generate(spec) = &job.task else {
            return Err(EngineError::Unsupported(job.task.model()));
        };
        let seed = spec
            .seed
            .ok_or_else(|| EngineError::InvalidInput("generate without a resolved seed".into()))?;
        let batches = split(spec, seed, self.max_batch);
        let total = spec.steps * batches.len() as u32;
        let mut timings = StageTimings::default();
        let mut images = Vec::with_capacity(spec.count as usize);
        for (b, request) in batches.iter().enumerate() {
            let done = spec.steps * b as u32;
            let out = self
                .pipeline
                .generate_batch(
                    std::slice::from_ref(request),
                    &mut |step, _| {
                        progress(Progress {
                            step: done + step as u32,
                            total,
                        })
                    },
                    &|| cancel.requested().is_some(),
                )
                .map_err(|e| engine_error(e, cancel))?;
            timings.add("encode_prompt", out.times.encode_prompt);
            timings.add("denoise", out.times.denoise);
            timings.add("decode", out.times.decode);
            images.extend(
                out.images
                    .into_iter()
                    .flatten()
                    .map(image::DynamicImage::ImageRgb8),
            );
        }
        let seeds = (0..u64::from(spec.count))
            .map(|n| Some(seed.wrapping_add(n)))
            .collect();
        Ok(EngineOutput {
            images,
            seeds,
            timings,
        })
    }
}

/// The job's images as requests of at most `max_batch` images; image `n` keeps seed `seed + n`.
fn split(spec: &GenerateSpec, seed: u64, max_batch: usize) -> Vec<GenerateRequest> {
    let count = spec.count as usize;
    (0..count)
        .step_by(max_batch)
        .map(|first| GenerateRequest {
            prompt: spec.prompt.clone(),
            negative_prompt: spec.negative_prompt.clone(),
            width: spec.width,
            height: spec.height,
            steps: spec.steps as usize,
            cfg: f64::from(spec.cfg),
            sampler: match spec.sampler {
                vnfarm_proto::Sampler::Euler => Sampler::Euler,
                vnfarm_proto::Sampler::EulerAncestral => Sampler::EulerAncestral,
                vnfarm_proto::Sampler::DpmppTwoMKarras => Sampler::DpmPp2mKarras,
            },
            seed: seed.wrapping_add(first as u64),
            count: max_batch.min(count - first),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(count: u32) -> GenerateSpec {
        GenerateSpec {
            prompt: "p".into(),
            negative_prompt: String::new(),
            width: 64,
            height: 64,
            steps: 3,
            cfg: 4.5,
            sampler: vnfarm_proto::Sampler::EulerAncestral,
            seed: Some(10),
            count,
        }
    }

    #[test]
    fn a_job_splits_into_batches_that_keep_each_images_seed() {
        let parts = split(&spec(10), 10, 4);
        let shape: Vec<(u64, usize)> = parts.iter().map(|r| (r.seed, r.count)).collect();
        assert_eq!(shape, [(10, 4), (14, 4), (18, 2)]);
        assert!(parts.iter().all(|r| r.sampler == Sampler::EulerAncestral));
        assert_eq!(split(&spec(1), 10, 4).len(), 1);
    }
}
