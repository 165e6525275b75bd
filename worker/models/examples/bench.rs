//! GPU benchmark of the SDXL UNet and VAE at real size (SDXL base configs), bf16, SDPA attention.
//!
//! Weights come from diffusers-format safetensors files (random values written by
//! `bench/run_bench.py`, which also times diffusers on the same weights):
//!
//! ```sh
//! bench <unet diffusion_pytorch_model.safetensors> <vae diffusion_pytorch_model.safetensors>
//! ```
//!
//! Prints one JSON object per line: `{"name": ..., "ms_median": ..., "ms_min": ..., "ms_max": ...}`
//! (load times as `{"name": ..., "s": ...}`). Timing: warm-up calls, then each timed call is
//! bracketed by `cuda synchronize` and a host clock; the median is reported.

use std::sync::Arc;
use std::time::Instant;

use tch::{Cuda, Device, Kind, Tensor};
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::safetensors::SafetensorsFile;
use vnfarm_models::unet::{AddedCond, UNet2DConditionModel, UNetConfig};
use vnfarm_models::vae::{AutoencoderKL, Tiling, VaeConfig};
use vnfarm_models::weights::{WeightStore, Weights};

fn sync() {
    Cuda::synchronize(0);
}

fn bench(name: &str, warm: usize, iters: usize, mut f: impl FnMut() -> Tensor) {
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
    ts.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    println!(
        "{{\"name\": \"{name}\", \"ms_median\": {:.3}, \"ms_min\": {:.3}, \"ms_max\": {:.3}, \"iters\": {iters}}}",
        ts[ts.len() / 2],
        ts[0],
        ts[ts.len() - 1]
    );
}

fn store(path: &str) -> anyhow::Result<Arc<WeightStore>> {
    let file = Arc::new(SafetensorsFile::open(path)?);
    Ok(Arc::new(WeightStore::identity(file)))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() == 3,
        "usage: bench <unet.safetensors> <vae.safetensors>"
    );
    anyhow::ensure!(Cuda::is_available(), "CUDA not available to libtorch");
    let dev = Device::Cuda(0);
    let dt = Kind::BFloat16;
    let imp = AttentionImpl::Sdpa;
    let _guard = tch::no_grad_guard();
    // Touch the device so CUDA context creation is not counted as load time.
    let _ = Tensor::zeros([1], (dt, dev));
    sync();

    let t = Instant::now();
    let unet = UNet2DConditionModel::new(
        &Weights::new(store(&args[1])?, dev, dt),
        &UNetConfig::sdxl_base(),
        imp,
    )?;
    sync();
    println!(
        "{{\"name\": \"unet_load\", \"s\": {:.3}}}",
        t.elapsed().as_secs_f64()
    );

    tch::manual_seed(0);
    let unet_inputs = |b: i64, h: i64, w: i64| {
        let x = Tensor::randn([b, 4, h, w], (dt, dev));
        let ctx = Tensor::randn([b, 154, 2048], (dt, dev));
        let te = Tensor::randn([b, 1280], (dt, dev));
        let ids = Tensor::randn([b, 6], (dt, dev));
        let t = Tensor::from_slice(&vec![500f32; b as usize]).to_device(dev);
        (x, ctx, te, ids, t)
    };
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
    }
    drop(unet);
    sync();

    let t = Instant::now();
    let vae = AutoencoderKL::new(
        &Weights::new(store(&args[2])?, dev, dt),
        &VaeConfig::sdxl(),
        imp,
    )?;
    sync();
    println!(
        "{{\"name\": \"vae_load\", \"s\": {:.3}}}",
        t.elapsed().as_secs_f64()
    );
    for (name, h, w, tiling) in [
        ("vae_decode_1024", 128, 128, Tiling::Never),
        ("vae_decode_1920x1080_untiled", 135, 240, Tiling::Never),
        ("vae_decode_1920x1080_tiled", 135, 240, Tiling::Always),
    ] {
        let z = Tensor::randn([1, 4, h, w], (dt, dev));
        bench(name, 2, 5, || vae.decode(&z, tiling));
    }
    let x = Tensor::randn([1, 3, 1024, 1024], (dt, dev));
    bench("vae_encode_1024", 2, 5, || {
        vae.encode(&x, Tiling::Never).mean
    });
    Ok(())
}
