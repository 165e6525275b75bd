//! The model catalogue end to end (DESIGN §7b): LoRAs pushed into the bucket with the CLI's code
//! (`vnfarm_storage::Catalogue::push`) and used by SDXL generates on two workers with caches of
//! their own, on the real S3 server; a download cut mid-way (a proxy between one worker and S3
//! drops the connection) resumes; a corrupted object and a file the engine refuses fail clearly and
//! are not fetched or handed to the engine again; the byte budget evicts.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vnfarm_proto::catalogue::{CatalogueEntry, ContentHash, blob_key, entry_key};
use vnfarm_proto::http::{JobState, JobView};
use vnfarm_proto::manifest::ModelFileRole;
use vnfarm_proto::{JobId, Manifest, decode_json, topology::manifest_key};
use vnfarm_storage::Catalogue;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;
use crate::sdxl::{Reference, fixtures, ldm_checkpoint, sdxl_worker};

fn lora_file(name: &str) -> PathBuf {
    fixtures().join("lora").join(format!("{name}.safetensors"))
}

/// Runs `submission` to its end; the job's id and view.
async fn run(farm: &Farm, submission: &Value) -> anyhow::Result<(String, JobView)> {
    let id = farm.submit_new(submission).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    Ok((id.to_string(), job))
}

async fn manifest(farm: &Farm, id: &str) -> anyhow::Result<Manifest> {
    let id: JobId = id.parse()?;
    Ok(decode_json(&farm.storage.get(&manifest_key(id)).await?)?)
}

/// The hashes worker `id`'s heartbeat says its model cache holds.
async fn cached(farm: &Farm, id: &str) -> anyhow::Result<Vec<String>> {
    let workers = farm.get_json("/v1/workers").await?;
    let worker = workers["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["id"] == id))
        .ok_or_else(|| anyhow::anyhow!("no worker {id}: {workers}"))?;
    Ok(serde_json::from_value(
        worker["heartbeat"]["model_cache"].clone(),
    )?)
}

/// Waits until worker `id`'s heartbeat lists exactly `hashes`.
async fn wait_cached(farm: &Farm, id: &str, hashes: &[&ContentHash]) -> anyhow::Result<()> {
    let want: Vec<String> = hashes.iter().map(|h| h.to_string()).collect();
    wait_for(
        &format!("{id}'s heartbeat to list {want:?}"),
        Duration::from_secs(10),
        || async {
            let mut have = cached(farm, id).await.ok()?;
            have.sort();
            let mut want = want.clone();
            want.sort();
            (have == want).then_some(())
        },
    )
    .await
}

/// A TCP proxy to `upstream` that, while armed, cuts the first connection whose answer passes
/// `after` bytes, then forwards everything whole.
struct CuttingProxy {
    endpoint: String,
    armed: Arc<AtomicBool>,
}

impl CuttingProxy {
    async fn start(upstream: &str, after: usize) -> anyhow::Result<Self> {
        let target = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let armed = Arc::new(AtomicBool::new(true));
        let cut = armed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (target, cut) = (target.clone(), cut.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                    });
                    let mut sent = 0;
                    let mut buf = vec![0u8; 8192];
                    loop {
                        let n = match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if sent + n > after && cut.swap(false, Ordering::SeqCst) {
                            // Half of what was asked for, then the connection is gone.
                            let _ = client_write.write_all(&buf[..(after - sent).min(n)]).await;
                            break;
                        }
                        if client_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        sent += n;
                    }
                    up.abort();
                });
            }
        });
        Ok(Self { endpoint, armed })
    }

    fn has_cut(&self) -> bool {
        !self.armed.load(Ordering::SeqCst)
    }
}

/// A worker of SDXL on the CPU whose LoRAs come from the catalogue only (no `lora_dir`), its
/// cache budget `max_bytes`, its S3 requests sent to `endpoint` when given.
fn catalogue_worker(checkpoint: &Path, max_bytes: u64, endpoint: Option<&str>) -> WorkerOptions {
    let mut options = sdxl_worker(checkpoint, 1);
    options.extra_env.push((
        "VNFARM_MODEL_CACHE__MAX_BYTES".into(),
        max_bytes.to_string(),
    ));
    if let Some(endpoint) = endpoint {
        options
            .extra_env
            .push(("VNFARM_STORAGE__ENDPOINT".into(), endpoint.to_owned()));
    }
    options
}

