//! Golden tests of the Qwen2.5-VL text side of Qwen-Image-Edit-Plus against diffusers 0.42.1 +
//! transformers 5.24.0 (`fixtures/qwen/make_text_reference.py`, CPU, fp32): tokenizer, condition
//! resize and image processor, M-RoPE position ids, the language model, and the full
//! `encode_prompt`, loading the tiny text encoder from the sharded `qwen_tiny/` folder (as written,
//! `model.*` / `visual.*`, and renamed to transformers ≥ 5's `model.language_model.*` /
//! `model.visual.*`) and from the ComfyUI-style scaled-fp8 single file (written from the folder's
//! tensors at test time by `support::derived`; fp8 upcast at load and resident).
//!
//! Relative error is `max|a − b| / max|b|` over the whole tensor (b = reference); tolerance 1e-5
//! in fp32. Position ids, grids, token ids, the condition resize and the processor's
//! `pixel_values` must be exact (they are: 0 differing bytes / values, with Pillow-exact
//! `imageops::resample`). Measured (x86-64 CPU, libtorch 2.11): language model 0 (SDPA) / 9.9e-8
//! (matmul); `encode_prompt` ≤ 2.4e-7 over every load (folder, re-rooted folder, ComfyUI scaled
//! fp8 upcast and resident), both attention kernels, both position modes, one and two images and
//! the padded batch; the fixtures' pipeline cases ≤ 2.3e-7 (incl. the real 384² condition size).
//! The fixture weights are exactly representable in scaled fp8, so every load gives the same
//! numbers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::loading::diffusers::component_store;
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{Fp8Mode, WeightStore, Weights};
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::qwen2_5_vl::config::{QwenVlConfig, TextConfig};
use vnfarm_models::qwen2_5_vl::language_model::{LanguageModel, language_model_prefix};
use vnfarm_models::qwen2_5_vl::processor::{
    ImageProcessorConfig, calculate_dimensions, condition_resize, preprocess, smart_resize,
};
use vnfarm_models::qwen2_5_vl::rope::{
    PositionMode, batch_position_ids, get_rope_index, masked_position_ids,
};
use vnfarm_models::qwen2_5_vl::text_encoder::{QwenTextEncoder, TextEncoderOptions};
use vnfarm_models::qwen2_5_vl::tokenizer::QwenTokenizer;

use crate::qwen_fixtures::{Reference, fixtures, ints, reroot, tiny_dir};
use crate::support;
use crate::support::{check, rel_err};

const TOL: f64 = 1e-5;

impl Reference {
    fn grid(&self, name: &str) -> Vec<(i64, i64, i64)> {
        let v = ints(self.get(name));
        v.chunks(3).map(|g| (g[0], g[1], g[2])).collect()
    }

    /// The padded batch's prompts.
    fn batch_prompts(&self) -> Vec<String> {
        self.meta["prompts"]["batch"]
            .as_array()
            .expect("batch")
            .iter()
            .map(|p| p.as_str().expect("prompt").to_string())
            .collect()
    }

    fn prompt(&self, key: &str) -> String {
        self.meta["prompts"][key]
            .as_str()
            .expect("prompt")
            .to_string()
    }
}

fn rgb(t: &Tensor) -> image::RgbImage {
    let (h, w, _) = t.size3().expect("[h, w, 3]");
    let data = Vec::<u8>::try_from(t.flatten(0, -1)).expect("u8");
    image::RgbImage::from_raw(w as u32, h as u32, data).expect("rgb image")
}

fn input_image(name: &str) -> image::RgbImage {
    image::open(fixtures().join("inputs").join(format!("{name}.png")))
        .expect("fixture input")
        .to_rgb8()
}

/// `comfy/text_encoder_fp8_scaled.safetensors`, written from the folder's shards at test time.
fn comfy_file() -> PathBuf {
    support::derived::qwen_text_encoder_fp8_scaled(&support::fixture_root())
}

fn opts(positions: PositionMode, attention: AttentionImpl, fp8: Fp8Mode) -> TextEncoderOptions {
    TextEncoderOptions {
        positions,
        attention,
        fp8,
        ..TextEncoderOptions::default()
    }
}

