//! Logs on request as JSON (`VNFARM_LOG_FORMAT=json`): one object a line, and every line logged
//! while a job is handled carries its id, from the `job` span in the worker and the `job` or
//! `dispatch` span in the scheduler.

use serde_json::{Value, json};
use std::time::Duration;

use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

/// Whether a JSON log line was logged about `id`: in its own fields or in a span it is in.
fn about(line: &Value, id: &str) -> bool {
    line["job_id"] == id
        || line["spans"]
            .as_array()
            .is_some_and(|spans| spans.iter().any(|s| s["job_id"] == id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_job_id_in_both_binaries() -> anyhow::Result<()> {
    let json_logs = ("VNFARM_LOG_FORMAT".to_owned(), "json".to_owned());
    let mut farm = Farm::new("json-logs").await?;
    farm.scheduler_env.push(json_logs.clone());
    farm.start_scheduler().await?;
    farm.start_worker(
        "logger",
        WorkerOptions {
            extra_env: vec![json_logs],
            ..Default::default()
        },
    )
    .await?;
    let id = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "generate",
            "prompt": "logged", "width": 256, "height": 256, "steps": 2}}))
        .await?
        .to_string();
    let job = farm.wait_finished(&id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");

    for (log, message) in [
        ("logger.log", "job completed"),
        ("scheduler.log", "dispatched"),
    ] {
        // The worker logs `job completed` just after it reports the job, so the line may come a
        // moment after the job shows as completed.
        let logged = wait_for(
            &format!("a `{message}` line about {id} in {log}"),
            Duration::from_secs(10),
            || {
                let text = farm.full_log(log);
                let id = id.clone();
                async move {
                    let lines: Vec<Value> = text
                        .lines()
                        .filter_map(|l| serde_json::from_str(l).ok())
                        .collect();
                    lines
                        .iter()
                        .any(|l| l["message"] == message && about(l, &id))
                        .then_some(())
                }
            },
        )
        .await;
        let text = farm.full_log(log);
        assert!(
            logged.is_ok(),
            "{log} has no `{message}` line about {id}:\n{text}"
        );
        for l in text.lines() {
            serde_json::from_str::<Value>(l).map_err(|e| anyhow::anyhow!("{log}: {e}: {l}"))?;
        }
    }
    // The worker's lines while it ran the job are in its `job` span, whatever their own fields.
    let worker = farm.full_log("logger.log");
    let in_span = worker
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["span"]["name"] == "job")
        .collect::<Vec<_>>();
    assert!(!in_span.is_empty(), "{worker}");
    assert!(
        in_span.iter().all(|l| l["span"]["job_id"] == id.as_str()),
        "{worker}"
    );
    Ok(())
}
