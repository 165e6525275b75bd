//! Links this crate's programs to libtorch so that they find the GPU backend and start without
//! `LD_LIBRARY_PATH` (see `vnfarm-build-support`), and builds the CUDA graph shim
//! (`csrc/graph.cpp`, behind `src/nn/cuda_graph.rs`) when libtorch is a CUDA build whose headers and
//! the CUDA runtime headers are at hand: it then sets `cfg(vnfarm_cuda_graphs)`. The operator shim
//! (`csrc/ops.cpp`, behind `src/nn/ops.rs`; plain ATen, no CUDA API) and the run-time kernel
//! compiler (`csrc/rtc.cpp`: NVRTC and the driver API through libtorch's stub, which needs `cuda.h`
//! and `nvrtc.h` beside the runtime headers) are built with it and set `cfg(vnfarm_ops_shim)`. A CPU-only or ROCm
//! libtorch compiles nothing here, and graph capture reports that it is not built in.

use std::path::{Path, PathBuf};

fn main() {
    vnfarm_build_support::link_libtorch();
    println!("cargo::rustc-check-cfg=cfg(vnfarm_cuda_graphs)");
    println!("cargo::rustc-check-cfg=cfg(vnfarm_ops_shim)");
    println!("cargo:rerun-if-changed=csrc/graph.cpp");
    println!("cargo:rerun-if-changed=csrc/ops.cpp");
    println!("cargo:rerun-if-changed=csrc/rtc.cpp");
    println!("cargo:rerun-if-changed=csrc/guarded.h");
    println!("cargo:rerun-if-env-changed=VNFARM_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    match cuda_graph_paths() {
        Ok(paths) => build_shim(&paths),
        Err(why) => println!("cargo:warning=CUDA graph capture not built: {why}"),
    }
}

struct ShimPaths {
    libtorch_lib: PathBuf,
    libtorch_include: PathBuf,
    /// The CUDA runtime headers first, then a folder supplying what they lack.
    cuda_include: Vec<PathBuf>,
}

/// Where the shim's headers and libraries are, or why it is not built.
fn cuda_graph_paths() -> Result<ShimPaths, String> {
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .map(PathBuf::from)
        .map_err(|_| "torch-sys gave no libtorch lib directory".to_string())?;
    if !lib.join("libtorch_cuda.so").exists() {
        return Err(format!(
            "{} holds no libtorch_cuda.so (CPU or ROCm build)",
            lib.display()
        ));
    }
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
    let mut cuda_include = vec![runtime.clone()];
    // `cuda_runtime.h` includes `crt/host_config.h`, which the CUDA 13 runtime wheel leaves to the
    // compiler's wheel; Triton (a torch dependency) bundles one. It only checks the host compiler.
    if !runtime.join("crt/host_config.h").exists() {
        candidates.push(site.join("triton/backends/nvidia/include"));
        let crt = candidates
            .into_iter()
            .find(|d| d.join("crt/host_config.h").exists())
            .ok_or_else(|| format!("{} has no crt/host_config.h", runtime.display()))?;
        cuda_include.push(crt);
    }
    Ok(ShimPaths {
        libtorch_lib: lib,
        libtorch_include: include,
        cuda_include,
    })
}

fn build_shim(p: &ShimPaths) {
    // The flags torch-sys compiles its own C++ wrapper with.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&p.libtorch_include)
        .include(p.libtorch_include.join("torch/csrc/api/include"))
        .includes(&p.cuda_include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-w")
        .file("csrc/graph.cpp")
        .file("csrc/ops.cpp")
        .file("csrc/rtc.cpp")
        .compile("vnfarm_cuda_graph");
    // After the static library, so that `--as-needed` keeps them for its references.
    println!(
        "cargo:rustc-link-search=native={}",
        p.libtorch_lib.display()
    );
    for lib in ["torch_cuda", "c10_cuda", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-cfg=vnfarm_cuda_graphs");
    println!("cargo:rustc-cfg=vnfarm_ops_shim");
}
