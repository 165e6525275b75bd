//! LoRA fusing (`loading::lora`) against diffusers 0.42.1 `load_lora_weights` + `fuse_lora` on the
//! tiny Qwen transformer (`fixtures/qwen/make_qwen_fixtures.py`: `lora/*.safetensors`,
//! `reference/lora.safetensors`), plus small files written here for the error paths and conv LoRAs.
//! The four styles are one LoRA in four layouts, which diffusers fuses to the same bytes (the script
//! checks it), so the reference holds one copy per strength: `<strength>.<weight name>`.
//!
//! Target: every 2-D weight of the tiny transformer as a `Linear`, by diffusers module name.
//! Tolerances (relative error = max|a − b| / max|b| per weight): fp32 fusing ≤ 1e-6 (measured
//! 2.1e-7, rounding order only; PEFT 0); two LoRAs at once ≤ 1e-6 against the sum of diffusers'
//! deltas (measured 1.8e-7); fp8-resident fusing: every element within half an e4m3fn step of the
//! fp32 result (|Δ| ≤ 2⁻⁴·|x| + 2⁻¹⁰·scale; measured max|Δ|/max|x| = 3.6e-2, fp8's own
//! resolution); restore: bit-exact (fp32 and fp8 with and without a scale).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use vnfarm_models::loading::lora::{
    Component, JobLoras, LoraError, LoraFile, LoraModule, LoraSpec, LoraTarget, PartFuser,
    TargetRef, apply, fuse_for_good,
};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::loading::weights::{WeightStore, Weights};
use vnfarm_models::nn::{Conv2d, Linear};
use vnfarm_models::noise;

const TOL: f64 = 1e-6;

fn qwen() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/qwen")
}

fn lora(style: &str) -> LoraFile {
    LoraFile::open(qwen().join(format!("lora/{style}.safetensors")))
        .unwrap_or_else(|e| panic!("{style}: {e}"))
}

