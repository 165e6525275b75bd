//! The box's facts: libtorch and its GPU backend, the device, its memory, the driver and kernel
//! facts the ROCm notes list (docs/operations.md, "Strix Halo"), each ROCm variable and whether it
//! is set, and which SDPA kernel libtorch picks at each engine's attention shapes.

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::engine::GpuMemoryProbe;
use crate::tuning::fingerprint::{self, Backend, DeviceIdentity};

/// Variables that public reports on gfx1151 name (docs/operations.md gives the sources); the check
/// reports each, and on a HIP build measures the ones that can change speed.
pub const ROCM_VARIABLES: [(&str, &str); 8] = [
    (
        "TORCH_BLAS_PREFER_HIPBLASLT",
        "GEMMs through hipBLASLt instead of rocBLAS (37 against 5-11 TFLOP/s reported on gfx1151)",
    ),
    (
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL",
        "SDPA's flash / memory-efficient kernels on gfx1151; without it SDPA takes the math kernel",
    ),
    (
        "MIOPEN_FIND_MODE",
        "2 (fast find): no minutes-long search per new convolution shape",
    ),
    (
        "MIOPEN_DEBUG_CONV_DIRECT",
        "0 avoided hipErrorLaunchFailure in some convolution solvers",
    ),
    (
        "PYTORCH_MIOPEN_SUGGEST_NHWC",
        "1: MIOpen's NHWC convolutions for channels-last tensors",
    ),
    (
        "PYTORCH_HIP_ALLOC_CONF",
        "expandable_segments:True: fewer fragmentation failures on unified memory",
    ),
    (
        "PYTORCH_CUDA_ALLOC_CONF",
        "read by ROCm builds too; the worker sets expandable_segments:True unless it is set",
    ),
    (
        "HSA_OVERRIDE_GFX_VERSION",
        "makes HIP treat the GPU as another gfx target; wrong values crash kernels",
    ),
];

#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub vnfarm: String,
    pub libtorch: String,
    pub backend: Backend,
    /// Where the loaded libtorch lives.
    pub libtorch_dir: Option<String>,
    pub device: DeviceIdentity,
    pub gpus_visible: i64,
    pub memory: Memory,
    pub kernel: String,
    pub driver: Driver,
    /// Boot parameters that decide how much of a unified memory HIP sees (`amdgpu.gttsize`,
    /// `ttm.pages_limit`, `amd_iommu`).
    pub boot_parameters: Vec<String>,
    /// `/dev/kfd` and `/dev/dri/renderD*`, and whether this process may open them.
    pub device_nodes: Vec<DeviceNode>,
    /// The groups of this process (`video` and `render` are what ROCm needs).
    pub groups: Vec<String>,
    pub variables: Vec<Variable>,
    pub sdpa: Vec<SdpaChoice>,
}

/// The GPU driver's versions, where the system says (each `None` where it does not).
#[derive(Debug, Clone, Serialize)]
pub struct Driver {
    /// The NVIDIA kernel module (`/proc/driver/nvidia/version`, its first line).
    pub nvidia: Option<String>,
    /// The amdgpu kernel module, when it comes from AMD's DKMS package (`/sys/module/amdgpu/version`;
    /// the in-tree module has none: the kernel's version is its version).
    pub amdgpu: Option<String>,
    /// The ROCm release installed on the system (`/opt/rocm/.info/version`). A ROCm PyTorch wheel
    /// carries its own HIP runtime, whose version is the libtorch build's.
    pub rocm: Option<String>,
}

