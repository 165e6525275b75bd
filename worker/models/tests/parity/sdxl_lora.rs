//! Per-job SDXL LoRAs (`SdxlPipeline::set_loras`) against diffusers 0.42.1 `load_lora_weights` +
//! `fuse_lora` on the tiny SDXL (`fixtures/sdxl/make_sdxl_lora_fixtures.py`: `lora/*.safetensors`,
//! `reference/lora.safetensors`), in the three key styles found in the wild: kohya (sgm UNet names,
//! `lora_te1_` / `lora_te2_`, alpha, LoCon convs), diffusers/PEFT (`unet.` / `text_encoder.` /
//! `text_encoder_2.`, lora_A/lora_B) and LyCORIS LoCon (flattened diffusers names, 3x3 convs).
//!
//! Tolerances: fused weights within 1e-6 relative (`max|a − b| / max|b|` per weight: fp32 rounding
//! order only); images within 1 / 255 mean absolute error, like the base pipeline's parity test;
//! restore: bit for bit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};
use vnfarm_models::error::GenerateError;
use vnfarm_models::loading::lora::{Component, LoraModule, LoraSpec};
use vnfarm_models::nn::{MemoryFormat, is_channels_last};
use vnfarm_models::schedulers::Sampler;
use vnfarm_models::sdxl::pipeline::{GenerateRequest, ModelSource, PipelineConfig, SdxlPipeline};

use crate::support;
use crate::support::{load_reference, rel_err};

const TOL: f64 = 1e-6;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sdxl")
}

fn lora(style: &str, strength: f64) -> LoraSpec {
    LoraSpec {
        path: fixtures().join(format!("lora/{style}.safetensors")),
        strength,
    }
}

/// The tiny SDXL from its diffusers folder, fp32 on the CPU (the references' precision), or `kind`.
fn pipeline(kind: Kind) -> SdxlPipeline {
    pipeline_in(kind, MemoryFormat::Contiguous)
}

/// [`pipeline`] with the UNet in `format`.
fn pipeline_in(kind: Kind, format: MemoryFormat) -> SdxlPipeline {
    let mut c = PipelineConfig::new(
        ModelSource::DiffusersFolder(fixtures().join("sdxl_tiny")),
        Device::Cpu,
    );
    c.dtype = kind;
    c.settings.unet_memory_format = format;
    SdxlPipeline::load(&c).expect("load the tiny SDXL")
}

/// Every patchable weight as `<component>.<module>.weight` (diffusers' component names), shallow.
fn weights(p: &mut SdxlPipeline) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for t in p.lora_targets() {
        let component = match t.component {
            Component::Denoiser => "unet",
            Component::TextEncoder => "text_encoder",
            Component::TextEncoder2 => "text_encoder_2",
        };
        for (name, module) in t.target.lora_modules() {
            let w = match module {
                LoraModule::Linear(l) => l.weight.shallow_clone(),
                LoraModule::Conv2d(c) => c.weight.shallow_clone(),
            };
            out.insert(format!("{component}.{name}.weight"), w);
        }
    }
    out
}

fn reference() -> (HashMap<String, Tensor>, serde_json::Value) {
    let (r, f) = load_reference(&fixtures().join("reference/lora.safetensors"));
    let meta = serde_json::from_str(&f.metadata()["fixture"]).expect("fixture metadata");
    (r, meta)
}

