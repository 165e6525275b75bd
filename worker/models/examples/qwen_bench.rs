//! GPU benchmark of the Qwen-Image-Edit-2509 engine at real size, bf16, SDPA attention, for one
//! fp8 mode per process (`--fp8 upcast|resident`).
//!
//! Weights are the ComfyUI-layout files with random values written by `bench/run_qwen_bench.py`,
//! which also times diffusers on the same weights and GPU and runs this binary:
//!
//! ```sh
//! qwen_bench read <file>...
//! qwen_bench pipeline  --transformer F --text-encoder F --vae F [--config-dir D] --fp8 M
//!                      --input PNG --instructions JSON [--iters N] [--variants 1,3,10] [--save DIR]
//!                      [--size S] [--condition-area A] [--vae-area A] [--cpu]
//! qwen_bench components --transformer F --vae F [--config-dir D] --fp8 M [--txt-len L]
//!                      [--size S] [--vae-area A] [--profile-trace PATH] [--cpu]
//!                      [--kernels SPEC] [--sweep SPEC,SPEC,...]
//! qwen_bench host [--size S] [--condition-area A]
//! ```
//!
//! - `read`: the files read start to end into one 64 MiB buffer, twice (the page-cache baseline of
//!   load times; the second pass counts).
//! - `pipeline`: `QwenEditPipeline::load`, then the full 4-step edit (`encode_inputs` + `edit`,
//!   instruction 0, seed 0, cfg 1, output `--size`²): first call and median of `--iters`, with the
//!   pipeline's stage times; `encode_inputs` of the input alone (median of 5 after one warm-up);
//!   then for each N of `--variants`: `encode_inputs` once + one `edit` per variant (instruction i,
//!   seed i). `--save DIR` writes the seed-0 image of the first call as raw RGB8 (`edit.rgb`), and
//!   each variant of the largest N as `variant_{i}.rgb` (the per-image comparison of two settings).
//! - `host`: the host's image steps on one thread and on rayon's pool (every core): the edit's
//!   condition-image resize of a `--size`² input (Pillow's Lanczos to `--condition-area`, then the
//!   vision processor's bicubic to a multiple of 28) and an upscale's resample of a ×4 network's
//!   output to ×2 (OpenCV's Lanczos-4, `4·size`² → `2·size`²); median of 5 after 1.
//! - `components`: the transformer alone (one forward at the edit's shapes: the target's and the
//!   reference's tokens of a `--size`² edit and `--txt-len` prompt tokens, sigma 0.9) and the VAE
//!   alone (encode of a `--vae-area` image, decode of a `--size`² latent), untiled.
//! - `--profile-trace PATH`: `components` also records one transformer forward (after the timed
//!   ones) with libtorch's profiler, GPU kernels included, into PATH as a Chrome trace
//!   (`bench/trace_breakdown.py` sorts it into kernel classes, as `bench/profile_qwen.py` does
//!   for diffusers' forward).
//! - `--kernels SPEC` (both modes): the transformer blocks' kernels ([`parse_kernels`]: `aten`,
//!   `all`, or `qk+norm+res+gelu+qkv+fp8` pieces; `nhwc`: the VAE channels-last, `vnorm`: its fused
//!   RMS norm); `--sweep SPECS` (`components`): the step timed under
//!   each spec in one process, twice round, each output compared with the first spec's.
//! - `--config-dir D`: a diffusers-layout folder with the components' `config.json` (the tiny smoke
//!   test's sizes); without it the real model's presets, as the studio's files are loaded.
//! - `--cpu`: fp32 on the CPU (smoke tests with the tiny fixtures' configs from `--config-dir`).
//!
//! Prints one JSON object per line: `{"name": ..., "ms_median": ...}` for repeated calls,
//! `{"name": ..., "s": ...}` for single timings; `t0`/`t1` (Unix seconds) bracket each case so that
//! the driver can attribute sampled GPU memory to it. Every timed call ends with a device
//! synchronize and is measured with the host clock, as the diffusers side is.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tch::{Cuda, Device, Kind, Tensor};
use vnfarm_models::imageops::rgb8_to_tensor;
use vnfarm_models::loading::diffusers::read_config;
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{Fp8Mode, Weights};
use vnfarm_models::nn::fused::NormKernels;
use vnfarm_models::nn::tiling::Tiling;
use vnfarm_models::nn::{AttentionImpl, FfGelu, MemoryFormat, ops};
use vnfarm_models::qwen_image::kernels::BlockKernels;
use vnfarm_models::qwen_image::keys::vae_weight_store;
use vnfarm_models::qwen_image::pipeline::{
    EditRequest, EncodedInputs, QwenEditConfig, QwenEditPipeline, QwenSource, calculate_dimensions,
};
use vnfarm_models::qwen_image::transformer::{
    QwenImageTransformer2DModel, QwenImageTransformerConfig, transformer_store,
};
use vnfarm_models::qwen_image::vae::{QwenVae, QwenVaeConfig};
use vnfarm_models::qwen2_5_vl::processor::{condition_resize, preprocess};
use vnfarm_models::schedulers::FlowMatchConfig;

