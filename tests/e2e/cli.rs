//! The command line (`vnfarm`, the binary) against a real farm: a completed job past the
//! registry's retention, which the API answers from its manifest, reads as what it is: `watch`
//! says it completed and prints its outputs, `fetch` downloads them.

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::json;
use vnfarm_proto::http::{JobAnswer, JobState};
use vnfarm_tests::{Farm, WorkerOptions, bin_dir, wait_for};

use crate::FINISH;

/// Runs `vnfarm <args>` against the farm's scheduler.
fn vnfarm(farm: &Farm, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(bin_dir().join("vnfarm"))
        .env_clear()
        .arg("--url")
        .arg(farm.url(""))
        .args(args)
        .output()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_reads_an_archived_job() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("cli-archived").await?;
    farm.scheduler_env
        .push(("VNFARM_RETAIN_JOBS".into(), "1".into()));
    farm.start_scheduler().await?;
    farm.start_worker("w1", WorkerOptions::default()).await?;
    let generate = |prompt: &str| {
        json!({"schema_version": 1, "job": {"kind": "generate", "prompt": prompt,
            "width": 256, "height": 256, "steps": 2, "count": 2}})
    };
    let old = farm.run(&generate("archived"), FINISH).await?;
    assert_eq!(old.state, JobState::Completed, "{old:?}");
    let kept = farm.run(&generate("kept"), FINISH).await?;
    assert_eq!(kept.state, JobState::Completed, "{kept:?}");

    // Retention keeps one finished job: the first is answered from its manifest.
    let archived = wait_for(
        "the first job to be archived",
        Duration::from_secs(10),
        || async {
            match farm.job_answer(old.id).await.ok()? {
                JobAnswer::Archived(job) => Some(job),
                JobAnswer::Live(_) => None,
            }
        },
    )
    .await?;
    assert_eq!(
        (archived.state, &archived.outputs, archived.attempts),
        (JobState::Completed, &old.outputs, 1),
        "{archived:?}"
    );
    assert!(archived.task.is_some(), "{archived:?}");

    let id = old.id.to_string();
    let watched = vnfarm(&farm, &["watch", &id])?;
    let stderr = String::from_utf8_lossy(&watched.stderr);
    assert!(watched.status.success(), "{}: {stderr}", watched.status);
    assert!(stderr.contains("completed (archived)"), "{stderr}");
    let printed: Vec<&str> = std::str::from_utf8(&watched.stdout)?.lines().collect();
    assert_eq!(printed, old.outputs, "watch prints the output keys");

    let dir = tempfile::tempdir()?;
    let out = dir.path().display().to_string();
    let fetched = vnfarm(&farm, &["fetch", &id, "--out", &out])?;
    let stderr = String::from_utf8_lossy(&fetched.stderr);
    assert!(fetched.status.success(), "{}: {stderr}", fetched.status);
    for (n, key) in old.outputs.iter().enumerate() {
        let file = std::fs::read(dir.path().join(format!("{id}-{n}.png")))?;
        assert_eq!(file, farm.storage.get(key).await?, "image {n}");
    }
    Ok(())
}
