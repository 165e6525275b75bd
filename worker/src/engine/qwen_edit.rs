//! The Qwen-Image-Edit-2509 engine: `edit` jobs on [`vnfarm_models::qwen_image::pipeline::QwenEditPipeline`],
//! kept warm for the worker's life.
//!
//! An edit's input set (one to three images) is encoded once (vision tower and VAE) and the
//! encodings are kept in an [`EncodeCache`] keyed by the inputs' sha256, bounded in bytes, least
//! recently used first out; the keys are what the worker reports in its heartbeat (`encode_cache`),
//! so the scheduler can send later edits of the same image here. Progress is reported after every
//! denoising step and cancellation is checked before every step. A job's `loras` are applied on top
//! of the load-time LoRAs (the Lightning LoRA) for that job; the next job with another set gets the
//! base restored bit for bit first, and the same set twice in a row costs nothing.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Deserialize;
use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_models::loading::weights::Fp8Mode;
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::nn::tiling::Tiling;
use vnfarm_models::qwen_image::pipeline::{
    EditRequest, EncodedInputs, QwenEditConfig, QwenEditPipeline, QwenSource,
};
use vnfarm_models::qwen2_5_vl::rope::PositionMode;
use vnfarm_models::schedulers::FlowMatchConfig;
use vnfarm_proto::{EditSpec, LoraRef, StageTimings, Task};

