//! The Real-ESRGAN engine on this box: the network on the device against a CPU copy in fp32 on a
//! small tile, then each memory layout on the device: it must agree with the portable preset's
//! output and is kept where one tile at the configured size (with its overlap) runs faster.

use tch::{Device, Kind};
use vnfarm_models::esrgan::upscaler::Upscaler;
use vnfarm_models::nn::MemoryFormat;
use vnfarm_models::settings::{EsrganSettings, Preset};

use super::measure::{randn, relative_error};
use super::{Plan, Step, tolerance};
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
