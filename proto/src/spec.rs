//! Job specifications as clients submit them (DESIGN §3), and their validation.
//!
//! Decoding ([`crate::decode_json`]) rejects unknown fields and wrong types; [`Submission::validate`]
//! then checks every bound and cross-field rule and names the offending field. A submission that passed
//! both is complete: its seeds are resolved and nothing downstream needs to guess.

use base64::Engine as _;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::JobId;

/// Largest inline input image, decoded.
pub const MAX_INLINE_IMAGE_BYTES: usize = 8 * 1024 * 1024;
/// Largest side of an input image.
pub const MAX_INPUT_SIDE: u32 = 4096;
/// Largest side of an upscaled output.
pub const MAX_UPSCALE_OUTPUT_SIDE: u32 = 8192;
/// Bounds of an upscale's tile side (input pixels); the overlap is at most a quarter of the tile.
pub const MIN_UPSCALE_TILE: u32 = 64;
pub const MAX_UPSCALE_TILE: u32 = 2048;
/// Most jobs one pipeline may expand into (its base generate included).
pub const MAX_PIPELINE_JOBS: usize = 64;
/// Input images of one edit (Qwen-Image-Edit-2509 takes one to three).
pub const MAX_EDIT_INPUTS: usize = 3;
const MAX_PROMPT_CHARS: usize = 8192;
const MAX_LORAS: usize = 8;

/// What a client submits: one job (possibly a pipeline) with its envelope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    /// Must equal [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Optional id chosen by the producer; a second submission with the same id is the same job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<JobId>,
    /// Same key, same job: a resubmission returns the job created by the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    #[serde(default)]
    pub priority: Priority,
    /// A job not started by this time fails with `deadline_exceeded` instead of running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    pub job: JobSpec,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Someone is waiting for it (the web page); overtakes batch work.
    Interactive,
    #[default]
    Batch,
}

/// The four kinds of job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobSpec {
    Generate(GenerateSpec),
    Edit(EditSpec),
    Upscale(UpscaleSpec),
    Pipeline(PipelineSpec),
}

impl JobSpec {
    pub fn kind_name(&self) -> &'static str {
        match self {
            JobSpec::Generate(_) => "generate",
            JobSpec::Edit(_) => "edit",
            JobSpec::Upscale(_) => "upscale",
            JobSpec::Pipeline(_) => "pipeline",
        }
    }

    /// The model family that runs this job; `None` for a pipeline, which the scheduler expands.
    pub fn model(&self) -> Option<ModelFamily> {
        match self {
            JobSpec::Generate(_) => Some(ModelFamily::Sdxl),
            JobSpec::Edit(_) => Some(ModelFamily::QwenEdit),
            JobSpec::Upscale(_) => Some(ModelFamily::Esrgan),
            JobSpec::Pipeline(_) => None,
        }
    }
}

/// The resolution class of an output of `width`×`height`, for the workers' `denoise_step_seconds` and the scheduler's estimates: its area
/// in megapixels, rounded to the nearest of 0.25, 0.5, 1, 2 and 4 on a log scale (the boundaries
/// are the geometric means of neighbours), `8mp` above. SDXL's and Qwen's 1024², 832×1216 and
/// 1280×720 are all `1mp`; a step's cost follows the pixel count, not the aspect ratio, so the
/// class keeps the label bounded without mixing step costs that differ.
pub fn resolution_class(width: u32, height: u32) -> &'static str {
    const CLASSES: [(f64, &str); 5] = [
        (0.25, "0.25mp"),
        (0.5, "0.5mp"),
        (1.0, "1mp"),
        (2.0, "2mp"),
        (4.0, "4mp"),
    ];
    let megapixels = f64::from(width) * f64::from(height) / (1u64 << 20) as f64;
    for (class, label) in CLASSES {
        // The geometric mean of `class` and the next class up (twice as large).
        if megapixels <= class * std::f64::consts::SQRT_2 {
            return label;
        }
    }
    "8mp"
}

/// The model families a worker may hold warm; each has a shared work queue.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum ModelFamily {
    Sdxl,
    QwenEdit,
    Esrgan,
}

impl ModelFamily {
    pub const ALL: [ModelFamily; 3] = [
        ModelFamily::Sdxl,
        ModelFamily::QwenEdit,
        ModelFamily::Esrgan,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ModelFamily::Sdxl => "sdxl",
            ModelFamily::QwenEdit => "qwen-edit",
            ModelFamily::Esrgan => "esrgan",
        }
    }
}

