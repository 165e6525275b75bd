//! Whole Qwen-Image-Edit-2509 edits against diffusers' `QwenImageEditPlusPipeline` on the tiny
//! fixture (`fixtures/qwen/make_qwen_fixtures.py`, cases a, b, c of `reference/pipeline.*`), through
//! the encode-once API: the inputs' VAE latents, then the output images; loading the ComfyUI-style
//! single files (fp8 transformer, scaled-fp8 text encoder, Wan VAE: the folder's tensors in those
//! forms, written at test time by `support::derived`) and the diffusers folder.
//! Plus: encode once and edit many equals editing each variant alone; per-job LoRAs are applied
//! and the base restored bit for bit; bad requests are errors.
//!
//! The references were made with transformers 5.24, where diffusers 0.42.1 feeds the text encoder
//! sequential position ids (`PositionMode::Sequential`, see `qwen2_5_vl::rope`); the tests use that
//! mode to match them.

use image::RgbImage;
use serde_json::Value;
use tch::{Device, Kind, Tensor};
use vnfarm_models::error::GenerateError;
use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::Fp8Mode;
use vnfarm_models::nn::tiling::Tiling;
use vnfarm_models::qwen_image::pipeline::{
    EditRequest, QwenEditConfig, QwenEditPipeline, QwenSource,
};
use vnfarm_models::qwen2_5_vl::rope::PositionMode;
use vnfarm_models::schedulers::FlowMatchConfig;

use crate::qwen_fixtures::fixtures;
use crate::support;

struct Reference {
    file: SafetensorsFile,
    meta: Value,
}

impl Reference {
    fn open() -> Self {
        let file = SafetensorsFile::open(fixtures().join("reference/pipeline.safetensors"))
            .expect("pipeline reference");
        let meta = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("reference/pipeline.json")).unwrap(),
        )
        .unwrap();
        Self { file, meta }
    }

    fn case(&self, name: &str) -> &Value {
        &self.meta["cases"][name]
    }

    fn tensor(&self, name: &str) -> Tensor {
        self.file
            .load(name, Device::Cpu, Kind::Float)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

fn input(name: &str) -> RgbImage {
    image::open(fixtures().join("inputs").join(name))
        .expect("fixture input")
        .to_rgb8()
}

fn files_source() -> QwenSource {
    let root = support::fixture_root();
    QwenSource::Files {
        transformer: support::derived::qwen_transformer_fp8(&root),
        text_encoder: support::derived::qwen_text_encoder_fp8_scaled(&root),
        vae: support::derived::qwen_vae_wan(&root),
        config_dir: Some(fixtures().join("qwen_tiny")),
    }
}

/// fp32 on the CPU with the case's reference sizes and scheduler.
fn config(source: QwenSource, case: &Value) -> QwenEditConfig {
    let mut c = QwenEditConfig::new(source, Device::Cpu);
    c.dtype = Kind::Float;
    c.vae_dtype = Kind::Float;
    c.positions = PositionMode::Sequential;
    c.vae_tiling = Tiling::Never;
    c.condition_image_area = case["condition_image_size"].as_u64().unwrap();
    c.vae_image_area = case["vae_image_size"].as_u64().unwrap();
    c.scheduler =
        Some(FlowMatchConfig::from_json(&case["scheduler_config"].to_string()).expect("scheduler"));
    c
}

fn request(case: &Value) -> EditRequest {
    let hw = &case["output_hw"];
    EditRequest {
        instruction: case["prompt"].as_str().unwrap().into(),
        seed: case["seed"].as_u64().unwrap(),
        steps: case["steps"].as_u64().unwrap() as usize,
        cfg: case["true_cfg_scale"].as_f64().unwrap(),
        size: Some((
            hw[1].as_u64().unwrap() as u32,
            hw[0].as_u64().unwrap() as u32,
        )),
    }
}

fn inputs(case: &Value) -> Vec<RgbImage> {
    case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| input(n.as_str().unwrap()))
        .collect()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).abs().max().double_value(&[]);
    d / b.abs().max().double_value(&[])
}

