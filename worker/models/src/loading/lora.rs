//! LoRA files fused into a model's weights, and restored exactly: parsing every key style found in
//! the wild, resolving module names against the target's own, fusing
//! `W += strength · (alpha/rank) · (up @ down)` in fp32, and a handle that puts the base back bit
//! for bit.
//!
//! Key styles (after diffusers 0.42.1 `loaders/lora_conversion_utils.py`
//! `_convert_non_diffusers_qwen_lora_to_diffusers`, Apache-2.0, and ComfyUI's key map, facts only):
//! - module style (lightx2v, diffusers-converted): `<module>.lora_down.weight` `[r, in]`,
//!   `<module>.lora_up.weight` `[out, r]`, optional `<module>.alpha`;
//! - PEFT: `<module>.lora_A.weight` / `.lora_B.weight`, optionally `.lora_A.default.weight`, no
//!   alpha (scale 1 unless an `.alpha` is present);
//! - prefixes stripped: `model.diffusion_model.`, `diffusion_model.`, `transformer.`, `unet.`,
//!   `base_model.model.` (denoiser); `text_encoder.` / `text_encoder_2.` (SDXL's text encoders);
//! - kohya: `lora_unet_<module with . as _>` (+ `.alpha`), `lora_te1_` / `lora_te_` / `lora_te2_`
//!   for text encoders, ComfyUI's `lycoris_` for the denoiser. Module names contain `_`, so a flat
//!   name is resolved by flattening each of the target's module names and looking it up. A target
//!   may give aliases ([`LoraTarget::lora_aliases`]): SDXL's UNet gives the sgm/ldm names
//!   sd-scripts trains it under (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`; the
//!   mapping diffusers undoes in `_maybe_map_sgm_blocks_to_diffusers` and `_convert_unet_lora_key`);
//! - LyCORIS LoCon on convs: down `[r, in, kh, kw]`, up `[out, r, 1, 1]`.
//!
//! LoHa, LoKr, Tucker (`lora_mid`), DoRA, full diffs and LoRA biases are errors naming the key.
//!
//! fp8-resident weights ([`Linear`] with an fp8 `weight` and optional `weight_scale`) are
//! dequantised (`w.float() · scale`), fused in fp32 and re-quantised to the same fp8 kind with a
//! fresh per-tensor scale `amax / fp8_max` (448 for e4m3fn). A fresh scale keeps the fused weight
//! inside fp8's range whatever the LoRA adds, and round-to-nearest makes the result deterministic;
//! ComfyUI instead rounds stochastically back to the base's fp8 with scale 1. The fp8 rounding of
//! the fused weight is the only extra error (≤ half an fp8 ulp, i.e. ≤ 2⁻⁴ relative per element for
//! e4m3fn).
//!
//! Originals are kept on the host, pinned (see `host_copy`): a Lightning LoRA touches every Linear
//! of the 20 B Qwen DiT, so a device copy would double the transformer's memory (20 GB in fp8, 41
//! GB in bf16). Measured on an H200 (PCIe 5 x16, 4 GiB of bf16 in 128 MiB tensors): device→pinned
//! 55 GB/s, pinned→device 55 GB/s (pageable memory: 1.7 and 8.4 GB/s), so backing up and restoring
//! 41 GB costs about 0.75 s each way, paid only when the LoRA set changes
//! ([`AppliedLoras::is_same_set`]). The first pinned allocation of that size is slower (2.7 GB/s,
//! ~15 s for 41 GB); libtorch's host allocator caches the blocks for later LoRA changes.
//!
//! A LoRA that nothing will remove (one a model is loaded with, as the Qwen engine's Lightning
//! LoRA) is fused by [`fuse_for_good`] instead: the same weights bit for bit, but no original is
//! kept, so it costs neither the pinned copies nor their allocation (about 38 s of a Qwen cold
//! start on the H200 with a Lightning LoRA, `docs/performance.md`, step 14), and the replaced
//! weights are freed as the fuse goes. [`LoraReport::kept_bytes`] says what a fuse kept.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use tch::{Device, Kind, Tensor};

use crate::dtype::is_fp8;
use crate::error::LoadError;
use crate::loading::safetensors::SafetensorsFile;
use crate::nn::{Conv2d, Linear};

