//! What a settings file was measured on: the device (backend, name, architecture), the libtorch
//! build the process loaded, the model files (by content sample, not path) and the vnfarm build.
//! A worker compares the live box with the file's fingerprint before it uses the file.
//!
//! Device facts come from the GPU runtime that libtorch loaded (looked up by name, as the memory
//! probe finds it, [`crate::gpu_runtime`]: no link dependency on CUDA or ROCm) and, on ROCm, from the amdgpu driver's KFD
//! topology in sysfs, which names the `gfx` target the way `rocminfo` does.

use std::ffi::{CStr, c_int, c_void};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::gpu_runtime;

/// The GPU backend of the loaded libtorch (ROCm devices are `cuda` to libtorch, HIP underneath).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Cpu,
    Cuda,
    Hip,
}

impl Backend {
    /// The backend of the libtorch this process loaded: which GPU library is mapped.
    pub fn loaded() -> Backend {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        if maps.contains("libtorch_hip.so") {
            Backend::Hip
        } else if maps.contains("libtorch_cuda.so") {
            Backend::Cuda
        } else {
            Backend::Cpu
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Hip => "hip",
        }
    }
}

/// One device as the settings were measured on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceIdentity {
    pub backend: Backend,
    /// `NVIDIA H200`, `AMD Radeon 8060S Graphics`, or the CPU's model name.
    pub name: String,
    /// `sm_90`, `gfx1151`, or the CPU architecture (`x86_64`).
    pub arch: String,
}

impl DeviceIdentity {
    /// The device libtorch calls `device` in this process (`cuda:N` or the CPU).
    pub fn of(device: tch::Device) -> DeviceIdentity {
        match device {
            tch::Device::Cuda(index) => gpu_identity(index),
            _ => cpu_identity(),
        }
    }
}

fn cpu_identity() -> DeviceIdentity {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown CPU".to_owned(), |(_, v)| v.trim().to_owned());
    DeviceIdentity {
        backend: Backend::Cpu,
        name,
        arch: std::env::consts::ARCH.to_owned(),
    }
}

fn gpu_identity(index: usize) -> DeviceIdentity {
    let backend = Backend::loaded();
    let device = c_int::try_from(index).unwrap_or(c_int::MAX);
    let name = device_name(backend, device).unwrap_or_else(|| format!("GPU {index}"));
    let arch = match backend {
        Backend::Hip => kfd_gfx_targets()
            .get(index)
            .cloned()
            .or_else(|| hip_arch_from_properties(device))
            .unwrap_or_else(|| "gfx?".to_owned()),
        Backend::Cuda | Backend::Cpu => cuda_compute_capability(device).map_or_else(
            || "sm_?".to_owned(),
            |(major, minor)| format!("sm_{major}{minor}"),
        ),
    };
    DeviceIdentity {
        backend,
        name,
        arch,
    }
}

type GetProperties = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type GetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;

/// Bytes reserved for a `cudaDeviceProp` / `hipDeviceProp_t` (about 1 KiB in CUDA 13 and ROCm 6;
/// generous, so a larger future layout cannot write past it).
const PROPERTIES_BYTES: usize = 16 << 10;

/// The runtime's device properties as raw bytes.
#[allow(unsafe_code)]
fn properties(backend: Backend, device: c_int) -> Option<Vec<u8>> {
    let names: &[&CStr] = match backend {
        // `hipGetDeviceProperties` is a macro for the `R0600` layout in ROCm 6 headers; both
        // layouts begin with `char name[256]`.
        Backend::Hip => &[c"hipGetDevicePropertiesR0600", c"hipGetDeviceProperties"],
        Backend::Cuda | Backend::Cpu => {
            &[c"cudaGetDeviceProperties_v2", c"cudaGetDeviceProperties"]
        }
    };
    // SAFETY: each name is the runtime's `cudaGetDeviceProperties` (or HIP's), `(prop *, int
    // device)` returning 0 on success.
    let f = names
        .iter()
        .find_map(|n| unsafe { gpu_runtime::function::<GetProperties>(n) })?;
    let mut buf = vec![0u8; PROPERTIES_BYTES];
    // SAFETY: the buffer is larger than either struct and lives for the call.
    let status = unsafe { f(buf.as_mut_ptr().cast(), device) };
    (status == 0).then_some(buf)
}

