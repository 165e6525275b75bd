//! `SdxlPipeline`: loads the four SDXL components from a single-file ldm checkpoint or a diffusers
//! folder and runs text-to-image generation the way diffusers' `StableDiffusionXLPipeline` does.
//!
//! Invariants: one pipeline is used from one thread at a time (tch tensors are not `Sync`; the
//! worker owns it on a dedicated thread); a seed determines the initial and ancestral noise exactly
//! as `torch.Generator("cpu").manual_seed(seed)` would in diffusers (see [`crate::noise`]); the
//! cancel callback is polled before every denoising step and cancellation is
//! [`GenerateError::Cancelled`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use image::RgbImage;
use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError, contain_backend_panics};
use crate::imageops::tensor_to_rgb8;
use crate::loading::diffusers::{component_store, open, read_config};
use crate::loading::lora::{Component, JobLoras, LoraReport, LoraSpec, LoraSwitch, TargetRef};
use crate::loading::weights::{WeightStore, Weights};
use crate::nn::cuda_graph;
use crate::nn::fused::{self, NormKernels};
use crate::nn::{FfGelu, ops};
use crate::noise;
use crate::schedulers::{PredictionType, Sampler, Scheduler, SchedulerConfig};
use crate::sdxl::clip::{ClipTextConfig, ClipTextModel};
use crate::sdxl::conditioning::{EncoderPair, PromptEncoder};
use crate::sdxl::ldm;
use crate::sdxl::unet::{AddedCond, UNet2DConditionModel, UNetConfig};
use crate::sdxl::unet_graph::GraphedUNet;
use crate::sdxl::vae::{AutoencoderKL, Tiling, VaeConfig, VaeRuntime};
use crate::settings::SdxlSettings;
use crate::text::clip_tokenizer::ClipTokenizer;

/// Where the weights are.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// One `.safetensors` file with ldm key names (A1111 / CivitAI / ComfyUI).
    SingleFile(PathBuf),
    /// A diffusers pipeline folder (`unet/`, `vae/`, `text_encoder/`, `text_encoder_2/`, …).
    DiffusersFolder(PathBuf),
}

/// Component configs. For a diffusers folder each `None` is read from the folder's `config.json`;
/// for a single file each `None` is the SDXL base preset.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComponentConfigs {
    pub unet: Option<UNetConfig>,
    pub vae: Option<VaeConfig>,
    pub clip_l: Option<ClipTextConfig>,
    pub clip_g: Option<ClipTextConfig>,
    pub scheduler: Option<SchedulerConfig>,
}

impl ComponentConfigs {
    /// Every `None` read from the diffusers-layout folder `dir`: `unet/`, `vae/`, `text_encoder/`
    /// and `text_encoder_2/` `config.json` (required), `scheduler/scheduler_config.json` (if present).
    pub fn fill_from_dir(&self, dir: &Path) -> Result<Self, LoadError> {
        fn or_read<T: Clone>(
            have: &Option<T>,
            path: &Path,
            parse: fn(&str) -> Result<T, String>,
        ) -> Result<Option<T>, LoadError> {
            match have {
                Some(x) => Ok(Some(x.clone())),
                None => read_config(path, parse).map(Some),
            }
        }
        let scheduler = dir.join("scheduler/scheduler_config.json");
        Ok(Self {
            unet: or_read(
                &self.unet,
                &dir.join("unet/config.json"),
                UNetConfig::from_json,
            )?,
            vae: or_read(
                &self.vae,
                &dir.join("vae/config.json"),
                VaeConfig::from_json,
            )?,
            clip_l: or_read(
                &self.clip_l,
                &dir.join("text_encoder/config.json"),
                ClipTextConfig::from_json,
            )?,
            clip_g: or_read(
                &self.clip_g,
                &dir.join("text_encoder_2/config.json"),
                ClipTextConfig::from_json,
            )?,
            scheduler: match &self.scheduler {
                None if scheduler.exists() => {
                    Some(read_config(&scheduler, SchedulerConfig::from_json)?)
                }
                other => other.clone(),
            },
        })
    }
}