fn sha(bytes: &[u8]) -> ContentHash {
    ContentHash::try_from(hex::encode(Sha256::digest(bytes))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_lora_reaches_two_workers_and_bad_files_fail_once() -> anyhow::Result<()> {
    let loras = Reference::loras();
    let mut farm = Farm::new("catalogue").await?;
    farm.start_scheduler().await?;
    let catalogue = Catalogue::new(farm.storage.clone());
    let kohya = catalogue
        .push(&lora_file("kohya"), ModelFileRole::Lora, None)
        .await?;
    assert_eq!(kohya.name, "kohya");
    let peft = catalogue
        .push(&lora_file("peft"), ModelFileRole::Lora, Some("peft_style"))
        .await?;
    let listed: Vec<String> = catalogue
        .list()
        .await?
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(listed, ["kohya", "peft_style"]);
    let checkpoint = ldm_checkpoint();

    // Worker A fetches the LoRA through a proxy that cuts its first large answer: the download
    // resumes where it broke, and the image is diffusers' with the LoRA fused.
    let proxy = CuttingProxy::start(&farm.s3_endpoint, 60_000).await?;
    farm.start_worker(
        "cat-a",
        catalogue_worker(&checkpoint, 1 << 30, Some(&proxy.endpoint)),
    )
    .await?;
    let submission = loras.submission("e2e_kohya");
    assert_eq!(
        submission["job"]["loras"],
        json!([{"name": "kohya", "weight": 0.8}])
    );
    let (id, job) = run(&farm, &submission).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    assert!(proxy.has_cut(), "the proxy cut a download");
    let mae = loras.mae("e2e_kohya", 0, &farm.outputs(&job).await?[0]);
    assert!(mae <= 1.0, "worker A: {mae:.3}/255 from diffusers");
    let made = manifest(&farm, &id).await?;
    assert_eq!(made.worker.as_str(), "cat-a");
    let lora = made
        .model_files
        .iter()
        .find(|f| f.role == Some(ModelFileRole::Lora))
        .expect("the LoRA in the manifest");
    assert_eq!(
        (lora.name.as_str(), lora.sha256.as_str()),
        ("kohya", kohya.sha256.as_str())
    );
    assert!(
        lora.path
            .as_deref()
            .is_some_and(|p| p.contains("model-cache-cat-a")),
        "{lora:?}"
    );
    let log = farm.full_log("cat-a.log");
    assert!(log.contains("retrying"), "the cut was retried:\n{log}");
    wait_cached(&farm, "cat-a", &[&kohya.sha256]).await?;

    // Worker B, with its own cache, a budget short of both LoRAs, straight to S3.
    farm.kill_worker("cat-a");
    let budget = kohya.size + peft.size - 1;
    farm.start_worker("cat-b", catalogue_worker(&checkpoint, budget, None))
        .await?;
    wait_for("cat-a to be gone", Duration::from_secs(30), || async {
        let workers = farm.get_json("/v1/workers").await.ok()?;
        workers["workers"]
            .as_array()?
            .iter()
            .all(|w| w["id"] != "cat-a" || w["alive"] == false)
            .then_some(())
    })
    .await?;
    // By hash this time: the same file, the same image.
    let mut by_hash = submission.clone();
    by_hash["job"]["loras"][0]["name"] = json!(format!("sha256:{}", kohya.sha256));
    let (id, job) = run(&farm, &by_hash).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    let mae = loras.mae("e2e_kohya", 0, &farm.outputs(&job).await?[0]);
    assert!(mae <= 1.0, "worker B: {mae:.3}/255 from diffusers");
    let made = manifest(&farm, &id).await?;
    assert_eq!(made.worker.as_str(), "cat-b");
    assert!(made.model_files.iter().any(|f| {
        f.sha256 == kohya.sha256.as_str()
            && f.path
                .as_deref()
                .is_some_and(|p| p.contains("model-cache-cat-b"))
    }));
    wait_cached(&farm, "cat-b", &[&kohya.sha256]).await?;

    // The budget holds one of the two: the other LoRA evicts the least recently used.
    let mut with_peft = submission.clone();
    with_peft["job"]["loras"] = json!([{"name": "peft_style", "weight": 0.5}]);
    let (_, job) = run(&farm, &with_peft).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    wait_cached(&farm, "cat-b", &[&peft.sha256]).await?;

    // A corrupted object: the entry's hash is not its bytes'. The job fails naming it, and again
    // without a second download.
    let mut spoilt = std::fs::read(lora_file("unsupported"))?;
    let last = spoilt.len() - 1;
    spoilt[last] ^= 0xff;
    let claimed = sha(b"what the entry says");
    let entry = CatalogueEntry {
        name: "broken".into(),
        sha256: claimed.clone(),
        role: ModelFileRole::Lora,
        size: spoilt.len() as u64,
        added: chrono::Utc::now(),
    };
    farm.storage
        .put(
            &blob_key(&claimed),
            Bytes::from(spoilt),
            "application/octet-stream",
        )
        .await?;
    farm.storage
        .put(
            &entry_key("broken"),
            Bytes::from(serde_json::to_vec(&entry)?),
            "application/json",
        )
        .await?;
    // A file the engine refuses (a LyCORIS LoHa): failed by the engine once, then before it.
    catalogue
        .push(&lora_file("unsupported"), ModelFileRole::Lora, None)
        .await?;
    for (name, first, then) in [
        ("broken", "hash to", "is bad"),
        ("unsupported", "hada_w1_a", "the engine refused it"),
    ] {
        let mut bad = submission.clone();
        bad["job"]["loras"] = json!([{"name": name}]);
        for (attempt, words) in [first, then].into_iter().enumerate() {
            let (_, job) = run(&farm, &bad).await?;
            assert_eq!(job.state, JobState::Failed, "{name} #{attempt}: {job:?}");
            let message = job.failure.as_ref().map_or("", |f| f.message.as_str());
            assert!(message.contains(words), "{name} #{attempt}: {job:?}");
        }
    }
    let log = farm.full_log("cat-b.log");
    let fetches = |sha: &str| {
        log.lines()
            .filter(|l| l.contains("fetching a model file") && l.contains(sha))
            .count()
    };
    assert_eq!(fetches(claimed.as_str()), 1, "{log}");
    // Neither bad file was kept: the cache still holds the good one alone.
    wait_cached(&farm, "cat-b", &[&peft.sha256]).await?;

    // The worker goes on, fetching the evicted LoRA again.
    let (_, job) = run(&farm, &submission).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    wait_cached(&farm, "cat-b", &[&kohya.sha256]).await?;
    Ok(())
}

/// A file larger than one part (`MULTIPART_PART`, 64 MiB) is pushed as a multipart upload read
/// from disk, and comes back whole: fetched into a file as it arrives, and resumed from a part
/// already on disk, with the bytes the catalogue names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_larger_than_a_part_is_pushed_in_parts_and_fetched_whole() -> anyhow::Result<()> {
    use std::io::Write as _;
    let farm = Farm::in_process("catalogue-parts").await?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("big.safetensors");
    let size = vnfarm_storage::MULTIPART_PART + (5 << 20) + 17;
    let mut hasher = Sha256::new();
    {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
        let mut header = 8u64.to_le_bytes().to_vec();
        header.extend_from_slice(b"{}      ");
        file.write_all(&header)?;
        hasher.update(&header);
        let mut written = header.len() as u64;
        let mut chunk = vec![0u8; 1 << 20];
        while written < size {
            let n = (size - written).min(chunk.len() as u64) as usize;
            for (i, b) in chunk[..n].iter_mut().enumerate() {
                *b = ((written as usize + i) % 251) as u8;
            }
            file.write_all(&chunk[..n])?;
            hasher.update(&chunk[..n]);
            written += n as u64;
        }
    }
    let expected =
        ContentHash::try_from(hex::encode(hasher.finalize())).map_err(anyhow::Error::msg)?;
    let entry = Catalogue::new(farm.storage.clone())
        .push(&path, ModelFileRole::Checkpoint, Some("big"))
        .await?;
    assert_eq!((entry.size, &entry.sha256), (size, &expected), "{entry:?}");
    assert_eq!(farm.storage.head(&blob_key(&expected)).await?, Some(size));

    let fetched = dir.path().join("fetched");
    // A part of it already there, as a cut download leaves it: the rest is read on from its end.
    std::io::copy(
        &mut std::io::Read::take(std::fs::File::open(&path)?, 3 << 20),
        &mut std::fs::File::create(&fetched)?,
    )?;
    let got = farm
        .storage
        .get_into_file(&blob_key(&expected), &fetched, size)
        .await?;
    assert_eq!(got, size);
    let (hash, len) = vnfarm_storage::hash_safetensors(&fetched)?;
    assert_eq!((hash, len), (expected, size));
    Ok(())
}