/// Mean and max absolute difference of an RGB8 image and a float `[H, W, 3]` reference, in 1/255.
fn image_error(img: &RgbImage, reference: &Tensor) -> (f64, f64) {
    let (h, w) = (i64::from(img.height()), i64::from(img.width()));
    assert_eq!(reference.size(), [h, w, 3], "image size");
    let got = Tensor::from_slice(img.as_raw())
        .to_kind(Kind::Float)
        .view([h, w, 3]);
    let d = (got - reference * 255.0).abs();
    (
        d.mean(Kind::Double).double_value(&[]),
        d.max().double_value(&[]),
    )
}

/// Cases a (one input), b (two inputs, windowed vision attention) and c (Lightning, 4 steps):
/// the VAE latents of the inputs and the final images.
#[test]
fn edits_match_diffusers() {
    let reference = Reference::open();
    for name in ["a", "b", "c"] {
        let case = reference.case(name);
        let pipe = QwenEditPipeline::load(&config(files_source(), case)).expect("load");
        let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
        if name != "c" {
            let want = reference.tensor(&format!("{name}.image_latents"));
            let got = encoded.image_latents.squeeze_dim(0);
            let e = rel(&got, &want);
            println!("{name}: image latents rel {e:.2e}");
            assert!(e <= 1e-5, "{name}: image latents rel {e:.2e}");
        }
        let mut steps = Vec::new();
        let (images, _) = pipe
            .edit(
                &encoded,
                &[request(case)],
                &mut |done, total| steps.push((done, total)),
                &|| false,
            )
            .expect("edit");
        let n = case["steps"].as_u64().unwrap() as usize;
        assert_eq!(steps, (1..=n).map(|s| (s, n)).collect::<Vec<_>>());
        let (mean, max) = image_error(&images[0], &reference.tensor(&format!("{name}.output")));
        println!("{name}: image mean {mean:.3}/255, max {max:.1}/255");
        // 0.25/255 is quantisation alone.
        assert!(
            mean <= 0.5 && max <= 2.0,
            "{name}: mean {mean:.3}, max {max:.1}"
        );
    }
}

/// The diffusers folder (transformer folder, sharded text encoder, diffusers-named VAE), with fp8
/// kept resident for the single files, gives the same image.
#[test]
fn every_format_and_fp8_mode_gives_the_same_edit() {
    let reference = Reference::open();
    let case = reference.case("a");
    let want = reference.tensor("a.output");
    for (label, source, fp8) in [
        (
            "folder",
            QwenSource::DiffusersFolder(fixtures().join("qwen_tiny")),
            Fp8Mode::Upcast,
        ),
        ("files, fp8 resident", files_source(), Fp8Mode::Resident),
    ] {
        let mut c = config(source, case);
        c.settings.fp8 = fp8;
        let pipe = QwenEditPipeline::load(&c).expect("load");
        let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
        let (images, _) = pipe
            .edit(&encoded, &[request(case)], &mut |_, _| {}, &|| false)
            .expect("edit");
        let (mean, max) = image_error(&images[0], &want);
        println!("{label}: image mean {mean:.3}/255, max {max:.1}/255");
        assert!(
            mean <= 0.5 && max <= 2.0,
            "{label}: mean {mean:.3}, max {max:.1}"
        );
    }
}

/// Encode once, edit many: three variants of one input set in one call (micro-batched, prompts of
/// different lengths padded with a mask) are the images each variant gets alone.
#[test]
fn variants_of_one_input_equal_each_variant_alone() {
    let reference = Reference::open();
    let case = reference.case("a");
    let mut c = config(files_source(), case);
    c.max_batch = 3;
    let pipe = QwenEditPipeline::load(&c).expect("load");
    let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
    let base = request(case);
    let variants: Vec<EditRequest> = [
        ("make her smile", 7),
        ("make her angry, with furrowed brows and a frown", 8),
        ("make her cry", 9),
    ]
    .iter()
    .map(|(t, s)| EditRequest {
        instruction: (*t).into(),
        seed: *s,
        ..base.clone()
    })
    .collect();
    let mut progress = Vec::new();
    let (together, _) = pipe
        .edit(
            &encoded,
            &variants,
            &mut |done, total| progress.push((done, total)),
            &|| false,
        )
        .expect("batch");
    assert_eq!(
        progress.last(),
        Some(&(6, 6)),
        "steps counted over the variants"
    );
    for (v, img) in variants.iter().zip(&together) {
        let (alone, _) = pipe
            .edit(&encoded, std::slice::from_ref(v), &mut |_, _| {}, &|| false)
            .expect("alone");
        let a = Tensor::from_slice(alone[0].as_raw()).to_kind(Kind::Float);
        let b = Tensor::from_slice(img.as_raw()).to_kind(Kind::Float);
        let max = (a - b).abs().max().double_value(&[]);
        println!("{}: batched vs alone max {max}/255", v.instruction);
        assert!(
            max <= 1.0,
            "{}: batched differs by {max}/255",
            v.instruction
        );
    }
    // The first variant is case a itself.
    let (mean, _) = image_error(&together[0], &reference.tensor("a.output"));
    assert!(mean <= 0.5, "batched variant 0: mean {mean:.3}");
}