impl std::fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    #[default]
    Euler,
    EulerAncestral,
    DpmppTwoMKarras,
}

/// SDXL text-to-image.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateSpec {
    /// A1111-style weights `(word:1.2)`, `(word)`, `[word]`; `BREAK` starts a new 75-token chunk.
    pub prompt: String,
    #[serde(default)]
    pub negative_prompt: String,
    #[serde(default = "crate::defaults::side")]
    pub width: u32,
    #[serde(default = "crate::defaults::side")]
    pub height: u32,
    #[serde(default = "crate::defaults::generate_steps")]
    pub steps: u32,
    #[serde(default = "crate::defaults::generate_cfg")]
    pub cfg: f32,
    #[serde(default)]
    pub sampler: Sampler,
    /// Omitted: the scheduler picks one at submission and records it, so the job stays reproducible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Images from this job; image `n` uses seed `seed + n`.
    #[serde(default = "crate::defaults::one")]
    pub count: u32,
    /// The SDXL checkpoint by name, as the workers that hold it advertise it, or the model
    /// catalogue's by name or as `sha256:<hex>`. Omitted: the fleet's
    /// default (the scheduler's `default_checkpoint`, recorded at submission), or any SDXL worker
    /// when the scheduler has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// LoRAs from the worker's LoRA directory (`engine.sdxl.lora_dir`), fused into the UNet and
    /// both text encoders at their weights for this job (A1111's `<lora:name:weight>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loras: Vec<LoraRef>,
}

/// A Qwen-Image-Edit-2509 instruction edit of one to three input images. Give `input` (one image)
/// or `inputs` (one to three, in the order the instruction calls them "picture 1", "picture 2", …:
/// typically the character, then an outfit or pose reference), not both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<ImageRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<ImageRef>,
    pub instruction: String,
    /// Output size in pixels, both or neither, multiples of 16. Unset: about one megapixel at the
    /// aspect ratio of the last input (diffusers' `QwenImageEditPlusPipeline` default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    #[serde(default = "crate::defaults::edit_steps")]
    pub steps: u32,
    #[serde(default = "crate::defaults::edit_cfg")]
    pub cfg: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loras: Vec<LoraRef>,
}

/// A Real-ESRGAN upscale of one input image.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpscaleSpec {
    pub input: ImageRef,
    /// Output size ÷ input size, 2 or 4 (a model of another scale resamples its output).
    #[serde(default = "crate::defaults::scale")]
    pub scale: u32,
    /// Side of a tile in input pixels, 64–2048: the image runs through the model tile by tile.
    /// Absent: the worker's setting (`engine.esrgan.tile`), the measured fastest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<u32>,
    /// Context around each tile in input pixels, at most a quarter of the tile; neighbouring
    /// tiles blend across it. Absent: the worker's setting (`engine.esrgan.tile_overlap`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile_overlap: Option<u32>,
}

/// A base generate, then edits of its first image, then upscales of any of those.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// Must produce one image (`count` 1): the edits apply to it.
    pub base: GenerateSpec,
    #[serde(default)]
    pub edits: Vec<PipelineEdit>,
    #[serde(default)]
    pub upscales: Vec<PipelineUpscale>,
}

/// One edit of a pipeline's base image.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineEdit {
    pub instruction: String,
    /// Further inputs after the base image (which is always picture 1): outfit or pose
    /// references, at most two.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<ImageRef>,
    #[serde(default = "crate::defaults::edit_steps")]
    pub steps: u32,
    #[serde(default = "crate::defaults::edit_cfg")]
    pub cfg: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loras: Vec<LoraRef>,
}

/// One upscale inside a pipeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineUpscale {
    /// Which image of the pipeline to upscale.
    pub of: PipelineImage,
    #[serde(default = "crate::defaults::scale")]
    pub scale: u32,
    /// As [`UpscaleSpec::tile`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<u32>,
    /// As [`UpscaleSpec::tile_overlap`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile_overlap: Option<u32>,
}

/// An image inside a pipeline: `"base"` or `{"edit": n}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PipelineImage {
    Base,
    Edit(usize),
}

