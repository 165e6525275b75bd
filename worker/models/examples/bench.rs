//! GPU benchmark of the SDXL engine at real size (SDXL base configs), bf16, SDPA attention.
//!
//! Weights come from diffusers-format files with random values written by `bench/run_bench.py`,
//! which also times diffusers on the same weights and GPU:
//!
//! ```sh
//! bench components <unet .safetensors> <vae .safetensors> [--loader L] [--vae-only|--unet-only]
//!                  [--vae-budget-mib N] [--vae-memory-format channels_last|contiguous]
//! bench pipeline <diffusers folder> [--loader L] [--tiling never|auto] [--cases a,b]
//!                [--iters N] [--save DIR] [--load-only] [--sequential-load] [--vae-budget-mib N]
//!                [--cuda-graphs]
//! (both take [--ff-gelu-epilogue])
//! bench read <file>...
//! ```
//!
//! - `components`: UNet and VAE load, UNet forward (CFG batch 2, batch 8) eager and replayed from
//!   a CUDA graph (`unet_graph_*`, with the capture's time and the largest difference from the
//!   eager output on the same inputs), VAE decode/encode; the
//!   VAE decode untiled, seam-free tiled (`decode_tiled` planned for a 2048 MiB budget, and with
//!   exact statistics at 1920×1080) and diffusers-tiled at 1216×832, 1920×1080 and 2048², each
//!   tiled image compared with the untiled one as RGB8 (`mae`, `max` in 1/255).
//! - `pipeline`: `SdxlPipeline::load` of the whole folder, then `generate` (Euler, 20 steps, cfg 4.5,
//!   prompt + negative prompt): 1024² first call and steady state, 1920×1080, 4 images at 1024².
//!   `--save DIR` writes the first image of some cases as raw RGB8 (`<case>.rgb`, with its size in
//!   the JSON line) for comparison with diffusers.
//! - `read`: reads the files from start to end into one 64 MiB buffer, twice (the page-cache read
//!   baseline for load times).
//! - `--loader staged|direct`: [`vnfarm_models::loading::safetensors::LoadPath`].
//! - `--cases a,b`: only these `pipeline` cases, in this order (default: all).
//! - `--cuda-graphs`: `pipeline` with `PipelineConfig::cuda_graphs` (the UNet forward replayed from a
//!   CUDA graph; the first call of each size captures it).
//! - `--profile-trace PATH`: `components` also records one batch-8 UNet forward with libtorch's
//!   profiler (GPU kernels included) into PATH as a Chrome trace (`profile_unet.py --trace` sorts
//!   it into the categories of diffusers' profile).
//! - `--unet-channels-last`: the UNet NHWC (`set_memory_format`; components and pipeline).
//! - `--norm-kernels-fused`: the UNet's normalisations as our fused kernels (`NormKernels::Fused`;
//!   components: the UNet cases, each also compared with libtorch's normalisations on the same
//!   inputs; pipeline: `PipelineConfig::norm_kernels`).
//! - `--norms-check`: `components` first checks each fused kernel against an fp32 reference at the
//!   SDXL UNet's shapes (beside libtorch's bf16 operators, whose error it must not exceed by much;
//!   the process fails otherwise) and times both.
//! - `--ff-gelu-epilogue`: the UNet's feed-forward GELU in the matmul's epilogue
//!   (`FfGelu::Epilogue`; components: the UNet cases, pipeline: `PipelineConfig::ff_gelu`).
//! - `--cpu`: fp32 on the CPU at 64–96 px (`pipeline` only; smoke tests of the driver with tiny models).
//!
//! Prints one JSON object per line: `{"name": ..., "ms_median": ..., "ms_min": ..., "ms_max": ...}`
//! for repeated calls, `{"name": ..., "s": ...}` for single timings; `t0`/`t1` are the case's start
//! and end (Unix seconds) so that the driver can attribute sampled GPU memory to cases. Timing:
//! warm-up calls, then each timed call is bracketed by `cuda synchronize` and a host clock.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tch::{Cuda, Device, Kind, Tensor};
use vnfarm_models::loading::safetensors::{self, LoadPath, SafetensorsFile};
use vnfarm_models::loading::weights::{WeightStore, Weights};
use vnfarm_models::nn::cuda_graph;
use vnfarm_models::nn::fused::{self, NormKernels};
use vnfarm_models::nn::{AttentionImpl, FfGelu, GroupNorm, LayerNorm, MemoryFormat, ops};
use vnfarm_models::schedulers::Sampler;
use vnfarm_models::sdxl::pipeline::{GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline};
use vnfarm_models::sdxl::unet::{AddedCond, UNet2DConditionModel, UNetConfig};
use vnfarm_models::sdxl::unet_graph::GraphedUNet;
use vnfarm_models::sdxl::vae::{AutoencoderKL, TiledDecode, Tiling, VaeConfig, VaeRuntime};
use vnfarm_models::text::clip_tokenizer::ClipTokenizer;

