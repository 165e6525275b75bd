//! The Qwen-Image-Edit-2509 engine: `edit` jobs on [`vnfarm_models::qwen_image::pipeline::QwenEditPipeline`],
//! kept warm for the worker's life.
//!
//! An edit's input set (one to three images) is encoded once (vision tower and VAE) and the
//! encodings are kept in an [`EncodeCache`] keyed by the inputs' sha256, bounded in bytes, least
//! recently used first out; the affinity keys of the jobs that used each entry are what the worker
//! reports in its heartbeat (`encode_cache`), so the scheduler can send later edits of the same
//! image here. The edits of a batch message that share inputs and a LoRA set are one group: its
//! inputs are encoded (or found) once and its edits run through `edit` in micro-batches of at most
//! `max_batch` (same output size, steps and guidance); groups run one after another. Progress is
//! reported per job after every denoising step; before every step a micro-batch stops if all of its
//! jobs were cancelled (a job cancelled alone rides along and its image is discarded). A job's
//! `loras` are applied on top of the load-time LoRAs (the Lightning LoRA) for its group; the next
//! group with another set gets the base restored bit for bit first, and the same set twice in a
//! row costs nothing.

use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;
use tch::Device;
use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_models::nn::tiling::Tiling;
use vnfarm_models::qwen_image::pipeline::{
    EditRequest, EncodedInputs, QwenEditConfig, QwenEditPipeline, QwenSource,
};
use vnfarm_models::qwen2_5_vl::rope::PositionMode;
use vnfarm_models::schedulers::FlowMatchConfig;
use vnfarm_models::settings::QwenSettings;
use vnfarm_proto::{EditSpec, ModelFileRole, StageTimings, Task};

use crate::tuning::SettingsChoice;
use crate::tuning::fingerprint::file_sample;

use super::device::{Dtype, engine_error, open_device, parse_device, warm_up_sizes};
use super::shared_encodings::hex_sha256;
use super::{
    AdvertisedKeys, CacheLookup, EncodeCache, EngineError, EngineJob, EngineOutput, Fetched,
    LoraDir, OutputImage, Progress, Runnable, SharedEncodings, SharedStore, UsedFile,
    all_cancelled, answered, content_key, groups, together_or_alone, weight_files,
};

/// The `[engine.qwen_edit]` table; a key left out is [`QwenEditEngineConfig::default`]'s.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct QwenEditEngineConfig {
    /// A diffusers folder in the layout of `Qwen/Qwen-Image-Edit-2509` (`transformer/`,
    /// `text_encoder/`, `vae/`, `tokenizer/`, `processor/`, `scheduler/`). Either this, or the three
    /// single files below.
    pub model_dir: Option<PathBuf>,
    /// ComfyUI-style single files: the transformer (`qwen_image_edit_2509_fp8_e4m3fn.safetensors`
    /// or bf16), the text encoder (`qwen_2.5_vl_7b_fp8_scaled.safetensors` or bf16) and the VAE
    /// (`qwen_image_vae.safetensors`).
    pub transformer: Option<PathBuf>,
    pub text_encoder: Option<PathBuf>,
    pub vae: Option<PathBuf>,
    /// For single files that are not the real model's size: a diffusers-layout folder holding the
    /// components' `config.json` files (tests use the tiny fixture).
    pub config_dir: Option<PathBuf>,
    /// LoRAs fused at load, e.g. the Lightning 4-step LoRA at strength 1.
    pub loras: Vec<LoadLora>,
    /// Where jobs' `loras` are looked up: `<lora_dir>/<name>` or `<lora_dir>/<name>.safetensors`.
    pub lora_dir: Option<PathBuf>,
    /// `lightning` (Qwen-Image-Lightning's flow-match shift, for the 4/8-step LoRAs) or `model`
    /// (the folder's `scheduler_config.json`, else Qwen-Image's).
    pub scheduler: SchedulerChoice,
    /// `cuda`, `cuda:N` (ROCm devices are `cuda` too) or `cpu`.
    pub device: String,
    /// Compute precision of the transformer and the text encoder.
    pub dtype: Dtype,
    pub vae_dtype: Dtype,
    /// Kernel and memory choices (`vnfarm_models::settings::QwenSettings`): a preset's name
    /// (`"portable"`, the default, or `"cuda"`) or a table (`attention`; `fp8`: `upcast`
    /// dequantises fp8 files at load, the transformer then takes ~41 GB in bf16, `resident` keeps
    /// them fp8 on the device, ~20 GB). With `engine.settings_file` the file decides.
    pub settings: Option<SettingsChoice<QwenSettings>>,
    /// Text-encoder position ids: `mrope` (Qwen2.5-VL as trained) or `sequential` (what
    /// diffusers 0.42.1 computes with transformers ≥ 5.15; for reproducing such references).
    pub positions: PositionMode,
    /// Output `[width, height]` sizes run once before the worker takes jobs.
    pub warm_up: Vec<[u32; 2]>,
    /// Variants per transformer forward when several edits of one input run together.
    pub max_batch: u32,
    /// Bound of the encode cache in MiB of device memory.
    pub encode_cache_mib: u64,
    /// Pixels of the vision tower's and the VAE's copies of each input (diffusers' constants).
    pub condition_image_area: u64,
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

