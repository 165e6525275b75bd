//! Named weight access for model constructors: a [`WeightStore`] maps every tensor name in
//! diffusers naming to where it lives (file, key, and an optional transform for ldm single-file
//! checkpoints); a [`Weights`] is a cursor into it with a name prefix, the target device and dtype.
//!
//! Invariant: model code asks for tensors by their diffusers key and the shape it expects; every
//! failure names the tensor and the file (missing, wrong shape, truncated, unsupported dtype).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tch::{Device, Kind, Tensor};

use crate::dtype::is_fp8;
use crate::error::LoadError;
use crate::loading::pth::PthFile;
use crate::loading::safetensors::SafetensorsFile;

/// A file tensors are read from.
#[derive(Debug, Clone)]
pub enum TensorFile {
    Safetensors(Arc<SafetensorsFile>),
    /// A PyTorch zip checkpoint, reduced to its state dict ([`PthFile`]).
    Pth(Arc<PthFile>),
}

impl TensorFile {
    pub fn path(&self) -> &std::path::Path {
        match self {
            TensorFile::Safetensors(f) => f.path(),
            TensorFile::Pth(f) => f.path(),
        }
    }

    /// Stored shape of `key`.
    pub fn shape(&self, key: &str) -> Option<Vec<i64>> {
        match self {
            TensorFile::Safetensors(f) => f.info(key).map(|i| i.shape.clone()),
            TensorFile::Pth(f) => f.shape(key).map(<[i64]>::to_vec),
        }
    }

    pub fn names(&self) -> Vec<String> {
        match self {
            TensorFile::Safetensors(f) => f.names().map(str::to_string).collect(),
            TensorFile::Pth(f) => f.names().map(str::to_string).collect(),
        }
    }

    pub fn load(&self, key: &str, device: Device, kind: Kind) -> Result<Tensor, LoadError> {
        match self {
            TensorFile::Safetensors(f) => f.load(key, device, kind),
            TensorFile::Pth(f) => f.load(key, device, kind),
        }
    }
}

/// How a stored tensor becomes the requested one.
#[derive(Debug, Clone)]
pub enum Transform {
    /// Used as stored (a reshape that only adds or drops trailing size-1 dims is allowed, e.g. a
    /// 1x1 conv weight `[o, i, 1, 1]` read as a linear weight `[o, i]`).
    Identity,
    /// Rows `[index*n/parts, (index+1)*n/parts)` of dim 0: OpenCLIP's fused `in_proj` into q/k/v.
    Chunk { index: i64, parts: i64 },
    /// Transposed 2-D matrix: OpenCLIP's `text_projection` (`x @ P`) into a Linear weight.
    Transpose,
}

/// Where one diffusers-named tensor is stored.
#[derive(Debug, Clone)]
pub struct Source {
    pub file: usize,
    pub key: String,
    pub transform: Transform,
}

/// What happens to Linear weights stored in fp8 (`F8_E4M3` / `F8_E5M2`, optionally with a
/// per-tensor `scale_weight` / `weight_scale` beside them, ComfyUI's "scaled fp8").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Mode {
    /// Dequantised once at load into the cursor's dtype (`w.float() * scale`, then cast).
    #[default]
    Upcast,
    /// Kept in fp8 on the device with its scale; the layer (`nn::Linear`) dequantises per call, so
    /// the weights take one byte per parameter.
    Resident,
}

/// A name table over one or more memory-mapped files, or over shapes only (see
/// [`WeightStore::placeholders`]). It records which names were asked for.
#[derive(Debug, Default)]
pub struct WeightStore {
    files: Vec<TensorFile>,
    names: HashMap<String, Source>,
    placeholders: HashMap<String, Vec<i64>>,
    requested: Mutex<BTreeSet<String>>,
    fp8: Fp8Mode,
}

impl WeightStore {
    /// Every tensor of `file` under its own name (diffusers folders).
    pub fn identity(file: Arc<SafetensorsFile>) -> Self {
        Self::renamed(file, |k| Some(k.to_string()))
    }

    /// Every tensor of `file` under `rename(key)`; keys mapped to `None` are skipped.
    pub fn renamed(file: Arc<SafetensorsFile>, rename: impl Fn(&str) -> Option<String>) -> Self {
        Self::renamed_file(TensorFile::Safetensors(file), rename)
    }