/// Prompts of both sides (`run_bench.py` uses the same strings).
const PROMPT: &str = "a photograph of an astronaut riding a horse on the surface of the moon, \
    earth in the sky, highly detailed, sharp focus, dramatic lighting";
const NEGATIVE: &str = "blurry, low quality, watermark, text, deformed";
const CFG: f64 = 4.5;
const STEPS: usize = 20;

/// `--cpu` (local smoke tests on small models): no CUDA, fp32.
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

fn median_min_max(mut ts: Vec<f64>) -> (f64, f64, f64) {
    ts.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    (ts[ts.len() / 2], ts[0], ts[ts.len() - 1])
}

fn bench(name: &str, warm: usize, iters: usize, mut f: impl FnMut() -> Tensor) {
    let t0 = now();
    for _ in 0..warm {
        let _ = f();
    }
    sync();
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let out = f();
        sync();
        ts.push(t.elapsed().as_secs_f64() * 1e3);
        drop(out);
    }
    let (med, min, max) = median_min_max(ts);
    println!(
        "{{\"name\": \"{name}\", \"ms_median\": {med:.3}, \"ms_min\": {min:.3}, \"ms_max\": {max:.3}, \"iters\": {iters}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        now()
    );
}

fn store(path: &str) -> anyhow::Result<Arc<WeightStore>> {
    let file = Arc::new(SafetensorsFile::open(path)?);
    Ok(Arc::new(WeightStore::identity(file)))
}

/// Options after the positional arguments.
struct Opts {
    loader: String,
    tiling: Tiling,
    iters: usize,
    save: Option<PathBuf>,
    load_only: bool,
    sequential_load: bool,
    cases: Option<Vec<String>>,
    vae_budget_mib: Option<u32>,
    vae_memory_format: MemoryFormat,
    vae_only: bool,
    unet_only: bool,
    cuda_graphs: bool,
    ff_gelu: FfGelu,
    profile_trace: Option<PathBuf>,
    unet_memory_format: MemoryFormat,
    norm_kernels: NormKernels,
    norms_check: bool,
}

fn parse_opts(args: &[String]) -> anyhow::Result<(Vec<String>, Opts)> {
    let mut pos = Vec::new();
    let mut o = Opts {
        loader: "staged".into(),
        tiling: Tiling::Never,
        iters: 5,
        save: None,
        load_only: false,
        sequential_load: false,
        cases: None,
        vae_budget_mib: None,
        vae_memory_format: MemoryFormat::ChannelsLast,
        vae_only: false,
        unet_only: false,
        cuda_graphs: false,
        ff_gelu: FfGelu::Separate,
        profile_trace: None,
        unet_memory_format: MemoryFormat::Contiguous,
        norm_kernels: NormKernels::Aten,
        norms_check: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--loader" => o.loader = val()?,
            "--tiling" => {
                o.tiling = match val()?.as_str() {
                    "never" => Tiling::Never,
                    "auto" => Tiling::Auto,
                    "always" => Tiling::Always,
                    other => anyhow::bail!("unknown tiling {other}"),
                }
            }
            "--iters" => o.iters = val()?.parse()?,
            "--save" => o.save = Some(PathBuf::from(val()?)),
            "--load-only" => o.load_only = true,
            "--sequential-load" => o.sequential_load = true,
            "--cases" => o.cases = Some(val()?.split(',').map(str::to_string).collect()),
            "--cpu" => CPU.store(true, std::sync::atomic::Ordering::Relaxed),
            "--vae-budget-mib" => o.vae_budget_mib = Some(val()?.parse()?),
            "--vae-only" => o.vae_only = true,
            "--vae-memory-format" => {
                o.vae_memory_format = match val()?.as_str() {
                    "channels_last" => MemoryFormat::ChannelsLast,
                    "contiguous" => MemoryFormat::Contiguous,
                    other => anyhow::bail!("unknown memory format {other}"),
                }
            }
            "--unet-only" => o.unet_only = true,
            "--cuda-graphs" => o.cuda_graphs = true,
            "--ff-gelu-epilogue" => o.ff_gelu = FfGelu::Epilogue,
            "--profile-trace" => o.profile_trace = Some(PathBuf::from(val()?)),
            "--unet-channels-last" => o.unet_memory_format = MemoryFormat::ChannelsLast,
            "--norm-kernels-fused" => o.norm_kernels = NormKernels::Fused,
            "--norms-check" => o.norms_check = true,
            _ if a.starts_with("--") => anyhow::bail!("unknown option {a}"),
            _ => pos.push(a.clone()),
        }
    }
    Ok((pos, o))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench components <unet.safetensors> <vae.safetensors> | bench pipeline <folder> | bench read <file>...";
    let Some((mode, rest)) = args.split_first() else {
        anyhow::bail!(usage);
    };
    let (pos, opts) = parse_opts(rest)?;
    match mode.as_str() {
        "read" => read_files(&pos),
        "components" => {
            anyhow::ensure!(pos.len() == 2, usage);
            components(&pos[0], &pos[1], &opts)
        }
        "pipeline" => {
            anyhow::ensure!(pos.len() == 1, usage);
            pipeline(Path::new(&pos[0]), &opts)
        }
        _ => anyhow::bail!(usage),
    }
}

