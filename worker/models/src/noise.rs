//! Seeded Gaussian noise identical to `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))`.
//!
//! tch 0.24 exposes no `Generator` object, so this seeds libtorch's default CPU generator
//! (`torch.manual_seed`), which starts from the same mt19937 state as a fresh generator seeded
//! with the same value, and draws fp32 on the CPU like diffusers' `randn_tensor` does for a CPU
//! generator (one call for the whole batch shape), before moving to the target device and dtype.
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
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

/// [`randn_cpu`] moved to `device` as `kind`.
pub fn randn(shape: &[i64], device: Device, kind: Kind) -> Tensor {
    randn_cpu(shape).to_device(device).to_kind(kind)
}