/// `LoadLora`'s `strength`: a field default, since its `path` is required (a struct-wide
/// `#[serde(default)]` would make a LoRA without a file decode).
fn one() -> f32 {
    1.0
}

impl Default for QwenEditEngineConfig {
    fn default() -> Self {
        Self {
            model_dir: None,
            transformer: None,
            text_encoder: None,
            vae: None,
            config_dir: None,
            loras: Vec::new(),
            lora_dir: None,
            scheduler: SchedulerChoice::default(),
            device: "cuda".into(),
            dtype: Dtype::default(),
            vae_dtype: Dtype::default(),
            settings: None,
            positions: PositionMode::default(),
            warm_up: vec![[1024, 1024]],
            max_batch: 1,
            encode_cache_mib: 2048,
            condition_image_area: 384 * 384,
            vae_image_area: 1024 * 1024,
        }
    }
}

impl QwenEditEngineConfig {
    /// The model's weight files and the LoRAs fused at load.
    pub fn files(&self) -> Vec<UsedFile> {
        let mut files = match &self.model_dir {
            Some(dir) => weight_files(dir),
            None => [
                (&self.transformer, ModelFileRole::Transformer),
                (&self.text_encoder, ModelFileRole::TextEncoder),
                (&self.vae, ModelFileRole::Vae),
            ]
            .into_iter()
            .filter_map(|(path, role)| path.as_ref().map(|p| UsedFile::named_by_file(p, role)))
            .collect(),
        };
        files.extend(self.loras.iter().map(|l| UsedFile {
            strength: Some(l.strength),
            ..UsedFile::named_by_file(&l.path, ModelFileRole::Lora)
        }));
        files
    }

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

pub struct QwenEditEngine {
    pipeline: QwenEditPipeline,
    /// What the pipeline loaded (the model and the load-time LoRAs).
    files: Vec<UsedFile>,
    cache: EncodeCache<EncodedInputs>,
    /// The fleet's encodings of this model (see `shared_encodings`), when shared.
    shared: Option<SharedStore>,
    lora_dir: LoraDir,
    max_batch: usize,
    /// The output sizes [`QwenEditEngine::warm_up`] runs.
    warm_up: Vec<[u32; 2]>,
}

impl QwenEditEngine {
    /// The loaded pipeline, for `vnfarm-worker check`, which drives it directly.
    pub fn into_pipeline(self) -> QwenEditPipeline {
        self.pipeline
    }

    /// The most edits in one transformer forward.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Loads the model onto the device and warms up at every configured size. Any failure (a
    /// missing or corrupt file, a missing or misshapen tensor, no device) is an error naming it.
    pub fn load(
        config: &QwenEditEngineConfig,
        settings: QwenSettings,
        cache_keys: AdvertisedKeys,
        shared: Option<SharedEncodings>,
    ) -> anyhow::Result<Self> {
        let engine = Self::load_cold(config, settings, cache_keys, shared)?;
        engine.warm_up()?;
        Ok(engine)
    }