/// Where an input image comes from. Never an arbitrary URL (DESIGN §9).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageRef {
    /// An object in the farm's bucket under `inputs/` or `results/`.
    Stored(String),
    /// Image `index` of another job's outputs.
    JobOutput { job: JobId, index: u32 },
    /// The image itself, base64 (standard alphabet), at most 8 MiB decoded. The scheduler stores it
    /// under `inputs/` and replaces it by a `stored` reference before dispatch.
    Inline(String),
}

/// A LoRA fused at the given strength: a file of the worker's LoRA directory by name, else the
/// model catalogue's file of that name, or the catalogue's file `sha256:<hex>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraRef {
    pub name: String,
    #[serde(default = "crate::defaults::one_f32")]
    pub weight: f32,
}

/// A submission that breaks a rule; `field` is the dotted path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ValidationError {
    ValidationError {
        field: field.into(),
        message: message.into(),
    }
}

fn check_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    value: T,
    lo: T,
    hi: T,
) -> Result<(), ValidationError> {
    if value < lo || value > hi {
        return Err(err(field, format!("{value} is outside {lo}..={hi}")));
    }
    Ok(())
}

fn check_cfg(field: &str, cfg: f32) -> Result<(), ValidationError> {
    if !cfg.is_finite() {
        return Err(err(field, "must be a finite number"));
    }
    check_range(field, cfg, 0.0, 30.0)
}

fn check_text(field: &str, text: &str, required: bool) -> Result<(), ValidationError> {
    if required && text.trim().is_empty() {
        return Err(err(field, "must not be empty"));
    }
    if text.chars().count() > MAX_PROMPT_CHARS {
        return Err(err(
            field,
            format!("is longer than {MAX_PROMPT_CHARS} characters"),
        ));
    }
    Ok(())
}

/// A model or LoRA file's name: [A-Za-z0-9._-], not starting with '.', at most 128 characters.
pub fn is_file_name(name: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    !name.is_empty() && name.len() <= 128 && !name.starts_with('.') && name.chars().all(ok)
}

/// Whether `name` is `sha256:<64 hex digits>`: the model catalogue's file of that hash.
fn is_hash_ref(name: &str) -> bool {
    matches!(
        crate::catalogue::ModelRef::parse(name),
        Some(crate::catalogue::ModelRef::Hash(_))
    )
}

fn check_loras(field: &str, loras: &[LoraRef]) -> Result<(), ValidationError> {
    if loras.len() > MAX_LORAS {
        return Err(err(field, format!("at most {MAX_LORAS} LoRAs")));
    }
    for (i, lora) in loras.iter().enumerate() {
        if !(is_file_name(&lora.name) || is_hash_ref(&lora.name)) {
            return Err(err(
                format!("{field}[{i}].name"),
                "must be a file name of [A-Za-z0-9._-], not starting with '.', or sha256:<64 hex digits>",
            ));
        }
        if !lora.weight.is_finite() {
            return Err(err(
                format!("{field}[{i}].weight"),
                "must be a finite number",
            ));
        }
        check_range(&format!("{field}[{i}].weight"), lora.weight, -4.0, 4.0)?;
    }
    Ok(())
}

impl GenerateSpec {
    /// Generates with the same key can share one forward pass (`SdxlPipeline::generate_batch`):
    /// same checkpoint, size, steps, sampler, whether guidance runs, and LoRA set (names and
    /// weights, in order: the weights the forward runs with).
    pub fn batch_key(&self) -> String {
        let loras: Vec<String> = self
            .loras
            .iter()
            .map(|l| format!("{}@{}", l.name, l.weight))
            .collect();
        format!(
            "{}:{}:{}x{}:{}:{:?}:{}:{}",
            ModelFamily::Sdxl.as_str(),
            self.checkpoint.as_deref().unwrap_or("-"),
            self.width,
            self.height,
            self.steps,
            self.sampler,
            if self.cfg > 1.0 { "cfg" } else { "nocfg" },
            if loras.is_empty() {
                "-".to_string()
            } else {
                loras.join("+")
            }
        )
    }

