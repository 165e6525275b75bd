//! Processes dying and restarting: a worker SIGKILLed mid-job, a worker drained by SIGTERM, and a
//! scheduler restarted with jobs queued and running.

use std::time::Duration;

use futures::TryStreamExt;
use serde_json::{Value, json};
use sse_stream::Sse;
use vnfarm_tests::{Farm, WorkerOptions, sse, wait_for};

use crate::FINISH;

fn generate(prompt: &str, steps: u32) -> Value {
    json!({"schema_version": 1, "job": {"kind": "generate", "prompt": prompt, "width": 256, "height": 256, "steps": steps}})
}

async fn submit_id(farm: &Farm, body: &Value) -> anyhow::Result<String> {
    let (status, reply) = farm.submit(body).await?;
    anyhow::ensure!(status == 201, "submit: {status} {reply}");
    Ok(reply["job_id"].as_str().unwrap().to_owned())
}

async fn wait_running_on(farm: &Farm, id: &str, worker: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("job {id} running on {worker}"),
        Duration::from_secs(30),
        || async {
            let job = farm.job(id).await.ok()?;
            (job["state"] == "running"
                && job["worker"] == worker
                && job["progress"]["step"].as_u64().unwrap_or(0) >= 1)
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
    let id = submit_id(&farm, &generate("killed midway", 30)).await?;
    wait_running_on(&farm, &id, "doomed").await?;
    farm.signal_worker("doomed", libc::SIGKILL);
    let _ = farm.worker_mut("doomed").wait();

    farm.start_worker("rescuer", WorkerOptions::default())
        .await?;
    let job = farm.wait_finished(&id, FINISH).await?;
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(job["worker"], "rescuer");
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
    let events: Vec<&str> = job_events(&farm, &id).await?;
    assert!(
        events.contains(&"requeued"),
        "the job came back to the scheduler: {events:?}"
    );
    Ok(())
}

async fn job_events(farm: &Farm, id: &str) -> anyhow::Result<Vec<&'static str>> {
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
    let first = submit_id(&farm, &generate("in hand", 15)).await?;
    let second = submit_id(&farm, &generate("next in line", 3)).await?;
    wait_running_on(&farm, &first, "drainer").await?;
    farm.signal_worker("drainer", libc::SIGTERM);

    let status = tokio::task::block_in_place(|| farm.worker_mut("drainer").wait())?;
    assert!(
        status.success(),
        "exit status {status}\n{}",
        farm.worker_logs()
    );
    let job = farm.job(&first).await?;
    assert_eq!(
        job["state"], "completed",
        "the job in hand finished before exit: {job}"
    );
    let waiting = farm.job(&second).await?;
    assert!(
        matches!(waiting["state"].as_str(), Some("queued" | "dispatched")),
        "{waiting}"
    );
    assert_eq!(
        waiting["attempts"], 0,
        "the draining worker took no new job: {waiting}"
    );

    farm.start_worker("successor", WorkerOptions::default())
        .await?;
    let job = farm.wait_finished(&second, FINISH).await?;
    assert_eq!(
        (job["state"].as_str(), job["worker"].as_str()),
        (Some("completed"), Some("successor")),
        "{job}"
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
    let mut ids = vec![submit_id(&farm, &pipeline).await?];
    for n in 0..4 {
        ids.push(submit_id(&farm, &generate(&format!("queued {n}"), 10)).await?);
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
        assert_ne!(job["state"], "failed", "{job}");
    }
    for id in &ids {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job["state"], "completed", "{job}");
        for child in job["children"].as_array().into_iter().flatten() {
            let child = farm.job(child.as_str().unwrap()).await?;
            assert_eq!(child["state"], "completed", "{child}");
            let outputs = child["outputs"].as_array().unwrap();
            assert_eq!(outputs.len(), 1);
            farm.storage.get(outputs[0].as_str().unwrap()).await?;
        }
    }
    Ok(())
}
