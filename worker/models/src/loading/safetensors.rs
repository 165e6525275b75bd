//! Memory-mapped safetensors files: header parsing, bounds checks, and one tensor at a time copied
//! out of the file straight to the target device and dtype.
//!
//! Invariant: a [`SafetensorsFile`] never reads the whole data section at once; every tensor's byte
//! range is checked against the mapping when the header is parsed, so a truncated file fails at open
//! time with the first tensor that does not fit.
//!
//! To a CUDA device, tensors travel through one pinned (page-locked) staging buffer shared by all
//! open files ([`LoadPath::Staged`]): each tensor's bytes are read with `pread` into the next free
//! range of the buffer and an asynchronous copy to the device is queued from there, so reading the
//! next tensor overlaps the transfer of the previous ones. When the buffer is full the loader waits
//! until the copies out of it are done (an event recorded after them on each stream that queued
//! some, see [`super::stream`]; the whole device, `cuda synchronize`, where events are not built in)
//! and starts again at its beginning, so no byte still being copied is overwritten. A dtype
//! conversion, if any, runs on the device. Copies may still be in flight when a load returns; they
//! are ordered before any later work on the loading thread's stream. The staging buffer is freed
//! when the last open file is dropped. Measured in docs/performance.md.
//!
//! Format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`
//! (plus an optional `__metadata__` map of strings), then the data section
//! (<https://github.com/huggingface/safetensors>, Apache-2.0). The header is parsed here instead of
//! with `tch::Tensor::read_safetensors`, which reads the whole file into memory.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use tch::{Cuda, Device, Kind, Tensor};

use crate::error::LoadError;
use crate::nn::stream::{Event, Stream};

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<i64>,
    /// Byte range within the data section.
    pub start: usize,
    pub end: usize,
}

/// How tensors go from the file to a CUDA device (CPU targets always use [`LoadPath::Direct`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadPath {
    /// Pinned staging buffer and asynchronous copies (the default).
    Staged,
    /// Copy out of the mapping into a pageable host tensor, then a synchronous copy to the device
    /// (the loader before staging; kept for comparison).
    Direct,
}

static LOAD_PATH: AtomicU8 = AtomicU8::new(0);

/// Chooses the load path for the whole process (benchmarks and diagnostics).
pub fn set_load_path(path: LoadPath) {
    let v = match path {
        LoadPath::Staged => 0,
        LoadPath::Direct => 1,
    };
    LOAD_PATH.store(v, Ordering::Relaxed);
}

/// The load path in use (see [`set_load_path`]).
pub fn load_path() -> LoadPath {
    match LOAD_PATH.load(Ordering::Relaxed) {
        0 => LoadPath::Staged,
        _ => LoadPath::Direct,
    }
}

/// Bytes of the pinned staging buffer. Holds the largest SDXL tensor in half precision (CLIP bigG's
/// token embedding, 126 MB); larger tensors take the direct path.
const STAGING_BYTES: usize = 128 << 20;
/// Alignment of each tensor inside the staging buffer.
const ALIGN: usize = 512;

/// The pinned buffer and how much of it holds bytes queued for copying since the last wait.
struct Staging {
    buf: Tensor,
    device: Device,
    used: usize,
    /// Per stream that queued copies out of the buffer, an event recorded after the latest one.
    copies: Vec<(Stream, Event)>,
    /// Whether `copies` covers every copy queued since the last wait (otherwise the wait is for
    /// the whole device).
    tracked: bool,
}

impl Staging {
    fn new(device: Device) -> Result<Self, tch::TchError> {
        Ok(Staging {
            buf: Tensor::f_empty([STAGING_BYTES as i64], (Kind::Uint8, Device::Cpu))?
                .f_internal_pin_memory(device)?,
            device,
            used: 0,
            copies: Vec::new(),
            tracked: true,
        })
    }

    /// Marks the copies this thread has queued out of the buffer so far.
    fn mark_copied(&mut self) {
        let device = self.device;
        let marked = Stream::current(device).is_some_and(|stream| {
            match self.copies.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, event)) => event.record(device),
                None => Event::new().is_some_and(|mut event| {
                    let recorded = event.record(device);
                    self.copies.push((stream, event));
                    recorded
                }),
            }
        });
        self.tracked &= marked;
    }

    /// Returns once no copy out of the buffer is in flight.
    fn wait_copied(&mut self) {
        let waited = self.tracked && self.copies.iter().all(|(_, event)| event.synchronize());
        if !waited {
            sync_device(self.device);
        }
        self.tracked = true;
    }
}

/// Staging buffers shared by all files, and how many files are open. A loading thread takes a
/// buffer out of the pool for one tensor and puts it back, so threads that load at the same time
/// (the pipeline loads the UNet beside the other components) read in parallel, each into its own
/// buffer; the pool grows to the number of such threads.
static STAGING: Mutex<Vec<Staging>> = Mutex::new(Vec::new());
static OPEN_FILES: AtomicUsize = AtomicUsize::new(0);

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