    fn validate(&self, at: &str) -> Result<(), ValidationError> {
        check_text(&format!("{at}.prompt"), &self.prompt, true)?;
        check_text(
            &format!("{at}.negative_prompt"),
            &self.negative_prompt,
            false,
        )?;
        for (name, side) in [("width", self.width), ("height", self.height)] {
            let field = format!("{at}.{name}");
            check_range(&field, side, 256, 2048)?;
            if side % 8 != 0 {
                return Err(err(field, format!("{side} is not a multiple of 8")));
            }
        }
        check_range(&format!("{at}.steps"), self.steps, 1, 150)?;
        check_cfg(&format!("{at}.cfg"), self.cfg)?;
        check_range(&format!("{at}.count"), self.count, 1, 16)?;
        if let Some(name) = &self.checkpoint
            && !(is_file_name(name) || is_hash_ref(name))
        {
            return Err(err(
                format!("{at}.checkpoint"),
                "must be a checkpoint name of [A-Za-z0-9._-], not starting with '.', or sha256:<64 hex digits>",
            ));
        }
        if let Some(seed) = self.seed
            && seed.checked_add(u64::from(self.count)).is_none()
        {
            return Err(err(format!("{at}.seed"), "seed + count overflows"));
        }
        check_loras(&format!("{at}.loras"), &self.loras)
    }
}

fn validate_edit_params(
    at: &str,
    instruction: &str,
    steps: u32,
    cfg: f32,
    loras: &[LoraRef],
) -> Result<(), ValidationError> {
    check_text(&format!("{at}.instruction"), instruction, true)?;
    check_range(&format!("{at}.steps"), steps, 1, 100)?;
    check_cfg(&format!("{at}.cfg"), cfg)?;
    check_loras(&format!("{at}.loras"), loras)
}

impl EditSpec {
    /// The input images in prompt order (`input`, or `inputs`).
    pub fn images(&self) -> Vec<&ImageRef> {
        self.input.iter().chain(&self.inputs).collect()
    }

    /// The key of the input encodings this edit needs (see [`crate::Task::affinity_key`]).
    pub fn affinity_key(&self) -> Option<String> {
        Self::affinity_key_of(&self.images())
    }

    /// The affinity key of an edit of these inputs, in prompt order: `qwen-edit:` and each
    /// reference (`job:<id>/<n>`, `stored:<key>`) joined by `+`. `None` for an inline image,
    /// which has no stable name until the scheduler stores it.
    pub fn affinity_key_of(inputs: &[&ImageRef]) -> Option<String> {
        let mut parts = Vec::with_capacity(inputs.len());
        for input in inputs {
            parts.push(match input {
                ImageRef::Stored(key) => format!("stored:{key}"),
                ImageRef::JobOutput { job, index } => format!("job:{job}/{index}"),
                ImageRef::Inline(_) => return None,
            });
        }
        Some(format!(
            "{}:{}",
            ModelFamily::QwenEdit.as_str(),
            parts.join("+")
        ))
    }

    /// The input images in prompt order, mutably (the scheduler stores inline ones).
    pub fn images_mut(&mut self) -> Vec<&mut ImageRef> {
        self.input.iter_mut().chain(&mut self.inputs).collect()
    }

    fn validate_inputs(&self, at: &str) -> Result<(), ValidationError> {
        match (&self.input, self.inputs.len()) {
            (Some(_), 0) => {}
            (Some(_), _) => {
                return Err(err(
                    format!("{at}.inputs"),
                    "give `input` or `inputs`, not both",
                ));
            }
            (None, 0) => {
                return Err(err(
                    format!("{at}.input"),
                    "an edit needs an input image (`input`, or `inputs` for several)",
                ));
            }
            (None, n) if n > MAX_EDIT_INPUTS => {
                return Err(err(
                    format!("{at}.inputs"),
                    format!("{n} images; an edit takes at most {MAX_EDIT_INPUTS}"),
                ));
            }
            (None, _) => {}
        }
        if let Some(input) = &self.input {
            input.validate(&format!("{at}.input"))?;
        }
        for (i, input) in self.inputs.iter().enumerate() {
            input.validate(&format!("{at}.inputs[{i}]"))?;
        }
        match (self.width, self.height) {
            (None, None) => Ok(()),
            (Some(w), Some(h)) => {
                for (name, side) in [("width", w), ("height", h)] {
                    check_range(&format!("{at}.{name}"), side, 256, 2048)?;
                    if side % 16 != 0 {
                        return Err(err(
                            format!("{at}.{name}"),
                            format!("{side} is not a multiple of 16"),
                        ));
                    }
                }
                Ok(())
            }
            (Some(_), None) => Err(err(
                format!("{at}.height"),
                "give width and height together",
            )),
            (None, Some(_)) => Err(err(format!("{at}.width"), "give width and height together")),
        }
    }
}