/// Every load of the tiny encoder: (what, encoder).
fn encoders(o: TextEncoderOptions) -> Vec<(String, QwenTextEncoder)> {
    let dir = tiny_dir().join("text_encoder");
    let folder = QwenTextEncoder::load_diffusers(&tiny_dir(), o).expect("tiny folder");
    let config = folder.config.clone();
    let processor = folder.processor.clone();
    let rerooted = QwenTextEncoder::from_store(
        component_store(&dir, "model", reroot).expect("tiny folder"),
        &dir,
        config.clone(),
        QwenTokenizer::from_dir(&tiny_dir().join("tokenizer")).expect("tokenizer"),
        processor,
        o,
    )
    .expect("re-rooted folder");
    let comfy = QwenTextEncoder::load_single_file(&comfy_file(), QwenVlConfig::tiny(), o)
        .expect("comfy scaled fp8");
    vec![
        ("folder".into(), folder),
        ("folder re-rooted".into(), rerooted),
        ("comfy fp8".into(), comfy),
    ]
}

#[test]
fn config_reads_the_tiny_folder_and_presets_agree() {
    let text = std::fs::read_to_string(tiny_dir().join("text_encoder").join("config.json"))
        .expect("config");
    let c = QwenVlConfig::from_json(&text).expect("parse");
    assert_eq!(c, QwenVlConfig::tiny());
    // Older layout: text keys at the top level, rope_theta + rope_scaling.
    let old = r#"{"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "vocab_size": 152064, "hidden_act": "silu",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584,
        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "fullatt_block_indexes": [7, 15, 23, 31]}}"#;
    assert_eq!(
        QwenVlConfig::from_json(old).expect("old layout"),
        QwenVlConfig::qwen2_5_vl_7b()
    );
    assert!(TextConfig::from_json(r#"{"hidden_size": 16, "num_attention_heads": 3}"#).is_err());
    let pre = std::fs::read_to_string(
        tiny_dir()
            .join("processor")
            .join("preprocessor_config.json"),
    )
    .expect("preprocessor config");
    assert_eq!(
        ImageProcessorConfig::from_json(&pre).expect("parse"),
        ImageProcessorConfig::default()
    );
    let overridden =
        ImageProcessorConfig::from_json(r#"{"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}"#)
            .expect("parse");
    assert_eq!(
        (overridden.min_pixels, overridden.max_pixels),
        (3136, 12845056)
    );
}

#[test]
fn tokenizer_matches_the_cases() {
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizer_cases.json")).expect("cases"),
    )
    .expect("json");
    let bundled = QwenTokenizer::bundled().expect("bundled");
    let folder = QwenTokenizer::from_dir(&tiny_dir().join("tokenizer")).expect("folder");
    assert_eq!(bundled.pad, 151643);
    let mut n = 0;
    for case in cases.as_array().expect("list") {
        let text = case["text"].as_str().expect("text");
        let ids: Vec<i64> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|i| i.as_i64().expect("id"))
            .collect();
        assert_eq!(bundled.encode(text).expect("encode"), ids, "{text:?}");
        assert_eq!(folder.encode(text).expect("encode"), ids, "{text:?}");
        n += 1;
    }
    println!("{n} tokenizer cases exact");
}

#[test]
fn smart_resize_and_calculate_dimensions_match() {
    let r = Reference::load("text_encoder.safetensors");
    for c in r.meta["smart_resize"].as_array().expect("cases") {
        let v: Vec<i64> = c
            .as_array()
            .expect("case")
            .iter()
            .map(|x| x.as_i64().expect("int"))
            .collect();
        let got = smart_resize(v[0], v[1], v[2], v[3], v[4]).expect("smart_resize");
        assert_eq!(got, (v[5], v[6]), "smart_resize{:?}", &v[..5]);
    }
    for c in r.meta["calculate_dimensions"].as_array().expect("cases") {
        let v: Vec<i64> = c
            .as_array()
            .expect("case")
            .iter()
            .map(|x| x.as_i64().expect("int"))
            .collect();
        let got = calculate_dimensions(v[0] as f64, v[1] as f64 / v[2] as f64);
        assert_eq!(got, (v[3], v[4]), "calculate_dimensions{:?}", &v[..3]);
    }
    assert!(smart_resize(1, 300, 28, 3136, 1003520).is_err());
    assert!(smart_resize(0, 30, 28, 3136, 1003520).is_err());
}

