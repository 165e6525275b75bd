//! `QwenEditPipeline`: Qwen-Image-Edit-2509 instruction edits of one to three input images, the way
//! diffusers' `QwenImageEditPlusPipeline` runs them (diffusers 0.42.1,
//! `pipelines/qwenimage/pipeline_qwenimage_edit_plus.py`, Apache-2.0), split so that an input set
//! is encoded once and edited many times:
//!
//! - [`QwenEditPipeline::encode_inputs`]: each input is resized (Pillow-exact Lanczos) to about
//!   `condition_image_area` pixels for the vision tower and to about `vae_image_area` pixels for the
//!   VAE; the VAE latents (the distribution's mode, normalised with the VAE's latents mean/std, packed
//!   into 2x2 patches) and the vision tower's image features are kept in an [`EncodedInputs`].
//! - [`QwenEditPipeline::edit`]: per variant, the instruction is encoded (Edit-Plus template, the
//!   cached image features in the `<|image_pad|>` slots), then flow-match Euler denoising with the
//!   reference latents appended after the noise tokens, then a VAE decode. Variants with the same
//!   size and step count run as micro-batches of up to `max_batch` (prompts padded, with a mask).
//!
//! Invariants: one pipeline is used from one thread at a time; a variant's seed determines its noise
//! exactly as `torch.Generator("cpu").manual_seed(seed)` in diffusers; the cancel callback is polled
//! before every step; a libtorch failure inside an operation is [`GenerateError::Backend`], not a
//! panic.

use crate::qwen_image::kernels::BlockKernels;
use crate::settings::QwenSettings;
use std::path::PathBuf;
use std::time::Instant;

use image::RgbImage;
use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError, contain_backend_panics};
use crate::imageops::resample::{Filter, resize};
use crate::imageops::{rgb8_to_tensor, tensor_to_rgb8};
use crate::loading::diffusers::{open, read_config};
use crate::loading::lora::{
    self, Component, JobLoras, LoraError, LoraModule, LoraSpec, LoraTarget, TargetRef,
};
use crate::loading::weights::{WeightStore, Weights};
use crate::nn::MemoryFormat;
use crate::nn::fused::NormKernels;
use crate::nn::tiling::Tiling;
use crate::noise;
use crate::qwen_image::encodings::{self, EncodingsError};
use crate::qwen_image::keys::vae_weight_store;
use crate::qwen_image::transformer::{
    QwenImageTransformer2DModel, QwenImageTransformerBlock, QwenImageTransformerConfig,
    transformer_folder_store, transformer_store,
};
use crate::qwen_image::vae::{QwenVae, QwenVaeConfig};
use crate::qwen2_5_vl::config::QwenVlConfig;
use crate::qwen2_5_vl::processor::ImageProcessorConfig;
use crate::qwen2_5_vl::rope::PositionMode;
use crate::qwen2_5_vl::text_encoder::{ImageFeatures, QwenTextEncoder, TextEncoderOptions};
use crate::qwen2_5_vl::tokenizer::QwenTokenizer;
use crate::schedulers::{FlowMatchConfig, FlowMatchEulerDiscrete};

/// What [`QwenEditPipeline::encode_inputs`] returns and [`QwenEditPipeline::edit`] takes, named
/// here with the rest of the pipeline's API.
pub use crate::qwen_image::encoded::EncodedInputs;

/// Where the weights are.
#[derive(Debug, Clone, PartialEq)]
pub enum QwenSource {
    /// A diffusers pipeline folder (`transformer/`, `text_encoder/`, `vae/`, `tokenizer/`,
    /// `processor/`, `scheduler/`), as `Qwen/Qwen-Image-Edit-2509` ships.
    DiffusersFolder(PathBuf),
    /// ComfyUI-style single files: the transformer (bf16, fp8 e4m3fn, optionally with a
    /// `model.diffusion_model.` prefix), the text encoder (Qwen2.5-VL-7B, bf16 or "scaled fp8") and
    /// the VAE (Wan 2.1 or diffusers key names). Sizes are the real model's unless `config_dir`
    /// names a diffusers-layout folder holding the components' `config.json` files.
    Files {
        transformer: PathBuf,
        text_encoder: PathBuf,
        vae: PathBuf,
        config_dir: Option<PathBuf>,
    },
}