const STEPS: usize = 4;
const CFG: f64 = 1.0;
/// The components' timestep, as the scheduler gives it (σ · 1000).
const STEP_T: f64 = 900.0;

/// `--cpu` (local smoke tests on tiny models): no CUDA, fp32.
static CPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn on_cpu() -> bool {
    CPU.load(std::sync::atomic::Ordering::Relaxed)
}

fn sync() {
    if !on_cpu() {
        Cuda::synchronize(0);
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn device_kind() -> (Device, Kind) {
    if on_cpu() {
        (Device::Cpu, Kind::Float)
    } else {
        (Device::Cuda(0), Kind::BFloat16)
    }
}

fn median_min_max(mut ts: Vec<f64>) -> (f64, f64, f64) {
    ts.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    (ts[ts.len() / 2], ts[0], ts[ts.len() - 1])
}

/// Times `f` (milliseconds): `warm` untimed calls, then `iters` timed ones.
fn bench<T>(
    name: &str,
    warm: usize,
    iters: usize,
    extra: &str,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<()> {
    let t0 = now();
    for _ in 0..warm {
        drop(f()?);
    }
    sync();
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let out = f()?;
        sync();
        ts.push(t.elapsed().as_secs_f64() * 1e3);
        drop(out);
    }
    let (med, min, max) = median_min_max(ts);
    println!(
        "{{\"name\": \"{name}\", \"ms_median\": {med:.3}, \"ms_min\": {min:.3}, \"ms_max\": {max:.3}, \"iters\": {iters}, \"t0\": {t0:.3}, \"t1\": {:.3}{extra}}}",
        now()
    );
    Ok(())
}

/// Options after the mode.
struct Opts {
    files: Vec<String>,
    transformer: Option<PathBuf>,
    text_encoder: Option<PathBuf>,
    vae: Option<PathBuf>,
    config_dir: Option<PathBuf>,
    fp8: Fp8Mode,
    input: Option<PathBuf>,
    instructions: Option<PathBuf>,
    iters: usize,
    variants: Vec<usize>,
    save: Option<PathBuf>,
    size: u32,
    condition_area: u64,
    vae_area: u64,
    txt_len: i64,
    profile_trace: Option<PathBuf>,
    kernels: BlockKernels,
    /// The VAE's memory order (`nhwc` in `--kernels`).
    vae_format: MemoryFormat,
    /// The VAE's RMS norm kernels (`vnorm` in `--kernels`).
    vae_norm: NormKernels,
    sweep: Vec<(String, BlockKernels)>,
}

/// A `--kernels` spec: `aten` (the portable path), `all`, or pieces joined by `+`: `qk` (q/k
/// RMSNorm + RoPE into the joint buffers), `norm` (LayerNorm + adaLN), `res` (gated residuals),
/// `gelu` (GELU in the FF-up epilogue), `qkv` (fused q/k/v projections), `fp8` (the image
/// stream's fp8 GEMMs; not part of `all`).
fn parse_kernels(spec: &str) -> anyhow::Result<BlockKernels> {
    Ok(parse_spec(spec)?.0)
}

/// The blocks' kernels and the VAE's memory order and norm kernels of a `--kernels` spec (`nhwc`:
/// channels-last VAE, `vnorm`: the VAE's fused RMS norm; not block kernels, the sweep's specs
/// ignore them).
fn parse_spec(spec: &str) -> anyhow::Result<(BlockKernels, MemoryFormat, NormKernels)> {
    let mut k = BlockKernels::default();
    let mut vae = MemoryFormat::Contiguous;
    let mut vae_norm = NormKernels::Aten;
    for piece in spec.split('+') {
        match piece {
            "aten" => {}
            "nhwc" => vae = MemoryFormat::ChannelsLast,
            "vnorm" => vae_norm = NormKernels::Fused,
            "qk" => k.qk_norm_rope = NormKernels::Fused,
            "norm" => k.ada_norm = NormKernels::Fused,
            "res" => k.gated_residual = NormKernels::Fused,
            "gelu" => k.ff_gelu = FfGelu::Epilogue,
            "qkv" => k.fused_qkv = true,
            "fp8" => k.fp8_gemm = true,
            "all" => {
                k = BlockKernels {
                    qk_norm_rope: NormKernels::Fused,
                    ada_norm: NormKernels::Fused,
                    gated_residual: NormKernels::Fused,
                    ff_gelu: FfGelu::Epilogue,
                    fused_qkv: true,
                    fp8_gemm: k.fp8_gemm,
                }
            }
            other => anyhow::bail!("unknown kernel piece {other:?} in {spec:?}"),
        }
    }
    Ok((k, vae, vae_norm))
}

fn parse_opts(args: &[String]) -> anyhow::Result<Opts> {
    let mut o = Opts {
        files: Vec::new(),
        transformer: None,
        text_encoder: None,
        vae: None,
        config_dir: None,
        fp8: Fp8Mode::Upcast,
        input: None,
        instructions: None,
        iters: 3,
        variants: vec![1, 3, 10],
        save: None,
        size: 1024,
        condition_area: 384 * 384,
        vae_area: 1024 * 1024,
        txt_len: 216,
        profile_trace: None,
        kernels: BlockKernels::default(),
        vae_format: MemoryFormat::Contiguous,
        vae_norm: NormKernels::Aten,
        sweep: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--transformer" => o.transformer = Some(val()?.into()),
            "--text-encoder" => o.text_encoder = Some(val()?.into()),
            "--vae" => o.vae = Some(val()?.into()),
            "--config-dir" => o.config_dir = Some(val()?.into()),
            "--fp8" => {
                o.fp8 = match val()?.as_str() {
                    "upcast" => Fp8Mode::Upcast,
                    "resident" => Fp8Mode::Resident,
                    other => anyhow::bail!("unknown fp8 mode {other}"),
                }
            }
            "--input" => o.input = Some(val()?.into()),
            "--instructions" => o.instructions = Some(val()?.into()),
            "--iters" => o.iters = val()?.parse()?,
            "--variants" => {
                o.variants = val()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--save" => o.save = Some(val()?.into()),
            "--size" => o.size = val()?.parse()?,
            "--condition-area" => o.condition_area = val()?.parse()?,
            "--vae-area" => o.vae_area = val()?.parse()?,
            "--txt-len" => o.txt_len = val()?.parse()?,
            "--profile-trace" => o.profile_trace = Some(val()?.into()),
            "--kernels" => (o.kernels, o.vae_format, o.vae_norm) = parse_spec(&val()?)?,
            "--sweep" => {
                o.sweep = val()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| Ok((s.to_string(), parse_kernels(s)?)))
                    .collect::<anyhow::Result<_>>()?
            }
            "--cpu" => CPU.store(true, std::sync::atomic::Ordering::Relaxed),
            _ if a.starts_with("--") => anyhow::bail!("unknown option {a}"),
            _ => o.files.push(a.clone()),
        }
    }
    anyhow::ensure!(o.iters >= 1, "--iters must be at least 1");
    Ok(o)
}

fn required<'a>(p: &'a Option<PathBuf>, flag: &str) -> anyhow::Result<&'a Path> {
    p.as_deref()
        .ok_or_else(|| anyhow::anyhow!("{flag} is required"))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: qwen_bench read <file>... | qwen_bench pipeline --transformer F --text-encoder F --vae F --input PNG --instructions JSON [...] | qwen_bench components --transformer F --vae F [...]";
    let Some((mode, rest)) = args.split_first() else {
        anyhow::bail!(usage);
    };
    let opts = parse_opts(rest)?;
    match mode.as_str() {
        "read" => read_files(&opts.files),
        "pipeline" => pipeline(&opts),
        "components" => components(&opts),
        "host" => host_steps(&opts),
        _ => anyhow::bail!(usage),
    }
}

