//! Outages of the services around the job system: what happens to the job in flight.

use std::time::Duration;

use serde_json::json;
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;

/// S3 goes down while a job is on the engine. The worker retries its upload with backoff; when the
/// retries run out it reports a retryable `failed` event and gives the job back; once S3 is up again
/// the job runs again and completes with all its outputs. Nothing is lost and nothing is stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_outage_mid_job_delays_the_job_and_loses_nothing() -> anyhow::Result<()> {
    let mut farm = Farm::with_own_s3("s3-outage").await?;
    farm.start_scheduler().await?;
    let options = WorkerOptions {
        step_ms: 50,
        // Two attempts, 200 ms apart: a short retry window, so the outage outlasts it.
        extra_env: vec![("VNFARM_STORAGE_ATTEMPTS".into(), "2".into())],
    };
    farm.start_worker("w1", options).await?;
    let (status, body) = farm
        .submit(&json!({"schema_version": 1, "job": {
            "kind": "generate", "prompt": "rooftop at dusk", "steps": 20, "count": 2,
            "width": 512, "height": 512}}))
        .await?;
    assert_eq!(status, 201, "{body}");
    let id = body["job_id"].as_str().unwrap().to_owned();
    farm.wait_step(&id, 1, FINISH).await?;

    farm.own_s3.as_mut().expect("own S3").stop();
    let events = farm
        .collect_events(FINISH, |evs| {
            evs.iter().any(|e| {
                e["job_id"] == id.as_str() && e["event"] == "failed" && e["retryable"] == true
            })
        })
        .await?;
    let failed = events
        .iter()
        .find(|e| e["job_id"] == id.as_str() && e["event"] == "failed")
        .unwrap();
    assert_eq!(failed["failure"], "storage", "{failed}");
    let log = farm.log("w1.log");
    assert!(
        log.contains("storage operation failed; retrying"),
        "the worker retried before giving up:\n{log}"
    );
    // The job is not final while S3 is down.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let job = farm.job(&id).await?;
    assert!(
        !matches!(
            job["state"].as_str(),
            Some("completed" | "failed" | "cancelled")
        ),
        "{job}"
    );

    farm.own_s3.as_mut().expect("own S3").restart()?;
    let job = farm.wait_finished(&id, FINISH).await?;
    assert_eq!(job["state"], "completed", "{job}\n{}", farm.worker_logs());
    let mut keys = farm.storage.list(&format!("results/{id}/")).await?;
    keys.sort();
    assert_eq!(
        keys,
        [
            format!("results/{id}/0.png"),
            format!("results/{id}/1.png"),
            format!("results/{id}/manifest.json"),
        ],
        "every output once, and the manifest"
    );
    Ok(())
}

/// A device failure on a worker (injected through the test-pattern fixture, as a CUDA error would
/// come from libtorch): the job is reported retryable and runs on another worker; the failed worker
/// stops taking jobs and exits with an error for its supervisor to restart it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_failure_moves_the_job_and_stops_the_worker() -> anyhow::Result<()> {
    const TRIGGER: &str = "a prompt that breaks the GPU";
    let mut farm = Farm::new("device-lost").await?;
    farm.start_scheduler().await?;
    let broken = WorkerOptions {
        extra_env: vec![(
            "VNFARM_ENGINE__TEST_PATTERN__DEVICE_FAILURE_PROMPT".into(),
            TRIGGER.into(),
        )],
        ..WorkerOptions::default()
    };
    farm.start_worker("w-bad", broken).await?;
    let (status, body) = farm
        .submit(&json!({"schema_version": 1, "job": {
            "kind": "generate", "prompt": TRIGGER, "steps": 4, "width": 512, "height": 512}}))
        .await?;
    assert_eq!(status, 201, "{body}");
    let id = body["job_id"].as_str().unwrap().to_owned();

    let exit = vnfarm_tests::wait_for("the broken worker to exit", FINISH, || {
        std::future::ready(farm.worker_mut("w-bad").try_wait().ok().flatten())
    })
    .await?;
    let log = farm.log("w-bad.log");
    assert!(!exit.success(), "exit status {exit}\n{log}");
    assert!(log.contains("device failure"), "{log}");

    farm.start_worker("w-good", WorkerOptions::default())
        .await?;
    let job = farm.wait_finished(&id, FINISH).await?;
    assert_eq!(job["state"], "completed", "{job}\n{}", farm.worker_logs());
    assert_eq!(job["worker"], "w-good", "{job}");
    let events = farm
        .collect_events(FINISH, |evs| {
            evs.iter()
                .any(|e| e["job_id"] == id.as_str() && e["event"] == "completed")
        })
        .await?;
    assert!(
        events.iter().any(|e| e["job_id"] == id.as_str()
            && e["event"] == "failed"
            && e["failure"] == "engine"
            && e["retryable"] == true),
        "a retryable engine failure was reported first"
    );
    Ok(())
}
