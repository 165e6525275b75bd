//! Building the CPU emulators of the run-time compiled kernels (`norms_emu.cpp`, `qwen_emu.cpp`
//! beside this file): the kernels' CUDA C source, made C++ by the caller, is included by the
//! emulator through a macro naming its path, at a warp width and with a shuffle spelling.

use std::path::{Path, PathBuf};
use std::process::Command;

use vnfarm_models::nn::ops::WarpWidth;

/// Which spelling of the warp shuffle the kernels' source is compiled with.
#[derive(Debug, Clone, Copy)]
pub enum Shuffle {
    /// `__shfl_xor_sync`, as NVRTC compiles it.
    Cuda,
    /// `__shfl_xor(v, mask, VN_WARP)`, as hiprtc compiles it (the source sees `__HIP__`).
    Hip,
}

/// Writes `source` into `dir` and compiles the emulator `tests/support/{emulator}.cpp` with it
/// (`-D{source_macro}="<path>"`) at `warp` lanes with `shuffle`; returns the executable.
pub fn build(
    dir: &Path,
    source: &str,
    source_macro: &str,
    emulator: &str,
    warp: WarpWidth,
    shuffle: Shuffle,
) -> PathBuf {
    let cu = dir.join(format!("{emulator}.cu"));
    std::fs::write(&cu, source).expect("write source");
    let support = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support");
    let exe = dir.join(emulator);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = Command::new(&cxx);
    cmd.args(["-std=c++20", "-O1", "-pthread"])
        .arg(format!("-D{source_macro}=\"{}\"", cu.display()))
        .arg(format!("-DVN_WARP={}", warp.lanes()));
    if let Shuffle::Hip = shuffle {
        cmd.arg("-DVN_EMULATE_HIP");
    }
    let built = cmd
        .arg(support.join(format!("{emulator}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        built.status.success(),
        "compiling the emulation failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    exe
}
