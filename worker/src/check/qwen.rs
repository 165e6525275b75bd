//! The Qwen-Image-Edit engine on this box: loads with the portable settings (falling back to the
//! matmul attention where SDPA fails on the device), compares its components on the device with
//! CPU copies (the transformer's first blocks and the VAE, from the box's own files: a CPU copy of
//! the whole 20 B transformer would not fit beside the warm models) and a short whole edit where
//! a CPU copy fits in memory, and measures the studio's 1024² edit: the encode of its input, one
//! denoising step and the decode (each the median of several edits' stage times). Then the
//! transformer's block kernels ([`CANDIDATES`]: the fused kernels of `qwen_image::kernels`, the
//! GELU epilogue, fused q/k/v projections, the image stream's fp8 GEMMs where the device has
//! them), each on top of the best so far, checked against the portable path's output and kept
//! where the transformer step at the edit's shapes is faster. Last the VAE's ([`VAE_CANDIDATES`]:
//! its RMS norms fused, its convolutions NHWC), each kept where its decode agrees with the portable
//! one and the edit's encode plus decode is faster.

use image::RgbImage;
use tch::{Device, Kind, Tensor};
use vnfarm_models::nn::fp8::Fp8Linear;
use vnfarm_models::nn::fused::NormKernels;
use vnfarm_models::nn::{AttentionImpl, FfGelu, MemoryFormat};
use vnfarm_models::qwen_image::pipeline::{EditRequest, EncodedInputs, QwenEditPipeline};
use vnfarm_models::settings::{Preset, QwenSettings};

use super::measure::{Timing, randn, relative_error, synchronize};
use super::report::CheckResult;
use super::{Plan, Step, tolerance};
use crate::engine::{AdvertisedKeys, QwenEditEngine, QwenEditEngineConfig};

fn input(side: u32) -> RgbImage {
    RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([
            (x * 7 % 256) as u8,
            (y * 5 % 256) as u8,
            ((x + y) % 256) as u8,
        ])
    })
}

fn edit(
    p: &QwenEditPipeline,
    inputs: &EncodedInputs,
    side: u32,
    steps: usize,
) -> anyhow::Result<(RgbImage, vnfarm_models::qwen_image::pipeline::EditTimes)> {
    let request = EditRequest {
        instruction: "make her smile".into(),
        seed: 3,
        steps,
        cfg: 1.0,
        size: Some((side, side)),
    };
    let (mut images, times) = p.edit(inputs, &[request], &mut |_, _| {}, &|| false)?;
    Ok((images.remove(0), times))
}

fn load(config: &QwenEditEngineConfig, settings: QwenSettings) -> anyhow::Result<QwenEditPipeline> {
    let mut c = config.clone();
    c.warm_up.clear();
    Ok(QwenEditEngine::load(&c, settings, AdvertisedKeys::default(), None)?.into_pipeline())
}

