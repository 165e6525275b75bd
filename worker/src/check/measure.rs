//! Timing and agreement on the device: medians of synchronised runs with the first call reported
//! apart (first-shape costs on these GPUs can be minutes: kernel search, compilation), and the
//! relative error of one output against another.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// How many times each measurement runs.
#[derive(Clone, Copy, Debug)]
pub struct Repeats {
    /// Untimed runs after the first call.
    pub warm: usize,
    /// Timed runs; their median is the measurement.
    pub timed: usize,
}

/// One measured operation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Timing {
    /// What ran, at which size: `sdxl.unet_step.1024x1024`.
    pub id: String,
    /// The candidate's name.
    pub candidate: String,
    /// The first call, alone (it includes kernel selection, compilation, graph capture).
    pub first_s: f64,
    pub median_s: f64,
    pub min_s: f64,
    pub runs: usize,
}

pub fn synchronize(device: Device) {
    if let Device::Cuda(n) = device {
        tch::Cuda::synchronize(n as i64);
    }
}

/// Times `f` on `device`: the first call, `warm` more untimed, then the median of `timed`.
pub fn time<T>(
    id: &str,
    candidate: &str,
    device: Device,
    repeats: Repeats,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<Timing> {
    let _guard = tch::no_grad_guard();
    let once = |f: &mut dyn FnMut() -> anyhow::Result<T>| -> anyhow::Result<f64> {
        synchronize(device);
        let started = Instant::now();
        let out = f()?;
        synchronize(device);
        drop(out);
        Ok(started.elapsed().as_secs_f64())
    };
    let first_s = once(&mut f)?;
    for _ in 0..repeats.warm {
        once(&mut f)?;
    }
    let mut runs = Vec::with_capacity(repeats.timed);
    for _ in 0..repeats.timed.max(1) {
        runs.push(once(&mut f)?);
    }
    Ok(Timing::from_runs(id, candidate, first_s, runs))
}

impl Timing {
    /// The median and minimum of `runs` (at least one), with the first call apart.
    pub fn from_runs(id: &str, candidate: &str, first_s: f64, mut runs: Vec<f64>) -> Timing {
        runs.sort_by(f64::total_cmp);
        Timing {
            id: id.to_owned(),
            candidate: candidate.to_owned(),
            first_s,
            median_s: runs[runs.len() / 2],
            min_s: runs[0],
            runs: runs.len(),
        }
    }
}

/// A candidate (or an environment set) is kept only when it is faster than this fraction of the
/// best time so far: a smaller gain is within the noise of a few medians.
pub const KEEP_BELOW: f64 = 0.99;

/// `‖a − b‖ / ‖b‖` in fp64 on the CPU (`b` is the reference). A NaN or infinity anywhere is an
/// infinite error.
pub fn relative_error(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(Kind::Double);
    if a.size() != b.size() {
        return f64::INFINITY;
    }
    let diff = (&a - &b).norm().double_value(&[]);
    let norm = b.norm().double_value(&[]);
    let e = if norm == 0.0 { diff } else { diff / norm };
    if e.is_finite() { e } else { f64::INFINITY }
}

/// Seeded normal noise made on the CPU (the same numbers for every device), then moved.
pub fn randn(shape: &[i64], seed: i64, kind: Kind, device: Device) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
        .to_kind(kind)
        .to_device(device)
}