/// Every 2-D weight of the tiny transformer as an fp32 `Linear` named like the module.
fn tiny_target() -> BTreeMap<String, Linear> {
    let f = SafetensorsFile::open(
        qwen().join("qwen_tiny/transformer/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    f.names()
        .filter(|n| n.ends_with(".weight") && f.info(n).unwrap().shape.len() == 2)
        .map(|n| {
            let l = Linear {
                weight: f.load(n, Device::Cpu, Kind::Float).unwrap(),
                weight_scale: None,
                bias: None,
            };
            (n.trim_end_matches(".weight").to_string(), l)
        })
        .collect()
}

/// The modules the fixture LoRAs patch (`reference/lora.json`).
fn lora_modules() -> Vec<String> {
    let text = std::fs::read_to_string(qwen().join("reference/lora.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect()
}

/// diffusers' fused weights, `<strength>.<weight name>` (every style fuses to these).
fn reference() -> SafetensorsFile {
    SafetensorsFile::open(qwen().join("reference/lora.safetensors")).unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    d / b.to_kind(Kind::Double).abs().max().double_value(&[])
}

fn denoiser(t: &mut dyn LoraTarget) -> [TargetRef<'_>; 1] {
    [TargetRef {
        component: Component::Denoiser,
        target: t,
    }]
}

fn snapshot(t: &BTreeMap<String, Linear>) -> BTreeMap<String, (Tensor, Option<Tensor>)> {
    t.iter()
        .map(|(k, l)| {
            (
                k.clone(),
                (l.weight.copy(), l.weight_scale.as_ref().map(Tensor::copy)),
            )
        })
        .collect()
}

fn assert_bit_equal(t: &BTreeMap<String, Linear>, s: &BTreeMap<String, (Tensor, Option<Tensor>)>) {
    for (k, l) in t {
        let (w, sc) = &s[k];
        assert_eq!(l.weight.kind(), w.kind(), "{k}");
        // Compare the bytes (fp8 has no `equal` on every backend).
        let bytes = |x: &Tensor| x.view_dtype(Kind::Uint8);
        assert!(
            bytes(&l.weight).equal(&bytes(w)),
            "{k} differs after restore"
        );
        match (&l.weight_scale, sc) {
            (None, None) => {}
            (Some(a), Some(b)) => assert!(a.equal(b), "{k} scale differs"),
            _ => panic!("{k}: scale presence differs after restore"),
        }
    }
}

#[test]
fn fused_weights_match_diffusers_for_every_style() {
    let r = reference();
    for (style, strength) in [
        ("lightx2v", 1.0),
        ("lightx2v", 0.7),
        ("kohya", 1.0),
        ("peft", 1.0),
        ("comfy", 1.0),
    ] {
        let mut target = tiny_target();
        let total = target.len();
        let file = lora(style);
        let applied = apply(&[(&file, strength)], &mut denoiser(&mut target)).unwrap();
        let report = &applied.report().files[0];
        let mut expected = lora_modules();
        expected.sort();
        assert_eq!(report.fused, expected, "{style}");
        assert!(
            report.unmatched.is_empty(),
            "{style}: {:?}",
            report.unmatched
        );
        assert_eq!(report.untouched, total - expected.len());
        let mut worst = 0.0f64;
        let prefix = format!("{strength:.1}.");
        let mut n = 0;
        for key in r.names().filter(|k| k.starts_with(&prefix)) {
            let module = key[prefix.len()..].trim_end_matches(".weight");
            let want = r.load(key, Device::Cpu, Kind::Float).unwrap();
            let e = rel(&target[module].weight, &want);
            assert!(e <= TOL, "{style} {strength} {module}: {e:e}");
            worst = worst.max(e);
            n += 1;
        }
        assert_eq!(n, expected.len());
        println!("{style} × {strength}: max rel error {worst:e} over {n} weights");
    }
}

#[test]
fn a_lora_that_matches_nothing_is_an_error() {
    let mut target = tiny_target();
    let before = snapshot(&target);
    let err = apply(&[(&lora("nomatch"), 1.0)], &mut denoiser(&mut target)).unwrap_err();
    assert!(matches!(err, LoraError::NoMatch { .. }), "{err}");
    assert!(err.to_string().contains("nomatch.safetensors"), "{err}");
    // A failing set leaves the model untouched, even when another file of it matches.
    let err = apply(
        &[(&lora("lightx2v"), 1.0), (&lora("nomatch"), 1.0)],
        &mut denoiser(&mut target),
    )
    .unwrap_err();
    assert!(matches!(err, LoraError::NoMatch { .. }), "{err}");
    assert_bit_equal(&target, &before);
}

#[test]
fn restore_is_bit_exact() {
    let mut target = tiny_target();
    let before = snapshot(&target);
    let applied = apply(
        &[(&lora("lightx2v"), 1.0), (&lora("kohya"), 0.5)],
        &mut denoiser(&mut target),
    )
    .unwrap();
    assert!(!target["img_in"].weight.equal(&before["img_in"].0));
    applied.restore(&mut denoiser(&mut target)).unwrap();
    assert_bit_equal(&target, &before);
}

#[test]
fn two_loras_at_once_add_up() {
    let r = reference();
    let mut target = tiny_target();
    let base = snapshot(&target);
    apply(
        &[(&lora("lightx2v"), 0.7), (&lora("comfy"), 1.0)],
        &mut denoiser(&mut target),
    )
    .unwrap();
    let mut worst = 0.0f64;
    for key in r.names().filter(|k| k.starts_with("1.0.")) {
        let module = key["1.0.".len()..].trim_end_matches(".weight");
        let b = base[module].0.to_kind(Kind::Double);
        let d07 = r
            .load(&format!("0.7.{module}.weight"), Device::Cpu, Kind::Double)
            .unwrap()
            - &b;
        let d10 = r.load(key, Device::Cpu, Kind::Double).unwrap() - &b;
        let want = &b + d07 + d10;
        let e = rel(&target[module].weight, &want);
        assert!(e <= TOL, "{module}: {e:e}");
        worst = worst.max(e);
    }
    println!("lightx2v × 0.7 + comfy × 1.0: max rel error {worst:e}");
}

/// The tiny transformer with fp8 weights. Its matrices are e4m3fn-representable: fp8 with scale
/// 1, and for half of them a power-of-two scale (also exact), so the base is the same as in fp32.
fn tiny_fp8_target() -> BTreeMap<String, Linear> {
    let mut target = tiny_target();
    for (i, l) in target.values_mut().enumerate() {
        if i % 2 == 0 {
            l.weight = l.weight.to_kind(Kind::Float8e4m3fn);
        } else {
            let s = Tensor::from(0.5f32);
            l.weight = (&l.weight / &s).to_kind(Kind::Float8e4m3fn);
            l.weight_scale = Some(s);
        }
    }
    target
}

#[test]
fn fp8_resident_fusing_stays_within_half_an_fp8_step() {
    let r = reference();
    let mut target = tiny_fp8_target();
    let before = snapshot(&target);
    let applied = apply(&[(&lora("lightx2v"), 1.0)], &mut denoiser(&mut target)).unwrap();
    let mut worst = 0.0f64;
    for key in r.names().filter(|k| k.starts_with("1.0.")) {
        let module = key["1.0.".len()..].trim_end_matches(".weight");
        let l = &target[module];
        assert_eq!(l.weight.kind(), Kind::Float8e4m3fn);
        let scale = l
            .weight_scale
            .as_ref()
            .expect("a fresh scale")
            .double_value(&[]);
        let want = r.load(key, Device::Cpu, Kind::Double).unwrap();
        let got = l.dense_weight(Kind::Double);
        let bound = want.abs() * 2f64.powi(-4) + scale * 2f64.powi(-10);
        let excess = ((&got - &want).abs() - bound).max().double_value(&[]);
        assert!(excess <= 0.0, "{module}: exceeds the bound by {excess:e}");
        worst = worst.max(rel(&got, &want));
    }
    println!("fp8-resident fusing: max rel error {worst:e} (bound: half an e4m3fn step)");
    applied.restore(&mut denoiser(&mut target)).unwrap();
    assert_bit_equal(&target, &before);
}

/// A load-time LoRA fused for good makes the weights `apply` makes, bit for bit (fp32, and fp8
/// with and without a scale), with the same report, and keeps nothing: `apply` keeps every weight
/// it replaced (and each fp8 scale).
#[test]
fn a_fuse_for_good_equals_apply_and_keeps_no_copy() {
    for (base, make) in [
        ("fp32", tiny_target as fn() -> BTreeMap<String, Linear>),
        ("fp8", tiny_fp8_target),
    ] {
        let loras = [(&lora("lightx2v"), 0.7), (&lora("kohya"), 0.5)];
        let mut restorable = make();
        let applied = apply(&loras, &mut denoiser(&mut restorable)).unwrap();
        let mut for_good = make();
        let report = fuse_for_good(&loras, &mut denoiser(&mut for_good)).unwrap();

        assert_eq!(
            report.kept_bytes, 0,
            "{base}: a fuse for good keeps no copy"
        );
        assert_eq!(report.files, applied.report().files, "{base}");
        assert_eq!(
            report.fused_modules,
            applied.report().fused_modules,
            "{base}"
        );
        let base_weights = make();
        let replaced: u64 = lora_modules()
            .iter()
            .map(|m| {
                let l = &base_weights[m];
                let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
                bytes(&l.weight) + l.weight_scale.as_ref().map_or(0, bytes)
            })
            .sum();
        assert!(replaced > 0);
        assert_eq!(
            applied.report().kept_bytes,
            replaced,
            "{base}: apply keeps every weight it replaced"
        );
        assert_bit_equal(&for_good, &snapshot(&restorable));
    }
}

/// Fused in two parts on two threads at once (a model's blocks as they load), the weights are the
/// whole-model fuse's bit for bit, and so is the report; a file that matches no module of one part
/// is no error there, but one that matches no module of any part is.
#[test]
fn a_fuse_in_parts_equals_the_whole_fuse() {
    let specs = [("lightx2v", 0.7), ("kohya", 0.5)].map(|(style, strength)| LoraSpec {
        path: qwen().join(format!("lora/{style}.safetensors")),
        strength,
    });
    for (base, make) in [
        ("fp32", tiny_target as fn() -> BTreeMap<String, Linear>),
        ("fp8", tiny_fp8_target),
    ] {
        let files = [lora("lightx2v"), lora("kohya")];
        let mut whole = make();
        let report = fuse_for_good(
            &[(&files[0], 0.7), (&files[1], 0.5)],
            &mut denoiser(&mut whole),
        )
        .unwrap();

        let (mut first, mut rest): (BTreeMap<_, _>, BTreeMap<_, _>) = make()
            .into_iter()
            .partition(|(name, _)| name.starts_with("transformer_blocks.0."));
        assert!(!first.is_empty() && !rest.is_empty(), "{base}: two parts");
        let fuser = PartFuser::open(&specs).unwrap();
        std::thread::scope(|scope| {
            let a = scope.spawn(|| fuser.part(&mut denoiser(&mut first)));
            let b = scope.spawn(|| fuser.part(&mut denoiser(&mut rest)));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
        let parts_report = fuser.finish().unwrap();
        first.extend(rest);
        assert_bit_equal(&first, &snapshot(&whole));
        assert_eq!(parts_report.fused_modules, report.fused_modules, "{base}");
        for (p, w) in parts_report.files.iter().zip(&report.files) {
            assert_eq!(
                (&p.path, &p.fused, p.untouched),
                (&w.path, &w.fused, w.untouched)
            );
            let mut unmatched = w.unmatched.clone();
            unmatched.sort();
            assert_eq!(p.unmatched, unmatched, "{base}");
        }
    }

    let mut part = tiny_target();
    let fuser = PartFuser::open(&[
        LoraSpec {
            path: qwen().join("lora/lightx2v.safetensors"),
            strength: 1.0,
        },
        LoraSpec {
            path: qwen().join("lora/nomatch.safetensors"),
            strength: 1.0,
        },
    ])
    .unwrap();
    fuser
        .part(&mut denoiser(&mut part))
        .expect("no error for one part");
    let err = fuser.finish().unwrap_err();
    assert!(matches!(err, LoraError::NoMatch { .. }), "{err}");
    assert!(err.to_string().contains("nomatch.safetensors"), "{err}");
}

/// A job's LoRA on top of a load-time LoRA fused for good (the Qwen engine's Lightning LoRA and a
/// job's own): removing the job's set gives back the load-time fused weights bit for bit.
#[test]
fn job_loras_on_a_fuse_for_good_restore_to_it() {
    let mut target = tiny_target();
    fuse_for_good(&[(&lora("lightx2v"), 1.0)], &mut denoiser(&mut target)).unwrap();
    let loaded = snapshot(&target);
    let mut job = JobLoras::default();
    let spec = LoraSpec {
        path: qwen().join("lora/comfy.safetensors"),
        strength: 0.7,
    };
    let switch = job.set(&[spec], &mut denoiser(&mut target)).unwrap();
    assert!(switch.applied);
    assert!(!target["img_in"].weight.equal(&loaded["img_in"].0));
    let switch = job.set(&[], &mut denoiser(&mut target)).unwrap();
    assert!(switch.restored);
    assert_bit_equal(&target, &loaded);
}

#[test]
fn the_applied_set_is_recognised() {
    let mut target = tiny_target();
    let path = qwen().join("lora/lightx2v.safetensors");
    let applied = apply(&[(&lora("lightx2v"), 0.7)], &mut denoiser(&mut target)).unwrap();
    let spec = |strength| LoraSpec {
        path: path.clone(),
        strength,
    };
    assert!(applied.is_same_set(&[spec(0.7)]));
    assert!(!applied.is_same_set(&[spec(1.0)]));
    assert!(!applied.is_same_set(&[]));
    assert!(!applied.is_same_set(&[spec(0.7), spec(0.7)]));
}

// ---- small files written here -------------------------------------------------------------

/// Writes fp32 tensors as a safetensors file.
fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        let values = Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).unwrap();
        let start = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": t.size(), "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vnfarm-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn small_target() -> BTreeMap<String, Linear> {
    // Drawn holding the default generator (`noise::seed`): the parity tests share one process, and
    // a pipeline test's seeded noise must not be interleaved with other draws.
    let _generator = noise::seed(7);
    [("blocks.0.to_out.0", 6, 4), ("blocks.0.to_out_0", 6, 4)]
        .into_iter()
        .map(|(n, o, i)| {
            (
                n.to_string(),
                Linear {
                    weight: Tensor::randn([o, i], (Kind::Float, Device::Cpu)),
                    weight_scale: None,
                    bias: None,
                },
            )
        })
        .collect()
}

#[test]
fn unsupported_keys_and_bad_shapes_are_errors_naming_key_and_file() {
    let loha = temp("loha.safetensors");
    let t = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    write_safetensors(&loha, &[("blocks.0.to_q.hada_w1_a", &t)]);
    let err = LoraFile::open(&loha).unwrap_err().to_string();
    assert!(
        err.contains("hada_w1_a") && err.contains("LoHa") && err.contains("loha.safetensors"),
        "{err}"
    );

    let lokr = temp("lokr.safetensors");
    write_safetensors(&lokr, &[("lora_unet_blocks_0_to_q.lokr_w1", &t)]);
    let err = LoraFile::open(&lokr).unwrap_err().to_string();
    assert!(err.contains("lokr_w1") && err.contains("LoKr"), "{err}");

    let half = temp("half.safetensors");
    write_safetensors(&half, &[("blocks.0.to_out.0.lora_down.weight", &t)]);
    let err = LoraFile::open(&half).unwrap_err().to_string();
    assert!(
        err.contains("blocks.0.to_out.0") && err.contains("up"),
        "{err}"
    );

    let shape = temp("shape.safetensors");
    let down = Tensor::ones([2, 5], (Kind::Float, Device::Cpu));
    let up = Tensor::ones([6, 2], (Kind::Float, Device::Cpu));
    write_safetensors(
        &shape,
        &[
            ("blocks.0.to_out.0.lora_down.weight", &down),
            ("blocks.0.to_out.0.lora_up.weight", &up),
        ],
    );
    let mut target = small_target();
    let err = apply(
        &[(&LoraFile::open(&shape).unwrap(), 1.0)],
        &mut denoiser(&mut target),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LoraError::Shape { .. }), "{msg}");
    assert!(
        msg.contains("blocks.0.to_out.0.lora_down.weight") && msg.contains("shape.safetensors"),
        "{msg}"
    );
}

#[test]
fn kohya_names_that_flatten_to_two_modules_are_ambiguous_and_peft_default_keys_load() {
    let down = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    let up = Tensor::ones([6, 2], (Kind::Float, Device::Cpu));
    let kohya = temp("ambiguous.safetensors");
    write_safetensors(
        &kohya,
        &[
            ("lora_unet_blocks_0_to_out_0.lora_down.weight", &down),
            ("lora_unet_blocks_0_to_out_0.lora_up.weight", &up),
        ],
    );
    let mut target = small_target();
    let err = apply(
        &[(&LoraFile::open(&kohya).unwrap(), 1.0)],
        &mut denoiser(&mut target),
    )
    .unwrap_err();
    assert!(matches!(err, LoraError::Ambiguous { .. }), "{err}");

    // PEFT with `base_model.model.` and `.default.`, no alpha: scale = strength.
    let peft = temp("peft_default.safetensors");
    write_safetensors(
        &peft,
        &[
            (
                "base_model.model.blocks.0.to_out.0.lora_A.default.weight",
                &down,
            ),
            (
                "base_model.model.blocks.0.to_out.0.lora_B.default.weight",
                &up,
            ),
        ],
    );
    let base = target["blocks.0.to_out.0"].weight.copy();
    let applied = apply(
        &[(&LoraFile::open(&peft).unwrap(), 0.5)],
        &mut denoiser(&mut target),
    )
    .unwrap();
    let want = &base + up.matmul(&down) * 0.5;
    assert!(rel(&target["blocks.0.to_out.0"].weight, &want) <= TOL);
    assert_eq!(applied.report().files[0].untouched, 1);
}

/// A conv layer as a LoRA target.
struct ConvTarget(Conv2d);

impl LoraTarget for ConvTarget {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        vec![("conv_in".to_string(), LoraModule::from(&mut self.0))]
    }
}

#[test]
fn locon_patches_a_conv_and_restores() {
    let opts = (Kind::Float, Device::Cpu);
    // Drawn holding the default generator, as in `small_target`.
    let [w, b, down, up] = {
        let _generator = noise::seed(3);
        [&[5, 3, 3, 3][..], &[5], &[2, 3, 3, 3], &[5, 2, 1, 1]].map(|s| Tensor::randn(s, opts))
    };
    let weights = temp("conv.safetensors");
    write_safetensors(&weights, &[("conv_in.weight", &w), ("conv_in.bias", &b)]);
    let store = WeightStore::identity(Arc::new(SafetensorsFile::open(&weights).unwrap()));
    let cursor = Weights::new(Arc::new(store), Device::Cpu, Kind::Float);
    let mut conv = ConvTarget(Conv2d::new(&cursor.pp("conv_in"), 3, 5, 3, 1, 1).unwrap());

    let alpha = Tensor::from(1.0f32);
    let file = temp("locon.safetensors");
    write_safetensors(
        &file,
        &[
            ("lora_unet_conv_in.lora_down.weight", &down),
            ("lora_unet_conv_in.lora_up.weight", &up),
            ("lora_unet_conv_in.alpha", &alpha),
        ],
    );
    let applied = apply(
        &[(&LoraFile::open(&file).unwrap(), 0.8)],
        &mut denoiser(&mut conv),
    )
    .unwrap();
    let delta = up
        .flatten(1, -1)
        .matmul(&down.flatten(1, -1))
        .reshape([5, 3, 3, 3]);
    let want = &w + delta * (0.8 * 1.0 / 2.0);
    let e = rel(&conv.0.weight, &want);
    assert!(e <= TOL, "{e:e}");
    applied.restore(&mut denoiser(&mut conv)).unwrap();
    assert!(conv.0.weight.equal(&w));
}
