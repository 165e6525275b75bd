//! The fused normalisation kernels (`src/nn/kernels/norms.cu`) compile as HIP device code for AMD
//! GPUs at both wavefront widths: gfx1151 (RDNA 3.5, the Radeon 8060S of the studio's Strix Halo
//! boxes) at 32 lanes and gfx90a (CDNA 2) at 64, as hiprtc compiles them on a ROCm box
//! (`csrc/rtc.cpp`: `--offload-arch=<gcnArchName> -DVN_WARP=<warp size>`). No ROCm here: Debian's
//! clang 19 (`./farm setup` installs `clang-19`) compiles device code only
//! (`-x hip --cuda-device-only -nogpulib -nogpuinc`) with `tests/support/hip_prelude.h` in place of
//! hiprtc's built-in header, to AMDGPU assembly (`-S`: no linker needed).
//!
//! Besides "it compiles", the assembly shows what the GPU will run: each kernel is there, built for
//! the intended width (`.amdhsa_wavefront_size32 1` only on gfx1151), and `add_layer_norm`'s two
//! reductions are log2(width) shuffles each (`ds_bpermute_b32`: 10 at 32 lanes, 12 at 64), so a
//! reduction that skipped the upper half of a 64-lane wavefront would show here as 10 on gfx90a.
//! A `-DVN_WARP` that disagrees with the target's width is refused by the source itself.
//!
//! The compiler is `VNFARM_HIP_CLANG` if set, else `clang++-19`. Without it the test says so and
//! passes, except in CI (`CI=true`), where it fails: CI must run it.

use std::path::PathBuf;
use std::process::{Command, Output};

use vnfarm_models::nn::fused::SOURCE;
use vnfarm_models::nn::ops::WarpWidth;
use vnfarm_models::qwen_image::kernels;

const KERNELS: [&str; 5] = [
    "gn_partial",
    "gn_finalize",
    "gn_apply",
    "add_layer_norm",
    "bias_residual",
];

#[test]
fn fused_norm_kernels_compile_for_rdna_at_32_lanes_and_cdna_at_64() {
    let Some(clang) = hip_clang() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (arch, warp) in [
        ("gfx1151", WarpWidth::Lanes32),
        ("gfx90a", WarpWidth::Lanes64),
    ] {
        let out = dir.path().join(format!("norms-{arch}.s"));
        let run = compile(&clang, SOURCE, arch, Some(warp), &out);
        assert!(
            run.status.success(),
            "{arch} at {} lanes:\n{}",
            warp.lanes(),
            String::from_utf8_lossy(&run.stderr)
        );
        let asm = std::fs::read_to_string(&out).expect("assembly");
        for kernel in KERNELS {
            assert!(
                asm.lines().any(|l| l.trim() == format!(".globl\t{kernel}")),
                "{arch}: no kernel {kernel}"
            );
        }
        let wave32 = asm.contains(".amdhsa_wavefront_size32 1");
        assert_eq!(
            wave32,
            warp == WarpWidth::Lanes32,
            "{arch}: wavefront width"
        );
        let shuffles = asm.matches("ds_bpermute_b32").count() as i64;
        let steps = i64::from(warp.lanes().trailing_zeros());
        assert_eq!(
            shuffles,
            2 * steps,
            "{arch}: add_layer_norm's two reductions should take {steps} shuffles each"
        );
    }
}

/// The Qwen block's kernels (`src/nn/kernels/qwen_block.cu`), the same way: every kernel there,
/// the intended width, and five warp-wide reductions (one in `qk_norm_rope`; in `modulated_norm`
/// two sums and the fp8 output's largest magnitude; in `gelu_quant` the largest magnitude; none in
/// `vae_rms_norm`, a thread per pixel) of log2(width) shuffles each, none spilling to scratch
/// memory.
#[test]
fn qwen_block_kernels_compile_for_rdna_at_32_lanes_and_cdna_at_64() {
    let Some(clang) = hip_clang() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (arch, warp) in [
        ("gfx1151", WarpWidth::Lanes32),
        ("gfx90a", WarpWidth::Lanes64),
    ] {
        let out = dir.path().join(format!("qwen-{arch}.s"));
        let run = compile(&clang, kernels::SOURCE, arch, Some(warp), &out);
        assert!(
            run.status.success(),
            "{arch} at {} lanes:\n{}",
            warp.lanes(),
            String::from_utf8_lossy(&run.stderr)
        );
        let asm = std::fs::read_to_string(&out).expect("assembly");
        for kernel in kernels::NAMES {
            assert!(
                asm.lines().any(|l| l.trim() == format!(".globl\t{kernel}")),
                "{arch}: no kernel {kernel}"
            );
        }
        assert_eq!(
            asm.contains(".amdhsa_wavefront_size32 1"),
            warp == WarpWidth::Lanes32,
            "{arch}: wavefront width"
        );
        let steps = i64::from(warp.lanes().trailing_zeros());
        assert_eq!(
            asm.matches("ds_bpermute_b32").count() as i64,
            5 * steps,
            "{arch}: five reductions of {steps} shuffles each"
        );
        assert!(
            !asm.contains(".vgpr_spill_count: 1")
                && asm.matches(".vgpr_spill_count: 0").count() == kernels::NAMES.len(),
            "{arch}: a kernel spills registers"
        );
    }
}

#[test]
fn a_warp_width_that_disagrees_with_the_target_is_a_compile_error() {
    let Some(clang) = hip_clang() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (arch, warp) in [
        ("gfx1151", WarpWidth::Lanes64),
        ("gfx90a", WarpWidth::Lanes32),
    ] {
        let run = compile(
            &clang,
            SOURCE,
            arch,
            Some(warp),
            &dir.path().join("wrong.s"),
        );
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            !run.status.success() && stderr.contains("VN_WARP differs from the wavefront width"),
            "{arch} at {} lanes:\n{stderr}",
            warp.lanes()
        );
    }
    // Without -DVN_WARP the source takes the width the compiler targets.
    let run = compile(
        &clang,
        SOURCE,
        "gfx90a",
        None,
        &dir.path().join("default.s"),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The HIP-capable clang, or `None` (with a note) where it is missing outside CI.
fn hip_clang() -> Option<String> {
    let clang = std::env::var("VNFARM_HIP_CLANG").unwrap_or_else(|_| "clang++-19".into());
    match Command::new(&clang).arg("--version").output() {
        Ok(o) if o.status.success() => Some(clang),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!(
                "{clang} not found: CI runs the HIP compile check (`./farm setup` installs clang-19)"
            )
        }
        _ => {
            eprintln!(
                "skipped: {clang} not found (apt-get install clang-19, or set VNFARM_HIP_CLANG)"
            );
            None
        }
    }
}

/// `source` compiled for `arch` as HIP device code to assembly at `out`.
fn compile(
    clang: &str,
    source: &str,
    arch: &str,
    warp: Option<WarpWidth>,
    out: &std::path::Path,
) -> Output {
    let cu = out.with_extension("hip");
    std::fs::write(&cu, source).expect("write source");
    let prelude = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/hip_prelude.h");
    let mut cmd = Command::new(clang);
    cmd.args(["-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc"])
        .args(["-O3", "-std=c++17", "-S"])
        .arg(format!("--offload-arch={arch}"))
        .arg("-include")
        .arg(&prelude);
    if let Some(w) = warp {
        cmd.arg(format!("-DVN_WARP={}", w.lanes()));
    }
    cmd.arg(&cu)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("running {clang}: {e}"))
}
