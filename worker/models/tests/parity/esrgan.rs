//! Real-ESRGAN parity: RRDBNet and `Upscaler` against the references written by
//! `fixtures/esrgan/make_esrgan_fixtures.py` (BasicSR's RRDBNet and Real-ESRGAN's
//! `RealESRGANer.enhance` re-implemented there, OpenCV 5.0 for colour conversion and resampling;
//! tiny random weights), CPU, fp32 unless stated. The models' safetensors forms and the refused
//! `extra_key` file are the `.pth` files' weights, written at test time by `support::derived`.
//!
//! Tolerances (measured on this machine, libtorch 2.11 CPU, in brackets):
//! - network outputs and float images: relative error (`max|ours − ref| / max|ref|`) ≤ 1e-5
//!   [0 for every forward, plain and cropped tiles; ≤ 7.2e-8 for feathered tiles];
//! - 8/16-bit images: every sample within 1 of the reference (a value at a rounding boundary may
//!   round the other way after float reordering), at most 0.5 % of 8-bit and 2 % of 16-bit samples
//!   differing: a 16-bit step is 257 times finer, so the same float noise (~7e-7 relative, about
//!   0.05 of a 16-bit step) turns that many more samples [one x86-64 machine: all 15 cases
//!   identical (RGB, RGBA, grey, 16-bit, ×2, pre-pad, both merges, outscale ×2 and ×4); an AMD
//!   EPYC: 8-bit cases ≤ 0.006 % differing by 1, the 16-bit case 0.567 %];
//! - OpenCV Lanczos-4: 8-bit byte-identical [identical], 16-bit within 1 [identical];
//! - fp16 / bf16 against the fp32 reference: mean |difference| ≤ 1/255 and 3/255 [0.03 and 0.25].

use std::path::{Path, PathBuf};

use image::DynamicImage;
use tch::{Device, Kind, Tensor};
use vnfarm_models::error::{GenerateError, LoadError};
use vnfarm_models::esrgan::tiling::{Blend, TileSettings};
use vnfarm_models::esrgan::upscaler::{UpscaleOptions, Upscaler};
use vnfarm_models::imageops::lanczos4::{self, Layout};

use crate::support;
use crate::support::{check, load_reference};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/esrgan")
}

fn reference() -> std::collections::HashMap<String, Tensor> {
    load_reference(&fixtures().join("reference/esrgan.safetensors")).0
}

/// Model file `name` of the fixture folder; its two safetensors forms are the `.pth` files'
/// weights, written at test time (`support::derived`).
fn model_file(name: &str) -> PathBuf {
    let root = support::fixture_root();
    match name {
        "tiny_x4.safetensors" => support::derived::esrgan_tiny_x4(&root),
        "tiny_x2.safetensors" => support::derived::esrgan_tiny_x2(&root),
        _ => fixtures().join(name),
    }
}

