//! The SDXL engine inside the worker, end to end: generate jobs through the scheduler on the tiny
//! random-weight SDXL checkpoint of the model crate's parity fixtures (single-file ldm format, the
//! studio's), with the images in S3 compared to diffusers' images for the same seeds.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tch::{Device, Kind};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/models/fixtures/sdxl")
}

/// A worker serving SDXL from `checkpoint` on the CPU in fp32 (the precision of the references).
fn sdxl_worker(checkpoint: &Path, max_batch: u32) -> WorkerOptions {
    let env = [
        ("CHECKPOINT", checkpoint.display().to_string()),
        // The tiny model's component sizes and 1000-token tokenizers.
        (
            "CONFIG_DIR",
            fixtures().join("sdxl_tiny").display().to_string(),
        ),
        ("DEVICE", "cpu".into()),
        ("DTYPE", "fp32".into()),
        ("VAE_DTYPE", "fp32".into()),
        ("WARM_UP", "[[256, 256]]".into()),
        // diffusers made the references without VAE tiling (the tiny VAE would tile above 128 px).
        ("VAE_TILING", "never".into()),
        ("MAX_BATCH", max_batch.to_string()),
    ];
    WorkerOptions {
        extra_env: env
            .into_iter()
            .map(|(k, v)| (format!("VNFARM_ENGINE__SDXL__{k}"), v))
            .collect(),
        ..WorkerOptions::default()
    }
}

/// diffusers' reference images and the parameters that made them (see
/// `worker/models/fixtures/sdxl/make_sdxl_fixtures.py`, `WORKER_CASES`).
struct Reference {
    file: SafetensorsFile,
    meta: Value,
}

impl Reference {
    fn open() -> Self {
        let file = SafetensorsFile::open(fixtures().join("reference/pipeline.safetensors"))
            .expect("pipeline reference");
        let meta = serde_json::from_str(&file.metadata()["fixture"]).expect("fixture metadata");
        Self { file, meta }
    }

    /// The submission of case `name`: `[name, sampler, prediction, seed, steps, count, h, w, cfg]`.
    fn submission(&self, name: &str) -> Value {
        let case = self.meta["worker_cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c[0] == name)
            .unwrap_or_else(|| panic!("case {name}"));
        let sampler = match case[1].as_str().unwrap() {
            "euler" => "euler",
            "euler_a" => "euler_ancestral",
            _ => "dpmpp_two_m_karras",
        };
        json!({"schema_version": 1, "job": {
            "kind": "generate",
            "prompt": self.meta["prompt"],
            "negative_prompt": self.meta["negative"],
            "seed": case[3], "steps": case[4], "count": case[5],
            "height": case[6], "width": case[7], "cfg": case[8],
            "sampler": sampler,
        }})
    }

    /// Mean absolute difference, in 1/255 units, of `png` and reference image `index` of `name`.
    fn mae(&self, name: &str, index: i64, png: &[u8]) -> f64 {
        let img = image::load_from_memory(png).expect("PNG").to_rgb8();
        let want = self
            .file
            .load(&format!("{name}.image"), Device::Cpu, Kind::Float)
            .expect("reference image")
            .get(index);
        let (h, w) = (img.height() as i64, img.width() as i64);
        assert_eq!(want.size(), [h, w, 3], "image size");
        let got = tch::Tensor::from_slice(img.as_raw())
            .to_kind(Kind::Float)
            .view([h, w, 3]);
        (got - want * 255.0)
            .abs()
            .mean(Kind::Double)
            .double_value(&[])
    }
}

async fn output_pngs(farm: &Farm, job: &Value) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut pngs = Vec::new();
    for key in job["outputs"].as_array().unwrap() {
        pngs.push(farm.storage.get(key.as_str().unwrap()).await?.to_vec());
    }
    Ok(pngs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_jobs_on_the_sdxl_engine_match_diffusers() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let reference = Reference::open();
    let mut farm = Farm::new("sdxl").await?;
    farm.start_scheduler().await?;
    // One image per UNet forward: a job of two images runs as two batches and image n must still
    // get seed + n.
    let checkpoint = fixtures().join("sdxl_tiny_ldm.safetensors");
    farm.start_worker("sdxl-1", sdxl_worker(&checkpoint, 1))
        .await?;
    println!("worker ready {:?} after the start", started.elapsed());
    let workers = farm.get_json("/v1/workers").await?;
    assert_eq!(
        workers["workers"][0]["heartbeat"]["models"],
        json!(["sdxl"]),
        "a tch worker advertises only the models it loaded: {workers}"
    );

    // Euler ancestral draws fresh noise every step, from each image's own generator.
    let mut jobs = Vec::new();
    for case in ["w_euler_a", "w_dpmpp"] {
        let (status, body) = farm.submit(&reference.submission(case)).await?;
        assert_eq!(status, 201, "{body}");
        jobs.push((case, body["job_id"].as_str().unwrap().to_owned()));
    }
    for (case, id) in &jobs {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job["state"], "completed", "{job}\n{}", farm.worker_logs());
        println!("{case}: finished {:?} after the start", started.elapsed());
        let pngs = output_pngs(&farm, &job).await?;
        let count = reference.submission(case)["job"]["count"].as_u64().unwrap();
        assert_eq!(pngs.len() as u64, count, "{case}: one PNG per image");
        for (n, png) in pngs.iter().enumerate() {
            let mae = reference.mae(case, n as i64, png);
            println!("{case} image {n}: mean abs difference {mae:.4}/255 from diffusers");
            assert!(
                mae <= 1.0,
                "{case} image {n}: mean abs difference {mae:.3}/255 from diffusers"
            );
        }
    }