/// How to load and run the pipeline.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub source: ModelSource,
    pub device: Device,
    /// Dtype of the text encoders and UNet (fp32, fp16 or bf16).
    pub dtype: Kind,
    /// Dtype of the VAE; fp16 overflows in the SDXL VAE (diffusers' `force_upcast`), use fp32 or
    /// bf16 there.
    pub vae_dtype: Kind,
    pub components: ComponentConfigs,
    /// A folder holding `tokenizer/` and `tokenizer_2/` (diffusers layout). `None`: the diffusers
    /// folder's own, else the bundled CLIP tokenizer.
    pub tokenizer_dir: Option<PathBuf>,
    /// Overrides both the checkpoint's flags and the scheduler config.
    pub prediction_type: Option<PredictionType>,
    pub vae_tiling: Tiling,
    /// Load the UNet on a second thread while the other components load (default true).
    pub parallel_load: bool,
    /// Kernel and layout choices (attention, graph capture, GELU, UNet layout, normalisation
    /// kernels, VAE layout and memory budget): [`SdxlSettings`], the portable preset by default.
    /// Graph capture needs a CUDA device and a binary built against a CUDA libtorch, the epilogue
    /// GELU and the fused normalisations the operator shim: `SdxlPipeline::load` refuses them
    /// elsewhere with the reason (docs/performance.md, kernels attempts 6, 8, 10 and 11).
    pub settings: SdxlSettings,
}

impl PipelineConfig {
    /// fp32 on `device`, the portable settings, automatic VAE tiling, everything else from the
    /// source.
    pub fn new(source: ModelSource, device: Device) -> Self {
        Self {
            source,
            device,
            dtype: Kind::Float,
            vae_dtype: Kind::Float,
            components: ComponentConfigs::default(),
            tokenizer_dir: None,
            prediction_type: None,
            vae_tiling: Tiling::Auto,
            parallel_load: true,
            settings: SdxlSettings::default(),
        }
    }
}

/// One text-to-image request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: String,
    pub negative_prompt: String,
    pub width: u32,
    pub height: u32,
    pub steps: usize,
    /// Classifier-free guidance scale; guidance is off at ≤ 1 (as in diffusers).
    pub cfg: f64,
    pub sampler: Sampler,
    /// Seed of the first image. Image `n` uses `seed + n` with a generator of its own, as diffusers
    /// does given `generator=[torch.Generator("cpu").manual_seed(seed + n) for n in range(count)]`:
    /// every image of a batch can be reproduced alone with `count` 1, and batching never changes
    /// which noise an image gets.
    pub seed: u64,
    /// Images of this request, denoised as one batch.
    pub count: usize,
}

/// Where a generation spent its time, in seconds. Device work is synchronised at each boundary,
/// so the stages add up to the wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    pub encode_prompt: f64,
    pub denoise: f64,
    pub decode: f64,
}

/// The images of a [`SdxlPipeline::generate_batch`] call, per request, in request order.
#[derive(Debug)]
pub struct BatchOutput {
    pub images: Vec<Vec<RgbImage>>,
    pub times: StageTimes,
}

/// What a loaded pipeline found out about its checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedInfo {
    pub prediction_type: PredictionType,
    pub flags: ldm::CheckpointFlags,
}

/// The SDXL text-to-image pipeline.
#[derive(Debug)]
pub struct SdxlPipeline {
    clip_l: ClipTextModel,
    clip_g: ClipTextModel,
    tok_l: ClipTokenizer,
    tok_g: ClipTokenizer,
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    scheduler: SchedulerConfig,
    device: Device,
    dtype: Kind,
    vae_dtype: Kind,
    tiling: Tiling,
    info: LoadedInfo,
    /// The LoRAs fused for the current job, with what restores the base.
    loras: JobLoras,
    /// The UNet forward's CUDA graph, when `PipelineConfig::cuda_graphs` is on. Behind a mutex
    /// because generation takes `&self`; one generation runs at a time on the model thread.
    unet_graph: Option<Mutex<GraphedUNet>>,
    settings: SdxlSettings,
}

