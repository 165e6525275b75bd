//! Checkpoints from the model catalogue (DESIGN §7b): a generate naming a checkpoint that only
//! the catalogue holds goes to a worker that serves catalogue checkpoints (it advertises how many
//! it keeps loaded), which fetches the file into its model cache and runs on it; the manifest
//! names the file by the job's name and its hash. A name that is a LoRA in the catalogue is
//! refused at submission; a corrupted file fails the job clearly and again without a second
//! download; with no such worker left the job waits, says for what, and fails in time.
//!
//! With the test-pattern engine for the routing, and with the real SDXL engine on the tiny
//! checkpoint (pushed with `vnfarm models push --role checkpoint`): loaded from the cache as the
//! configured one is, it makes diffusers' image, and a file that is no SDXL checkpoint fails
//! once in the engine and after that before it.

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use vnfarm_proto::catalogue::{CatalogueEntry, ContentHash, blob_key, entry_key};
use vnfarm_proto::http::{JobState, JobView};
use vnfarm_proto::{FailureKind, Manifest, ModelFileRole, decode_json, topology::manifest_key};
use vnfarm_storage::Catalogue;
use vnfarm_tests::{Farm, S3_KEY, S3_SECRET, WorkerOptions, bin_dir, wait_for};

use crate::FINISH;
use crate::engines::engine_env;
use crate::sdxl::{Reference, fixtures, ldm_checkpoint, sdxl_worker};

fn generate(checkpoint: &str) -> Value {
    json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "1girl", "width": 256,
        "height": 256, "steps": 2, "checkpoint": checkpoint}})
}

/// A minimal safetensors file: an 8-byte header length, `{}` padded, and `data`.
fn safetensors(data: &[u8]) -> Vec<u8> {
    let mut file = 8u64.to_le_bytes().to_vec();
    file.extend_from_slice(b"{}      ");
    file.extend_from_slice(data);
    file
}

async fn manifest(farm: &Farm, job: &JobView) -> anyhow::Result<Manifest> {
    Ok(decode_json(
        &farm.storage.get(&manifest_key(job.id)).await?,
    )?)
}

/// The checkpoint files a job's manifest names, as `(name, sha256)`.
fn checkpoints_of(made: &Manifest) -> Vec<(String, String)> {
    made.model_files
        .iter()
        .filter(|f| f.role == Some(ModelFileRole::Checkpoint))
        .map(|f| (f.name.clone(), f.sha256.clone()))
        .collect()
}