#[test]
fn fused_weights_match_diffusers_in_every_key_style() {
    let (r, meta) = reference();
    let strength = meta["strength"].as_f64().expect("strength");
    let mut p = pipeline(Kind::Float);
    let sets: [(&str, Vec<LoraSpec>); 4] = [
        ("kohya.0.7", vec![lora("kohya", strength)]),
        ("peft.0.7", vec![lora("peft", strength)]),
        ("lycoris.0.7", vec![lora("lycoris", strength)]),
        (
            "kohya+lycoris",
            vec![lora("kohya", strength), lora("lycoris", -0.5)],
        ),
    ];
    for (tag, specs) in sets {
        let switch = p.set_loras(&specs).expect(tag);
        assert!(switch.applied, "{tag}");
        let report = p.lora_report().expect("a set is fused").clone();
        for file in &report.files {
            assert!(
                file.unmatched.is_empty(),
                "{tag}: {} left modules unmatched: {:?}",
                file.path.display(),
                file.unmatched
            );
        }
        let got = weights(&mut p);
        let mut compared = 0;
        for (key, want) in &r {
            let Some(name) = key.strip_prefix(&format!("{tag}.")) else {
                continue;
            };
            let have = got
                .get(name)
                .unwrap_or_else(|| panic!("{tag}: no weight {name}"));
            let e = rel_err(have, want);
            assert!(e <= TOL, "{tag} {name}: relative error {e:.3e} > {TOL:.0e}");
            compared += 1;
        }
        let modules = meta["modules"].as_array().expect("modules").len();
        assert_eq!(compared, modules, "{tag}: every patched module compared");
        println!(
            "{tag}: {compared} weights within {TOL:.0e} of diffusers; {} modules fused",
            report.fused_modules
        );
    }
}

#[test]
fn restoring_gives_back_the_loaded_weights_bit_for_bit() {
    for kind in [Kind::Float, Kind::BFloat16] {
        let mut p = pipeline(kind);
        // Deep copies: the pipeline replaces its tensors, and must never write into the originals.
        let base: HashMap<String, Tensor> = weights(&mut p)
            .into_iter()
            .map(|(k, v)| (k, v.copy()))
            .collect();
        let unchanged = |p: &mut SdxlPipeline| {
            weights(p)
                .iter()
                .filter(|(k, v)| v.kind() == base[*k].kind() && v.equal(&base[*k]))
                .count()
        };

        let kohya = [lora("kohya", 0.8)];
        let switch = p.set_loras(&kohya).expect("kohya");
        assert!(switch.applied && !switch.restored);
        let fused = base.len() - unchanged(&mut p);
        assert!(fused > 200, "{kind:?}: kohya changed {fused} weights");
        // The same set again costs nothing.
        assert!(!p.set_loras(&kohya).expect("same set").changed());
        // Another set restores, then fuses: only the UNet's weights stay changed (LyCORIS file).
        let switch = p.set_loras(&[lora("lycoris", 0.5)]).expect("lycoris");
        assert!(switch.restored && switch.applied);
        let te_changed = weights(&mut p)
            .iter()
            .filter(|(k, v)| k.starts_with("text_encoder") && !v.equal(&base[*k]))
            .count();
        assert_eq!(
            te_changed, 0,
            "{kind:?}: the text encoders are back to the base"
        );
        // No LoRA: every weight is the loaded one, bit for bit, in its dtype.
        let switch = p.set_loras(&[]).expect("base");
        assert!(switch.restored && !switch.applied);
        assert_eq!(unchanged(&mut p), base.len(), "{kind:?}: restored exactly");
        assert!(p.lora_report().is_none());
        println!("{kind:?}: {fused} weights fused and restored bit for bit");
    }
}

/// diffusers' images with each style fused, and the base's again after a restore; with the UNet
/// NCHW and NHWC (fusing into NHWC convolution weights keeps them NHWC).
#[test]
fn images_with_loras_match_diffusers() {
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        images_with_loras_match_diffusers_in(format);
    }
}