/// How the pipeline is loaded and run.
#[derive(Debug, Clone)]
pub struct QwenEditConfig {
    pub source: QwenSource,
    pub device: Device,
    /// Compute dtype of the transformer and text encoder (bf16 on GPUs, fp32 for parity tests).
    pub dtype: Kind,
    /// Dtype of the VAE.
    pub vae_dtype: Kind,
    /// Kernel and memory choices: attention, and whether fp8 weights are dequantised at load or
    /// kept resident and dequantised per layer ([`QwenSettings`], the portable preset by default).
    pub settings: QwenSettings,
    /// LoRAs fused into the transformer at load (the Lightning 4-step LoRA at strength 1).
    pub loras: Vec<LoraSpec>,
    /// Position ids of the text encoder: M-RoPE as Qwen2.5-VL was trained (the default), or the
    /// sequential positions diffusers 0.42.1 computes with transformers ≥ 5.15 (for parity).
    pub positions: PositionMode,
    /// The scheduler; `None` reads the folder's `scheduler/scheduler_config.json`, else Qwen-Image's.
    pub scheduler: Option<FlowMatchConfig>,
    /// Pixels of the vision tower's copy of each input (diffusers' `CONDITION_IMAGE_SIZE`).
    pub condition_image_area: u64,
    /// Pixels of the VAE's copy of each input (diffusers' `VAE_IMAGE_SIZE`).
    pub vae_image_area: u64,
    /// Default output area when a request gives no size (about one megapixel, diffusers' default).
    pub default_output_area: u64,
    pub vae_tiling: Tiling,
    /// Variants per transformer forward.
    pub max_batch: usize,
}

impl QwenEditConfig {
    pub fn new(source: QwenSource, device: Device) -> Self {
        Self {
            source,
            device,
            dtype: Kind::BFloat16,
            vae_dtype: Kind::BFloat16,
            settings: QwenSettings::default(),
            loras: Vec::new(),
            positions: PositionMode::Mrope,
            scheduler: None,
            condition_image_area: 384 * 384,
            vae_image_area: 1024 * 1024,
            default_output_area: 1024 * 1024,
            vae_tiling: Tiling::Auto,
            max_batch: 1,
        }
    }
}

/// One variant of an edit.
#[derive(Debug, Clone, PartialEq)]
pub struct EditRequest {
    pub instruction: String,
    pub seed: u64,
    pub steps: usize,
    /// diffusers' `true_cfg_scale`: above 1, a negative prompt (`" "`) is encoded too and the two
    /// predictions are combined with diffusers' norm-preserving rescale.
    pub cfg: f64,
    /// Output size; `None`: `default_output_area` at the last input's aspect ratio.
    pub size: Option<(u32, u32)>,
}

/// Wall time of each stage of an edit call, in seconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct EditTimes {
    pub encode_prompt: f64,
    pub denoise: f64,
    pub decode: f64,
}

/// diffusers' `calculate_dimensions(target_area, ratio)`: the width and height of about
/// `target_area` pixels at `ratio = w/h`, each rounded (half to even, like Python's `round`) to a
/// multiple of 32.
pub fn calculate_dimensions(target_area: u64, ratio: f64) -> (u32, u32) {
    let width = (target_area as f64 * ratio).sqrt();
    let height = width / ratio;
    let round32 = |x: f64| ((x / 32.0).round_ties_even() * 32.0) as u32;
    (round32(width), round32(height))
}

pub struct QwenEditPipeline {
    transformer: QwenImageTransformer2DModel,
    text_encoder: QwenTextEncoder,
    vae: QwenVae,
    scheduler: FlowMatchConfig,
    device: Device,
    dtype: Kind,
    vae_dtype: Kind,
    config: QwenEditConfig,
    /// LoRAs applied for the current job on top of the load-time ones, with what restores them.
    job_loras: JobLoras,
    /// Seconds each part of the load took ([`QwenEditPipeline::load_times`]).
    load_times: Vec<(&'static str, f64)>,
}

/// The transformer's Linear layers by diffusers module name, for LoRA fusing.
impl LoraTarget for QwenImageTransformer2DModel {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        self.linears_mut()
            .into_iter()
            .map(|(name, linear)| (name, linear.into()))
            .collect()
    }
}

/// A loader thread's result; a panic in it (a libtorch failure tch reports by panicking) is a
/// load error, not a crash of the worker.
fn join_loader<T>(
    handle: std::thread::ScopedJoinHandle<'_, Result<T, LoadError>>,
) -> Result<T, LoadError> {
    handle.join().unwrap_or_else(|_| {
        Err(LoadError::Format {
            path: PathBuf::from("<loader thread>"),
            reason: "a loader thread panicked".into(),
        })
    })
}

fn lora_load_error(e: LoraError) -> LoadError {
    match e {
        LoraError::Load(e) => e,
        other => LoadError::Format {
            path: PathBuf::from("<lora>"),
            reason: other.to_string(),
        },
    }
}

/// Block `i` of the transformer as it loads, as a LoRA target (its modules by their full names).
struct LoadedBlock<'a>(i64, &'a mut QwenImageTransformerBlock);

impl LoraTarget for LoadedBlock<'_> {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        QwenImageTransformer2DModel::block_linears_mut(self.0, self.1)
            .into_iter()
            .map(|(name, linear)| (name, linear.into()))
            .collect()
    }
}

