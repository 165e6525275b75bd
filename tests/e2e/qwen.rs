//! The Qwen-Image-Edit-2509 engine inside the worker, end to end: a pipeline (an SDXL base, then
//! Qwen edits of it) through the scheduler, RabbitMQ and S3 on one worker holding both tiny
//! random-weight models, with every image in storage compared to diffusers' images for the same
//! parameters (`worker/models/fixtures/qwen/make_e2e_reference.py`); plus edits of uploaded
//! images with two inputs, the encode cache in heartbeats, encodings shared between workers
//! through storage, and cancellation between steps.

use serde_json::{Value, json};
use tch::{Device, Kind};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_proto::ModelFamily;
use vnfarm_proto::http::{JobState, JobView, Worker};
use vnfarm_scheduler::scheduler::inline_image;
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;
use crate::engines::{engine_env, models, sdxl_folder, tiny_sdxl};

/// One worker with the tiny SDXL (diffusers folder) and the tiny Qwen edit model (ComfyUI-style
/// single files, written from the tiny diffusers folder at test time and sized by its configs), on
/// the CPU in fp32.
fn farm_worker(condition_area: u64, vae_area: u64, scheduler: &str) -> WorkerOptions {
    let mut qwen_edit = tiny_qwen(condition_area, vae_area);
    qwen_edit.extend([
        ("SCHEDULER", scheduler.to_owned()),
        // The references were made by diffusers 0.42.1 with transformers 5.24, which feeds the text
        // encoder sequential positions (see `qwen2_5_vl::rope::PositionMode`).
        ("POSITIONS", "sequential".into()),
    ]);
    WorkerOptions::default()
        .with_env(tiny_sdxl(&sdxl_folder()))
        .with_env(engine_env("QWEN_EDIT", qwen_edit))
}

/// The Qwen engine's settings (`engine.qwen_edit`, for [`engine_env`]) for the tiny model as the
/// studio's ComfyUI single files, on the CPU in fp32, warmed at 256², with the conditioning and VAE
/// image areas given.
pub(crate) fn tiny_qwen(condition_area: u64, vae_area: u64) -> Vec<(&'static str, String)> {
    let path = |p: std::path::PathBuf| p.display().to_string();
    vec![
        (
            "TRANSFORMER",
            path(crate::derived::qwen_transformer_fp8(&models())),
        ),
        (
            "TEXT_ENCODER",
            path(crate::derived::qwen_text_encoder_fp8_scaled(&models())),
        ),
        ("VAE", path(crate::derived::qwen_vae_wan(&models()))),
        ("CONFIG_DIR", path(models().join("qwen/qwen_tiny"))),
        ("DEVICE", "cpu".into()),
        ("DTYPE", "fp32".into()),
        ("VAE_DTYPE", "fp32".into()),
        ("CONDITION_IMAGE_AREA", condition_area.to_string()),
        ("VAE_IMAGE_AREA", vae_area.to_string()),
        ("WARM_UP", "[[256, 256]]".into()),
    ]
}

/// Mean absolute difference, in 1/255 units, of `png` and the float image `name` of `file`.
fn mae(file: &SafetensorsFile, name: &str, png: &[u8]) -> f64 {
    let want = file
        .load(name, Device::Cpu, Kind::Float)
        .expect("reference image");
    vnfarm_tests::png_mae(png, &want)
}

async fn png(farm: &Farm, job: &JobView) -> anyhow::Result<Vec<u8>> {
    let outputs = farm.outputs(job).await?;
    Ok(outputs.first().expect("an output").to_vec())
}

