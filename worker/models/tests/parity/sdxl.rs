//! Golden tests against diffusers / transformers / compel on the tiny SDXL fixtures of
//! `fixtures/sdxl/make_sdxl_fixtures.py`, loading both the diffusers folder and the ldm single file
//! (the folder's tensors under ldm names in fp16, written at test time by `support::derived`).
//!
//! Relative error is `max|a − b| / max|b|` over the whole tensor (b = reference); components must
//! be within 1e-4 in fp32. Images: mean absolute error over all RGB8 values, in units of 1/255,
//! must be ≤ 1.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::error::{GenerateError, LoadError};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{WeightStore, Weights};
use vnfarm_models::nn::fused::NormKernels;
use vnfarm_models::nn::{AttentionImpl, FfGelu, MemoryFormat};
use vnfarm_models::noise;
use vnfarm_models::schedulers::PredictionType;
use vnfarm_models::schedulers::{Sampler, Scheduler, SchedulerConfig};
use vnfarm_models::sdxl::clip::{ClipTextConfig, ClipTextModel};
use vnfarm_models::sdxl::ldm;
use vnfarm_models::sdxl::pipeline::{
    ComponentConfigs, GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline,
};
use vnfarm_models::sdxl::unet::{AddedCond, UNet2DConditionModel, UNetConfig};
use vnfarm_models::sdxl::vae::{AutoencoderKL, TiledDecode, Tiling, VaeConfig, VaeRuntime};
use vnfarm_models::text::clip_tokenizer::ClipTokenizer;

use crate::support;
use crate::support::{check, load_reference};

const TOL: f64 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("sdxl")
}

fn folder() -> PathBuf {
    fixtures().join("sdxl_tiny")
}

/// `sdxl_tiny_ldm.safetensors`, written from the folder at test time.
fn single_file() -> PathBuf {
    support::derived::sdxl_tiny_ldm(&support::fixture_root())
}

/// The `fixture` metadata (a JSON object) of a reference file.
fn fixture_meta(f: &SafetensorsFile) -> serde_json::Value {
    serde_json::from_str(&f.metadata()["fixture"]).expect("fixture metadata")
}

/// All tensors of a reference file (floats as fp32).
fn reference(name: &str) -> (HashMap<String, Tensor>, SafetensorsFile) {
    load_reference(&fixtures().join("reference").join(name))
}

/// The four component stores of a format: `[unet, vae, clip_l, clip_g]`.
fn stores(format: &str) -> [WeightStore; 4] {
    if format == "ldm" {
        let f = Arc::new(SafetensorsFile::open(single_file()).expect("ldm file"));
        let s = ldm::stores(f, 2, 2);
        [s.unet, s.vae, s.clip_l, s.clip_g]
    } else {
        let file = |rel: &str| {
            Arc::new(SafetensorsFile::open(folder().join(rel)).expect("diffusers file"))
        };
        let clip =
            |rel: &str| WeightStore::renamed(file(rel), vnfarm_models::sdxl::clip::canonical_key);
        [
            WeightStore::identity(file("unet/diffusion_pytorch_model.safetensors")),
            WeightStore::identity(file("vae/diffusion_pytorch_model.safetensors")),
            clip("text_encoder/model.safetensors"),
            clip("text_encoder_2/model.safetensors"),
        ]
    }
}

fn weights(s: WeightStore) -> Weights {
    Weights::new(Arc::new(s), Device::Cpu, Kind::Float)
}

const FORMATS: [&str; 2] = ["diffusers", "ldm"];

#[test]
fn text_encoders_match_transformers() {
    let _g = tch::no_grad_guard();
    let (r, _) = reference("text_encoders.safetensors");
    for format in FORMATS {
        let [_, _, l, g] = stores(format);
        for (name, store, cfg) in [
            ("te1", l, ClipTextConfig::tiny(false)),
            ("te2", g, ClipTextConfig::tiny(true)),
        ] {
            let m = ClipTextModel::new(&weights(store), &cfg, AttentionImpl::Sdpa).expect("load");
            let ids = &r[&format!("{name}.ids")];
            let o = m.forward(ids, None);
            check(
                &format!("{format} {name} penultimate"),
                &o.penultimate,
                &r[&format!("{name}.penultimate")],
                TOL,
            );
            check(
                &format!("{format} {name} last hidden"),
                &o.last_hidden,
                &r[&format!("{name}.last_hidden")],
                TOL,
            );
            if name == "te1" {
                check(
                    &format!("{format} {name} pooled"),
                    &o.pooled,
                    &r["te1.pooled"],
                    TOL,
                );
            } else {
                let te = o.text_embeds.expect("te2 has a projection");
                check(
                    &format!("{format} {name} text_embeds"),
                    &te,
                    &r["te2.text_embeds"],
                    TOL,
                );
            }
            let masked = m.forward(ids, Some(&r[&format!("{name}.mask")]));
            check(
                &format!("{format} {name} masked penultimate"),
                &masked.penultimate,
                &r[&format!("{name}.masked_penultimate")],
                TOL,
            );
        }
    }
}

#[test]
fn unet_matches_diffusers() {
    let _g = tch::no_grad_guard();
    let (r, _) = reference("unet.safetensors");
    for format in FORMATS {
        for imp in [AttentionImpl::Sdpa, AttentionImpl::Matmul] {
            let [u, ..] = stores(format);
            let unet =
                UNet2DConditionModel::new(&weights(u), &UNetConfig::tiny(), imp).expect("load");
            for case in 0..2 {
                let k = |n: &str| &r[&format!("{case}.{n}")];
                let out = unet.forward(
                    k("sample"),
                    k("timestep"),
                    k("context"),
                    &AddedCond {
                        text_embeds: k("text_embeds"),
                        time_ids: k("time_ids"),
                    },
                );
                check(
                    &format!("{format} {imp:?} unet case {case}"),
                    &out,
                    k("out"),
                    TOL,
                );
            }
        }
    }
}