/// The NUL-terminated string at the start of `bytes`.
fn leading_string(bytes: &[u8]) -> Option<String> {
    let end = bytes.iter().position(|&b| b == 0)?;
    let s = std::str::from_utf8(&bytes[..end]).ok()?.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

fn device_name(backend: Backend, device: c_int) -> Option<String> {
    // Both structs begin with `char name[256]`.
    leading_string(&properties(backend, device)?[..256])
}

/// HIP's `gcnArchName` (`gfx1151:xnack-`), found in the properties without depending on the
/// struct's layout: the one string field that starts with `gfx`.
fn hip_arch_from_properties(device: c_int) -> Option<String> {
    let bytes = properties(Backend::Hip, device)?;
    let at = bytes
        .windows(4)
        .position(|w| w == b"gfx1" || w == b"gfx9")?;
    let arch = leading_string(&bytes[at..])?;
    Some(arch.split(':').next().unwrap_or(&arch).to_owned())
}

#[allow(unsafe_code)]
fn cuda_compute_capability(device: c_int) -> Option<(c_int, c_int)> {
    // cudaDevAttrComputeCapabilityMajor / Minor (driver_types.h).
    const MAJOR: c_int = 75;
    const MINOR: c_int = 76;
    // SAFETY: `cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device)`;
    // the out-pointers are valid for the calls.
    let f = unsafe { gpu_runtime::function::<GetAttribute>(c"cudaDeviceGetAttribute") }?;
    let (mut major, mut minor) = (0, 0);
    let ok = unsafe { f(&mut major, MAJOR, device) == 0 && f(&mut minor, MINOR, device) == 0 };
    ok.then_some((major, minor))
}

/// Whether a CUDA device is integrated, sharing the system's memory (`cudaDevAttrIntegrated`).
#[allow(unsafe_code)]
pub fn cuda_integrated(index: usize) -> Option<bool> {
    const INTEGRATED: c_int = 18;
    // SAFETY: as in `cuda_compute_capability`.
    let f = unsafe { gpu_runtime::function::<GetAttribute>(c"cudaDeviceGetAttribute") }?;
    let mut v = 0;
    let device = c_int::try_from(index).ok()?;
    (unsafe { f(&mut v, INTEGRATED, device) } == 0).then_some(v != 0)
}

/// The `gfx` target of each GPU node in the KFD topology, in HIP's device order (CPU nodes, whose
/// `gfx_target_version` is 0, are skipped). `gfx_target_version` 110501 is gfx1151: major, minor
/// and stepping, the last two as hex digits.
pub fn kfd_gfx_targets() -> Vec<String> {
    let root = Path::new("/sys/class/kfd/kfd/topology/nodes");
    let mut nodes: Vec<(u32, String)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let id: u32 = e.file_name().to_str()?.parse().ok()?;
            let props = std::fs::read_to_string(e.path().join("properties")).ok()?;
            let version: u32 = kfd_property(&props, "gfx_target_version")?;
            (version > 0).then(|| {
                let (major, minor, step) = (version / 10000, (version / 100) % 100, version % 100);
                (id, format!("gfx{major}{minor:x}{step:x}"))
            })
        })
        .collect();
    nodes.sort();
    nodes.into_iter().map(|(_, gfx)| gfx).collect()
}

/// Whether the KFD topology has a node with both CPU cores and GPU SIMDs: an APU, whose GPU
/// shares the system's memory (Strix Halo).
pub fn kfd_has_apu() -> Option<bool> {
    let root = Path::new("/sys/class/kfd/kfd/topology/nodes");
    let entries = std::fs::read_dir(root).ok()?;
    Some(entries.flatten().any(|e| {
        std::fs::read_to_string(e.path().join("properties")).is_ok_and(|p| {
            kfd_property(&p, "cpu_cores_count").unwrap_or(0) > 0
                && kfd_property(&p, "simd_count").unwrap_or(0) > 0
        })
    }))
}

