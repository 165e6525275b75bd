//! For the build scripts of crates that link libtorch through `tch`: call [`link_libtorch`] from
//! `build.rs` (the crate must depend directly on `torch-sys`, whose `links = "tch"` hands its build
//! scripts `DEP_TCH_LIBTORCH_LIB`, the libtorch `lib/` directory it linked).
//!
//! For every linked target of the crate (binaries, tests, examples) it emits:
//! - `libtorch_cuda` (NVIDIA) or `libtorch_hip` (ROCm), when present, inside `--no-as-needed`:
//!   nothing references them by symbol, so the linker's default `--as-needed` would drop them, the
//!   GPU backend would never register and `tch::Cuda::is_available()` would be false;
//! - a `RUNPATH` to that directory, so the programs start without `LD_LIBRARY_PATH`. `RUNPATH`, not
//!   `RPATH`: `LD_LIBRARY_PATH`, when set, still wins (a deployment image or a GPU machine with its
//!   own torch `lib/`).
//!
//! Link arguments do not propagate to dependents, so every crate with linked targets that reach
//! libtorch calls this itself.

use std::path::Path;

pub fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    for backend in ["torch_cuda", "torch_hip"] {
        if Path::new(&lib).join(format!("lib{backend}.so")).exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-l{backend}");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
}
