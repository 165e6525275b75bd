//! Golden tests of the Qwen-Image VAE (`qwen_image::vae`) against diffusers'
//! `AutoencoderKLQwenImage` on the tiny fixture VAE (`fixtures/qwen/make_vae_reference.py`),
//! loaded from the diffusers folder and from the Wan-named ComfyUI-style single file (the folder's
//! tensors under Wan names, written at test time by `support::derived`); plus the real-size layout
//! (names and shapes of the real checkpoint) and loading errors.
//!
//! Relative error is `max|a − b| / max|b|` over the whole tensor (b = the fp32 reference); fp32
//! must be within 1e-5 (measured on CPU: encode 1.0e-6, decode 2.1e-6, tiled encode 9.8e-7, tiled
//! decode 1.2e-6, normalize/denormalize exact; the same from both files). bf16 weights and
//! activations must stay within 5e-2 of the fp32 reference (measured: at most 2.4e-2).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::error::LoadError;
use vnfarm_models::loading::diffusers::{component_store, read_config};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{Transform, WeightStore, Weights};
use vnfarm_models::nn::fused::NormKernels;
use vnfarm_models::nn::tiling::Tiling;
use vnfarm_models::nn::{MemoryFormat, is_channels_last};
use vnfarm_models::qwen_image::keys::{VaeNaming, vae_weight_store, wan_vae_key};
use vnfarm_models::qwen_image::vae::{QwenVae, QwenVaeConfig};

use crate::qwen_fixtures::fixtures;
use crate::support;
use crate::support::{check, load_reference, rel_err};

const TOL_FP32: f64 = 1e-5;
const TOL_BF16: f64 = 5e-2;

fn vae_dir() -> PathBuf {
    fixtures().join("qwen_tiny").join("vae")
}

/// `comfy/vae_wan.safetensors`, written from the folder's file at test time.
fn wan_file() -> PathBuf {
    support::derived::qwen_vae_wan(&support::fixture_root())
}

fn reference() -> HashMap<String, Tensor> {
    load_reference(&fixtures().join("reference").join("vae.safetensors")).0
}

fn tiny_config() -> QwenVaeConfig {
    let c = read_config(&vae_dir().join("config.json"), QwenVaeConfig::from_json)
        .expect("vae/config.json");
    assert_eq!(
        c,
        QwenVaeConfig::tiny(),
        "tiny() preset = the fixture's config.json"
    );
    c
}

fn folder_store() -> WeightStore {
    component_store(&vae_dir(), "diffusion_pytorch_model", |k| {
        Some(k.to_string())
    })
    .expect("vae folder")
}

fn wan_store() -> WeightStore {
    vae_weight_store(&wan_file(), QwenVaeConfig::tiny().num_res_blocks).expect("vae_wan file")
}

fn load(store: WeightStore, kind: Kind) -> QwenVae {
    let store = Arc::new(store);
    let vae = QwenVae::new(
        &Weights::new(store.clone(), Device::Cpu, kind),
        &tiny_config(),
    )
    .expect("tiny VAE loads");
    assert_eq!(store.unused(), Vec::<String>::new(), "every tensor is used");
    vae
}

/// Runs every reference case through `vae` in `kind`; returns the largest relative error.
fn run_all(name: &str, vae: QwenVae, kind: Kind, tol: f64) -> f64 {
    let r = reference();
    let x = |k: &str| r[k].to_kind(kind);
    let mut errs = Vec::new();
    let mut c = |what: &str, a: Tensor, b: &str| {
        errs.push(check(
            &format!("{name} {what}"),
            &a.to_kind(Kind::Float),
            &r[b],
            tol,
        ));
    };
    let vae = vae.with_tiling(Tiling::Never);
    for hw in ["40x48", "64x64"] {
        let m = vae.encode_mean(&x(&format!("image_{hw}"))).expect("encode");
        c(&format!("encode {hw}"), m, &format!("encode_mean_{hw}"));
    }
    let d = vae.decode(&x("latents_10x12")).expect("decode");
    c("decode 10x12 (batch 2)", d, "decode_10x12");
    c(
        "normalize",
        vae.normalize(&x("encode_mean_40x48")),
        "normalized_40x48",
    );
    c(
        "denormalize",
        vae.denormalize(&x("latents_10x12")),
        "denormalized_10x12",
    );
    errs.push(run_tiled(name, kind, tol, &r));
    errs.into_iter().fold(0.0, f64::max)
}

/// The reference's tiling: `enable_tiling(32, 32, 24, 24)` (tiny spatial factor 4).
fn tiled_config() -> QwenVaeConfig {
    let c = QwenVaeConfig {
        tile_sample_min_height: 32,
        tile_sample_min_width: 32,
        tile_sample_stride_height: 24,
        tile_sample_stride_width: 24,
        ..tiny_config()
    };
    c.validate().expect("tile geometry");
    c
}