/// The transformer's Linear layers outside its blocks, as a LoRA target.
struct OuterLinears<'a>(&'a mut QwenImageTransformer2DModel);

impl LoraTarget for OuterLinears<'_> {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        self.0
            .outer_linears_mut()
            .into_iter()
            .map(|(name, linear)| (name, linear.into()))
            .collect()
    }
}

/// Loads the transformer with `specs` fused for good: load-time LoRAs stay for the pipeline's life,
/// so no original is kept (a Lightning LoRA's would be 41 GB of pinned host memory in bf16). Each
/// block is fused on its loading thread as soon as it is loaded ([`lora::PartFuser`]): the fuse's
/// device work (about 0.6 s for a Lightning LoRA on an H100) overlaps the reading of the blocks
/// still loading instead of following the whole load. The layers outside the blocks are fused last.
fn load_transformer_fused(
    config: &QwenEditConfig,
    c: &QwenImageTransformerConfig,
    specs: &[LoraSpec],
) -> Result<QwenImageTransformer2DModel, LoraError> {
    let fuser = lora::PartFuser::open(specs)?;
    let part = |target: &mut dyn LoraTarget| {
        fuser.part(&mut [TargetRef {
            component: Component::Denoiser,
            target,
        }])
    };
    let mut transformer = load_transformer(config, c, |i, block| {
        part(&mut LoadedBlock(i, block)).map_err(lora_load_error)
    })?;
    let _guard = tch::no_grad_guard();
    part(&mut OuterLinears(&mut transformer))?;
    fuser.finish()?;
    Ok(transformer)
}

/// The folder of the components' config files, when there is one.
fn config_dir(config: &QwenEditConfig) -> Option<PathBuf> {
    match &config.source {
        QwenSource::DiffusersFolder(dir) => Some(dir.clone()),
        QwenSource::Files { config_dir, .. } => config_dir.clone(),
    }
}

fn transformer_config(config: &QwenEditConfig) -> Result<QwenImageTransformerConfig, LoadError> {
    match config_dir(config) {
        Some(dir) => read_config(
            &dir.join("transformer/config.json"),
            QwenImageTransformerConfig::from_json,
        ),
        None => Ok(QwenImageTransformerConfig::qwen_image_edit_2509()),
    }
}

fn vae_config(config: &QwenEditConfig) -> Result<QwenVaeConfig, LoadError> {
    match config_dir(config) {
        Some(dir) => read_config(&dir.join("vae/config.json"), QwenVaeConfig::from_json),
        None => Ok(QwenVaeConfig::qwen_image()),
    }
}

/// The transformer of `c`'s shape from the configured weights (blocks past `c.num_layers` are
/// not read), without LoRAs and with libtorch's operators (the caller sets the block kernels once
/// its weights are final: fused q/k/v and fp8 copies are made from them).
/// The transformer from the configured files; `loaded(i, block)` runs on each block as it loads.
fn load_transformer(
    config: &QwenEditConfig,
    c: &QwenImageTransformerConfig,
    loaded: impl Fn(i64, &mut QwenImageTransformerBlock) -> Result<(), LoadError> + Sync,
) -> Result<QwenImageTransformer2DModel, LoadError> {
    let _guard = tch::no_grad_guard();
    let store = match &config.source {
        QwenSource::DiffusersFolder(dir) => transformer_folder_store(&dir.join("transformer"))?,
        QwenSource::Files { transformer, .. } => transformer_store(open(transformer)?),
    };
    let w = Weights::new(
        std::sync::Arc::new(store.with_fp8(config.settings.fp8)),
        config.device,
        config.dtype,
    );
    QwenImageTransformer2DModel::new_with(&w, c, config.settings.attention, loaded)
}

/// The settings' block kernels on `transformer`: refused where the binary lacks the shim, fused
/// kernels compiled now, the q/k/v projections fused into one GEMM and the fp8 copies made (the
/// pipeline calls this once the load-time LoRAs are fused).
fn set_block_kernels(
    transformer: &mut QwenImageTransformer2DModel,
    config: &QwenEditConfig,
) -> Result<(), LoadError> {
    transformer
        .set_block_kernels(config.settings.block_kernels())
        .map_err(|reason| LoadError::Setting {
            setting: "qk_norm_rope, ada_norm, gated_residual = fused, ff_gelu = epilogue, \
                      fused_qkv or fp8_gemm",
            reason,
        })
}

fn load_vae(config: &QwenEditConfig, c: &QwenVaeConfig) -> Result<QwenVae, LoadError> {
    let _guard = tch::no_grad_guard();
    let path = match &config.source {
        QwenSource::DiffusersFolder(dir) => dir.join("vae/diffusion_pytorch_model.safetensors"),
        QwenSource::Files { vae, .. } => vae.clone(),
    };
    let store = vae_weight_store(&path, c.num_res_blocks)?;
    let w = Weights::new(std::sync::Arc::new(store), config.device, config.vae_dtype);
    let mut vae = QwenVae::new(&w, c)?.with_tiling(config.vae_tiling);
    vae.set_memory_format(config.settings.vae_memory_format);
    vae.set_norm_kernels(config.settings.vae_norm)
        .map_err(|reason| LoadError::Setting {
            setting: "vae_norm = fused",
            reason,
        })?;
    Ok(vae)
}

