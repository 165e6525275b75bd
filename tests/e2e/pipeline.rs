//! The main job path: a pipeline over HTTP, and a submission from a foreign AMQP producer.

use lapin::BasicProperties;
use serde_json::{Value, json};
use vnfarm_proto::http::{JobState, JobView};
use vnfarm_proto::{ImageRef, JobId, JobSpec};
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;

fn states_of(events: &[Value], job: JobId) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["job_id"] == job.to_string())
        .map(|e| e["event"].as_str().unwrap_or("?").to_owned())
        .collect()
}

async fn assert_outputs(farm: &Farm, job: &JobView) -> anyhow::Result<()> {
    let id = job.id;
    let keys = farm.storage.list(&format!("results/{id}/")).await?;
    let outputs = &job.outputs;
    let mut expected = outputs.clone();
    expected.push(format!("results/{id}/manifest.json"));
    expected.sort();
    assert_eq!(keys, expected, "objects of job {id}");
    let manifest: Value = serde_json::from_slice(
        &farm
            .storage
            .get(&format!("results/{id}/manifest.json"))
            .await?,
    )?;
    assert_eq!(manifest["job_id"], id.to_string());
    for (n, key) in outputs.iter().enumerate() {
        let png = farm.storage.get(key).await?;
        let img = image::load_from_memory(&png)?;
        assert_eq!(manifest["outputs"][n]["width"], img.width());
        assert_eq!(manifest["outputs"][n]["height"], img.height());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_over_http_completes_with_every_output_and_event() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("pipeline").await?;
    farm.start_scheduler().await?;
    farm.start_worker("w1", WorkerOptions::default()).await?;
    farm.start_worker("w2", WorkerOptions::default()).await?;

    let pipeline_id = farm
        .submit_new(&json!({"schema_version": 1, "job": {"kind": "pipeline",
            "base": {"prompt": "a girl, (red hair:1.2)", "width": 512, "height": 384, "steps": 6},
            "edits": [{"instruction": "make her smile"}, {"instruction": "make her angry"}, {"instruction": "make her cry"}],
            "upscales": [{"of": {"edit": 0}, "scale": 2}]}}))
        .await?;
    let pipeline = farm.wait_finished(pipeline_id, FINISH).await?;
    assert_eq!(pipeline.state, JobState::Completed, "{pipeline:?}");
    let children = pipeline.children;
    assert_eq!(children.len(), 5);

    let events = farm
        .collect_events(FINISH, |evs| {
            evs.iter()
                .any(|e| e["job_id"] == pipeline_id.to_string() && e["event"] == "completed")
        })
        .await?;
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "sequence numbers increase: {seqs:?}"
    );

    // The pipeline is one `queued` event that lists its jobs (accepting is all or nothing); the
    // jobs have no `queued` event of their own in the stream.
    let queued: Vec<&Value> = events.iter().filter(|e| e["event"] == "queued").collect();
    assert_eq!(queued.len(), 1, "{queued:?}");
    assert_eq!(queued[0]["job_id"], pipeline_id.to_string());
    assert_eq!(queued[0]["children"], json!(children));

    for (i, child) in children.iter().enumerate() {
        let job = farm.job(child).await?;
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        assert_eq!(job.parent, Some(pipeline_id));
        assert_outputs(&farm, &job).await?;
        // Every state after the pipeline's `queued`, in order: dispatched, started, progress...,
        // completed.
        let states = states_of(&events, *child);
        let compact: Vec<&str> = states
            .iter()
            .map(String::as_str)
            .filter(|s| *s != "progress")
            .collect();
        assert_eq!(
            compact,
            ["dispatched", "started", "completed"],
            "job {i}: {states:?}"
        );
        let first_progress = states
            .iter()
            .position(|s| s == "progress")
            .expect("progress events");
        assert!(
            first_progress > 1 && first_progress < states.len() - 1,
            "progress between started and completed: {states:?}"
        );
    }
    // Edits take the base image as picture 1 and keep its size; the upscale doubles its edit.
    let edit = farm.job(children[1]).await?;
    let Some(JobSpec::Edit(spec)) = edit.submission.map(|s| s.job) else {
        panic!("the edit's submission is an edit");
    };
    assert_eq!(
        spec.inputs,
        [ImageRef::JobOutput {
            job: children[0],
            index: 0
        }]
    );
    assert_eq!((spec.width, spec.height), (Some(512), Some(384)));
    let upscaled = image::load_from_memory(
        &farm
            .storage
            .get(&format!("results/{}/0.png", children[4]))
            .await?,
    )?;
    assert_eq!((upscaled.width(), upscaled.height()), (1024, 768));
    assert_eq!(states_of(&events, pipeline_id), ["queued", "completed"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_producer_can_publish_to_the_intake_queue() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("foreign").await?;
    farm.start_scheduler().await?;
    farm.start_worker("w1", WorkerOptions::default()).await?;

    let job_id = uuid::Uuid::now_v7().to_string();
    let body = json!({"schema_version": 1, "job_id": job_id, "priority": "interactive",
        "job": {"kind": "generate", "prompt": "a castle at dusk", "width": 256, "height": 256, "steps": 3, "count": 2, "seed": 7}});
    farm.publish_intake(&body, BasicProperties::default())
        .await?;

    let job = farm.wait_finished(&job_id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    assert_eq!(job.outputs.len(), 2);
    assert_outputs(&farm, &job).await?;
    let manifest: Value = serde_json::from_slice(
        &farm
            .storage
            .get(&format!("results/{job_id}/manifest.json"))
            .await?,
    )?;
    assert_eq!(manifest["outputs"][1]["seed"], 8, "image n uses seed + n");
    // The PNG carries its generation parameters.
    let png = farm.storage.get(&format!("results/{job_id}/0.png")).await?;
    let text = String::from_utf8_lossy(&png);
    assert!(
        text.contains("a castle at dusk") && text.contains("Seed: 7"),
        "parameters chunk present"
    );
    Ok(())
}
