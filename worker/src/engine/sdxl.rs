//! The SDXL engine: `generate` jobs on [`vnfarm_models::sdxl::pipeline::SdxlPipeline`], kept warm for the
//! worker's life.
//!
//! A job's images are denoised together, at most `max_batch` per UNet forward; the compatible jobs of
//! a batch message (same size, steps, sampler, guidance on or off, LoRA set) share those forwards through
//! `generate_batch`, and the others run one after another. Image `n` of a job uses seed `seed + n`
//! whatever the batching, so an image can always be reproduced alone. Progress is reported per job
//! after every denoising step; before every step the forward stops if all of its jobs were
//! cancelled (a job cancelled alone rides along and its images are discarded).
//!
//! A job's `loras` (files in `lora_dir`) are fused into the UNet and both text encoders before its
//! group runs, so only jobs with the same set share forwards. The next group with another set gets
//! the base weights back bit for bit first; consecutive jobs with the same set pay nothing
//! (`SdxlPipeline::set_loras`, `docs/performance.md` for the cost of a switch).
//!
//! With `catalogue_checkpoints` above 0, a job may name a checkpoint of the model catalogue that
//! the worker fetched for it: its group runs on that checkpoint's own pipeline, loaded like the
//! configured one and kept among the `catalogue_checkpoints` most recently used
//! (`catalogue_checkpoints.rs`); a file that does not load fails its jobs naming the file, so the
//! worker condemns it.

use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;

use vnfarm_models::error::GenerateError;
use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_models::schedulers::PredictionType;
use vnfarm_models::schedulers::Sampler;
use vnfarm_models::sdxl::pipeline::{
    ComponentConfigs, GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline,
};
use vnfarm_models::sdxl::vae::Tiling;
use vnfarm_models::settings::SdxlSettings;
use vnfarm_proto::catalogue::ContentHash;
use vnfarm_proto::{GenerateSpec, LoraRef, ModelFileRole, StageTimings, Task};

use crate::tuning::SettingsChoice;

