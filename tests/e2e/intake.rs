//! Intake under concurrency and over a long history: same-key submissions sent together make one
//! job whichever way they arrive, and a scheduler restarted from its snapshot knows exactly what
//! the long-running one knew.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use serde_json::{Value, json};
use vnfarm_proto::JobId;
use vnfarm_proto::http::{JobAnswer, JobState};
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;

fn keyed_generate(key: &str) -> Value {
    json!({"schema_version": 1, "idempotency_key": key, "job": {
        "kind": "generate", "prompt": format!("same key {key}"), "width": 256, "height": 256, "steps": 2}})
}

/// Every job the scheduler lists, pipeline jobs included, as id → state.
async fn all_jobs(farm: &Farm) -> anyhow::Result<BTreeMap<JobId, JobState>> {
    let jobs = farm.jobs("all=true&limit=1000").await?;
    Ok(jobs.into_iter().map(|j| (j.id, j.state)).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_key_submissions_sent_together_make_one_job() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("same-key").await?;
    farm.start_scheduler().await?;
    let amqp = farm.connect_amqp().await?;
    let channel = amqp.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let intake = format!("{}.intake", farm.prefix);

    // Eight pairs over HTTP, sent together; four pairs with one half over HTTP and the other over
    // the intake queue at the same moment.
    let http_keys: Vec<String> = (0..8).map(|i| format!("http-{i}")).collect();
    let mixed_keys: Vec<String> = (0..4).map(|i| format!("mixed-{i}")).collect();
    let mut bodies = Vec::new();
    for key in &http_keys {
        bodies.push(keyed_generate(key));
        bodies.push(keyed_generate(key));
    }
    bodies.extend(mixed_keys.iter().map(|key| keyed_generate(key)));
    let posts = bodies.iter().map(|body| farm.submit(body));
    let publishes = mixed_keys.iter().map(|key| {
        let body = serde_json::to_vec(&keyed_generate(key)).unwrap();
        let channel = channel.clone();
        let intake = intake.clone();
        async move {
            channel
                .basic_publish(
                    "".into(),
                    intake.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await?
                .await?;
            anyhow::Ok(())
        }
    });
    let (replies, published) = tokio::join!(
        futures::future::join_all(posts),
        futures::future::join_all(publishes)
    );
    for p in published {
        p?;
    }
    let mut by_key: BTreeMap<String, HashSet<JobId>> = BTreeMap::new();
    let mut created = 0;
    for (i, reply) in replies.into_iter().enumerate() {
        let (status, body) = reply?;
        assert!(status == 200 || status == 201, "{status} {body:?}");
        created += usize::from(status == 201);
        let key = if i < 16 {
            http_keys[i / 2].clone()
        } else {
            mixed_keys[i - 16].clone()
        };
        let submitted = body.expect("an accepted submission");
        by_key.entry(key).or_default().insert(submitted.job_id);
    }
    for (key, ids) in &by_key {
        assert_eq!(ids.len(), 1, "key {key} answered with {ids:?}");
    }
    assert!(created <= 12, "at most one 201 per key, got {created}");

    // The scheduler knows one job per key once the intake messages are in, and no other.
    let jobs = wait_for("one job per key", Duration::from_secs(30), || async {
        let jobs = all_jobs(&farm).await.ok()?;
        (jobs.len() >= 12).then_some(jobs)
    })
    .await?;
    assert_eq!(jobs.len(), 12, "{jobs:?}");
    for ids in by_key.values() {
        assert!(ids.iter().all(|id| jobs.contains_key(id)), "{ids:?}");
    }

    // Each runs once.
    farm.start_worker("w1", WorkerOptions::default()).await?;
    for id in jobs.keys() {
        let job = farm.wait_finished(id, FINISH).await?;
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        assert_eq!(job.attempts, 1, "{job:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_restarted_from_its_snapshot_knows_what_the_running_one_knew()
-> anyhow::Result<()> {
    let mut farm = Farm::new("snapshot").await?;
    farm.scheduler_env = vec![
        ("VNFARM_SNAPSHOT_EVERY_EVENTS".into(), "100".into()),
        ("VNFARM_RETAIN_JOBS".into(), "12".into()),
        // One job per message, so that jobs finish in the order they were submitted and the
        // newest twelve finished are the last twelve submitted: the jobs of a batch message are
        // each reported as they are stored, and two stores may finish in either order.
        ("VNFARM_DISPATCH__MAX_BATCH".into(), "1".into()),
    ];
    farm.start_scheduler().await?;
    farm.start_worker(
        "w1",
        WorkerOptions {
            step_ms: 1,
            ..Default::default()
        },
    )
    .await?;
    let mut ids = Vec::new();
    for i in 0..30 {
        ids.push(farm.submit_new(&keyed_generate(&format!("k{i}"))).await?);
    }
    for id in &ids {
        // The newest twelve finished are kept: an earlier one may be archived by now.
        farm.wait_finished_or_archived(id, FINISH).await?;
    }
    // Retention keeps the newest twelve finished jobs; the running scheduler has forgotten the rest.
    let before = wait_for("retention to settle", Duration::from_secs(10), || async {
        let jobs = all_jobs(&farm).await.ok()?;
        (jobs.len() == 12).then_some(jobs)
    })
    .await?;
    assert!(
        before.values().all(|s| *s == JobState::Completed),
        "{before:?}"
    );
    assert_eq!(
        before.keys().copied().collect::<HashSet<_>>(),
        ids[18..].iter().copied().collect()
    );
    wait_for("a snapshot", Duration::from_secs(10), || async {
        farm.full_log("scheduler.log")
            .contains("registry snapshot written")
            .then_some(())
    })
    .await?;

    farm.kill_scheduler();
    farm.start_scheduler().await?;
    let log = farm.full_log("scheduler.log");
    assert!(log.contains("registry snapshot loaded"), "{log}");
    assert_eq!(
        all_jobs(&farm).await?,
        before,
        "restarted and running schedulers agree"
    );

    // A forgotten job that completed is answered from its manifest.
    let JobAnswer::Archived(old) = farm.job_answer(ids[0]).await? else {
        panic!("job {} is archived", ids[0]);
    };
    assert_eq!(old.state, JobState::Completed, "{old:?}");
    assert_eq!(old.outputs, [format!("results/{}/0.png", ids[0])]);
    // A recent one still has its history, without progress events.
    let JobAnswer::Live(recent) = farm.job_answer(ids[29]).await? else {
        panic!("job {} is in the registry", ids[29]);
    };
    assert_eq!(recent.attempts, 1, "{recent:?}");
    Ok(())
}