/// Tokenizers 1 and 2 from `dir/tokenizer{,_2}` (see [`ClipTokenizer::from_dir`]), else the bundled
/// one with SDXL's pad tokens (`<|endoftext|>` and `!`).
fn tokenizers(dir: Option<&Path>) -> Result<(ClipTokenizer, ClipTokenizer), LoadError> {
    let one = |sub: &str, pad: &str| match dir {
        Some(d) if d.join(sub).is_dir() => ClipTokenizer::from_dir(&d.join(sub), pad),
        _ => ClipTokenizer::bundled(pad),
    };
    Ok((one("tokenizer", "<|endoftext|>")?, one("tokenizer_2", "!")?))
}

/// The components LoRAs patch, by the component a LoRA key names.
fn lora_targets<'a>(
    unet: &'a mut UNet2DConditionModel,
    clip_l: &'a mut ClipTextModel,
    clip_g: &'a mut ClipTextModel,
) -> [TargetRef<'a>; 3] {
    [
        TargetRef {
            component: Component::Denoiser,
            target: unet,
        },
        TargetRef {
            component: Component::TextEncoder,
            target: clip_l,
        },
        TargetRef {
            component: Component::TextEncoder2,
            target: clip_g,
        },
    ]
}

/// Whether `settings` can run on `device` with this binary: graph capture where graphs can be
/// captured, the operator shim where a setting needs it, the fused kernels compiled for the device
/// (so that a GPU or driver NVRTC cannot serve fails now, with the compiler's log).
fn check_settings(settings: &SdxlSettings, device: Device) -> Result<(), LoadError> {
    settings.validate().map_err(|reason| LoadError::Setting {
        setting: "settings",
        reason,
    })?;
    if settings.cuda_graphs {
        cuda_graph::check_available(device)?;
    }
    // Settings that need the operator shim (csrc/ops.cpp, csrc/rtc.cpp).
    for (asked, setting) in [
        (settings.ff_gelu == FfGelu::Epilogue, "ff_gelu = epilogue"),
        (
            settings.norm_kernels == NormKernels::Fused,
            "norm_kernels = fused",
        ),
    ] {
        if asked && !ops::BUILT_IN {
            return Err(LoadError::Setting {
                setting,
                reason: ops::NOT_BUILT_IN.into(),
            });
        }
    }
    if settings.norm_kernels == NormKernels::Fused {
        // Compiled now, so that a GPU or driver NVRTC cannot serve fails the load.
        fused::prepare(device).map_err(|reason| LoadError::Setting {
            setting: "norm_kernels = fused",
            reason,
        })?;
    }
    Ok(())
}

