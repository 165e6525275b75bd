//! A rolling upgrade (docs/DESIGN.md §4, "Versions and rolling upgrades"): a worker of the previous
//! release, which reads protocol version 1 only and dead-letters anything else as malformed, works
//! beside current workers through a mixed workload, is then drained mid-job by SIGTERM (as an
//! upgrade stops it) and comes back as a current worker under the same id. Nothing is lost, failed
//! or run twice.
//!
//! The previous release's worker is this build's worker with the test harness's
//! `VNFARM_TEST_PROTOCOL_V1_ONLY=1`: it advertises and decodes version 1 only and settles an
//! unreadable message as that release did. What it cannot stand in for, the golden files prove:
//! what this build writes for a version-1 worker is byte for byte what version 1 wrote
//! (`proto/tests/golden.rs`).

use std::collections::BTreeMap;

use serde_json::json;
use vnfarm_proto::JobId;
use vnfarm_proto::http::{JobState, JobView};
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

fn previous_release(step_ms: u64) -> WorkerOptions {
    WorkerOptions {
        step_ms,
        extra_env: vec![("VNFARM_TEST_PROTOCOL_V1_ONLY".into(), "1".into())],
    }
}

/// Submits a generate, a pipeline of a generate with three edits and an upscale, and two edits of
/// one stored input (an affinity batch); returns the ids of every job to wait for.
async fn workload(farm: &Farm, tag: &str) -> anyhow::Result<Vec<JobId>> {
    let input = format!("inputs/upgrade-{tag}.png");
    farm.storage
        .put(
            &input,
            vnfarm_tests::png_bytes(64, 64, 3).into(),
            "image/png",
        )
        .await?;
    let mut bodies = vec![
        json!({"schema_version": 1, "idempotency_key": format!("{tag}-gen"),
            "job": {"kind": "generate", "prompt": format!("{tag} rooftop"), "width": 256, "height": 256, "steps": 6, "count": 2}}),
        json!({"schema_version": 1, "job": {"kind": "pipeline",
            "base": {"prompt": format!("{tag} portrait"), "width": 256, "height": 256, "steps": 6},
            "edits": [{"instruction": "make her smile"}, {"instruction": "make her angry"}, {"instruction": "make her cry"}],
            "upscales": [{"of": "base", "scale": 2}]}}),
    ];
    for instruction in ["wave", "wink"] {
        bodies.push(json!({"schema_version": 1,
            "job": {"kind": "edit", "input": {"stored": input}, "instruction": instruction}}));
    }
    // The same key again: the same job, not a second one.
    bodies.push(bodies[0].clone());
    let mut ids = Vec::new();
    for body in &bodies {
        let (status, answer) = farm.submit(body).await?;
        let id = match answer {
            Ok(submitted) => submitted.job_id,
            Err(refused) => anyhow::bail!("{status}: {refused:?}"),
        };
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// Waits for every job, and the jobs of every pipeline among them; returns each one's final view.
async fn finish_all(farm: &Farm, ids: &[JobId]) -> anyhow::Result<BTreeMap<JobId, JobView>> {
    let mut out = BTreeMap::new();
    let mut todo: Vec<JobId> = ids.to_vec();
    while let Some(id) = todo.pop() {
        let job = farm.wait_finished(id, FINISH).await?;
        todo.extend(job.children.iter().copied());
        out.insert(id, job);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_the_previous_release_works_beside_current_ones_and_is_upgraded()
-> anyhow::Result<()> {
    let mut farm = Farm::new("upgrade").await?;
    farm.start_scheduler().await?;
    // The old worker alone first, so that it gets work.
    farm.start_worker("box-1", previous_release(50)).await?;
    let mut ids = workload(&farm, "old").await?;
    let jobs = finish_all(&farm, &ids).await?;
    assert!(
        jobs.values()
            .any(|j| j.worker.as_ref().is_some_and(|w| w.as_str() == "box-1")),
        "the previous release's worker ran jobs: {jobs:?}"
    );

    farm.start_worker("box-2", WorkerOptions::default()).await?;
    farm.start_worker("box-3", WorkerOptions::default()).await?;
    ids.extend(workload(&farm, "mixed").await?);

    // Upgrade box-1 in the middle of a long job (40 steps of 50 ms): SIGTERM drains it, and the
    // current build starts under the same id. The other boxes are down meanwhile, so the job is
    // on box-1 (what they held is dispatched again).
    farm.kill_worker("box-2");
    farm.kill_worker("box-3");
    let long = farm
        .submit_new(
            &json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "long one",
            "width": 256, "height": 256, "steps": 40}}),
        )
        .await?;
    farm.wait_step(long, 1, FINISH).await?;
    farm.signal_worker("box-1", libc::SIGTERM);
    wait_for("the drained worker to exit", FINISH, || {
        std::future::ready(farm.worker_mut("box-1").try_wait().ok().flatten())
    })
    .await?;
    ids.push(long);
    farm.launch_worker("box-1", WorkerOptions::default())?;
    farm.relaunch_worker("box-2")?;
    farm.relaunch_worker("box-3")?;
    ids.extend(workload(&farm, "new").await?);

    let jobs = finish_all(&farm, &ids).await?;
    for (id, job) in &jobs {
        assert_eq!(
            job.state,
            JobState::Completed,
            "{id}: {job:?}\n{}",
            farm.worker_logs()
        );
    }
    let logs = farm.worker_logs();
    assert!(
        !logs.contains("malformed") && !logs.contains("cannot read"),
        "no worker got a message it could not read:\n{logs}"
    );
    // Every output and manifest is in storage.
    for (id, job) in &jobs {
        for key in job.outputs.iter().chain(&job.manifest) {
            farm.storage
                .get(key)
                .await
                .map_err(|e| anyhow::anyhow!("{id}: {key}: {e}"))?;
        }
    }
    Ok(())
}
