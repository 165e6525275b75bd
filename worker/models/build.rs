//! Keeps libtorch's GPU backend registered in this crate's linked targets (tests, examples): the
//! linker's `--as-needed` would otherwise drop `libtorch_cuda` / `libtorch_hip`, which nothing
//! references by symbol, and `Device::Cuda` would then report no devices. Adds a `RUNPATH` to the
//! libtorch it was built against, so tests and examples start without `LD_LIBRARY_PATH` (which,
//! when set, still wins). Link arguments do not propagate to dependents: the worker's build script
//! emits the same lines for its binary.
//!
//! torch-sys (links = "tch") exports its libtorch directory to direct dependents as
//! `DEP_TCH_LIBTORCH_LIB`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let lib = std::path::PathBuf::from(lib);
    for backend in ["torch_cuda", "torch_hip"] {
        if lib.join(format!("lib{backend}.so")).exists() {
            // This package has no binaries, so the per-target `-bins` form would be rejected.
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-l{backend}");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