impl SdxlPipeline {
    /// Loads every component straight to `config.device` in `config.dtype`.
    pub fn load(config: &PipelineConfig) -> Result<Self, LoadError> {
        let _guard = tch::no_grad_guard();
        let c = &config.components;
        let settings = &config.settings;
        check_settings(settings, config.device)?;
        let (dev, dt, imp) = (config.device, config.dtype, settings.attention);
        let (unet_cfg, vae_cfg, l_cfg, g_cfg, mut sched, stores, flags, tok_dir) =
            match &config.source {
                ModelSource::SingleFile(path) => {
                    let file = open(path)?;
                    let flags = ldm::detect_flags(&file);
                    let unet_cfg = c.unet.clone().unwrap_or_else(UNetConfig::sdxl_base);
                    let vae_cfg = c.vae.clone().unwrap_or_else(VaeConfig::sdxl);
                    let s = ldm::stores(
                        file,
                        unet_cfg.layers_per_block as usize,
                        vae_cfg.block_out_channels.len(),
                    );
                    (
                        unet_cfg,
                        vae_cfg,
                        c.clip_l.clone().unwrap_or_else(ClipTextConfig::sdxl_clip_l),
                        c.clip_g.clone().unwrap_or_else(ClipTextConfig::sdxl_clip_g),
                        c.scheduler.clone().unwrap_or_else(SchedulerConfig::sdxl),
                        [s.unet, s.vae, s.clip_l, s.clip_g],
                        flags,
                        config.tokenizer_dir.clone(),
                    )
                }
                ModelSource::DiffusersFolder(dir) => {
                    let filled = c.fill_from_dir(dir)?;
                    let (unet_cfg, vae_cfg, l_cfg, g_cfg) = (
                        filled.unet.expect("filled"),
                        filled.vae.expect("filled"),
                        filled.clip_l.expect("filled"),
                        filled.clip_g.expect("filled"),
                    );
                    let sched = filled.scheduler.unwrap_or_else(SchedulerConfig::sdxl);
                    let keep = |k: &str| Some(k.to_string());
                    let clip = crate::sdxl::clip::canonical_key;
                    (
                        unet_cfg,
                        vae_cfg,
                        l_cfg,
                        g_cfg,
                        sched,
                        [
                            component_store(&dir.join("unet"), "diffusion_pytorch_model", keep)?,
                            component_store(&dir.join("vae"), "diffusion_pytorch_model", keep)?,
                            component_store(&dir.join("text_encoder"), "model", clip)?,
                            component_store(&dir.join("text_encoder_2"), "model", clip)?,
                        ],
                        ldm::CheckpointFlags::default(),
                        Some(config.tokenizer_dir.clone().unwrap_or_else(|| dir.clone())),
                    )
                }
            };
        let prediction_type = config
            .prediction_type
            .or(flags.prediction_type)
            .unwrap_or(sched.prediction_type);
        sched.prediction_type = prediction_type;
        let [unet_s, vae_s, l_s, g_s] = stores;
        let w = |s: WeightStore, kind: Kind| Weights::new(Arc::new(s), dev, kind);
        // The tokenizers (about 0.1 s each to parse) load while the weights do.
        let toks = std::thread::spawn(move || tokenizers(tok_dir.as_deref()));
        let vae_dt = config.vae_dtype;
        let others = || -> Result<_, LoadError> {
            Ok((
                ClipTextModel::new(&w(l_s, dt), &l_cfg, imp)?,
                ClipTextModel::new(&w(g_s, dt), &g_cfg, imp)?,
                AutoencoderKL::new(&w(vae_s, vae_dt), &vae_cfg, imp)?.with_runtime(VaeRuntime {
                    memory_budget_mib: settings.vae_memory_budget_mib,
                    memory_format: settings.vae_memory_format,
                }),
            ))
        };
        let unet = || UNet2DConditionModel::new(&w(unet_s, dt), &unet_cfg, imp);
        let (unet, others) = if config.parallel_load {
            // The UNet (three quarters of the bytes) loads on a second thread while the rest
            // loads here: two reads from the page cache at once (docs/performance.md).
            std::thread::scope(|scope| {
                let unet = crate::loading::stream::spawn(scope, unet);
                let others = others();
                let unet = unet
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (unet, others)
            })
        } else {
            let others = others();
            (unet(), others)
        };
        let (clip_l, clip_g, vae) = others?;
        let mut unet = unet?;
        unet.set_ff_gelu(settings.ff_gelu);
        unet.set_memory_format(settings.unet_memory_format);
        unet.set_norm_kernels(settings.norm_kernels);
        let (tok_l, tok_g) = toks
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        Ok(Self {
            clip_l,
            clip_g,
            tok_l,
            tok_g,
            unet,
            vae,
            scheduler: sched,
            device: dev,
            dtype: dt,
            vae_dtype: config.vae_dtype,
            tiling: config.vae_tiling,
            info: LoadedInfo {
                prediction_type,
                flags,
            },
            loras: JobLoras::default(),
            unet_graph: settings.cuda_graphs.then(|| Mutex::new(GraphedUNet::new())),
            settings: *settings,
        })
    }