impl QwenEditPipeline {
    /// Loads the three components to `config.device` (each on its own thread: the transformer,
    /// the text encoder and the VAE read their files in parallel) and fuses the configured LoRAs.
    pub fn load(config: &QwenEditConfig) -> Result<Self, LoadError> {
        let device = config.device;
        let configs = config_dir(config);
        let transformer_config = transformer_config(config)?;
        let vae_config = vae_config(config)?;
        let scheduler = match (&config.scheduler, &configs) {
            (Some(s), _) => s.clone(),
            (None, Some(dir)) if dir.join("scheduler/scheduler_config.json").exists() => {
                read_config(
                    &dir.join("scheduler/scheduler_config.json"),
                    FlowMatchConfig::from_json,
                )?
            }
            (None, _) => FlowMatchConfig::qwen_image(),
        };
        let te_options = TextEncoderOptions {
            device,
            kind: config.dtype,
            attention: config.settings.attention,
            fp8: config.settings.fp8,
            positions: config.positions,
        };
        let since = |t: &mut Instant| {
            let seconds = t.elapsed().as_secs_f64();
            *t = Instant::now();
            seconds
        };
        type Timed<T> = Result<(T, Vec<(&'static str, f64)>), LoadError>;
        let transformer_task = || -> Timed<QwenImageTransformer2DModel> {
            let mut t = Instant::now();
            let (mut transformer, loaded) = if config.loras.is_empty() {
                (
                    load_transformer(config, &transformer_config, |_, _| Ok(()))?,
                    "transformer",
                )
            } else {
                let fused = load_transformer_fused(config, &transformer_config, &config.loras);
                (
                    fused.map_err(lora_load_error)?,
                    "transformer, LoRAs fused as blocks loaded",
                )
            };
            let mut times = vec![(loaded, since(&mut t))];
            set_block_kernels(&mut transformer, config)?;
            times.push(("transformer block kernels", since(&mut t)));
            Ok((transformer, times))
        };
        let load_text_encoder = || -> Result<QwenTextEncoder, LoadError> {
            let _guard = tch::no_grad_guard();
            let mut te = match &config.source {
                QwenSource::DiffusersFolder(dir) => {
                    QwenTextEncoder::load_diffusers(dir, te_options)?
                }
                QwenSource::Files {
                    text_encoder,
                    config_dir,
                    ..
                } => {
                    let (vl_config, tokenizer, processor) = match config_dir {
                        Some(dir) => {
                            let pre = dir.join("processor/preprocessor_config.json");
                            (
                                read_config(
                                    &dir.join("text_encoder/config.json"),
                                    QwenVlConfig::from_json,
                                )?,
                                if dir.join("tokenizer").is_dir() {
                                    QwenTokenizer::from_dir(&dir.join("tokenizer"))?
                                } else {
                                    QwenTokenizer::bundled()?
                                },
                                if pre.exists() {
                                    read_config(&pre, ImageProcessorConfig::from_json)?
                                } else {
                                    ImageProcessorConfig::default()
                                },
                            )
                        }
                        None => (
                            QwenVlConfig::qwen2_5_vl_7b(),
                            QwenTokenizer::bundled()?,
                            ImageProcessorConfig::default(),
                        ),
                    };
                    let store = WeightStore::identity(open(text_encoder)?);
                    QwenTextEncoder::from_store(
                        store,
                        text_encoder,
                        vl_config,
                        tokenizer,
                        processor,
                        te_options,
                    )?
                }
            };
            te.processor.condition_image_size = config.condition_image_area as i64;
            Ok(te)
        };
        let text_encoder_task = || -> Timed<QwenTextEncoder> {
            let mut t = Instant::now();
            let te = load_text_encoder()?;
            Ok((te, vec![("text encoder", since(&mut t))]))
        };
        let (transformer, text_encoder, vae) = std::thread::scope(|scope| {
            let t = crate::loading::stream::spawn(scope, transformer_task);
            let e = crate::loading::stream::spawn(scope, text_encoder_task);
            let mut started = Instant::now();
            let vae = load_vae(config, &vae_config).map(|vae| (vae, since(&mut started)));
            (join_loader(t), join_loader(e), vae)
        });
        let ((transformer, mut load_times), (text_encoder, te_times)) =
            (transformer?, text_encoder?);
        let (vae, vae_seconds) = vae?;
        load_times.extend(te_times);
        load_times.push(("VAE", vae_seconds));
        Ok(Self {
            load_times,
            transformer,
            text_encoder,
            vae,
            scheduler,
            device,
            dtype: config.dtype,
            vae_dtype: config.vae_dtype,
            config: config.clone(),
            job_loras: JobLoras::default(),
        })
    }

    /// Seconds each part of [`QwenEditPipeline::load`] took, by name: the transformer's weights
    /// read to the device, its load-time LoRAs fused, its block kernels set (fused q/k/v and fp8
    /// copies made), then the text encoder and the VAE, each loaded on a thread of its own (so the
    /// parts overlap and do not add up to the load).
    pub fn load_times(&self) -> &[(&'static str, f64)] {
        &self.load_times
    }

    /// The transformer's first `blocks` blocks, with its input and output layers, from the
    /// configured files, on `config.device` in `config.dtype` and without LoRAs: a part of the
    /// model small enough to load a second copy of beside the warm one (the box check runs one
    /// on the device and one on the CPU and compares them).
    pub fn load_transformer_part(
        config: &QwenEditConfig,
        blocks: usize,
    ) -> Result<QwenImageTransformer2DModel, LoadError> {
        let mut c = transformer_config(config)?;
        c.num_layers = c.num_layers.min(blocks as i64);
        let mut transformer = load_transformer(config, &c, |_, _| Ok(()))?;
        set_block_kernels(&mut transformer, config)?;
        Ok(transformer)
    }

    /// The VAE alone, from the configured files, on `config.device` in `config.vae_dtype`.
    pub fn load_vae_only(config: &QwenEditConfig) -> Result<QwenVae, LoadError> {
        load_vae(config, &vae_config(config)?)
    }

    pub fn config(&self) -> &QwenEditConfig {
        &self.config
    }

    /// Latent pixels per image pixel along a side (8 for the real VAE).
    fn vae_scale(&self) -> u32 {
        self.vae.config().spatial_compression_ratio() as u32
    }

    /// Makes the transformer carry exactly the load-time LoRAs plus `loras` (none: the base as
    /// loaded). The previous job's extra LoRAs are removed bit for bit first; the same set twice in
    /// a row costs nothing.
    pub fn set_job_loras(&mut self, loras: &[LoraSpec]) -> Result<(), GenerateError> {
        self.job_loras
            .set(
                loras,
                &mut [TargetRef {
                    component: Component::Denoiser,
                    target: &mut self.transformer,
                }],
            )
            .map_err(GenerateError::from)?;
        // The LoRAs replaced (or restored) weights: q/k/v fused and fp8 copies made again where
        // asked.
        let kernels = self.transformer.block_kernels();
        if kernels.fused_qkv || kernels.fp8_gemm {
            self.set_block_kernels(kernels)
                .map_err(GenerateError::InvalidRequest)?;
        }
        Ok(())
    }

    /// The transformer's block kernels from now on ([`QwenSettings`]'s `qk_norm_rope`,
    /// `ada_norm`, `gated_residual`, `ff_gelu`, `fused_qkv`; the box check tries each).
    pub fn set_block_kernels(&mut self, kernels: BlockKernels) -> Result<(), String> {
        self.transformer.set_block_kernels(kernels)?;
        self.config.settings.qk_norm_rope = kernels.qk_norm_rope;
        self.config.settings.ada_norm = kernels.ada_norm;
        self.config.settings.gated_residual = kernels.gated_residual;
        self.config.settings.ff_gelu = kernels.ff_gelu;
        self.config.settings.fused_qkv = kernels.fused_qkv;
        self.config.settings.fp8_gemm = kernels.fp8_gemm;
        Ok(())
    }

    /// The VAE's memory order from now on ([`QwenSettings`]'s `vae_memory_format`; the box
    /// check tries both).
    pub fn set_vae_memory_format(&mut self, format: MemoryFormat) {
        self.vae.set_memory_format(format);
        self.config.settings.vae_memory_format = format;
    }

    /// The VAE's RMS norm kernels from now on ([`QwenSettings`]'s `vae_norm`; the box check
    /// tries both).
    pub fn set_vae_norm_kernels(&mut self, kernels: NormKernels) -> Result<(), String> {
        self.vae.set_norm_kernels(kernels)?;
        self.config.settings.vae_norm = kernels;
        Ok(())
    }

    /// The diffusion transformer (for component timings).
    pub fn transformer(&self) -> &QwenImageTransformer2DModel {
        &self.transformer
    }

    /// The VAE (for component timings).
    pub fn vae(&self) -> &QwenVae {
        &self.vae
    }

    /// The text encoder and its vision tower (for component timings).
    pub fn text_encoder(&self) -> &QwenTextEncoder {
        &self.text_encoder
    }

    /// Encodes an input set once: the vision tower's features and the VAE latents of each input.
    pub fn encode_inputs(&self, images: &[RgbImage]) -> Result<EncodedInputs, GenerateError> {
        if images.is_empty() || images.len() > 3 {
            return Err(GenerateError::InvalidRequest(format!(
                "an edit takes one to three input images, got {}",
                images.len()
            )));
        }
        if let Some(img) = images.iter().find(|i| i.width() == 0 || i.height() == 0) {
            return Err(GenerateError::InvalidRequest(format!(
                "input image is {}x{}",
                img.width(),
                img.height()
            )));
        }
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            let _guard = tch::no_grad_guard();
            // The VAE encodes first: its kernels run while the host resizes the condition images
            // for the vision tower (the next upload to the device waits for them).
            let mut latents = Vec::with_capacity(images.len());
            let mut latent_shapes = Vec::with_capacity(images.len());
            for img in images {
                let ratio = f64::from(img.width()) / f64::from(img.height());
                let (w, h) = calculate_dimensions(self.config.vae_image_area, ratio);
                let resized = resize(img, w, h, Filter::Lanczos)
                    .map_err(|e| GenerateError::InvalidRequest(e.to_string()))?;
                let x = rgb8_to_tensor(&resized, self.device, self.vae_dtype);
                let z = self.vae.encode_mean(&x)?;
                let z = self.vae.normalize(&z).to_kind(self.dtype);
                latent_shapes.push((1, z.size()[2] / 2, z.size()[3] / 2));
                latents.push(pack_latents(&z));
            }
            let features = self.text_encoder.encode_images(images)?;
            let last = images.last().expect("checked non-empty");
            Ok(EncodedInputs {
                image_latents: Tensor::cat(&latents, 1),
                latent_shapes,
                features,
                last_input_size: (last.width(), last.height()),
            })
        }))
    }