fn images_with_loras_match_diffusers_in(format: MemoryFormat) {
    let (r, meta) = reference();
    let text = |v: &serde_json::Value| v.as_str().expect("string").to_string();
    let mut p = pipeline_in(Kind::Float, format);
    for case in meta["cases"].as_array().expect("cases") {
        let name = text(&case[0]);
        if name.starts_with("e2e_") {
            continue; // the worker's end-to-end case (tests/e2e/sdxl.rs)
        }
        let specs: Vec<LoraSpec> = case[1]
            .as_array()
            .expect("loras")
            .iter()
            .map(|l| {
                lora(
                    l[0].as_str().expect("style"),
                    l[1].as_f64().expect("strength"),
                )
            })
            .collect();
        assert_eq!(case[2], "euler", "{name}: the cases here use Euler");
        let req = GenerateRequest {
            prompt: text(&meta["prompt"]),
            negative_prompt: text(&meta["negative"]),
            width: case[7].as_u64().expect("w") as u32,
            height: case[6].as_u64().expect("h") as u32,
            steps: case[4].as_u64().expect("steps") as usize,
            cfg: case[8].as_f64().expect("cfg"),
            sampler: Sampler::Euler,
            seed: case[3].as_u64().expect("seed"),
            count: case[5].as_u64().expect("count") as usize,
        };
        p.set_loras(&specs).expect(&name);
        if format == MemoryFormat::ChannelsLast {
            let convs = weights(&mut p)
                .into_iter()
                .filter(|(k, w)| k.starts_with("unet.") && w.dim() == 4)
                .collect::<Vec<_>>();
            assert!(!convs.is_empty());
            for (k, w) in convs {
                // A 1x1 kernel's NCHW and NHWC memory orders are the same.
                let one_by_one = w.size()[2..] == [1, 1];
                assert!(
                    is_channels_last(&w) || one_by_one,
                    "{name}: {k} is not NHWC after fusing"
                );
            }
        }
        let images = p.generate(&req, &mut |_, _| {}, &|| false).expect(&name);
        let mae = support::image_mae(&images[0], &r[&format!("{name}.image")].get(0));
        let from_base = support::image_mae(&images[0], &r["base.image"].get(0));
        println!(
            "{format:?} {name}: image MAE {mae:.4} / 255 (from the base image: {from_base:.1})"
        );
        assert!(mae <= 1.0, "{name}: MAE {mae} / 255");
        if name != "base" {
            assert!(from_base > 5.0, "{name}: the LoRA must change the image");
        }
    }
}

#[test]
fn unusable_files_are_errors_naming_the_key_and_leave_the_base() {
    let mut p = pipeline(Kind::Float);
    let base: HashMap<String, Tensor> = weights(&mut p)
        .into_iter()
        .map(|(k, v)| (k, v.copy()))
        .collect();
    let dir = std::env::temp_dir().join(format!("vnfarm-sdxl-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Modules this model does not have (an SD 1.5 text encoder key, a 4th down block).
    let nomatch = dir.join("nomatch.safetensors");
    let d = Tensor::ones([4, 32], (Kind::Float, Device::Cpu));
    let u = Tensor::ones([32, 4], (Kind::Float, Device::Cpu));
    Tensor::write_safetensors(
        &[
            ("lora_unet_input_blocks_11_1_proj_in.lora_down.weight", &d),
            ("lora_unet_input_blocks_11_1_proj_in.lora_up.weight", &u),
        ],
        &nomatch,
    )
    .unwrap();
    // A misshapen pair: rank 4 down against a 2-channel proj_in.
    let misfit = dir.join("misfit.safetensors");
    Tensor::write_safetensors(
        &[
            ("lora_unet_input_blocks_4_1_proj_in.lora_down.weight", &d),
            ("lora_unet_input_blocks_4_1_proj_in.lora_up.weight", &u),
        ],
        &misfit,
    )
    .unwrap();
    let cases = [
        (fixtures().join("lora/unsupported.safetensors"), "hada_w1_a"),
        (nomatch, "input_blocks_11_1_proj_in"),
        (
            misfit,
            "lora_unet_input_blocks_4_1_proj_in.lora_down.weight",
        ),
        (dir.join("missing.safetensors"), "missing.safetensors"),
    ];
    // A good set first: a bad one must restore it and leave the base.
    p.set_loras(&[lora("kohya", 0.8)]).expect("kohya");
    for (path, names) in cases {
        let err = p
            .set_loras(&[LoraSpec {
                path: path.clone(),
                strength: 1.0,
            }])
            .expect_err("an unusable file");
        let GenerateError::InvalidRequest(message) = &err else {
            panic!("{}: {err:?} is not the request's fault", path.display());
        };
        println!("{message}");
        assert!(message.contains(names), "{message} names {names}");
        let same = weights(&mut p)
            .iter()
            .filter(|(k, v)| v.equal(&base[*k]))
            .count();
        assert_eq!(
            same,
            base.len(),
            "{}: the base weights are back",
            path.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
