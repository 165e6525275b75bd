//! The SDXL engine: `generate` jobs on [`vnfarm_models::sdxl::pipeline::SdxlPipeline`], kept warm for the
//! worker's life.
//!
//! A job's images are denoised together, at most `max_batch` per UNet forward; image `n` of a job
//! uses seed `seed + n` whatever the batching, so an image can always be reproduced alone. Progress
//! is reported after every denoising step, cancellation is checked before every step.

use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;
use tch::{Device, Kind};
use vnfarm_models::error::GenerateError;
use vnfarm_models::schedulers::PredictionType;
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::sdxl::pipeline::{
    ComponentConfigs, GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline,
};
use vnfarm_models::schedulers::Sampler;
use vnfarm_models::sdxl::vae::{Tiling, VaeConfig};
use vnfarm_proto::{GenerateSpec, StageTimings, Task};

use super::{Cancel, CancelReason, EngineError, EngineJob, EngineOutput, Progress};

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
pub enum Dtype {
    Fp32,
    Fp16,
    #[default]
    Bf16,
}

impl Dtype {
    fn kind(self) -> Kind {
        match self {
            Dtype::Fp32 => Kind::Float,
            Dtype::Fp16 => Kind::Half,
            Dtype::Bf16 => Kind::BFloat16,
        }
    }
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

/// `cuda`, `cuda:N` or `cpu`, without touching the device.
fn parse_device(name: &str) -> Result<Device, String> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("`{other}` is not `cuda`, `cuda:N` or `cpu`")),
    }
}

/// The device, checked against what libtorch sees.
fn open_device(name: &str) -> anyhow::Result<Device> {
    let device = parse_device(name).map_err(anyhow::Error::msg)?;
    if let Device::Cuda(i) = device {
        let count = tch::Cuda::device_count();
        anyhow::ensure!(
            count > 0,
            "engine.sdxl.device is `{name}` but libtorch sees no CUDA/ROCm device \
             (tch::Cuda::is_available() is false); set engine.sdxl.device = \"cpu\" to run on the CPU"
        );
        anyhow::ensure!(
            (i as i64) < count,
            "engine.sdxl.device is `{name}` but libtorch sees {count} device(s)"
        );
    }
    Ok(device)
}

pub struct SdxlEngine {
    pipeline: SdxlPipeline,
    max_batch: usize,
}

impl SdxlEngine {
    /// Loads the checkpoint onto the device and warms up at every configured size. Any failure
    /// (missing file, missing or misshapen tensor, no device) is an error naming what is wrong.
    pub fn load(config: &SdxlConfig) -> anyhow::Result<Self> {
        let device = open_device(&config.device)?;
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
        for [w, h] in &config.warm_up {
            let started = Instant::now();
            pipeline
                .warm_up(&[(*w, *h)])
                .map_err(|e| anyhow::anyhow!("SDXL warm-up at {w}x{h}: {e}"))?;
            tracing::info!(
                width = w,
                height = h,
                seconds = started.elapsed().as_secs_f64(),
                "SDXL warmed up"
            );
        }
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
            images.extend(out.images.into_iter().flatten());
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

fn engine_error(e: GenerateError, cancel: &Cancel) -> EngineError {
    match e {
        GenerateError::Cancelled => {
            EngineError::Cancelled(cancel.requested().unwrap_or(CancelReason::User))
        }
        GenerateError::InvalidRequest(m) | GenerateError::Tokenizer(m) => {
            EngineError::InvalidInput(m)
        }
        GenerateError::Backend(m) if is_out_of_memory(&m) => EngineError::OutOfMemory(m),
        GenerateError::Backend(m) if is_device_failure(&m) => EngineError::DeviceLost(m),
        GenerateError::Torch(e) if is_out_of_memory(&e.to_string()) => {
            EngineError::OutOfMemory(e.to_string())
        }
        GenerateError::Backend(m) => EngineError::Failed(m),
        GenerateError::Torch(e) => EngineError::Failed(e.to_string()),
    }
}

/// Errors after which the device context cannot be trusted: CUDA/HIP runtime errors ("CUDA error: an
/// illegal memory access was encountered", "HIP error: …") and device-side asserts. Out-of-memory
/// errors are not among them: the allocator recovers from those.
fn is_device_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    !is_out_of_memory(message)
        && (m.contains("cuda error") || m.contains("hip error") || m.contains("device-side assert"))
}

/// libtorch's allocator messages: "CUDA out of memory", "HIP out of memory", CPU "DefaultCPUAllocator:
/// not enough memory".
fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("out of memory") || m.contains("not enough memory")
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

    #[test]
    fn devices_parse_without_touching_hardware() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(parse_device("cuda:3"), Ok(Device::Cuda(3)));
        assert!(parse_device("gpu").is_err());
        assert!(parse_device("cuda:x").is_err());
    }

    #[test]
    fn out_of_memory_is_told_apart() {
        let cancel = Cancel::default();
        assert!(matches!(
            engine_error(
                GenerateError::Backend("CUDA out of memory. Tried to allocate 2.00 GiB".into()),
                &cancel
            ),
            EngineError::OutOfMemory(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend(
                    "CUDA error: an illegal memory access was encountered".into()
                ),
                &cancel
            ),
            EngineError::DeviceLost(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend("device-side assert triggered".into()),
                &cancel
            ),
            EngineError::DeviceLost(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend("expected a 4-D tensor, got 3-D".into()),
                &cancel
            ),
            EngineError::Failed(_)
        ));
        assert!(matches!(
            engine_error(GenerateError::InvalidRequest("size".into()), &cancel),
            EngineError::InvalidInput(_)
        ));
        cancel.request(CancelReason::Shutdown);
        assert!(matches!(
            engine_error(GenerateError::Cancelled, &cancel),
            EngineError::Cancelled(CancelReason::Shutdown)
        ));
    }
}
