//! A RabbitMQ restart (`rabbitmqctl stop_app` / `start_app`) with a job on the engine: the scheduler
//! and the worker reconnect on their own, the job in flight is delivered again and completes, and new
//! jobs flow afterwards. Needs the right to run `rabbitmqctl` (root, as in CI).

use std::time::Duration;

use serde_json::json;
use vnfarm_proto::JobId;
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, restart_rabbitmq};

const FINISH: Duration = Duration::from_secs(120);

async fn submit(farm: &Farm, prompt: &str, steps: u32) -> anyhow::Result<JobId> {
    farm.submit_new(&json!({"schema_version": 1, "job": {
        "kind": "generate", "prompt": prompt, "steps": steps, "width": 512, "height": 512}}))
        .await
}

async fn outputs(farm: &Farm, id: JobId) -> anyhow::Result<Vec<String>> {
    let mut keys = farm.storage.list(&format!("results/{id}/")).await?;
    keys.sort();
    Ok(keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_job_loses_nothing() -> anyhow::Result<()> {
    let mut farm = Farm::new("broker-restart").await?;
    farm.start_scheduler().await?;
    farm.start_worker(
        "w1",
        WorkerOptions {
            step_ms: 100,
            ..WorkerOptions::default()
        },
    )
    .await?;
    let id = submit(&farm, "before the restart", 40).await?;
    farm.wait_step(id, 2, FINISH).await?;

    restart_rabbitmq(Duration::from_secs(2)).await?;

    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}\n{}",
        farm.log("scheduler.log"),
        farm.worker_logs()
    );
    assert_eq!(
        outputs(&farm, id).await?,
        [
            format!("results/{id}/0.png"),
            format!("results/{id}/manifest.json")
        ]
    );
    for (name, log) in [
        ("scheduler", farm.log("scheduler.log")),
        ("worker", farm.worker_logs()),
    ] {
        assert!(
            log.contains("reconnecting"),
            "the {name} noticed the lost session and reconnected:\n{log}"
        );
    }

    // New work flows after the restart.
    let after = submit(&farm, "after the restart", 5).await?;
    let job = farm.wait_finished(after, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");

    // The scheduler's metrics show the lost session and the connection back (what the dashboards
    // and the VnfarmAmqpDisconnected alert read).
    let metrics = farm.scheduler_metrics().await?;
    let value = |name: &str| {
        metrics.lines().find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .parse::<f64>()
                .ok()
        })
    };
    assert!(
        value("vnfarm_amqp_reconnects_total").is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert_eq!(value("vnfarm_amqp_connected"), Some(1.0), "{metrics}");
    Ok(())
}