/// The condition resize and the image processor are bit-exact (Pillow-exact LANCZOS / BICUBIC).
#[test]
fn processor_is_bit_exact() {
    let r = Reference::load("text_encoder.safetensors");
    let names: Vec<String> = r.meta["images"]
        .as_array()
        .expect("names")
        .iter()
        .map(|n| n.as_str().expect("name").to_string())
        .collect();
    let small = ImageProcessorConfig {
        condition_image_size: 56 * 56,
        ..ImageProcessorConfig::default()
    };
    let mut cond = Vec::new();
    for n in &names {
        let got = condition_resize(&input_image(n), &small).expect("resize");
        let want = rgb(r.get(&format!("cond.{n}")));
        assert_eq!(got.dimensions(), want.dimensions(), "{n}");
        let diff = got
            .as_raw()
            .iter()
            .zip(want.as_raw())
            .filter(|(a, b)| a != b)
            .count();
        println!("condition resize {n}: {diff} differing bytes");
        assert_eq!(diff, 0, "condition resize of {n}");
        cond.push(want);
    }
    let p = preprocess(&cond, &ImageProcessorConfig::default()).expect("preprocess");
    assert_eq!(p.grid_thw, r.grid("proc.grid_thw"));
    assert_eq!(
        rel_err(&p.pixel_values, r.get("proc.pixel_values")),
        0.0,
        "pixel_values"
    );
    let raw: Vec<_> = names.iter().map(|n| input_image(n)).collect();
    let p = preprocess(&raw, &ImageProcessorConfig::default()).expect("preprocess");
    assert_eq!(p.grid_thw, r.grid("raw.grid_thw"));
    assert_eq!(
        rel_err(&p.pixel_values, r.get("raw.pixel_values")),
        0.0,
        "raw pixel_values"
    );
}

#[test]
fn rope_index_matches() {
    let r = Reference::load("text_encoder.safetensors");
    let ids = ints(r.get("rope.input_ids"));
    let grids = r.grid("rope.grid_thw");
    let pos = get_rope_index(&ids, 151655, &grids, 2).expect("rope index");
    assert_eq!(pos.concat(), ints(r.get("rope.position_ids")));

    // A right-padded batch, each sequence with both images.
    let batch = r.get("rope_batch.input_ids");
    let mask = r.get("rope_batch.attention_mask");
    let (b, len) = batch.size2().expect("[B, L]");
    let seqs: Vec<Vec<i64>> = (0..b)
        .map(|i| {
            let n = mask.get(i).sum(Kind::Int64).int64_value(&[]);
            ints(&batch.get(i).narrow(0, 0, n))
        })
        .collect();
    let t = batch_position_ids(
        &seqs,
        &vec![grids.clone(); b as usize],
        len as usize,
        151655,
        2,
        PositionMode::Mrope,
    )
    .expect("batch positions");
    assert_eq!(ints(&t), ints(r.get("rope_batch.position_ids")));

    // The same through the mask-driven form, and with left padding.
    let rows = |t: &Tensor| -> Vec<Vec<i64>> { (0..b).map(|i| ints(&t.get(i))).collect() };
    for (case, ids_name) in [
        ("rope_batch", "rope_batch.input_ids"),
        ("rope_left", "rope_left.input_ids"),
    ] {
        let t = masked_position_ids(
            &rows(r.get(ids_name)),
            &rows(r.get(&format!("{case}.attention_mask"))),
            &vec![grids.clone(); b as usize],
            151655,
            2,
            PositionMode::Mrope,
        )
        .expect("masked positions");
        assert_eq!(
            ints(&t),
            ints(r.get(&format!("{case}.position_ids"))),
            "{case}"
        );
    }

    // Mismatched grids are errors, not panics.
    assert!(get_rope_index(&ids, 151655, &grids[..1], 2).is_err());
    assert!(get_rope_index(&ids, 151655, &[(1, 4, 4), (1, 4, 4), (1, 2, 2)], 2).is_err());
    assert!(get_rope_index(&ids, 151655, &[(1, 4, 4), (1, 3, 4)], 2).is_err());
}