    /// [`QwenEditEngine::load`] without the warm-up (see [`QwenEditEngine::warm_up`]).
    pub fn load_cold(
        config: &QwenEditEngineConfig,
        settings: QwenSettings,
        cache_keys: AdvertisedKeys,
        shared: Option<SharedEncodings>,
    ) -> anyhow::Result<Self> {
        let device = open_device(&config.device, "engine.qwen_edit.device")?;
        let shared = match shared {
            Some(s) => Some(s.for_model("qwen_edit", &encodings_fingerprint(config, &settings)?)),
            None => None,
        };
        let pc = pipeline_config(config, settings, device)?;
        let started = Instant::now();
        let pipeline = QwenEditPipeline::load(&pc)
            .map_err(|e| anyhow::anyhow!("loading Qwen-Image-Edit: {e}"))?;
        tracing::info!(
            ?device,
            fp8 = ?settings.fp8,
            seconds = started.elapsed().as_secs_f64(),
            parts = ?pipeline.load_times(),
            "Qwen-Image-Edit loaded"
        );
        Ok(Self {
            pipeline,
            files: config.files(),
            cache: EncodeCache::new((config.encode_cache_mib as usize) << 20, cache_keys),
            shared,
            lora_dir: LoraDir::new(config.lora_dir.clone(), "engine.qwen_edit.lora_dir"),
            max_batch: config.max_batch as usize,
            warm_up: config.warm_up.clone(),
        })
    }

    /// Runs an edit at every configured output size once (kernel selection, memory pools) before
    /// the worker takes jobs.
    pub fn warm_up(&self) -> anyhow::Result<()> {
        warm_up_sizes("Qwen-Image-Edit", &self.warm_up, |w, h| {
            self.pipeline.warm_up(&[(w, h)])
        })
    }

    /// The files an edit is made from: the loaded ones, then the job's LoRAs (by the job's names).
    pub fn files(&self, job: &EngineJob) -> Vec<UsedFile> {
        let mut files = self.files.clone();
        if let Task::Edit(e) = &job.task {
            files.extend(self.lora_dir.used_files(&e.loras, &job.fetched));
        }
        files
    }