fn load(name: &str) -> Upscaler {
    Upscaler::load(&model_file(name), Device::Cpu, Kind::Float)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn input(name: &str) -> DynamicImage {
    let path = fixtures().join("inputs").join(name);
    image::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn options(tile: Option<i64>, overlap: i64, blend: Blend) -> UpscaleOptions {
    UpscaleOptions {
        outscale: None,
        tiles: TileSettings {
            tile,
            overlap,
            blend,
            max_batch: 4,
        },
        pre_pad: 0,
    }
}

fn upscale(up: &Upscaler, image: &DynamicImage, opts: &UpscaleOptions) -> DynamicImage {
    up.upscale(image, opts, &mut |_, _| {}, &|| false)
        .expect("upscale")
}

/// The image's samples as a tensor shaped like the reference (`[H, W, C]`, `[H, W]` for grey).
fn samples(image: &DynamicImage) -> Tensor {
    let (w, h) = (i64::from(image.width()), i64::from(image.height()));
    let c = i64::from(image.color().channel_count());
    let t = match image {
        DynamicImage::ImageLuma16(_)
        | DynamicImage::ImageLumaA16(_)
        | DynamicImage::ImageRgb16(_)
        | DynamicImage::ImageRgba16(_) => {
            let v: Vec<i64> = image
                .as_bytes()
                .chunks(2)
                .map(|b| i64::from(u16::from_ne_bytes([b[0], b[1]])))
                .collect();
            Tensor::from_slice(&v)
        }
        _ => Tensor::from_slice(image.as_bytes()).to_kind(Kind::Int64),
    };
    if c == 1 {
        t.view([h, w])
    } else {
        t.view([h, w, c])
    }
}

/// Samples within 1 of the reference, at most 0.5 % differing (2 % of 16-bit samples: see the
/// header); returns (max, differing fraction).
fn check_image(what: &str, ours: &DynamicImage, reference: &Tensor) -> (i64, f64) {
    let limit = if ours.color().bytes_per_pixel() / ours.color().channel_count() == 2 {
        0.02
    } else {
        0.005
    };
    let got = samples(ours);
    assert_eq!(got.size(), reference.size(), "{what}: shape");
    let diff = (got - reference.to_kind(Kind::Int64)).abs();
    let max = diff.max().int64_value(&[]);
    let frac = diff
        .gt(0)
        .to_kind(Kind::Double)
        .mean(Kind::Double)
        .double_value(&[]);
    println!(
        "{what}: max |diff| {max}, {:.3} % of samples differ",
        frac * 100.0
    );
    assert!(max <= 1, "{what}: max |diff| {max} > 1");
    assert!(
        frac <= limit,
        "{what}: {:.3} % of samples differ",
        frac * 100.0
    );
    (max, frac)
}

/// `[1, 3, H, W]` fp32 of an RGB8 image, as `enhance` scales it.
fn rgb_tensor(image: &DynamicImage) -> Tensor {
    let rgb = image.to_rgb8();
    let (w, h) = (i64::from(rgb.width()), i64::from(rgb.height()));
    (Tensor::from_slice(rgb.as_raw())
        .view([h, w, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        / 255.0)
        .unsqueeze(0)
}

#[test]
fn rrdbnet_matches_basicsr_in_every_file_format() {
    let r = reference();
    for file in [
        "tiny_x4.safetensors",
        "tiny_x4.pth",
        "tiny_x4_esrgan_names.pth",
    ] {
        let up = load(file);
        let c = up.config();
        assert_eq!(
            (c.scale, c.num_block, c.num_feat, c.num_grow_ch),
            (4, 2, 8, 4),
            "{file}"
        );
        let out = tch::no_grad(|| up.network().forward(&r["forward_x4.input"]));
        check(
            &format!("{file} forward"),
            &out,
            &r["forward_x4.output"],
            1e-5,
        );
    }
    for file in ["tiny_x2.safetensors", "tiny_x2.pth"] {
        let up = load(file);
        assert_eq!(
            up.config().scale,
            2,
            "{file}: detected as ×2 from conv_first's 12 inputs"
        );
        let out = tch::no_grad(|| up.network().forward(&r["forward_x2.input"]));
        check(
            &format!("{file} forward"),
            &out,
            &r["forward_x2.output"],
            1e-5,
        );
    }
}

#[test]
fn params_ema_wins_over_params_as_in_realesrgan() {
    let r = reference();
    let up = load("tiny_x4.pth");
    assert!(up.describe().contains("`params_ema`"), "{}", up.describe());
    let out = tch::no_grad(|| up.network().forward(&r["forward_x4.input"]));
    check("params_ema", &out, &r["forward_x4.output"], 1e-5);
    let other = support::rel_err(&out, &r["forward_x4_other.output"]);
    assert!(other > 0.1, "the `params` weights differ: {other}");
    assert!(load("tiny_x2.pth").describe().contains("`params`"));
}

/// Every `enhance` case of the fixture script: (reference name, model, input, options).
fn cases() -> Vec<(&'static str, &'static str, &'static str, UpscaleOptions)> {
    let full = options(None, 0, Blend::Crop);
    let crop = options(Some(16), 4, Blend::Crop);
    let feather = options(Some(16), 4, Blend::Feather);
    vec![
        ("x4_full", "tiny_x4.pth", "rgb8_37x29.png", full),
        ("x4_crop_16_4", "tiny_x4.pth", "rgb8_37x29.png", crop),
        (
            "x4_crop_16_4_prepad_3",
            "tiny_x4.pth",
            "rgb8_37x29.png",
            UpscaleOptions { pre_pad: 3, ..crop },
        ),
        ("x4_feather_16_4", "tiny_x4.pth", "rgb8_37x29.png", feather),
        (
            "x4_feather_12_3",
            "tiny_x4.pth",
            "rgb8_37x29.png",
            options(Some(12), 3, Blend::Feather),
        ),
        ("x2_full", "tiny_x2.pth", "rgb8_37x29.png", full),
        ("x2_crop_16_4", "tiny_x2.pth", "rgb8_37x29.png", crop),
        (
            "x2_feather_16_4",
            "tiny_x2.safetensors",
            "rgb8_37x29.png",
            feather,
        ),
        (
            "x4_rgba_crop_16_4",
            "tiny_x4.safetensors",
            "rgba8_37x29.png",
            crop,
        ),
        ("x4_rgba_full", "tiny_x4.pth", "rgba8_37x29.png", full),
        ("x4_grey_full", "tiny_x4.pth", "grey8_37x29.png", full),
        ("x4_rgb16_full", "tiny_x4.pth", "rgb16_23x19.png", full),
        (
            "x4_outscale2_full",
            "tiny_x4.pth",
            "rgb8_37x29.png",
            UpscaleOptions {
                outscale: Some(2),
                ..full
            },
        ),
        (
            "x4_rgba_outscale2_full",
            "tiny_x4.pth",
            "rgba8_37x29.png",
            UpscaleOptions {
                outscale: Some(2),
                ..full
            },
        ),
        (
            "x2_outscale4_full",
            "tiny_x2.pth",
            "rgb8_37x29.png",
            UpscaleOptions {
                outscale: Some(4),
                ..full
            },
        ),
    ]
}

#[test]
fn upscaled_images_match_realesrgan_enhance() {
    let r = reference();
    for (name, model, file, opts) in cases() {
        let up = load(model);
        let image = input(file);
        let out = upscale(&up, &image, &opts);
        assert_eq!(
            out.color(),
            image.color(),
            "{name}: the layout (alpha, grey, 16 bits) is kept"
        );
        check_image(name, &out, &r[&format!("{name}.image")]);
        // Float level, before rounding: the colour image of RGB(A) inputs at the network's scale.
        if matches!(
            image,
            DynamicImage::ImageRgb8(_) | DynamicImage::ImageRgba8(_)
        ) && opts.outscale.is_none()
        {
            let f = up
                .upscale_tensor(&rgb_tensor(&image), &opts, &mut |_, _| {}, &|| false)
                .expect("upscale_tensor");
            check(
                &format!("{name} float"),
                &f,
                &r[&format!("{name}.float")],
                1e-5,
            );
        }
    }
}

#[test]
fn tiles_stay_close_to_the_full_frame_and_batching_changes_nothing() {
    // The tiny network has a receptive field wider than the tests' tiles and no trained
    // locality, so tiles differ from the full frame (relative, measured: crop 1.8e-4, feather
    // 5.6e-3 at tile 16 / overlap 4); the bounds (1e-3, 2e-2) catch a broken merge, which is off
    // by whole tiles.
    let up = load("tiny_x4.pth");
    let x = rgb_tensor(&input("rgb8_37x29.png"));
    let run = |opts: &UpscaleOptions| {
        up.upscale_tensor(&x, opts, &mut |_, _| {}, &|| false)
            .expect("upscale_tensor")
    };
    let full = run(&options(None, 0, Blend::Crop));
    let crop = support::rel_err(&run(&options(Some(16), 4, Blend::Crop)), &full);
    let feather = support::rel_err(&run(&options(Some(16), 4, Blend::Feather)), &full);
    println!("tiled vs full frame: crop {crop:.2e}, feather {feather:.2e}");
    assert!(crop <= 1e-3, "crop: {crop:.2e}");
    assert!(feather <= 2e-2, "feather: {feather:.2e}");

    // A tile larger than the image is the full frame, exactly.
    let one = run(&options(Some(64), 8, Blend::Feather));
    assert!(
        one.equal(&full),
        "one tile covering the image is the full frame"
    );

    // Tiles batched four at a time equal tiles run one by one.
    let one_by_one = run(&UpscaleOptions {
        tiles: TileSettings {
            max_batch: 1,
            ..options(Some(12), 3, Blend::Feather).tiles
        },
        ..options(Some(12), 3, Blend::Feather)
    });
    let batched = run(&options(Some(12), 3, Blend::Feather));
    check("batched vs one by one", &batched, &one_by_one, 1e-6);
}

#[test]
fn channels_last_gives_the_same_output() {
    let mut up = load("tiny_x4.pth");
    let x = rgb_tensor(&input("rgb8_37x29.png"));
    let opts = options(Some(16), 4, Blend::Feather);
    let nchw = up
        .upscale_tensor(&x, &opts, &mut |_, _| {}, &|| false)
        .unwrap();
    up.set_memory_format(vnfarm_models::esrgan::rrdbnet::MemoryFormat::ChannelsLast);
    let nhwc = up
        .upscale_tensor(&x, &opts, &mut |_, _| {}, &|| false)
        .unwrap();
    check("channels-last vs contiguous", &nhwc, &nchw, 1e-5);
}

#[test]
fn progress_counts_tiles_and_cancel_stops_between_them() {
    let up = load("tiny_x4.pth");
    let image = input("rgb8_37x29.png");
    let opts = UpscaleOptions {
        tiles: TileSettings {
            max_batch: 1,
            ..options(Some(16), 4, Blend::Feather).tiles
        },
        ..options(Some(16), 4, Blend::Feather)
    };
    let mut seen = Vec::new();
    up.upscale(
        &image,
        &opts,
        &mut |done, total| seen.push((done, total)),
        &|| false,
    )
    .expect("upscale");
    // 37×29 at tile 16: 3 columns × 2 rows.
    assert_eq!(seen, (1..=6).map(|d| (d, 6)).collect::<Vec<_>>());

    let calls = std::cell::Cell::new(0);
    let err = up
        .upscale(&image, &opts, &mut |_, _| {}, &|| {
            calls.set(calls.get() + 1);
            calls.get() > 2
        })
        .unwrap_err();
    assert!(matches!(err, GenerateError::Cancelled), "{err}");
    assert_eq!(calls.get(), 3, "two tiles ran, the third was not started");
}

#[test]
fn half_precision_stays_close_to_fp32() {
    let r = reference();
    let image = input("rgb8_37x29.png");
    for (kind, bound) in [(Kind::Half, 1.0), (Kind::BFloat16, 3.0)] {
        let up = Upscaler::load(&fixtures().join("tiny_x4.pth"), Device::Cpu, kind).expect("load");
        let out = upscale(&up, &image, &options(Some(16), 4, Blend::Crop));
        let diff = (samples(&out) - r["x4_crop_16_4.image"].to_kind(Kind::Int64))
            .abs()
            .to_kind(Kind::Double);
        let (mean, max) = (
            diff.mean(Kind::Double).double_value(&[]),
            diff.max().double_value(&[]),
        );
        println!("{kind:?} vs fp32 reference: mean {mean:.3}/255, max {max}/255");
        assert!(mean <= bound, "{kind:?}: mean {mean:.3}/255 > {bound}");
    }
}

#[test]
fn tiny_images_are_padded_without_failing() {
    // 1×1 and 3×2 inputs: too small to reflect-pad for the ×2 model's even size or pre_pad 10.
    let up = load("tiny_x2.pth");
    for (w, h) in [(1, 1), (3, 2)] {
        let image = DynamicImage::ImageRgb8(image::RgbImage::from_pixel(
            w,
            h,
            image::Rgb([90, 120, 200]),
        ));
        for pre_pad in [0, 10] {
            let opts = UpscaleOptions {
                pre_pad,
                ..options(Some(16), 4, Blend::Feather)
            };
            let out = upscale(&up, &image, &opts);
            assert_eq!((out.width(), out.height()), (2 * w, 2 * h));
        }
    }
}

#[test]
fn lanczos4_matches_opencv() {
    let r = reference();
    let src = &r["lanczos4.u8.source"];
    let (h, w) = (src.size()[0] as usize, src.size()[1] as usize);
    let rgb: Vec<u8> = Vec::<i64>::try_from(src.reshape([-1]))
        .unwrap()
        .into_iter()
        .map(|v| v as u8)
        .collect();
    let mut cases = 0;
    for (name, expected) in &r {
        let Some(rest) = name.strip_prefix("lanczos4.u8.c") else {
            continue;
        };
        let (cn, size) = rest.split_once('.').unwrap();
        let cn: usize = cn.parse().unwrap();
        let (dw, dh) = size.split_once('x').unwrap();
        let (dw, dh): (usize, usize) = (dw.parse().unwrap(), dh.parse().unwrap());
        let source: Vec<u8> = match cn {
            1 => rgb.chunks(3).map(|p| p[0]).collect(),
            3 => rgb.clone(),
            _ => rgb
                .chunks(3)
                .flat_map(|p| [p[0], p[1], p[2], p[0]])
                .collect(),
        };
        let layout = Layout {
            width: w,
            height: h,
            channels: cn,
        };
        let ours = lanczos4::resize_u8(&source, layout, dw, dh);
        let theirs: Vec<u8> = Vec::<i64>::try_from(expected.reshape([-1]))
            .unwrap()
            .into_iter()
            .map(|v| v as u8)
            .collect();
        let differing = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        assert_eq!(differing, 0, "{name}: {differing} bytes differ from OpenCV");
        cases += 1;
    }
    assert_eq!(cases, 18);

    let img = input("rgb16_23x19.png").into_rgb16();
    for (dw, dh) in [(46, 38), (11, 9)] {
        let ours = lanczos4::resize_u16(
            img.as_raw(),
            Layout {
                width: 23,
                height: 19,
                channels: 3,
            },
            dw,
            dh,
        );
        let theirs =
            Vec::<i64>::try_from(r[&format!("lanczos4.u16.c3.{dw}x{dh}")].reshape([-1])).unwrap();
        let max = ours
            .iter()
            .zip(&theirs)
            .map(|(&a, &b)| (i64::from(a) - b).abs())
            .max()
            .unwrap();
        assert!(max <= 1, "16-bit {dw}x{dh}: max |diff| {max}");
    }
}

fn load_err(path: &Path) -> String {
    let err = Upscaler::load(path, Device::Cpu, Kind::Float).unwrap_err();
    let msg = err.to_string();
    println!("{}: {msg}", path.display());
    assert!(
        msg.contains(&path.display().to_string()),
        "the error names the file: {msg}"
    );
    msg
}

#[test]
fn bad_checkpoints_are_refused_with_the_reason() {
    let bad = fixtures().join("bad");
    let msg = load_err(&bad.join("evil_global.pth"));
    assert!(
        msg.contains("`posix.system`") && msg.contains("only tensors and plain containers"),
        "{msg}"
    );
    let msg = load_err(&bad.join("legacy.pth"));
    assert!(msg.contains("pre-1.6"), "{msg}");
    let msg = load_err(&support::derived::esrgan_extra_key(&support::fixture_root()));
    assert!(
        msg.contains("conv_extra.weight") && msg.contains("×4, 2 blocks"),
        "{msg}"
    );
    let err = Upscaler::load(&bad.join("bad_shape.pth"), Device::Cpu, Kind::Float).unwrap_err();
    match &err {
        LoadError::Shape {
            tensor,
            expected,
            found,
            ..
        } => {
            assert_eq!(tensor, "conv_hr.weight");
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[8, 8, 3, 3][..], &[8, 8, 1, 1][..])
            );
        }
        other => panic!("expected a shape error, got {other}"),
    }

    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixtures().join("tiny_x4.pth")).unwrap();
    let cut = dir.path().join("truncated.pth");
    std::fs::write(&cut, &good[..good.len() * 2 / 3]).unwrap();
    let msg = load_err(&cut);
    assert!(msg.contains("zip") || msg.contains("truncated"), "{msg}");
    let text = dir.path().join("notes.pth");
    std::fs::write(&text, "not a model at all").unwrap();
    assert!(load_err(&text).contains("neither a PyTorch zip checkpoint nor a safetensors file"));
    let sd = dir.path().join("sdxl_like.safetensors");
    std::fs::copy(
        support::derived::sdxl_tiny_ldm(&support::fixture_root()),
        &sd,
    )
    .unwrap();
    assert!(load_err(&sd).contains("not an RRDBNet"));
}
