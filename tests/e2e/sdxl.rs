//! The SDXL engine inside the worker, end to end: generate jobs through the scheduler on the tiny
//! random-weight SDXL checkpoint of the model crate's parity fixtures (single-file ldm format, the
//! studio's, written from the tiny diffusers folder at test time), with the images in S3 compared
//! to diffusers' images for the same seeds; and per-job LoRAs from the worker's LoRA folder
//! (`make_sdxl_lora_fixtures.py`), fused and restored between jobs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tch::{Device, Kind};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_proto::ModelFamily;
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;
use crate::engines::{engine_env, models, tiny_sdxl};

pub(crate) fn fixtures() -> PathBuf {
    models().join("sdxl")
}

/// The tiny SDXL as one ldm single file, written from its diffusers folder at test time.
pub(crate) fn ldm_checkpoint() -> PathBuf {
    crate::derived::sdxl_tiny_ldm(&models())
}

/// A worker serving the tiny SDXL from `checkpoint` (see [`tiny_sdxl`]).
pub(crate) fn sdxl_worker(checkpoint: &Path, max_batch: u32) -> WorkerOptions {
    let sizes = engine_env(
        "SDXL",
        [
            // The tiny model's component sizes and 1000-token tokenizers.
            (
                "CONFIG_DIR",
                fixtures().join("sdxl_tiny").display().to_string(),
            ),
            ("MAX_BATCH", max_batch.to_string()),
        ],
    );
    WorkerOptions::default()
        .with_env(tiny_sdxl(checkpoint))
        .with_env(sizes)
}

/// diffusers' reference images and the parameters that made them (see
/// `worker/models/fixtures/sdxl/make_sdxl_fixtures.py`, `WORKER_CASES`).
pub(crate) struct Reference {
    file: SafetensorsFile,
    meta: Value,
}

impl Reference {
    pub(crate) fn open() -> Self {
        Self::open_file("reference/pipeline.safetensors")
    }

    /// diffusers' images with LoRAs fused (`make_sdxl_lora_fixtures.py`, `CASES`).
    pub(crate) fn loras() -> Self {
        Self::open_file("reference/lora.safetensors")
    }

    fn open_file(name: &str) -> Self {
        let file = SafetensorsFile::open(fixtures().join(name)).expect("pipeline reference");
        let meta = serde_json::from_str(&file.metadata()["fixture"]).expect("fixture metadata");
        Self { file, meta }
    }

