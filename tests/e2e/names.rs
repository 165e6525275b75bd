//! Names that exist (DESIGN §7b): a submission naming a checkpoint or LoRA that no worker has
//! advertised and the model catalogue (on the real S3 server) does not hold is refused with 422,
//! naming the field and the names that exist, over HTTP and over the intake queue alike; a name
//! that exists runs; a checkpoint whose only worker left waits, says until when, and fails with
//! `no_worker` once that time has passed while other SDXL workers are up.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use vnfarm_proto::http::{Failure, JobState, JobView};
use vnfarm_proto::{FailureKind, ModelFileRole};
use vnfarm_storage::Catalogue;
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

fn generate(extra: Value) -> Value {
    let mut job =
        json!({"kind": "generate", "prompt": "1girl", "width": 256, "height": 256, "steps": 2});
    job.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    json!({"schema_version": 1, "job": job})
}

/// A test-pattern worker that claims these checkpoints and LoRA files.
fn claiming(checkpoints: &[&str], loras: &[&str]) -> WorkerOptions {
    WorkerOptions::default().with_env([
        (
            "VNFARM_ENGINE__TEST_PATTERN__CHECKPOINTS".to_owned(),
            serde_json::to_string(checkpoints).unwrap(),
        ),
        (
            "VNFARM_ENGINE__TEST_PATTERN__LORAS".to_owned(),
            serde_json::to_string(loras).unwrap(),
        ),
    ])
}

/// Submits and expects a 422 on `field` whose message has every one of `says`.
async fn refused(farm: &Farm, body: &Value, field: &str, says: &[&str]) -> anyhow::Result<()> {
    let (status, reply) = farm.submit(body).await?;
    let error = reply.expect_err("refused").error;
    assert_eq!(status, 422, "{body}: {error:?}");
    assert_eq!(error.field, field, "{error:?}");
    for s in says {
        assert!(error.message.contains(s), "{s:?} in {:?}", error.message);
    }
    Ok(())
}

/// The failure of a job that ended failed as `kind`.
fn failed_with(job: JobView, kind: FailureKind) -> Failure {
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    let failure = job.failure.clone().expect("a failure");
    assert_eq!(failure.kind, kind, "{job:?}");
    failure
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn names_that_exist_nowhere_are_refused_and_a_gone_checkpoint_fails_in_time()
-> anyhow::Result<()> {
    let mut farm = Farm::in_process("names").await?;
    farm.scheduler_env = vec![("VNFARM_CHECKPOINT_WAIT_S".into(), "3".into())];
    farm.start_scheduler().await?;
    let lora = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../worker/models/fixtures/sdxl/lora/kohya.safetensors");
    let pushed = Catalogue::new(farm.storage.clone())
        .push(&lora, ModelFileRole::Lora, Some("cat_style"))
        .await?;
    farm.start_worker("a", claiming(&["nova"], &["ink.safetensors"]))
        .await?;
    farm.start_worker("rare", claiming(&["rare"], &[])).await?;
    // Until a heartbeat timeout (3 s) has passed since it started, a scheduler may not have heard
    // every worker: it refuses nothing.
    let typo = generate(json!({"checkpoint": "novaa"}));
    wait_for(
        "the scheduler to have heard the fleet",
        Duration::from_secs(10),
        || async { (farm.submit(&typo).await.ok()?.0 == 422).then_some(()) },
    )
    .await?;

    refused(
        &farm,
        &typo,
        "job.checkpoint",
        &["checkpoint `novaa`", "names that exist: nova, rare"],
    )
    .await?;
    refused(
        &farm,
        &generate(json!({"loras": [{"name": "ink"}, {"name": "inkk"}]})),
        "job.loras[1].name",
        &[
            "LoRA `inkk`",
            "names that exist: cat_style, ink.safetensors",
        ],
    )
    .await?;
    let pipeline = json!({"schema_version": 1, "job": {"kind": "pipeline",
        "base": {"prompt": "x", "width": 256, "height": 256, "steps": 2},
        "edits": [{"instruction": "smile", "loras": [{"name": "cat_style"}]},
                  {"instruction": "frown", "loras": [{"name": "cat-style"}]}]}});
    refused(
        &farm,
        &pipeline,
        "job.edits[1].loras[0].name",
        &["LoRA `cat-style`"],
    )
    .await?;
    let absent = format!("sha256:{}", "0".repeat(64));
    refused(
        &farm,
        &generate(json!({"loras": [{"name": absent}]})),
        "job.loras[0].name",
        &["is on no worker and not in the model catalogue"],
    )
    .await?;

    // Names that exist: a worker's file (with or without its extension), a catalogue name, a
    // catalogue file by hash, a checkpoint.
    for extra in [
        json!({"checkpoint": "nova", "loras": [{"name": "ink"}]}),
        json!({"loras": [{"name": "ink.safetensors"}, {"name": "cat_style"}]}),
        json!({"loras": [{"name": format!("sha256:{}", pushed.sha256)}]}),
    ] {
        let id = farm.submit_new(&generate(extra.clone())).await?;
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job.state, JobState::Completed, "{extra}: {job:?}");
    }

    // Over the intake queue a refusal is the job's `failed` event, with the same words.
    let id = vnfarm_proto::JobId::new();
    let mut body = typo.clone();
    body["job_id"] = json!(id);
    farm.publish_intake(&body, lapin::BasicProperties::default())
        .await?;
    let failure = failed_with(
        farm.wait_finished(id, FINISH).await?,
        FailureKind::InvalidSpec,
    );
    assert!(
        failure.message.contains("checkpoint `novaa`"),
        "{failure:?}"
    );

    // The only worker of `rare` leaves: a job naming it is accepted (the name is known), says how
    // long it waits, and fails with no_worker once that has passed, as `a` serves SDXL meanwhile.
    farm.kill_worker("rare");
    wait_for("rare to be gone", Duration::from_secs(15), || async {
        let workers = farm.workers().await.ok()?;
        workers
            .iter()
            .any(|w| w.id.as_str() == "rare" && !w.alive)
            .then_some(())
    })
    .await?;
    let id = farm
        .submit_new(&generate(json!({"checkpoint": "rare"})))
        .await?;
    let waiting = farm.job(id).await?.waiting_for.unwrap_or_default();
    assert!(
        waiting.contains("no live worker serves sdxl checkpoint rare")
            && waiting.contains("fails at"),
        "{waiting}"
    );
    let failure = failed_with(
        farm.wait_finished(id, Duration::from_secs(20)).await?,
        FailureKind::NoWorker,
    );
    assert!(failure.message.contains("checkpoint_wait_s"), "{failure:?}");
    Ok(())
}
