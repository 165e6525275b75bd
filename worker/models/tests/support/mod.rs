//! What the parity tests (`tests/parity/`) compare with: the relative error of a tensor against its
//! Python reference, and the checked form that prints and asserts it; and the fixture files written
//! at test time from other fixtures ([`derived`], which the end-to-end tests include too).

pub mod derived;
pub mod emulation;

use tch::{Kind, Tensor};

/// The crate's `fixtures/` folder (what [`derived`]'s functions take).
pub fn fixture_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

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

/// Every tensor of a reference file, by name: integers as int64 (`U8` as uint8), `F64` as f64,
/// every other float as fp32; with the open file for its metadata.
pub fn load_reference(
    path: &std::path::Path,
) -> (
    std::collections::HashMap<String, Tensor>,
    vnfarm_models::loading::safetensors::SafetensorsFile,
) {
    let f = vnfarm_models::loading::safetensors::SafetensorsFile::open(path).unwrap_or_else(|e| {
        panic!(
            "reference file {} (run its fixture script): {e}",
            path.display()
        )
    });
    let names: Vec<String> = f.names().map(str::to_string).collect();
    let tensors = names
        .into_iter()
        .map(|n| {
            let kind = match f.info(&n).expect("listed").dtype.as_str() {
                "I64" | "I32" => Kind::Int64,
                "U8" => Kind::Uint8,
                "F64" => Kind::Double,
                _ => Kind::Float,
            };
            let t = f
                .load(&n, tch::Device::Cpu, kind)
                .unwrap_or_else(|e| panic!("reference tensor {n}: {e}"));
            (n, t)
        })
        .collect();
    (tensors, f)
}

/// A gzipped JSON reference file, parsed (the large JSON references are stored gzipped).
pub fn read_json_gz(path: &std::path::Path) -> serde_json::Value {
    use std::io::Read;
    let gz = std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "reference file {} (run its fixture script): {e}",
            path.display()
        )
    });
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_string(&mut text)
        .unwrap_or_else(|e| panic!("{}: not gzipped UTF-8: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

/// Mean absolute difference, in 1/255 units, of an RGB8 image and a float reference `[H, W, 3]`
/// in 0..1.
pub fn image_mae(img: &image::RgbImage, want: &Tensor) -> f64 {
    let (h, w) = (i64::from(img.height()), i64::from(img.width()));
    assert_eq!(want.size(), [h, w, 3]);
    let got = Tensor::from_slice(img.as_raw())
        .to_kind(Kind::Float)
        .view([h, w, 3]);
    (got - want * 255.0)
        .abs()
        .mean(Kind::Double)
        .double_value(&[])
}