    /// The submission of case `name`: `[name, sampler, prediction, seed, steps, count, h, w, cfg]`,
    /// or in the LoRA reference `[name, [[lora, weight]…], sampler, seed, …]`.
    pub(crate) fn submission(&self, name: &str) -> Value {
        let with_loras = self.meta.get("worker_cases").is_none();
        let cases = if with_loras {
            &self.meta["cases"]
        } else {
            &self.meta["worker_cases"]
        };
        let case = cases
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c[0] == name)
            .unwrap_or_else(|| panic!("case {name}"));
        if !with_loras {
            return self.generate(case);
        }
        // The LoRA cases carry their set where the base cases carry the sampler, then the
        // sampler where they carry the prediction type (always epsilon here).
        let mut fields = case.as_array().unwrap().clone();
        let set = fields.remove(1);
        fields.insert(2, json!("epsilon"));
        let mut submission = self.generate(&Value::Array(fields));
        submission["job"]["loras"] = set
            .as_array()
            .unwrap()
            .iter()
            .map(|l| json!({"name": l[0], "weight": l[1]}))
            .collect();
        submission
    }

    fn generate(&self, case: &Value) -> Value {
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
    pub(crate) fn mae(&self, name: &str, index: i64, png: &[u8]) -> f64 {
        let want = self
            .file
            .load(&format!("{name}.image"), Device::Cpu, Kind::Float)
            .expect("reference image")
            .get(index);
        vnfarm_tests::png_mae(png, &want)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_jobs_on_the_sdxl_engine_match_diffusers() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let reference = Reference::open();
    let mut farm = Farm::in_process("sdxl").await?;
    farm.start_scheduler().await?;
    // One image per UNet forward: a job of two images runs as two batches and image n must still
    // get seed + n.
    let checkpoint = ldm_checkpoint();
    farm.start_worker("sdxl-1", sdxl_worker(&checkpoint, 1))
        .await?;
    println!("worker ready {:?} after the start", started.elapsed());
    let workers = farm.workers().await?;
    assert_eq!(
        workers[0].heartbeat.as_ref().map(|h| h.models.clone()),
        Some(vec![ModelFamily::Sdxl]),
        "a tch worker advertises only the models it loaded: {workers:?}"
    );

    // Euler ancestral draws fresh noise every step, from each image's own generator.
    let mut jobs = Vec::new();
    for case in ["w_euler_a", "w_dpmpp"] {
        jobs.push((case, farm.submit_new(&reference.submission(case)).await?));
    }
    for (case, id) in &jobs {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(
            job.state,
            JobState::Completed,
            "{job:?}\n{}",
            farm.worker_logs()
        );
        println!("{case}: finished {:?} after the start", started.elapsed());
        let pngs = farm.outputs(&job).await?;
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
    let id = id.to_string();
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
    let mut farm = Farm::in_process("sdxl-cancel").await?;
    farm.start_scheduler().await?;
    let checkpoint = ldm_checkpoint();
    farm.start_worker("sdxl-c", sdxl_worker(&checkpoint, 4))
        .await?;
    let mut long = reference.submission("w_dpmpp");
    long["job"]["steps"] = json!(150);
    let id = farm.submit_new(&long).await?;
    farm.wait_step(id, 1, FINISH).await?;
    farm.cancel(id).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(job.state, JobState::Cancelled, "{job:?}");
    let step = job.progress.as_ref().map_or(0, |p| p.step);
    assert!(step < 150, "stopped at step {step} of 150");
    assert!(
        farm.storage
            .list(&format!("results/{id}/"))
            .await?
            .is_empty(),
        "a cancelled job leaves nothing in storage"
    );
    // The engine is free again.
    let next = farm.run(&reference.submission("w_dpmpp"), FINISH).await?;
    assert_eq!(next.state, JobState::Completed, "{next:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_broken_checkpoint_exits_naming_the_file() -> anyhow::Result<()> {
    let mut farm = Farm::new("sdxl-broken").await?;
    farm.start_scheduler().await?;
    let dir = tempfile::tempdir()?;
    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(ldm_checkpoint())?;
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
    let workers = farm.workers().await?;
    assert!(workers.is_empty(), "it never registered: {workers:?}");
    Ok(())
}

/// The worker's PNG `parameters` text of a stored image.
fn parameters(png: &[u8]) -> String {
    let reader = png::Decoder::new(std::io::Cursor::new(png))
        .read_info()
        .expect("a PNG");
    reader
        .info()
        .utf8_text
        .iter()
        .find(|t| t.keyword == "parameters")
        .expect("a parameters chunk")
        .get_text()
        .expect("UTF-8 parameters")
}

/// A generate with a LoRA matches diffusers with it fused; the next job without one matches the
/// base again (the weights were restored); a LoRA that exists nowhere is refused at submission
/// naming the ones that do; a file the loader cannot use fails the job with an error naming it,
/// and the worker goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_jobs_with_loras_match_diffusers_and_leave_the_base_as_it_was()
-> anyhow::Result<()> {
    let base = Reference::open();
    let loras = Reference::loras();
    let mut farm = Farm::in_process("sdxl-lora").await?;
    farm.start_scheduler().await?;
    let checkpoint = ldm_checkpoint();
    let mut worker = sdxl_worker(&checkpoint, 4);
    worker.extra_env.push((
        "VNFARM_ENGINE__SDXL__LORA_DIR".into(),
        fixtures().join("lora").display().to_string(),
    ));
    farm.start_worker("sdxl-l", worker).await?;

    // One job at a time, so that each runs with the weights the previous one left.
    let lora_job = loras.submission("e2e_kohya");
    assert_eq!(
        lora_job["job"]["loras"],
        json!([{"name": "kohya", "weight": 0.8}])
    );
    for (name, reference, submission) in [
        ("with the kohya LoRA", &loras, lora_job.clone()),
        ("without a LoRA", &base, base.submission("w_dpmpp")),
        ("with the LoRA again", &loras, lora_job),
    ] {
        let case = if submission["job"].get("loras").is_some() {
            "e2e_kohya"
        } else {
            "w_dpmpp"
        };
        let job = farm.run(&submission, FINISH).await?;
        assert_eq!(
            job.state,
            JobState::Completed,
            "{job:?}\n{}",
            farm.worker_logs()
        );
        let pngs = farm.outputs(&job).await?;
        let mae = reference.mae(case, 0, &pngs[0]);
        println!("{name}: mean abs difference {mae:.4}/255 from diffusers");
        assert!(mae <= 1.0, "{name}: {mae:.3}/255 from diffusers");
        if case == "e2e_kohya" {
            // A1111's infotext: the LoRA and its weight in the prompt, its hash in `Lora hashes`.
            let text = parameters(&pngs[0]);
            assert!(text.contains("horse <lora:kohya:0.8>\n"), "{text}");
            assert!(text.contains("Lora hashes: \"kohya: "), "{text}");
            let manifest: vnfarm_proto::Manifest = vnfarm_proto::decode_json(
                &farm
                    .storage
                    .get(&vnfarm_proto::topology::manifest_key(job.id))
                    .await?,
            )?;
            let lora = manifest
                .model_files
                .iter()
                .find(|f| f.role == Some(vnfarm_proto::manifest::ModelFileRole::Lora))
                .expect("the LoRA in the manifest");
            assert_eq!((lora.name.as_str(), lora.strength), ("kohya", Some(0.8)));
            let hash = lora
                .data_sha256
                .as_deref()
                .expect("a safetensors data hash");
            assert!(text.contains(&format!("kohya: {}", &hash[..12])), "{text}");
        }
    }

    // A name in neither the folder (which the worker's heartbeat lists) nor the catalogue is
    // refused at submission, with the names that exist.
    let mut nope = base.submission("w_dpmpp");
    nope["job"]["loras"] = json!([{"name": "nope"}]);
    let (status, reply) = farm.submit(&nope).await?;
    let error = reply.expect_err("a LoRA that exists nowhere").error;
    assert_eq!(
        (status.as_u16(), error.field.as_str()),
        (422, "job.loras[0].name"),
        "{error:?}"
    );
    assert!(
        error.message.contains("LoRA `nope`") && error.message.contains("kohya.safetensors"),
        "{error:?}"
    );
    // A file the loader cannot use fails its job on the worker.
    let mut unsupported = base.submission("w_dpmpp");
    unsupported["job"]["loras"] = json!([{"name": "unsupported"}]);
    let job = farm.run(&unsupported, FINISH).await?;
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    let message = job.failure.as_ref().map_or("", |f| f.message.as_str());
    assert!(message.contains("hada_w1_a"), "{job:?}");
    // The worker still serves, from the base weights.
    let job = farm.run(&base.submission("w_dpmpp"), FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    let mae = base.mae("w_dpmpp", 0, &farm.outputs(&job).await?[0]);
    assert!(mae <= 1.0, "after the failures: {mae:.3}/255");
    Ok(())
}
