//! Golden tests of the QwenImage transformer against diffusers 0.42.1 on the tiny fixture
//! (`fixtures/qwen/make_transformer_reference.py`), loaded from the diffusers folder, ComfyUI's fp8
//! single file and its `model.diffusion_model.`-prefixed variant (both written from the folder's
//! tensors at test time by `support::derived`), with fp8 weights upcast at load or resident, with
//! SDPA and matmul attention.
//!
//! Relative error is `max|a − b| / max|b|` over the whole tensor (b = reference), fp32 on CPU.
//! The fixture's Linear weights are fp8-representable, so every format holds the same values and
//! must meet the same tolerance, 1e-5. Measured (2026-11-30, torch 2.11 CPU): 1.9e-7 at most over
//! every source, fp8 mode and attention kernel (case a, no mask: 1.5e-7 SDPA, 1.1e-7 matmul; case b,
//! two images and a padded prompt: 1.9e-7 SDPA, 1.4e-7 matmul); the RoPE tables within 6e-8 (one
//! fp32 ulp of cos/sin).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::dtype::is_fp8;
use vnfarm_models::error::GenerateError;
use vnfarm_models::loading::diffusers::{open, read_config};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{Fp8Mode, WeightStore, Weights};
use vnfarm_models::nn::fused::NormKernels;
use vnfarm_models::nn::{AttentionImpl, FfGelu};
use vnfarm_models::qwen_image::kernels::BlockKernels;
use vnfarm_models::qwen_image::transformer::{
    QwenImageTransformer2DModel, QwenImageTransformerConfig, transformer_folder_store,
    transformer_store,
};

use crate::qwen_fixtures::fixtures;
use crate::support;
use crate::support::{check, load_reference, rel_err};

const TOL: f64 = 1e-5;

const SHAPES_A: [(i64, i64, i64); 1] = [(1, 4, 4)];
const SHAPES_B: [(i64, i64, i64); 2] = [(1, 4, 4), (1, 3, 5)];

fn folder() -> PathBuf {
    fixtures().join("qwen_tiny").join("transformer")
}

#[derive(Debug, Clone, Copy)]
enum Source {
    Folder,
    Comfy,
    ComfyPrefixed,
}

fn store(source: Source) -> WeightStore {
    let comfy = |path: PathBuf| open(&path).expect("comfy file");
    let root = support::fixture_root();
    match source {
        Source::Folder => transformer_folder_store(&folder()).expect("folder"),
        Source::Comfy => transformer_store(comfy(support::derived::qwen_transformer_fp8(&root))),
        Source::ComfyPrefixed => transformer_store(comfy(
            support::derived::qwen_transformer_fp8_prefixed(&root),
        )),
    }
}

fn folder_config() -> QwenImageTransformerConfig {
    read_config(&folder().join("config.json"), |t| {
        QwenImageTransformerConfig::from_json(t)
    })
    .expect("config")
}

fn load(
    source: Source,
    fp8: Fp8Mode,
    imp: AttentionImpl,
) -> (QwenImageTransformer2DModel, Arc<WeightStore>) {
    let store = Arc::new(store(source).with_fp8(fp8));
    let w = Weights::new(store.clone(), Device::Cpu, Kind::Float);
    let model = QwenImageTransformer2DModel::new(&w, &folder_config(), imp).expect("model");
    (model, store)
}

fn reference() -> HashMap<String, Tensor> {
    load_reference(&fixtures().join("reference").join("transformer.safetensors")).0
}

/// Runs both reference cases; returns the worse relative error.
fn run_cases(model: &QwenImageTransformer2DModel, r: &HashMap<String, Tensor>, what: &str) -> f64 {
    let a = model
        .forward(
            &r["a_hidden"],
            &r["a_encoder"],
            None,
            &r["a_timestep"],
            &SHAPES_A,
        )
        .expect("case a");
    let ea = check(&format!("{what} case a"), &a, &r["a_out"], TOL);
    let b = model
        .forward(
            &r["b_hidden"],
            &r["b_encoder"],
            Some(&r["b_mask"]),
            &r["b_timestep"],
            &SHAPES_B,
        )
        .expect("case b");
    let eb = check(&format!("{what} case b"), &b, &r["b_out"], TOL);
    ea.max(eb)
}