/// The tiny UNet from the diffusers-format files, set up by `setup`, on both reference cases: each
/// output within `TOL` of diffusers', after `more` has checked it.
fn configured_unet_matches_diffusers(
    what: &str,
    setup: impl FnOnce(&mut UNet2DConditionModel),
    more: impl Fn(usize, &Tensor),
) {
    let _g = tch::no_grad_guard();
    let (r, _) = reference("unet.safetensors");
    let [u, ..] = stores("diffusers");
    let mut unet = UNet2DConditionModel::new(&weights(u), &UNetConfig::tiny(), AttentionImpl::Sdpa)
        .expect("load");
    setup(&mut unet);
    for case in 0..2 {
        let k = |n: &str| &r[&format!("{case}.{n}")];
        let added = AddedCond {
            text_embeds: k("text_embeds"),
            time_ids: k("time_ids"),
        };
        let out = unet.forward(k("sample"), k("timestep"), k("context"), &added);
        more(case, &out);
        check(&format!("{what} unet case {case}"), &out, k("out"), TOL);
    }
}

/// The feed-forward GELU in the matmul's epilogue (`FfGelu::Epilogue`, through the operator shim):
/// on the CPU the epilogue is the matmul and then erf GELU, so the UNet matches diffusers as
/// tightly as the separate GELU. (On CUDA cuBLASLt's epilogue computes the tanh approximation; what
/// that moves is measured in docs/performance.md, kernels attempt 8.)
#[test]
fn unet_with_gelu_in_the_matmul_epilogue_matches_diffusers() {
    configured_unet_matches_diffusers(
        "epilogue GELU",
        |unet| unet.set_ff_gelu(FfGelu::Epilogue),
        |_, _| {},
    );
}

/// The UNet run NHWC (`MemoryFormat::ChannelsLast`: weights and activations channels-last) matches
/// diffusers as the NCHW one does, and gives an NCHW output.
#[test]
fn unet_in_channels_last_matches_diffusers() {
    configured_unet_matches_diffusers(
        "channels-last",
        |unet| unet.set_memory_format(MemoryFormat::ChannelsLast),
        |case, out| assert!(out.is_contiguous(), "case {case}: NCHW output"),
    );
}

/// The UNet with `NormKernels::Fused` in both layouts. The CPU has no fused kernels, so every
/// normalisation takes libtorch's operators, but in the fused forwards' order: the time embedding
/// added inside the second GroupNorm of each ResNet, each residual add paired with the LayerNorm
/// after it (across blocks too). Those must match diffusers as the plain forward does; the
/// kernels themselves are checked on the GPU (`bench components --norms-check`).
#[test]
fn unet_with_fused_norm_kernels_setting_matches_diffusers() {
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        configured_unet_matches_diffusers(
            &format!("fused norms {format:?}"),
            |unet| {
                unet.set_memory_format(format);
                unet.set_norm_kernels(NormKernels::Fused);
            },
            |_, _| {},
        );
    }
}

fn tiny_vae(format: &str, tile: i64) -> AutoencoderKL {
    let [_, v, ..] = stores(format);
    let mut cfg = VaeConfig::tiny();
    cfg.tile_sample_size = tile;
    AutoencoderKL::new(&weights(v), &cfg, AttentionImpl::Sdpa).expect("load vae")
}

#[test]
fn vae_matches_diffusers() {
    let _g = tch::no_grad_guard();
    let (r, _) = reference("vae.safetensors");
    for format in FORMATS {
        let vae = tiny_vae(format, 128);
        let d = vae.encode(&r["image"], Tiling::Never);
        check(
            &format!("{format} vae encode mean"),
            &d.mean,
            &r["mean"],
            TOL,
        );
        check(
            &format!("{format} vae encode logvar"),
            &d.logvar,
            &r["logvar"],
            TOL,
        );
        check(
            &format!("{format} vae decode"),
            &vae.decode(&r["z"], Tiling::Never),
            &r["decoded"],
            TOL,
        );
        check(
            &format!("{format} vae decode 40x40 latent"),
            &vae.decode(&r["z_big"], Tiling::Never),
            &r["decoded_big"],
            TOL,
        );
        // Tiled with 32 px tiles, as diffusers' tiled_decode / tiled_encode.
        let tiled = tiny_vae(format, 32);
        let dec = tiled.decode(&r["z_big"], Tiling::Always);
        check(
            &format!("{format} vae tiled decode vs diffusers tiled"),
            &dec,
            &r["decoded_big_tiled"],
            TOL,
        );
        let enc = tiled.encode(&r["image_big"], Tiling::Always);
        check(
            &format!("{format} vae tiled encode vs diffusers tiled"),
            &enc.mean,
            &r["mean_big_tiled"],
            TOL,
        );
    }
}

#[test]
fn vae_tiled_decode_is_close_to_untiled() {
    // Tiles normalise with their own GroupNorm statistics, so tiling is an approximation; on the
    // tiny random VAE (80x80 output, 32 px tiles, 8 px blend) the measured gap is stated here.
    let _g = tch::no_grad_guard();
    let (r, _) = reference("vae.safetensors");
    let z = &r["z_big"];
    let untiled = tiny_vae("diffusers", 128).decode(z, Tiling::Never);
    let tiled = tiny_vae("diffusers", 32).decode(z, Tiling::Always);
    let mae = (&tiled - &untiled)
        .abs()
        .mean(Kind::Float)
        .double_value(&[]);
    let range = untiled.abs().max().double_value(&[]);
    println!("tiled vs untiled decode: mean abs diff {mae:.4e}, max|untiled| {range:.3}");
    assert!(
        mae / range <= 0.1,
        "tiled decode drifts from untiled: {mae} / {range}"
    );
}