pub fn run(config: &QwenEditEngineConfig, plan: &Plan, step: &mut Step) {
    let device = crate::engine::device::parse_device(&config.device).unwrap_or(Device::Cpu);
    let mut settings = QwenSettings::preset(Preset::Portable);
    let Some(pipeline) = step.run("qwen_edit.load", || {
        Ok((
            load(config, settings)?,
            "loaded with the portable settings".to_owned(),
        ))
    }) else {
        return;
    };
    let probe_side = if plan.quick { 64 } else { 256 };
    let mut pipeline = pipeline;
    let mut probe = step.attempt("qwen_edit.device.edit", || {
        let encoded = pipeline.encode_inputs(&[input(probe_side)])?;
        Ok(edit(&pipeline, &encoded, probe_side, 2)?.0)
    });
    if probe.is_none() {
        // SDPA can fail on a backend (the studio's Python process needed plain attention once).
        settings.attention = AttentionImpl::Matmul;
        drop(pipeline);
        let Some(p) = step.run("qwen_edit.load_matmul_attention", || {
            Ok((
                load(config, settings)?,
                "loaded with the matmul attention".to_owned(),
            ))
        }) else {
            return;
        };
        pipeline = p;
        probe = step.run("qwen_edit.device.edit_matmul_attention", || {
            let encoded = pipeline.encode_inputs(&[input(probe_side)])?;
            Ok((
                edit(&pipeline, &encoded, probe_side, 2)?.0,
                "a 2-step edit runs with matmul attention".to_owned(),
            ))
        });
    } else {
        step.record(CheckResult::pass(
            "qwen_edit.device.edit",
            format!("a 2-step {probe_side}² edit runs"),
            None,
        ));
    }
    let Some(device_image) = probe else { return };
    component_parity(config, settings, device, step);
    cpu_parity(config, settings, step, &device_image, probe_side);

    let side = if plan.quick { 128 } else { 1024 };
    let image = input(side);
    let Some(encode) = step.time(
        &format!("qwen_edit.encode.{side}x{side}"),
        "portable",
        device,
        plan.repeats,
        || Ok(pipeline.encode_inputs(std::slice::from_ref(&image))?),
    ) else {
        return;
    };
    let Some(encoded) = step.attempt("qwen_edit.encode", || {
        Ok(pipeline.encode_inputs(std::slice::from_ref(&image))?)
    }) else {
        return;
    };
    // Four steps, as the Lightning LoRA runs: the stage times of each edit, medians over runs.
    let steps = 4;
    let id = format!("qwen_edit.edit.{side}x{side}");
    step.start(&id);
    let mut runs = Vec::new();
    for _ in 0..(1 + plan.repeats.warm + plan.repeats.timed.max(1)) {
        synchronize(device);
        match edit(&pipeline, &encoded, side, steps) {
            Ok((_, times)) => runs.push(times),
            Err(e) => {
                step.record(CheckResult::fail(&id, format!("{e:#}")));
                return;
            }
        }
    }
    let stage = |name: &str, f: fn(&vnfarm_models::qwen_image::pipeline::EditTimes) -> f64| {
        let timed: Vec<f64> = runs[1 + plan.repeats.warm..].iter().map(f).collect();
        Timing::from_runs(
            &format!("qwen_edit.{name}.{side}x{side}"),
            "portable",
            f(&runs[0]),
            timed,
        )
    };
    let denoise_step = stage("step", |t| t.denoise / 4.0);
    let decode = stage("decode", |t| t.decode);
    let prompt = stage("encode_prompt", |t| t.encode_prompt);
    step.record(CheckResult::pass(
        &id,
        format!(
            "4-step edit: step {:.4} s, decode {:.4} s, prompt {:.4} s, input encode {:.4} s (medians)",
            denoise_step.median_s, decode.median_s, prompt.median_s, encode.median_s
        ),
        Some(denoise_step.median_s),
    ));
    for t in [denoise_step, decode, prompt] {
        step.timing(t);
    }
    let (best, speedup) = block_kernels(&mut pipeline, settings, side, plan, device, step);
    let best = vae_settings(&mut pipeline, best, side, plan, device, step);
    step.chosen(
        serde_json::to_value(best).expect("settings serialize"),
        speedup,
    );
}

/// A named change of the transformer's block kernels.
struct Candidate {
    name: &'static str,
    apply: fn(&mut QwenSettings),
    /// Relative error from the portable step allowed, by the activations' kind.
    tolerance: fn(Kind) -> f64,
    /// What the device must have, asked before the candidate runs (a device without it skips
    /// the candidate: nothing failed).
    requires: Option<fn(Device) -> Result<(), String>>,
}

/// fp8 GEMMs round each weight and activation to 3 mantissa bits (2⁻⁴ relative at most), so the
/// step moves by a few percent where the other candidates move by bf16 rounding; a wrong kernel
/// or scale moves it by order 1. What the images do is measured per image on the GPU
/// (docs/performance.md, "fp8 GEMMs of step 13").
fn fp8_tolerance(_: Kind) -> f64 {
    0.2
}

/// In the order they are tried, each on top of the best so far (docs/performance.md, "fused
/// kernels of step 13").
const CANDIDATES: [Candidate; 6] = [
    Candidate {
        name: "qk_norm_rope_fused",
        apply: |s| s.qk_norm_rope = NormKernels::Fused,
        tolerance,
        requires: None,
    },
    Candidate {
        name: "ada_norm_fused",
        apply: |s| s.ada_norm = NormKernels::Fused,
        tolerance,
        requires: None,
    },
    Candidate {
        name: "gated_residual_fused",
        apply: |s| s.gated_residual = NormKernels::Fused,
        tolerance,
        requires: None,
    },
    Candidate {
        name: "ff_gelu_epilogue",
        apply: |s| s.ff_gelu = FfGelu::Epilogue,
        tolerance,
        requires: None,
    },
    Candidate {
        name: "fused_qkv",
        apply: |s| s.fused_qkv = true,
        tolerance,
        requires: None,
    },
    // Last: it refuses a device without fp8 GEMMs (a Radeon 8060S) at once, and pays only with
    // the fused norms before it (they write its quantised inputs).
    Candidate {
        name: "fp8_gemm",
        apply: |s| s.fp8_gemm = true,
        tolerance: fp8_tolerance,
        requires: Some(Fp8Linear::probe),
    },
];