    /// [`WeightStore::renamed`] for any [`TensorFile`].
    pub fn renamed_file(file: TensorFile, rename: impl Fn(&str) -> Option<String>) -> Self {
        let mut store = Self::default();
        store.files.push(file);
        let keys = store.files[0].names();
        for k in keys {
            if let Some(name) = rename(&k) {
                store.insert(name, 0, k, Transform::Identity);
            }
        }
        store
    }

    /// A store of shapes only: every tensor is a zero scalar expanded to its shape (no memory), for
    /// checking that a config asks for exactly the tensors of a checkpoint layout (dry runs).
    pub fn placeholders(shapes: HashMap<String, Vec<i64>>) -> Self {
        Self {
            placeholders: shapes,
            ..Self::default()
        }
    }

    /// Known names that no model constructor asked for (so far).
    pub fn unused(&self) -> Vec<String> {
        let requested = self
            .requested
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.names
            .keys()
            .chain(self.placeholders.keys())
            .filter(|k| !requested.contains(*k))
            .cloned()
            .collect()
    }

    pub fn add_file(&mut self, file: Arc<SafetensorsFile>) -> usize {
        self.files.push(TensorFile::Safetensors(file));
        self.files.len() - 1
    }

    pub fn insert(&mut self, name: String, file: usize, key: String, transform: Transform) {
        self.names.insert(
            name,
            Source {
                file,
                key,
                transform,
            },
        );
    }

    pub fn len(&self) -> usize {
        self.names.len() + self.placeholders.len()
    }

    /// Sets what happens to fp8 Linear weights (see [`Fp8Mode`]).
    pub fn with_fp8(mut self, mode: Fp8Mode) -> Self {
        self.fp8 = mode;
        self
    }

    /// Loads the Linear weight `name` (`[out, in]`) and, when it stays in fp8, its scale: a dense
    /// tensor in `kind` with no scale, unless the file stores it in fp8 and the store keeps fp8
    /// resident ([`Fp8Mode::Resident`]). The scale is the 0-d fp32 tensor stored under the same
    /// key with `weight` replaced by `scale_weight` (ComfyUI's legacy scaled fp8) or
    /// `weight_scale` (its newer layout); absent, the scale is 1.
    pub fn get_linear_weight(
        &self,
        name: &str,
        shape: &[i64],
        device: Device,
        kind: Kind,
    ) -> Result<(Tensor, Option<Tensor>), LoadError> {
        let Some(src) = self.names.get(name) else {
            return Ok((self.get(name, shape, device, kind)?, None));
        };
        let TensorFile::Safetensors(file) = &self.files[src.file] else {
            // fp8 weights come only in safetensors files.
            return Ok((self.get(name, shape, device, kind)?, None));
        };
        let stored = file
            .info(&src.key)
            .and_then(|info| crate::loading::safetensors::kind_of(&info.dtype))
            .map(|(k, _)| k);
        let fp8_kind = match (stored, &src.transform) {
            (Some(k), Transform::Identity) if is_fp8(k) => k,
            _ => return Ok((self.get(name, shape, device, kind)?, None)),
        };
        let scale = match self.fp8_scale(file, &src.key, device)? {
            Some((scale, suffix)) => {
                // Read by its key in the file, not through the store: count it as asked for, so
                // that it is not listed among the file's unused tensors.
                if let Some(stem) = name.strip_suffix("weight") {
                    self.requested
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(format!("{stem}{suffix}"));
                }
                Some(scale)
            }
            None => None,
        };
        match (self.fp8, scale) {
            (Fp8Mode::Resident, scale) => Ok((self.get(name, shape, device, fp8_kind)?, scale)),
            (Fp8Mode::Upcast, None) => Ok((self.get(name, shape, device, kind)?, None)),
            (Fp8Mode::Upcast, Some(scale)) => {
                let w = self.get(name, shape, device, Kind::Float)?;
                Ok(((w * scale).to_kind(kind), None))
            }
        }
    }