fn validate_upscale_params(
    at: &str,
    scale: u32,
    tile: Option<u32>,
    overlap: Option<u32>,
) -> Result<(), ValidationError> {
    if scale != 2 && scale != 4 {
        return Err(err(format!("{at}.scale"), format!("{scale} is not 2 or 4")));
    }
    if let Some(tile) = tile {
        check_range(
            &format!("{at}.tile"),
            tile,
            MIN_UPSCALE_TILE,
            MAX_UPSCALE_TILE,
        )?;
    }
    if let Some(overlap) = overlap {
        // Without a tile the worker's applies; it checks the quarter rule again.
        let max = tile.unwrap_or(MAX_UPSCALE_TILE) / 4;
        check_range(&format!("{at}.tile_overlap"), overlap, 0, max)?;
    }
    Ok(())
}

impl ImageRef {
    fn validate(&self, at: &str) -> Result<(), ValidationError> {
        match self {
            ImageRef::Stored(key) => {
                let allowed = key.starts_with("inputs/") || key.starts_with("results/");
                if !allowed || key.contains("..") || key.len() > 512 {
                    return Err(err(
                        format!("{at}.stored"),
                        "must be a key under inputs/ or results/ without '..'",
                    ));
                }
                Ok(())
            }
            ImageRef::JobOutput { index, .. } => {
                check_range(&format!("{at}.job_output.index"), *index, 0, 15)
            }
            ImageRef::Inline(data) => {
                // base64 is 4 characters per 3 bytes; check the length before decoding anything.
                if data.len() / 4 * 3 > MAX_INLINE_IMAGE_BYTES + 3 {
                    return Err(err(format!("{at}.inline"), "image is larger than 8 MiB"));
                }
                Ok(())
            }
        }
    }

    /// Decodes an inline image's base64; `None` for other references.
    pub fn inline_bytes(&self) -> Option<Result<Vec<u8>, base64::DecodeError>> {
        match self {
            ImageRef::Inline(data) => Some(base64::engine::general_purpose::STANDARD.decode(data)),
            _ => None,
        }
    }
}