/// The transformer step at a `side`² edit's shapes (target and reference tokens, a 211-token
/// prompt; 16 with `--quick`) under the portable kernels and each candidate; returns the best
/// settings and the portable step's time over the best's.
fn block_kernels(
    pipeline: &mut QwenEditPipeline,
    portable: QwenSettings,
    side: u32,
    plan: &Plan,
    device: Device,
    step: &mut Step,
) -> (QwenSettings, f64) {
    let c = pipeline.transformer().config().clone();
    let kind = pipeline.config().dtype;
    let patches = i64::from(side) / 16;
    let shapes = [(1, patches, patches), (1, patches, patches)];
    let tokens = 2 * patches * patches;
    let txt_len = if plan.quick { 16 } else { 211 };
    let hidden = randn(&[1, tokens, c.in_channels], 31, kind, device);
    let text = randn(&[1, txt_len, c.joint_attention_dim], 32, kind, device);
    let sigma = Tensor::from_slice(&[0.9f32]).to_device(device);
    let id = format!("qwen_edit.transformer_step.{side}x{side}");
    let forward = |p: &QwenEditPipeline| -> anyhow::Result<Tensor> {
        let _guard = tch::no_grad_guard();
        Ok(p.transformer()
            .forward(&hidden, &text, None, &sigma, &shapes)?)
    };
    let Some(reference) = step.run("qwen_edit.transformer_step.reference", || {
        Ok((
            forward(pipeline)?,
            format!("the portable transformer step at a {side}² edit's shapes runs"),
        ))
    }) else {
        return (portable, 1.0);
    };
    let Some(portable_t) = step.time(&id, "portable", device, plan.repeats, || forward(pipeline))
    else {
        return (portable, 1.0);
    };
    let (mut best, mut best_t) = (portable, portable_t.median_s);
    for candidate in &CANDIDATES {
        let mut settings = best;
        (candidate.apply)(&mut settings);
        let cid = format!("qwen_edit.candidate.{}", candidate.name);
        if !step.can_try(&cid, settings.needs_shims()) {
            continue;
        }
        if let Some(Err(why)) = candidate.requires.map(|r| r(device)) {
            step.record(CheckResult::skip(&cid, why));
            continue;
        }
        let agreed = step.run(&cid, || {
            pipeline
                .set_block_kernels(settings.block_kernels())
                .map_err(anyhow::Error::msg)?;
            let error = relative_error(&forward(pipeline)?, &reference);
            let tol = (candidate.tolerance)(kind);
            anyhow::ensure!(
                error < tol,
                "disagrees with the portable path: relative error {error:.2e} (tolerance {tol:.0e})"
            );
            Ok((
                (),
                format!("agrees with the portable path: relative error {error:.2e}"),
            ))
        });
        let timed = agreed.and_then(|()| {
            step.time(&id, candidate.name, device, plan.repeats, || {
                forward(pipeline)
            })
        });
        match timed {
            Some(t) if step.speed(&cid, t.median_s, best_t) => {
                best = settings;
                best_t = t.median_s;
            }
            _ => {
                // Back to the best so far, which ran before.
                if let Err(e) = pipeline.set_block_kernels(best.block_kernels()) {
                    step.record(CheckResult::fail(&format!("{cid}.restore"), e));
                }
            }
        }
    }
    (best, portable_t.median_s / best_t)
}

/// A named change of the VAE's settings.
struct VaeCandidate {
    name: &'static str,
    apply: fn(&mut QwenSettings),
}

/// In the order they are tried, each on top of the best so far.
const VAE_CANDIDATES: [VaeCandidate; 2] = [
    VaeCandidate {
        name: "vae_norm_fused",
        apply: |s| s.vae_norm = NormKernels::Fused,
    },
    VaeCandidate {
        name: "vae_channels_last",
        apply: |s| s.vae_memory_format = MemoryFormat::ChannelsLast,
    },
];