/// Why LoRAs could not be applied or restored.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{path}: key `{key}`: {reason}")]
    Unsupported {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("{path}: LoRA module `{module}` has no {missing}")]
    Incomplete {
        path: PathBuf,
        module: String,
        missing: &'static str,
    },
    #[error("{path}: key `{key}`: {reason}")]
    Shape {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error(
        "{path}: none of its {modules} LoRA modules (e.g. `{example}`) matches a module of the model"
    )]
    NoMatch {
        path: PathBuf,
        modules: usize,
        example: String,
    },
    #[error("{path}: kohya name `{key}` matches several modules of the model: {candidates:?}")]
    Ambiguous {
        path: PathBuf,
        key: String,
        candidates: Vec<String>,
    },
    #[error("restore: module `{module}` is no longer in the model")]
    RestoreMissing { module: String },
    #[error("torch error while fusing `{key}` from {path}: {source}")]
    Torch {
        path: PathBuf,
        key: String,
        #[source]
        source: tch::TchError,
    },
}

/// Which model component a LoRA module belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// The denoiser: the Qwen-Image transformer, SDXL's UNet.
    Denoiser,
    /// The (first) text encoder.
    TextEncoder,
    /// SDXL's second text encoder.
    TextEncoder2,
}

/// A weight a LoRA can patch.
pub enum LoraModule<'a> {
    Linear(&'a mut Linear),
    Conv2d(&'a mut Conv2d),
}

/// A model (or a map of layers) whose weights LoRAs can patch, by diffusers module name
/// (`transformer_blocks.0.attn.to_q`, the weight key without `.weight`).
pub trait LoraTarget {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)>;

    /// Other names LoRA files use for the target's modules, as `(alias, module name)`: SDXL's
    /// sgm/ldm UNet names that kohya's sd-scripts trains under
    /// (`input_blocks.4.1.transformer_blocks.0.attn1.to_q`), or a text encoder's names without
    /// the `text_model.` level that transformers 5 dropped. Looked up like module names (dotted
    /// and flattened), after them.
    fn lora_aliases(&mut self) -> Vec<(String, String)> {
        Vec::new()
    }
}

impl<'a> From<&'a mut Linear> for LoraModule<'a> {
    fn from(l: &'a mut Linear) -> Self {
        Self::Linear(l)
    }
}

impl<'a> From<&'a mut Conv2d> for LoraModule<'a> {
    fn from(c: &'a mut Conv2d) -> Self {
        Self::Conv2d(c)
    }
}

impl LoraTarget for BTreeMap<String, Linear> {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        self.iter_mut()
            .map(|(k, v)| (k.clone(), LoraModule::Linear(v)))
            .collect()
    }
}

impl LoraTarget for HashMap<String, Linear> {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        self.iter_mut()
            .map(|(k, v)| (k.clone(), LoraModule::Linear(v)))
            .collect()
    }
}

/// How a LoRA names its module.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum ModuleName {
    /// Dotted diffusers name, looked up as is.
    Dotted(String),
    /// Kohya's flattened name (`.` → `_`), looked up among the target's flattened names.
    Flat(String),
}

impl ModuleName {
    fn as_str(&self) -> &str {
        match self {
            Self::Dotted(s) | Self::Flat(s) => s,
        }
    }
}

/// One low-rank pair of a file, by its keys (tensors are read when fusing).
#[derive(Debug, Clone)]
struct LoraPair {
    component: Component,
    name: ModuleName,
    down: String,
    up: String,
    alpha: Option<String>,
}

/// What identifies a LoRA on disk: two jobs with equal fingerprints and strengths get the same
/// fused weights.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFingerprint {
    pub path: PathBuf,
    pub len: u64,
    pub modified: Option<SystemTime>,
}

impl LoraFingerprint {
    pub fn of(path: &Path) -> Result<Self, LoraError> {
        let meta = std::fs::metadata(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }
}

/// A LoRA a job asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub path: PathBuf,
    pub strength: f64,
}

/// A parsed LoRA file.
#[derive(Debug)]
pub struct LoraFile {
    file: Arc<SafetensorsFile>,
    fingerprint: LoraFingerprint,
    pairs: Vec<LoraPair>,
}

/// What one key of a LoRA file is.
enum KeyRole {
    Down,
    Up,
    Alpha,
}

const DENOISER_PREFIXES: [&str; 5] = [
    "model.diffusion_model.",
    "diffusion_model.",
    "base_model.model.",
    "transformer.",
    "unet.",
];