/// measured: 0 with SDPA, 9.9e-8 with matmul (every load).
#[test]
fn language_model_matches() {
    let r = Reference::load("text_encoder.safetensors");
    let dir = tiny_dir().join("text_encoder");
    let stores: Vec<(&str, WeightStore, Fp8Mode)> = vec![
        (
            "folder",
            component_store(&dir, "model", |k| Some(k.to_string())).expect("folder"),
            Fp8Mode::Upcast,
        ),
        (
            "folder re-rooted",
            component_store(&dir, "model", reroot).expect("folder"),
            Fp8Mode::Upcast,
        ),
        (
            "comfy fp8 upcast",
            WeightStore::identity(Arc::new(
                SafetensorsFile::open(comfy_file()).expect("comfy"),
            )),
            Fp8Mode::Upcast,
        ),
        (
            "comfy fp8 resident",
            WeightStore::identity(Arc::new(
                SafetensorsFile::open(comfy_file()).expect("comfy"),
            )),
            Fp8Mode::Resident,
        ),
    ];
    for (what, store, fp8) in stores {
        let prefix = language_model_prefix(&store).expect("a language model");
        let w = Weights::new(Arc::new(store.with_fp8(fp8)), Device::Cpu, Kind::Float).pp(prefix);
        for imp in [AttentionImpl::Sdpa, AttentionImpl::Matmul] {
            let lm = LanguageModel::new(&w, &TextConfig::tiny(), imp).expect("tiny LM");
            let out = lm
                .forward(
                    r.get("lm.inputs_embeds"),
                    r.get("rope_batch.position_ids"),
                    Some(r.get("rope_batch.attention_mask")),
                )
                .expect("forward");
            check(
                &format!("LM {what} {imp:?} (M-RoPE, padded batch)"),
                &out,
                r.get("lm.output"),
                TOL,
            );
            // Left padding: rows rolled right by their padding; compare the tokens only.
            let mask = r.get("rope_left.attention_mask");
            let shift = (mask.eq(0)).sum_dim_intlist(1, false, Kind::Int64);
            let left = Tensor::stack(
                &(0..mask.size()[0])
                    .map(|i| {
                        r.get("lm.inputs_embeds")
                            .get(i)
                            .roll([shift.int64_value(&[i])], [0])
                    })
                    .collect::<Vec<_>>(),
                0,
            );
            let out = lm
                .forward(&left, r.get("rope_left.position_ids"), Some(mask))
                .expect("forward");
            let keep = mask.unsqueeze(-1).to_kind(Kind::Float);
            check(
                &format!("LM {what} {imp:?} (M-RoPE, left padding, tokens)"),
                &(out * &keep),
                &(r.get("lm_left.output") * &keep),
                TOL,
            );
            let ids = r.get("lm.input_ids");
            let l = ids.size()[1];
            let pos = Tensor::arange(l, (Kind::Int64, Device::Cpu))
                .view([1, 1, l])
                .expand([3, 1, l], false);
            let out = lm
                .forward(&lm.embed(ids).expect("embed"), &pos, None)
                .expect("forward");
            check(
                &format!("LM {what} {imp:?} (token ids)"),
                &out,
                r.get("lm.output_ids"),
                TOL,
            );
        }
    }
}

/// The full `encode_prompt` from the reference processor output (independent of resizing).
/// measured: ≤ 1.8e-7 (SDPA), ≤ 2.4e-7 (matmul), every load and position mode.
#[test]
fn encode_prompt_matches_the_pipeline() {
    let r = Reference::load("text_encoder.safetensors");
    let pv = r.get("proc.pixel_values");
    let grids = r.grid("proc.grid_thw");
    // Image a alone: its patches are the first t·h·w rows.
    let (t, h, w) = grids[0];
    let pv_one = pv.narrow(0, 0, t * h * w);
    for (positions, suffix) in [
        (PositionMode::Mrope, "mrope"),
        (PositionMode::Sequential, "sequential"),
    ] {
        for imp in [AttentionImpl::Sdpa, AttentionImpl::Matmul] {
            for fp8 in [Fp8Mode::Upcast, Fp8Mode::Resident] {
                for (what, enc) in encoders(opts(positions, imp, fp8)) {
                    let what = format!("{what} {imp:?} {fp8:?} {suffix}");
                    let one = enc
                        .encode_pixel_values(&pv_one, &grids[..1])
                        .expect("vision");
                    let e = enc.encode_prompt(&r.prompt("one"), &one).expect("encode");
                    check(
                        &format!("encode_prompt one image, {what}"),
                        &e,
                        &r.get(&format!("prompt.one.{suffix}")).select(0, 0),
                        TOL,
                    );
                    let two = enc.encode_pixel_values(pv, &grids).expect("vision");
                    let e = enc.encode_prompt(&r.prompt("two"), &two).expect("encode");
                    check(
                        &format!("encode_prompt two images, {what}"),
                        &e,
                        &r.get(&format!("prompt.two.{suffix}")).select(0, 0),
                        TOL,
                    );
                    if positions == PositionMode::Mrope {
                        let batch = r.batch_prompts();
                        let refs: Vec<&str> = batch.iter().map(String::as_str).collect();
                        let (e, mask) = enc.encode_prompts(&refs, &two).expect("batch");
                        check(
                            &format!("encode_prompts batch, {what}"),
                            &e,
                            r.get("prompt.batch.mrope"),
                            TOL,
                        );
                        assert_eq!(ints(&mask), ints(r.get("prompt.batch.mask")));
                    }
                }
            }
        }
    }
    // The two position modes really differ on this prompt.
    // (tiny random model: 3.1e-4 for two images, 4.9e-4 for one; far above TOL)
    assert!(rel_err(r.get("prompt.two.mrope"), r.get("prompt.two.sequential")) > 1e-4);
}