/// The VAE's candidates ([`VAE_CANDIDATES`]: its RMS norms fused, its convolutions NHWC): a `side`²
/// image's encode and decode under the portable settings first; each candidate's decode must agree
/// with that within the device's tolerance, then the encode plus the decode must be faster
/// beyond the noise. Returns `best` with what was kept.
fn vae_settings(
    pipeline: &mut QwenEditPipeline,
    mut best: QwenSettings,
    side: u32,
    plan: &Plan,
    device: Device,
    step: &mut Step,
) -> QwenSettings {
    let kind = pipeline.config().vae_dtype;
    let z_dim = pipeline.vae().config().z_dim;
    let f = pipeline.vae().config().spatial_compression_ratio();
    let s = i64::from(side);
    let image = randn(&[1, 3, s, s], 33, kind, device).clamp(-1.0, 1.0);
    let latents = randn(&[1, z_dim, s / f, s / f], 34, kind, device);
    let run = |p: &QwenEditPipeline| -> anyhow::Result<Tensor> {
        let _guard = tch::no_grad_guard();
        drop(p.vae().encode_mean(&image)?);
        Ok(p.vae().decode(&latents)?)
    };
    let apply = |p: &mut QwenEditPipeline, s: &QwenSettings| -> anyhow::Result<()> {
        p.set_vae_norm_kernels(s.vae_norm)
            .map_err(anyhow::Error::msg)?;
        p.set_vae_memory_format(s.vae_memory_format);
        Ok(())
    };
    let id = format!("qwen_edit.vae.{side}x{side}");
    let Some(reference) = step.run("qwen_edit.vae.reference", || {
        Ok((
            run(pipeline)?,
            format!("the portable VAE's {side}² encode and decode run"),
        ))
    }) else {
        return best;
    };
    let Some(portable) = step.time(&id, "portable", device, plan.repeats, || run(pipeline)) else {
        return best;
    };
    let mut best_t = portable.median_s;
    for candidate in &VAE_CANDIDATES {
        let cid = format!("qwen_edit.candidate.{}", candidate.name);
        let mut settings = best;
        (candidate.apply)(&mut settings);
        if !step.can_try(&cid, settings.needs_shims()) {
            continue;
        }
        let agreed = step.run(&cid, || {
            apply(pipeline, &settings)?;
            let error = relative_error(&run(pipeline)?, &reference);
            let tol = tolerance(kind);
            anyhow::ensure!(
                error < tol,
                "disagrees with the portable VAE: relative error {error:.2e} (tolerance {tol:.0e})"
            );
            Ok((
                (),
                format!("agrees with the portable VAE: relative error {error:.2e}"),
            ))
        });
        let timed = agreed
            .and_then(|()| step.time(&id, candidate.name, device, plan.repeats, || run(pipeline)));
        match timed {
            Some(t) if step.speed(&cid, t.median_s, best_t) => {
                best = settings;
                best_t = t.median_s;
            }
            _ => {
                // Back to the best so far, which ran before.
                if let Err(e) = apply(pipeline, &best) {
                    step.record(CheckResult::fail(
                        &format!("{cid}.restore"),
                        format!("{e:#}"),
                    ));
                }
            }
        }
    }
    best
}

/// A short edit on a CPU copy in fp32 against the device's, where the copy fits: a copy takes
/// four bytes a parameter, and the check keeps it under a quarter of the system's memory so that
/// it never competes with the warm models (the real 20 B transformer does not fit: then the
/// comparison is reported as not made).
fn cpu_parity(
    config: &QwenEditEngineConfig,
    settings: QwenSettings,
    step: &mut Step,
    device_image: &RgbImage,
    side: u32,
) {
    let id = "qwen_edit.cpu_parity.edit";
    let bytes: u64 = config
        .files()
        .iter()
        .filter_map(|f| std::fs::metadata(&f.path).ok())
        .map(|m| m.len())
        .sum();
    // fp8 and bf16 files grow to four bytes a parameter in fp32: at most four times the files.
    let need = bytes.saturating_mul(4);
    let system = super::environment::system_memory_bytes();
    if need > system / 4 {
        step.record(CheckResult::skip(
            id,
            format!(
                "a CPU copy would take up to {:.1} GiB, more than a quarter of the system's {:.1} GiB",
                need as f64 / (1u64 << 30) as f64,
                system as f64 / (1u64 << 30) as f64
            ),
        ));
        return;
    }
    let mut cpu_config = config.clone();
    cpu_config.device = "cpu".into();
    cpu_config.dtype = crate::engine::device::Dtype::Fp32;
    cpu_config.vae_dtype = crate::engine::device::Dtype::Fp32;
    let out = step.attempt(id, || {
        let cpu = load(&cpu_config, settings)?;
        let encoded = cpu.encode_inputs(&[input(side)])?;
        Ok(edit(&cpu, &encoded, side, 2)?.0)
    });
    if let Some(cpu_image) = out {
        let diff: f64 = device_image
            .as_raw()
            .iter()
            .zip(cpu_image.as_raw())
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
            .sum::<f64>()
            / device_image.as_raw().len().max(1) as f64;
        // bf16 through a 2-step edit of random weights moves pixels by a few levels.
        let tolerance = if config.dtype.kind() == tch::Kind::Float {
            0.5
        } else {
            8.0
        };
        let detail = format!(
            "2-step {side}² edit, device against CPU: mean |difference| {diff:.3}/255 (tolerance {tolerance}/255)"
        );
        step.record(CheckResult::at_most(id, detail, diff, tolerance));
    }
}

