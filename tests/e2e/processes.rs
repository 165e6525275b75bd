//! Processes dying and restarting: a worker SIGKILLed mid-job, a worker drained by SIGTERM, and a
//! scheduler restarted with jobs queued and running.

use std::time::Duration;

use futures::TryStreamExt;
use serde_json::{Value, json};
use sse_stream::Sse;
use vnfarm_proto::http::JobState;
use vnfarm_proto::{JobId, WorkerId};
use vnfarm_tests::{Farm, WorkerOptions, sse, wait_for};

use crate::FINISH;

fn generate(prompt: &str, steps: u32) -> Value {
    json!({"schema_version": 1, "job": {"kind": "generate", "prompt": prompt, "width": 256, "height": 256, "steps": steps}})
}

async fn wait_running_on(farm: &Farm, id: JobId, worker: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("job {id} running on {worker}"),
        Duration::from_secs(30),
        || async {
            let job = farm.job(id).await.ok()?;
            (job.state == JobState::Running
                && job.worker.as_ref().map(WorkerId::as_str) == Some(worker)
                && job.progress.is_some_and(|p| p.step >= 1))
            .then_some(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_job_loses_nothing() -> anyhow::Result<()> {
    let mut farm = Farm::new("sigkill").await?;
    farm.start_scheduler().await?;
    farm.start_worker(
        "doomed",
        WorkerOptions {
            step_ms: 100,
            ..Default::default()
        },
    )
    .await?;
    let id = farm.submit_new(&generate("killed midway", 30)).await?;
    wait_running_on(&farm, id, "doomed").await?;
    farm.signal_worker("doomed", libc::SIGKILL);
    let _ = farm.worker_mut("doomed").wait();

    farm.start_worker("rescuer", WorkerOptions::default())
        .await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    assert_eq!(job.worker.as_ref().map(WorkerId::as_str), Some("rescuer"));
    // Exactly one set of outputs: one image and one manifest, written by the rescuer.
    let keys = farm.storage.list(&format!("results/{id}/")).await?;
    assert_eq!(
        keys,
        [
            format!("results/{id}/0.png"),
            format!("results/{id}/manifest.json")
        ]
    );
    let manifest: Value = serde_json::from_slice(
        &farm
            .storage
            .get(&format!("results/{id}/manifest.json"))
            .await?,
    )?;
    assert_eq!(manifest["worker"], "rescuer");
    let events: Vec<&str> = job_events(&farm, id).await?;
    assert!(
        events.contains(&"requeued"),
        "the job came back to the scheduler: {events:?}"
    );
    Ok(())
}

async fn job_events(farm: &Farm, id: JobId) -> anyhow::Result<Vec<&'static str>> {
    let response = farm
        .http
        .get(farm.url(&format!("/v1/jobs/{id}/events")))
        .send()
        .await?;
    let known = [
        "queued",
        "dispatched",
        "requeued",
        "started",
        "progress",
        "completed",
        "failed",
        "cancelled",
    ];
    let events: Vec<Sse> = sse::events(response.bytes_stream()).try_collect().await?;
    Ok(events
        .iter()
        .filter_map(|e| e.event.as_deref())
        .filter_map(|e| known.iter().find(|k| **k == e).copied())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_job_in_hand_then_exits_zero() -> anyhow::Result<()> {
    let mut farm = Farm::new("sigterm").await?;
    farm.start_scheduler().await?;
    farm.start_worker(
        "drainer",
        WorkerOptions {
            step_ms: 100,
            ..Default::default()
        },
    )
    .await?;
    let first = farm.submit_new(&generate("in hand", 15)).await?;
    let second = farm.submit_new(&generate("next in line", 3)).await?;
    wait_running_on(&farm, first, "drainer").await?;
    farm.signal_worker("drainer", libc::SIGTERM);

    let status = tokio::task::block_in_place(|| farm.worker_mut("drainer").wait())?;
    assert!(
        status.success(),
        "exit status {status}\n{}",
        farm.worker_logs()
    );
    let job = farm.job(first).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "the job in hand finished before exit: {job:?}"
    );
    let waiting = farm.job(second).await?;
    assert!(
        matches!(waiting.state, JobState::Queued | JobState::Dispatched),
        "{waiting:?}"
    );
    assert_eq!(
        waiting.attempts, 0,
        "the draining worker took no new job: {waiting:?}"
    );

    farm.start_worker("successor", WorkerOptions::default())
        .await?;
    let job = farm.wait_finished(second, FINISH).await?;
    assert_eq!(
        (job.state, job.worker.as_ref().map(WorkerId::as_str)),
        (JobState::Completed, Some("successor")),
        "{job:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scheduler_answers_for_every_job_and_they_complete() -> anyhow::Result<()> {
    let mut farm = Farm::new("restart").await?;
    farm.start_scheduler().await?;
    farm.start_worker(
        "w1",
        WorkerOptions {
            step_ms: 40,
            ..Default::default()
        },
    )
    .await?;
    let pipeline = json!({"schema_version": 1, "job": {"kind": "pipeline",
        "base": {"prompt": "a knight", "width": 256, "height": 256, "steps": 10},
        "edits": [{"instruction": "smile"}, {"instruction": "frown"}], "upscales": [{"of": "base"}]}});
    let mut ids = vec![farm.submit_new(&pipeline).await?];
    for n in 0..4 {
        ids.push(
            farm.submit_new(&generate(&format!("queued {n}"), 10))
                .await?,
        );
    }
    // Kill it while some jobs run and others wait.
    wait_for("a job to be running", Duration::from_secs(30), || async {
        let jobs = farm
            .get_json("/v1/jobs?all=true&state=running")
            .await
            .ok()?;
        (!jobs["jobs"].as_array()?.is_empty()).then_some(())
    })
    .await?;
    farm.kill_scheduler();
    farm.start_scheduler().await?;

    for id in &ids {
        let job = farm.job(id).await?;
        assert_ne!(job.state, JobState::Failed, "{job:?}");
    }
    for id in &ids {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        for child in &job.children {
            let child = farm.job(child).await?;
            assert_eq!(child.state, JobState::Completed, "{child:?}");
            assert_eq!(child.outputs.len(), 1);
            farm.storage.get(&child.outputs[0]).await?;
        }
    }
    Ok(())
}
