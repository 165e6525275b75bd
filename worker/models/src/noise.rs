//! Seeded Gaussian noise identical to `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))`.
//!
//! tch 0.24 exposes no `Generator` object, so this seeds libtorch's default CPU generator
//! (`torch.manual_seed`), which starts from the same mt19937 state as a fresh generator seeded
//! with the same value, and draws on the CPU in the latents' dtype like diffusers' `randn_tensor`
//! does for a CPU generator (one call for the whole batch shape), then moves to the device. For an
//! fp32 pipeline that is an fp32 draw; for bf16/fp16 torch draws a different stream than an fp32
//! draw cast down, and we follow diffusers (verified bit-exact against torch in the tests).
//!
//! Invariant: nothing else draws from the default generator between [`seed`] and the last draw of
//! a generation. [`seed`] returns a guard of a process-wide lock that every seeded user holds for
//! that whole span, so two generations on different threads serialise instead of interleaving
//! their draws. The draw order is the one diffusers uses (initial latents, then one draw per
//! ancestral step).

use std::sync::{Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

static DEFAULT_GENERATOR: Mutex<()> = Mutex::new(());

/// Holds the default generator for one seeded sequence of draws.
#[derive(Debug)]
pub struct SeededGenerator {
    _lock: MutexGuard<'static, ()>,
}

/// Locks the default generator and resets it (and every device generator) to `seed`.
pub fn seed(seed: u64) -> SeededGenerator {
    // A panic while holding the lock leaves no broken state behind: the next user reseeds.
    let lock = DEFAULT_GENERATOR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // torch takes the seed as uint64; tch passes the same 64 bits as i64.
    tch::manual_seed(seed as i64);
    SeededGenerator { _lock: lock }
}

/// `N(0, 1)` of `shape`, drawn in fp32 on the CPU from the default generator.
pub fn randn_cpu(shape: &[i64]) -> Tensor {
    randn_cpu_as(shape, Kind::Float)
}

/// `N(0, 1)` of `shape` drawn on the CPU directly in `kind`, as `torch.randn(shape,
/// generator=cpu_generator, dtype=kind)`. Note that torch's half-precision draws are a different
/// stream from fp32 draws cast down; diffusers draws in the pipeline dtype, so do we.
pub fn randn_cpu_as(shape: &[i64], kind: Kind) -> Tensor {
    Tensor::randn(shape, (kind, Device::Cpu))
}

/// [`randn_cpu_as`] moved to `device`.
pub fn randn(shape: &[i64], kind: Kind, device: Device) -> Tensor {
    randn_cpu_as(shape, kind).to_device(device)
}
