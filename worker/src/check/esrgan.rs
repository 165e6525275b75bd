//! The Real-ESRGAN engine on this box: the network on the device against a CPU copy in fp32 on a
//! small tile, then each memory layout on the device: it must agree with the portable preset's
//! output and is kept where one tile at the configured size (with its overlap) runs faster.

use tch::{Device, Kind, Tensor};
use vnfarm_models::esrgan::tiling::{Blend, TileSettings};
use vnfarm_models::esrgan::upscaler::{UpscaleOptions, Upscaler};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::nn::MemoryFormat;
use vnfarm_models::settings::{EsrganSettings, Preset};

use super::measure::{randn, relative_error};
use super::report::CheckResult;
use super::{Plan, Step, fixture_files, tolerance};
use crate::engine::EsrganConfig;

pub fn run(config: &EsrganConfig, plan: &Plan, step: &mut Step) {
    let device = crate::engine::device::parse_device(&config.device).unwrap_or(Device::Cpu);
    let kind = config.dtype.kind();
    let portable = EsrganSettings::preset(Preset::Portable);
    let Some(mut upscaler) = step.run("esrgan.load", || {
        let mut up = Upscaler::load(&config.model, device, kind)?;
        up.set_memory_format(portable.memory_format);
        Ok((up, "loaded with the portable settings".to_owned()))
    }) else {
        return;
    };
    let net_kind = kind;
    let channels = upscaler.config().num_in_ch;
    let probe = randn(&[1, channels, 64, 64], 5, Kind::Float, Device::Cpu).sigmoid();
    let Some(reference) = step.run("esrgan.device.forward", || {
        let out = upscaler
            .network()
            .forward(&probe.to_device(device).to_kind(net_kind));
        let scale = out.abs().max().to_kind(Kind::Float).double_value(&[]);
        anyhow::ensure!(
            scale.is_finite() && scale > 0.0,
            "the network's output is zero or not finite"
        );
        Ok((out, "a 64x64 tile runs".to_owned()))
    }) else {
        return;
    };
    fixture_parity(plan, device, step);
    if let Some(cpu) = step.attempt("esrgan.cpu_parity.load", || {
        Ok(Upscaler::load(&config.model, Device::Cpu, Kind::Float)?)
    }) {
        step.agreement(
            "esrgan.cpu_parity.forward",
            "RRDBNet tile, device against CPU",
            tolerance(kind),
            || Ok(relative_error(&reference, &cpu.network().forward(&probe))),
        );
    }
    let side = if plan.quick {
        64
    } else {
        i64::from(portable.tile)
    };
    let tile = side + 2 * i64::from(portable.tile_overlap);
    let input = randn(&[1, channels, tile, tile], 9, kind, device);
    let time = |up: &Upscaler, name: &str, step: &mut Step| {
        step.time(
            &format!("esrgan.tile.{tile}x{tile}"),
            name,
            device,
            plan.repeats,
            || Ok(up.network().forward(&input)),
        )
        .map(|t| t.median_s)
    };
    let Some(portable_s) = time(&upscaler, "portable", step) else {
        return;
    };
    let mut best = portable;
    let mut best_s = portable_s;
    let other = match portable.memory_format {
        MemoryFormat::ChannelsLast => MemoryFormat::Contiguous,
        MemoryFormat::Contiguous => MemoryFormat::ChannelsLast,
    };
    let candidate = EsrganSettings {
        memory_format: other,
        ..portable
    };
    let id = format!(
        "esrgan.candidate.{}",
        match other {
            MemoryFormat::ChannelsLast => "channels_last",
            MemoryFormat::Contiguous => "contiguous",
        }
    );
    let agreed = step.run(&id, || {
        upscaler.set_memory_format(other);
        let out = upscaler
            .network()
            .forward(&probe.to_device(device).to_kind(net_kind));
        let e = relative_error(&out, &reference);
        let tol = tolerance(kind);
        anyhow::ensure!(
            e < tol,
            "disagrees with the portable path: relative error {e:.2e} (tolerance {tol:.0e})"
        );
        Ok((
            (),
            format!("agrees with the portable path: relative error {e:.2e}"),
        ))
    });
    if agreed.is_some()
        && let Some(t) = time(&upscaler, &id["esrgan.candidate.".len()..], step)
        && step.speed(&id, t, best_s)
    {
        best = candidate;
        best_s = t;
    }
    upscaler.set_memory_format(best.memory_format);
    step.chosen(
        serde_json::to_value(best).expect("settings serialize"),
        portable_s / best_s,
    );
}

/// Mean |difference| in 1/255 that the tiny Real-ESRGAN's output on the device may have from
/// Real-ESRGAN's own (fp32 on both sides; the model crate's CPU tests hold it to 1e-5 relative).
const FIXTURE_TOLERANCE: f64 = 0.5;

/// The model crate's tiny Real-ESRGAN (`esrgan/tiny_x4.pth`, random weights) on the device in fp32,
/// upscaling a fixture image whole, against the float output Real-ESRGAN's `enhance` made for it
/// (`esrgan/reference/esrgan.safetensors`, case `x4_full`): an independent implementation, on
/// this box's convolution kernels.
fn fixture_parity(plan: &Plan, device: Device, step: &mut Step) {
    let id = "esrgan.fixture_parity";
    let Some([model, reference, input]) = fixture_files(
        plan,
        step,
        id,
        "tiny Real-ESRGAN",
        [
            "esrgan/tiny_x4.pth",
            "esrgan/reference/esrgan.safetensors",
            "esrgan/inputs/rgb8_37x29.png",
        ],
    ) else {
        return;
    };
    let out = step.attempt(id, || {
        let up = Upscaler::load(&model, device, Kind::Float)?;
        let rgb = image::open(&input)?.to_rgb8();
        let (w, h) = (i64::from(rgb.width()), i64::from(rgb.height()));
        let x = (Tensor::from_slice(rgb.as_raw())
            .view([h, w, 3])
            .permute([2, 0, 1])
            .to_kind(Kind::Float)
            / 255.0)
            .unsqueeze(0);
        let options = UpscaleOptions {
            outscale: None,
            tiles: TileSettings {
                tile: None,
                overlap: 0,
                blend: Blend::Crop,
                max_batch: 1,
            },
            pre_pad: 0,
        };
        let got = up.upscale_tensor(&x, &options, &mut |_, _| {}, &|| false)?;
        let want =
            SafetensorsFile::open(&reference)?.load("x4_full.float", Device::Cpu, Kind::Float)?;
        anyhow::ensure!(
            got.size() == want.size(),
            "output shape {:?}, Real-ESRGAN's {:?}",
            got.size(),
            want.size()
        );
        let mae = (got.to_device(Device::Cpu) - want)
            .abs()
            .mean(Kind::Double)
            .double_value(&[])
            * 255.0;
        Ok(mae)
    });
    if let Some(mae) = out {
        let detail = format!(
            "tiny Real-ESRGAN x4 in fp32, a 37x29 image whole: mean |difference| {mae:.3}/255 from \
             Real-ESRGAN (tolerance {FIXTURE_TOLERANCE}/255)"
        );
        step.record(CheckResult::at_most(id, detail, mae, FIXTURE_TOLERANCE));
    }
}