impl Submission {
    /// Checks every bound; on success every `seed` is set (missing ones drawn from `seed_source`).
    pub fn validate(
        mut self,
        seed_source: &mut dyn FnMut() -> u64,
    ) -> Result<Submission, ValidationError> {
        if self.schema_version != crate::SCHEMA_VERSION {
            return Err(err(
                "schema_version",
                format!(
                    "version {} is not supported (this build speaks {})",
                    self.schema_version,
                    crate::SCHEMA_VERSION
                ),
            ));
        }
        if let Some(key) = &self.idempotency_key
            && (key.is_empty() || key.len() > 128)
        {
            return Err(err("idempotency_key", "must be 1-128 characters"));
        }
        match &mut self.job {
            JobSpec::Generate(g) => {
                g.validate("job")?;
                g.seed.get_or_insert_with(&mut *seed_source);
            }
            JobSpec::Edit(e) => {
                e.validate_inputs("job")?;
                validate_edit_params("job", &e.instruction, e.steps, e.cfg, &e.loras)?;
                e.seed.get_or_insert_with(&mut *seed_source);
            }
            JobSpec::Upscale(u) => {
                u.input.validate("job.input")?;
                validate_upscale_params("job", u.scale, u.tile, u.tile_overlap)?;
            }
            JobSpec::Pipeline(p) => {
                p.base.validate("job.base")?;
                if p.base.count != 1 {
                    return Err(err(
                        "job.base.count",
                        "a pipeline's base makes exactly one image",
                    ));
                }
                let jobs = 1 + p.edits.len() + p.upscales.len();
                if jobs > MAX_PIPELINE_JOBS {
                    return Err(err(
                        "job",
                        format!("pipeline expands to {jobs} jobs, more than {MAX_PIPELINE_JOBS}"),
                    ));
                }
                p.base.seed.get_or_insert_with(&mut *seed_source);
                for (i, e) in p.edits.iter_mut().enumerate() {
                    if e.references.len() > MAX_EDIT_INPUTS - 1 {
                        return Err(err(
                            format!("job.edits[{i}].references"),
                            format!(
                                "at most {} references (the base is picture 1)",
                                MAX_EDIT_INPUTS - 1
                            ),
                        ));
                    }
                    for (j, r) in e.references.iter().enumerate() {
                        r.validate(&format!("job.edits[{i}].references[{j}]"))?;
                    }
                    validate_edit_params(
                        &format!("job.edits[{i}]"),
                        &e.instruction,
                        e.steps,
                        e.cfg,
                        &e.loras,
                    )?;
                    e.seed.get_or_insert_with(&mut *seed_source);
                }
                for (i, u) in p.upscales.iter().enumerate() {
                    let at = format!("job.upscales[{i}]");
                    validate_upscale_params(&at, u.scale, u.tile, u.tile_overlap)?;
                    if let PipelineImage::Edit(n) = u.of
                        && n >= p.edits.len()
                    {
                        return Err(err(
                            format!("{at}.of"),
                            format!("edit {n} does not exist ({} edits)", p.edits.len()),
                        ));
                    }
                    // Edits keep their input's size, so every pipeline image has the base's size.
                    let longest = p.base.width.max(p.base.height) * u.scale;
                    if longest > MAX_UPSCALE_OUTPUT_SIDE {
                        return Err(err(
                            format!("{at}.scale"),
                            format!("output side {longest} exceeds {MAX_UPSCALE_OUTPUT_SIDE}"),
                        ));
                    }
                }
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_json;

    fn seeds() -> impl FnMut() -> u64 {
        let mut n = 0;
        move || {
            n += 1;
            n
        }
    }

    fn decode_and_validate(json: serde_json::Value) -> Result<Submission, String> {
        let sub: Submission =
            decode_json(json.to_string().as_bytes()).map_err(|e| e.to_string())?;
        sub.validate(&mut seeds()).map_err(|e| e.to_string())
    }

    #[test]
    fn minimal_generate_gets_defaults_and_a_seed() {
        let sub = decode_and_validate(serde_json::json!({
            "schema_version": 1, "job": {"kind": "generate", "prompt": "a cat"}
        }))
        .unwrap();
        let JobSpec::Generate(g) = &sub.job else {
            panic!("not a generate: {sub:?}")
        };
        assert_eq!((g.width, g.height, g.steps, g.count), (1024, 1024, 20, 1));
        assert_eq!(g.seed, Some(1));
        assert_eq!(sub.priority, Priority::Batch);
    }

    #[test]
    fn every_kind_round_trips() {
        let job_id = JobId::new();
        let subs = [
            serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "(a cat:1.2) BREAK hat",
                "negative_prompt": "blurry", "width": 1280, "height": 720, "steps": 30, "cfg": 5.0,
                "sampler": "dpmpp_two_m_karras", "seed": 42, "count": 4,
                "loras": [{"name": "ink_style", "weight": 0.8}, {"name": "detail.safetensors"},
                    {"name": "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}]}}),
            serde_json::json!({"schema_version": 1, "priority": "interactive", "idempotency_key": "k1",
                "job": {"kind": "edit", "input": {"job_output": {"job": job_id, "index": 0}},
                "instruction": "make her smile", "loras": [{"name": "lightning.safetensors", "weight": 1.0}]}}),
            serde_json::json!({"schema_version": 1, "deadline": "2030-01-01T00:00:00Z",
                "job": {"kind": "upscale", "input": {"stored": "inputs/abc.png"}, "scale": 4}}),
            serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline",
                "base": {"prompt": "a girl", "width": 832, "height": 1216},
                "edits": [{"instruction": "smile"}, {"instruction": "angry", "seed": 7}],
                "upscales": [{"of": "base"}, {"of": {"edit": 1}, "scale": 4}]}}),
        ];
        for json in subs {
            let sub = decode_and_validate(json.clone()).unwrap();
            let again: Submission =
                decode_json(serde_json::to_vec(&sub).unwrap().as_slice()).unwrap();
            assert_eq!(sub, again, "round trip of {json}");
        }
    }

    #[test]
    fn rejections_name_the_field() {
        let cases = [
            (
                serde_json::json!({"schema_version": 2, "job": {"kind": "generate", "prompt": "x"}}),
                "schema_version",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "width": 1001}}),
                "job.width",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "height": 4096}}),
                "job.height",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "steps": 0}}),
                "job.steps",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "count": 17}}),
                "job.count",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": " "}}),
                "job.prompt",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "colour": 1}}),
                "job",
            ),
            (
                serde_json::json!({"schema_version": 1, "extra": true, "job": {"kind": "generate", "prompt": "x"}}),
                "extra",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "dance"}}),
                "job.kind",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"stored": "../etc/passwd"}, "instruction": "x"}}),
                "job.input.stored",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"url": "http://x"}, "instruction": "x"}}),
                "job",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "instruction": "x"}}),
                "job.input",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"stored": "inputs/a.png"},
                "inputs": [{"stored": "inputs/b.png"}], "instruction": "x"}}),
                "job.inputs",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "instruction": "x", "inputs": [
                    {"stored": "inputs/a.png"}, {"stored": "inputs/b.png"}, {"stored": "inputs/c.png"}, {"stored": "inputs/d.png"}]}}),
                "job.inputs",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "instruction": "x", "inputs": [
                    {"stored": "inputs/a.png"}, {"stored": "/etc/passwd"}]}}),
                "job.inputs[1].stored",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"stored": "inputs/a.png"},
                "instruction": "x", "width": 1024}}),
                "job.height",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"stored": "inputs/a.png"},
                "instruction": "x", "width": 1000, "height": 1024}}),
                "job.width",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"},
                "edits": [{"instruction": "x", "references": [{"stored": "inputs/a.png"}, {"stored": "inputs/b.png"}, {"stored": "inputs/c.png"}]}]}}),
                "job.edits[0].references",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/a.png"}, "scale": 3}}),
                "job.scale",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/a.png"}, "tile": 32}}),
                "job.tile",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/a.png"},
                "tile": 256, "tile_overlap": 65}}),
                "job.tile_overlap",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"stored": "inputs/a.png"},
                "tile_overlap": 513}}),
                "job.tile_overlap",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x", "count": 2}}}),
                "job.base.count",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"},
                "upscales": [{"of": {"edit": 0}}]}}),
                "job.upscales[0].of",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x", "width": 2048},
                "upscales": [{"of": "base", "scale": 8}]}}),
                "job.upscales[0].scale",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "edit", "input": {"stored": "inputs/a.png"},
                "instruction": "x", "loras": [{"name": "../x", "weight": 1}]}}),
                "job.loras[0].name",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x",
                "loras": [{"name": "a"}, {"name": ".hidden"}]}}),
                "job.loras[1].name",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "x",
                "loras": [{"name": "sha256:abc"}]}}),
                "job.loras[0].name",
            ),
            (
                serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x",
                "loras": [{"name": "a", "weight": 5}]}}}),
                "job.base.loras[0].weight",
            ),
        ];
        for (json, field) in cases {
            let message = decode_and_validate(json.clone()).expect_err(&json.to_string());
            assert!(
                message.starts_with(&format!("{field}: ")),
                "{json} gave {message:?}, expected field {field}"
            );
        }
    }

    #[test]
    fn generates_batch_only_with_the_same_lora_set() {
        let key = |loras: serde_json::Value| {
            let sub = decode_and_validate(serde_json::json!({"schema_version": 1,
                "job": {"kind": "generate", "prompt": "x", "loras": loras}}))
            .unwrap();
            let JobSpec::Generate(g) = sub.job else {
                panic!("not a generate")
            };
            g.batch_key()
        };
        let ink = serde_json::json!([{"name": "ink", "weight": 0.8}]);
        assert_eq!(key(ink.clone()), key(ink.clone()));
        assert_ne!(key(ink.clone()), key(serde_json::json!([])));
        assert_ne!(
            key(ink),
            key(serde_json::json!([{"name": "ink", "weight": 0.7}]))
        );
        assert_ne!(
            key(serde_json::json!([{"name": "a"}, {"name": "b"}])),
            key(serde_json::json!([{"name": "b"}, {"name": "a"}]))
        );
    }

    #[test]
    fn pipeline_size_is_bounded() {
        let edits: Vec<_> = (0..64)
            .map(|i| serde_json::json!({"instruction": format!("e{i}")}))
            .collect();
        let json = serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x"}, "edits": edits}});
        let message = decode_and_validate(json).unwrap_err();
        assert!(message.contains("65 jobs"), "{message}");
    }

    #[test]
    fn oversized_inline_images_are_rejected_before_decoding() {
        let big = "A".repeat(12 * 1024 * 1024);
        let json = serde_json::json!({"schema_version": 1, "job": {"kind": "upscale", "input": {"inline": big}}});
        assert!(
            decode_and_validate(json)
                .unwrap_err()
                .starts_with("job.input.inline")
        );
    }
}