/// Worker `id`'s latest heartbeat, as the fleet view shows it.
async fn heartbeat(farm: &Farm, id: &str) -> anyhow::Result<Value> {
    let workers = farm.get_json("/v1/workers").await?;
    workers["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["id"] == id))
        .map(|w| w["heartbeat"].clone())
        .ok_or_else(|| anyhow::anyhow!("no worker {id}: {workers}"))
}

/// Puts an entry `name` whose hash is not its blob's bytes' (a corrupted object).
async fn put_corrupted(farm: &Farm, name: &str) -> anyhow::Result<ContentHash> {
    use sha2::{Digest, Sha256};
    let bytes = safetensors(b"not what the entry says");
    let claimed = ContentHash::try_from(hex::encode(Sha256::digest(name.as_bytes())))
        .map_err(anyhow::Error::msg)?;
    let entry = CatalogueEntry {
        name: name.into(),
        sha256: claimed.clone(),
        role: ModelFileRole::Checkpoint,
        size: bytes.len() as u64,
        added: chrono::Utc::now(),
    };
    farm.storage
        .put(
            &blob_key(&claimed),
            Bytes::from(bytes),
            "application/octet-stream",
        )
        .await?;
    farm.storage
        .put(
            &entry_key(name),
            Bytes::from(serde_json::to_vec(&entry)?),
            "application/json",
        )
        .await?;
    Ok(claimed)
}

/// How many times worker `id`'s log says it began fetching `sha256`.
fn fetches(farm: &Farm, id: &str, sha256: &ContentHash) -> usize {
    farm.full_log(&format!("{id}.log"))
        .lines()
        .filter(|l| l.contains("fetching a model file") && l.contains(sha256.as_str()))
        .count()
}

fn failure(job: &JobView) -> (FailureKind, String) {
    let f = job.failure.clone().expect("a failure");
    (f.kind, f.message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_catalogue_checkpoint_goes_to_a_worker_that_fetches_it() -> anyhow::Result<()> {
    let mut farm = Farm::new("ckpt-route").await?;
    farm.scheduler_env = vec![("VNFARM_CHECKPOINT_WAIT_S".into(), "3".into())];
    farm.start_scheduler().await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("cat_ckpt.safetensors");
    std::fs::write(&file, safetensors(b"a checkpoint's weights"))?;
    let catalogue = Catalogue::new(farm.storage.clone());
    let pushed = catalogue
        .push(&file, ModelFileRole::Checkpoint, None)
        .await?;
    assert_eq!(pushed.name, "cat_ckpt");
    let lora = fixtures().join("lora/kohya.safetensors");
    catalogue
        .push(&lora, ModelFileRole::Lora, Some("cat_lora"))
        .await?;

    let claims = |checkpoints: &[&str], catalogue: u32| {
        WorkerOptions::default().with_env([
            (
                "VNFARM_ENGINE__TEST_PATTERN__CHECKPOINTS".to_owned(),
                serde_json::to_string(checkpoints).unwrap(),
            ),
            (
                "VNFARM_ENGINE__TEST_PATTERN__CATALOGUE_CHECKPOINTS".to_owned(),
                catalogue.to_string(),
            ),
        ])
    };
    farm.start_worker("own", claims(&["nova"], 0)).await?;
    farm.start_worker("fetches", claims(&[], 2)).await?;
    assert_eq!(
        heartbeat(&farm, "fetches").await?["catalogue_checkpoints"],
        2
    );
    assert!(
        heartbeat(&farm, "own")
            .await?
            .get("catalogue_checkpoints")
            .is_none()
    );

    // A name that is a LoRA in the catalogue is no checkpoint: refused, saying what it is (once
    // the scheduler has heard the fleet, it refuses what it can tell).
    let as_checkpoint = generate("cat_lora");
    let refusal = wait_for(
        "the refusal of a LoRA named as a checkpoint",
        Duration::from_secs(10),
        || async {
            let (status, reply) = farm.submit(&as_checkpoint).await.ok()?;
            (status == 422).then(|| reply.expect_err("refused").error)
        },
    )
    .await?;
    assert_eq!(refusal.field, "job.checkpoint", "{refusal:?}");
    assert!(
        refusal.message.contains("is a lora in the model catalogue"),
        "{refusal:?}"
    );

    // The catalogue's checkpoint runs on the worker that fetches them, from its model cache.
    let job = farm.run(&generate("cat_ckpt"), FINISH).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    let made = manifest(&farm, &job).await?;
    assert_eq!(made.worker.as_str(), "fetches");
    assert_eq!(
        checkpoints_of(&made),
        [("cat_ckpt".to_owned(), pushed.sha256.to_string())]
    );
    wait_for(
        "the fetching worker to list the file",
        Duration::from_secs(10),
        || async {
            let beat = heartbeat(&farm, "fetches").await.ok()?;
            (beat["model_cache"] == json!([pushed.sha256.as_str()])).then_some(())
        },
    )
    .await?;
    // Again: the same file, without another download; also named by its hash.
    let job = farm.run(&generate("cat_ckpt"), FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    let by_hash = format!("sha256:{}", pushed.sha256.as_str());
    let job = farm.run(&generate(&by_hash), FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    assert_eq!(
        checkpoints_of(&manifest(&farm, &job).await?),
        [(by_hash.clone(), pushed.sha256.to_string())]
    );
    assert_eq!(fetches(&farm, "fetches", &pushed.sha256), 1);
    // A checkpoint a worker advertises goes to that worker, not to one that fetches.
    let job = farm.run(&generate("nova"), FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    assert_eq!(manifest(&farm, &job).await?.worker.as_str(), "own");

    // A corrupted object fails clearly, and again without a second download.
    let claimed = put_corrupted(&farm, "spoilt").await?;
    for (attempt, words) in ["hash to", "is bad"].into_iter().enumerate() {
        let job = farm.run(&generate("spoilt"), FINISH).await?;
        assert_eq!(job.state, JobState::Failed, "#{attempt}: {job:?}");
        let (kind, message) = failure(&job);
        assert_eq!(kind, FailureKind::BadInput, "#{attempt}: {message}");
        assert!(
            message.contains("checkpoint `spoilt`") && message.contains(words),
            "#{attempt}: {message}"
        );
    }
    assert_eq!(fetches(&farm, "fetches", &claimed), 1);

    // Without a worker that fetches them, the job waits, saying for what, and fails in time
    // while another SDXL worker is up.
    farm.kill_worker("fetches");
    wait_for(
        "the fetching worker to be gone",
        Duration::from_secs(30),
        || async {
            let workers = farm.workers().await.ok()?;
            workers
                .iter()
                .any(|w| w.id.as_str() == "fetches" && !w.alive)
                .then_some(())
        },
    )
    .await?;
    let id = farm.submit_new(&generate("cat_ckpt")).await?;
    let waiting = wait_for(
        "the job to say what it waits for",
        Duration::from_secs(30),
        || async {
            let says = farm.job(id).await.ok()?.waiting_for?;
            says.contains("fetches the catalogue's checkpoints")
                .then_some(says)
        },
    )
    .await?;
    assert!(waiting.contains("cat_ckpt"), "{waiting}");
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(failure(&job).0, FailureKind::NoWorker, "{job:?}");
    Ok(())
}

/// `vnfarm models push` with the farm's bucket as its `[storage]`.
fn push(farm: &Farm, file: &std::path::Path, role: &str, name: &str) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("storage.toml");
    std::fs::write(
        &config,
        format!(
            "[storage]\nbackend = \"s3\"\nbucket = \"{}\"\nendpoint = \"{}\"\n\
             access_key_id = \"{S3_KEY}\"\nsecret_access_key = \"{S3_SECRET}\"\n",
            farm.bucket, farm.s3_endpoint
        ),
    )?;
    let out = Command::new(bin_dir().join("vnfarm"))
        .args(["models", "--storage"])
        .arg(&config)
        .arg("push")
        .arg(file)
        .args(["--role", role, "--name", name])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "vnfarm models push: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdxl_worker_loads_a_catalogue_checkpoint_and_condemns_a_bad_one() -> anyhow::Result<()>
{
    let reference = Reference::open();
    let mut farm = Farm::new("ckpt-sdxl").await?;
    farm.start_scheduler().await?;
    let checkpoint = ldm_checkpoint();
    // The worker's own checkpoint is the tiny SDXL under another name; the catalogue's is the
    // same file, so its images must be diffusers' too.
    assert_eq!(
        push(&farm, &checkpoint, "checkpoint", "cat_tiny")?,
        "cat_tiny"
    );
    // A safetensors file that is no SDXL checkpoint (a LoRA's tensors), pushed as one.
    let lora = fixtures().join("lora/kohya.safetensors");
    assert_eq!(push(&farm, &lora, "checkpoint", "not_sdxl")?, "not_sdxl");
    let entries = Catalogue::new(farm.storage.clone()).list().await?;
    let tiny = entries
        .iter()
        .find(|e| e.name == "cat_tiny")
        .unwrap()
        .sha256
        .clone();
    let bad = entries
        .iter()
        .find(|e| e.name == "not_sdxl")
        .unwrap()
        .sha256
        .clone();

    let options = sdxl_worker(&checkpoint, 1).with_env(engine_env(
        "SDXL",
        [
            ("NAME", "own_tiny".to_owned()),
            ("CATALOGUE_CHECKPOINTS", "1".to_owned()),
        ],
    ));
    farm.start_worker("sdxl-cat", options).await?;
    assert_eq!(
        heartbeat(&farm, "sdxl-cat").await?["catalogue_checkpoints"],
        1
    );

    let mut submission = reference.submission("w_euler_a");
    submission["job"]["checkpoint"] = json!("cat_tiny");
    submission["job"]["count"] = json!(1);
    let job = farm.run(&submission, FINISH).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    let mae = reference.mae("w_euler_a", 0, &farm.outputs(&job).await?[0]);
    assert!(
        mae <= 1.0,
        "the catalogue's checkpoint: {mae:.3}/255 from diffusers"
    );
    let made = manifest(&farm, &job).await?;
    assert_eq!(
        checkpoints_of(&made),
        [("cat_tiny".to_owned(), tiny.to_string())]
    );
    let log = farm.full_log("sdxl-cat.log");
    let cached = log
        .lines()
        .filter(|l| l.contains("SDXL loaded") && l.contains(tiny.as_str()))
        .count();
    assert_eq!(cached, 1, "loaded once, from the model cache:\n{log}");

    // Again: the loaded pipeline serves it, without a second load.
    let job = farm.run(&submission, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    let log = farm.full_log("sdxl-cat.log");
    let loads = log
        .lines()
        .filter(|l| l.contains("SDXL loaded") && l.contains(tiny.as_str()))
        .count();
    assert_eq!(loads, 1, "{log}");

    // A file that does not load fails in the engine, naming it, and is condemned: the next job
    // naming it fails before the engine, and it is not kept.
    let mut broken = submission.clone();
    broken["job"]["checkpoint"] = json!("not_sdxl");
    for (attempt, words) in ["is not a usable SDXL checkpoint", "the engine refused it"]
        .into_iter()
        .enumerate()
    {
        let job = farm.run(&broken, FINISH).await?;
        assert_eq!(job.state, JobState::Failed, "#{attempt}: {job:?}");
        let (kind, message) = failure(&job);
        assert_eq!(kind, FailureKind::BadInput, "#{attempt}: {message}");
        assert!(message.contains(words), "#{attempt}: {message}");
    }
    let log = farm.full_log("sdxl-cat.log");
    let attempts = log
        .lines()
        .filter(|l| l.contains("a catalogue checkpoint failed to load"))
        .count();
    assert_eq!(attempts, 1, "the bad file reached the engine once:\n{log}");
    wait_for(
        "the bad file to leave the cache",
        Duration::from_secs(10),
        || async {
            let beat = heartbeat(&farm, "sdxl-cat").await.ok()?;
            let listed = beat["model_cache"].as_array()?.clone();
            (!listed.iter().any(|h| h == bad.as_str())).then_some(())
        },
    )
    .await?;
    // The worker goes on with its own checkpoint.
    submission["job"]["checkpoint"] = json!("own_tiny");
    let job = farm.run(&submission, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    Ok(())
}
