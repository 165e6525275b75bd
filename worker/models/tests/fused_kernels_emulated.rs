//! The fused normalisation kernels (`src/nn/kernels/norms.cu`) run on the CPU: their source is
//! compiled as C++ by the system compiler into `tests/support/norms_emu.cpp`, which runs every CUDA
//! thread as a thread of its own (barriers for `__syncthreads`, an exchange through memory for the
//! warp shuffles) and checks the results against double-precision references. This covers the
//! kernels' indexing, the groups that straddle 8-channel vectors, the time embedding folded into
//! the statistics, the grid-stride loops and the bf16 rounding on every CI machine; the GPU run
//! (`bench components --norms-check`, docs/performance.md) covers the real compiler and hardware.

use std::path::PathBuf;
use std::process::Command;

use vnfarm_models::nn::fused::{GroupNormGrid, SOURCE};

#[test]
fn fused_norm_kernels_match_double_precision_references_in_emulation() {
    let dir = std::env::temp_dir().join(format!("vnfarm-norms-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // What CUDA C has and C++ lacks: dynamic shared memory, extern "C" kernels.
    let source = SOURCE
        .replace("extern __shared__ float sh[];", "float* sh = g_dyn_shared;")
        .replace("extern \"C\" ", "");
    let cu = dir.join("norms.cu");
    std::fs::write(&cu, source).expect("write source");
    let emu_src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/norms_emu.cpp");
    let exe = dir.join("norms_emu");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread"])
        .arg(format!("-DNORMS_SOURCE=\"{}\"", cu.display()))
        .arg(&emu_src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        built.status.success(),
        "compiling the emulation failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let mut args: Vec<String> = Vec::new();
    // (N, C, HW, G, time-embedding term, SiLU): channels per group of 10 (groups straddle the
    // 8-channel vectors), 8, 12 and 5, odd row counts, single samples.
    for (n, c, hw, g, add, silu) in [
        (2, 80, 50, 8, true, true),
        (1, 64, 33, 8, false, true),
        (3, 48, 20, 4, true, false),
        (2, 160, 9, 32, false, false),
        (1, 320, 64, 32, true, true),
    ] {
        let GroupNormGrid { nb, rows, ty } = GroupNormGrid::new(n, c, hw);
        args.push("gn".into());
        args.extend(
            [n, c, hw, g, i64::from(add), i64::from(silu), nb, rows, ty].map(|v| v.to_string()),
        );
    }
    // Residual add + LayerNorm: the UNet's widths (640, 1280), a narrow one, a ragged last vector
    // per lane, and a row count that leaves the last block's warps partly idle.
    for (rows, c) in [(11, 64), (9, 640), (5, 1280), (11, 136)] {
        args.extend(["ln".to_string(), rows.to_string(), c.to_string()]);
    }
    // Bias + residual: a ragged grid-stride tail (the emulation launches 64 threads).
    for (rows, c) in [(13, 64), (7, 320)] {
        args.extend(["br".to_string(), rows.to_string(), c.to_string()]);
    }
    let run = Command::new(&exe)
        .args(&args)
        .output()
        .expect("run emulation");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "emulated kernels off (exit {:?}):\n{stdout}{}",
        run.status.code(),
        String::from_utf8_lossy(&run.stderr)
    );
    // Every case reported, and reported good.
    let cases = args
        .iter()
        .filter(|a| ["gn", "ln", "br"].contains(&a.as_str()))
        .count();
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with(" ok")).count(),
        cases,
        "{stdout}"
    );
}
