//! What every parity test file compares with: the relative error of a tensor against its Python
//! reference, and the checked form that prints and asserts it. Each test binary uses a subset.
#![allow(dead_code)]

use tch::{Kind, Tensor};

/// `max|a − b| / max|b|`, in f64 (`b` the reference).
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shape mismatch");
    let a = a.to_kind(Kind::Double);
    let b = b.to_kind(Kind::Double);
    let num = (&a - &b).abs().max().double_value(&[]);
    let den = b.abs().max().double_value(&[]).max(1e-12);
    num / den
}

/// [`rel_err`], printed under `what` and asserted to be at most `tol`.
pub fn check(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> f64 {
    let e = rel_err(a, b);
    println!("{what}: relative error {e:.3e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.1e}");
    e
}
