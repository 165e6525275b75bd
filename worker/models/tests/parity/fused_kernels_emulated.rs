//! The fused normalisation kernels (`src/nn/kernels/norms.cu`) run on the CPU: their source is
//! compiled as C++ by the system compiler into `tests/support/norms_emu.cpp`, which runs every GPU
//! thread as a thread of its own (barriers for `__syncthreads`, an exchange through memory for the
//! warp shuffles) and checks the results against double-precision references. This covers the
//! kernels' indexing, the groups that straddle 8-channel vectors, the time embedding folded into
//! the statistics, the grid-stride loops and the bf16 rounding on every CI machine; the GPU run
//! (`bench components --norms-check`, docs/performance.md) covers the real compiler and hardware.
//!
//! Each case runs at both warp widths the kernels are built for, with the launch geometry
//! `src/nn/fused.rs` computes for that width: 32 lanes (CUDA, and AMD RDNA such as gfx1151) and 64
//! (AMD CDNA). The 32-lane build runs once with CUDA's shuffle (`__shfl_xor_sync`) and once with
//! HIP's (`__shfl_xor(v, mask, width)`), the 64-lane build with HIP's. Mutation checked by hand
//! (2026-12-01): `add_layer_norm`'s reductions starting at `o = 16` instead of `VN_WARP / 2` pass
//! every case at 32 lanes and fail at 64 the rows of 640, 1024 and 1280 channels (max error
//! 0.7–1.0): each half-wavefront normalises with its own sums. Rows of at most 32 vectors (64 and
//! 136 channels) leave the upper half empty, so they pass either way.

use std::path::{Path, PathBuf};
use std::process::Command;

use vnfarm_models::nn::fused::{AddLayerNormGrid, GroupNormGrid, SOURCE};
use vnfarm_models::nn::ops::WarpWidth;

use crate::support::emulation::{self, Shuffle};

#[test]
fn fused_norm_kernels_match_double_precision_references_in_emulation_with_32_lane_warps() {
    check_in_emulation(WarpWidth::Lanes32, Shuffle::Cuda);
    check_in_emulation(WarpWidth::Lanes32, Shuffle::Hip);
}

#[test]
fn fused_norm_kernels_match_double_precision_references_in_emulation_with_64_lane_wavefronts() {
    check_in_emulation(WarpWidth::Lanes64, Shuffle::Hip);
}

/// Builds the emulation of the kernels at `warp` lanes with `shuffle`, runs every case and asserts
/// that each one is reported, and reported good.
fn check_in_emulation(warp: WarpWidth, shuffle: Shuffle) {
    let dir = tempfile::tempdir().expect("temp dir");
    let exe = build_emulator(dir.path(), warp, shuffle);
    let args = cases(warp);
    let run = Command::new(&exe)
        .args(&args)
        .output()
        .expect("run emulation");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let what = format!("{} lanes, {shuffle:?} shuffle", warp.lanes());
    assert!(
        run.status.success(),
        "emulated kernels off at {what} (exit {:?}):\n{stdout}{}",
        run.status.code(),
        String::from_utf8_lossy(&run.stderr)
    );
    let cases = args
        .iter()
        .filter(|a| ["gn", "ln", "br"].contains(&a.as_str()))
        .count();
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with(" ok")).count(),
        cases,
        "at {what}:\n{stdout}"
    );
}

/// The kernels' source compiled into the emulator, in `dir`.
fn build_emulator(dir: &Path, warp: WarpWidth, shuffle: Shuffle) -> PathBuf {
    // What CUDA C has and C++ lacks: dynamic shared memory, extern "C" kernels.
    let source = SOURCE
        .replace("extern __shared__ float sh[];", "float* sh = g_dyn_shared;")
        .replace("extern \"C\" ", "");
    emulation::build(dir, &source, "NORMS_SOURCE", "norms_emu", warp, shuffle)
}

/// The emulator's command line: every case, with the launch geometry fused.rs computes at `warp`.
fn cases(warp: WarpWidth) -> Vec<String> {
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
    // per lane, a width that fills 64-lane wavefronts exactly, and row counts that leave the last
    // block's warps partly idle (at 8 and at 4 rows per block).
    for (rows, c) in [(11, 64), (9, 640), (5, 1280), (11, 136), (6, 1024)] {
        let AddLayerNormGrid { blocks, threads } = AddLayerNormGrid::new(rows, warp);
        args.push("ln".into());
        args.extend([rows, c, blocks, threads].map(|v| v.to_string()));
    }
    // Bias + residual: a ragged grid-stride tail (the emulation launches 64 threads).
    for (rows, c) in [(13, 64), (7, 320)] {
        args.extend(["br".to_string(), rows.to_string(), c.to_string()]);
    }
    args
}