    /// Makes the UNet and both text encoders carry exactly `loras` (none: the weights as loaded).
    /// The same set as the previous call (same files unchanged on disk, strengths, order) costs
    /// nothing; another set puts the loaded weights back bit for bit first, then fuses the new
    /// one in fp32 (`W += strength · alpha/rank · up @ down`). A file that cannot be used (key
    /// styles: `loading::lora`) is [`GenerateError::InvalidRequest`] naming the file and the key,
    /// and leaves the base weights.
    pub fn set_loras(&mut self, loras: &[LoraSpec]) -> Result<LoraSwitch, GenerateError> {
        let mut targets = lora_targets(&mut self.unet, &mut self.clip_l, &mut self.clip_g);
        let switch = self.loras.set(loras, &mut targets);
        if switch.as_ref().is_ok_and(|s| !s.changed()) {
            return Ok(switch?);
        }
        // Fusing replaces the UNet's weight tensors: they take the UNet's memory order again, and
        // the graph, which reads the ones it was captured with, is dropped.
        let format = self.unet.memory_format();
        self.unet.set_memory_format(format);
        self.invalidate_unet_graph();
        Ok(switch?)
    }

    /// One UNet forward as the denoising loop runs it: replayed from the graph of its shape when
    /// graphs are on, eagerly otherwise.
    pub fn unet_step(
        &self,
        sample: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        added: &AddedCond<'_>,
    ) -> Result<Tensor, GenerateError> {
        match &self.unet_graph {
            Some(graph) => graph
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .forward(&self.unet, sample, timestep, context, added)
                .map_err(|e| GenerateError::Backend(e.to_string())),
            None => Ok(self.unet.forward(sample, timestep, context, added)),
        }
    }

    /// Runs with other settings from now on, without loading again: what `vnfarm-worker check`
    /// compares. Checked as at load (graphs on a CUDA device of a shim build, the operator shim,
    /// the kernels compiled); the attention implementation is chosen at load and cannot change
    /// here.
    pub fn apply_settings(&mut self, settings: &SdxlSettings) -> Result<(), LoadError> {
        let current = self.settings;
        if settings.attention != current.attention {
            return Err(LoadError::Setting {
                setting: "attention",
                reason: "chosen at load; load the pipeline again to change it".into(),
            });
        }
        check_settings(settings, self.device)?;
        self.unet.set_ff_gelu(settings.ff_gelu);
        self.unet.set_memory_format(settings.unet_memory_format);
        self.unet.set_norm_kernels(settings.norm_kernels);
        self.vae.set_runtime(VaeRuntime {
            memory_budget_mib: settings.vae_memory_budget_mib,
            memory_format: settings.vae_memory_format,
        });
        self.unet_graph = settings.cuda_graphs.then(|| Mutex::new(GraphedUNet::new()));
        self.settings = *settings;
        Ok(())
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The VAE's dtype.
    pub fn vae_dtype(&self) -> Kind {
        self.vae_dtype
    }

    /// The settings it runs.
    pub fn settings(&self) -> &SdxlSettings {
        &self.settings
    }

    fn invalidate_unet_graph(&mut self) {
        if let Some(graph) = &mut self.unet_graph {
            graph
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .invalidate();
        }
    }

    /// What the current LoRA set fused, per file (`None`: no LoRA).
    pub fn lora_report(&self) -> Option<&LoraReport> {
        self.loras.report()
    }

    /// The components LoRAs patch: the UNet (`lora_unet_`, `unet.`), CLIP-L (`lora_te1_`,
    /// `text_encoder.`) and bigG (`lora_te2_`, `text_encoder_2.`). Drops the UNet's CUDA graph:
    /// the caller may replace weights through these.
    pub fn lora_targets(&mut self) -> [TargetRef<'_>; 3] {
        self.invalidate_unet_graph();
        lora_targets(&mut self.unet, &mut self.clip_l, &mut self.clip_g)
    }

    /// What the loader detected (prediction type and checkpoint flags).
    pub fn info(&self) -> LoadedInfo {
        self.info
    }

    pub fn unet(&self) -> &UNet2DConditionModel {
        &self.unet
    }

    pub fn vae(&self) -> &AutoencoderKL {
        &self.vae
    }

    pub fn text_encoders(&self) -> (&ClipTextModel, &ClipTextModel) {
        (&self.clip_l, &self.clip_g)
    }

    /// The prompt encoder over this pipeline's text encoders and tokenizers.
    pub fn prompt_encoder(&self) -> PromptEncoder<'_> {
        PromptEncoder {
            clip_l: EncoderPair {
                model: &self.clip_l,
                tokenizer: &self.tok_l,
            },
            clip_g: EncoderPair {
                model: &self.clip_g,
                tokenizer: &self.tok_g,
            },
        }
    }