#[test]
fn every_format_fp8_mode_and_kernel_matches_diffusers() {
    let r = reference();
    let mut worst: f64 = 0.0;
    for source in [Source::Folder, Source::Comfy, Source::ComfyPrefixed] {
        for fp8 in [Fp8Mode::Upcast, Fp8Mode::Resident] {
            for imp in [AttentionImpl::Sdpa, AttentionImpl::Matmul] {
                let (mut model, store) = load(source, fp8, imp);
                let what = format!("{source:?}/{fp8:?}/{imp:?}");
                worst = worst.max(run_cases(&model, &r, &what));
                // Every model tensor was consumed, the fp8 scales too (read beside their weights);
                // only the scaled-fp8 sentinel may be left over.
                let unused: Vec<String> = store
                    .unused()
                    .into_iter()
                    .filter(|k| !k.ends_with("scaled_fp8"))
                    .collect();
                assert!(unused.is_empty(), "{what}: unused tensors {unused:?}");
                // Resident mode keeps the comfy file's Linear weights in fp8.
                let fp8_weights = model
                    .linears_mut()
                    .iter()
                    .filter(|(_, l)| is_fp8(l.weight.kind()))
                    .count();
                let expect_fp8 =
                    matches!(fp8, Fp8Mode::Resident) && !matches!(source, Source::Folder);
                assert_eq!(
                    fp8_weights > 0,
                    expect_fp8,
                    "{what}: {fp8_weights} fp8 weights"
                );
            }
        }
    }
    println!("worst relative error over all loads: {worst:.3e}");
}

/// The block-kernel settings on the CPU: the fused kernels fall back to libtorch's operators (the
/// same results), the GELU epilogue keeps the tanh GELU kernel (the CPU's epilogue would be erf),
/// and fused q/k/v projections run one GEMM over weights the three Linears hold views of.
#[test]
fn every_block_kernel_setting_matches_diffusers_on_the_cpu() {
    let r = reference();
    let all = BlockKernels {
        qk_norm_rope: NormKernels::Fused,
        ada_norm: NormKernels::Fused,
        gated_residual: NormKernels::Fused,
        ff_gelu: FfGelu::Epilogue,
        fused_qkv: true,
        fp8_gemm: false,
    };
    for (source, fp8) in [
        (Source::Folder, Fp8Mode::Upcast),
        (Source::Comfy, Fp8Mode::Resident),
    ] {
        let (mut model, _) = load(source, fp8, AttentionImpl::Sdpa);
        model.set_block_kernels(all).expect("kernels");
        assert_eq!(model.block_kernels(), all);
        run_cases(
            &model,
            &r,
            &format!("{source:?}/{fp8:?} with every block kernel"),
        );
        // Fused q/k/v: to_k's weight starts where to_q's ends (views of one tensor), except for
        // fp8-resident weights, which keep three GEMMs.
        let linears = model.linears_mut();
        let ptr = |name: &str| {
            let (_, l) = linears
                .iter()
                .find(|(n, _)| n == name)
                .expect("a named Linear");
            (
                l.weight.data_ptr() as usize,
                l.weight.numel() * l.weight.kind().elt_size_in_bytes(),
            )
        };
        let ((q, q_bytes), (k, _)) = (
            ptr("transformer_blocks.0.attn.to_q"),
            ptr("transformer_blocks.0.attn.to_k"),
        );
        assert_eq!(
            q + q_bytes == k,
            matches!(fp8, Fp8Mode::Upcast),
            "{source:?}/{fp8:?}"
        );
    }
}