#[test]
fn seam_free_tiled_decode_equals_untiled_with_exact_statistics() {
    // With statistics of the whole image (stride 1) and the receptive-field margin, every tile's
    // core is what the untiled decode computes there; 10x10 latent pixels per tile on a 40x40
    // latent, so 16 tiles, 8 of them touching no image border.
    let _g = tch::no_grad_guard();
    let (r, _) = reference("vae.safetensors");
    let z = &r["z_big"];
    let vae = tiny_vae("diffusers", 128);
    let margin = vae.config().tiled_receptive_radius();
    let plan = |stats_stride| TiledDecode {
        core: 10,
        margin,
        stats_stride,
    };
    let untiled = vae.decode(z, Tiling::Never);
    check(
        "seam-free tiled decode, exact statistics",
        &vae.decode_tiled(z, plan(1)),
        &untiled,
        TOL,
    );
    // Statistics from every second latent pixel: the estimate's error, stated here (random
    // latents and weights have no spatial structure, the hard case for a subsample).
    let approx = vae.decode_tiled(z, plan(2));
    let diff = (&approx - &untiled).abs();
    let range = untiled.abs().max().double_value(&[]);
    let (mean, max) = (
        diff.mean(Kind::Float).double_value(&[]) / range,
        diff.max().double_value(&[]) / range,
    );
    println!(
        "seam-free tiled decode, 2x subsample: error mean {mean:.3e}, max {max:.3e} of max|untiled|"
    );
    assert!(
        mean < 0.05 && max < 0.25,
        "statistics from a subsample drift: {mean}, {max}"
    );
    // Under `Auto`, a budget of 0 tiles everything, the default budget nothing.
    let cfg = VaeConfig::tiny();
    let [_, v, ..] = stores("diffusers");
    let tight = AutoencoderKL::new(&weights(v), &cfg, AttentionImpl::Sdpa)
        .expect("load vae")
        .with_runtime(VaeRuntime {
            memory_budget_mib: 0,
            ..VaeRuntime::default()
        });
    let plan0 = tight.tiled_plan(40, 40, Kind::Float);
    assert_eq!((plan0.core, plan0.stats_stride), (16, 8), "{plan0:?}");
    check(
        "auto under the default budget is untiled",
        &vae.decode(z, Tiling::Auto),
        &untiled,
        0.0,
    );
}

fn sched_config(pred: &str) -> SchedulerConfig {
    let mut c = SchedulerConfig::sdxl();
    c.prediction_type = if pred == "v_prediction" {
        PredictionType::VPrediction
    } else {
        PredictionType::Epsilon
    };
    c
}

#[test]
fn schedulers_match_diffusers() {
    let _g = tch::no_grad_guard();
    let (r, _) = reference("schedulers.safetensors");
    for (name, sampler) in [
        ("euler", Sampler::Euler),
        ("euler_a", Sampler::EulerAncestral),
        ("dpmpp_2m_karras", Sampler::DpmPp2mKarras),
    ] {
        for pred in ["epsilon", "v_prediction"] {
            let key = format!("{name}.{pred}");
            let cfg = sched_config(pred);
            for n in [1usize, 4, 7, 20, 30] {
                let s = Scheduler::new(sampler, &cfg, n);
                let ts = Tensor::from_slice(s.timesteps());
                let sig = Tensor::from_slice(s.sigmas());
                check(
                    &format!("{key} n{n} timesteps"),
                    &ts,
                    &r[&format!("{key}.n{n}.timesteps")],
                    1e-6,
                );
                check(
                    &format!("{key} n{n} sigmas"),
                    &sig,
                    &r[&format!("{key}.n{n}.sigmas")],
                    1e-6,
                );
            }
            let mut s = Scheduler::new(sampler, &cfg, 10);
            let init = r[&format!("{key}.init_noise_sigma")].double_value(&[0]);
            assert!(
                (s.init_noise_sigma() - init).abs() <= 1e-6 * init,
                "{key} init_noise_sigma"
            );
            let mut sample = &r["x0"] * s.init_noise_sigma();
            let _generator = noise::seed(1234);
            let mut draw = |shape: &[i64]| noise::randn_cpu(shape);
            let (mut scaled_all, mut samples) = (Vec::new(), Vec::new());
            for i in 0..10 {
                let scaled = s.scale_model_input(&sample, i);
                let model_out = r["eps"].get(i as i64) + &scaled * 0.1;
                sample = s.step(&model_out, i, &sample, &mut draw);
                scaled_all.push(scaled);
                samples.push(sample.shallow_clone());
            }
            check(
                &format!("{key} scaled inputs"),
                &Tensor::stack(&scaled_all, 0),
                &r[&format!("{key}.scaled")],
                TOL,
            );
            check(
                &format!("{key} samples"),
                &Tensor::stack(&samples, 0),
                &r[&format!("{key}.samples")],
                TOL,
            );
        }
    }
}

fn tiny_components() -> ComponentConfigs {
    ComponentConfigs {
        unet: Some(UNetConfig::tiny()),
        vae: Some(VaeConfig::tiny()),
        clip_l: Some(ClipTextConfig::tiny(false)),
        clip_g: Some(ClipTextConfig::tiny(true)),
        scheduler: Some(SchedulerConfig::sdxl()),
    }
}

fn load(format: &str) -> SdxlPipeline {
    SdxlPipeline::load(&pipeline_config(format)).expect("load pipeline")
}