/// End to end from the PNG inputs (condition resize, processor, vision, LM), on the folder.
#[test]
fn encode_images_from_png_matches_the_pipeline() {
    let r = Reference::load("text_encoder.safetensors");
    let mut enc = QwenTextEncoder::load_diffusers(&tiny_dir(), TextEncoderOptions::default())
        .expect("tiny folder");
    enc.processor.condition_image_size = 56 * 56;
    let a = input_image("a_48x40");
    let b = input_image("b_32x56");
    let one = enc.encode_images(std::slice::from_ref(&a)).expect("images");
    let e = enc.encode_prompt(&r.prompt("one"), &one).expect("encode");
    check(
        "PNG one image",
        &e,
        &r.get("prompt.one.mrope").select(0, 0),
        TOL,
    );
    let two = enc.encode_images(&[a, b]).expect("images");
    let e = enc.encode_prompt(&r.prompt("two"), &two).expect("encode");
    check(
        "PNG two images",
        &e,
        &r.get("prompt.two.mrope").select(0, 0),
        TOL,
    );
}

#[test]
fn bad_requests_are_errors() {
    let enc = QwenTextEncoder::load_diffusers(&tiny_dir(), TextEncoderOptions::default())
        .expect("tiny folder");
    let r = Reference::load("text_encoder.safetensors");
    let grids = r.grid("proc.grid_thw");
    let two = enc
        .encode_pixel_values(r.get("proc.pixel_values"), &grids)
        .expect("vision");
    assert!(enc.encode_prompt("a <|image_pad|> b", &two).is_err());
    assert!(enc.encode_prompt("a <|video_pad|> b", &two).is_err());
    assert!(enc.encode_prompts(&[], &two).is_err());
    assert!(
        enc.encode_pixel_values(r.get("proc.pixel_values"), &grids[..1])
            .is_err()
    );
    // Special tokens in the instruction are kept (as the reference), not an error.
    assert!(enc.encode_prompt("<|im_end|>", &two).is_ok());
    let empty = image::RgbImage::new(0, 0);
    assert!(enc.encode_images(&[empty]).is_err());
}

/// `TextConfig::qwen2_5_vl_7b()` asks for exactly the tensors (names and shapes) of transformers'
/// real-size `Qwen2_5_VLTextModel` (`reference/language_model_7b_shapes.json`).
#[test]
fn the_7b_preset_matches_the_real_tensor_list() {
    let text = std::fs::read_to_string(
        fixtures()
            .join("reference")
            .join("language_model_7b_shapes.json"),
    )
    .expect("shapes file");
    let shapes: HashMap<String, Vec<i64>> = serde_json::from_str(&text).expect("json");
    let n = shapes.len();
    let store = Arc::new(WeightStore::placeholders(shapes));
    let w = Weights::new(store.clone(), Device::Cpu, Kind::Float);
    LanguageModel::new(&w, &TextConfig::qwen2_5_vl_7b(), AttentionImpl::Sdpa).expect("7B LM");
    assert!(store.unused().is_empty(), "unused: {:?}", store.unused());
    println!("{n} real-size tensors, all asked for with their shapes");
}