/// CUDA context created before anything is timed.
fn init_device(opts: &Opts) -> anyhow::Result<()> {
    if !on_cpu() {
        anyhow::ensure!(Cuda::is_available(), "CUDA not available to libtorch");
        let _ = Tensor::zeros([1], (Kind::BFloat16, Device::Cuda(0)));
        sync();
    }
    println!(
        "{{\"name\": \"config\", \"fp8\": \"{:?}\", \"cpu\": {}, \"alloc_conf\": \"{}\"}}",
        opts.fp8,
        on_cpu(),
        std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default()
    );
    Ok(())
}

fn read_files(files: &[String]) -> anyhow::Result<()> {
    use std::io::Read;
    let mut buf = vec![0u8; 64 << 20];
    for pass in 0..2 {
        let t0 = now();
        let t = Instant::now();
        let mut total = 0usize;
        for f in files {
            let mut file = std::fs::File::open(f)?;
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                total += n;
            }
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{{\"name\": \"read_files_pass{pass}\", \"s\": {s:.3}, \"bytes\": {total}, \"gb_per_s\": {:.2}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
            total as f64 / s / 1e9,
            now()
        );
    }
    Ok(())
}

fn pipeline(opts: &Opts) -> anyhow::Result<()> {
    init_device(opts)?;
    let (dev, dt) = device_kind();
    let instructions_json =
        std::fs::read_to_string(required(&opts.instructions, "--instructions")?)?;
    let instructions: Vec<String> = serde_json::from_str(&instructions_json)?;
    anyhow::ensure!(!instructions.is_empty(), "no instructions");
    let input = image::open(required(&opts.input, "--input")?)?.to_rgb8();

    let source = QwenSource::Files {
        transformer: required(&opts.transformer, "--transformer")?.into(),
        text_encoder: required(&opts.text_encoder, "--text-encoder")?.into(),
        vae: required(&opts.vae, "--vae")?.into(),
        config_dir: opts.config_dir.clone(),
    };
    let mut cfg = QwenEditConfig::new(source, dev);
    cfg.dtype = dt;
    cfg.vae_dtype = dt;
    cfg.settings.fp8 = opts.fp8;
    cfg.settings.attention = AttentionImpl::Sdpa;
    let k = opts.kernels;
    cfg.settings.qk_norm_rope = k.qk_norm_rope;
    cfg.settings.ada_norm = k.ada_norm;
    cfg.settings.gated_residual = k.gated_residual;
    cfg.settings.ff_gelu = k.ff_gelu;
    cfg.settings.fused_qkv = k.fused_qkv;
    cfg.settings.fp8_gemm = k.fp8_gemm;
    cfg.settings.vae_memory_format = opts.vae_format;
    cfg.settings.vae_norm = opts.vae_norm;
    println!(
        "{{\"name\": \"settings\", \"settings\": {}}}",
        serde_json::to_string(&cfg.settings)?
    );
    cfg.loras = Vec::new();
    // diffusers 0.42.1 with transformers >= 5.15 (the GPU machine has 5.17) feeds the text encoder
    // sequential positions; the same here, so the images are comparable (no speed difference).
    cfg.positions = vnfarm_models::qwen2_5_vl::rope::PositionMode::Sequential;
    // Qwen-Image-Lightning's scheduler, as the diffusers side (run_qwen_bench.py LIGHTNING_SCHEDULER).
    cfg.scheduler = Some(FlowMatchConfig::qwen_image_lightning());
    cfg.max_batch = 1;
    cfg.vae_tiling = Tiling::Never; // diffusers decodes untiled
    cfg.condition_image_area = opts.condition_area;
    cfg.vae_image_area = opts.vae_area;

    let t0 = now();
    let t = Instant::now();
    let pipe = QwenEditPipeline::load(&cfg)?;
    sync();
    let parts: Vec<String> = pipe
        .load_times()
        .iter()
        .map(|(part, s)| format!("\"{part}\": {s:.3}"))
        .collect();
    println!(
        "{{\"name\": \"pipeline_load\", \"s\": {:.3}, \"parts_s\": {{{}}}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        parts.join(", "),
        now()
    );

    let inputs = [input];
    let request = |i: usize| EditRequest {
        instruction: instructions[i % instructions.len()].clone(),
        seed: i as u64,
        steps: STEPS,
        cfg: CFG,
        size: Some((opts.size, opts.size)),
    };
    let edit_once = |encoded: &EncodedInputs, i: usize| {
        pipe.edit(encoded, &[request(i)], &mut |_, _| {}, &|| false)
    };

    // Full edit: encode_inputs + edit, as one diffusers pipeline call does both.
    let t0 = now();
    let run = || -> anyhow::Result<(f64, image::RgbImage, [f64; 3])> {
        let t = Instant::now();
        let encoded = pipe.encode_inputs(&inputs)?;
        let (mut images, times) = edit_once(&encoded, 0)?;
        sync();
        let s = t.elapsed().as_secs_f64();
        anyhow::ensure!(images.len() == 1, "edit returned {} images", images.len());
        Ok((
            s,
            images.remove(0),
            [times.encode_prompt, times.denoise, times.decode],
        ))
    };
    let (first, image, first_times) = run()?;
    let mut saved = String::new();
    if let Some(dir) = &opts.save {
        std::fs::create_dir_all(dir)?;
        let p = dir.join("edit.rgb");
        std::fs::write(&p, image.as_raw())?;
        saved = format!(
            ", \"saved\": \"{}\", \"width\": {}, \"height\": {}",
            p.display(),
            image.width(),
            image.height()
        );
    }
    let mut ts = Vec::with_capacity(opts.iters);
    let mut stages = Vec::with_capacity(opts.iters);
    for _ in 0..opts.iters {
        let (s, _, st) = run()?;
        ts.push(s);
        stages.push(st);
    }
    let (med, min, max) = median_min_max(ts);
    let stage_median = |k: usize| median_min_max(stages.iter().map(|s| s[k]).collect()).0 * 1e3;
    println!(
        "{{\"name\": \"edit\", \"first_s\": {first:.3}, \"s_median\": {med:.3}, \"s_min\": {min:.3}, \"s_max\": {max:.3}, \"iters\": {}, \"steps\": {STEPS}, \
\"encode_prompt_ms\": {:.3}, \"denoise_ms\": {:.3}, \"denoise_step_ms\": {:.3}, \"decode_ms\": {:.3}, \
\"first_encode_prompt_ms\": {:.3}, \"first_denoise_ms\": {:.3}, \"first_decode_ms\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}{saved}}}",
        opts.iters,
        stage_median(0),
        stage_median(1),
        stage_median(1) / STEPS as f64,
        stage_median(2),
        first_times[0] * 1e3,
        first_times[1] * 1e3,
        first_times[2] * 1e3,
        now()
    );

    // The input set's encode alone (vision tower + VAE encode), after the first edit.
    bench("encode_inputs", 1, 5, "", || {
        Ok(pipe.encode_inputs(&inputs)?)
    })?;
    // Its parts, one after another: the condition image's host work (the Lanczos resize, then the
    // processor's bicubic resize, rescale and patches), the vision tower on those patches, and the
    // VAE's part (the RGB8 upload and conversion, the encode).
    let te = pipe.text_encoder();
    bench("encode_part.condition_host", 1, 5, "", || {
        let resized = condition_resize(&inputs[0], &te.processor)?;
        Ok(preprocess(std::slice::from_ref(&resized), &te.processor)?)
    })?;
    let processed = preprocess(
        &[condition_resize(&inputs[0], &te.processor)?],
        &te.processor,
    )?;
    bench("encode_part.vision_tower", 1, 5, "", || {
        Ok(te.encode_pixel_values(&processed.pixel_values, &processed.grid_thw)?)
    })?;
    bench("encode_part.vae", 1, 5, "", || {
        let x = rgb8_to_tensor(&inputs[0], pipe.config().device, pipe.config().vae_dtype);
        Ok(pipe.vae().encode_mean(&x)?)
    })?;

    // N variants of one input: the input set encoded once, then one edit per variant.
    let most = opts.variants.iter().copied().max().unwrap_or(0);
    for &n in &opts.variants {
        let t0 = now();
        let t = Instant::now();
        let encoded = pipe.encode_inputs(&inputs)?;
        sync();
        let encode_s = t.elapsed().as_secs_f64();
        let mut per = Vec::with_capacity(n);
        for i in 0..n {
            let tv = Instant::now();
            let (images, _) = edit_once(&encoded, i)?;
            sync();
            anyhow::ensure!(images.len() == 1, "edit returned {} images", images.len());
            per.push(format!("{:.3}", tv.elapsed().as_secs_f64()));
            if let Some(dir) = opts.save.as_ref().filter(|_| n == most) {
                std::fs::write(dir.join(format!("variant_{i}.rgb")), images[0].as_raw())?;
            }
        }
        println!(
            "{{\"name\": \"variants_{n}\", \"s\": {:.3}, \"encode_s\": {encode_s:.3}, \"per_variant_s\": [{}], \"t0\": {t0:.3}, \"t1\": {:.3}}}",
            t.elapsed().as_secs_f64(),
            per.join(", "),
            now()
        );
    }
    Ok(())
}

/// The transformer step under each `--sweep` setting, twice over in order (A B C … A B C …, so
/// that a drift of the GPU's clock shows as a difference between the rounds), each forward's
/// output compared with the first setting's: max and mean |difference| over its mean |value|.
fn kernel_sweep(
    transformer: &mut QwenImageTransformer2DModel,
    opts: &Opts,
    (hs, txt, timestep): (&Tensor, &Tensor, &Tensor),
    shapes: &[(i64, i64, i64)],
) -> anyhow::Result<()> {
    let mut reference: Option<Tensor> = None;
    for round in 0..2 {
        for (name, kernels) in &opts.sweep {
            transformer
                .set_block_kernels(*kernels)
                .map_err(anyhow::Error::msg)?;
            let out = transformer
                .forward(hs, txt, None, timestep, shapes)?
                .to_kind(Kind::Float);
            let agreement = match &reference {
                None => {
                    reference = Some(out.shallow_clone());
                    String::new()
                }
                Some(r) => {
                    let scale = r.abs().mean(Kind::Float).double_value(&[]);
                    let d = (&out - r).abs();
                    format!(
                        ", \"vs_first_max\": {:.4e}, \"vs_first_mean\": {:.4e}",
                        d.max().double_value(&[]) / scale,
                        d.mean(Kind::Float).double_value(&[]) / scale
                    )
                }
            };
            drop(out);
            bench(
                &format!("transformer_step_sweep.r{round}.{name}"),
                2,
                5,
                &format!(", \"round\": {round}, \"kernels\": \"{name}\"{agreement}"),
                || Ok(transformer.forward(hs, txt, None, timestep, shapes)?),
            )?;
            // The pipeline's step: the schedule's modulations made once (`forward_step`).
            let modulations = transformer.step_modulations(&[STEP_T], hs.kind());
            bench(
                &format!("transformer_step_sweep.r{round}.{name}.precomputed"),
                2,
                5,
                &format!(
                    ", \"round\": {round}, \"kernels\": \"{name}\", \"modulations\": \"precomputed\""
                ),
                || Ok(transformer.forward_step(hs, txt, None, &modulations, 0, shapes)?),
            )?;
        }
    }
    Ok(())
}

/// See `host` in the file header.
fn host_steps(opts: &Opts) -> anyhow::Result<()> {
    use vnfarm_models::imageops::lanczos4::{Layout, resize_u8};
    use vnfarm_models::imageops::{Filter, resize};
    // Host work only: no device to synchronise.
    CPU.store(true, std::sync::atomic::Ordering::Relaxed);
    let side = opts.size;
    let pattern = |s: u32| {
        image::RgbImage::from_fn(s, s, |x, y| {
            image::Rgb([
                (x * 7 % 256) as u8,
                (y * 5 % 256) as u8,
                ((x ^ y) % 256) as u8,
            ])
        })
    };
    let input = pattern(side);
    let network_out = pattern(4 * side).into_raw();
    let (cw, ch) = calculate_dimensions(opts.condition_area, 1.0);
    // The processor's `smart_resize` of the condition image: each side to a multiple of 28.
    let round28 = |v: u32| (((f64::from(v) / 28.0).round() as u32) * 28).max(28);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let threads = rayon::current_num_threads();
    for (label, pool) in [("one_thread", Some(&one)), ("pool", None)] {
        let run = |f: &mut (dyn FnMut() -> anyhow::Result<()> + Send)| match pool {
            Some(p) => p.install(f),
            None => f(),
        };
        let extra = format!(
            ", \"threads\": {}",
            if pool.is_some() { 1 } else { threads }
        );
        bench(
            &format!("host_condition_resize.{label}"),
            1,
            5,
            &format!("{extra}, \"from\": {side}, \"to\": [{cw}, {ch}]"),
            || {
                run(&mut || {
                    let c = resize(&input, cw, ch, Filter::Lanczos)?;
                    drop(resize(&c, round28(cw), round28(ch), Filter::Bicubic)?);
                    Ok(())
                })
            },
        )?;
        let layout = Layout {
            width: 4 * side as usize,
            height: 4 * side as usize,
            channels: 3,
        };
        bench(
            &format!("host_upscale_resample.{label}"),
            1,
            5,
            &format!("{extra}, \"from\": {}, \"to\": {}", 4 * side, 2 * side),
            || {
                run(&mut || {
                    let to = 2 * side as usize;
                    drop(resize_u8(&network_out, layout, to, to));
                    Ok(())
                })
            },
        )?;
    }
    Ok(())
}

fn components(opts: &Opts) -> anyhow::Result<()> {
    init_device(opts)?;
    let (dev, dt) = device_kind();
    let _guard = tch::no_grad_guard();

    // Transformer alone.
    let t0 = now();
    let t = Instant::now();
    let tcfg = match &opts.config_dir {
        Some(d) => read_config(
            &d.join("transformer/config.json"),
            QwenImageTransformerConfig::from_json,
        )?,
        None => QwenImageTransformerConfig::qwen_image_edit_2509(),
    };
    let file = Arc::new(SafetensorsFile::open(required(
        &opts.transformer,
        "--transformer",
    )?)?);
    let tw = Weights::new(
        Arc::new(transformer_store(file).with_fp8(opts.fp8)),
        dev,
        dt,
    );
    let mut transformer = QwenImageTransformer2DModel::new(&tw, &tcfg, AttentionImpl::Sdpa)?;
    transformer
        .set_block_kernels(opts.kernels)
        .map_err(anyhow::Error::msg)?;
    sync();
    println!(
        "{{\"name\": \"transformer_load\", \"s\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        now()
    );

    // VAE alone.
    let t0 = now();
    let t = Instant::now();
    let vcfg = match &opts.config_dir {
        Some(d) => read_config(&d.join("vae/config.json"), QwenVaeConfig::from_json)?,
        None => QwenVaeConfig::qwen_image(),
    };
    let vae_store = vae_weight_store(required(&opts.vae, "--vae")?, vcfg.num_res_blocks)?;
    let mut vae = QwenVae::new(&Weights::new(Arc::new(vae_store), dev, dt), &vcfg)?
        .with_tiling(Tiling::Never);
    sync();
    println!(
        "{{\"name\": \"vae_load\", \"s\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        now()
    );

    // The edit's shapes: target tokens of a size² output, reference tokens of the VAE copy.
    let f = vae.config().spatial_compression_ratio();
    let size = i64::from(opts.size);
    let (vw, vh) = calculate_dimensions(opts.vae_area, 1.0);
    let (vw, vh) = (i64::from(vw), i64::from(vh));
    let target = (1, size / f / 2, size / f / 2);
    let reference = (1, vh / f / 2, vw / f / 2);
    let tokens = target.1 * target.2 + reference.1 * reference.2;
    tch::manual_seed(0);
    let hs = Tensor::randn([1, tokens, tcfg.in_channels], (dt, dev));
    let txt = Tensor::randn([1, opts.txt_len, tcfg.joint_attention_dim], (dt, dev));
    let timestep = Tensor::full([1], STEP_T, (dt, dev)) / 1000.0;
    let shapes = [target, reference];
    bench(
        "transformer_step",
        2,
        5,
        &format!(
            ", \"tokens\": [{}, {}, {}]",
            target.1 * target.2,
            reference.1 * reference.2,
            opts.txt_len
        ),
        || Ok(transformer.forward(&hs, &txt, None, &timestep, &shapes)?),
    )?;
    let modulations = transformer.step_modulations(&[STEP_T], dt);
    bench(
        "transformer_step_precomputed",
        2,
        5,
        ", \"modulations\": \"precomputed\"",
        || Ok(transformer.forward_step(&hs, &txt, None, &modulations, 0, &shapes)?),
    )?;
    drop(modulations);
    if !opts.sweep.is_empty() {
        kernel_sweep(&mut transformer, opts, (&hs, &txt, &timestep), &shapes)?;
        transformer
            .set_block_kernels(opts.kernels)
            .map_err(anyhow::Error::msg)?;
    }
    if let Some(path) = &opts.profile_trace {
        // One forward after the timed ones, every kernel recorded.
        sync();
        ops::profile_start(dev.is_cuda()).map_err(anyhow::Error::msg)?;
        let t = Instant::now();
        drop(transformer.forward(&hs, &txt, None, &timestep, &shapes)?);
        sync();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ops::profile_stop(path).map_err(anyhow::Error::msg)?;
        println!(
            "{{\"name\": \"transformer_step_profile\", \"ms\": {ms:.3}, \"trace\": \"{}\"}}",
            path.display()
        );
    }
    drop((hs, txt, timestep, transformer));
    sync();

    let x = Tensor::rand([1, 3, vh, vw], (dt, dev)) * 2.0 - 1.0;
    let z = Tensor::randn([1, vcfg.z_dim, size / f, size / f], (dt, dev));
    // The mode's VAE settings first (the rows the table reads), then every other memory order and
    // norm kernel (the fused norm on the GPU only), each output compared with the first's.
    let mine = (opts.vae_format, opts.vae_norm);
    let mut variants = vec![mine];
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        for norm in [NormKernels::Aten, NormKernels::Fused] {
            if (format, norm) != mine && (norm == NormKernels::Aten || dev.is_cuda()) {
                variants.push((format, norm));
            }
        }
    }
    let mut first: Option<(Tensor, Tensor)> = None;
    for (i, &(format, norm)) in variants.iter().enumerate() {
        vae.set_memory_format(format);
        vae.set_norm_kernels(norm).map_err(anyhow::Error::msg)?;
        let suffix = if i == 0 {
            String::new()
        } else {
            format!(".{format:?}.{norm:?}")
        };
        let encoded = vae.encode_mean(&x)?.to_kind(Kind::Float);
        let decoded = vae.decode(&z)?.to_kind(Kind::Float);
        let agreement = match &first {
            None => String::new(),
            Some((e, d)) => format!(
                ", \"encode_vs_first_max\": {:.4e}, \"decode_vs_first_max\": {:.4e}",
                (&encoded - e).abs().max().double_value(&[]),
                (&decoded - d).abs().max().double_value(&[])
            ),
        };
        if first.is_none() {
            first = Some((encoded, decoded));
        }
        let what = format!("\"format\": \"{format:?}\", \"norm\": \"{norm:?}\"{agreement}");
        bench(
            &format!("vae_encode{suffix}"),
            2,
            5,
            &format!(", \"size\": [{vw}, {vh}], {what}"),
            || Ok(vae.encode_mean(&x)?),
        )?;
        bench(
            &format!("vae_decode{suffix}"),
            2,
            5,
            &format!(", \"size\": [{size}, {size}], {what}"),
            || Ok(vae.decode(&z)?),
        )?;
    }
    Ok(())
}