    // Progress after every denoising step, counted over the job's batches.
    let (case, id) = &jobs[0];
    let steps = reference.submission(case)["job"]["steps"].as_u64().unwrap();
    let events = farm
        .collect_events(FINISH, |evs| {
            evs.iter()
                .any(|e| e["job_id"] == id.as_str() && e["event"] == "completed")
        })
        .await?;
    let progress: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e["job_id"] == id.as_str() && e["event"] == "progress")
        .map(|e| (e["step"].as_u64().unwrap(), e["total"].as_u64().unwrap()))
        .collect();
    let expected: Vec<(u64, u64)> = (1..=2 * steps).map(|s| (s, 2 * steps)).collect();
    assert_eq!(progress, expected, "progress events of {case}");
    Ok(())
}

/// A cancel reaches the SDXL engine between denoising steps: the job ends `cancelled` long before its
/// last step, with nothing in storage, and the worker takes the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_generate_stops_it_between_steps() -> anyhow::Result<()> {
    let reference = Reference::open();
    let mut farm = Farm::new("sdxl-cancel").await?;
    farm.start_scheduler().await?;
    let checkpoint = fixtures().join("sdxl_tiny_ldm.safetensors");
    farm.start_worker("sdxl-c", sdxl_worker(&checkpoint, 4))
        .await?;
    let mut long = reference.submission("w_dpmpp");
    long["job"]["steps"] = json!(150);
    let (status, body) = farm.submit(&long).await?;
    assert_eq!(status, 201, "{body}");
    let id = body["job_id"].as_str().unwrap().to_owned();
    farm.wait_step(&id, 1, FINISH).await?;
    farm.cancel(&id).await?;
    let job = farm.wait_finished(&id, FINISH).await?;
    assert_eq!(job["state"], "cancelled", "{job}");
    let step = job["progress"]["step"].as_u64().unwrap_or(0);
    assert!(step < 150, "stopped at step {step} of 150");
    assert!(
        farm.storage
            .list(&format!("results/{id}/"))
            .await?
            .is_empty(),
        "a cancelled job leaves nothing in storage"
    );
    // The engine is free again.
    let (_, body) = farm.submit(&reference.submission("w_dpmpp")).await?;
    let next = farm
        .wait_finished(body["job_id"].as_str().unwrap(), FINISH)
        .await?;
    assert_eq!(next["state"], "completed", "{next}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_broken_checkpoint_exits_naming_the_file() -> anyhow::Result<()> {
    let mut farm = Farm::new("sdxl-broken").await?;
    farm.start_scheduler().await?;
    let dir = tempfile::tempdir()?;
    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(fixtures().join("sdxl_tiny_ldm.safetensors"))?;
    std::fs::write(&truncated, &bytes[..bytes.len() / 2])?;
    farm.launch_worker("broken", sdxl_worker(&truncated, 4))?;
    let status = wait_for("the worker to exit", Duration::from_secs(60), || {
        std::future::ready(farm.worker_mut("broken").try_wait().ok().flatten())
    })
    .await?;
    let log = farm.log("broken.log");
    assert!(!status.success(), "exit status {status}\n{log}");
    assert!(
        log.contains("truncated.safetensors") && log.contains("truncated:"),
        "the error names the file and the problem:\n{log}"
    );
    let workers = farm.get_json("/v1/workers").await?;
    assert_eq!(workers["workers"], json!([]), "it never registered");
    Ok(())
}