#[test]
fn rope_tables_match_diffusers() {
    let r = reference();
    let (model, _) = load(Source::Folder, Fp8Mode::Upcast, AttentionImpl::Sdpa);
    let t = model.rope_tables(&SHAPES_B, 9);
    check("img cos", &t.img_cos, &r["b_img_freqs_re"], 1e-6);
    check("img sin", &t.img_sin, &r["b_img_freqs_im"], 1e-6);
    check("txt cos", &t.txt_cos, &r["b_txt_freqs_re"], 1e-6);
    check("txt sin", &t.txt_sin, &r["b_txt_freqs_im"], 1e-6);
    // Cached per (img_shapes, text length): the same storage comes back.
    let ptr = |t: &Tensor| t.data_ptr();
    assert_eq!(
        ptr(&t.img_cos),
        ptr(&model.rope_tables(&SHAPES_B, 9).img_cos)
    );
    assert_ne!(
        ptr(&t.txt_cos),
        ptr(&model.rope_tables(&SHAPES_B, 8).txt_cos)
    );
}

/// A schedule's modulations made once (`step_modulations`, one GEMM per layer for every step)
/// give each step what the timestep tensor gives, for one sample and for two; the schedule's are
/// kept while the weights stay, and made again after `linears_mut` (a LoRA's way in).
#[test]
fn a_schedules_precomputed_modulations_give_each_steps_result() {
    let r = reference();
    let (mut model, _) = load(Source::Folder, Fp8Mode::Upcast, AttentionImpl::Sdpa);
    let sigma = r["a_timestep"].double_value(&[0]);
    // The pipeline's timesteps are σ · 1000; the reference's σ sits in the middle of a schedule.
    let schedule = [1000.0, sigma * 1000.0, 250.0];
    let mods = model.step_modulations(&schedule, Kind::Float);
    assert_eq!(mods.steps(), 3);
    let stepped = model
        .forward_step(&r["a_hidden"], &r["a_encoder"], None, &mods, 1, &SHAPES_A)
        .expect("step 1");
    check(
        "precomputed modulations, case a",
        &stepped,
        &r["a_out"],
        TOL,
    );
    // Two samples at one timestep: the rows are given to each.
    let two = |t: &Tensor| Tensor::cat(&[t, t], 0);
    let hidden = two(&r["a_hidden"]);
    let encoder = two(&r["a_encoder"]);
    for (step, &t) in schedule.iter().enumerate() {
        let timestep = Tensor::full([2], t, (Kind::Float, Device::Cpu)) / 1000.0;
        let want = model
            .forward(&hidden, &encoder, None, &timestep, &SHAPES_A)
            .expect("forward");
        let got = model
            .forward_step(&hidden, &encoder, None, &mods, step, &SHAPES_A)
            .expect("forward_step");
        check(&format!("batch of two, step {step}"), &got, &want, 1e-6);
    }
    assert!(
        model
            .forward_step(&hidden, &encoder, None, &mods, 3, &SHAPES_A)
            .is_err(),
        "a step past the schedule is refused"
    );
    // Kept: the same storage comes back for the same schedule and dtype.
    let again = model.step_modulations(&schedule, Kind::Float);
    let first_row = |m: &vnfarm_models::qwen_image::transformer::StepModulations| {
        m.norm_out().data_ptr() as usize
    };
    assert_eq!(first_row(&mods), first_row(&again));
    // A weight change through linears_mut drops them: the next call computes with the new weights.
    for (name, linear) in model.linears_mut() {
        if name == "transformer_blocks.0.img_mod.1" {
            let _guard = tch::no_grad_guard();
            let _ = linear.weight.g_add_scalar_(0.05);
        }
    }
    let changed = model.step_modulations(&schedule, Kind::Float);
    assert_ne!(first_row(&mods), first_row(&changed));
    let timestep = Tensor::full([1], schedule[1], (Kind::Float, Device::Cpu)) / 1000.0;
    let want = model
        .forward(&r["a_hidden"], &r["a_encoder"], None, &timestep, &SHAPES_A)
        .expect("forward with the changed weight");
    let got = model
        .forward_step(
            &r["a_hidden"],
            &r["a_encoder"],
            None,
            &changed,
            1,
            &SHAPES_A,
        )
        .expect("forward_step with the changed weight");
    check("after a weight change", &got, &want, 1e-6);
    assert!(
        rel_err(&got, &r["a_out"]) > 1e-4,
        "the changed weight must change the output"
    );
}