#[test]
fn prompt_weighting_matches_compel() {
    let _g = tch::no_grad_guard();
    let (r, f) = reference("prompts.safetensors");
    let meta = fixture_meta(&f);
    let cases = meta["cases"].as_array().expect("cases");
    for format in FORMATS {
        let p = load(format);
        let enc = p.prompt_encoder();
        for (i, case) in cases.iter().enumerate() {
            let prompt = case["a1111"].as_str().expect("prompt");
            let c = enc.encode(prompt).expect("encode");
            check(
                &format!("{format} prompt {i} {prompt:?} embeds"),
                &c.embeds,
                &r[&format!("{i}.cond")],
                TOL,
            );
            check(
                &format!("{format} prompt {i} pooled"),
                &c.pooled,
                &r[&format!("{i}.pooled")],
                TOL,
            );
        }
        let long = cases[cases.len() - 2]["a1111"]
            .as_str()
            .expect("long prompt");
        let pos = enc.encode(long).expect("encode");
        let neg = enc
            .encode(meta["negative"].as_str().expect("negative"))
            .expect("encode");
        let (pos, neg) = enc.pad_to_same_length(pos.embeds, neg.embeds);
        check(
            &format!("{format} padded positive"),
            &pos,
            &r["pad.pos"],
            TOL,
        );
        check(
            &format!("{format} padded negative"),
            &neg,
            &r["pad.neg"],
            TOL,
        );
    }
}

fn sampler_of(name: &str) -> Sampler {
    match name {
        "euler" => Sampler::Euler,
        "euler_a" => Sampler::EulerAncestral,
        _ => Sampler::DpmPp2mKarras,
    }
}

fn pipeline_config(format: &str) -> PipelineConfig {
    if format == "ldm" {
        let mut c = PipelineConfig::new(ModelSource::SingleFile(single_file()), Device::Cpu);
        c.components = tiny_components();
        // The tiny text encoders have a 1000-token vocabulary: use the fixture's tokenizers.
        c.tokenizer_dir = Some(folder());
        c
    } else {
        PipelineConfig::new(ModelSource::DiffusersFolder(folder()), Device::Cpu)
    }
}

/// Mean absolute difference of RGB8 images and a float reference `[N, H, W, 3]`, in 1/255 units
/// (also prints how many 8-bit values differ from `round(255 · reference)`).
fn image_mae(images: &[image::RgbImage], want: &Tensor) -> f64 {
    assert_eq!(images.len() as i64, want.size()[0]);
    let mut total = 0.0;
    let mut n = 0usize;
    let mut off_by = 0i64;
    let mut worst = 0.0f64;
    for (b, img) in images.iter().enumerate() {
        let (h, w) = (img.height() as i64, img.width() as i64);
        assert_eq!(want.size()[1..], [h, w, 3]);
        let got = Tensor::from_slice(img.as_raw())
            .to_kind(Kind::Float)
            .view([h, w, 3]);
        let reference = want.get(b as i64) * 255.0;
        let diff = (&got - &reference).abs();
        total += diff.sum(Kind::Double).double_value(&[]);
        worst = worst.max(diff.max().double_value(&[]));
        off_by += (&got - reference.round())
            .abs()
            .gt(0.0)
            .sum(Kind::Int64)
            .int64_value(&[]);
        n += img.as_raw().len();
    }
    println!(
        "  {off_by} of {n} 8-bit values differ from round(255·reference); max |diff| {worst:.3} / 255"
    );
    total / n as f64
}

#[test]
fn pipeline_images_match_diffusers() {
    let (r, f) = reference("pipeline.safetensors");
    let meta = fixture_meta(&f);
    let text = |v: &serde_json::Value| v.as_str().expect("string").to_string();
    // (name, prediction type, request)
    let mut cases: Vec<(String, &str, GenerateRequest)> = meta["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let req = GenerateRequest {
                prompt: text(&meta["prompt"]),
                negative_prompt: text(&meta["negative"]),
                width: c[7].as_u64().expect("w") as u32,
                height: c[6].as_u64().expect("h") as u32,
                steps: c[4].as_u64().expect("steps") as usize,
                cfg: c[8].as_f64().expect("cfg"),
                sampler: sampler_of(c[1].as_str().expect("sampler")),
                seed: c[3].as_u64().expect("seed"),
                count: c[5].as_u64().expect("count") as usize,
            };
            (text(&c[0]), c[2].as_str().expect("pred"), req)
        })
        .collect();
    // A1111 weights and BREAK through the whole pipeline (diffusers fed compel's embeddings).
    let w = &meta["weighted"];
    cases.push((
        "weighted".into(),
        "epsilon",
        GenerateRequest {
            prompt: text(&w[0]),
            negative_prompt: text(&w[2]),
            width: 64,
            height: 64,
            steps: w[4].as_u64().expect("steps") as usize,
            cfg: w[5].as_f64().expect("cfg"),
            sampler: Sampler::Euler,
            seed: w[3].as_u64().expect("seed"),
            count: 1,
        },
    ));
    for format in FORMATS {
        for (name, pred, req) in &cases {
            let mut cfg = pipeline_config(format);
            if *pred == "v_prediction" {
                cfg.prediction_type = Some(PredictionType::VPrediction);
            }
            let p = SdxlPipeline::load(&cfg).expect("load");
            let mut calls = Vec::new();
            let images = p
                .generate(req, &mut |s, t| calls.push((s, t)), &|| false)
                .expect("generate");
            assert_eq!(calls.last(), Some(&(req.steps, req.steps)));
            assert_eq!(images.len(), req.count);
            let mae = image_mae(&images, &r[&format!("{name}.image")]);
            println!("{format} pipeline {name}: image MAE {mae:.4} / 255");
            assert!(mae <= 1.0, "{format} {name}: MAE {mae} / 255");
        }
    }
}