use super::device::{Dtype, engine_error, open_device, parse_device, warm_up_sizes};
use super::{Cancel, EngineError, EngineJob, EngineOutput, InputImage, Progress};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QwenEditEngineConfig {
    /// A diffusers folder in the layout of `Qwen/Qwen-Image-Edit-2509` (`transformer/`,
    /// `text_encoder/`, `vae/`, `tokenizer/`, `processor/`, `scheduler/`). Either this, or the three
    /// single files below.
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// ComfyUI-style single files: the transformer (`qwen_image_edit_2509_fp8_e4m3fn.safetensors`
    /// or bf16), the text encoder (`qwen_2.5_vl_7b_fp8_scaled.safetensors` or bf16) and the VAE
    /// (`qwen_image_vae.safetensors`).
    #[serde(default)]
    pub transformer: Option<PathBuf>,
    #[serde(default)]
    pub text_encoder: Option<PathBuf>,
    #[serde(default)]
    pub vae: Option<PathBuf>,
    /// For single files that are not the real model's size: a diffusers-layout folder holding the
    /// components' `config.json` files (tests use the tiny fixture).
    #[serde(default)]
    pub config_dir: Option<PathBuf>,
    /// LoRAs fused at load, e.g. the Lightning 4-step LoRA at strength 1.
    #[serde(default)]
    pub loras: Vec<LoadLora>,
    /// Where jobs' `loras` are looked up: `<lora_dir>/<name>` or `<lora_dir>/<name>.safetensors`.
    #[serde(default)]
    pub lora_dir: Option<PathBuf>,
    /// `lightning` (Qwen-Image-Lightning's flow-match shift, for the 4/8-step LoRAs) or `model`
    /// (the folder's `scheduler_config.json`, else Qwen-Image's).
    #[serde(default)]
    pub scheduler: SchedulerChoice,
    /// `cuda`, `cuda:N` (ROCm devices are `cuda` too) or `cpu`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Compute precision of the transformer and the text encoder.
    #[serde(default)]
    pub dtype: Dtype,
    #[serde(default)]
    pub vae_dtype: Dtype,
    /// `upcast`: fp8 weight files are dequantised at load (the transformer takes ~41 GB in bf16);
    /// `resident`: fp8 weights stay fp8 on the device and are dequantised per layer (~20 GB).
    #[serde(default)]
    pub fp8: Fp8Mode,
    #[serde(default)]
    pub attention: AttentionImpl,
    /// Text-encoder position ids: `mrope` (Qwen2.5-VL as trained) or `sequential` (what
    /// diffusers 0.42.1 computes with transformers ≥ 5.15; for reproducing such references).
    #[serde(default)]
    pub positions: PositionMode,
    /// Output `[width, height]` sizes run once before the worker takes jobs.
    #[serde(default = "default_warm_up")]
    pub warm_up: Vec<[u32; 2]>,
    /// Variants per transformer forward when several edits of one input run together.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Bound of the encode cache in MiB of device memory.
    #[serde(default = "default_cache_mib")]
    pub encode_cache_mib: u64,
    /// Pixels of the vision tower's and the VAE's copies of each input (diffusers' constants).
    #[serde(default = "default_condition_area")]
    pub condition_image_area: u64,
    #[serde(default = "default_vae_area")]
    pub vae_image_area: u64,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoadLora {
    pub path: PathBuf,
    #[serde(default = "one")]
    pub strength: f32,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerChoice {
    #[default]
    Lightning,
    Model,
}

fn one() -> f32 {
    1.0
}
fn default_device() -> String {
    "cuda".into()
}
fn default_warm_up() -> Vec<[u32; 2]> {
    vec![[1024, 1024]]
}
fn default_max_batch() -> u32 {
    1
}
fn default_cache_mib() -> u64 {
    2048
}
fn default_condition_area() -> u64 {
    384 * 384
}
fn default_vae_area() -> u64 {
    1024 * 1024
}

impl QwenEditEngineConfig {
    pub fn validate(&self) -> Result<(), String> {
        parse_device(&self.device).map_err(|e| format!("engine.qwen_edit.device: {e}"))?;
        let files = [&self.transformer, &self.text_encoder, &self.vae];
        match (
            &self.model_dir,
            files.iter().filter(|f| f.is_some()).count(),
        ) {
            (Some(_), 0) | (None, 3) => {}
            (Some(_), _) => {
                return Err("engine.qwen_edit: give `model_dir` or the single files \
                            (`transformer`, `text_encoder`, `vae`), not both"
                    .into());
            }
            (None, _) => {
                return Err(
                    "engine.qwen_edit: give `model_dir` (a diffusers folder) or all of \
                            `transformer`, `text_encoder` and `vae`"
                        .into(),
                );
            }
        }
        if self.vae_dtype == Dtype::Fp16 || self.dtype == Dtype::Fp16 {
            return Err(
                "engine.qwen_edit.dtype: fp16 overflows in Qwen-Image; use bf16 or fp32".into(),
            );
        }
        if !(1..=16).contains(&self.max_batch) {
            return Err("engine.qwen_edit.max_batch: must be 1..=16".into());
        }
        for [w, h] in &self.warm_up {
            if *w < 256 || *h < 256 || w % 16 != 0 || h % 16 != 0 || *w > 2048 || *h > 2048 {
                return Err(format!(
                    "engine.qwen_edit.warm_up: {w}x{h} is not an edit size \
                     (multiples of 16, 256..=2048)"
                ));
            }
        }
        for (field, area) in [
            ("condition_image_area", self.condition_image_area),
            ("vae_image_area", self.vae_image_area),
        ] {
            if !(28 * 28..=4096 * 4096).contains(&area) {
                return Err(format!(
                    "engine.qwen_edit.{field}: {area} pixels is out of range"
                ));
            }
        }
        Ok(())
    }
}

/// Encodings of input sets, least recently used first out, bounded in bytes. The key list is shared
/// with the heartbeat.
pub struct EncodeCache {
    entries: VecDeque<(String, EncodedInputs)>,
    max_bytes: usize,
    keys: Arc<Mutex<Vec<String>>>,
}

impl EncodeCache {
    pub fn new(max_bytes: usize, keys: Arc<Mutex<Vec<String>>>) -> Self {
        Self {
            entries: VecDeque::new(),
            max_bytes,
            keys,
        }
    }

    /// The cache key of an input set: the model family, then each input's sha256 in order.
    pub fn key(inputs: &[InputImage]) -> String {
        let shas: Vec<&str> = inputs.iter().map(|i| i.sha256.as_str()).collect();
        format!("qwen-edit:{}", shas.join("+"))
    }

    /// The entry for `key`, moved to the most recently used end.
    fn get(&mut self, key: &str) -> Option<&EncodedInputs> {
        let at = self.entries.iter().position(|(k, _)| k == key)?;
        let entry = self.entries.remove(at)?;
        self.entries.push_back(entry);
        self.entries.back().map(|(_, e)| e)
    }

    fn insert(&mut self, key: String, value: EncodedInputs) {
        let size = value.bytes();
        self.entries.push_back((key, value));
        let mut total: usize = self.entries.iter().map(|(_, e)| e.bytes()).sum();
        // Keep at least the newest entry even when it alone exceeds the bound: the job needs it.
        while total > self.max_bytes.max(size) && self.entries.len() > 1 {
            if let Some((_, old)) = self.entries.pop_front() {
                total -= old.bytes();
            }
        }
        self.publish();
    }

    fn publish(&self) {
        let keys = self.entries.iter().map(|(k, _)| k.clone()).collect();
        *self
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = keys;
    }
}

pub struct QwenEditEngine {
    pipeline: QwenEditPipeline,
    cache: EncodeCache,
    lora_dir: Option<PathBuf>,
}

impl QwenEditEngine {
    /// Loads the model onto the device and warms up at every configured size. Any failure (a
    /// missing or corrupt file, a missing or misshapen tensor, no device) is an error naming it.
    pub fn load(
        config: &QwenEditEngineConfig,
        cache_keys: Arc<Mutex<Vec<String>>>,
    ) -> anyhow::Result<Self> {
        let device = open_device(&config.device, "engine.qwen_edit.device")?;
        let source = match (
            &config.model_dir,
            &config.transformer,
            &config.text_encoder,
            &config.vae,
        ) {
            (Some(dir), ..) => {
                anyhow::ensure!(
                    dir.is_dir(),
                    "engine.qwen_edit.model_dir: {} is not a folder",
                    dir.display()
                );
                QwenSource::DiffusersFolder(dir.clone())
            }
            (None, Some(transformer), Some(text_encoder), Some(vae)) => QwenSource::Files {
                transformer: transformer.clone(),
                text_encoder: text_encoder.clone(),
                vae: vae.clone(),
                config_dir: config.config_dir.clone(),
            },
            _ => anyhow::bail!("engine.qwen_edit: no model configured"),
        };
        let mut pc = QwenEditConfig::new(source, device);
        pc.dtype = config.dtype.kind();
        pc.vae_dtype = config.vae_dtype.kind();
        pc.fp8 = config.fp8;
        pc.attention = config.attention;
        pc.positions = config.positions;
        pc.max_batch = config.max_batch as usize;
        pc.condition_image_area = config.condition_image_area;
        pc.vae_image_area = config.vae_image_area;
        pc.vae_tiling = Tiling::Auto;
        pc.loras = config
            .loras
            .iter()
            .map(|l| LoraSpec {
                path: l.path.clone(),
                strength: f64::from(l.strength),
            })
            .collect();
        pc.scheduler = match config.scheduler {
            SchedulerChoice::Lightning => Some(FlowMatchConfig::qwen_image_lightning()),
            SchedulerChoice::Model => None,
        };
        let started = Instant::now();
        let pipeline = QwenEditPipeline::load(&pc)
            .map_err(|e| anyhow::anyhow!("loading Qwen-Image-Edit: {e}"))?;
        tracing::info!(
            ?device,
            fp8 = ?config.fp8,
            seconds = started.elapsed().as_secs_f64(),
            "Qwen-Image-Edit loaded"
        );
        warm_up_sizes("Qwen-Image-Edit", &config.warm_up, |w, h| {
            pipeline.warm_up(&[(w, h)])
        })?;
        Ok(Self {
            pipeline,
            cache: EncodeCache::new((config.encode_cache_mib as usize) << 20, cache_keys),
            lora_dir: config.lora_dir.clone(),
        })
    }

    /// The job's LoRA files: `<lora_dir>/<name>`, or with `.safetensors` appended.
    fn lora_files(&self, loras: &[LoraRef]) -> Result<Vec<LoraSpec>, EngineError> {
        if loras.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.lora_dir.as_ref().ok_or_else(|| {
            EngineError::InvalidInput(
                "the job names LoRAs but this worker has no engine.qwen_edit.lora_dir".into(),
            )
        })?;
        loras
            .iter()
            .map(|l| {
                let plain = dir.join(&l.name);
                let path = if plain.is_file() {
                    plain
                } else {
                    dir.join(format!("{}.safetensors", l.name))
                };
                if !path.is_file() {
                    return Err(EngineError::InvalidInput(format!(
                        "LoRA `{}` is not in {}",
                        l.name,
                        dir.display()
                    )));
                }
                Ok(LoraSpec {
                    path,
                    strength: f64::from(l.weight),
                })
            })
            .collect()
    }

    pub fn run(
        &mut self,
        job: EngineJob,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<EngineOutput, EngineError> {
        let Task::Edit(spec) = &job.task else {
            return Err(EngineError::Unsupported(job.task.model()));
        };
        let request = edit_request(spec)?;
        let mut timings = StageTimings::default();

        let loras = self.lora_files(&spec.loras)?;
        let started = Instant::now();
        self.pipeline
            .set_job_loras(&loras)
            .map_err(|e| engine_error(e, cancel))?;
        if !loras.is_empty() {
            timings.add("lora", started.elapsed().as_secs_f64());
        }

        let key = EncodeCache::key(&job.inputs);
        let started = Instant::now();
        if self.cache.get(&key).is_none() {
            let images: Vec<_> = job.inputs.iter().map(|i| i.image.clone()).collect();
            let encoded = self
                .pipeline
                .encode_inputs(&images)
                .map_err(|e| engine_error(e, cancel))?;
            self.cache.insert(key.clone(), encoded);
            timings.add("encode", started.elapsed().as_secs_f64());
        }
        let encoded = self.cache.get(&key).ok_or_else(|| {
            EngineError::Failed("encode cache lost the entry it just stored".into())
        })?;
        let total = request.steps as u32;
        let (images, times) = self
            .pipeline
            .edit(
                encoded,
                std::slice::from_ref(&request),
                &mut |step, _| {
                    progress(Progress {
                        step: step as u32,
                        total,
                    })
                },
                &|| cancel.requested().is_some(),
            )
            .map_err(|e| engine_error(e, cancel))?;
        timings.add("encode_prompt", times.encode_prompt);
        timings.add("denoise", times.denoise);
        timings.add("decode", times.decode);
        Ok(EngineOutput {
            images: images
                .into_iter()
                .map(image::DynamicImage::ImageRgb8)
                .collect(),
            seeds: vec![Some(request.seed)],
            timings,
        })
    }
}

fn edit_request(spec: &EditSpec) -> Result<EditRequest, EngineError> {
    let seed = spec
        .seed
        .ok_or_else(|| EngineError::InvalidInput("edit without a resolved seed".into()))?;
    Ok(EditRequest {
        instruction: spec.instruction.clone(),
        seed,
        steps: spec.steps as usize,
        cfg: f64::from(spec.cfg),
        size: spec.width.zip(spec.height),
    })
}