/// Start of a CUDA run: context created, so that it is not counted in load times.
/// `--loader`: the only use of the library's loader option, so that the benchmark builds against
/// the library before it with this body replaced (the `base` binary of docs/performance.md).
fn set_loader(name: &str) -> anyhow::Result<()> {
    safetensors::set_load_path(match name {
        "staged" => LoadPath::Staged,
        "direct" => LoadPath::Direct,
        other => anyhow::bail!("unknown loader {other}"),
    });
    Ok(())
}

fn init_cuda(opts: &Opts) -> anyhow::Result<()> {
    set_loader(&opts.loader)?;
    if !on_cpu() {
        anyhow::ensure!(Cuda::is_available(), "CUDA not available to libtorch");
        let _ = Tensor::zeros([1], (Kind::BFloat16, Device::Cuda(0)));
        sync();
    }
    println!(
        "{{\"name\": \"config\", \"loader\": \"{}\", \"tiling\": \"{:?}\", \"alloc_conf\": \"{}\", \"vae_budget_mib\": {:?}, \"vae_memory_format\": \"{:?}\", \"cuda_graphs\": {}, \"cuda_graphs_built_in\": {}}}",
        opts.loader,
        opts.tiling,
        std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default(),
        opts.vae_budget_mib,
        opts.vae_memory_format,
        opts.cuda_graphs,
        cuda_graph::built_in(),
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

fn pipeline(dir: &Path, opts: &Opts) -> anyhow::Result<()> {
    init_cuda(opts)?;
    let (dev, dt) = if on_cpu() {
        (Device::Cpu, Kind::Float)
    } else {
        (Device::Cuda(0), Kind::BFloat16)
    };
    let mut cfg = PipelineConfig::new(ModelSource::DiffusersFolder(dir.into()), dev);
    cfg.dtype = dt;
    cfg.vae_dtype = dt;
    cfg.vae_tiling = opts.tiling;
    cfg.parallel_load = !opts.sequential_load;
    cfg.settings.attention = AttentionImpl::Sdpa;
    cfg.settings.cuda_graphs = opts.cuda_graphs;
    cfg.settings.ff_gelu = opts.ff_gelu;
    cfg.settings.unet_memory_format = opts.unet_memory_format;
    cfg.settings.norm_kernels = opts.norm_kernels;
    if let Some(mib) = opts.vae_budget_mib {
        cfg.settings.vae_memory_budget_mib = mib;
    }
    // What the tokenizers alone cost to parse (part of the load below).
    let t = Instant::now();
    for (sub, pad) in [("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")] {
        ClipTokenizer::from_dir(&dir.join(sub), pad)?;
    }
    println!(
        "{{\"name\": \"tokenizers_parse\", \"s\": {:.3}}}",
        t.elapsed().as_secs_f64()
    );
    let t0 = now();
    let t = Instant::now();
    let pipe = SdxlPipeline::load(&cfg)?;
    sync();
    println!(
        "{{\"name\": \"pipeline_load\", \"s\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        now()
    );
    if opts.load_only {
        return Ok(());
    }

    let half = opts.iters.div_ceil(2).max(1);
    let mut cases: [(&str, u32, u32, usize, usize); 4] = [
        ("gen_1024", 1024, 1024, 1, opts.iters),
        ("gen_1920x1080", 1920, 1080, 1, half),
        ("gen_1024_x4", 1024, 1024, 4, half),
        // Only when asked for (`--cases gen_2048`): the VAE tiling question at 2048².
        ("gen_2048", 2048, 2048, 1, half),
    ];
    if on_cpu() {
        // Smoke-test sizes for tiny models (same as run_bench.py --cpu).
        for (c, (w, h)) in cases
            .iter_mut()
            .zip([(64, 64), (96, 64), (64, 64), (128, 128)])
        {
            (c.1, c.2) = (w, h);
        }
    }
    let selected: Vec<_> = match &opts.cases {
        None => cases[..3].to_vec(),
        Some(names) => names
            .iter()
            .map(|n| {
                cases
                    .iter()
                    .find(|c| c.0 == n)
                    .copied()
                    .ok_or_else(|| anyhow::anyhow!("unknown case {n}"))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    for (name, width, height, count, iters) in selected {
        let req = GenerateRequest {
            prompt: PROMPT.into(),
            negative_prompt: NEGATIVE.into(),
            width,
            height,
            steps: STEPS,
            cfg: CFG,
            sampler: Sampler::Euler,
            seed: 0,
            count,
        };
        let t0 = now();
        let run = || -> anyhow::Result<(f64, Vec<image::RgbImage>)> {
            let t = Instant::now();
            let images = pipe.generate(&req, &mut |_, _| {}, &|| false)?;
            sync();
            Ok((t.elapsed().as_secs_f64(), images))
        };
        let (first, images) = run()?;
        anyhow::ensure!(images.len() == count, "{name}: {} images", images.len());
        let mut saved = String::new();
        if let Some(dir) = &opts.save {
            std::fs::create_dir_all(dir)?;
            let p = dir.join(format!("{name}.rgb"));
            std::fs::write(&p, images[0].as_raw())?;
            saved = format!(
                ", \"saved\": \"{}\", \"width\": {}, \"height\": {}",
                p.display(),
                images[0].width(),
                images[0].height()
            );
        }
        let mut ts = Vec::with_capacity(iters);
        for _ in 0..iters {
            ts.push(run()?.0);
        }
        let (med, min, max) = median_min_max(ts);
        println!(
            "{{\"name\": \"{name}\", \"first_s\": {first:.3}, \"s_median\": {med:.3}, \"s_min\": {min:.3}, \"s_max\": {max:.3}, \"iters\": {iters}, \"t0\": {t0:.3}, \"t1\": {:.3}{saved}}}",
            now()
        );
    }
    Ok(())
}

fn components(unet_path: &str, vae_path: &str, opts: &Opts) -> anyhow::Result<()> {
    init_cuda(opts)?;
    let dev = Device::Cuda(0);
    let dt = Kind::BFloat16;
    let imp = AttentionImpl::Sdpa;
    let _guard = tch::no_grad_guard();
    let weights =
        |path: &str| -> anyhow::Result<Weights> { Ok(Weights::new(store(path)?, dev, dt)) };

    if opts.norms_check {
        norms_check(dev)?;
    }
    if !opts.vae_only {
        unet_cases(&weights(unet_path)?, imp, opts)?;
    }
    if opts.unet_only {
        return Ok(());
    }

    let t0 = now();
    let t = Instant::now();
    let vae_cfg = VaeConfig::sdxl();
    let vae = AutoencoderKL::new(&weights(vae_path)?, &vae_cfg, imp)?.with_runtime(VaeRuntime {
        memory_budget_mib: opts.vae_budget_mib.unwrap_or(2048),
        memory_format: opts.vae_memory_format,
    });
    sync();
    println!(
        "{{\"name\": \"vae_load\", \"s\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        now()
    );
    bench("vae_decode_1024", 2, 5, || {
        vae.decode(&Tensor::randn([1, 4, 128, 128], (dt, dev)), Tiling::Never)
    });
    // Increasing sizes, so that each case's window of the sampled GPU memory shows its own peak.
    for (size, h, w) in [
        ("1216x832", 104, 152),
        ("1920x1080", 135, 240),
        ("2048", 256, 256),
    ] {
        vae_tiling_cases(&vae, size, h, w, dt, dev);
    }
    let x = Tensor::randn([1, 3, 1024, 1024], (dt, dev));
    bench("vae_encode_1024", 2, 5, || {
        vae.encode(&x, Tiling::Never).mean
    });
    Ok(())
}

/// UNet load and forwards (CFG batch 2 at 1024² and 1280×720, batch 8 at 1024²), eager and
/// replayed from a CUDA graph, with the SDPA backend libtorch picks for each attention shape.
fn unet_cases(w: &Weights, imp: AttentionImpl, opts: &Opts) -> anyhow::Result<()> {
    let ff_gelu = opts.ff_gelu;
    let (dev, dt) = (w.device, w.kind);
    let t0 = now();
    let t = Instant::now();
    let mut unet = UNet2DConditionModel::new(w, &UNetConfig::sdxl_base(), imp)?;
    unet.set_ff_gelu(ff_gelu);
    unet.set_memory_format(opts.unet_memory_format);
    if opts.norm_kernels == NormKernels::Fused {
        fused::prepare(dev).map_err(anyhow::Error::msg)?;
    }
    unet.set_norm_kernels(opts.norm_kernels);
    sync();
    println!(
        "{{\"name\": \"unet_load\", \"s\": {:.3}, \"t0\": {t0:.3}, \"t1\": {:.3}}}",
        t.elapsed().as_secs_f64(),
        now()
    );
    // 0 math, 1 flash, 2 memory-efficient, 3 cuDNN (at::SDPBackend).
    for (heads, lq, lk) in [
        (10, 4096, 4096),
        (10, 4096, 154),
        (20, 1024, 1024),
        (20, 1024, 154),
    ] {
        let q = Tensor::randn([2, heads, lq, 64], (dt, dev));
        let k = Tensor::randn([2, heads, lk, 64], (dt, dev));
        let choice =
            Tensor::internal_fused_sdp_choice(&q, &k, &k, None::<Tensor>, 0.0, false, None, false);
        println!("{{\"name\": \"sdp_choice_h{heads}_q{lq}_k{lk}\", \"backend\": {choice}}}");
    }

    tch::manual_seed(0);
    let unet_inputs = |b: i64, h: i64, w: i64| {
        let x = Tensor::randn([b, 4, h, w], (dt, dev));
        let ctx = Tensor::randn([b, 154, 2048], (dt, dev));
        let te = Tensor::randn([b, 1280], (dt, dev));
        let ids = Tensor::randn([b, 6], (dt, dev));
        let t = Tensor::from_slice(&vec![500f32; b as usize]).to_device(dev);
        (x, ctx, te, ids, t)
    };
    let mut graphed = GraphedUNet::new();
    for (name, b, h, w) in [
        ("unet_cfg_1024", 2, 128, 128),
        ("unet_cfg_1280x720", 2, 90, 160),
        ("unet_b8_1024", 8, 128, 128),
    ] {
        let (x, ctx, te, ids, t) = unet_inputs(b, h, w);
        let added = AddedCond {
            text_embeds: &te,
            time_ids: &ids,
        };
        bench(name, 3, 10, || unet.forward(&x, &t, &ctx, &added));
        if ff_gelu != FfGelu::Separate && b == 2 {
            // What the epilogue's tanh GELU moves, against diffusers' erf GELU on the same inputs.
            let out = unet.forward(&x, &t, &ctx, &added).to_kind(Kind::Float);
            unet.set_ff_gelu(FfGelu::Separate);
            let exact = unet.forward(&x, &t, &ctx, &added).to_kind(Kind::Float);
            unet.set_ff_gelu(ff_gelu);
            let diff = (&out - &exact).abs();
            println!(
                "{{\"name\": \"{name}_ff_gelu_vs_separate\", \"max_abs_diff\": {:.6e}, \"mean_abs_diff\": {:.6e}, \"mean_abs_separate\": {:.6e}}}",
                diff.max().double_value(&[]),
                diff.mean(Kind::Float).double_value(&[]),
                exact.abs().mean(Kind::Float).double_value(&[]),
            );
        }
        if opts.norm_kernels != NormKernels::Aten {
            // What the fused normalisations move, against libtorch's on the same inputs.
            let out = unet.forward(&x, &t, &ctx, &added).to_kind(Kind::Float);
            unet.set_norm_kernels(NormKernels::Aten);
            let reference = unet.forward(&x, &t, &ctx, &added).to_kind(Kind::Float);
            unet.set_norm_kernels(opts.norm_kernels);
            let diff = (&out - &reference).abs();
            println!(
                "{{\"name\": \"{name}_norms_vs_aten\", \"max_abs_diff\": {:.6e}, \"mean_abs_diff\": {:.6e}, \"mean_abs_aten\": {:.6e}}}",
                diff.max().double_value(&[]),
                diff.mean(Kind::Float).double_value(&[]),
                reference.abs().mean(Kind::Float).double_value(&[]),
            );
        }
        if let (Some(path), 8) = (&opts.profile_trace, b) {
            // One forward after the timed ones, every kernel recorded.
            sync();
            ops::profile_start(dev.is_cuda()).map_err(anyhow::Error::msg)?;
            let _ = unet.forward(&x, &t, &ctx, &added);
            sync();
            ops::profile_stop(path).map_err(anyhow::Error::msg)?;
            println!(
                "{{\"name\": \"{name}_profile\", \"trace\": \"{}\"}}",
                path.display()
            );
        }
        unet_graph_case(&unet, &mut graphed, name, [&x, &t, &ctx, &te, &ids]);
    }
    drop(graphed);
    drop(unet);
    sync();
    Ok(())
}

/// The `unet_*` case `name` replayed from a CUDA graph (`unet_graph_*`): the capture (warm-up
/// included) timed once, the largest difference from the eager output on the same inputs, then
/// the replays timed as the eager case is. A failure is printed and the run goes on.
fn unet_graph_case(
    unet: &UNet2DConditionModel,
    graphed: &mut GraphedUNet,
    name: &str,
    [x, t, ctx, te, ids]: [&Tensor; 5],
) {
    let name = name.replacen("unet_", "unet_graph_", 1);
    let added = AddedCond {
        text_embeds: te,
        time_ids: ids,
    };
    let t0 = now();
    let started = Instant::now();
    let first = graphed.forward(unet, x, t, ctx, &added);
    sync();
    let capture_s = started.elapsed().as_secs_f64();
    let first = match first {
        Ok(out) => out,
        Err(e) => {
            let e = e.to_string().replace('\\', "/").replace('"', "'");
            println!("{{\"name\": \"{name}\", \"error\": \"{e}\", \"t0\": {t0:.3}}}");
            return;
        }
    };
    let eager = unet.forward(x, t, ctx, &added);
    let diff = (eager.to_kind(Kind::Float) - first.to_kind(Kind::Float)).abs();
    let again = graphed
        .forward(unet, x, t, ctx, &added)
        .expect("the graph replayed once already");
    let replay_diff = (again.to_kind(Kind::Float) - first.to_kind(Kind::Float)).abs();
    println!(
        "{{\"name\": \"{name}_parity\", \"capture_s\": {capture_s:.3}, \"max_abs_diff_vs_eager\": {:.6e}, \"mean_abs_diff_vs_eager\": {:.6e}, \"mean_abs_eager\": {:.6e}, \"max_abs_diff_replay_vs_replay\": {:.6e}, \"captures\": {}}}",
        diff.max().double_value(&[]),
        diff.mean(Kind::Float).double_value(&[]),
        eager
            .to_kind(Kind::Float)
            .abs()
            .mean(Kind::Float)
            .double_value(&[]),
        replay_diff.max().double_value(&[]),
        graphed.captures(),
    );
    bench(&name, 3, 10, || {
        graphed
            .forward(unet, x, t, ctx, &added)
            .expect("the graph replayed for these shapes above")
    });
}

/// RGB8 of a decoded `[1, 3, H, W]` image, as the pipeline quantises it.
fn rgb8(x: &Tensor) -> Tensor {
    ((x.to_kind(Kind::Float) / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0).round()
}

/// One size: untiled, seam-free tiled (as `Tiling::Auto` plans it for the VAE's budget; with exact
/// statistics too at 1920×1080), diffusers-tiled; each tiled image vs the untiled one.
fn vae_tiling_cases(vae: &AutoencoderKL, size: &str, h: i64, w: i64, dt: Kind, dev: Device) {
    tch::manual_seed(1);
    let z = &Tensor::randn([1, 4, h, w], (dt, dev));
    let c = vae.config();
    let f = c.scale_factor();
    let plan = vae.tiled_plan(h, w, dt);
    println!(
        "{{\"name\": \"vae_plan_{size}\", \"decode_bytes_estimate\": {}, \"budget_mib\": {}, \"core\": {}, \"margin\": {}, \"stats_stride\": {}}}",
        c.decode_bytes(h * f, w * f, dt),
        vae.runtime().memory_budget_mib,
        plan.core,
        plan.margin,
        plan.stats_stride
    );
    let untiled = rgb8(&vae.decode(z, Tiling::Never));
    bench(&format!("vae_decode_{size}_untiled"), 2, 5, || {
        vae.decode(z, Tiling::Never)
    });
    let mut variants: Vec<(String, Box<dyn Fn() -> Tensor + '_>)> = vec![
        (
            format!("vae_decode_{size}_seamfree"),
            Box::new(move || vae.decode_tiled(z, plan)),
        ),
        (
            format!("vae_decode_{size}_difftiled"),
            Box::new(move || vae.decode(z, Tiling::Always)),
        ),
    ];
    if size == "1920x1080" {
        let exact = TiledDecode {
            stats_stride: 1,
            ..plan
        };
        variants.push((
            format!("vae_decode_{size}_seamfree_exact_stats"),
            Box::new(move || vae.decode_tiled(z, exact)),
        ));
    }
    for (name, f) in &variants {
        let d = (rgb8(&f()) - &untiled).abs();
        println!(
            "{{\"name\": \"{name}_vs_untiled\", \"mae\": {:.4}, \"max\": {:.1}}}",
            d.mean(Kind::Float).double_value(&[]),
            d.max().double_value(&[])
        );
        bench(name, 2, 5, f);
    }
}

/// `--norms-check`: each fused normalisation kernel (`nn::fused`) against an fp32 reference at
/// the SDXL UNet's shapes, beside libtorch's bf16 operators, and both timed (20 calls per timed
/// iteration). Fails when a fused kernel's largest error exceeds twice libtorch's plus one bf16
/// step at the output's scale, or when the residual sum differs from libtorch's add at all.
fn norms_check(dev: Device) -> anyhow::Result<()> {
    let dt = Kind::BFloat16;
    fused::prepare(dev).map_err(anyhow::Error::msg)?;
    let mut failures = Vec::new();
    tch::manual_seed(1);
    // (name, batch, channels, side, time embedding added, SiLU): the UNet's GroupNorms.
    for (name, n, c, side, with_add, silu) in [
        ("gn_b8_320_128_temb_silu", 8, 320, 128, true, true),
        ("gn_b8_640_64_temb_silu", 8, 640, 64, true, true),
        ("gn_b8_1280_32_temb_silu", 8, 1280, 32, true, true),
        ("gn_b8_2560_32_silu", 8, 2560, 32, false, true),
        ("gn_b8_960_64_silu", 8, 960, 64, false, true),
        ("gn_b8_640_64_plain", 8, 640, 64, false, false),
        ("gn_b2_320_128_temb_silu", 2, 320, 128, true, true),
    ] {
        let x = channels_last_randn(n, c, side, dt, dev) * 3.0 + 0.5;
        let t = with_add.then(|| Tensor::randn([n, c], (dt, dev)));
        let norm = GroupNorm::from_parts(
            Tensor::randn([c], (dt, dev)) * 0.5 + 1.0,
            Tensor::randn([c], (dt, dev)) * 0.2,
            32,
            1e-5,
        );
        // fp32 reference: the input plus the term, normalised and activated in fp32.
        let mut xf = x.to_kind(Kind::Float).contiguous();
        if let Some(t) = &t {
            xf += t.to_kind(Kind::Float).view([n, c, 1, 1]);
        }
        let reference = xf.group_norm(
            32,
            Some(&norm.weight.to_kind(Kind::Float)),
            Some(&norm.bias.to_kind(Kind::Float)),
            1e-5,
            false,
        );
        let reference = if silu { reference.silu() } else { reference };
        let op = |k| fused::group_norm(&norm, &x, t.as_ref(), silu, k);
        if !norms_case(name, &reference, op, ("", true)) {
            failures.push(name);
        }
    }
    // (name, batch, tokens, channels): the transformer blocks' residual add + LayerNorm.
    for (name, n, l, c) in [
        ("addln_b8_4096_640", 8, 4096, 640),
        ("addln_b8_1024_1280", 8, 1024, 1280),
        ("addln_b2_4096_640", 2, 4096, 640),
    ] {
        let a = Tensor::randn([n, l, c], (dt, dev)) * 4.0;
        let b = Tensor::randn([n, l, c], (dt, dev));
        let norm = LayerNorm::from_parts(
            Tensor::randn([c], (dt, dev)) * 0.5 + 1.0,
            Tensor::randn([c], (dt, dev)) * 0.2,
            1e-5,
        );
        // The residual sums must equal libtorch's add bit for bit.
        let s_aten = fused::add_layer_norm(&a, &b, &norm, NormKernels::Aten).0;
        let s_ours = fused::add_layer_norm(&a, &b, &norm, NormKernels::Fused).0;
        let sum_diff = max_abs_diff(&s_ours, &s_aten);
        let reference = s_aten.to_kind(Kind::Float).layer_norm(
            [c],
            Some(&norm.weight.to_kind(Kind::Float)),
            Some(&norm.bias.to_kind(Kind::Float)),
            1e-5,
            false,
        );
        let op = |k| fused::add_layer_norm(&a, &b, &norm, k).1;
        let extra = format!("\"sum_max_diff\": {sum_diff:.4e}, ");
        if !norms_case(name, &reference, op, (&extra, sum_diff == 0.0)) {
            failures.push(name);
        }
    }
    // (name, batch, channels, side): a ResNet's output, conv2 + shortcut + bias.
    for (name, n, c, side) in [
        ("biasres_b8_320_128", 8, 320, 128),
        ("biasres_b8_1280_32", 8, 1280, 32),
    ] {
        let h = channels_last_randn(n, c, side, dt, dev);
        let r = channels_last_randn(n, c, side, dt, dev) * 4.0;
        let bias = Tensor::randn([c], (dt, dev)) * 0.5;
        let reference = h.to_kind(Kind::Float)
            + r.to_kind(Kind::Float)
            + bias.to_kind(Kind::Float).view([1, c, 1, 1]);
        let op = |k| fused::bias_residual(&h, &r, Some(&bias), k);
        let nhwc = is_nhwc(&op(NormKernels::Fused));
        if !norms_case(name, &reference, op, ("", nhwc)) {
            failures.push(name);
        }
    }
    anyhow::ensure!(failures.is_empty(), "fused norm kernels off: {failures:?}");
    Ok(())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

/// One `--norms-check` case: `op` with the fused kernels and with libtorch's operators, each
/// output's largest error against the fp32 `reference`, printed with the verdict, then both timed
/// (20 calls per timed iteration). Good when the fused error is at most twice libtorch's plus one
/// bf16 step at the output's scale and the case's own condition (`extra`: its JSON fields and
/// its verdict) holds.
fn norms_case(
    name: &str,
    reference: &Tensor,
    op: impl Fn(NormKernels) -> Tensor,
    (extra_json, extra_ok): (&str, bool),
) -> bool {
    const REPS: usize = 20;
    let err_ours = max_abs_diff(&op(NormKernels::Fused), reference);
    let err_aten = max_abs_diff(&op(NormKernels::Aten), reference);
    let scale = reference.abs().max().double_value(&[]);
    let ok = extra_ok && err_ours <= 2.0 * err_aten + scale / 128.0;
    println!(
        "{{\"name\": \"{name}_check\", {extra_json}\"max_err_fused\": {err_ours:.4e}, \"max_err_aten\": {err_aten:.4e}, \"max_abs_ref\": {scale:.3}, \"ok\": {ok}}}"
    );
    for (label, k) in [("aten", NormKernels::Aten), ("fused", NormKernels::Fused)] {
        bench(&format!("{name}_{label}_x{REPS}"), 3, 10, || {
            repeated(REPS, || op(k))
        });
    }
    ok
}

/// `f` called `reps` times (at least once), the last result returned.
fn repeated(reps: usize, mut f: impl FnMut() -> Tensor) -> Tensor {
    let mut out = f();
    for _ in 1..reps {
        out = f();
    }
    out
}

fn is_nhwc(x: &Tensor) -> bool {
    vnfarm_models::nn::is_channels_last(x)
}

/// `randn([n, c, side, side])` laid out NHWC.
fn channels_last_randn(n: i64, c: i64, side: i64, dt: Kind, dev: Device) -> Tensor {
    Tensor::randn([n, side, side, c], (dt, dev)).permute([0, 3, 1, 2])
}