    /// The output size of a request: its own (floored to the VAE factor x 2), else
    /// `default_output_area` at the last input's aspect ratio.
    pub fn output_size(&self, inputs: &EncodedInputs, request: &EditRequest) -> (u32, u32) {
        let multiple = self.vae_scale() * 2;
        let (w, h) = request.size.unwrap_or_else(|| {
            let (iw, ih) = inputs.last_input_size;
            calculate_dimensions(
                self.config.default_output_area,
                f64::from(iw) / f64::from(ih),
            )
        });
        (w / multiple * multiple, h / multiple * multiple)
    }

    fn validate(&self, inputs: &EncodedInputs, r: &EditRequest) -> Result<(), GenerateError> {
        if r.steps == 0 {
            return Err(GenerateError::InvalidRequest(
                "steps must be at least 1".into(),
            ));
        }
        if !r.cfg.is_finite() || r.cfg < 0.0 {
            return Err(GenerateError::InvalidRequest(format!(
                "cfg {} is not usable",
                r.cfg
            )));
        }
        let (w, h) = self.output_size(inputs, r);
        if w == 0 || h == 0 {
            return Err(GenerateError::InvalidRequest(format!(
                "output size {w}x{h} is empty"
            )));
        }
        Ok(())
    }

    /// Edits the encoded inputs once per request. Requests with the same output size, step count
    /// and guidance run together, at most `max_batch` per transformer forward. `progress(done,
    /// total)` counts denoising steps over all requests; `cancel()` is polled before every step.
    pub fn edit(
        &self,
        inputs: &EncodedInputs,
        requests: &[EditRequest],
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<(Vec<RgbImage>, EditTimes), GenerateError> {
        for r in requests {
            self.validate(inputs, r)?;
        }
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            let _guard = tch::no_grad_guard();
            let mut times = EditTimes::default();
            let total: usize = requests.iter().map(|r| r.steps).sum();
            let mut done = 0;
            let mut images: Vec<Option<RgbImage>> = vec![None; requests.len()];
            // Group compatible requests, keeping the callers' order within a group.
            let mut groups: Vec<Vec<usize>> = Vec::new();
            for (i, r) in requests.iter().enumerate() {
                let key = (self.output_size(inputs, r), r.steps, r.cfg > 1.0);
                match groups.iter_mut().find(|g| {
                    let f = &requests[g[0]];
                    g.len() < self.config.max_batch.max(1)
                        && (self.output_size(inputs, f), f.steps, f.cfg > 1.0) == key
                }) {
                    Some(g) => g.push(i),
                    None => groups.push(vec![i]),
                }
            }
            for group in groups {
                let batch: Vec<&EditRequest> = group.iter().map(|&i| &requests[i]).collect();
                let mut step_progress = |_: usize, _: usize| {
                    done += batch.len();
                    progress(done, total);
                };
                let out =
                    self.edit_batch(inputs, &batch, &mut step_progress, cancel, &mut times)?;
                for (i, img) in group.into_iter().zip(out) {
                    images[i] = Some(img);
                }
            }
            Ok((images.into_iter().flatten().collect(), times))
        }))
    }

    /// Prompt embeddings of several instructions, padded to one length, with their mask (`None`
    /// when every prompt has the same length: the transformer's fast path).
    fn encode_prompts(
        &self,
        instructions: &[&str],
        features: &ImageFeatures,
    ) -> Result<(Tensor, Option<Tensor>), GenerateError> {
        let (embeds, mask) = self.text_encoder.encode_prompts(instructions, features)?;
        let embeds = embeds.to_kind(self.dtype);
        // The mask is on the host: read there, moved only where a prompt is padded, so nothing
        // here waits for the text encoder's forward (the noise is drawn on the host meanwhile).
        let all_valid = mask.min().int64_value(&[]) == 1;
        Ok((embeds, (!all_valid).then(|| mask.to_device(self.device))))
    }

    fn edit_batch(
        &self,
        inputs: &EncodedInputs,
        batch: &[&EditRequest],
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
        times: &mut EditTimes,
    ) -> Result<Vec<RgbImage>, GenerateError> {
        let first = batch[0];
        let (width, height) = self.output_size(inputs, first);
        let guided = first.cfg > 1.0;
        let n = batch.len() as i64;

        let started = Instant::now();
        let instructions: Vec<&str> = batch.iter().map(|r| r.instruction.as_str()).collect();
        let (prompt_embeds, prompt_mask) = self.encode_prompts(&instructions, &inputs.features)?;
        let negative = if guided {
            Some(self.encode_prompts(&vec![" "; batch.len()], &inputs.features)?)
        } else {
            None
        };
        times.encode_prompt += started.elapsed().as_secs_f64();

        // Noise: per variant, `randn((1, 1, C, H/8, W/8))` from its own seeded CPU generator in the
        // pipeline dtype (diffusers' `prepare_latents`), packed.
        let scale = i64::from(self.vae_scale());
        let (lh, lw) = (
            2 * (i64::from(height) / (scale * 2)),
            2 * (i64::from(width) / (scale * 2)),
        );
        let channels = self.vae.config().z_dim;
        let latent_channels = self.transformer.config().in_channels / 4;
        if latent_channels != channels {
            return Err(GenerateError::InvalidRequest(format!(
                "the transformer takes {latent_channels}-channel latents, the VAE makes {channels}"
            )));
        }
        let mut noises = Vec::with_capacity(batch.len());
        for r in batch {
            let _generator = noise::seed(r.seed);
            let z = noise::randn(&[1, 1, channels, lh, lw], self.dtype, self.device);
            noises.push(pack_latents(&z.squeeze_dim(1)));
        }
        let mut latents = Tensor::cat(&noises, 0);
        let image_latents = inputs.image_latents.expand([n, -1, -1], false);
        let mut img_shapes = vec![(1, lh / 2, lw / 2)];
        img_shapes.extend(inputs.latent_shapes.iter().copied());

        let started = Instant::now();
        let target_tokens = latents.size()[1];
        let mu = self.scheduler.calculate_shift(target_tokens);
        let scheduler = FlowMatchEulerDiscrete::new(&self.scheduler, first.steps, Some(mu))
            .map_err(GenerateError::InvalidRequest)?;
        // diffusers: `t.expand(B).to(latents.dtype)`, then `timestep / 1000` in that dtype; the
        // adaLN modulations of every step at once, or the last edit's where the schedule is the same.
        let modulations = self
            .transformer
            .step_modulations(&scheduler.timesteps[..first.steps], self.dtype);
        for i in 0..first.steps {
            if cancel() {
                return Err(GenerateError::Cancelled);
            }
            let model_in = Tensor::cat(&[&latents, &image_latents], 1);
            let pred = self
                .transformer
                .forward_step(
                    &model_in,
                    &prompt_embeds,
                    prompt_mask.as_ref(),
                    &modulations,
                    i,
                    &img_shapes,
                )?
                .narrow(1, 0, target_tokens);
            let pred = match &negative {
                None => pred,
                Some((neg_embeds, neg_mask)) => {
                    let neg = self
                        .transformer
                        .forward_step(
                            &model_in,
                            neg_embeds,
                            neg_mask.as_ref(),
                            &modulations,
                            i,
                            &img_shapes,
                        )?
                        .narrow(1, 0, target_tokens);
                    let cfg =
                        Tensor::from_slice(&batch.iter().map(|r| r.cfg as f32).collect::<Vec<_>>())
                            .to_device(self.device)
                            .to_kind(pred.kind())
                            .view([n, 1, 1]);
                    let comb = &neg + (&pred - &neg) * cfg;
                    let cond_norm = pred.norm_scalaropt_dim(2, [-1].as_slice(), true);
                    let comb_norm = comb.norm_scalaropt_dim(2, [-1].as_slice(), true);
                    comb * (cond_norm / comb_norm)
                }
            };
            latents = scheduler.step(&pred, i, &latents);
            progress(i + 1, first.steps);
        }
        crate::nn::stream::synchronize_current(self.device);
        times.denoise += started.elapsed().as_secs_f64();

        let started = Instant::now();
        let mut images = Vec::with_capacity(batch.len());
        for latent in latents.split(1, 0) {
            let z = unpack_latents(&latent, lh, lw, channels).to_kind(self.vae_dtype);
            let z = self.vae.denormalize(&z);
            let x = self.vae.decode(&z)?;
            images.push(tensor_to_rgb8(&x)?);
        }
        times.decode += started.elapsed().as_secs_f64();
        Ok(images)
    }

    /// Steps of a warm-up edit: every step runs the same kernels, so one where the scheduler makes
    /// a one-step schedule (the Lightning scheduler's), two where it does not (Qwen-Image's own
    /// stretches its sigmas to a terminal value, 0/0 at one step).
    pub fn warm_up_steps(&self) -> usize {
        let one = FlowMatchEulerDiscrete::new(
            &self.scheduler,
            1,
            Some(self.scheduler.calculate_shift(4096)),
        );
        if one.is_ok() { 1 } else { 2 }
    }

    /// The encodings as bytes ([`encodings::to_bytes`]), to share with other workers.
    pub fn encodings_to_bytes(&self, e: &EncodedInputs) -> Result<Vec<u8>, EncodingsError> {
        encodings::to_bytes(e)
    }

    /// Encodings another worker of the same model made, read onto this pipeline's devices; bytes
    /// that do not fit this model (dtype, sizes) or are damaged are an error.
    pub fn encodings_from_bytes(&self, bytes: &[u8]) -> Result<EncodedInputs, EncodingsError> {
        let language_model = self.text_encoder.language_model();
        let expected = encodings::Expected {
            latents_kind: self.dtype,
            latents_device: self.device,
            latent_channels: self.transformer.config().in_channels,
            features_kind: language_model.kind(),
            features_device: language_model.device(),
            hidden: self.text_encoder.config.text.hidden_size,
        };
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            Ok(encodings::from_bytes(bytes, &expected))
        }))
        .unwrap_or_else(|e| Err(encodings::EncodingsError::backend(e.to_string())))
    }

    /// Runs one edit of a synthetic input at each output `(width, height)`, so kernels are
    /// compiled and memory pools sized before the first job; at [`Self::warm_up_steps`] steps.
    pub fn warm_up(&self, sizes: &[(u32, u32)]) -> Result<(), GenerateError> {
        for &(width, height) in sizes {
            let input = RgbImage::from_fn(width, height, |x, y| {
                image::Rgb([(x % 256) as u8, (y % 256) as u8, 128])
            });
            let encoded = self.encode_inputs(&[input])?;
            let request = EditRequest {
                instruction: "warm up".into(),
                seed: 0,
                steps: self.warm_up_steps(),
                cfg: 1.0,
                size: Some((width, height)),
            };
            self.edit(&encoded, &[request], &mut |_, _| {}, &|| false)?;
        }
        Ok(())
    }
}