fn run_tiled(name: &str, kind: Kind, tol: f64, r: &HashMap<String, Tensor>) -> f64 {
    let store = if name.starts_with("wan") {
        wan_store()
    } else {
        folder_store()
    };
    let vae = QwenVae::new(
        &Weights::new(Arc::new(store), Device::Cpu, kind),
        &tiled_config(),
    )
    .expect("loads")
    .with_tiling(Tiling::Always);
    let m = vae
        .encode_mean(&r["image_96x80"].to_kind(kind))
        .expect("tiled encode");
    let e1 = check(
        &format!("{name} tiled encode 96x80"),
        &m.to_kind(Kind::Float),
        &r["tiled_encode_mean_96x80"],
        tol,
    );
    let d = vae
        .decode(&r["latents_24x20"].to_kind(kind))
        .expect("tiled decode");
    let e2 = check(
        &format!("{name} tiled decode 24x20"),
        &d.to_kind(Kind::Float),
        &r["tiled_decode_24x20"],
        tol,
    );
    // Auto with the image below the threshold (2048 px): untiled, far from the tiled reference.
    let untiled = vae.with_tiling(Tiling::Auto);
    let m2 = untiled
        .encode_mean(&r["image_96x80"].to_kind(kind))
        .expect("encode");
    let e3 = rel_err(&m2.to_kind(Kind::Float), &r["tiled_encode_mean_96x80"]);
    println!("{name} untiled vs tiled encode 96x80: relative difference {e3:.3e}");
    assert!(e3 > 10.0 * tol, "Auto below the threshold must not tile");
    e1.max(e2)
}

#[test]
fn diffusers_folder_matches_diffusers_in_fp32() {
    let worst = run_all(
        "folder",
        load(folder_store(), Kind::Float),
        Kind::Float,
        TOL_FP32,
    );
    println!("folder fp32 worst relative error {worst:.3e}");
}

#[test]
fn wan_single_file_matches_diffusers_in_fp32() {
    let store = wan_store();
    let worst = run_all("wan", load(store, Kind::Float), Kind::Float, TOL_FP32);
    println!("wan fp32 worst relative error {worst:.3e}");
}

/// NHWC convolutions (`MemoryFormat::ChannelsLast`, the box check's VAE candidate) compute the
/// same network: the reference cases within the same tolerance, and the weights and outputs in
/// NHWC order where they are 4-D.
#[test]
fn channels_last_matches_diffusers_in_fp32() {
    let mut vae = load(folder_store(), Kind::Float);
    vae.set_memory_format(MemoryFormat::ChannelsLast);
    assert_eq!(vae.memory_format(), MemoryFormat::ChannelsLast);
    let r = reference();
    let out = vae.decode(&r["latents_10x12"]).expect("decode");
    assert!(
        is_channels_last(&out),
        "the decode ran NHWC: {:?}",
        out.stride()
    );
    let worst = run_all("folder channels-last", vae, Kind::Float, TOL_FP32);
    println!("channels-last fp32 worst relative error {worst:.3e}");
}

/// The fused RMS norm is a CUDA/HIP kernel for bf16: elsewhere (here: the CPU, fp32) the setting
/// takes libtorch's path, so the reference cases hold unchanged. The kernel itself is checked in
/// emulation (`qwen_kernels_emulated`).
#[test]
fn the_fused_norm_setting_falls_back_where_the_kernel_does_not_apply() {
    let mut vae = load(folder_store(), Kind::Float);
    vae.set_norm_kernels(NormKernels::Fused)
        .expect("nothing to compile on the CPU");
    assert_eq!(vae.norm_kernels(), NormKernels::Fused);
    let worst = run_all("folder fused-norm setting", vae, Kind::Float, TOL_FP32);
    println!("fused-norm setting on the CPU, worst relative error {worst:.3e}");
}

#[test]
fn bf16_stays_close_to_fp32() {
    let worst = run_all(
        "folder bf16",
        load(folder_store(), Kind::BFloat16),
        Kind::BFloat16,
        TOL_BF16,
    );
    println!("bf16 worst relative error {worst:.3e}");
}

#[test]
fn naming_is_detected_from_the_keys() {
    let f = SafetensorsFile::open(wan_file()).expect("wan file");
    assert_eq!(VaeNaming::detect(f.names()), VaeNaming::Wan);
    let f = SafetensorsFile::open(vae_dir().join("diffusion_pytorch_model.safetensors"))
        .expect("diffusers file");
    assert_eq!(VaeNaming::detect(f.names()), VaeNaming::Diffusers);
}