/// The fixtures' full-pipeline runs (`reference/pipeline.safetensors` + `pipeline.json`, written by
/// `make_qwen_fixtures.py` with diffusers 0.42.1 + transformers 5.24.0 unpatched, hence sequential
/// positions): grids, pixel values (bit-exact), token ids and prompt embeddings from the PNG
/// inputs, including case `a_fullsize` at the real CONDITION_IMAGE_SIZE 384².
/// measured: pixel values exact; prompt embeddings ≤ 2.3e-7.
#[test]
fn pipeline_fixture_cases_match() {
    let dir = fixtures().join("reference");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pipeline.json")).expect("pipeline.json"),
    )
    .expect("json");
    let f = SafetensorsFile::open(dir.join("pipeline.safetensors")).expect("pipeline reference");
    let load = |name: &str, kind| f.load(name, Device::Cpu, kind).expect(name);
    let mut enc = QwenTextEncoder::load_diffusers(
        &tiny_dir(),
        opts(
            PositionMode::Sequential,
            AttentionImpl::Sdpa,
            Fp8Mode::Upcast,
        ),
    )
    .expect("tiny folder");
    let mut checked = 0;
    for (case, c) in meta["cases"].as_object().expect("cases") {
        if f.info(&format!("{case}.prompt_embeds")).is_none() {
            continue;
        }
        enc.processor.condition_image_size = c["condition_image_size"].as_i64().expect("area");
        let images: Vec<_> = c["images"]
            .as_array()
            .expect("images")
            .iter()
            .map(|n| input_image(n.as_str().expect("name").trim_end_matches(".png")))
            .collect();
        let resized: Vec<_> = images
            .iter()
            .map(|i| condition_resize(i, &enc.processor).expect("resize"))
            .collect();
        let p = preprocess(&resized, &enc.processor).expect("preprocess");
        let grid: Vec<(i64, i64, i64)> =
            ints(&load(&format!("{case}.image_grid_thw"), Kind::Int64))
                .chunks(3)
                .map(|g| (g[0], g[1], g[2]))
                .collect();
        assert_eq!(p.grid_thw, grid, "{case} grids");
        let (pv_name, pv) = match f.info(&format!("{case}.pixel_values")) {
            Some(_) => (
                format!("{case}.pixel_values"),
                p.pixel_values.shallow_clone(),
            ),
            None => {
                let name = format!("{case}.pixel_values_head");
                let rows = f.info(&name).expect("pixel_values_head").shape[0];
                (name, p.pixel_values.narrow(0, 0, rows))
            }
        };
        assert_eq!(
            rel_err(&pv, &load(&pv_name, Kind::Float)),
            0.0,
            "{}",
            pv_name
        );
        let feats = enc
            .encode_pixel_values(&p.pixel_values, &p.grid_thw)
            .expect("vision");
        let prompt = c["prompt"].as_str().expect("prompt");
        assert_eq!(
            enc.prompt_ids(prompt, &feats).expect("ids"),
            ints(&load(&format!("{case}.input_ids"), Kind::Int64)),
            "{case} input ids"
        );
        let e = enc.encode_prompt(prompt, &feats).expect("encode");
        check(
            &format!(
                "pipeline case {case} prompt_embeds ({} images)",
                images.len()
            ),
            &e,
            &load(&format!("{case}.prompt_embeds"), Kind::Float),
            TOL,
        );
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} pipeline cases");
}

/// bf16 weights and activations (the production dtype) run through every dtype-sensitive path
/// (mask, rotary cast, feature scatter, padding) and stay close to the fp32 reference.
/// measured: 7.0e-3 (tolerance 5e-2: bf16 has 8 mantissa bits).
#[test]
fn bf16_is_close_to_the_fp32_reference() {
    let r = Reference::load("text_encoder.safetensors");
    let o = TextEncoderOptions {
        kind: Kind::BFloat16,
        ..TextEncoderOptions::default()
    };
    let enc = QwenTextEncoder::load_diffusers(&tiny_dir(), o).expect("tiny folder");
    let grids = r.grid("proc.grid_thw");
    let two = enc
        .encode_pixel_values(r.get("proc.pixel_values"), &grids)
        .expect("vision");
    let e = enc.encode_prompt(&r.prompt("two"), &two).expect("encode");
    assert_eq!(e.kind(), Kind::BFloat16);
    check(
        "bf16 encode_prompt two images",
        &e,
        &r.get("prompt.two.mrope").select(0, 0),
        5e-2,
    );
    let batch = r.batch_prompts();
    let refs: Vec<&str> = batch.iter().map(String::as_str).collect();
    let (e, _) = enc.encode_prompts(&refs, &two).expect("batch");
    check(
        "bf16 encode_prompts batch",
        &e,
        r.get("prompt.batch.mrope"),
        5e-2,
    );
}
