//! PyTorch checkpoints (`.pth`, `.pt`, `.ckpt` as `torch.save` writes them since torch 1.6): a
//! zip archive holding `<dir>/data.pkl` (the pickled object) and `<dir>/data/<key>` (the raw bytes
//! of each storage), read without Python and without running the pickle.
//!
//! Invariants: the pickle is read by [`crate::loading::pickle`], which accepts only tensors and
//! plain containers; every tensor is a view that lies inside its storage, and every storage entry
//! holds the bytes it claims ([`PthFile::open`] checks all of them before any tensor is loaded);
//! the archive is memory-mapped and only the requested tensors are read.
//!
//! Which tensors: a bare state dict (`{name: tensor}`), or the wrapper BasicSR and Real-ESRGAN save
//! (`{"params_ema": …, "params": …}`, `params_ema` preferred as `RealESRGANer` prefers it), or a
//! `{"state_dict": …}` wrapper. Files of the pre-1.6 format (a bare pickle stream) are refused with
//! a message saying how to convert them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::LoadError;
use crate::loading::pickle::{self, Id, TensorRef, Unpickled, Value};
use crate::loading::zip::ZipIndex;

/// The wrapper keys tried, in order, before the top-level dict is taken as the state dict.
const WRAPPERS: [&str; 3] = ["params_ema", "params", "state_dict"];

/// An open PyTorch zip checkpoint, reduced to its state dict.
pub struct PthFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    tensors: BTreeMap<String, TensorRef>,
    /// `data/<key>` entry of each storage: byte range in the mapping.
    storages: BTreeMap<String, std::ops::Range<usize>>,
    wrapper: Option<&'static str>,
}

impl std::fmt::Debug for PthFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PthFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .field("wrapper", &self.wrapper)
            .finish()
    }
}

/// The byte size of one element of a storage kind.
fn element_size(kind: Kind) -> usize {
    match kind {
        Kind::Double | Kind::Int64 => 8,
        Kind::Float | Kind::Int => 4,
        Kind::Half | Kind::BFloat16 | Kind::Int16 => 2,
        _ => 1,
    }
}