impl Driver {
    fn read() -> Driver {
        let first = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .map(|s| first_line(&s))
                .filter(|s| !s.is_empty())
        };
        Driver {
            nvidia: first("/proc/driver/nvidia/version"),
            amdgpu: first("/sys/module/amdgpu/version"),
            rocm: first("/opt/rocm/.info/version"),
        }
    }

    /// One line for the summary.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = [
            ("nvidia", &self.nvidia),
            ("amdgpu", &self.amdgpu),
            ("rocm", &self.rocm),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.as_ref().map(|v| format!("{name} {v}")))
        .collect();
        if parts.is_empty() {
            "none found".into()
        } else {
            parts.join("; ")
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    pub system_bytes: u64,
    pub device_total_bytes: Option<u64>,
    pub device_free_bytes: Option<u64>,
    /// The GPU shares the system's memory (an APU: Strix Halo), where the backend says.
    pub unified: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeviceNode {
    pub path: String,
    pub present: bool,
    pub accessible: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Variable {
    pub name: String,
    pub value: Option<String>,
    pub meaning: String,
}

/// The SDPA kernel libtorch picks for one engine's attention shape.
#[derive(Debug, Clone, Serialize)]
pub struct SdpaChoice {
    pub shape: String,
    /// `flash_attention`, `efficient_attention`, `cudnn_attention`, `math` (the slow fallback),
    /// or `error: …`.
    pub backend: String,
}

impl Environment {
    pub fn read(device: Device) -> Environment {
        let backend = Backend::loaded();
        let probe = match device {
            Device::Cuda(n) => GpuMemoryProbe::new(n).read(),
            _ => None,
        };
        let unified = match (backend, device) {
            (_, Device::Cpu) => Some(true),
            (Backend::Hip, _) => fingerprint::kfd_has_apu(),
            (_, Device::Cuda(n)) => fingerprint::cuda_integrated(n),
            _ => None,
        };
        Environment {
            vnfarm: fingerprint::vnfarm_build(),
            libtorch: fingerprint::libtorch_build(),
            backend,
            libtorch_dir: fingerprint::loaded_library_dir("libtorch_cpu.so")
                .map(|p| p.display().to_string()),
            device: DeviceIdentity::of(device),
            gpus_visible: tch::Cuda::device_count(),
            memory: Memory {
                system_bytes: system_memory_bytes(),
                device_total_bytes: probe.map(|m| m.total_bytes),
                device_free_bytes: probe.map(|m| m.free_bytes),
                unified,
            },
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            driver: Driver::read(),
            boot_parameters: boot_parameters(),
            device_nodes: device_nodes(),
            groups: groups(),
            variables: ROCM_VARIABLES
                .iter()
                .map(|(name, meaning)| Variable {
                    name: (*name).to_owned(),
                    value: std::env::var(name).ok(),
                    meaning: (*meaning).to_owned(),
                })
                .collect(),
            sdpa: sdpa_choices(device),
        }
    }
}

/// The system's memory in bytes (`MemTotal`).
pub fn system_memory_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn boot_parameters() -> Vec<String> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    cmdline
        .split_whitespace()
        .filter(|p| {
            ["amdgpu.", "ttm.", "amd_iommu", "iommu"]
                .iter()
                .any(|k| p.starts_with(k))
        })
        .map(str::to_owned)
        .collect()
}

fn device_nodes() -> Vec<DeviceNode> {
    let mut paths = vec!["/dev/kfd".to_owned()];
    if let Ok(dir) = std::fs::read_dir("/dev/dri") {
        let mut render: Vec<String> = dir
            .flatten()
            .map(|e| e.path().display().to_string())
            .filter(|p| p.contains("renderD"))
            .collect();
        render.sort();
        paths.extend(render);
    } else {
        paths.push("/dev/dri".to_owned());
    }
    paths
        .into_iter()
        .map(|path| {
            let present = std::path::Path::new(&path).exists();
            let accessible = present
                && std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .is_ok();
            DeviceNode {
                path,
                present,
                accessible,
            }
        })
        .collect()
}

/// This process's groups by name (`/proc/self/status` ids, named through `/etc/group`).
fn groups() -> Vec<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let ids: Vec<&str> = status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| g.split_whitespace().collect())
        .unwrap_or_default();
    let table = std::fs::read_to_string("/etc/group").unwrap_or_default();
    ids.iter()
        .map(|id| {
            table
                .lines()
                .find_map(|l| {
                    let mut f = l.split(':');
                    let (name, _, gid) = (f.next()?, f.next()?, f.next()?);
                    (gid == *id).then(|| name.to_owned())
                })
                .unwrap_or_else(|| (*id).to_owned())
        })
        .collect()
}

/// The attention shapes of the engines at the studio's sizes: `(what, batch, heads, queries,
/// keys, head dim)`.
const ATTENTION_SHAPES: [(&str, i64, i64, i64, i64, i64); 5] = [
    (
        "sdxl unet self-attention 1024² (64x64 tokens)",
        2,
        10,
        4096,
        4096,
        64,
    ),
    ("sdxl unet cross-attention 1024²", 2, 10, 4096, 77, 64),
    (
        "sdxl vae mid-block 1024² (one 512-wide head)",
        1,
        1,
        16384,
        16384,
        512,
    ),
    (
        "qwen transformer joint attention 1024² edit",
        1,
        24,
        8448,
        8448,
        128,
    ),
    ("qwen vision tower 384²", 1, 16, 576, 576, 80),
];

fn sdpa_choices(device: Device) -> Vec<SdpaChoice> {
    let kind = if device == Device::Cpu {
        Kind::Float
    } else {
        Kind::BFloat16
    };
    ATTENTION_SHAPES
        .iter()
        .map(|&(shape, b, h, q, k, d)| {
            let backend = std::panic::catch_unwind(|| {
                let _guard = tch::no_grad_guard();
                let query = Tensor::zeros([b, h, q, d], (kind, device));
                let key = Tensor::zeros([b, h, k, d], (kind, device));
                Tensor::f_internal_fused_sdp_choice(
                    &query,
                    &key,
                    &key,
                    None::<Tensor>,
                    0.0,
                    false,
                    None::<f64>,
                    false,
                )
            });
            let backend = match backend {
                Ok(Ok(choice)) => sdp_backend_name(choice).to_owned(),
                Ok(Err(e)) => format!("error: {}", first_line(&e.to_string())),
                Err(_) => "error: libtorch panicked".to_owned(),
            };
            SdpaChoice {
                shape: shape.to_owned(),
                backend,
            }
        })
        .collect()
}

/// `at::SDPBackend` (aten/src/ATen/native/transformers/sdp_utils_cpp.h).
fn sdp_backend_name(choice: i64) -> &'static str {
    match choice {
        0 => "math",
        1 => "flash_attention",
        2 => "efficient_attention",
        3 => "cudnn_attention",
        4 => "overrideable",
        _ => "error",
    }
}

pub fn first_line(s: &str) -> String {
    s.lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(300)
        .collect()
}