/// Names and shapes of the real `AutoencoderKLQwenImage()` state dict, and its Wan names.
fn real_layout() -> (HashMap<String, Vec<i64>>, HashMap<String, String>) {
    let text = std::fs::read_to_string(fixtures().join("reference").join("vae_real_layout.json"))
        .expect("vae_real_layout.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let shapes = serde_json::from_value(v["diffusers"].clone()).expect("diffusers shapes");
    let wan = serde_json::from_value(v["wan"].clone()).expect("wan names");
    (shapes, wan)
}

#[test]
fn qwen_image_preset_asks_for_exactly_the_real_checkpoint() {
    let (shapes, _) = real_layout();
    let n = shapes.len();
    let store = Arc::new(WeightStore::placeholders(shapes));
    let vae = QwenVae::new(
        &Weights::new(store.clone(), Device::Cpu, Kind::Float),
        &QwenVaeConfig::qwen_image(),
    )
    .expect("the real preset loads the real layout");
    assert_eq!(store.unused(), Vec::<String>::new(), "all {n} tensors used");
    assert_eq!(vae.config().spatial_compression_ratio(), 8);
}

#[test]
fn wan_names_of_the_real_checkpoint_map_to_diffusers() {
    let (shapes, wan) = real_layout();
    let nrb = QwenVaeConfig::qwen_image().num_res_blocks;
    for (wan_name, diffusers_name) in &wan {
        assert_eq!(
            wan_vae_key(wan_name, nrb).as_deref(),
            Some(diffusers_name.as_str()),
            "{wan_name}"
        );
        assert!(shapes.contains_key(diffusers_name));
    }
    assert_eq!(wan.len(), shapes.len());
}

#[test]
fn config_json_of_the_real_model_is_the_preset() {
    // Qwen/Qwen-Image-Edit-2509 vae/config.json (its fields as published).
    let text = r#"{"_class_name": "AutoencoderKLQwenImage", "_diffusers_version": "0.34.0.dev0",
        "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
        "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
            0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
        "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687,
            2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
        "num_res_blocks": 2, "temperal_downsample": [false, true, true], "z_dim": 16}"#;
    assert_eq!(
        QwenVaeConfig::from_json(text).expect("parses"),
        QwenVaeConfig::qwen_image()
    );
    let bad = text.replace("\"attn_scales\": []", "\"attn_scales\": [0.5]");
    assert!(QwenVaeConfig::from_json(&bad).is_err());
    let bad = text.replace("[false, true, true]", "[false, true]");
    assert!(QwenVaeConfig::from_json(&bad).is_err());
}

/// A copy of the fixture folder's VAE file with one tensor dropped or replaced, as a store.
fn store_with(edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> (WeightStore, PathBuf) {
    let src = vae_dir().join("diffusion_pytorch_model.safetensors");
    let f = SafetensorsFile::open(&src).expect("vae file");
    let mut tensors: HashMap<String, Tensor> = f
        .names()
        .map(|n| {
            (
                n.to_string(),
                f.load(n, Device::Cpu, Kind::Float).expect("t"),
            )
        })
        .collect();
    edit(&mut tensors);
    let dir = std::env::temp_dir().join(format!("qwen_vae_test_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join(format!("edited_{}.safetensors", tensors.len()));
    let list: Vec<(String, Tensor)> = tensors.into_iter().collect();
    Tensor::write_safetensors(&list, &path).expect("write");
    let file = Arc::new(SafetensorsFile::open(&path).expect("reopen"));
    let mut store = WeightStore::default();
    let idx = store.add_file(file.clone());
    for n in file.names() {
        store.insert(n.to_string(), idx, n.to_string(), Transform::Identity);
    }
    (store, path)
}

fn load_err(store: WeightStore) -> LoadError {
    QwenVae::new(
        &Weights::new(Arc::new(store), Device::Cpu, Kind::Float),
        &QwenVaeConfig::tiny(),
    )
    .expect_err("must fail")
}

#[test]
fn a_missing_tensor_is_an_error_naming_tensor_and_file() {
    let name = "encoder.down_blocks.2.conv_shortcut.weight";
    let (store, path) = store_with(|t| {
        assert!(t.remove(name).is_some(), "{name} is in the fixture");
    });
    let err = load_err(store);
    let msg = err.to_string();
    assert!(matches!(err, LoadError::Missing { .. }), "{msg}");
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    std::fs::remove_file(path).ok();
}

#[test]
fn a_misshaped_tensor_is_an_error_naming_tensor_and_file() {
    let name = "encoder.down_blocks.0.conv1.weight";
    let (store, path) = store_with(|t| {
        let w = t.get(name).expect("present");
        // A 2-D kernel where the 3-D one belongs (5-D [24, 24, 3, 3, 3] expected).
        let w2 = w.select(2, 2).contiguous();
        t.insert(name.to_string(), w2);
    });
    let err = load_err(store);
    let msg = err.to_string();
    assert!(matches!(err, LoadError::Shape { .. }), "{msg}");
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    std::fs::remove_file(path).ok();
}

#[test]
fn wrong_inputs_are_rejected_not_panics() {
    let vae = load(folder_store(), Kind::Float);
    assert!(
        vae.encode_mean(&Tensor::zeros([1, 4, 8, 8], (Kind::Float, Device::Cpu)))
            .is_err()
    );
    assert!(
        vae.encode_mean(&Tensor::zeros([1, 3, 10, 8], (Kind::Float, Device::Cpu)))
            .is_err()
    );
    assert!(
        vae.decode(&Tensor::zeros([1, 3, 8], (Kind::Float, Device::Cpu)))
            .is_err()
    );
}
