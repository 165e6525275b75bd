//! Golden tests of `FlowMatchEulerDiscrete` against diffusers 0.42.1, from
//! `fixtures/qwen/make_scheduler_reference.py` (`reference/flow_match.{json.gz,safetensors}`).
//!
//! Tolerances: μ within 1e-12 (f64 arithmetic in both); σ, timesteps and transformer timesteps
//! bit-identical to diffusers' f32 values (stated bound 1e-7; measured 0 over 115 schedules);
//! step results bit-identical in fp32 and bf16 (measured 0; the bf16 case depends on the operand
//! order of `dt * v`, see `FlowMatchEulerDiscrete::step`).

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::schedulers::{FlowMatchConfig, FlowMatchEulerDiscrete, TimeShiftType};

use crate::support;

fn reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/qwen/reference")
}

fn json() -> serde_json::Value {
    support::read_json_gz(&reference().join("flow_match.json.gz"))
}

fn values(v: &serde_json::Value) -> Vec<Option<f64>> {
    v.as_array()
        .expect("an array")
        .iter()
        // Every reference value is an f32 printed in f64; serde_json's float parsing is not always
        // correctly rounded (last bit), so round back to the f32 it came from.
        .map(|x| x.as_f64().map(|x| f64::from(x as f32)))
        .collect()
}

fn max_abs(a: &[f64], b: &[Option<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y.expect("finite reference")).abs())
        .fold(0.0, f64::max)
}

#[test]
fn presets_equal_the_configs_diffusers_writes() {
    let j = json();
    for (name, preset) in [
        ("qwen_image", FlowMatchConfig::qwen_image()),
        (
            "qwen_image_lightning",
            FlowMatchConfig::qwen_image_lightning(),
        ),
    ] {
        let parsed = FlowMatchConfig::from_json(j[name]["config_json"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(parsed, preset, "{name}");
    }
    let linear =
        FlowMatchConfig::from_json(j["linear_shift"]["config_json"].as_str().unwrap()).unwrap();
    assert_eq!(linear.time_shift_type, TimeShiftType::Linear);
}

#[test]
fn unsupported_options_are_rejected_by_name() {
    for field in [
        "use_karras_sigmas",
        "use_exponential_sigmas",
        "use_beta_sigmas",
        "stochastic_sampling",
    ] {
        let err = FlowMatchConfig::from_json(&format!("{{\"{field}\": true}}")).unwrap_err();
        assert!(err.contains(field), "{err}");
    }
    let err = FlowMatchConfig::from_json(r#"{"time_shift_type": "cosine"}"#).unwrap_err();
    assert!(err.contains("time_shift_type"), "{err}");
    // Absent fields take diffusers' constructor defaults.
    assert_eq!(
        FlowMatchConfig::from_json("{}").unwrap(),
        FlowMatchConfig::default()
    );
}

#[test]
fn lightning_four_steps_is_a_constant_shift_of_three() {
    let c = FlowMatchConfig::qwen_image_lightning();
    let s = FlowMatchEulerDiscrete::new(&c, 4, Some(c.calculate_shift(4096))).unwrap();
    let expected = [1.0f32, 0.9, 0.75, 0.5, 0.0];
    assert_eq!(
        s.sigmas,
        expected.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()
    );
    assert_eq!(s.timesteps, vec![1000.0, f64::from(900.0f32), 750.0, 500.0]);
}

#[test]
fn schedules_match_diffusers() {
    let j = json();
    let mut worst = (0.0f64, 0.0f64, 0.0f64);
    let mut checked = 0;
    for (name, preset) in j.as_object().unwrap() {
        let config = FlowMatchConfig::from_json(preset["config_json"].as_str().unwrap()).unwrap();
        for case in preset["cases"].as_array().unwrap() {
            let steps = case["steps"].as_u64().unwrap() as usize;
            let seq = case["image_seq_len"].as_i64().unwrap();
            let mu = config.calculate_shift(seq);
            let mu_ref = case["mu"].as_f64().unwrap();
            assert!(
                (mu - mu_ref).abs() <= 1e-12,
                "{name} seq {seq}: mu {mu} vs {mu_ref}"
            );
            let sigmas_ref = values(&case["sigmas"]);
            let result = FlowMatchEulerDiscrete::new(&config, steps, Some(mu));
            if sigmas_ref.iter().any(Option::is_none) {
                // diffusers computes NaN (one step stretched to a terminal σ); we refuse.
                let err = result.expect_err("a NaN schedule must be an error");
                assert!(err.contains("degenerate"), "{err}");
                continue;
            }
            let s = result.unwrap_or_else(|e| panic!("{name} {steps} steps: {e}"));
            let model_t: Vec<f64> = (0..s.num_steps()).map(|i| s.model_timestep(i)).collect();
            let e = (
                max_abs(&s.sigmas, &sigmas_ref),
                max_abs(&s.timesteps, &values(&case["timesteps"])),
                max_abs(&model_t, &values(&case["model_timesteps"])),
            );
            assert!(
                e.0 <= 1e-7 && e.1 <= 1e-4 && e.2 <= 1e-7 && e == (0.0, 0.0, 0.0),
                "{name} steps {steps} seq {seq}: errors {e:?}\n{:?}\n{sigmas_ref:?}",
                s.sigmas
            );
            worst = (worst.0.max(e.0), worst.1.max(e.1), worst.2.max(e.2));
            checked += 1;
        }
    }
    println!(
        "{checked} schedules; max |Δσ| {:e}, |Δt| {:e}, |Δt/1000| {:e}",
        worst.0, worst.1, worst.2
    );
    assert!(checked >= 45);
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    d / b.to_kind(Kind::Double).abs().max().double_value(&[])
}

#[test]
fn steps_match_diffusers_in_fp32_and_bf16() {
    let f = SafetensorsFile::open(reference().join("flow_match.safetensors")).unwrap();
    let load = |n: &str| f.load(n, Device::Cpu, Kind::Float).unwrap();
    let sample = load("sample");
    let outputs: Vec<Tensor> = (0..4).map(|i| load(&format!("model_output.{i}"))).collect();
    for (kind, tag, tol) in [(Kind::Float, "f32", 0.0), (Kind::BFloat16, "bf16", 0.0)] {
        for (config, final_name) in [
            (FlowMatchConfig::qwen_image_lightning(), None),
            (FlowMatchConfig::qwen_image(), Some("qwen_image_final")),
        ] {
            let s =
                FlowMatchEulerDiscrete::new(&config, 4, Some(config.calculate_shift(256))).unwrap();
            let mut latents = sample.to_kind(kind);
            for (i, output) in outputs.iter().enumerate() {
                latents = s.step(&output.to_kind(kind), i, &latents);
                assert_eq!(latents.kind(), kind);
                if final_name.is_none() {
                    let r = load(&format!("{tag}.after_step.{i}"));
                    let e = rel(&latents, &r);
                    println!("{tag} lightning step {i}: rel error {e:e}");
                    assert!(e <= tol, "{tag} step {i}: {e}");
                }
            }
            if let Some(n) = final_name {
                let e = rel(&latents, &load(&format!("{tag}.{n}")));
                println!("{tag} qwen_image 4 steps: rel error {e:e}");
                assert!(e <= tol, "{tag} {n}: {e}");
            }
        }
    }
}
