//! Links this crate's programs to libtorch so that they find the GPU backend and start without
//! `LD_LIBRARY_PATH` (see `vnfarm-build-support`), and builds the C++ shims of `csrc/` when
//! libtorch is a GPU build whose headers are at hand:
//! - the CUDA graph shim (`csrc/graph.cpp`, behind `src/nn/cuda_graph.rs`) and the streams and
//!   events one (`csrc/stream.cpp`, behind `src/nn/stream.rs`): set `cfg(vnfarm_cuda_graphs)`;
//! - the operator shim (`csrc/ops.cpp`, behind `src/nn/ops.rs`; plain ATen, no GPU API) and the
//!   run-time kernel compiler (`csrc/rtc.cpp`: NVRTC or hiprtc through libtorch's stub): set
//!   `cfg(vnfarm_ops_shim)`.
//!
//! Which backend, from what `DEP_TCH_LIBTORCH_LIB` holds:
//! - `libtorch_cuda.so` (the PyPI wheel here and on NVIDIA boxes): the CUDA runtime headers, plus
//!   `cuda.h` and `nvrtc.h` for rtc.cpp, from `VNFARM_CUDA_INCLUDE`, `CUDA_HOME`, the NVIDIA wheels
//!   beside torch or `/usr/local/cuda`; links `torch_cuda` and `c10_cuda`.
//! - `libtorch_hip.so` (a ROCm build of PyTorch): the HIP headers (`hip/hip_runtime_api.h`,
//!   `hip/hiprtc.h`) from `VNFARM_HIP_INCLUDE`, `HIP_PATH`, `ROCM_PATH`, libtorch's own include
//!   folder (where a wheel bundles them) or `/opt/rocm/include`; compiled with
//!   `-D__HIP_PLATFORM_AMD__ -DUSE_ROCM -DHIPBLAS_V2` (the defines torch/utils/cpp_extension.py
//!   gives ROCm extensions, COMMON_HIP_FLAGS) and `-DVN_HIP`, which selects the HIP side of
//!   `csrc/backend.h` and `csrc/rtc.cpp`; links `torch_hip` and `c10_hip`. The same cfgs: the Rust
//!   side needs no backend switch (the kernels' warp width comes from the device at run time).
//! - neither (a CPU-only libtorch): compiles nothing; graph capture and the shim's settings report
//!   that they are not built in.

use std::path::{Path, PathBuf};