#[test]
fn an_all_ones_mask_gives_the_unmasked_result() {
    let r = reference();
    let (model, _) = load(Source::Folder, Fp8Mode::Upcast, AttentionImpl::Sdpa);
    let ones = Tensor::ones([1, 7], (Kind::Float, Device::Cpu));
    let masked = model
        .forward(
            &r["a_hidden"],
            &r["a_encoder"],
            Some(&ones),
            &r["a_timestep"],
            &SHAPES_A,
        )
        .expect("masked");
    check("all-ones mask vs none", &masked, &r["a_out"], TOL);
    // And the padded prompt's mask matters: without it case b is far off.
    let unmasked = model
        .forward(
            &r["b_hidden"],
            &r["b_encoder"],
            None,
            &r["b_timestep"],
            &SHAPES_B,
        )
        .expect("unmasked");
    let e = rel_err(&unmasked, &r["b_out"]);
    assert!(
        e > 1e-3,
        "case b without its mask: relative error only {e:.3e}"
    );
}

#[test]
fn linears_are_named_by_their_checkpoint_modules() {
    let (mut model, _) = load(Source::Folder, Fp8Mode::Upcast, AttentionImpl::Sdpa);
    let names: BTreeSet<String> = model.linears_mut().into_iter().map(|(n, _)| n).collect();
    // Every 2-D `*.weight` of the checkpoint is a Linear.
    let file =
        SafetensorsFile::open(folder().join("diffusion_pytorch_model.safetensors")).expect("file");
    let expected: BTreeSet<String> = file
        .names()
        .filter(|k| file.info(k).is_some_and(|i| i.shape.len() == 2))
        .filter_map(|k| k.strip_suffix(".weight").map(str::to_string))
        .collect();
    assert_eq!(names, expected);
    assert!(names.contains("transformer_blocks.0.attn.to_q"));
    assert!(names.contains("transformer_blocks.1.attn.to_out.0"));
    assert!(names.contains("transformer_blocks.1.img_mlp.net.0.proj"));
}

