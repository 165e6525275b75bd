//! GPU benchmark of the Real-ESRGAN upscaler: one model, one input size, one tiling per process,
//! so that the driver's per-process GPU memory peak belongs to that case alone.
//!
//! ```sh
//! esrgan_bench --model M.pth --input IMG.rgb --size N [--tile T] [--overlap O] [--blend crop|feather]
//!              [--batch B] [--runs R] [--dtype fp16|bf16|fp32] [--cudnn-benchmark] [--save OUT.rgb]
//!              [--outscale S] [--channels-last] [--cpu]
//! ```
//!
//! `--input` is raw RGB8 of `--size`² (written by `bench/run_esrgan_bench.py`, which runs this
//! binary and Real-ESRGAN's `tile_process` on the same weights, input and GPU). Without `--tile` the
//! whole image runs in one forward. Prints JSON lines: `load` (seconds), then `upscale` with the
//! first call and `--runs` further calls (seconds, host clock around `Upscaler::upscale`, which
//! ends with the output copied to the host as RGB8), `t0`/`t1` bracketing them.

use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use image::{DynamicImage, RgbImage};
use tch::{Cuda, Device, Kind};
use vnfarm_models::esrgan::rrdbnet::MemoryFormat;
use vnfarm_models::esrgan::tiling::{Blend, TileSettings};
use vnfarm_models::esrgan::upscaler::{UpscaleOptions, Upscaler};

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

struct Args {
    model: PathBuf,
    input: PathBuf,
    size: u32,
    tile: Option<i64>,
    overlap: i64,
    blend: Blend,
    batch: usize,
    runs: usize,
    kind: Kind,
    cudnn_benchmark: bool,
    save: Option<PathBuf>,
    outscale: Option<i64>,
    channels_last: bool,
    cpu: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        input: PathBuf::new(),
        size: 0,
        tile: None,
        overlap: 0,
        blend: Blend::Crop,
        batch: 1,
        runs: 2,
        kind: Kind::Half,
        cudnn_benchmark: false,
        save: None,
        outscale: None,
        channels_last: false,
        cpu: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<i64>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--model" => a.model = value()?.into(),
            "--input" => a.input = value()?.into(),
            "--size" => a.size = num(value()?)? as u32,
            "--tile" => a.tile = Some(num(value()?)?).filter(|&t| t > 0),
            "--overlap" => a.overlap = num(value()?)?,
            "--blend" => {
                a.blend = match value()?.as_str() {
                    "crop" => Blend::Crop,
                    "feather" => Blend::Feather,
                    other => return Err(format!("--blend {other}")),
                }
            }
            "--batch" => a.batch = num(value()?)? as usize,
            "--runs" => a.runs = num(value()?)? as usize,
            "--dtype" => {
                a.kind = match value()?.as_str() {
                    "fp16" => Kind::Half,
                    "bf16" => Kind::BFloat16,
                    "fp32" => Kind::Float,
                    other => return Err(format!("--dtype {other}")),
                }
            }
            "--cudnn-benchmark" => a.cudnn_benchmark = true,
            "--save" => a.save = Some(value()?.into()),
            "--outscale" => a.outscale = Some(num(value()?)?),
            "--channels-last" => a.channels_last = true,
            "--cpu" => a.cpu = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("esrgan_bench: {e}");
            std::process::exit(64);
        }
    };
    let device = if a.cpu { Device::Cpu } else { Device::Cuda(0) };
    let kind = if a.cpu { Kind::Float } else { a.kind };
    if a.cudnn_benchmark {
        Cuda::cudnn_set_benchmark(true);
    }
    let sync = || {
        if let Device::Cuda(i) = device {
            Cuda::synchronize(i as i64);
        }
    };
    let bytes = std::fs::read(&a.input).expect("input image");
    let image = DynamicImage::ImageRgb8(
        RgbImage::from_raw(a.size, a.size, bytes).expect("--input holds --size² RGB8 pixels"),
    );

    let started = Instant::now();
    let mut up = Upscaler::load(&a.model, device, kind).expect("model loads");
    if a.channels_last {
        up.set_memory_format(MemoryFormat::ChannelsLast);
    }
    sync();
    println!(
        "{{\"name\": \"load\", \"s\": {:.4}, \"model\": {:?}}}",
        started.elapsed().as_secs_f64(),
        up.describe()
    );

    let options = UpscaleOptions {
        outscale: a.outscale,
        tiles: TileSettings {
            tile: a.tile,
            overlap: a.overlap,
            blend: a.blend,
            max_batch: a.batch,
        },
        pre_pad: 0,
    };
    let t0 = now();
    let mut times = Vec::new();
    let mut tiles = 0;
    let mut out = None;
    for _ in 0..=a.runs {
        let started = Instant::now();
        let o = up
            .upscale(&image, &options, &mut |_, total| tiles = total, &|| false)
            .expect("upscale");
        times.push(started.elapsed().as_secs_f64());
        out = Some(o);
    }
    let t1 = now();
    let mut steady = times[1..].to_vec();
    steady.sort_by(f64::total_cmp);
    let median = steady.get(steady.len() / 2).copied().unwrap_or(times[0]);
    let out = out.expect("at least one run");
    println!(
        "{{\"name\": \"upscale\", \"first_s\": {:.4}, \"median_s\": {median:.4}, \"times\": {times:?}, \
         \"tiles\": {tiles}, \"out\": [{}, {}], \"t0\": {t0:.3}, \"t1\": {t1:.3}}}",
        times[0],
        out.width(),
        out.height()
    );
    if let Some(path) = &a.save {
        std::fs::write(path, out.into_rgb8().into_raw()).expect("--save writes the output");
    }
}