    /// The per-tensor scale stored beside fp8 weight `key`, as a 0-d fp32 tensor on `device`, with
    /// the suffix that named it in place of `weight`.
    fn fp8_scale(
        &self,
        file: &SafetensorsFile,
        key: &str,
        device: Device,
    ) -> Result<Option<(Tensor, &'static str)>, LoadError> {
        let Some(stem) = key.strip_suffix("weight") else {
            return Ok(None);
        };
        for suffix in ["scale_weight", "weight_scale"] {
            let candidate = format!("{stem}{suffix}");
            let Some(info) = file.info(&candidate) else {
                continue;
            };
            if info.shape.iter().product::<i64>() != 1 {
                return Err(LoadError::Shape {
                    path: file.path().to_path_buf(),
                    tensor: candidate,
                    expected: vec![],
                    found: info.shape.clone(),
                });
            }
            let t = file.load(&candidate, device, Kind::Float)?;
            return Ok(Some((t.reshape([] as [i64; 0]), suffix)));
        }
        Ok(None)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn describe_files(&self) -> PathBuf {
        match self.files.as_slice() {
            [] => PathBuf::from("<placeholders>"),
            [one] => one.path().to_path_buf(),
            many => PathBuf::from(
                many.iter()
                    .map(|f| f.path().display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
        }
    }

    /// Loads `name` with the given expected shape.
    pub fn get(
        &self,
        name: &str,
        shape: &[i64],
        device: Device,
        kind: Kind,
    ) -> Result<Tensor, LoadError> {
        self.requested
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(name.to_string());
        if let Some(stored) = self.placeholders.get(name) {
            if stored.as_slice() != shape {
                return Err(LoadError::Shape {
                    path: PathBuf::from("<placeholders>"),
                    tensor: name.to_string(),
                    expected: shape.to_vec(),
                    found: stored.clone(),
                });
            }
            return Ok(Tensor::zeros([], (kind, device)).expand(shape, false));
        }
        let src = self.names.get(name).ok_or_else(|| LoadError::Missing {
            path: self.describe_files(),
            tensor: name.to_string(),
        })?;
        let file = &self.files[src.file];
        let stored = file.shape(&src.key).ok_or_else(|| LoadError::Missing {
            path: file.path().to_path_buf(),
            tensor: src.key.clone(),
        })?;
        let shape_err = |found: Vec<i64>| LoadError::Shape {
            path: file.path().to_path_buf(),
            tensor: src.key.clone(),
            expected: shape.to_vec(),
            found,
        };
        let torch = |source| LoadError::Torch {
            path: file.path().to_path_buf(),
            tensor: src.key.clone(),
            source,
        };
        let t = match src.transform {
            Transform::Identity => {
                if !same_up_to_trailing_ones(&stored, shape) {
                    return Err(shape_err(stored));
                }
                let t = file.load(&src.key, device, kind)?;
                if stored.as_slice() == shape {
                    t
                } else {
                    t.f_reshape(shape).map_err(torch)?
                }
            }
            Transform::Chunk { index, parts } => {
                let mut want = shape.to_vec();
                if let Some(first) = want.first_mut() {
                    *first *= parts;
                }
                if stored != want {
                    return Err(shape_err(stored));
                }
                let t = file.load(&src.key, device, kind)?;
                t.f_chunk(parts, 0).map_err(torch)?[index as usize]
                    .f_contiguous()
                    .map_err(torch)?
            }
            Transform::Transpose => {
                if stored.len() != 2
                    || shape.len() != 2
                    || stored[0] != shape[1]
                    || stored[1] != shape[0]
                {
                    return Err(shape_err(stored));
                }
                let t = file.load(&src.key, device, kind)?;
                t.f_transpose(0, 1)
                    .map_err(torch)?
                    .f_contiguous()
                    .map_err(torch)?
            }
        };
        Ok(t)
    }

    /// Every known name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names
            .keys()
            .chain(self.placeholders.keys())
            .map(String::as_str)
    }

    /// The stored shape of `name` (before any transform).
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        if let Some(shape) = self.placeholders.get(name) {
            return Some(shape.clone());
        }
        let src = self.names.get(name)?;
        self.files[src.file].shape(&src.key)
    }

    /// Whether `name` is known.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name) || self.placeholders.contains_key(name)
    }
}

fn same_up_to_trailing_ones(a: &[i64], b: &[i64]) -> bool {
    let strip = |s: &[i64]| {
        let mut n = s.len();
        while n > 0 && s[n - 1] == 1 {
            n -= 1;
        }
        s[..n].to_vec()
    };
    a == b || (a.iter().product::<i64>() == b.iter().product::<i64>() && strip(a) == strip(b))
}