impl PthFile {
    /// Whether `data` is a pre-1.6 PyTorch file (a pickle stream starting with protocol 2 and the
    /// magic number `0x1950a86a20f9469cfc6c`).
    fn is_legacy(data: &[u8]) -> bool {
        data.starts_with(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19")
    }

    /// Maps `path`, reads its pickle and checks every tensor and storage (see the module docs).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: read-only private mapping; model files are treated as immutable while a worker
        // runs (the same contract as `SafetensorsFile::open`). Every range is checked below.
        #[allow(unsafe_code)]
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        let format = |reason: String| LoadError::Format {
            path: path.clone(),
            reason,
        };
        if Self::is_legacy(&mmap) {
            return Err(format(
                "a PyTorch checkpoint in the pre-1.6 format, which is not read; re-save it with \
                 a current torch (`torch.save(torch.load(f), f2)`) or convert it to safetensors"
                    .into(),
            ));
        }
        if !ZipIndex::looks_like_zip(&mmap) {
            return Err(format(
                "neither a PyTorch zip checkpoint nor a safetensors file".into(),
            ));
        }
        let zip = ZipIndex::parse(&mmap).map_err(|e| format(format!("broken zip archive: {e}")))?;
        let pkl_name = zip
            .names()
            .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .min()
            .map(str::to_string)
            .ok_or_else(|| {
                format("zip archive without `<dir>/data.pkl`: not a PyTorch checkpoint".into())
            })?;
        let dir = pkl_name.trim_end_matches("data.pkl").to_string();
        if let Some(order) = zip.get(&format!("{dir}byteorder")) {
            let order = &mmap[order.start..order.start + order.len];
            if order != b"little" {
                return Err(format(format!(
                    "byte order `{}` is not supported",
                    String::from_utf8_lossy(order)
                )));
            }
        }
        let pkl = zip.get(&pkl_name).expect("listed by the index");
        let unpickled = pickle::unpickle(&mmap[pkl.start..pkl.start + pkl.len])
            .map_err(|e| format(format!("refused: {e}")))?;
        let StateDict {
            wrapper,
            items: dict,
        } = state_dict(&unpickled).map_err(format)?;

        let mut tensors = BTreeMap::new();
        for (k, v) in dict {
            let name = unpickled
                .str(k)
                .ok_or_else(|| {
                    format(format!(
                        "a state-dict key is a {}, not a string",
                        unpickled.type_name(k)
                    ))
                })?
                .to_string();
            let Value::Tensor(t) = unpickled.get(v) else {
                return Err(format(format!(
                    "`{name}` is a {}, not a tensor",
                    unpickled.type_name(v)
                )));
            };
            tensors.insert(name, t.clone());
        }
        let mut storages = BTreeMap::new();
        for (name, t) in &tensors {
            let s = &t.storage;
            if storages.contains_key(&s.key) {
                continue;
            }
            let entry_name = format!("{dir}data/{}", s.key);
            let entry = zip.get(&entry_name).ok_or_else(|| LoadError::Missing {
                path: path.clone(),
                tensor: format!("{name} (storage {entry_name})"),
            })?;
            let need = s.numel as usize * element_size(s.kind);
            if entry.len < need {
                return Err(LoadError::Truncated {
                    path: path.clone(),
                    tensor: name.clone(),
                    start: 0,
                    end: need,
                    available: entry.len,
                });
            }
            storages.insert(s.key.clone(), entry.start..entry.start + need);
        }
        Ok(Self {
            path,
            mmap,
            tensors,
            storages,
            wrapper,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapper key the state dict was found under (`params_ema`, `params`, `state_dict`), or
    /// `None` for a bare state dict.
    pub fn wrapper(&self) -> Option<&'static str> {
        self.wrapper
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    pub fn kind(&self, name: &str) -> Option<Kind> {
        self.tensors.get(name).map(|t| t.storage.kind)
    }

    /// Loads tensor `name` (a contiguous copy of its view) to `device` as `kind`.
    pub fn load(&self, name: &str, device: Device, kind: Kind) -> Result<Tensor, LoadError> {
        let t = self.tensors.get(name).ok_or_else(|| LoadError::Missing {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        let torch = |source| LoadError::Torch {
            path: self.path.clone(),
            tensor: name.to_string(),
            source,
        };
        let range = self.storages[&t.storage.key].clone();
        let storage =
            Tensor::f_from_data_size(&self.mmap[range], &[t.storage.numel], t.storage.kind)
                .map_err(torch)?;
        // Bounds were checked when the pickle was read (`check_view`).
        let view = storage
            .f_as_strided(t.shape.as_slice(), t.stride.as_slice(), t.offset)
            .map_err(torch)?;
        view.f_to_device(device)
            .and_then(|v| v.f_to_kind(kind))
            .and_then(|v| v.f_contiguous())
            .map_err(torch)
    }
}

/// The state dict found in a checkpoint: the wrapper key it was under, and its (key, value) ids.
struct StateDict {
    wrapper: Option<&'static str>,
    items: Vec<(Id, Id)>,
}

/// The dict of tensors inside the unpickled object (see [`WRAPPERS`]).
fn state_dict(u: &Unpickled) -> Result<StateDict, String> {
    let Value::Dict(top) = u.get(u.root) else {
        return Err(format!(
            "the checkpoint holds a {}, not a dict of tensors",
            u.type_name(u.root)
        ));
    };
    for wrapper in WRAPPERS {
        if let Some(&(_, v)) = top.iter().find(|(k, _)| u.str(*k) == Some(wrapper)) {
            let Value::Dict(inner) = u.get(v) else {
                return Err(format!(
                    "`{wrapper}` is a {}, not a dict of tensors",
                    u.type_name(v)
                ));
            };
            return Ok(StateDict {
                wrapper: Some(wrapper),
                items: inner.clone(),
            });
        }
    }
    Ok(StateDict {
        wrapper: None,
        items: top.clone(),
    })
}
