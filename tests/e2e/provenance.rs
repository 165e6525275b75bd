//! Provenance (issue 10): a manifest names every file its images were made from, with the sha256
//! and size of the real bytes, and the PNG's A1111 parameters name the checkpoint by that hash. The
//! test-pattern engine loads no file; here it claims two the test writes (`model_files`).

use std::path::Path;

use serde_json::json;
use sha2::{Digest, Sha256};
use vnfarm_proto::http::JobState;
use vnfarm_proto::manifest::ModelFileRole;
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{Manifest, decode_json};
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_names_each_model_file_by_its_sha256_and_size() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Bigger than the hasher's 8 MiB read buffer, so the file is hashed in several reads.
    let checkpoint: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 251) as u8).collect();
    let vae = b"a vae of a few bytes".to_vec();
    let files = [
        (dir.path().join("claimed-xl.safetensors"), checkpoint),
        (dir.path().join("claimed-vae.safetensors"), vae),
    ];
    for (path, bytes) in &files {
        std::fs::write(path, bytes)?;
    }
    let cache = dir.path().join("hash-cache");
    let paths: Vec<String> = files.iter().map(|(p, _)| p.display().to_string()).collect();

    let mut farm = Farm::in_process("provenance").await?;
    farm.start_scheduler().await?;
    farm.start_worker(
        "holder",
        WorkerOptions {
            extra_env: vec![
                (
                    "VNFARM_ENGINE__TEST_PATTERN__MODEL_FILES".into(),
                    serde_json::to_string(&paths)?,
                ),
                ("VNFARM_HASH_CACHE_DIR".into(), cache.display().to_string()),
            ],
            ..Default::default()
        },
    )
    .await?;
    let job_id = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "generate",
            "prompt": "a lighthouse, at dusk", "width": 256, "height": 256, "steps": 2,
            "sampler": "dpmpp_two_m_karras", "seed": 11}}))
        .await?;
    let job = farm.wait_finished(job_id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");

    let manifest: Manifest = decode_json(&farm.storage.get(&manifest_key(job_id)).await?)?;
    assert_eq!(manifest.model_files.len(), files.len(), "{manifest:?}");
    for ((path, bytes), listed) in files.iter().zip(&manifest.model_files) {
        let name = path.file_name().unwrap().to_string_lossy();
        assert_eq!(listed.name, name);
        assert_eq!(listed.sha256, hex::encode(Sha256::digest(bytes)), "{name}");
        assert_eq!(listed.size, bytes.len() as u64, "{name}");
        let canonical = path.canonicalize()?;
        assert_eq!(listed.path.as_deref(), canonical.to_str());
        assert_eq!(listed.role, Some(ModelFileRole::Checkpoint));
    }

    // The image names the first checkpoint as A1111 does.
    let png = farm.storage.get(&output_key(job_id, 0)).await?;
    let reader = png::Decoder::new(std::io::Cursor::new(&png[..])).read_info()?;
    let text = reader
        .info()
        .utf8_text
        .iter()
        .find(|t| t.keyword == "parameters")
        .expect("a parameters chunk")
        .get_text()?;
    let short = &manifest.model_files[0].sha256[..10];
    assert!(
        text.starts_with(
            "a lighthouse, at dusk\nSteps: 2, Sampler: DPM++ 2M, Schedule type: Karras"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!("Model hash: {short}, Model: claimed-xl, ")),
        "{text}"
    );

    // The hashes persist for the next start of the worker.
    let persisted = std::fs::read_to_string(cache.join("model-hashes.json"))?;
    for (path, _) in &files {
        let canonical = path.canonicalize()?;
        assert!(
            persisted.contains(&*canonical.to_string_lossy()),
            "{persisted}"
        );
    }
    assert!(Path::new(&cache).is_dir());
    Ok(())
}