    fn validate(&self, r: &GenerateRequest) -> Result<(), GenerateError> {
        let f = self.vae.config().scale_factor() as u32;
        let bad = |m: String| Err(GenerateError::InvalidRequest(m));
        if r.width == 0
            || r.height == 0
            || !r.width.is_multiple_of(f)
            || !r.height.is_multiple_of(f)
        {
            return bad(format!(
                "width and height must be positive multiples of {f}, got {}x{}",
                r.width, r.height
            ));
        }
        if r.steps == 0 {
            return bad("steps must be at least 1".into());
        }
        if r.count == 0 {
            return bad("count must be at least 1".into());
        }
        if !r.cfg.is_finite() {
            return bad("cfg must be finite".into());
        }
        Ok(())
    }

    /// Each request valid, and all of them able to share one batch: the same size, steps and
    /// sampler, and guidance on for all or for none.
    fn validate_batch(&self, requests: &[GenerateRequest]) -> Result<(), GenerateError> {
        let Some(first) = requests.first() else {
            return Err(GenerateError::InvalidRequest("empty batch".into()));
        };
        let shape = |r: &GenerateRequest| (r.width, r.height, r.steps, r.sampler, r.cfg > 1.0);
        for r in requests {
            self.validate(r)?;
            if shape(r) != shape(first) {
                return Err(GenerateError::InvalidRequest(
                    "requests in one batch must share width, height, steps, sampler and whether \
                     guidance is on (cfg > 1)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Waits for the work this thread queued on the device (not other threads' loads on their
    /// own streams), so that a host clock measures it.
    fn synchronize(&self) {
        crate::nn::stream::synchronize_current(self.device);
    }

    /// Generates `request.count` images. `progress(step, total)` is called after every step;
    /// `cancel()` is polled before every step.
    pub fn generate(
        &self,
        request: &GenerateRequest,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<Vec<RgbImage>, GenerateError> {
        let mut out = self.generate_batch(std::slice::from_ref(request), progress, cancel)?;
        Ok(out.images.pop().unwrap_or_default())
    }

    /// Denoises several requests as one batch (one UNet forward per step for all their images)
    /// and returns each request's images. The requests must share size, steps, sampler and
    /// whether guidance is on, and their prompts must encode to the same number of 77-token
    /// windows (a shorter prompt is not padded to a longer one's length: that would change its
    /// image); prompts, negative prompts, cfg, seeds and counts may differ. Every image is the one
    /// its request would get alone, up to the floating-point effects of the batch size on the
    /// device's kernels.
    ///
    /// tch reports libtorch failures inside tensor operations (out of device memory, a device
    /// error) by panicking; such a panic is contained here and returned as
    /// [`GenerateError::Backend`], so a request cannot bring the worker down. The pipeline holds
    /// no state that a half-finished generation could leave inconsistent.
    pub fn generate_batch(
        &self,
        requests: &[GenerateRequest],
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<BatchOutput, GenerateError> {
        let run = std::panic::AssertUnwindSafe(|| {
            let mut times = StageTimes::default();
            let latents = self.denoise_batch(requests, progress, cancel, &mut times)?;
            let started = std::time::Instant::now();
            let mut images = self.decode_to_images(&latents)?.into_iter();
            times.decode = started.elapsed().as_secs_f64();
            let images = requests
                .iter()
                .map(|r| images.by_ref().take(r.count).collect())
                .collect();
            Ok(BatchOutput { images, times })
        });
        contain_backend_panics(run)
    }

    /// Conditioning rows for a batch: `(context, pooled)` with, under guidance, every image's
    /// negative rows first and then every image's positive rows (diffusers' order).
    fn condition_batch(
        &self,
        requests: &[GenerateRequest],
        guided: bool,
    ) -> Result<(Tensor, Tensor), GenerateError> {
        let enc = self.prompt_encoder();
        let (mut neg_rows, mut pos_rows, mut neg_pooled, mut pos_pooled) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut windows = None;
        for r in requests {
            let n = r.count as i64;
            let pos = enc.encode(&r.prompt).map_err(GenerateError::Tokenizer)?;
            let embeds = if guided {
                let neg = enc
                    .encode(&r.negative_prompt)
                    .map_err(GenerateError::Tokenizer)?;
                let (p, q) = enc.pad_to_same_length(pos.embeds, neg.embeds);
                neg_rows.push(q.repeat([n, 1, 1]));
                neg_pooled.push(neg.pooled.repeat([n, 1]));
                p
            } else {
                pos.embeds
            };
            let tokens = embeds.size()[1];
            if *windows.get_or_insert(tokens) != tokens {
                return Err(GenerateError::InvalidRequest(format!(
                    "prompts in one batch must encode to the same number of 77-token windows \
                     ({} and {} tokens)",
                    windows.unwrap_or_default(),
                    tokens
                )));
            }
            pos_rows.push(embeds.repeat([n, 1, 1]));
            pos_pooled.push(pos.pooled.repeat([n, 1]));
        }
        neg_rows.append(&mut pos_rows);
        neg_pooled.append(&mut pos_pooled);
        Ok((
            Tensor::cat(&neg_rows, 0).to_kind(self.dtype),
            Tensor::cat(&neg_pooled, 0).to_kind(self.dtype),
        ))
    }

    /// The denoising loop of a batch; returns the final latents of every image in request order.
    fn denoise_batch(
        &self,
        requests: &[GenerateRequest],
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
        times: &mut StageTimes,
    ) -> Result<Tensor, GenerateError> {
        self.validate_batch(requests)?;
        let _guard = tch::no_grad_guard();
        let first = &requests[0];
        let guided = first.cfg > 1.0;
        let started = std::time::Instant::now();
        let (context, pooled) = self.condition_batch(requests, guided)?;
        self.synchronize();
        times.encode_prompt = started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();

        let images: i64 = requests.iter().map(|r| r.count as i64).sum();
        let batch = if guided { 2 * images } else { images };
        let (h, w) = (f64::from(first.height), f64::from(first.width));
        let time_ids = Tensor::from_slice(&[h, w, 0.0, 0.0, h, w])
            .to_kind(self.dtype)
            .to_device(self.device)
            .view([1, 6])
            .repeat([batch, 1]);
        // One guidance scale for the batch is a scalar, as in diffusers; mixed ones a per-row
        // column.
        let uniform_cfg = requests.iter().all(|r| r.cfg == first.cfg);
        let cfg_column = (!uniform_cfg).then(|| {
            let per_image: Vec<f64> = requests
                .iter()
                .flat_map(|r| std::iter::repeat_n(r.cfg, r.count))
                .collect();
            Tensor::from_slice(&per_image)
                .to_kind(Kind::Float)
                .to_device(self.device)
                .view([-1, 1, 1, 1])
        });

        let mut scheduler = Scheduler::new(first.sampler, &self.scheduler, first.steps);
        let f = self.vae.config().scale_factor();
        let one = [
            1,
            self.unet.config().in_channels,
            i64::from(first.height) / f,
            i64::from(first.width) / f,
        ];
        // Every image's noise from its own generator, in diffusers' draw order: the initial
        // latents, then one draw per ancestral step. diffusers' randn_tensor draws on the CPU
        // generator in the latents' dtype.
        let draws = scheduler.noise_draws();
        let mut initial = Vec::with_capacity(images as usize);
        let mut ancestral: Vec<std::vec::IntoIter<Tensor>> = Vec::with_capacity(images as usize);
        for r in requests {
            for n in 0..r.count as u64 {
                let _generator = noise::seed(r.seed.wrapping_add(n));
                initial.push(noise::randn_cpu_as(&one, self.dtype));
                let later: Vec<Tensor> = (0..draws)
                    .map(|_| noise::randn_cpu_as(&one, self.dtype))
                    .collect();
                ancestral.push(later.into_iter());
            }
        }
        let mut latents =
            Tensor::cat(&initial, 0).to_device(self.device) * scheduler.init_noise_sigma();
        drop(initial);
        let mut noise_fn = |shape: &[i64]| {
            let next: Vec<Tensor> = ancestral
                .iter_mut()
                .map(|d| d.next().expect("noise drawn for every ancestral step"))
                .collect();
            let t = Tensor::cat(&next, 0);
            debug_assert_eq!(t.size(), shape);
            t.to_device(self.device)
        };
        let total = scheduler.timesteps().len();
        let timesteps = scheduler.timesteps().to_vec();
        for (i, &t) in timesteps.iter().enumerate() {
            if cancel() {
                return Err(GenerateError::Cancelled);
            }
            let input = if guided {
                Tensor::cat(&[&latents, &latents], 0)
            } else {
                latents.shallow_clone()
            };
            let input = scheduler.scale_model_input(&input, i);
            let t_tensor = Tensor::from_slice(&[t as f32]).to_device(self.device);
            let added = AddedCond {
                text_embeds: &pooled,
                time_ids: &time_ids,
            };
            let out = self.unet_step(&input, &t_tensor, &context, &added)?;
            let guided_out = if guided {
                let parts = out.chunk(2, 0);
                let delta = &parts[1] - &parts[0];
                match &cfg_column {
                    None => &parts[0] + delta * first.cfg,
                    Some(cfg) => (&parts[0] + delta * cfg).to_kind(out.kind()),
                }
            } else {
                out
            };
            latents = scheduler.step(&guided_out, i, &latents, &mut noise_fn);
            progress(i + 1, total);
        }
        self.synchronize();
        times.denoise = started.elapsed().as_secs_f64();
        Ok(latents)
    }

    /// Decodes latents one image at a time (the VAE gains nothing from batching, and one image's
    /// activations are the decode's peak memory) and converts to RGB8
    /// (`round(255·clamp(x/2 + 0.5, 0, 1))`).
    pub fn decode_to_images(&self, latents: &Tensor) -> Result<Vec<RgbImage>, GenerateError> {
        let _guard = tch::no_grad_guard();
        let mut out = Vec::with_capacity(latents.size()[0] as usize);
        for latent in latents.split(1, 0) {
            let z = latent.to_kind(self.vae_dtype) / self.vae.config().scaling_factor;
            let x = self.vae.decode(&z, self.tiling);
            out.push(tensor_to_rgb8(&x)?);
        }
        Ok(out)
    }

    /// Runs one step and a decode at each `(width, height)` so that kernels are compiled and
    /// memory pools sized before the first job.
    pub fn warm_up(&self, resolutions: &[(u32, u32)]) -> Result<(), GenerateError> {
        for &(width, height) in resolutions {
            let req = GenerateRequest {
                prompt: String::new(),
                negative_prompt: String::new(),
                width,
                height,
                steps: 1,
                cfg: 2.0,
                sampler: Sampler::Euler,
                seed: 0,
                count: 1,
            };
            self.generate(&req, &mut |_, _| {}, &|| false)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// The worker moves the pipeline onto its model thread.
    #[test]
    fn pipeline_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<super::SdxlPipeline>();
    }

    /// CUDA graphs are refused at load, before any file is read, where they cannot be captured.
    #[test]
    fn cuda_graphs_on_the_cpu_are_refused_at_load() {
        use super::*;
        let mut config = PipelineConfig::new(
            ModelSource::DiffusersFolder("/nonexistent".into()),
            Device::Cpu,
        );
        config.settings.cuda_graphs = true;
        let err = SdxlPipeline::load(&config).expect_err("no graphs on the CPU");
        assert!(
            matches!(
                err,
                LoadError::CudaGraphs(cuda_graph::GraphError::NotCuda(Device::Cpu))
            ),
            "{err}"
        );
    }
}