/// Transformer blocks compared across devices: enough to cover a block's every layer and the
/// hand-over between two, about 0.7 B parameters of the real model (2.7 GB in fp32 on the CPU).
const PARITY_BLOCKS: usize = 2;

/// The transformer's first [`PARITY_BLOCKS`] blocks (with its input and output layers) and the
/// VAE's decoder, loaded from the box's files once on the device in the engine's dtypes and once
/// on the CPU in fp32 (fp8 weights dequantised), run on the same random inputs: an edit's shape
/// in small (an 8x8-patch target beside an 8x8-patch reference, 16 text tokens; a 16x16 latent).
/// LoRAs are left out: both copies are the base weights.
fn component_parity(
    config: &QwenEditEngineConfig,
    settings: QwenSettings,
    device: Device,
    step: &mut Step,
) {
    let configs = step.attempt("qwen_edit.cpu_parity.config", || {
        let on_device = crate::engine::qwen_edit::pipeline_config(config, settings, device)?;
        let mut on_cpu = on_device.clone();
        on_cpu.device = Device::Cpu;
        on_cpu.dtype = Kind::Float;
        on_cpu.vae_dtype = Kind::Float;
        on_cpu.settings = QwenSettings::preset(Preset::Portable);
        Ok((on_device, on_cpu))
    });
    let Some((on_device, on_cpu)) = configs else {
        return;
    };
    let kind = on_device.dtype;
    step.agreement(
        "qwen_edit.cpu_parity.transformer_blocks",
        &format!("the transformer's first {PARITY_BLOCKS} blocks, device against CPU"),
        tolerance(kind),
        || {
            let dev = QwenEditPipeline::load_transformer_part(&on_device, PARITY_BLOCKS)?;
            let cpu = QwenEditPipeline::load_transformer_part(&on_cpu, PARITY_BLOCKS)?;
            let c = cpu.config().clone();
            let shapes = [(1, 8, 8), (1, 8, 8)];
            let tokens: i64 = shapes.iter().map(|(f, h, w)| f * h * w).sum();
            let hidden = randn(&[1, tokens, c.in_channels], 21, Kind::Float, Device::Cpu);
            let text = randn(
                &[1, 16, c.joint_attention_dim],
                22,
                Kind::Float,
                Device::Cpu,
            );
            let sigma = Tensor::from_slice(&[0.6f32]);
            let _guard = tch::no_grad_guard();
            let want = cpu.forward(&hidden, &text, None, &sigma, &shapes)?;
            let got = dev.forward(
                &hidden.to_device(device).to_kind(kind),
                &text.to_device(device).to_kind(kind),
                None,
                &sigma.to_device(device),
                &shapes,
            )?;
            Ok(relative_error(&got, &want))
        },
    );
    let vae_kind = on_device.vae_dtype;
    step.agreement(
        "qwen_edit.cpu_parity.vae",
        "the VAE's decode of a 16x16 latent, device against CPU",
        tolerance(vae_kind),
        || {
            let dev = QwenEditPipeline::load_vae_only(&on_device)?;
            let cpu = QwenEditPipeline::load_vae_only(&on_cpu)?;
            let z = randn(
                &[1, cpu.config().z_dim, 16, 16],
                23,
                Kind::Float,
                Device::Cpu,
            );
            let _guard = tch::no_grad_guard();
            let want = cpu.decode(&z)?;
            let got = dev.decode(&z.to_device(device).to_kind(vae_kind))?;
            Ok(relative_error(&got, &want))
        },
    );
}
