//! Seeded Gaussian noise identical to `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))`.
//!
//! tch 0.24 exposes no `Generator` object, so this seeds libtorch's default CPU generator
//! (`torch.manual_seed`), which starts from the same mt19937 state as a fresh generator seeded
//! with the same value, and draws fp32 on the CPU like diffusers' `randn_tensor` does for a CPU
//! generator (one call for the whole batch shape), before moving to the target device and dtype.
//!
//! Invariant: the generation thread is the only user of the default generator between [`seed`]
//! and its last draw (the worker runs the model on one dedicated thread); the draw order is the
//! one diffusers uses (initial latents, then one draw per ancestral step).

use tch::{Device, Kind, Tensor};

/// Resets the default CPU generator (and every device generator) to `seed`.
pub fn seed(seed: u64) {
    // torch takes the seed as uint64; tch passes the same 64 bits as i64.
    tch::manual_seed(seed as i64);
}

/// `N(0, 1)` of `shape`, drawn in fp32 on the CPU from the default generator.
pub fn randn_cpu(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

/// [`randn_cpu`] moved to `device` as `kind`.
pub fn randn(shape: &[i64], device: Device, kind: Kind) -> Tensor {
    randn_cpu(shape).to_device(device).to_kind(kind)
}
