//! Golden tests of the Qwen2.5-VL vision tower against transformers 5.24.0
//! (`fixtures/qwen/make_vision_reference.py`, CPU, fp32), loading the tiny tower from the sharded
//! `qwen_tiny/text_encoder/` folder (under both vision roots, `model.visual.*` and `visual.*`) and
//! from the ComfyUI-style scaled-fp8 single file (`visual.*`; written from the folder's tensors at
//! test time by `support::derived`), with SDPA and matmul attention, fp8 upcast at load and fp8
//! resident.
//!
//! Relative error is `max|a − b| / max|b|` over the whole output (b = reference); the tower must be
//! within 1e-5 in fp32. Measured (x86-64 CPU, libtorch 2.11): 1.5e-7 at most (1.5e-7 for one
//! image, 1.5e-7 for two, 1.4e-7 for the two-frame clip; SDPA and matmul alike), the same for
//! every load (the fixture weights are exactly representable in scaled fp8, so fp8 upcast and fp8
//! resident give the fp32 numbers). The rotary table and window layout are exact.

use std::collections::HashMap;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::error::GenerateError;
use vnfarm_models::loading::diffusers::component_store;
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{Fp8Mode, WeightStore, Weights};
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::qwen2_5_vl::vision::{
    VisionConfig, VisionLayout, VisionTransformer, vision_prefix,
};

use crate::qwen_fixtures::{Reference, fixtures, ints, reroot, tiny_dir};
use crate::support;
use crate::support::check;

const TOL: f64 = 1e-5;

impl Reference {
    /// A case's `grid_thw` from the metadata.
    fn case_grid(&self, case: &str) -> Vec<(i64, i64, i64)> {
        self.meta[case]["grid_thw"]
            .as_array()
            .expect("grid_thw list")
            .iter()
            .map(|g| {
                let v: Vec<i64> = g
                    .as_array()
                    .expect("grid triple")
                    .iter()
                    .map(|x| x.as_i64().expect("grid size"))
                    .collect();
                (v[0], v[1], v[2])
            })
            .collect()
    }
}

/// The tiny text encoder's stores: the sharded folder (as written and re-rooted) and ComfyUI's
/// scaled-fp8 file.
fn stores(fp8: Fp8Mode) -> Vec<(&'static str, WeightStore)> {
    let dir = tiny_dir().join("text_encoder");
    let folder = component_store(&dir, "model", |k| Some(k.to_string())).expect("tiny folder");
    let rerooted = component_store(&dir, "model", reroot).expect("tiny folder");
    let comfy = SafetensorsFile::open(support::derived::qwen_text_encoder_fp8_scaled(
        &support::fixture_root(),
    ))
    .expect("comfy text encoder file");
    vec![
        ("folder", folder.with_fp8(fp8)),
        ("folder re-rooted", rerooted.with_fp8(fp8)),
        (
            "comfy fp8",
            WeightStore::identity(Arc::new(comfy)).with_fp8(fp8),
        ),
    ]
}

fn tower(store: WeightStore, imp: AttentionImpl) -> VisionTransformer {
    let prefix = vision_prefix(&store).expect("a vision tower in the checkpoint");
    let w = Weights::new(Arc::new(store), Device::Cpu, Kind::Float).pp(prefix);
    VisionTransformer::new(&w, &VisionConfig::tiny(), imp).expect("tiny vision tower")
}

#[test]
fn the_vision_prefix_is_found_in_both_layouts() {
    let found: Vec<_> = stores(Fp8Mode::Upcast)
        .iter()
        .map(|(what, s)| (*what, vision_prefix(s)))
        .collect();
    println!("{found:?}");
    let mut folders = [found[0].1, found[1].1];
    folders.sort_unstable();
    assert_eq!(folders, [Some("model.visual"), Some("visual")]);
    assert_eq!(found[2], ("comfy fp8", Some("visual")));
}

#[test]
fn the_layout_matches_transformers_window_index_and_rotary_table() {
    let r = Reference::load("vision.safetensors");
    let c = VisionConfig::tiny();
    for case in ["one", "two", "frames"] {
        let layout = VisionLayout::new(&c, &r.case_grid(case)).expect("valid grid");
        assert_eq!(
            layout.window_index,
            ints(r.get(&format!("{case}.window_index"))),
            "{case}: window_index"
        );
        assert_eq!(
            layout.cu_window_seqlens,
            ints(r.get(&format!("{case}.cu_window_seqlens"))),
            "{case}: cu_window_seqlens"
        );
    }
    for case in ["two", "frames"] {
        let layout = VisionLayout::new(&c, &r.case_grid(case)).expect("valid grid");
        assert_eq!(
            layout.cu_seqlens,
            ints(r.get(&format!("{case}.cu_seqlens"))),
            "{case}: cu_seqlens"
        );
    }

    let rot = tower(stores(Fp8Mode::Upcast).remove(0).1, AttentionImpl::Sdpa)
        .rot_pos_emb(&r.case_grid("one"))
        .expect("valid grid");
    // Products of small integers and fp32 powers computed with the same ops: bit-identical.
    check("rot_pos_emb", &rot, r.get("one.rot_pos_emb"), 0.0);
}