fn sync_device(device: Device) {
    if let Device::Cuda(i) = device {
        Cuda::synchronize(i as i64);
    }
}

/// An open, memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    mmap: memmap2::Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl Drop for SafetensorsFile {
    fn drop(&mut self) {
        if OPEN_FILES.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Copies still queued from the buffers hold their own reference to their pinned blocks
            // (libtorch records an event), so they can be released now.
            let staging = std::mem::take(
                &mut *STAGING
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            drop(staging);
        }
    }
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The libtorch kind and element size of a safetensors dtype name.
pub fn kind_of(dtype: &str) -> Option<(Kind, usize)> {
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
        OPEN_FILES.fetch_add(1, Ordering::AcqRel);
        Ok(Self {
            path,
            file,
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

    /// Loads tensor `name` to `device` as `kind`: to a CUDA device through the pinned staging
    /// buffer (see the module docs and [`set_load_path`]), otherwise copied out of the mapping (one
    /// tensor's worth of host memory) and moved.
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
        let torch = |source| LoadError::Torch {
            path: self.path.clone(),
            tensor: name.to_string(),
            source,
        };
        let nbytes = info.end - info.start;
        let t = if device.is_cuda() && load_path() == LoadPath::Staged && nbytes <= STAGING_BYTES {
            self.load_staged(info, src_kind, device)
                .map_err(|e| match e {
                    Staged::Torch(source) => torch(source),
                    Staged::Io(source) => LoadError::Io {
                        path: self.path.clone(),
                        source,
                    },
                })?
        } else {
            let bytes = &self.mmap[self.data_start + info.start..self.data_start + info.end];
            let host = Tensor::f_from_data_size(bytes, &info.shape, src_kind).map_err(torch)?;
            host.f_to_device(device).map_err(torch)?
        };
        // Convert on the device after moving there (cheaper link traffic for half-precision files).
        if src_kind == kind {
            Ok(t)
        } else {
            t.f_to_kind(kind).map_err(torch)
        }
    }

    /// One tensor through the staging buffer; returns a new device tensor in the stored dtype.
    fn load_staged(
        &self,
        info: &TensorInfo,
        src_kind: Kind,
        device: Device,
    ) -> Result<Tensor, Staged> {
        let taken = {
            let mut pool = STAGING
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if pool.iter().any(|s| s.device != device) {
                // Another device: let queued copies finish before those buffers are dropped.
                for other in pool.iter().map(|s| s.device).collect::<Vec<_>>() {
                    sync_device(other);
                }
                pool.clear();
            }
            pool.pop()
        };
        let mut staging = match taken {
            Some(staging) => staging,
            None => Staging::new(device)?,
        };
        let result = self.stage(&mut staging, info, src_kind, device);
        STAGING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(staging);
        result
    }

    /// Reads one tensor into `staging` (owned by this thread until it goes back to the pool) and
    /// queues its copy to the device.
    fn stage(
        &self,
        staging: &mut Staging,
        info: &TensorInfo,
        src_kind: Kind,
        device: Device,
    ) -> Result<Tensor, Staged> {
        let nbytes = info.end - info.start;
        let mut offset = align(staging.used);
        if offset + nbytes > STAGING_BYTES {
            // Every queued copy out of the buffer must be done before it is overwritten.
            staging.wait_copied();
            offset = 0;
        }
        {
            // SAFETY: `buf` is a contiguous, pinned CPU tensor of `STAGING_BYTES` bytes that only
            // this thread touches while it holds `staging` out of the pool; `offset + nbytes` is within it
            // (checked above, and `nbytes <= STAGING_BYTES` by the caller); no copy out of this
            // range is in flight, since every range handed to the device since the last
            // wait lies below `staging.used <= offset`.
            #[allow(unsafe_code)]
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    (staging.buf.data_ptr() as *mut u8).add(offset),
                    nbytes,
                )
            };
            self.file
                .read_exact_at(dst, (self.data_start + info.start) as u64)
                .map_err(Staged::Io)?;
        }
        staging.used = offset + nbytes;
        let host = staging
            .buf
            .f_narrow(0, offset as i64, nbytes as i64)?
            .f_view_dtype(src_kind)?
            .f_view(info.shape.as_slice())?;
        let copied = host.f_to_device_(device, src_kind, true, false)?;
        staging.mark_copied();
        Ok(copied)
    }
}

/// Failures of the staged path, mapped to [`LoadError`] by the caller.
enum Staged {
    Torch(tch::TchError),
    Io(std::io::Error),
}

impl From<tch::TchError> for Staged {
    fn from(e: tch::TchError) -> Self {
        Staged::Torch(e)
    }
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [usize; 2],
}