/// The keys of the encode cache the first worker's last heartbeat lists.
fn encode_cache(workers: &[Worker]) -> Vec<String> {
    workers
        .first()
        .and_then(|w| w.heartbeat.as_ref())
        .map(|h| h.encode_cache.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_runs_on_sdxl_then_qwen_edits_and_matches_diffusers() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let reference =
        SafetensorsFile::open(models().join("qwen/reference/e2e_pipeline.safetensors"))?;
    let meta: Value = serde_json::from_str(&reference.metadata()["fixture"])?;
    let areas = &meta["edit_pipeline"];
    let mut farm = Farm::new("qwen-pipeline").await?;
    farm.start_scheduler().await?;
    let options = farm_worker(
        areas["condition_image_area"].as_u64().unwrap(),
        areas["vae_image_area"].as_u64().unwrap(),
        "lightning",
    );
    farm.start_worker("studio-1", options.clone()).await?;
    println!("worker ready {:?} after the start", started.elapsed());
    let workers = farm.workers().await?;
    assert_eq!(
        workers[0].heartbeat.as_ref().map(|h| h.models.clone()),
        Some(vec![ModelFamily::Sdxl, ModelFamily::QwenEdit]),
        "one worker holds both models warm: {workers:?}"
    );

    let pipeline = farm.run(&meta["submission"], FINISH).await?;
    assert_eq!(
        pipeline.state,
        JobState::Completed,
        "{pipeline:?}\n{}",
        farm.worker_logs()
    );
    println!("pipeline finished {:?} after the start", started.elapsed());
    let children = pipeline.children.clone();
    assert_eq!(children.len(), 3, "{pipeline:?}");

    let base = farm.job(children[0]).await?;
    let base_mae = mae(&reference, "base.image", &png(&farm, &base).await?);
    println!("base: mean abs difference {base_mae:.4}/255 from diffusers");
    assert!(base_mae <= 1.0, "base: {base_mae:.3}/255 from diffusers");
    for (n, child) in children[1..].iter().enumerate() {
        let edit = farm.job(child).await?;
        assert_eq!(edit.state, JobState::Completed, "{edit:?}");
        let d = mae(
            &reference,
            &format!("edit{n}.image"),
            &png(&farm, &edit).await?,
        );
        println!("edit {n}: mean abs difference {d:.4}/255 from diffusers");
        assert!(d <= 1.0, "edit {n}: {d:.3}/255 from diffusers");
    }

    // Both edits share one input: it was encoded once and the worker says it holds it.
    let keys = encode_cache(&farm.workers().await?);
    assert_eq!(keys.len(), 1, "one cached input set: {keys:?}");
    assert!(keys[0].starts_with("qwen-edit:"), "{keys:?}");
    // The first edit of the input encoded it; the second found it in the cache.
    let mut encoded = Vec::new();
    for child in &children[1..] {
        let key = format!("results/{child}/manifest.json");
        let manifest: Value = serde_json::from_slice(&farm.storage.get(&key).await?)?;
        encoded.push(manifest["timings"].get("encode").is_some());
    }
    assert_eq!(
        encoded.iter().filter(|e| **e).count(),
        1,
        "exactly one edit paid the input encode: {encoded:?}"
    );

    // Shared encodings: the first worker published them; a second worker (the first is gone) runs
    // the first edit again from them, without encoding, and makes the same image.
    let published = farm.storage.list("encodings/qwen_edit/").await?;
    assert_eq!(published.len(), 1, "one input set published: {published:?}");
    farm.kill_worker("studio-1");
    farm.start_worker("studio-2", options).await?;
    let first_edit = &meta["submission"]["job"]["edits"][0];
    let mut again = json!({"schema_version": 1, "job": {"kind": "edit",
        "input": {"job_output": {"job": children[0], "index": 0}}}});
    for (k, v) in first_edit.as_object().unwrap() {
        again["job"][k] = v.clone();
    }
    // A pipeline's edits come out at its base's size; a lone edit names it.
    let base_spec = &meta["submission"]["job"]["base"];
    again["job"]["width"] = base_spec["width"].clone();
    again["job"]["height"] = base_spec["height"].clone();
    let rerun = farm.run(&again, FINISH).await?;
    assert_eq!(
        rerun.state,
        JobState::Completed,
        "{rerun:?}\n{}",
        farm.worker_logs()
    );
    let key = format!("results/{}/manifest.json", rerun.id);
    let manifest: Value = serde_json::from_slice(&farm.storage.get(&key).await?)?;
    assert_eq!(manifest["worker"], "studio-2", "{manifest}");
    let timings = &manifest["timings"];
    assert!(
        timings.get("fetch_encodings").is_some() && timings.get("encode").is_none(),
        "fetched, not encoded: {timings}"
    );
    // The same pixels (the PNGs' parameters name their own jobs).
    let first = farm.job(children[1]).await?;
    let pixels = |png: Vec<u8>| image::load_from_memory(&png).map(|i| i.to_rgb8().into_raw());
    assert!(
        pixels(png(&farm, &rerun).await?)? == pixels(png(&farm, &first).await?)?,
        "the same image from another worker's encodings"
    );
    Ok(())
}

/// An edit of two uploaded images (character + reference): it runs at the requested size, its
/// encodings are cached under both images' hashes, and a long edit is cancelled between steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_of_uploaded_images_take_two_inputs_and_cancel_between_steps() -> anyhow::Result<()> {
    let inputs = models().join("qwen/inputs");
    let a = std::fs::read(inputs.join("a_48x40.png"))?;
    let b = std::fs::read(inputs.join("b_32x56.png"))?;
    let mut farm = Farm::in_process("qwen-edit").await?;
    farm.start_scheduler().await?;
    farm.start_worker("studio-2", farm_worker(56 * 56, 64 * 64, "model"))
        .await?;
    let inline = |bytes: &[u8]| serde_json::to_value(inline_image(bytes)).expect("an ImageRef");
    let job = farm
        .run(
            &json!({"schema_version": 1, "job": {"kind": "edit",
                "inputs": [inline(&a), inline(&b)],
                "instruction": "put the hat from picture 2 on her",
                "width": 256, "height": 256, "steps": 2, "seed": 11}}),
            FINISH,
        )
        .await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    let img = image::load_from_memory(&png(&farm, &job).await?)?;
    assert_eq!((img.width(), img.height()), (256, 256));
    // The worker lists its encode cache in its next heartbeat (every 300 ms here).
    let keys = vnfarm_tests::wait_for(
        "a heartbeat listing the edit's encodings",
        std::time::Duration::from_secs(10),
        || async {
            let keys = encode_cache(&farm.workers().await.ok()?);
            (!keys.is_empty()).then_some(keys)
        },
    )
    .await?;
    assert_eq!(
        keys.first()
            .and_then(|k| k.strip_prefix("qwen-edit:"))
            .map(|k| k.split('+').count()),
        Some(2),
        "the cache key names both inputs: {keys:?}"
    );

    // A long edit stops between steps when cancelled, stores nothing, and frees the engine.
    let id = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "edit",
            "inputs": [inline(&a)], "instruction": "make her smile",
            "width": 256, "height": 256, "steps": 100, "seed": 3}}))
        .await?;
    farm.wait_step(id, 1, FINISH).await?;
    farm.cancel(id).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(job.state, JobState::Cancelled, "{job:?}");
    assert!(job.progress.as_ref().map_or(0, |p| p.step) < 100);
    assert!(
        farm.storage
            .list(&format!("results/{id}/"))
            .await?
            .is_empty(),
        "a cancelled edit leaves nothing in storage"
    );
    Ok(())
}
