//! The shipped configuration files load with the binaries' own loaders, and bad ones are rejected.

use std::path::Path;

fn deploy(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(name)
}

#[test]
fn shipped_configs_are_valid() {
    let scheduler = vnfarm_scheduler::Config::load(Some(&deploy("scheduler.toml")), Vec::new())
        .expect("deploy/scheduler.toml");
    assert_eq!(scheduler.amqp.delivery_limit, 3);
    let worker = vnfarm_worker::Config::load(Some(&deploy("worker.toml")), Vec::new())
        .expect("deploy/worker.toml");
    assert_eq!(worker.worker_id, "box-1");
    assert_eq!(worker.engine.kind(), vnfarm_worker::engine::EngineKind::Tch);
    assert_eq!(
        worker.models(),
        [
            vnfarm_proto::ModelFamily::Sdxl,
            vnfarm_proto::ModelFamily::QwenEdit,
            vnfarm_proto::ModelFamily::Esrgan
        ]
    );
}

#[test]
fn engine_settings_are_checked_before_anything_loads() {
    let load = |pairs: &[(&str, &str)]| {
        let env = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        vnfarm_worker::Config::load(Some(&deploy("worker.toml")), env.collect::<Vec<_>>())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let err = load(&[("VNFARM_ENGINE__SDXL__DEVICE", "gpu0")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.device: "), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__VAE_DTYPE", "fp16")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.vae_dtype: "), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__WARM_UP", "[[1000, 7]]")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.warm_up: "), "{err}");
    // A tch worker cannot claim a family it has no model for.
    let err = vnfarm_worker::Config::load(
        None,
        [
            (
                "VNFARM_ENGINE__SDXL__CHECKPOINT",
                "/models/sdxl.safetensors",
            ),
            ("VNFARM_ENGINE__MODELS", "[\"sdxl\", \"esrgan\"]"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("engine.models: `esrgan`"), "{err}");
    let err = load(&[("VNFARM_ENGINE__ESRGAN__SETTINGS__TILE_OVERLAP", "300")]).unwrap_err();
    assert!(err.starts_with("engine.esrgan.settings"), "{err}");
    let err = load(&[("VNFARM_ENGINE__ESRGAN__BLEND", "smooth")]).unwrap_err();
    assert!(err.contains("blend"), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__SETTINGS__ATTENTION", "flash")]).unwrap_err();
    assert!(err.contains("attention"), "{err}");
    load(&[("VNFARM_ENGINE__SDXL__SETTINGS__ATTENTION", "matmul")]).expect("matmul attention");
    load(&[("VNFARM_ENGINE__SDXL__SETTINGS", "cuda")]).expect("a preset by name");
    let err = load(&[("VNFARM_ENGINE__SDXL__SETTINGS", "fastest")]).unwrap_err();
    assert!(err.contains("fastest"), "{err}");
    let err = load(&[
        (
            "VNFARM_ENGINE__SETTINGS_FILE",
            "/var/lib/vnfarm/settings.json",
        ),
        ("VNFARM_ENGINE__SDXL__SETTINGS", "cuda"),
    ])
    .unwrap_err();
    assert!(
        err.starts_with("engine.sdxl.settings: engine.settings_file decides"),
        "{err}"
    );
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__SETTINGS__FP8", "fp4")]).unwrap_err();
    assert!(err.contains("fp8"), "{err}");
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__MODEL_DIR", "/models/qwen")]).unwrap_err();
    assert!(
        err.starts_with("engine.qwen_edit: give `model_dir`"),
        "{err}"
    );
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__WARM_UP", "[[1000, 1000]]")]).unwrap_err();
    assert!(err.starts_with("engine.qwen_edit.warm_up: "), "{err}");
}

#[test]
fn environment_overrides_and_errors_name_the_field() {
    let env = vec![("VNFARM_WORKER_ID".to_string(), "Box One".to_string())];
    let err = vnfarm_worker::Config::load(Some(&deploy("worker.toml")), env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("worker_id: "), "{err}");
    let env = vec![("VNFARM_API_TOKEN".to_string(), "short".to_string())];
    let err = vnfarm_scheduler::Config::load(Some(&deploy("scheduler.toml")), env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("api_token: "), "{err}");
}