/// Splits a key into (component, module name, role), or says why it is not supported.
fn classify(key: &str) -> Result<(Component, ModuleName, KeyRole), String> {
    // Kohya / LyCORIS flat names: the module is everything before the first `.`.
    for (prefix, component) in [
        ("lora_unet_", Component::Denoiser),
        ("lycoris_", Component::Denoiser),
        ("lora_te1_", Component::TextEncoder),
        ("lora_te2_", Component::TextEncoder2),
        ("lora_te_", Component::TextEncoder),
    ] {
        if let Some(rest) = key.strip_prefix(prefix) {
            let (module, suffix) = rest
                .split_once('.')
                .ok_or_else(|| "a kohya key without a `.` suffix".to_string())?;
            let role = role_of(&format!(".{suffix}"))
                .map_err(|r| r.to_string())?
                .ok_or_else(|| format!("unknown suffix `.{suffix}`"))?;
            return Ok((component, ModuleName::Flat(module.to_string()), role));
        }
    }
    let (component, rest) = if let Some(r) = key.strip_prefix("text_encoder_2.") {
        (Component::TextEncoder2, r)
    } else if let Some(r) = key.strip_prefix("text_encoder.") {
        (Component::TextEncoder, r)
    } else {
        let r = DENOISER_PREFIXES
            .iter()
            .find_map(|p| key.strip_prefix(p))
            .unwrap_or(key);
        (Component::Denoiser, r)
    };
    for suffix in SUFFIXES
        .iter()
        .map(|(s, _)| *s)
        .chain(UNSUPPORTED.iter().map(|(s, _)| *s))
    {
        if let Some(module) = rest.strip_suffix(suffix) {
            let role = role_of(suffix)
                .map_err(|r| r.to_string())?
                .expect("every listed suffix has a role or a reason");
            return Ok((component, ModuleName::Dotted(module.to_string()), role));
        }
    }
    Err(
        "not a LoRA key this loader knows (expected lora_down/lora_up, lora_A/lora_B or alpha)"
            .into(),
    )
}

const SUFFIXES: [(&str, u8); 7] = [
    (".lora_down.weight", 0),
    (".lora_A.weight", 0),
    (".lora_A.default.weight", 0),
    (".lora_up.weight", 1),
    (".lora_B.weight", 1),
    (".lora_B.default.weight", 1),
    (".alpha", 2),
];

const UNSUPPORTED: [(&str, &str); 12] = [
    (
        ".lora_mid.weight",
        "LoCon with a Tucker mid weight is not supported",
    ),
    (".hada_w1_a", "LoHa is not supported"),
    (".hada_w1_b", "LoHa is not supported"),
    (".hada_w2_a", "LoHa is not supported"),
    (".hada_w2_b", "LoHa is not supported"),
    (".lokr_w1", "LoKr is not supported"),
    (".lokr_w2", "LoKr is not supported"),
    (".dora_scale", "DoRA is not supported"),
    (".diff", "full weight differences are not supported"),
    (".diff_b", "full bias differences are not supported"),
    (".lora_B.bias", "LoRA biases are not supported"),
    (".lora_up.bias", "LoRA biases are not supported"),
];

/// The role of a suffix: `Ok(Some)` for LoRA parts, `Err(reason)` for known unsupported ones,
/// `Ok(None)` for unknown ones.
fn role_of(suffix: &str) -> Result<Option<KeyRole>, &'static str> {
    if let Some((_, r)) = SUFFIXES.iter().find(|(s, _)| *s == suffix) {
        return Ok(Some(match r {
            0 => KeyRole::Down,
            1 => KeyRole::Up,
            _ => KeyRole::Alpha,
        }));
    }
    if let Some((_, reason)) = UNSUPPORTED.iter().find(|(s, _)| *s == suffix) {
        return Err(reason);
    }
    // LoKr/LoHa have more parts (`lokr_w1_a`, `lokr_t2`, `hada_t1`): name the family.
    if suffix.starts_with(".lokr_") {
        return Err("LoKr is not supported");
    }
    if suffix.starts_with(".hada_") {
        return Err("LoHa is not supported");
    }
    Ok(None)
}

impl LoraFile {
    /// Opens and parses `path`; any key that is not part of a supported LoRA is an error naming it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LoraError> {
        let path = path.as_ref();
        let fingerprint = LoraFingerprint::of(path)?;
        let file = Arc::new(SafetensorsFile::open(path)?);
        #[derive(Default)]
        struct Parts {
            down: Option<String>,
            up: Option<String>,
            alpha: Option<String>,
        }
        let mut modules: BTreeMap<(Component, ModuleName), Parts> = BTreeMap::new();
        let mut keys: Vec<&str> = file.names().collect();
        keys.sort_unstable();
        for key in keys {
            let (component, name, role) =
                classify(key).map_err(|reason| LoraError::Unsupported {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                    reason,
                })?;
            let parts = modules.entry((component, name)).or_default();
            let slot = match role {
                KeyRole::Down => &mut parts.down,
                KeyRole::Up => &mut parts.up,
                KeyRole::Alpha => &mut parts.alpha,
            };
            if let Some(previous) = slot.replace(key.to_string()) {
                return Err(LoraError::Unsupported {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                    reason: format!("names the same LoRA part as `{previous}`"),
                });
            }
        }
        let mut pairs = Vec::with_capacity(modules.len());
        for ((component, name), parts) in modules {
            let incomplete = |missing| LoraError::Incomplete {
                path: path.to_path_buf(),
                module: name.as_str().to_string(),
                missing,
            };
            let down = parts
                .down
                .ok_or_else(|| incomplete("down (lora_down / lora_A) weight"))?;
            let up = parts
                .up
                .ok_or_else(|| incomplete("up (lora_up / lora_B) weight"))?;
            pairs.push(LoraPair {
                component,
                name,
                down,
                up,
                alpha: parts.alpha,
            });
        }
        Ok(Self {
            file,
            fingerprint,
            pairs,
        })
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    pub fn fingerprint(&self) -> &LoraFingerprint {
        &self.fingerprint
    }