use super::device::{Dtype, engine_error, open_device, parse_device, warm_up_sizes};
use super::{
    EngineError, EngineJob, EngineOutput, LoadedCheckpoints, LoraDir, OutputImage, Progress,
    Runnable, UsedFile, all_cancelled, answered, groups, together_or_alone, weight_files,
};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SdxlConfig {
    /// A single-file checkpoint (`.safetensors` with ldm key names: A1111 / CivitAI / ComfyUI) or
    /// a diffusers pipeline folder.
    pub checkpoint: PathBuf,
    /// The checkpoint's name, as generate jobs name it (`checkpoint`) and heartbeats advertise it.
    /// Unset: the file's name without its extension, or the folder's name.
    #[serde(default)]
    pub name: Option<String>,
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
    /// Overrides the checkpoint's own flag (`v_pred` key) and the scheduler config.
    #[serde(default)]
    pub prediction_type: Option<PredictionType>,
    /// `auto` decodes untiled while the estimated working memory of one image's decode fits the
    /// settings' `vae_memory_budget_mib`, and with the seam-free tiled decode (whole-image GroupNorm
    /// statistics) beyond it; `always` is diffusers' tiled decode; `never`.
    #[serde(default)]
    pub vae_tiling: VaeTiling,
    /// `[width, height]` sizes run once (one step and a decode) before the worker takes jobs.
    #[serde(default = "default_warm_up")]
    pub warm_up: Vec<[u32; 2]>,
    /// Images per UNet forward, over all the jobs that share it; a job with more images runs in
    /// several forwards.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Kernel and layout choices (`vnfarm_models::settings::SdxlSettings`): a preset's name
    /// (`"portable"`, the default, or `"cuda"`) or a table of them (`attention`, `cuda_graphs`,
    /// `ff_gelu`, `unet_memory_format`, `norm_kernels`, `vae_memory_format`,
    /// `vae_memory_budget_mib`; unset keys are the portable preset's). With `engine.settings_file`
    /// the file decides and this must be unset.
    #[serde(default)]
    pub settings: Option<SettingsChoice<SdxlSettings>>,
    /// Where jobs' `loras` are looked up: `<lora_dir>/<name>` or `<lora_dir>/<name>.safetensors`
    /// (kohya, diffusers/PEFT or LyCORIS LoCon files).
    #[serde(default)]
    pub lora_dir: Option<PathBuf>,
    /// How many checkpoints of the model catalogue it keeps loaded besides `checkpoint` (0: it
    /// serves only its own). Above 0 it takes generates naming a catalogue checkpoint, fetches the
    /// file into the model cache and loads it as it loads `checkpoint` (a single file, with the
    /// same `config_dir`, `tokenizer_dir`, dtypes and settings; not warmed up), the least
    /// recently used one unloaded first. Each costs a checkpoint's memory on the device.
    #[serde(default)]
    pub catalogue_checkpoints: u32,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum VaeTiling {
    #[default]
    Auto,
    Always,
    Never,
}

/// The most catalogue checkpoints a worker keeps loaded (each is a whole SDXL on the device).
pub const MAX_CATALOGUE_CHECKPOINTS: u32 = 16;

// Field defaults rather than a struct-wide `#[serde(default)]`: `checkpoint` is required, and a
// `Default` of the whole section would let one without it decode.
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
    /// The checkpoint's name: `name`, else the file's stem or the folder's name.
    pub fn name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        let path = &self.checkpoint;
        let single_file = path
            .extension()
            .is_some_and(|e| e == "safetensors" || e == "ckpt" || e == "sft");
        let name = if single_file {
            path.file_stem()
        } else {
            path.file_name()
        };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The checkpoint file, or the weight files of the diffusers folder.
    pub fn files(&self) -> Vec<UsedFile> {
        if self.checkpoint.is_dir() {
            weight_files(&self.checkpoint)
        } else {
            vec![UsedFile::named_by_file(
                &self.checkpoint,
                ModelFileRole::Checkpoint,
            )]
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.name().trim().is_empty() {
            return Err("engine.sdxl.name: the checkpoint needs a name (set `name`)".into());
        }
        parse_device(&self.device).map_err(|e| format!("engine.sdxl.device: {e}"))?;
        if self.vae_dtype == Dtype::Fp16 {
            return Err(
                "engine.sdxl.vae_dtype: fp16 overflows in the SDXL VAE; use bf16 or fp32".into(),
            );
        }
        if !(1..=64).contains(&self.max_batch) {
            return Err("engine.sdxl.max_batch: must be 1..=64".into());
        }
        if self.catalogue_checkpoints > MAX_CATALOGUE_CHECKPOINTS {
            return Err(format!(
                "engine.sdxl.catalogue_checkpoints: at most {MAX_CATALOGUE_CHECKPOINTS}"
            ));
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
    name: String,
    files: Vec<UsedFile>,
    lora_dir: LoraDir,
    /// What loads a catalogue checkpoint: the configured one's settings.
    config: SdxlConfig,
    settings: SdxlSettings,
    /// Catalogue checkpoints loaded for jobs that named them (`catalogue_checkpoints`).
    catalogue: LoadedCheckpoints<SdxlPipeline>,
}

/// Which loaded pipeline a job runs on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Checkpoint {
    /// `engine.sdxl.checkpoint`.
    Configured,
    /// A catalogue checkpoint, by hash (its file fetched for the job).
    Catalogue(ContentHash),
}

impl SdxlEngine {
    /// The most images in one UNet forward.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Loads the checkpoint onto the device and warms up at every configured size. Any failure
    /// (missing file, missing or misshapen tensor, no device) is an error naming what is wrong.
    pub fn load(config: &SdxlConfig, settings: SdxlSettings) -> anyhow::Result<Self> {
        let engine = Self::load_cold(config, settings)?;
        engine.warm_up()?;
        Ok(engine)
    }

    /// [`SdxlEngine::load`] without the warm-up (see [`SdxlEngine::warm_up`]).
    pub fn load_cold(config: &SdxlConfig, settings: SdxlSettings) -> anyhow::Result<Self> {
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
        let pipeline = load_pipeline(config, settings, source)?;
        Ok(Self {
            pipeline,
            max_batch: config.max_batch as usize,
            name: config.name(),
            files: config.files(),
            lora_dir: LoraDir::new(config.lora_dir.clone(), "engine.sdxl.lora_dir"),
            catalogue: LoadedCheckpoints::new(config.catalogue_checkpoints as usize),
            config: config.clone(),
            settings,
        })
    }

    /// Runs every configured warm-up size once (one step and a decode: kernel selection, memory
    /// pools, CUDA graph capture where set) before the worker takes jobs.
    pub fn warm_up(&self) -> anyhow::Result<()> {
        warm_up_sizes("SDXL", &self.config.warm_up, |w, h| {
            self.pipeline.warm_up(&[(w, h)])
        })
    }

    /// The pipeline of a job's checkpoint, loading a catalogue checkpoint that is not loaded (a
    /// failure names the file, so the worker condemns it).
    fn ready(&mut self, job: &EngineJob) -> Result<Checkpoint, EngineError> {
        let Some(fetched) = &job.checkpoint else {
            return Ok(Checkpoint::Configured);
        };
        let (config, settings) = (&self.config, &self.settings);
        let started = Instant::now();
        let loaded = self.catalogue.get_or_load(&fetched.sha256, || {
            load_pipeline(
                config,
                *settings,
                ModelSource::SingleFile(fetched.path.clone()),
            )
        });
        match loaded {
            Ok(Some(_)) => Ok(Checkpoint::Catalogue(fetched.sha256.clone())),
            Ok(None) => Err(EngineError::NoCheckpoint(fetched.name.clone())),
            Err(e) => {
                let message = format!("{e:#}");
                tracing::warn!(checkpoint = fetched.name, sha256 = %fetched.sha256, seconds = started.elapsed().as_secs_f64(), error = message, "a catalogue checkpoint failed to load");
                // Out of memory or a lost device is not the file's fault; anything else is.
                Err(
                    match engine_error(GenerateError::Backend(message.clone()), None) {
                        EngineError::Failed(_) => EngineError::InvalidInput(format!(
                            "checkpoint `{}` (sha256:{}) is not a usable SDXL checkpoint: {message}",
                            fetched.name, fetched.sha256
                        )),
                        other => other,
                    },
                )
            }
        }
    }

    /// The loaded pipeline of `which` ([`SdxlEngine::ready`] loaded it).
    fn pipeline_of(&self, which: &Checkpoint) -> Result<&SdxlPipeline, EngineError> {
        match which {
            Checkpoint::Configured => Ok(&self.pipeline),
            Checkpoint::Catalogue(sha256) => self.catalogue.get(sha256).ok_or_else(|| {
                EngineError::Failed(format!(
                    "catalogue checkpoint sha256:{sha256} is not loaded"
                ))
            }),
        }
    }

    /// The loaded pipeline, for `vnfarm-worker check`, which drives it directly.
    pub fn into_pipeline(self) -> SdxlPipeline {
        self.pipeline
    }

    pub fn pipeline(&self) -> &SdxlPipeline {
        &self.pipeline
    }

    pub fn pipeline_mut(&mut self) -> &mut SdxlPipeline {
        &mut self.pipeline
    }

    /// The files a generate's images are made from: the checkpoint's, then the job's LoRAs (by
    /// the job's names, with their weights).
    pub fn files(&self, job: &EngineJob) -> Vec<UsedFile> {
        let mut files = match &job.checkpoint {
            Some(fetched) => vec![fetched.used_file()],
            None => self.files.clone(),
        };
        if let Task::Generate(g) = &job.task {
            files.extend(self.lora_dir.used_files(&g.loras, &job.fetched));
        }
        files
    }

    /// Runs a batch: compatible jobs (same shape and LoRA set) share UNet forwards, the others run
    /// one after another; each group's LoRA set is fused before it runs (nothing to do when it is
    /// the set already fused). One result per job.
    pub fn run_batch(
        &mut self,
        jobs: &[&EngineJob],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Vec<Result<EngineOutput, EngineError>> {
        let Runnable {
            mut results,
            runnable,
            prepared: loras,
        } = Runnable::of(jobs, |job| self.prepare(job));
        let members: Vec<&EngineJob> = runnable.iter().map(|&i| jobs[i]).collect();
        for group in groups(&members, forward_key) {
            let switched = self.ready(members[group[0]]).and_then(|which| {
                let cancelled = || all_cancelled(group.iter().map(|&k| &members[k].cancel));
                let seconds = self
                    .switch_loras(&which, &loras[group[0]])
                    .map_err(|e| engine_error(e, cancelled()))?;
                Ok((which, seconds))
            });
            let (which, lora_seconds) = match switched {
                Ok(switched) => switched,
                Err(e) => {
                    for &k in &group {
                        results[runnable[k]] = Some(Err(e.clone()));
                    }
                    continue;
                }
            };
            let answers = together_or_alone(&members, &group, |together| {
                self.generate(&which, &members, together, &mut |k, p| {
                    progress(runnable[k], p)
                })
            });
            let share = 1.0 / group.len() as f64;
            for (k, mut answer) in answers {
                if let (Ok(out), Some(seconds)) = (&mut answer, lora_seconds) {
                    out.timings.add("lora", seconds * share);
                }
                results[runnable[k]] = Some(answer);
            }
        }
        answered(results)
    }

    /// Makes the pipeline of `which` carry `specs`; the seconds it took when the set changed.
    fn switch_loras(
        &mut self,
        which: &Checkpoint,
        specs: &[LoraSpec],
    ) -> Result<Option<f64>, GenerateError> {
        let started = Instant::now();
        let pipeline = match which {
            Checkpoint::Configured => &mut self.pipeline,
            Checkpoint::Catalogue(sha256) => match self.catalogue.touch(sha256) {
                Some(pipeline) => pipeline,
                // `ready` loaded it just now; nothing ran in between.
                None => return Ok(None),
            },
        };
        let switch = pipeline.set_loras(specs)?;
        if !switch.changed() {
            return Ok(None);
        }
        let seconds = started.elapsed().as_secs_f64();
        let names: Vec<String> = specs
            .iter()
            .map(|s| format!("{}:{}", s.path.display(), s.strength))
            .collect();
        tracing::info!(
            loras = %names.join(", "),
            restored = switch.restored,
            seconds,
            "SDXL LoRA set switched"
        );
        Ok(Some(seconds))
    }

    /// Why this engine cannot run the job at all, if it cannot; else the job's LoRA files.
    fn prepare(&self, job: &EngineJob) -> Result<Vec<LoraSpec>, EngineError> {
        let Task::Generate(spec) = &job.task else {
            return Err(EngineError::Unsupported(job.task.model()));
        };
        if spec.seed.is_none() {
            return Err(EngineError::InvalidInput(
                "generate without a resolved seed".into(),
            ));
        }
        match (&spec.checkpoint, &job.checkpoint) {
            // Fetched from the catalogue for it: loaded when its group runs.
            (Some(name), Some(fetched)) if *name == fetched.name => {}
            (Some(name), _) if *name != self.name => {
                return Err(EngineError::NoCheckpoint(name.clone()));
            }
            (Some(_) | None, _) => {}
        }
        self.lora_dir.resolve(&spec.loras, &job.fetched)
    }

    /// Generates the images of `together` (indices into `jobs`, compatible generates) in forwards of
    /// at most `max_batch` images; one output per job, in order. A forward's stage times are split
    /// across its jobs by their share of its images.
    fn generate(
        &self,
        which: &Checkpoint,
        jobs: &[&EngineJob],
        together: &[usize],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Result<Vec<EngineOutput>, EngineError> {
        let specs: Vec<&GenerateSpec> = together
            .iter()
            .map(|&i| match &jobs[i].task {
                Task::Generate(spec) => Ok(spec),
                other => Err(EngineError::Unsupported(other.model())),
            })
            .collect::<Result<_, _>>()?;
        let pipeline = self.pipeline_of(which)?;
        let forwards = pack(&specs, self.max_batch);
        // Each job's progress runs over all the forwards it is in.
        let mut in_forwards = vec![0u32; specs.len()];
        for forward in &forwards {
            for (k, _) in forward {
                in_forwards[*k] += 1;
            }
        }
        let mut done = vec![0u32; specs.len()];
        let mut outputs: Vec<EngineOutput> = specs
            .iter()
            .map(|spec| EngineOutput {
                images: Vec::with_capacity(spec.count as usize),
                seeds: image_seeds(spec),
                timings: StageTimings::default(),
                encode_cache: None,
                files: Vec::new(),
            })
            .collect();
        for forward in &forwards {
            let requests: Vec<GenerateRequest> = forward.iter().map(|(_, r)| r.clone()).collect();
            let cancels = || all_cancelled(forward.iter().map(|(k, _)| &jobs[together[*k]].cancel));
            let out = pipeline
                .generate_batch(
                    &requests,
                    &mut |step, _| {
                        for (k, _) in forward {
                            let steps = specs[*k].steps;
                            progress(
                                together[*k],
                                Progress {
                                    step: done[*k] * steps + step as u32,
                                    total: steps * in_forwards[*k],
                                },
                            );
                        }
                    },
                    &|| cancels().is_some(),
                )
                .map_err(|e| engine_error(e, cancels()))?;
            let images: usize = requests.iter().map(|r| r.count).sum();
            for ((k, request), produced) in forward.iter().zip(out.images) {
                let share = request.count as f64 / images.max(1) as f64;
                let timings = &mut outputs[*k].timings;
                timings.add("encode_prompt", out.times.encode_prompt * share);
                timings.add("denoise", out.times.denoise * share);
                timings.add("decode", out.times.decode * share);
                outputs[*k].images.extend(
                    produced
                        .into_iter()
                        .map(|image| OutputImage::Finished(image::DynamicImage::ImageRgb8(image))),
                );
                done[*k] += 1;
            }
        }
        Ok(outputs)
    }
}

/// The pipeline of `source` as `config` says to load it (device, dtypes, prediction type, VAE
/// tiling, component configs and tokenizers, settings): the configured checkpoint and the
/// catalogue's are loaded alike. Any failure names the file.
fn load_pipeline(
    config: &SdxlConfig,
    settings: SdxlSettings,
    source: ModelSource,
) -> anyhow::Result<SdxlPipeline> {
    let device = open_device(&config.device, "engine.sdxl.device")?;
    let (path, folder) = match &source {
        ModelSource::DiffusersFolder(dir) => (dir.clone(), Some(dir.clone())),
        ModelSource::SingleFile(file) => (file.clone(), None),
    };
    let mut pc = PipelineConfig::new(source, device);
    pc.dtype = config.dtype.kind();
    pc.vae_dtype = config.vae_dtype.kind();
    pc.prediction_type = config.prediction_type;
    pc.settings = settings;
    pc.vae_tiling = match config.vae_tiling {
        VaeTiling::Auto => Tiling::Auto,
        VaeTiling::Always => Tiling::Always,
        VaeTiling::Never => Tiling::Never,
    };
    // Component configs: `config_dir`'s, else a diffusers folder's own, else (single file) the
    // SDXL base presets inside the pipeline.
    let config_dir = config.config_dir.as_ref();
    if let Some(dir) = config_dir.or(folder.as_ref()) {
        pc.components = ComponentConfigs::default().fill_from_dir(dir)?;
    }
    pc.tokenizer_dir = config.tokenizer_dir.clone().or_else(|| {
        config
            .config_dir
            .clone()
            .filter(|d| d.join("tokenizer").is_dir())
    });
    let started = Instant::now();
    let pipeline = SdxlPipeline::load(&pc)
        .map_err(|e| anyhow::anyhow!("loading SDXL from {}: {e}", path.display()))?;
    tracing::info!(
        checkpoint = %path.display(),
        ?device,
        prediction = ?pipeline.info().prediction_type,
        seconds = started.elapsed().as_secs_f64(),
        "SDXL loaded"
    );
    Ok(pipeline)
}

/// What generates must share to run in one forward: the checkpoint (a catalogue one by hash),
/// size, steps, sampler, guidance on or off, and the LoRA set (names and weights, in order: the
/// weights the forward runs with).
type ForwardKey = (
    Option<ContentHash>,
    (u32, u32),
    u32,
    vnfarm_proto::Sampler,
    bool,
    Vec<LoraRef>,
);

fn forward_key(job: &EngineJob) -> Option<ForwardKey> {
    match &job.task {
        Task::Generate(g) => Some((
            job.checkpoint.as_ref().map(|c| c.sha256.clone()),
            (g.width, g.height),
            g.steps,
            g.sampler,
            g.cfg > 1.0,
            g.loras.clone(),
        )),
        Task::Edit(_) | Task::Upscale(_) => None,
    }
}

/// The seed of each of a job's images: `seed + n` for image `n`.
fn image_seeds(spec: &GenerateSpec) -> Vec<Option<u64>> {
    let seed = spec.seed.unwrap_or_default();
    (0..u64::from(spec.count))
        .map(|n| Some(seed.wrapping_add(n)))
        .collect()
}

/// The images of several compatible jobs as UNet forwards of at most `max_batch` images, filled in
/// job order: each forward lists `(job, request)`, a job's images possibly spread over several
/// forwards, each request keeping its images' seeds.
fn pack(specs: &[&GenerateSpec], max_batch: usize) -> Vec<Vec<(usize, GenerateRequest)>> {
    let max_batch = max_batch.max(1);
    let mut forwards: Vec<Vec<(usize, GenerateRequest)>> = Vec::new();
    let mut room = 0;
    for (k, spec) in specs.iter().enumerate() {
        let seed = spec.seed.unwrap_or_default();
        let mut first = 0;
        let count = spec.count as usize;
        while first < count {
            if room == 0 {
                forwards.push(Vec::new());
                room = max_batch;
            }
            let take = room.min(count - first);
            let mut request = request(spec);
            request.seed = seed.wrapping_add(first as u64);
            request.count = take;
            forwards
                .last_mut()
                .expect("a forward was pushed above")
                .push((k, request));
            first += take;
            room -= take;
        }
    }
    forwards
}

/// A job's spec as a pipeline request (seed and count set by the caller).
fn request(spec: &GenerateSpec) -> GenerateRequest {
    GenerateRequest {
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
        seed: spec.seed.unwrap_or_default(),
        count: spec.count as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(count: u32, seed: u64) -> GenerateSpec {
        GenerateSpec {
            prompt: "p".into(),
            negative_prompt: String::new(),
            width: 64,
            height: 64,
            steps: 3,
            cfg: 4.5,
            sampler: vnfarm_proto::Sampler::EulerAncestral,
            seed: Some(seed),
            count,
            checkpoint: None,
            loras: Vec::new(),
        }
    }

    /// Each forward as `(job, seed, count)`.
    fn shape(forwards: &[Vec<(usize, GenerateRequest)>]) -> Vec<Vec<(usize, u64, usize)>> {
        forwards
            .iter()
            .map(|f| f.iter().map(|(k, r)| (*k, r.seed, r.count)).collect())
            .collect()
    }

    #[test]
    fn a_job_splits_into_forwards_that_keep_each_images_seed() {
        let forwards = pack(&[&spec(10, 10)], 4);
        assert_eq!(
            shape(&forwards),
            [vec![(0, 10, 4)], vec![(0, 14, 4)], vec![(0, 18, 2)]]
        );
        assert!(
            forwards
                .iter()
                .flatten()
                .all(|(_, r)| r.sampler == Sampler::EulerAncestral)
        );
        assert_eq!(pack(&[&spec(1, 10)], 4).len(), 1);
    }

    #[test]
    fn jobs_share_forwards_up_to_the_batch_size() {
        let (a, b, c) = (spec(1, 100), spec(3, 200), spec(2, 300));
        assert_eq!(
            shape(&pack(&[&a, &b, &c], 4)),
            [vec![(0, 100, 1), (1, 200, 3)], vec![(2, 300, 2)],]
        );
        // A job that does not fit whole is spread, its images keeping their seeds.
        assert_eq!(
            shape(&pack(&[&b, &b], 4)),
            [vec![(0, 200, 3), (1, 200, 1)], vec![(1, 201, 2)]]
        );
        assert_eq!(image_seeds(&b), [Some(200), Some(201), Some(202)]);
    }

    #[test]
    fn only_generates_with_the_same_lora_set_share_forwards() {
        let with = |loras: &[(&str, f32)]| {
            let mut g = spec(1, 5);
            g.loras = loras
                .iter()
                .map(|(name, weight)| LoraRef {
                    name: (*name).into(),
                    weight: *weight,
                })
                .collect();
            crate::engine::job::tests::job(Task::Generate(g))
        };
        let jobs = [
            with(&[("ink", 0.8)]),
            with(&[]),
            with(&[("ink", 0.8)]),
            with(&[("ink", 0.5)]),
            with(&[("ink", 0.8), ("detail", 1.0)]),
            with(&[]),
        ];
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        assert_eq!(
            groups(&refs, forward_key),
            [vec![0, 2], vec![1, 5], vec![3], vec![4]]
        );
    }

    fn config(path: impl Into<PathBuf>, name: Option<&str>) -> SdxlConfig {
        SdxlConfig {
            checkpoint: path.into(),
            name: name.map(Into::into),
            config_dir: None,
            tokenizer_dir: None,
            device: "cpu".into(),
            dtype: Dtype::Bf16,
            vae_dtype: Dtype::Bf16,
            prediction_type: None,
            vae_tiling: VaeTiling::Auto,
            warm_up: Vec::new(),
            max_batch: 4,
            lora_dir: None,
            settings: None,
            catalogue_checkpoints: 0,
        }
    }

    /// `cuda_graphs` on a device without CUDA graphs stops the worker at load with the reason.
    #[test]
    fn cuda_graphs_off_cuda_are_a_load_error() {
        let tiny =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/fixtures/sdxl/sdxl_tiny");
        let mut c = config(tiny, None);
        c.dtype = Dtype::Fp32;
        c.vae_dtype = Dtype::Fp32;
        let settings = SdxlSettings {
            cuda_graphs: true,
            ..SdxlSettings::default()
        };
        let e = SdxlEngine::load(&c, settings).err().expect("refused");
        assert!(format!("{e:#}").contains("cuda_graphs"), "{e:#}");
    }

    #[test]
    fn a_checkpoint_is_named_by_its_file_or_folder() {
        assert_eq!(
            config("/models/sdxl/novaAnimeXL_ilV190.safetensors", None).name(),
            "novaAnimeXL_ilV190"
        );
        assert_eq!(
            config("/models/stable-diffusion-xl-base-1.0", None).name(),
            "stable-diffusion-xl-base-1.0"
        );
        assert_eq!(config("/models/x.safetensors", Some("nova")).name(), "nova");
    }

    #[test]
    fn a_job_is_made_from_the_checkpoint_file_or_the_weights_of_the_folder() {
        let dir = std::env::temp_dir().join(format!(
            "vnfarm-sdxl-files-{}-{}",
            std::process::id(),
            vnfarm_proto::JobId::new()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let single = dir.join("nova.safetensors");
        std::fs::write(&single, b"w").unwrap();
        assert_eq!(
            config(&single, None).files(),
            [UsedFile {
                name: "nova.safetensors".into(),
                path: single,
                role: ModelFileRole::Checkpoint,
                strength: None,
            }]
        );
        let folder = dir.join("sdxl-base");
        for file in [
            "model_index.json",
            "unet/diffusion_pytorch_model.fp16.safetensors",
            "unet/config.json",
            "vae/diffusion_pytorch_model.safetensors",
            "text_encoder/model.safetensors",
            "tokenizer/vocab.json",
        ] {
            let path = folder.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"{}").unwrap();
        }
        let files = config(&folder, None).files();
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "text_encoder/model.safetensors",
                "unet/diffusion_pytorch_model.fp16.safetensors",
                "vae/diffusion_pytorch_model.safetensors",
            ]
        );
        assert!(files.iter().all(|f| f.role == ModelFileRole::Component));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
