//! Memory-mapped safetensors files: header parsing, bounds checks, and one tensor at a time copied
//! out of the mapping straight to the target device and dtype.
//!
//! Invariant: a [`SafetensorsFile`] never reads the whole data section; every tensor's byte range is
//! checked against the mapping when the header is parsed, so a truncated file fails at open time with
//! the first tensor that does not fit.
//!
//! Format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`
//! (plus an optional `__metadata__` map of strings), then the data section
//! (<https://github.com/huggingface/safetensors>, Apache-2.0). The header is parsed here instead of
//! with `tch::Tensor::read_safetensors`, which reads the whole file into memory.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::LoadError;

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<i64>,
    /// Byte range within the data section.
    pub start: usize,
    pub end: usize,
}

/// An open, memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn kind_of(dtype: &str) -> Option<(Kind, usize)> {
    Some(match dtype {
        "F64" => (Kind::Double, 8),
        "F32" => (Kind::Float, 4),
        "F16" => (Kind::Half, 2),
        "BF16" => (Kind::BFloat16, 2),
        "I64" => (Kind::Int64, 8),
        "I32" => (Kind::Int, 4),
        "I16" => (Kind::Int16, 2),
        "I8" => (Kind::Int8, 1),
        "U8" => (Kind::Uint8, 1),
        "BOOL" => (Kind::Bool, 1),
        "F8_E4M3" => (Kind::Float8e4m3fn, 1),
        "F8_E5M2" => (Kind::Float8e5m2, 1),
        _ => return None,
    })
}

impl SafetensorsFile {
    /// Maps `path` and parses its header; fails on a malformed header or a tensor whose byte range
    /// lies outside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| LoadError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this struct. Model files are treated as
        // immutable while a worker runs; a file truncated underneath a live mapping would fault
        // (SIGBUS), which is the documented contract of memmap2 and of every mmap-based loader
        // (safetensors, candle). Bounds are checked below before any byte is read.
        #[allow(unsafe_code)]
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let bad = |reason: String| LoadError::BadHeader {
            path: path.clone(),
            reason,
        };
        if mmap.len() < 8 {
            return Err(bad(format!("only {} bytes long", mmap.len())));
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&mmap[..8]);
        let header_len = u64::from_le_bytes(len_bytes) as usize;
        let data_start = header_len
            .checked_add(8)
            .filter(|&end| end <= mmap.len())
            .ok_or_else(|| {
                bad(format!(
                    "header of {header_len} bytes does not fit in a file of {} bytes (truncated?)",
                    mmap.len()
                ))
            })?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&mmap[8..data_start])
                .map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let available = mmap.len() - data_start;
        let mut tensors = HashMap::with_capacity(header.len());
        let mut metadata = BTreeMap::new();
        for (name, value) in header {
            if name == "__metadata__" {
                if let Some(map) = value.as_object() {
                    for (k, v) in map {
                        if let Some(s) = v.as_str() {
                            metadata.insert(k.clone(), s.to_string());
                        }
                    }
                }
                continue;
            }
            let entry: RawEntry =
                serde_json::from_value(value).map_err(|e| bad(format!("entry `{name}`: {e}")))?;
            let [start, end] = entry.data_offsets;
            if start > end || end > available {
                return Err(LoadError::Truncated {
                    path: path.clone(),
                    tensor: name,
                    start,
                    end,
                    available,
                });
            }
            if let Some((_, size)) = kind_of(&entry.dtype) {
                let numel: i64 = entry.shape.iter().product();
                if numel as usize * size != end - start {
                    return Err(bad(format!(
                        "tensor `{name}`: shape {:?} of {} needs {} bytes, header gives {}",
                        entry.shape,
                        entry.dtype,
                        numel as usize * size,
                        end - start
                    )));
                }
            }
            tensors.insert(
                name,
                TensorInfo {
                    dtype: entry.dtype,
                    shape: entry.shape,
                    start,
                    end,
                },
            );
        }
        Ok(Self {
            path,
            mmap,
            data_start,
            tensors,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `__metadata__` map of the header.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Copies tensor `name` out of the mapping (one tensor's worth of host memory) and moves it to
    /// `device` as `kind`.
    pub fn load(&self, name: &str, device: Device, kind: Kind) -> Result<Tensor, LoadError> {
        let info = self.info(name).ok_or_else(|| LoadError::Missing {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        let (src_kind, _) = kind_of(&info.dtype).ok_or_else(|| LoadError::Dtype {
            path: self.path.clone(),
            tensor: name.to_string(),
            dtype: info.dtype.clone(),
        })?;
        let bytes = &self.mmap[self.data_start + info.start..self.data_start + info.end];
        let torch = |source| LoadError::Torch {
            path: self.path.clone(),
            tensor: name.to_string(),
            source,
        };
        let host = Tensor::f_from_data_size(bytes, &info.shape, src_kind).map_err(torch)?;
        // Convert on the device when moving there (cheaper link traffic for half-precision files).
        let t = host.f_to_device(device).map_err(torch)?;
        if src_kind == kind {
            Ok(t)
        } else {
            t.f_to_kind(kind).map_err(torch)
        }
    }
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [usize; 2],
}