    /// Runs a batch: edits of the same inputs and LoRA set share one encoding and run in
    /// micro-batches; groups run one after another. One result per job.
    pub fn run_batch(
        &mut self,
        jobs: &[&EngineJob],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Vec<Result<EngineOutput, EngineError>> {
        let Runnable {
            mut results,
            runnable,
            prepared,
        } = Runnable::of(jobs, |job| self.prepare(job));
        let members: Vec<&EngineJob> = runnable.iter().map(|&i| jobs[i]).collect();
        let by_inputs = groups(&members, |job| {
            let loras = match &job.task {
                Task::Edit(e) => e.loras.clone(),
                Task::Generate(_) | Task::Upscale(_) => Vec::new(),
            };
            (content_key(&job.inputs), loras)
        });
        for group in by_inputs {
            let answers = self.run_group(&members, &prepared, &group, &mut |k, p| {
                progress(runnable[k], p)
            });
            for (k, answer) in answers {
                results[runnable[k]] = Some(answer);
            }
        }
        answered(results)
    }

    /// Another worker's encodings of `key` from shared storage, if published there and usable by
    /// this model.
    fn fetch(&self, key: &str) -> Option<EncodedInputs> {
        let shared = self.shared.as_ref()?;
        let Fetched::Found(bytes) = shared.fetch(key) else {
            return None;
        };
        match self.pipeline.encodings_from_bytes(&bytes) {
            Ok(encoded) => Some(encoded),
            Err(e) => {
                shared.unusable(key, &e.to_string());
                None
            }
        }
    }

    /// Publishes encodings just made (in the background; a failure only costs other workers an
    /// encode).
    fn publish(&self, key: &str, encoded: &EncodedInputs) {
        let Some(shared) = &self.shared else {
            return;
        };
        match self.pipeline.encodings_to_bytes(encoded) {
            Ok(bytes) => shared.publish(key, bytes),
            Err(e) => tracing::warn!(error = %e, "encodings not shared"),
        }
    }

    /// A job's request and LoRA files, or why it cannot run.
    fn prepare(&self, job: &EngineJob) -> Result<Prepared, EngineError> {
        let Task::Edit(spec) = &job.task else {
            return Err(EngineError::Unsupported(job.task.model()));
        };
        Ok(Prepared {
            request: edit_request(spec)?,
            loras: self.lora_dir.resolve(&spec.loras, &job.fetched)?,
        })
    }

    /// One group (edits of the same inputs with the same LoRAs, indices into `jobs`): LoRAs, the
    /// inputs' encoding (from the cache, else made once), then the edits in micro-batches.
    fn run_group(
        &mut self,
        jobs: &[&EngineJob],
        prepared: &[Prepared],
        group: &[usize],
        progress: &mut dyn FnMut(usize, Progress),
    ) -> Vec<(usize, Result<EngineOutput, EngineError>)> {
        let fail = |e: EngineError| -> Vec<(usize, Result<EngineOutput, EngineError>)> {
            group
                .iter()
                .map(|&k| {
                    let own = match (&e, jobs[k].cancel.requested()) {
                        (EngineError::Cancelled(_), Some(reason)) => EngineError::Cancelled(reason),
                        _ => e.clone(),
                    };
                    (k, Err(own))
                })
                .collect()
        };
        let cancelled = || all_cancelled(group.iter().map(|&k| &jobs[k].cancel));
        let first = jobs[group[0]];
        let mut shared = StageTimings::default();

        let loras = &prepared[group[0]].loras;
        let started = Instant::now();
        if let Err(e) = self.pipeline.set_job_loras(loras) {
            return fail(engine_error(e, cancelled()));
        }
        if !loras.is_empty() {
            shared.add("lora", started.elapsed().as_secs_f64());
        }

        let key = content_key(&first.inputs);
        let mut encoder = None;
        if !self.cache.contains(&key) {
            if let Some(reason) = cancelled() {
                return fail(EngineError::Cancelled(reason));
            }
            let started = Instant::now();
            let (encoded, lookup) = match self.fetch(&key) {
                Some(encoded) => (encoded, CacheLookup::Fetched),
                None => {
                    let images: Vec<_> = first.inputs.iter().map(|i| i.image.clone()).collect();
                    let encoded = match self.pipeline.encode_inputs(&images) {
                        Ok(encoded) => encoded,
                        Err(e) => return fail(engine_error(e, cancelled())),
                    };
                    self.publish(&key, &encoded);
                    (encoded, CacheLookup::Miss)
                }
            };
            let by = group
                .iter()
                .copied()
                .find(|&k| jobs[k].cancel.requested().is_none())
                .unwrap_or(group[0]);
            let bytes = encoded.bytes();
            self.cache.insert(
                key.clone(),
                encoded,
                bytes,
                jobs[by].task.affinity_key().as_deref(),
            );
            encoder = Some((by, lookup, started.elapsed().as_secs_f64()));
        }
        for &k in group {
            self.cache.get(&key, jobs[k].task.affinity_key().as_deref());
        }
        let Some(encoded) = self.cache.get(&key, None) else {
            return fail(EngineError::Failed(
                "encode cache lost the entry it just stored".into(),
            ));
        };

        // Micro-batches: same output size, steps and guidance, at most `max_batch` edits each.
        let shapes = groups(
            &group.iter().map(|&k| jobs[k]).collect::<Vec<_>>(),
            |job| match &job.task {
                Task::Edit(e) => Some((e.width.zip(e.height), e.steps, e.cfg > 1.0)),
                Task::Generate(_) | Task::Upscale(_) => None,
            },
        );
        let pipeline = &self.pipeline;
        let mut answers = Vec::with_capacity(group.len());
        for shape in shapes {
            let same: Vec<usize> = shape.into_iter().map(|s| group[s]).collect();
            for chunk in same.chunks(self.max_batch.max(1)) {
                answers.extend(together_or_alone(jobs, chunk, |together| {
                    let requests: Vec<EditRequest> = together
                        .iter()
                        .map(|&k| prepared[k].request.clone())
                        .collect();
                    let stop = || all_cancelled(together.iter().map(|&k| &jobs[k].cancel));
                    let (images, times) = pipeline
                        .edit(
                            encoded,
                            &requests,
                            &mut |done, _| {
                                // One micro-batch (same shape, at most `max_batch`): `done` counts
                                // the steps of all its edits, which take each step together.
                                let step = (done / requests.len()) as u32;
                                for (&k, r) in together.iter().zip(&requests) {
                                    progress(
                                        k,
                                        Progress {
                                            step,
                                            total: r.steps as u32,
                                        },
                                    );
                                }
                            },
                            &|| stop().is_some(),
                        )
                        .map_err(|e| engine_error(e, stop()))?;
                    let share = 1.0 / together.len() as f64;
                    Ok(together
                        .iter()
                        .zip(images)
                        .zip(&requests)
                        .map(|((_, image), r)| {
                            let mut timings = StageTimings::default();
                            timings.add("encode_prompt", times.encode_prompt * share);
                            timings.add("denoise", times.denoise * share);
                            timings.add("decode", times.decode * share);
                            EngineOutput {
                                images: vec![OutputImage::Finished(
                                    image::DynamicImage::ImageRgb8(image),
                                )],
                                seeds: vec![Some(r.seed)],
                                timings,
                                encode_cache: None,
                                files: Vec::new(),
                            }
                        })
                        .collect())
                }));
            }
        }
        let share = 1.0 / group.len() as f64;
        for (k, answer) in &mut answers {
            if let Ok(out) = answer {
                for (stage, seconds) in &shared.0 {
                    out.timings.add(stage, seconds * share);
                }
                out.encode_cache = Some(match encoder {
                    Some((by, lookup, seconds)) if by == *k => {
                        out.timings.add(lookup.stage(), seconds);
                        lookup
                    }
                    Some(_) | None => CacheLookup::Hit,
                });
            }
        }
        answers
    }
}

/// What a job needs from its spec to run.
struct Prepared {
    request: EditRequest,
    loras: Vec<LoraSpec>,
}

/// What this engine's encodings depend on, hashed: the layout, the dtypes, fp8 handling, the resize
/// areas and the text encoder's and VAE's weights (by [`file_sample`]: size, first and last MiB).
/// Workers with the same fingerprint can use each other's encodings.
fn encodings_fingerprint(
    config: &QwenEditEngineConfig,
    settings: &QwenSettings,
) -> anyhow::Result<String> {
    let mut parts: Vec<Vec<u8>> = vec![
        vnfarm_models::qwen_image::encodings::FORMAT.into(),
        format!(
            "{:?}/{:?}/{:?}/{}/{}",
            config.dtype,
            config.vae_dtype,
            settings.fp8,
            config.condition_image_area,
            config.vae_image_area
        )
        .into(),
    ];
    for file in config.files() {
        // Single files by role; a diffusers folder's by subfolder (named, as the layout is fixed).
        let encoder = match file.role {
            ModelFileRole::TextEncoder | ModelFileRole::Vae => true,
            ModelFileRole::Component => {
                parts.push(file.name.clone().into());
                file.name.starts_with("text_encoder/") || file.name.starts_with("vae/")
            }
            _ => false,
        };
        if encoder {
            let sample = file_sample(&file.path).map_err(|e| {
                anyhow::anyhow!("engine.qwen_edit: reading {}: {e}", file.path.display())
            })?;
            parts.push(sample.into());
        }
    }
    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    Ok(hex_sha256(&parts)[..16].to_string())
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

/// The model crate's configuration of the pipeline this engine configuration loads on `device`.
pub(crate) fn pipeline_config(
    config: &QwenEditEngineConfig,
    settings: QwenSettings,
    device: Device,
) -> anyhow::Result<QwenEditConfig> {
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
    pc.settings = settings;
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
    Ok(pc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edit_is_made_from_the_three_files_and_the_load_time_loras() {
        let config: QwenEditEngineConfig = serde_json::from_str(
            r#"{"transformer": "/m/qwen_image_edit_2509_fp8_e4m3fn.safetensors",
                "text_encoder": "/m/qwen_2.5_vl_7b_fp8_scaled.safetensors",
                "vae": "/m/qwen_image_vae.safetensors",
                "loras": [{"path": "/m/loras/Qwen-Image-Lightning-4steps.safetensors"}]}"#,
        )
        .expect("a valid config");
        let files: Vec<(String, ModelFileRole)> = config
            .files()
            .into_iter()
            .map(|f| (f.name, f.role))
            .collect();
        assert_eq!(
            files,
            [
                (
                    "qwen_image_edit_2509_fp8_e4m3fn.safetensors".into(),
                    ModelFileRole::Transformer
                ),
                (
                    "qwen_2.5_vl_7b_fp8_scaled.safetensors".into(),
                    ModelFileRole::TextEncoder
                ),
                ("qwen_image_vae.safetensors".into(), ModelFileRole::Vae),
                (
                    "Qwen-Image-Lightning-4steps.safetensors".into(),
                    ModelFileRole::Lora
                ),
            ]
        );
    }
}