fn kfd_property(props: &str, key: &str) -> Option<u32> {
    props.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The libtorch build this process loaded: the version (with its local tag, `2.11.0+cu130`) and
/// the PyTorch commit it was built from, read beside the loaded `libtorch_cpu.so` (a wheel's
/// `torch/version.py`, or a libtorch archive's `build-version` and `build-hash`). Unknown where
/// neither is there.
pub fn libtorch_build() -> String {
    let Some(lib) = loaded_library_dir("libtorch_cpu.so") else {
        return "unknown".into();
    };
    let root = lib.parent().map(Path::to_path_buf).unwrap_or_default();
    if let Ok(text) = std::fs::read_to_string(root.join("version.py")) {
        let field = |key: &str| {
            text.lines().find_map(|l| {
                let v = l.strip_prefix(key)?.trim_start().strip_prefix('=')?.trim();
                Some(v.trim_matches(['\'', '"']).to_owned())
            })
        };
        if let Some(version) = field("__version__") {
            return match field("git_version") {
                Some(git) if git.len() >= 12 => format!("{version} ({})", &git[..12]),
                _ => version,
            };
        }
    }
    let read = |name: &str| std::fs::read_to_string(root.join(name)).map(|s| s.trim().to_owned());
    match (read("build-version"), read("build-hash")) {
        (Ok(v), Ok(h)) if h.len() >= 12 => format!("{v} ({})", &h[..12]),
        (Ok(v), _) => v,
        _ => "unknown".into(),
    }
}

/// The folder of a shared library mapped into this process.
pub fn loaded_library_dir(name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().is_some_and(|f| f == name))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
}

/// This build of vnfarm: the crate version and the commit it was built from (where the build had
/// a git checkout).
pub fn vnfarm_build() -> String {
    match option_env!("VNFARM_GIT_COMMIT") {
        Some(commit) if !commit.is_empty() => {
            format!("{} ({commit})", env!("CARGO_PKG_VERSION"))
        }
        _ => env!("CARGO_PKG_VERSION").to_owned(),
    }
}

/// One model file, by content: its size and the sha256 of its first and last MiB.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFileIdentity {
    /// Where it was when measured (for the reader; not compared).
    pub path: PathBuf,
    /// `<bytes>:<sha256 of the first and last MiB>`.
    pub sample: String,
}

impl ModelFileIdentity {
    pub fn of(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            path: path.to_path_buf(),
            sample: file_sample(path)?,
        })
    }
}

/// What a file contributes to a fingerprint without reading it whole (encoder weights are GiBs):
/// its size and the sha256 of its first and last MiB (the safetensors header, with every tensor's
/// name, shape and offset, and the last tensors' values).
pub fn file_sample(path: &Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    const SPAN: u64 = 1 << 20;
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let mut head = vec![0u8; SPAN.min(len) as usize];
    file.read_exact(&mut head)?;
    let tail_len = SPAN.min(len);
    let mut tail = vec![0u8; tail_len as usize];
    file.seek(SeekFrom::Start(len - tail_len))?;
    file.read_exact(&mut tail)?;
    let sha256 = Sha256::new()
        .chain_update(&head)
        .chain_update(&tail)
        .finalize();
    Ok(format!("{len}:{}", hex::encode(sha256)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kfd_versions_name_gfx_targets() {
        let props = "cpu_cores_count 0\nsimd_count 80\ngfx_target_version 110501\n";
        let v = kfd_property(props, "gfx_target_version").unwrap();
        let (major, minor, step) = (v / 10000, (v / 100) % 100, v % 100);
        assert_eq!(format!("gfx{major}{minor:x}{step:x}"), "gfx1151");
        let v = 90010;
        let (major, minor, step) = (v / 10000, (v / 100) % 100, v % 100);
        assert_eq!(format!("gfx{major}{minor:x}{step:x}"), "gfx90a");
    }

    #[test]
    fn the_loaded_libtorch_is_named() {
        // The test binary links libtorch (tch), so its version file is beside it.
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let build = libtorch_build();
        assert!(build.starts_with("2."), "{build}");
        assert_eq!(DeviceIdentity::of(tch::Device::Cpu).backend, Backend::Cpu);
    }

    #[test]
    fn file_samples_tell_contents_apart() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut tail_changed = big.clone();
        *tail_changed.last_mut().unwrap() ^= 1;
        let a = file_sample(&write("a", &big)).unwrap();
        assert_eq!(
            a,
            file_sample(&write("a-copy", &big)).unwrap(),
            "name-independent"
        );
        assert_ne!(a, file_sample(&write("b", &tail_changed)).unwrap());
        assert_ne!(a, file_sample(&write("c", &big[..big.len() - 1])).unwrap());
        let small = file_sample(&write("small", b"tiny")).unwrap();
        assert!(small.starts_with("4:"), "{small}");
    }
}