    /// How many low-rank modules the file holds.
    pub fn num_modules(&self) -> usize {
        self.pairs.len()
    }

    fn shape(&self, key: &str) -> Vec<i64> {
        self.file
            .info(key)
            .map(|i| i.shape.clone())
            .unwrap_or_default()
    }
}

/// What applying one file did.
#[derive(Debug, Clone, PartialEq)]
pub struct FileReport {
    pub path: PathBuf,
    /// Target modules this file patched.
    pub fused: Vec<String>,
    /// The file's module names (as written, without suffix) that match no module of the model.
    pub unmatched: Vec<String>,
    /// Target modules this file left alone.
    pub untouched: usize,
}

/// What applying a LoRA set did, per file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoraReport {
    pub files: Vec<FileReport>,
    /// Distinct modules patched by any file.
    pub fused_modules: usize,
    /// Bytes of original weights (and fp8 scales) kept to restore the base: pinned host copies of
    /// device weights, the replaced tensors themselves on the CPU. 0 after [`fuse_for_good`].
    pub kept_bytes: u64,
}

/// The LoRA set currently fused into a model, with the originals to restore it.
#[derive(Debug)]
pub struct AppliedLoras {
    set: Vec<(LoraFingerprint, f64)>,
    originals: Vec<Original>,
    report: LoraReport,
}

/// A weight as it was before a fuse: (component, module, weight on the host, fp8 scale on the
/// host).
type Original = (Component, String, Tensor, Option<Tensor>);

/// Whether a fuse keeps what it replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Originals {
    /// On the host, to restore the base ([`apply`]).
    Kept,
    /// Freed: nothing will restore the base ([`fuse_for_good`]).
    Dropped,
}

/// One component of a model that LoRAs may patch.
pub struct TargetRef<'a> {
    pub component: Component,
    pub target: &'a mut dyn LoraTarget,
}

/// Where a pair resolved: (target index, module index within it).
type Slot = (usize, usize);

