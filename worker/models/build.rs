//! Keeps libtorch's GPU backend registered in this crate's linked targets (its tests): the linker's
//! `--as-needed` would otherwise drop `libtorch_cuda` / `libtorch_hip`, which nothing references
//! by symbol, and `Device::Cuda` would then report no devices. Link arguments do not propagate to
//! dependents: a binary using this crate (the worker) emits the same lines with
//! `cargo:rustc-link-arg-bins=` from its own build script.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    let Some(lib) = libtorch_lib_dir() else {
        return;
    };
    for backend in ["torch_cuda", "torch_hip"] {
        if lib.join(format!("lib{backend}.so")).exists() {
            // This package has no binaries, so the per-target `-bins` form would be rejected.
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-l{backend}");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
}

/// `$LIBTORCH/lib`, or torch's `lib/` inside the Python environment on PATH.
fn libtorch_lib_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(dir).join("lib"));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import torch, os; print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    Some(PathBuf::from(dir.trim()).join("lib"))
}