fn main() {
    vnfarm_build_support::link_libtorch();
    println!("cargo::rustc-check-cfg=cfg(vnfarm_cuda_graphs)");
    println!("cargo::rustc-check-cfg=cfg(vnfarm_ops_shim)");
    for file in [
        "graph.cpp",
        "ops.cpp",
        "rtc.cpp",
        "stream.cpp",
        "guarded.h",
        "backend.h",
    ] {
        println!("cargo:rerun-if-changed=csrc/{file}");
    }
    for var in [
        "VNFARM_CUDA_INCLUDE",
        "CUDA_HOME",
        "VNFARM_HIP_INCLUDE",
        "HIP_PATH",
        "ROCM_PATH",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    match shim_paths() {
        Ok(paths) => build_shim(&paths),
        Err(why) => println!("cargo:warning=CUDA graph capture not built: {why}"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Cuda,
    Hip,
}

struct ShimPaths {
    backend: Backend,
    libtorch_lib: PathBuf,
    libtorch_include: PathBuf,
    /// The GPU runtime headers first, then a folder supplying what they lack.
    gpu_include: Vec<PathBuf>,
}

/// Where the shim's headers and libraries are, or why it is not built.
fn shim_paths() -> Result<ShimPaths, String> {
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .map(PathBuf::from)
        .map_err(|_| "torch-sys gave no libtorch lib directory".to_string())?;
    if lib.join("libtorch_cuda.so").exists() {
        cuda_paths(lib)
    } else if lib.join("libtorch_hip.so").exists() {
        hip_paths(lib)
    } else {
        Err(format!(
            "{} holds neither libtorch_cuda.so nor libtorch_hip.so (a CPU build)",
            lib.display()
        ))
    }
}

fn cuda_paths(lib: PathBuf) -> Result<ShimPaths, String> {
    let include = lib.join("../include");
    if !include.join("ATen/cuda/CUDAGraph.h").exists() {
        return Err(format!(
            "no ATen/cuda/CUDAGraph.h under {}",
            include.display()
        ));
    }
    // The CUDA runtime headers: an explicit folder, a toolkit, or the NVIDIA wheels beside a
    // PyTorch install (`site-packages/nvidia/cu13/include`, `nvidia/cuda_runtime/include` for CUDA 12).
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = std::env::var("VNFARM_CUDA_INCLUDE") {
        candidates.push(dir.into());
    }
    if let Ok(home) = std::env::var("CUDA_HOME") {
        candidates.push(Path::new(&home).join("include"));
    }
    let site = lib.join("../..");
    for sub in ["nvidia/cu13/include", "nvidia/cuda_runtime/include"] {
        candidates.push(site.join(sub));
    }
    candidates.push("/usr/local/cuda/include".into());
    let runtime = candidates
        .iter()
        .find(|d| d.join("cuda_runtime_api.h").exists())
        .cloned()
        .ok_or_else(|| "no cuda_runtime_api.h found (set VNFARM_CUDA_INCLUDE)".to_string())?;
    let mut gpu_include = vec![runtime.clone()];
    // `cuda_runtime.h` includes `crt/host_config.h`, which the CUDA 13 runtime wheel leaves to the
    // compiler's wheel; Triton (a torch dependency) bundles one. It only checks the host compiler.
    if !runtime.join("crt/host_config.h").exists() {
        candidates.push(site.join("triton/backends/nvidia/include"));
        let crt = candidates
            .into_iter()
            .find(|d| d.join("crt/host_config.h").exists())
            .ok_or_else(|| format!("{} has no crt/host_config.h", runtime.display()))?;
        gpu_include.push(crt);
    }
    Ok(ShimPaths {
        backend: Backend::Cuda,
        libtorch_lib: lib,
        libtorch_include: include,
        gpu_include,
    })
}

fn hip_paths(lib: PathBuf) -> Result<ShimPaths, String> {
    let include = lib.join("../include");
    // The hipified headers a ROCm libtorch installs for `ATen/cuda/CUDAGraph.h` and
    // `c10/cuda/CUDAStream.h` (csrc/backend.h, csrc/graph.cpp).
    for header in [
        "ATen/hip/HIPGraph.h",
        "ATen/hip/impl/HIPStreamMasqueradingAsCUDA.h",
    ] {
        if !include.join(header).exists() {
            return Err(format!("no {header} under {}", include.display()));
        }
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = std::env::var("VNFARM_HIP_INCLUDE") {
        candidates.push(dir.into());
    }
    for var in ["HIP_PATH", "ROCM_PATH"] {
        if let Ok(root) = std::env::var(var) {
            candidates.push(Path::new(&root).join("include"));
        }
    }
    candidates.push(include.clone());
    candidates.push("/opt/rocm/include".into());
    let hip = candidates
        .into_iter()
        .find(|d| d.join("hip/hip_runtime_api.h").exists() && d.join("hip/hiprtc.h").exists())
        .ok_or_else(|| {
            "no hip/hip_runtime_api.h with hip/hiprtc.h found (install ROCm's HIP headers or set \
             VNFARM_HIP_INCLUDE)"
                .to_string()
        })?;
    Ok(ShimPaths {
        backend: Backend::Hip,
        libtorch_lib: lib,
        libtorch_include: include,
        gpu_include: vec![hip],
    })
}

fn build_shim(p: &ShimPaths) {
    // The flags torch-sys compiles its own C++ wrapper with.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&p.libtorch_include)
        .include(p.libtorch_include.join("torch/csrc/api/include"))
        .includes(&p.gpu_include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-w");
    if p.backend == Backend::Hip {
        for define in ["__HIP_PLATFORM_AMD__", "USE_ROCM", "HIPBLAS_V2", "VN_HIP"] {
            build.define(define, None);
        }
    }
    build
        .file("csrc/graph.cpp")
        .file("csrc/ops.cpp")
        .file("csrc/rtc.cpp")
        .file("csrc/stream.cpp")
        .compile("vnfarm_cuda_graph");
    // After the static library, so that `--as-needed` keeps them for its references.
    println!(
        "cargo:rustc-link-search=native={}",
        p.libtorch_lib.display()
    );
    let gpu_libs = match p.backend {
        Backend::Cuda => ["torch_cuda", "c10_cuda"],
        Backend::Hip => ["torch_hip", "c10_hip"],
    };
    for lib in gpu_libs.into_iter().chain(["torch_cpu", "c10"]) {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-cfg=vnfarm_cuda_graphs");
    println!("cargo:rustc-cfg=vnfarm_ops_shim");
}