/// A cursor into a [`WeightStore`]: a name prefix plus the target device and dtype.
#[derive(Debug, Clone)]
pub struct Weights {
    store: Arc<WeightStore>,
    prefix: String,
    pub device: Device,
    pub kind: Kind,
}

impl Weights {
    pub fn new(store: Arc<WeightStore>, device: Device, kind: Kind) -> Self {
        Self {
            store,
            prefix: String::new(),
            device,
            kind,
        }
    }

    /// The cursor one level down: `pp("down_blocks").pp(0)` names `down_blocks.0.*`.
    pub fn pp(&self, part: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{}", self.prefix, part)
        };
        Self {
            store: self.store.clone(),
            prefix,
            device: self.device,
            kind: self.kind,
        }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    /// The Linear weight `prefix.name` and its fp8 scale (see [`WeightStore::get_linear_weight`]).
    pub fn get_linear_weight(
        &self,
        name: &str,
        shape: &[i64],
    ) -> Result<(Tensor, Option<Tensor>), LoadError> {
        self.store
            .get_linear_weight(&self.full(name), shape, self.device, self.kind)
    }

    /// The tensor `prefix.name` with the expected shape, on this cursor's device and dtype.
    pub fn get(&self, name: &str, shape: &[i64]) -> Result<Tensor, LoadError> {
        self.store
            .get(&self.full(name), shape, self.device, self.kind)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.store.contains(&self.full(name))
    }
}

/// Threads [`load_layers`] reads on: half the cores, at most four.
pub fn loader_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() / 2)
        .clamp(1, 4)
}

/// `load(i)` for every layer `i` in `0..n`, on [`loader_threads`] threads at once, in order. A
/// model's layers are read from disk (or the page cache) and copied to the device one tensor at a
/// time, and one thread's reads and copies leave most of the memory system idle; layers share
/// nothing while loading (each thread takes a staging buffer of its own from the loader's pool).
/// The first failure, by layer, is the error, once every thread has stopped (each stops at its
/// first failure or when another failed).
pub fn load_layers<T: Send>(
    n: i64,
    load: impl Fn(i64) -> Result<T, LoadError> + Sync,
) -> Result<Vec<T>, LoadError> {
    load_layers_on(loader_threads(), n, load)
}

fn load_layers_on<T: Send>(
    threads: usize,
    n: i64,
    load: impl Fn(i64) -> Result<T, LoadError> + Sync,
) -> Result<Vec<T>, LoadError> {
    let threads = threads.min(n.max(1) as usize);
    if threads <= 1 {
        return (0..n).map(load).collect();
    }
    let next = std::sync::atomic::AtomicI64::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let mut done: Vec<(i64, Result<T, LoadError>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                super::stream::spawn(scope, || {
                    let _guard = tch::no_grad_guard();
                    let mut mine = Vec::new();
                    while !failed.load(std::sync::atomic::Ordering::Relaxed) {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        let layer = load(i);
                        if layer.is_err() {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        mine.push((i, layer));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| match w.join() {
                Ok(mine) => mine,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, layer)| layer).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missing(i: i64) -> LoadError {
        LoadError::Missing {
            path: "model.safetensors".into(),
            tensor: format!("layers.{i}.weight"),
        }
    }

    /// Layers come back in order however the threads interleave, and each is loaded once.
    #[test]
    fn layers_load_on_several_threads_in_order() {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let layers = load_layers_on(4, 23, |i| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis((i as u64 * 7) % 5));
            Ok(i * 10)
        })
        .expect("every layer loads");
        assert_eq!(layers, (0..23).map(|i| i * 10).collect::<Vec<_>>());
        assert_eq!(calls.into_inner(), 23);
    }

    /// The error is the first failing layer's, even when a later one failed sooner; the threads
    /// stop taking layers once one failed.
    #[test]
    fn the_first_failing_layer_is_the_error() {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let e = load_layers_on(4, 40, |i| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match i {
                5 => {
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    Err(missing(5))
                }
                6 => Err(missing(6)),
                _ => Ok(i),
            }
        })
        .expect_err("layers 5 and 6 fail");
        assert_eq!(
            e.to_string(),
            "tensor `layers.5.weight` is missing from model.safetensors"
        );
        assert!(calls.into_inner() < 40, "loading stopped after the failure");
    }
}