/// The real-size names and shapes, compacted by the reference script.
fn real_size_shapes() -> HashMap<String, Vec<i64>> {
    let path = fixtures()
        .join("reference")
        .join("qwen_image_edit_2509_transformer_shapes.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("shapes json")).expect("json");
    let shape = |s: &serde_json::Value| -> Vec<i64> {
        s.as_array()
            .expect("shape list")
            .iter()
            .map(|d| d.as_i64().expect("dim"))
            .collect()
    };
    let mut out: HashMap<String, Vec<i64>> = v["other"]
        .as_object()
        .expect("other")
        .iter()
        .map(|(k, s)| (k.clone(), shape(s)))
        .collect();
    for i in 0..v["num_blocks"].as_i64().expect("num_blocks") {
        for (k, s) in v["block"].as_object().expect("block") {
            out.insert(format!("transformer_blocks.{i}.{k}"), shape(s));
        }
    }
    out
}

#[test]
fn the_2509_preset_asks_for_exactly_the_real_checkpoint_tensors() {
    let shapes = real_size_shapes();
    let n = shapes.len();
    let store = Arc::new(WeightStore::placeholders(shapes));
    let w = Weights::new(store.clone(), Device::Cpu, Kind::Float);
    let c = QwenImageTransformerConfig::qwen_image_edit_2509();
    QwenImageTransformer2DModel::new(&w, &c, AttentionImpl::Sdpa).expect("real-size model");
    assert_eq!(store.unused(), Vec::<String>::new(), "of {n} tensors");
}

#[test]
fn config_presets_parse_and_unsupported_variants_are_rejected() {
    assert_eq!(folder_config(), QwenImageTransformerConfig::tiny());
    let real = r#"{"_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 128,
        "axes_dims_rope": [16, 56, 56], "guidance_embeds": false, "in_channels": 64,
        "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60,
        "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 768}"#;
    assert_eq!(
        QwenImageTransformerConfig::from_json(real).expect("real config"),
        QwenImageTransformerConfig::qwen_image_edit_2509()
    );
    for flag in [
        "guidance_embeds",
        "zero_cond_t",
        "use_additional_t_cond",
        "use_layer3d_rope",
    ] {
        let err = QwenImageTransformerConfig::from_json(&format!("{{\"{flag}\": true}}"))
            .expect_err(flag);
        assert!(err.contains(flag), "{err}");
    }
    let err = QwenImageTransformerConfig::from_json(r#"{"axes_dims_rope": [16, 56, 58]}"#)
        .expect_err("bad axes");
    assert!(err.contains("axes_dims_rope"), "{err}");
}

#[test]
fn malformed_inputs_are_rejected_not_panicked_on() {
    let r = reference();
    let (model, _) = load(Source::Folder, Fp8Mode::Upcast, AttentionImpl::Sdpa);
    let invalid = |res: Result<Tensor, GenerateError>| {
        assert!(
            matches!(res, Err(GenerateError::InvalidRequest(_))),
            "{res:?}"
        )
    };
    let (h, e, t) = (&r["a_hidden"], &r["a_encoder"], &r["a_timestep"]);
    invalid(model.forward(h, e, None, t, &[(1, 4, 3)]));
    invalid(model.forward(h, e, None, t, &[]));
    invalid(model.forward(h, e, None, t, &[(1, 0, 4), (1, 4, 4)]));
    invalid(model.forward(h, e, None, &r["b_timestep"], &SHAPES_A));
    invalid(model.forward(h, &r["b_encoder"], None, t, &SHAPES_A));
    invalid(model.forward(h, e, Some(&r["b_mask"]), t, &SHAPES_A));
    invalid(model.forward(&h.view([16, 16]), e, None, t, &SHAPES_A));
}

#[test]
fn bf16_runs_close_to_the_fp32_reference_and_fp8_modes_agree_exactly() {
    let r = reference();
    let bf = |name: &str| r[name].to_kind(Kind::BFloat16);
    let run = |source: Source, fp8: Fp8Mode| {
        let store = Arc::new(store(source).with_fp8(fp8));
        let w = Weights::new(store, Device::Cpu, Kind::BFloat16);
        let model = QwenImageTransformer2DModel::new(&w, &folder_config(), AttentionImpl::Sdpa)
            .expect("model");
        model
            .forward(
                &bf("b_hidden"),
                &bf("b_encoder"),
                Some(&r["b_mask"]),
                &bf("b_timestep"),
                &SHAPES_B,
            )
            .expect("bf16 case b")
    };
    let upcast = run(Source::Comfy, Fp8Mode::Upcast);
    assert_eq!(upcast.kind(), Kind::BFloat16);
    // Measured 2026-11-30: 6.3e-3 (bf16 activations through two blocks).
    check("bf16 case b", &upcast, &r["b_out"], 5e-2);
    // fp8 → bf16 is exact, whether at load or per call.
    let resident = run(Source::Comfy, Fp8Mode::Resident);
    assert!(
        upcast.equal(&resident),
        "fp8 upcast and resident differ in bf16"
    );
}