#[test]
fn the_tiny_tower_matches_transformers() {
    let r = Reference::load("vision.safetensors");
    let mut worst: f64 = 0.0;
    for fp8 in [Fp8Mode::Upcast, Fp8Mode::Resident] {
        for (what, store) in stores(fp8) {
            let store = Arc::new(store);
            for imp in [AttentionImpl::Sdpa, AttentionImpl::Matmul] {
                let prefix = vision_prefix(&store).expect("vision prefix");
                let w = Weights::new(store.clone(), Device::Cpu, Kind::Float).pp(prefix);
                let model =
                    VisionTransformer::new(&w, &VisionConfig::tiny(), imp).expect("tiny tower");
                for case in ["one", "two", "frames"] {
                    let pixels = r.get(&format!("{case}.pixel_values"));
                    let out = model.forward(pixels, &r.case_grid(case)).expect("forward");
                    let e = check(
                        &format!("{what} {fp8:?} {imp:?} {case}"),
                        &out,
                        r.get(&format!("{case}.output")),
                        TOL,
                    );
                    worst = worst.max(e);
                }
            }
            if fp8 == Fp8Mode::Resident && what == "comfy fp8" {
                let qkv = store
                    .get_linear_weight(
                        "visual.blocks.0.attn.qkv.weight",
                        &[48, 16],
                        Device::Cpu,
                        Kind::Float,
                    )
                    .expect("qkv weight");
                assert_eq!(qkv.0.kind(), Kind::Float8e4m3fn, "resident fp8 stays fp8");
            }
        }
    }
    println!("worst relative error {worst:.3e}");
}

#[test]
fn images_are_independent() {
    // The two-image call gives each image what it gets alone: no attention across images.
    let r = Reference::load("vision.safetensors");
    let model = tower(stores(Fp8Mode::Upcast).remove(0).1, AttentionImpl::Sdpa);
    let pixels = r.get("two.pixel_values");
    let grids = r.case_grid("two");
    let both = model.forward(pixels, &grids).expect("forward");
    let first = grids[0].0 * grids[0].1 * grids[0].2;
    let a = model
        .forward(&pixels.narrow(0, 0, first), &grids[..1])
        .expect("first alone");
    let b = model
        .forward(
            &pixels.narrow(0, first, pixels.size()[0] - first),
            &grids[1..],
        )
        .expect("second alone");
    check(
        "images apart vs together",
        &Tensor::cat(&[a, b], 0),
        &both,
        TOL,
    );
}

#[test]
fn bad_grids_and_shapes_are_rejected() {
    let model = tower(stores(Fp8Mode::Upcast).remove(0).1, AttentionImpl::Sdpa);
    let pixels = Tensor::zeros([96, 1176], (Kind::Float, Device::Cpu));
    for grid in [
        vec![(1, 8, 11)],
        vec![(0, 8, 12)],
        vec![(1, -8, 12)],
        vec![(1, 8, 8)],
        vec![(1 << 40, 1 << 20, 1 << 20)],
    ] {
        match model.forward(&pixels, &grid) {
            Err(GenerateError::InvalidRequest(msg)) => println!("{grid:?}: {msg}"),
            other => panic!("{grid:?}: expected InvalidRequest, got {other:?}"),
        }
    }
    let wrong_width = Tensor::zeros([96, 1175], (Kind::Float, Device::Cpu));
    assert!(matches!(
        model.forward(&wrong_width, &[(1, 8, 12)]),
        Err(GenerateError::InvalidRequest(_))
    ));
}

#[test]
fn the_7b_preset_asks_for_exactly_the_real_checkpoint_tensors() {
    let text = std::fs::read_to_string(fixtures().join("reference").join("vision_7b_shapes.json"))
        .expect("vision_7b_shapes.json");
    let shapes: HashMap<String, Vec<i64>> = serde_json::from_str(&text).expect("shapes json");
    let n = shapes.len();
    let store = Arc::new(WeightStore::placeholders(shapes));
    let w = Weights::new(store.clone(), Device::Cpu, Kind::Float);
    VisionTransformer::new(&w, &VisionConfig::qwen2_5_vl_7b(), AttentionImpl::Sdpa)
        .expect("every tensor the 7B preset asks for exists with its shape");
    assert_eq!(
        store.unused(),
        Vec::<String>::new(),
        "tensors never asked for"
    );
    assert_eq!(n, 390);
}

#[test]
fn configs_parse_from_transformers_json() {
    // vision_config of Qwen/Qwen2.5-VL-7B-Instruct config.json (also Qwen-Image-Edit-2509's
    // text_encoder/config.json).
    let real = r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 3584,
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2}}"#;
    assert_eq!(
        VisionConfig::from_json(real).expect("real config"),
        VisionConfig::qwen2_5_vl_7b()
    );
    let tiny = std::fs::read_to_string(
        fixtures()
            .join("qwen_tiny")
            .join("text_encoder")
            .join("config.json"),
    )
    .expect("tiny config.json");
    assert_eq!(
        VisionConfig::from_json(&tiny).expect("tiny config"),
        VisionConfig::tiny()
    );
    assert!(VisionConfig::from_json(r#"{"vision_config": {"hidden_act": "gelu"}}"#).is_err());
    assert!(VisionConfig::from_json(r#"{"vision_config": {"num_heads": 0}}"#).is_err());
}