/// Fuses `loras` (file, strength) into `targets`, keeping each replaced weight on the host so
/// that [`AppliedLoras::restore`] puts the base back bit for bit. Everything is checked (names,
/// shapes) before any weight changes, so an error leaves the model as it was. A file that matches
/// no module is an error; modules of a file that match nothing are reported in [`LoraReport`].
pub fn apply(
    loras: &[(&LoraFile, f64)],
    targets: &mut [TargetRef<'_>],
) -> Result<AppliedLoras, LoraError> {
    let (report, originals) = fuse(loras, targets, Originals::Kept, true)?;
    Ok(AppliedLoras {
        set: loras
            .iter()
            .map(|(f, s)| (f.fingerprint.clone(), *s))
            .collect(),
        originals,
        report,
    })
}

/// Fuses `loras` into `targets` for good: the weights [`apply`] would make, bit for bit, checked
/// the same way first, but nothing is kept to restore the base (the report's `kept_bytes` is 0),
/// and each replaced weight is freed as the fuse goes. For LoRAs a model is loaded with and no job
/// removes; a job's own LoRAs on top of them go through [`JobLoras`], which restores to this fused
/// state.
pub fn fuse_for_good(
    loras: &[(&LoraFile, f64)],
    targets: &mut [TargetRef<'_>],
) -> Result<LoraReport, LoraError> {
    let (report, originals) = fuse(loras, targets, Originals::Dropped, true)?;
    debug_assert!(originals.is_empty(), "a fuse for good keeps nothing");
    Ok(report)
}

/// [`fuse_for_good`] split into parts of a model, each fused as soon as it is loaded (a block of
/// layers), so that the fuse's device work overlaps the reading of the parts still loading. The
/// weights are those the whole-model fuse makes, bit for bit (each module's fuse is its own). Each
/// part is checked before it changes; a pair that matches no module of a part is left for the
/// others, and a file is an error ([`LoraError::NoMatch`]) only when it matched no module of any
/// part ([`PartFuser::finish`]). Parts must not share module names, flattened ones included (a
/// kohya name matching modules of two parts is not found ambiguous, as the whole-model fuse would
/// find it).
pub struct PartFuser {
    files: Vec<LoraFile>,
    specs: Vec<LoraSpec>,
    reports: std::sync::Mutex<Vec<LoraReport>>,
}

impl PartFuser {
    /// Opens the LoRA files of `specs` (a file that cannot be read or is no LoRA is the error).
    pub fn open(specs: &[LoraSpec]) -> Result<Self, LoraError> {
        Ok(Self {
            files: open_specs(specs)?,
            specs: specs.to_vec(),
            reports: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Fuses for good the pairs that match a module of `targets`, one part of the model; may run
    /// on several threads at once, for different parts.
    pub fn part(&self, targets: &mut [TargetRef<'_>]) -> Result<(), LoraError> {
        let loras = with_strengths(&self.files, &self.specs);
        let (report, _) = fuse(&loras, targets, Originals::Dropped, false)?;
        self.reports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(report);
        Ok(())
    }

    /// The parts' reports as the whole model's, once every part is fused.
    pub fn finish(self) -> Result<LoraReport, LoraError> {
        let parts = self
            .reports
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut report = LoraReport {
            fused_modules: parts.iter().map(|p| p.fused_modules).sum(),
            ..LoraReport::default()
        };
        for (fi, file) in self.files.iter().enumerate() {
            let mut fused = Vec::new();
            let mut untouched = 0;
            let mut unmatched: Option<BTreeSet<String>> = None;
            for r in parts.iter().map(|p| &p.files[fi]) {
                fused.extend(r.fused.iter().cloned());
                untouched += r.untouched;
                let here: BTreeSet<String> = r.unmatched.iter().cloned().collect();
                unmatched = Some(match unmatched {
                    None => here,
                    Some(before) => before.intersection(&here).cloned().collect(),
                });
            }
            if fused.is_empty() {
                return Err(no_match(file));
            }
            fused.sort();
            report.files.push(FileReport {
                path: file.path().to_path_buf(),
                fused,
                unmatched: unmatched.unwrap_or_default().into_iter().collect(),
                untouched,
            });
        }
        Ok(report)
    }
}

/// A file none of whose modules matches a module of the model.
fn no_match(file: &LoraFile) -> LoraError {
    LoraError::NoMatch {
        path: file.path().to_path_buf(),
        modules: file.pairs.len(),
        example: file
            .pairs
            .first()
            .map(|p| p.name.as_str().to_string())
            .unwrap_or_default(),
    }
}

/// [`apply`] or [`fuse_for_good`]: checks, fuses and, where `keep` says so, keeps the originals.
/// `whole`: `targets` are the whole model, where a file that matches nothing is an error (a
/// [`PartFuser`] part is not).
fn fuse(
    loras: &[(&LoraFile, f64)],
    targets: &mut [TargetRef<'_>],
    keep: Originals,
    whole: bool,
) -> Result<(LoraReport, Vec<Original>), LoraError> {
    let components: Vec<Component> = targets.iter().map(|t| t.component).collect();
    let aliases: Vec<Vec<(String, String)>> = targets
        .iter_mut()
        .map(|t| t.target.lora_aliases())
        .collect();
    let mut modules: Vec<Vec<(String, LoraModule<'_>)>> = targets
        .iter_mut()
        .map(|t| t.target.lora_modules())
        .collect();
    // Name tables per component: dotted names, and flattened names for kohya (a flattened name
    // that two modules share is recorded as ambiguous). Aliases fill in names no module has.
    let mut dotted: HashMap<(Component, String), Slot> = HashMap::new();
    let mut flat: HashMap<(Component, String), Vec<Slot>> = HashMap::new();
    for (ti, (&component, list)) in components.iter().zip(&modules).enumerate() {
        for (mi, (name, _)) in list.iter().enumerate() {
            dotted.insert((component, name.clone()), (ti, mi));
            flat.entry((component, name.replace('.', "_")))
                .or_default()
                .push((ti, mi));
        }
    }
    for (ti, (&component, list)) in components.iter().zip(&aliases).enumerate() {
        let index: HashMap<&str, usize> = modules[ti]
            .iter()
            .enumerate()
            .map(|(mi, (name, _))| (name.as_str(), mi))
            .collect();
        for (alias, name) in list {
            let Some(&mi) = index.get(name.as_str()) else {
                continue;
            };
            dotted.entry((component, alias.clone())).or_insert((ti, mi));
            let slots = flat
                .entry((component, alias.replace('.', "_")))
                .or_default();
            if !slots.contains(&(ti, mi)) {
                slots.push((ti, mi));
            }
        }
    }
    let total_modules: usize = modules.iter().map(Vec::len).sum();

    // Resolve and check shapes.
    let mut plan: BTreeMap<Slot, Vec<(usize, &LoraPair, f64)>> = BTreeMap::new();
    let mut report = LoraReport::default();
    for (fi, (file, strength)) in loras.iter().enumerate() {
        let path = file.path().to_path_buf();
        let mut fused = Vec::new();
        let mut unmatched = Vec::new();
        for pair in &file.pairs {
            let slot = match &pair.name {
                ModuleName::Dotted(n) => dotted.get(&(pair.component, n.clone())).copied(),
                ModuleName::Flat(n) => match flat.get(&(pair.component, n.clone())) {
                    None => None,
                    Some(slots) if slots.len() == 1 => Some(slots[0]),
                    Some(slots) => {
                        return Err(LoraError::Ambiguous {
                            path,
                            key: pair.down.clone(),
                            candidates: slots
                                .iter()
                                .map(|&(t, m)| modules[t][m].0.clone())
                                .collect(),
                        });
                    }
                },
            };
            let Some(slot) = slot else {
                unmatched.push(pair.name.as_str().to_string());
                continue;
            };
            let (name, module) = &modules[slot.0][slot.1];
            let weight_shape = match module {
                LoraModule::Linear(l) => l.weight.size(),
                LoraModule::Conv2d(c) => c.weight.size(),
            };
            check_shapes(file, pair, &weight_shape)?;
            let scale = match &pair.alpha {
                None => 1.0,
                Some(key) => {
                    let alpha = file.file.load(key, Device::Cpu, Kind::Double)?;
                    if alpha.numel() != 1 {
                        return Err(LoraError::Shape {
                            path,
                            key: key.clone(),
                            reason: format!("alpha must be a scalar, has shape {:?}", alpha.size()),
                        });
                    }
                    let rank = file.shape(&pair.down)[0];
                    alpha.double_value(&[]) / rank as f64
                }
            };
            fused.push(name.clone());
            plan.entry(slot)
                .or_default()
                .push((fi, pair, strength * scale));
        }
        if fused.is_empty() && whole {
            return Err(no_match(file));
        }
        fused.sort();
        report.files.push(FileReport {
            path,
            untouched: total_modules - fused.len(),
            fused,
            unmatched,
        });
    }
    report.fused_modules = plan.len();

    // Fuse, keeping each original on the host where asked.
    let mut originals = Vec::with_capacity(match keep {
        Originals::Kept => plan.len(),
        Originals::Dropped => 0,
    });
    for ((ti, mi), parts) in plan {
        let component = components[ti];
        let (name, module) = &mut modules[ti][mi];
        let torch_err = |fi: usize, key: &str| {
            let path = loras[fi].0.path().to_path_buf();
            let key = key.to_string();
            move |source| LoraError::Torch { path, key, source }
        };
        let (weight, scale) = match module {
            LoraModule::Linear(l) => (&l.weight, l.weight_scale.as_ref()),
            LoraModule::Conv2d(c) => (&c.weight, None),
        };
        let device = weight.device();
        let kind = weight.kind();
        let first = parts[0].0;
        let mut w = dequantised(weight, scale);
        for (fi, pair, factor) in parts {
            let file = &loras[fi].0.file;
            let down = file.load(&pair.down, device, Kind::Float)?;
            let up = file.load(&pair.up, device, Kind::Float)?;
            let rank = down.size()[0];
            let delta = up
                .f_reshape([up.size()[0], rank])
                .and_then(|u| u.f_matmul(&down.f_reshape([rank, -1])?))
                .and_then(|d| d.f_reshape(w.size()))
                .map_err(torch_err(fi, &pair.down))?;
            // Out of place on purpose: for an fp32 base, `w` still shares the model's (and the
            // kept original's) storage, which `+=` would overwrite.
            w = w.g_add(&(delta * factor));
        }
        let original = match keep {
            Originals::Kept => {
                let key = format!("{name}.weight");
                let weight = host_copy(weight).map_err(torch_err(first, &key))?;
                let scale = scale
                    .map(host_copy)
                    .transpose()
                    .map_err(torch_err(first, &key))?;
                report.kept_bytes += bytes(&weight) + scale.as_ref().map_or(0, bytes);
                Some((weight, scale))
            }
            Originals::Dropped => None,
        };
        match module {
            LoraModule::Linear(l) if is_fp8(kind) => {
                let (q, s) = quantise_fp8(&w, kind);
                l.weight = q;
                l.weight_scale = Some(s);
            }
            LoraModule::Linear(l) => l.weight = w.to_kind(kind),
            LoraModule::Conv2d(c) => c.weight = w.to_kind(kind),
        }
        if let Some((weight, scale)) = original {
            originals.push((component, name.clone(), weight, scale));
        }
    }
    Ok((report, originals))
}

/// The bytes of a tensor's elements.
fn bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// A host copy of `t` to restore it from: pinned memory for a CUDA tensor (device→pinned copies
/// run at ~55 GB/s on an H200 host, into pageable memory at ~1.7 GB/s; pinned→device ~55 GB/s
/// against ~8 GB/s), and `t` itself on the CPU: fusing replaces weights, never writes into them,
/// so the original stays intact without a second copy.
fn host_copy(t: &Tensor) -> Result<Tensor, tch::TchError> {
    let device = t.device();
    if !device.is_cuda() {
        return t.f_to_device(Device::Cpu);
    }
    let host = Tensor::f_empty(t.size(), (t.kind(), Device::Cpu))?.f_internal_pin_memory(device)?;
    let mut dst = host.shallow_clone();
    dst.f_copy_(t)?;
    Ok(host)
}

/// Checks that `up @ down` has the weight's shape: `[out, r] @ [r, in]` for a Linear (a 1×1 conv
/// layout `[.., 1, 1]` is accepted), `[out, r, 1, 1]` and `[r, in, kh, kw]` for a conv.
fn check_shapes(file: &LoraFile, pair: &LoraPair, weight: &[i64]) -> Result<(), LoraError> {
    let down = file.shape(&pair.down);
    let up = file.shape(&pair.up);
    let bad = |key: &str, reason: String| LoraError::Shape {
        path: file.path().to_path_buf(),
        key: key.to_string(),
        reason,
    };
    let trailing_ones = |s: &[i64]| s.iter().skip(2).all(|&d| d == 1);
    if down.len() < 2 || up.len() < 2 || !trailing_ones(&up) {
        return Err(bad(
            &pair.up,
            format!("unsupported LoRA shapes: down {down:?}, up {up:?}"),
        ));
    }
    if up[1] != down[0] {
        return Err(bad(
            &pair.up,
            format!("rank mismatch: up {up:?} vs down {down:?}"),
        ));
    }
    let expected_in: Vec<i64> = if weight.len() == 2 {
        if !trailing_ones(&down) {
            return Err(bad(
                &pair.down,
                format!("a {down:?} conv LoRA cannot patch a Linear of shape {weight:?}"),
            ));
        }
        vec![weight[1]]
    } else {
        weight[1..].to_vec()
    };
    let found_in: Vec<i64> = if weight.len() == 2 {
        vec![down[1]]
    } else {
        down[1..].to_vec()
    };
    if up[0] != weight[0] || found_in != expected_in {
        return Err(bad(
            &pair.down,
            format!(
                "up {up:?} @ down {down:?} does not fit the model's weight of shape {weight:?}"
            ),
        ));
    }
    Ok(())
}

/// The weight in fp32 (`w.float() · scale` for fp8).
fn dequantised(weight: &Tensor, scale: Option<&Tensor>) -> Tensor {
    let w = weight.to_kind(Kind::Float);
    match scale {
        Some(s) if is_fp8(weight.kind()) => w * s,
        _ => w,
    }
}

/// The largest finite value of an fp8 kind.
fn fp8_max(kind: Kind) -> f64 {
    match kind {
        Kind::Float8e4m3fn => 448.0,
        Kind::Float8e4m3fnuz => 240.0,
        _ => 57344.0, // e5m2, e5m2fnuz
    }
}

/// fp32 `w` to fp8 `kind` with a per-tensor scale `amax / fp8_max` (1 for an all-zero tensor),
/// rounding to nearest. Returns (fp8 weight, 0-d fp32 scale), both on `w`'s device.
fn quantise_fp8(w: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let max = fp8_max(kind);
    let amax = w.abs().max();
    let scale = (&amax / max).where_self(&amax.gt(0.0), &amax.ones_like());
    // The clamp only catches the last-bit overshoot of `w / scale` at ±amax.
    let q = (w / &scale).clamp(-max, max).to_kind(kind);
    (q, scale)
}

impl AppliedLoras {
    pub fn report(&self) -> &LoraReport {
        &self.report
    }

    /// Whether `requested` is the set applied now: same files (path, size, modification time),
    /// same strengths, same order. A job whose set is the same pays nothing.
    pub fn is_same_set(&self, requested: &[LoraSpec]) -> bool {
        self.set.len() == requested.len()
            && self.set.iter().zip(requested).all(|((fp, s), spec)| {
                s.to_bits() == spec.strength.to_bits()
                    && LoraFingerprint::of(&spec.path).is_ok_and(|now| now == *fp)
            })
    }

    /// Puts back every patched weight (and fp8 scale) exactly as it was, on its device.
    pub fn restore(self, targets: &mut [TargetRef<'_>]) -> Result<(), LoraError> {
        let mut modules: HashMap<(Component, String), LoraModule<'_>> = HashMap::new();
        for t in targets.iter_mut() {
            let component = t.component;
            for (name, m) in t.target.lora_modules() {
                modules.insert((component, name), m);
            }
        }
        // Check every module first so that a failure restores nothing rather than half.
        for (component, name, _, _) in &self.originals {
            if !modules.contains_key(&(*component, name.clone())) {
                return Err(LoraError::RestoreMissing {
                    module: name.clone(),
                });
            }
        }
        for (component, name, weight, scale) in self.originals {
            let module = modules
                .get_mut(&(component, name))
                .expect("checked above that every module is present");
            match module {
                LoraModule::Linear(l) => {
                    let device = l.weight.device();
                    l.weight = weight.to_device(device);
                    l.weight_scale = scale.map(|s| s.to_device(device));
                }
                LoraModule::Conv2d(c) => c.weight = weight.to_device(c.weight.device()),
            }
        }
        Ok(())
    }
}

/// Opens `specs` and fuses them into `targets` (see [`apply`]).
pub fn apply_specs(
    specs: &[LoraSpec],
    targets: &mut [TargetRef<'_>],
) -> Result<AppliedLoras, LoraError> {
    let files = open_specs(specs)?;
    apply(&with_strengths(&files, specs), targets)
}

/// Opens `specs` and fuses them into `targets` for good (see [`fuse_for_good`]).
pub fn fuse_specs_for_good(
    specs: &[LoraSpec],
    targets: &mut [TargetRef<'_>],
) -> Result<LoraReport, LoraError> {
    let files = open_specs(specs)?;
    fuse_for_good(&with_strengths(&files, specs), targets)
}

fn open_specs(specs: &[LoraSpec]) -> Result<Vec<LoraFile>, LoraError> {
    specs.iter().map(|s| LoraFile::open(&s.path)).collect()
}

fn with_strengths<'a>(files: &'a [LoraFile], specs: &[LoraSpec]) -> Vec<(&'a LoraFile, f64)> {
    files
        .iter()
        .zip(specs)
        .map(|(f, s)| (f, s.strength))
        .collect()
}

/// What [`JobLoras::set`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoraSwitch {
    /// The previous job's set was removed (its weights put back bit for bit).
    pub restored: bool,
    /// The requested set was fused.
    pub applied: bool,
}

impl LoraSwitch {
    /// Whether anything changed (the same set twice in a row changes nothing).
    pub fn changed(&self) -> bool {
        self.restored || self.applied
    }
}

/// The LoRA set a model carries for its current job, on top of whatever it was loaded with.
#[derive(Debug, Default)]
pub struct JobLoras {
    applied: Option<AppliedLoras>,
}

impl JobLoras {
    /// What is fused now, if anything.
    pub fn report(&self) -> Option<&LoraReport> {
        self.applied.as_ref().map(AppliedLoras::report)
    }

    /// Makes `targets` carry exactly `specs` (none: the base). The same set as now (same files,
    /// unchanged on disk, same strengths, same order) costs nothing; another set first puts the
    /// base back bit for bit, then fuses the new one. An error while fusing leaves the base.
    pub fn set(
        &mut self,
        specs: &[LoraSpec],
        targets: &mut [TargetRef<'_>],
    ) -> Result<LoraSwitch, LoraError> {
        let same = match &self.applied {
            Some(applied) => applied.is_same_set(specs),
            None => specs.is_empty(),
        };
        let mut switch = LoraSwitch::default();
        if same {
            return Ok(switch);
        }
        let _guard = tch::no_grad_guard();
        if let Some(applied) = self.applied.take() {
            applied.restore(targets)?;
            switch.restored = true;
        }
        if !specs.is_empty() {
            self.applied = Some(apply_specs(specs, targets)?);
            switch.applied = true;
        }
        Ok(switch)
    }
}

/// A job's LoRAs that cannot be fused are the job's fault; a failed restore or a libtorch failure
/// is the model's or the device's.
impl From<LoraError> for crate::error::GenerateError {
    fn from(e: LoraError) -> Self {
        if e.is_in_the_files() {
            Self::InvalidRequest(e.to_string())
        } else {
            Self::Backend(format!("switching LoRAs: {e}"))
        }
    }
}

impl LoraError {
    /// Whether the error is the job's LoRA files' (unreadable, unsupported, not fitting the
    /// model) rather than the model's or the device's.
    pub fn is_in_the_files(&self) -> bool {
        match self {
            LoraError::Load(_)
            | LoraError::Unsupported { .. }
            | LoraError::Incomplete { .. }
            | LoraError::Shape { .. }
            | LoraError::NoMatch { .. }
            | LoraError::Ambiguous { .. } => true,
            LoraError::RestoreMissing { .. } | LoraError::Torch { .. } => false,
        }
    }
}