/// `(B, C, H, W)` latents → `(B, (H/2)(W/2), 4C)`: diffusers' `_pack_latents` (2x2 patches,
/// channel-major within a patch).
pub fn pack_latents(z: &Tensor) -> Tensor {
    let (b, c, h, w) = z.size4().expect("latents are 4-D");
    z.view([b, c, h / 2, 2, w / 2, 2])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([b, (h / 2) * (w / 2), c * 4])
}

/// The inverse of [`pack_latents`] for one latent grid of `h x w` with `c` channels.
pub fn unpack_latents(x: &Tensor, h: i64, w: i64, c: i64) -> Tensor {
    let b = x.size()[0];
    x.view([b, h / 2, w / 2, c, 2, 2])
        .permute([0, 3, 1, 4, 2, 5])
        .reshape([b, c, h, w])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dimensions_follow_diffusers() {
        // Python: calculate_dimensions(1024*1024, 832/1216) == (832, 1248)
        assert_eq!(
            calculate_dimensions(1024 * 1024, 832.0 / 1216.0),
            (832, 1248)
        );
        assert_eq!(calculate_dimensions(1024 * 1024, 1.0), (1024, 1024));
        assert_eq!(calculate_dimensions(384 * 384, 1.0), (384, 384));
    }

    #[test]
    fn pack_then_unpack_is_identity() {
        let z = Tensor::arange(2 * 3 * 4 * 6, (Kind::Float, Device::Cpu)).view([2, 3, 4, 6]);
        let packed = pack_latents(&z);
        assert_eq!(packed.size(), [2, 6, 12]);
        let back = unpack_latents(&packed, 4, 6, 3);
        assert_eq!(back, z);
    }

    #[test]
    fn pipeline_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<QwenEditPipeline>();
    }
}
