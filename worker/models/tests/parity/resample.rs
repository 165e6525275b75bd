//! Pillow parity of `imageops::resize`: every case written by
//! `fixtures/resample/make_resample_fixtures.py` (Pillow 13.0.0, recorded in `cases.json`) must be
//! byte-identical. Tolerance: none (measured: 0 differing bytes over all cases).

use std::path::{Path, PathBuf};

use image::RgbImage;
use serde::Deserialize;
use vnfarm_models::imageops::{Filter, resize};

#[derive(Deserialize)]
struct Cases {
    pillow_version: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    source: String,
    width: u32,
    height: u32,
    filter: String,
    output: String,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/resample")
}

fn load(path: &Path) -> RgbImage {
    image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_rgb8()
}

#[test]
fn resize_matches_pillow_byte_for_byte() {
    let dir = fixtures();
    let text = std::fs::read_to_string(dir.join("cases.json")).expect("cases.json");
    let cases: Cases = serde_json::from_str(&text).expect("cases.json parses");
    assert!(!cases.cases.is_empty());
    let mut failures = Vec::new();
    for case in &cases.cases {
        let filter = match case.filter.as_str() {
            "nearest" => Filter::Nearest,
            "bilinear" => Filter::Bilinear,
            "bicubic" => Filter::Bicubic,
            "lanczos" => Filter::Lanczos,
            other => panic!("unknown filter {other}"),
        };
        let source = load(&dir.join(&case.source));
        let expected = load(&dir.join(&case.output));
        let got = resize(&source, case.width, case.height, filter).expect("valid sizes");
        assert_eq!(got.dimensions(), expected.dimensions(), "{}", case.output);
        let differing = got
            .as_raw()
            .iter()
            .zip(expected.as_raw())
            .filter(|(a, b)| a != b)
            .count();
        if differing > 0 {
            let max = got
                .as_raw()
                .iter()
                .zip(expected.as_raw())
                .map(|(&a, &b)| a.abs_diff(b))
                .max()
                .unwrap_or(0);
            failures.push(format!(
                "{}: {differing} bytes differ, max |diff| {max}",
                case.output
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "mismatches against Pillow {}:\n{}",
        cases.pillow_version,
        failures.join("\n")
    );
}