/// Seeded noise is bit-identical to `torch.randn(shape, generator=Generator("cpu").manual_seed(42),
/// dtype=…)`, including the second draw from the same generator and half-precision draws.
#[test]
fn seeded_noise_is_bit_identical_to_torch() {
    let (r, _) = reference("noise.safetensors");
    for (name, kind) in [
        ("f32", Kind::Float),
        ("bf16", Kind::BFloat16),
        ("f16", Kind::Half),
    ] {
        let _generator = noise::seed(42);
        let first = noise::randn_cpu_as(&[2, 4, 32, 32], kind).to_kind(Kind::Float);
        let second = noise::randn_cpu_as(&[1, 4, 32, 32], kind).to_kind(Kind::Float);
        assert!(
            first.equal(&r[&format!("{name}.first")]),
            "{name} first draw"
        );
        assert!(
            second.equal(&r[&format!("{name}.second")]),
            "{name} second draw"
        );
    }
}

/// bf16 (the worker's dtype) end to end: components stay near the fp32 references, the pipeline
/// runs. Images are not compared: bf16 noise is a different stream (see `noise.rs`).
#[test]
fn bf16_components_are_close_to_fp32() {
    let _g = tch::no_grad_guard();
    let bf = |s: WeightStore| Weights::new(Arc::new(s), Device::Cpu, Kind::BFloat16);
    let [u, v, l, _] = stores("ldm");
    let (r, _) = reference("unet.safetensors");
    let unet =
        UNet2DConditionModel::new(&bf(u), &UNetConfig::tiny(), AttentionImpl::Sdpa).expect("unet");
    let k = |n: &str| r[&format!("0.{n}")].to_kind(Kind::BFloat16);
    let out = unet.forward(
        &k("sample"),
        &r["0.timestep"],
        &k("context"),
        &AddedCond {
            text_embeds: &k("text_embeds"),
            time_ids: &k("time_ids"),
        },
    );
    check("bf16 unet", &out, &r["0.out"], 5e-2);
    let (r, _) = reference("text_encoders.safetensors");
    let te =
        ClipTextModel::new(&bf(l), &ClipTextConfig::tiny(false), AttentionImpl::Sdpa).expect("te1");
    let o = te.forward(&r["te1.ids"], Some(&r["te1.mask"]));
    check(
        "bf16 te1 masked penultimate",
        &o.penultimate,
        &r["te1.masked_penultimate"],
        5e-2,
    );
    let (r, _) = reference("vae.safetensors");
    let vae = AutoencoderKL::new(&bf(v), &VaeConfig::tiny(), AttentionImpl::Sdpa).expect("vae");
    let dec = vae.decode(&r["z"].to_kind(Kind::BFloat16), Tiling::Never);
    check("bf16 vae decode", &dec, &r["decoded"], 5e-2);

    let mut cfg = pipeline_config("ldm");
    cfg.dtype = Kind::BFloat16;
    cfg.vae_dtype = Kind::BFloat16;
    let p = SdxlPipeline::load(&cfg).expect("load bf16");
    for sampler in [
        Sampler::Euler,
        Sampler::EulerAncestral,
        Sampler::DpmPp2mKarras,
    ] {
        let req = GenerateRequest {
            prompt: "a (red:1.2) apple".into(),
            negative_prompt: "blurry".into(),
            width: 64,
            height: 48,
            steps: 3,
            cfg: 5.0,
            sampler,
            seed: 9,
            count: 2,
        };
        let images = p
            .generate(&req, &mut |_, _| {}, &|| false)
            .expect("generate bf16");
        assert_eq!(images.len(), 2);
        assert_eq!((images[0].width(), images[0].height()), (64, 48));
    }
}

