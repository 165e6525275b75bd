//! Redeliveries: a job message that comes back after the job finished, as it does when a worker
//! stores a job's results and then dies, or loses the broker, before its ack.

use futures::StreamExt;
use serde_json::{Value, json};
use vnfarm_bus::Publisher;
use vnfarm_bus::publisher::json_properties;
use vnfarm_proto::http::JobState;
use vnfarm_proto::topology::{Topology, manifest_key};
use vnfarm_proto::{Manifest, SCHEMA_VERSION, WorkMessage, WorkerId, decode_json};
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

/// The job's message arrives again after the job completed. The worker finds the job's manifest,
/// reports `completed` from it without running the engine (no `started`, no progress, the stored
/// results untouched) and acks the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_completed_job_is_not_run_again() -> anyhow::Result<()> {
    let mut farm = Farm::new("redelivered").await?;
    farm.start_scheduler().await?;
    farm.start_worker("w1", WorkerOptions::default()).await?;
    let job_id = farm
        .submit_new(&json!({"schema_version": 1, "job": {
            "kind": "generate", "prompt": "a lighthouse", "steps": 4, "width": 256, "height": 256}}))
        .await?;
    let id = job_id.to_string();
    let job = farm.wait_finished(job_id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    let stored = farm.storage.get(&manifest_key(job_id)).await?;
    let manifest: Manifest = decode_json(&stored)?;

    // Watch the job's events on the exchange, from before the message goes out.
    let topology = Topology::new(farm.prefix.clone());
    let conn = farm.connect_amqp().await?;
    let mut events = vnfarm_bus::topology::subscribe_private(
        &conn,
        &topology.events_exchange(),
        &format!("job.{id}.#"),
        "redelivery-test",
    )
    .await?;
    // The message as the scheduler dispatches it, straight onto the worker's queue.
    let message = WorkMessage {
        schema_version: SCHEMA_VERSION,
        job_id,
        priority: Default::default(),
        deadline: None,
        task: manifest.task.clone(),
        batch: Vec::new(),
    };
    let worker: WorkerId = "w1".parse().map_err(anyhow::Error::msg)?;
    Publisher::open(&conn)
        .await?
        .publish_json(
            "",
            &topology.worker_queue(&worker),
            &message,
            json_properties().with_message_id(id.clone().into()),
        )
        .await?;

    let mut seen = Vec::new();
    while !seen.iter().any(|e| e == "completed") {
        let delivery = tokio::time::timeout(FINISH, events.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!("no completed event; seen {seen:?}\n{}", farm.worker_logs())
            })?
            .ok_or_else(|| anyhow::anyhow!("event subscription ended"))??;
        let event: Value = serde_json::from_slice(&delivery.data)?;
        seen.push(event["event"].as_str().unwrap_or("?").to_owned());
    }
    assert_eq!(seen, ["completed"], "only `completed`, nothing run");

    // Logged once the message is acked.
    wait_for("the worker to ack the redelivery", FINISH, || async {
        farm.log("w1.log")
            .contains("job already completed; not running it again")
            .then_some(())
    })
    .await?;
    assert_eq!(
        farm.storage.get(&manifest_key(job_id)).await?,
        stored,
        "the stored manifest was not rewritten"
    );
    let job = farm.job(job_id).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    assert_eq!(job.attempts, 1, "one `started` in all: {job:?}");
    Ok(())
}
