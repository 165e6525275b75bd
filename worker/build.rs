//! Links the worker binary (and its test binaries) against libtorch the way it must be linked to find
//! the GPU:
//!
//! - `libtorch_cuda` (NVIDIA) or `libtorch_hip` (ROCm) with `--no-as-needed`: nothing references it by
//!   symbol, so the linker's default `--as-needed` would drop it, the CUDA/HIP backend would never
//!   register and `tch::Cuda::is_available()` would be false.
//! - a `RUNPATH` to the libtorch it was built against, so the binary starts without
//!   `LD_LIBRARY_PATH`; `RUNPATH` (not `RPATH`) so that `LD_LIBRARY_PATH`, when set, still wins
//!   (a deployment image or a GPU machine with its own torch `lib/`).
//!
//! torch-sys (links = "tch") exports its libtorch directory to direct dependents as
//! `DEP_TCH_LIBTORCH_LIB`; the worker depends on torch-sys only for this.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let lib = std::path::PathBuf::from(lib);
    for backend in ["torch_cuda", "torch_hip"] {
        if lib.join(format!("lib{backend}.so")).exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-l{backend}");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