#[test]
fn bundled_tokenizer_matches_transformers() {
    let tok = ClipTokenizer::bundled("<|endoftext|>").expect("bundled tokenizer");
    let text = std::fs::read_to_string(fixtures().join("tokenizer_cases.json")).expect("cases");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
    for c in &cases {
        let prompt = c["prompt"].as_str().expect("prompt");
        let want: Vec<i64> = c["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_i64().expect("id"))
            .collect();
        assert_eq!(
            tok.encode_with_specials(prompt).expect("encode"),
            want,
            "{prompt:?}"
        );
    }
    println!("{} tokenizer cases match", cases.len());
}

#[test]
fn cancellation_is_a_distinct_error() {
    let p = load("diffusers");
    let req = GenerateRequest {
        prompt: "a cat".into(),
        negative_prompt: String::new(),
        width: 32,
        height: 32,
        steps: 3,
        cfg: 5.0,
        sampler: Sampler::Euler,
        seed: 1,
        count: 1,
    };
    let calls = std::cell::Cell::new(0);
    let res = p.generate(&req, &mut |_, _| {}, &|| {
        calls.set(calls.get() + 1);
        calls.get() > 2
    });
    assert!(matches!(res, Err(GenerateError::Cancelled)), "{res:?}");
    let bad = GenerateRequest { width: 33, ..req };
    assert!(matches!(
        p.generate(&bad, &mut |_, _| {}, &|| false),
        Err(GenerateError::InvalidRequest(_))
    ));
    p.warm_up(&[(32, 32), (48, 32)]).expect("warm up");
}

/// Several requests in one batch (different prompts, negative prompts, cfg, seeds and counts) give
/// each request the images it gets alone; requests that cannot share a batch are refused.
#[test]
fn a_batch_of_requests_gives_each_the_images_it_gets_alone() {
    let p = load("diffusers");
    let base = GenerateRequest {
        prompt: "a red car on a road".into(),
        negative_prompt: "blurry".into(),
        width: 48,
        height: 32,
        steps: 3,
        cfg: 5.0,
        sampler: Sampler::EulerAncestral,
        seed: 3,
        count: 2,
    };
    let other = GenerateRequest {
        prompt: "a (blue:1.2) house at night".into(),
        negative_prompt: String::new(),
        cfg: 3.5,
        seed: 100,
        count: 1,
        ..base.clone()
    };
    let mut steps = Vec::new();
    let batch = p
        .generate_batch(
            &[base.clone(), other.clone()],
            &mut |s, t| steps.push((s, t)),
            &|| false,
        )
        .expect("batch");
    assert_eq!(steps, [(1, 3), (2, 3), (3, 3)], "one step per forward");
    assert_eq!(batch.images.len(), 2);
    for (request, images) in [&base, &other].into_iter().zip(&batch.images) {
        let alone = p
            .generate(request, &mut |_, _| {}, &|| false)
            .expect("alone");
        assert_eq!(images.len(), request.count);
        for (a, b) in images.iter().zip(&alone) {
            let diff = a
                .as_raw()
                .iter()
                .zip(b.as_raw())
                .map(|(x, y)| x.abs_diff(*y))
                .max()
                .unwrap_or(0);
            assert!(
                diff <= 1,
                "{}: batched vs alone differ by {diff}",
                request.prompt
            );
        }
    }
    // Image n of a request is the image of seed + n alone.
    let second = p
        .generate(
            &GenerateRequest {
                seed: base.seed + 1,
                count: 1,
                ..base.clone()
            },
            &mut |_, _| {},
            &|| false,
        )
        .expect("second seed alone");
    let diff = batch.images[0][1]
        .as_raw()
        .iter()
        .zip(second[0].as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0);
    assert!(
        diff <= 1,
        "image 1 of seed 3 is image 0 of seed 4 (max diff {diff})"
    );

    for bad in [
        GenerateRequest {
            width: 32,
            ..other.clone()
        },
        GenerateRequest {
            sampler: Sampler::Euler,
            ..other.clone()
        },
        GenerateRequest {
            cfg: 1.0,
            ..other.clone()
        },
        GenerateRequest {
            prompt: "word ".repeat(80),
            ..other.clone()
        },
    ] {
        let r = p.generate_batch(&[base.clone(), bad], &mut |_, _| {}, &|| false);
        assert!(
            matches!(r, Err(GenerateError::InvalidRequest(_))),
            "incompatible batch accepted: {r:?}"
        );
    }
}

// ---------------------------------------------------------------- loader errors

/// `(name, dtype, shape, little-endian bytes)` of one tensor to write.
type Entry = (String, &'static str, Vec<i64>, Vec<u8>);

/// Writes a safetensors file from entries plus metadata.
fn write_safetensors(path: &Path, entries: &[Entry], meta: &[(&str, &str)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in entries {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    if !meta.is_empty() {
        let m: serde_json::Map<String, serde_json::Value> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(m));
    }
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).expect("write");
}

/// Every tensor of the diffusers text encoder 1 file, optionally edited.
fn te1_entries(edit: impl Fn(&str, Vec<i64>) -> Option<(String, Vec<i64>)>) -> Vec<Entry> {
    let f = SafetensorsFile::open(folder().join("text_encoder/model.safetensors")).expect("te1");
    let mut names: Vec<String> = f.names().map(str::to_string).collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|n| {
            let info = f.info(&n).expect("listed").clone();
            let (name, shape) = edit(&n, info.shape.clone())?;
            let t = f.load(&n, Device::Cpu, Kind::Float).expect("tensor");
            let numel: i64 = shape.iter().product();
            let t = t.reshape([-1]).narrow(0, 0, numel.min(t.numel() as i64));
            let mut bytes = Vec::<f32>::try_from(&t)
                .expect("f32")
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>();
            bytes.resize(numel as usize * 4, 0);
            Some((name, "F32", shape, bytes))
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vnfarm-models-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(name)
}

fn load_te1(path: &Path) -> Result<ClipTextModel, LoadError> {
    let f = Arc::new(SafetensorsFile::open(path)?);
    let store = WeightStore::renamed(f, vnfarm_models::sdxl::clip::canonical_key);
    ClipTextModel::new(
        &weights(store),
        &ClipTextConfig::tiny(false),
        AttentionImpl::Sdpa,
    )
}

#[test]
fn missing_or_misnamed_tensor_is_named() {
    let path = scratch("misnamed.safetensors");
    let target = "encoder.layers.3.mlp.fc1.weight";
    write_safetensors(
        &path,
        &te1_entries(|n, s| {
            Some((
                if n == target {
                    n.replace("fc1", "fc_1")
                } else {
                    n.to_string()
                },
                s,
            ))
        }),
        &[],
    );
    let err = load_te1(&path).expect_err("must fail");
    let msg = err.to_string();
    println!("{msg}");
    assert!(matches!(err, LoadError::Missing { .. }), "{err:?}");
    assert!(
        msg.contains(target) && msg.contains("misnamed.safetensors"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let path = scratch("shape.safetensors");
    let target = "final_layer_norm.weight";
    write_safetensors(
        &path,
        &te1_entries(|n, s| Some((n.to_string(), if n == target { vec![31] } else { s }))),
        &[],
    );
    let err = load_te1(&path).expect_err("must fail");
    let msg = err.to_string();
    println!("{msg}");
    assert!(matches!(err, LoadError::Shape { .. }), "{err:?}");
    assert!(
        msg.contains(target) && msg.contains("shape.safetensors") && msg.contains("[31]"),
        "{msg}"
    );
}

#[test]
fn truncated_file_is_named() {
    let path = scratch("truncated.safetensors");
    let bytes = std::fs::read(folder().join("text_encoder/model.safetensors")).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).expect("write");
    let err = SafetensorsFile::open(&path).expect_err("must fail");
    let msg = err.to_string();
    println!("{msg}");
    assert!(matches!(err, LoadError::Truncated { .. }), "{err:?}");
    assert!(
        msg.contains("truncated.safetensors") && msg.contains("tensor `"),
        "{msg}"
    );
    // A file cut inside its header is reported too.
    std::fs::write(&path, &bytes[..100]).expect("write");
    let err = SafetensorsFile::open(&path).expect_err("must fail");
    assert!(matches!(err, LoadError::BadHeader { .. }), "{err:?}");
}

#[test]
fn v_prediction_flags_are_detected() {
    let one = vec![("x".to_string(), "F32", vec![1], 0f32.to_le_bytes().to_vec())];
    let mut with_key = one.clone();
    with_key.push(("v_pred".to_string(), "F32", vec![0], Vec::new()));
    with_key.push(("ztsnr".to_string(), "F32", vec![0], Vec::new()));
    type Case<'a> = (
        &'a str,
        Vec<Entry>,
        Vec<(&'a str, &'a str)>,
        Option<PredictionType>,
        bool,
    );
    let cases: [Case<'_>; 4] = [
        ("plain", one.clone(), vec![], None, false),
        (
            "vpred_key",
            with_key,
            vec![],
            Some(PredictionType::VPrediction),
            true,
        ),
        (
            "modelspec",
            one.clone(),
            vec![("modelspec.prediction_type", "v")],
            Some(PredictionType::VPrediction),
            false,
        ),
        (
            "kohya",
            one,
            vec![("ss_v_parameterization", "True")],
            Some(PredictionType::VPrediction),
            false,
        ),
    ];
    for (name, entries, meta, want, ztsnr) in cases {
        let path = scratch(&format!("{name}.safetensors"));
        write_safetensors(&path, &entries, &meta);
        let flags = ldm::detect_flags(&SafetensorsFile::open(&path).expect("open"));
        assert_eq!(flags.prediction_type, want, "{name}");
        assert_eq!(flags.zero_terminal_snr, ztsnr, "{name}");
    }
}

// ---------------------------------------------------------------- real-size SDXL layout

fn shape_table(v: &serde_json::Value) -> HashMap<String, Vec<i64>> {
    v.as_object()
        .expect("shape table")
        .iter()
        .map(|(k, s)| {
            let shape = s
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_i64().expect("dim"))
                .collect();
            (k.clone(), shape)
        })
        .collect()
}

/// The SDXL base presets ask for exactly the tensors (names and shapes) of diffusers' real-size
/// SDXL components, and the ldm mapping covers every one of them from real single-file key names.
#[test]
fn sdxl_base_presets_match_diffusers_layout() {
    let _g = tch::no_grad_guard();
    let t = support::read_json_gz(&fixtures().join("reference/sdxl_base_tables.json.gz"));
    let cfg = |k: &str| t["configs"][k].to_string();
    assert_eq!(
        UNetConfig::from_json(&cfg("unet")).expect("unet config"),
        UNetConfig::sdxl_base()
    );
    assert_eq!(
        VaeConfig::from_json(&cfg("vae")).expect("vae config"),
        VaeConfig::sdxl()
    );
    assert_eq!(
        ClipTextConfig::from_json(&cfg("clip_l")).expect("clip_l"),
        ClipTextConfig::sdxl_clip_l()
    );
    assert_eq!(
        ClipTextConfig::from_json(&cfg("clip_g")).expect("clip_g"),
        ClipTextConfig::sdxl_clip_g()
    );

    let store = |k: &str| {
        let table: HashMap<String, Vec<i64>> = shape_table(&t["shapes"][k])
            .into_iter()
            .filter_map(|(name, s)| {
                let name = if k.starts_with("clip") {
                    vnfarm_models::sdxl::clip::canonical_key(&name)?
                } else {
                    name
                };
                Some((name, s))
            })
            .collect();
        Arc::new(WeightStore::placeholders(table))
    };
    let w = |s: &Arc<WeightStore>| Weights::new(s.clone(), Device::Cpu, Kind::Float);
    let (u, v, l, g) = (
        store("unet"),
        store("vae"),
        store("clip_l"),
        store("clip_g"),
    );
    UNet2DConditionModel::new(&w(&u), &UNetConfig::sdxl_base(), AttentionImpl::Sdpa)
        .expect("sdxl unet");
    AutoencoderKL::new(&w(&v), &VaeConfig::sdxl(), AttentionImpl::Sdpa).expect("sdxl vae");
    ClipTextModel::new(&w(&l), &ClipTextConfig::sdxl_clip_l(), AttentionImpl::Sdpa)
        .expect("clip-l");
    ClipTextModel::new(&w(&g), &ClipTextConfig::sdxl_clip_g(), AttentionImpl::Sdpa).expect("bigG");
    for (name, s) in [("unet", &u), ("vae", &v), ("clip_l", &l), ("clip_g", &g)] {
        assert!(s.unused().is_empty(), "{name}: unused {:?}", s.unused());
        println!("sdxl {name}: {} tensors, all used", s.len());
    }

    // ldm single-file names of the same components map onto exactly those tensors.
    let ldm = shape_table(&t["shapes"]["ldm"]);
    let mut mapped: HashMap<&str, HashMap<String, Vec<i64>>> = HashMap::new();
    for (key, shape) in &ldm {
        let (comp, names): (&str, Vec<(String, Vec<i64>)>) =
            if let Some(k) = key.strip_prefix(ldm::UNET_PREFIX) {
                (
                    "unet",
                    ldm::unet_key(k, 2)
                        .map(|n| (n, shape.clone()))
                        .into_iter()
                        .collect(),
                )
            } else if let Some(k) = key.strip_prefix(ldm::VAE_PREFIX) {
                // ldm stores the VAE attention projections as 1x1 convs.
                let s = if k.contains("attn_1") && shape.len() == 4 {
                    shape[..2].to_vec()
                } else {
                    shape.clone()
                };
                (
                    "vae",
                    ldm::vae_key(k, 4).map(|n| (n, s)).into_iter().collect(),
                )
            } else if let Some(k) = key.strip_prefix(ldm::CLIP_L_PREFIX) {
                (
                    "clip_l",
                    vnfarm_models::sdxl::clip::canonical_key(k)
                        .map(|n| (n, shape.clone()))
                        .into_iter()
                        .collect(),
                )
            } else if let Some(k) = key.strip_prefix(ldm::CLIP_G_PREFIX) {
                let names = ldm::open_clip_keys(k)
                    .into_iter()
                    .map(|(n, tr)| {
                        let s = match tr {
                            vnfarm_models::loading::weights::Transform::Chunk { parts, .. } => {
                                let mut s = shape.clone();
                                s[0] /= parts;
                                s
                            }
                            vnfarm_models::loading::weights::Transform::Transpose => {
                                vec![shape[1], shape[0]]
                            }
                            vnfarm_models::loading::weights::Transform::Identity => shape.clone(),
                        };
                        (n, s)
                    })
                    .collect();
                ("clip_g", names)
            } else {
                panic!("unexpected ldm key {key}");
            };
        if names.is_empty() {
            assert!(
                key.ends_with("logit_scale"),
                "ldm key {key} maps to nothing"
            );
        }
        mapped.entry(comp).or_default().extend(names);
    }
    for comp in ["unet", "vae", "clip_l", "clip_g"] {
        let want: HashMap<String, Vec<i64>> = shape_table(&t["shapes"][comp])
            .into_iter()
            .filter_map(|(n, s)| {
                Some((
                    if comp.starts_with("clip") {
                        vnfarm_models::sdxl::clip::canonical_key(&n)?
                    } else {
                        n
                    },
                    s,
                ))
            })
            .collect();
        assert_eq!(
            mapped[comp], want,
            "{comp}: ldm mapping differs from the diffusers layout"
        );
    }
    println!(
        "sdxl ldm layout: {} keys map onto the diffusers layout",
        ldm.len()
    );
}

/// libtorch errors inside a generation (here: token ids beyond the tiny encoders' vocabulary, from
/// the bundled full CLIP tokenizer) come back as `GenerateError::Backend`, not as a panic.
#[test]
fn libtorch_failure_is_an_error_not_a_panic() {
    let mut cfg = pipeline_config("ldm");
    cfg.tokenizer_dir = None;
    let p = SdxlPipeline::load(&cfg).expect("load");
    let req = GenerateRequest {
        prompt: "a photo of a cat".into(),
        negative_prompt: String::new(),
        width: 32,
        height: 32,
        steps: 1,
        cfg: 5.0,
        sampler: Sampler::Euler,
        seed: 1,
        count: 1,
    };
    let res = p.generate(&req, &mut |_, _| {}, &|| false);
    println!("{res:?}");
    match res {
        Err(GenerateError::Backend(msg)) => assert_eq!(msg, "index out of range in self"),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

/// Diffusers folders with a sharded component (`model.safetensors.index.json`) and an fp16-variant
/// file name load like the plain layout.
#[test]
fn sharded_and_variant_diffusers_files_load() {
    let _g = tch::no_grad_guard();
    let root = scratch("sharded_folder");
    for sub in [
        "unet",
        "vae",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "scheduler",
    ] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
        for entry in std::fs::read_dir(folder().join(sub)).expect("read dir") {
            let path = entry.expect("entry").path();
            let name = path
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .to_string();
            let target = match (sub, name.as_str()) {
                ("unet", "diffusion_pytorch_model.safetensors") => {
                    "diffusion_pytorch_model.fp16.safetensors".to_string()
                }
                ("text_encoder_2", "model.safetensors") => continue,
                _ => name,
            };
            std::fs::copy(&path, root.join(sub).join(target)).expect("copy");
        }
    }
    // Split text_encoder_2 into two shards plus an index.
    let f = SafetensorsFile::open(folder().join("text_encoder_2/model.safetensors")).expect("te2");
    let mut names: Vec<String> = f.names().map(str::to_string).collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", i + 1);
        let entries: Vec<Entry> = part
            .iter()
            .map(|n| {
                let t = f.load(n, Device::Cpu, Kind::Float).expect("tensor");
                let bytes = Vec::<f32>::try_from(&t.reshape([-1]))
                    .expect("f32")
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                weight_map.insert(n.clone(), serde_json::json!(shard));
                (
                    n.clone(),
                    "F32",
                    f.info(n).expect("info").shape.clone(),
                    bytes,
                )
            })
            .collect();
        write_safetensors(&root.join("text_encoder_2").join(&shard), &entries, &[]);
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        root.join("text_encoder_2/model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");

    let p = SdxlPipeline::load(&PipelineConfig::new(
        ModelSource::DiffusersFolder(root),
        Device::Cpu,
    ))
    .expect("load sharded folder");
    let (r, _) = reference("text_encoders.safetensors");
    let o = p.text_encoders().1.forward(&r["te2.ids"], None);
    check(
        "sharded te2 text_embeds",
        &o.text_embeds.expect("projection"),
        &r["te2.text_embeds"],
        TOL,
    );
    let (r, _) = reference("unet.safetensors");
    let k = |n: &str| &r[&format!("0.{n}")];
    let out = p.unet().forward(
        k("sample"),
        k("timestep"),
        k("context"),
        &AddedCond {
            text_embeds: k("text_embeds"),
            time_ids: k("time_ids"),
        },
    );
    check("fp16-variant-named unet", &out, k("out"), TOL);
}

/// A tokenizer folder without `tokenizer.json` (the original SDXL base layout: vocab.json and
/// merges.txt only) falls back to the bundled CLIP tokenizer with the folder's pad token.
#[test]
fn vocab_only_tokenizer_folder_uses_bundled_files() {
    let dir = scratch("tokenizer_2_vocab_only");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"pad_token": "!"}"#).expect("write");
    let tok = ClipTokenizer::from_dir(&dir, "<|endoftext|>").expect("tokenizer");
    assert_eq!((tok.bos, tok.eos, tok.pad), (49406, 49407, 0));
    let fixture = ClipTokenizer::from_dir(&folder().join("tokenizer"), "!").expect("fixture");
    assert_eq!((fixture.bos, fixture.eos, fixture.pad), (998, 999, 999));
}