/// A job's LoRA is fused for that job and the base comes back bit for bit; the same set twice
/// costs nothing; a LoRA that matches nothing is a clear error that leaves the model as it was.
#[test]
fn job_loras_apply_and_restore_exactly() {
    let reference = Reference::open();
    let case = reference.case("a");
    let mut pipe = QwenEditPipeline::load(&config(files_source(), case)).expect("load");
    let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
    let run = |pipe: &QwenEditPipeline| {
        pipe.edit(&encoded, &[request(case)], &mut |_, _| {}, &|| false)
            .expect("edit")
            .0
            .remove(0)
    };
    let before = run(&pipe);
    let lora = vec![LoraSpec {
        path: fixtures().join("lora/lightx2v.safetensors"),
        strength: 1.0,
    }];
    pipe.set_job_loras(&lora).expect("apply");
    pipe.set_job_loras(&lora).expect("same set again");
    let with = run(&pipe);
    assert_ne!(with.as_raw(), before.as_raw(), "the LoRA changes the image");
    pipe.set_job_loras(&[]).expect("restore");
    assert_eq!(
        run(&pipe).as_raw(),
        before.as_raw(),
        "the base is back bit for bit"
    );
    let nomatch = vec![LoraSpec {
        path: fixtures().join("lora/nomatch.safetensors"),
        strength: 1.0,
    }];
    match pipe.set_job_loras(&nomatch) {
        Err(GenerateError::InvalidRequest(m)) => println!("nomatch: {m}"),
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
    assert_eq!(
        run(&pipe).as_raw(),
        before.as_raw(),
        "a failed LoRA changes nothing"
    );
}

/// A LoRA the pipeline is loaded with is fused for good (no original kept) and edits exactly as
/// the same LoRA applied for a job (originals kept): the same fused weights, the same image.
#[test]
fn a_load_time_lora_edits_as_the_same_lora_for_a_job() {
    let reference = Reference::open();
    let case = reference.case("a");
    let lora = vec![LoraSpec {
        path: fixtures().join("lora/lightx2v.safetensors"),
        strength: 0.7,
    }];
    let run = |pipe: &QwenEditPipeline| {
        let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
        pipe.edit(&encoded, &[request(case)], &mut |_, _| {}, &|| false)
            .expect("edit")
            .0
            .remove(0)
    };
    let mut with_lora = config(files_source(), case);
    with_lora.loras = lora.clone();
    let at_load = run(&QwenEditPipeline::load(&with_lora).expect("load with the LoRA"));
    let mut pipe = QwenEditPipeline::load(&config(files_source(), case)).expect("load");
    let base = run(&pipe);
    pipe.set_job_loras(&lora).expect("apply for a job");
    let for_a_job = run(&pipe);
    assert_ne!(
        at_load.as_raw(),
        base.as_raw(),
        "the LoRA changes the image"
    );
    assert_eq!(
        at_load.as_raw(),
        for_a_job.as_raw(),
        "fused at load = fused for a job"
    );
}

/// Encodings shared through bytes (another worker's, case b: two inputs) are the same tensors, give
/// the same image, and bytes that are damaged or made for another model are errors.
#[test]
fn encodings_round_trip_through_bytes() {
    let reference = Reference::open();
    let case = reference.case("b");
    let pipe = QwenEditPipeline::load(&config(files_source(), case)).expect("load");
    let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
    let bytes = pipe.encodings_to_bytes(&encoded).expect("to bytes");
    let back = pipe.encodings_from_bytes(&bytes).expect("from bytes");
    assert!(back.image_latents.equal(&encoded.image_latents), "latents");
    assert!(
        back.features.features.equal(&encoded.features.features),
        "features"
    );
    assert_eq!(back.latent_shapes, encoded.latent_shapes);
    assert_eq!(back.features.grid_thw, encoded.features.grid_thw);
    assert_eq!(
        back.features.tokens_per_image,
        encoded.features.tokens_per_image
    );
    assert_eq!(back.last_input_size, encoded.last_input_size);
    let edit = |e| {
        pipe.edit(e, &[request(case)], &mut |_, _| {}, &|| false)
            .expect("edit")
            .0
            .remove(0)
    };
    assert_eq!(
        edit(&back),
        edit(&encoded),
        "the same image from shared encodings"
    );

    let refused = |bytes: &[u8], why: &str| {
        let e = pipe
            .encodings_from_bytes(bytes)
            .expect_err(&format!("{why}: accepted"));
        println!("{why}: {e}");
    };
    refused(&bytes[..bytes.len() - 7], "truncated");
    refused(&bytes[..100], "cut in the header");
    refused(b"not encodings", "garbage");
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    refused(&flipped, "a bit flipped in the data");
    // Another model: the same inputs encoded in bf16 are not this fp32 model's encodings.
    let mut c = config(files_source(), case);
    c.dtype = Kind::BFloat16;
    let bf16 = QwenEditPipeline::load(&c).expect("load bf16");
    let other = bf16
        .encodings_to_bytes(&bf16.encode_inputs(&inputs(case)).expect("encode bf16"))
        .expect("bf16 bytes");
    refused(&other, "bf16 for an fp32 model");
    // A format tag from elsewhere.
    let tag = b"vnfarm.qwen_edit.encodings.v1";
    let at = bytes
        .windows(tag.len())
        .position(|w| w == tag)
        .expect("format tag in the header");
    let mut foreign = bytes.clone();
    foreign[at + tag.len() - 1] = b'9';
    refused(&foreign, "another format");
}

#[test]
fn bad_requests_are_errors() {
    let reference = Reference::open();
    let case = reference.case("a");
    let pipe = QwenEditPipeline::load(&config(files_source(), case)).expect("load");
    assert!(matches!(
        pipe.encode_inputs(&[]),
        Err(GenerateError::InvalidRequest(_))
    ));
    let four = vec![input("a_48x40.png"); 4];
    assert!(matches!(
        pipe.encode_inputs(&four),
        Err(GenerateError::InvalidRequest(_))
    ));
    let encoded = pipe.encode_inputs(&inputs(case)).expect("encode");
    let mut r = request(case);
    r.steps = 0;
    assert!(matches!(
        pipe.edit(&encoded, &[r], &mut |_, _| {}, &|| false),
        Err(GenerateError::InvalidRequest(_))
    ));
    assert!(matches!(
        pipe.edit(&encoded, &[request(case)], &mut |_, _| {}, &|| true),
        Err(GenerateError::Cancelled)
    ));
}

#[test]
fn a_truncated_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(support::derived::qwen_transformer_fp8(
        &support::fixture_root(),
    ))
    .unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let QwenSource::Files {
        text_encoder,
        vae,
        config_dir,
        ..
    } = files_source()
    else {
        unreachable!()
    };
    let source = QwenSource::Files {
        transformer: cut,
        text_encoder,
        vae,
        config_dir,
    };
    let reference = Reference::open();
    let err = QwenEditPipeline::load(&config(source, reference.case("a")))
        .err()
        .expect("a truncated file fails")
        .to_string();
    assert!(
        err.contains("cut.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

/// A warm-up edit runs the fewest steps its scheduler can make: one under the Lightning scheduler
/// (the worker's default), two under Qwen-Image's own (its terminal stretch is 0/0 at one step);
/// both warm-ups run.
#[test]
fn the_warm_up_runs_the_fewest_steps_its_schedule_allows() {
    let reference = Reference::open();
    let case = reference.case("a");
    for (scheduler, steps) in [
        (FlowMatchConfig::qwen_image_lightning(), 1),
        (FlowMatchConfig::qwen_image(), 2),
    ] {
        let mut c = config(files_source(), case);
        c.scheduler = Some(scheduler);
        let pipe = QwenEditPipeline::load(&c).expect("load");
        assert_eq!(pipe.warm_up_steps(), steps);
        pipe.warm_up(&[(64, 64)]).expect("warm up");
    }
}
