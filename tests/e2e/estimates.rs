//! Estimates (issue 24, DESIGN §5 "Estimates") against a real farm: a job of a class no run has
//! measured says why it has no estimate; once one has run, a running job and the jobs waiting
//! behind it have estimated starts and finishes in queue order; `vnfarm watch` prints them.

use std::process::Command;

use anyhow::Context as _;
use chrono::Utc;
use serde_json::json;
use vnfarm_proto::http::{Estimate, JobState};
use vnfarm_tests::{Farm, WorkerOptions, bin_dir, wait_for};

use crate::FINISH;

fn generate(steps: u32) -> serde_json::Value {
    json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "eta",
        "width": 256, "height": 256, "steps": steps}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_and_running_jobs_have_estimates_and_watch_prints_them() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("estimates").await?;
    // One job per message: the test watches one running job and three waiting behind it, and a
    // batch message would take two of them at once when the four arrive before the worker frees
    // (seen in CI: jobs 0 and 1 dispatched together, never three waiting).
    farm.scheduler_env
        .push(("VNFARM_DISPATCH__MAX_BATCH".into(), "1".into()));
    farm.start_scheduler().await?;
    farm.start_worker(
        "w1",
        WorkerOptions {
            step_ms: 40,
            ..Default::default()
        },
    )
    .await?;

    // Nothing has run: no basis, and the job says so.
    let first = farm.submit_new(&generate(10)).await?;
    let why = wait_for("the first job's reason", FINISH, || async {
        farm.job(first).await.ok()?.no_estimate
    })
    .await?;
    assert!(
        why.contains("no sdxl 0.25mp job has finished on this farm yet")
            || why.contains("not estimated yet"),
        "{why}"
    );
    let done = farm.wait_finished(first, FINISH).await?;
    assert_eq!(done.state, JobState::Completed);
    assert!(
        done.estimate.is_none() && done.no_estimate.is_none(),
        "{done:?}"
    );

    // One measured run (10 steps): a running job and three behind it on the one worker.
    let jobs: Vec<_> = {
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(farm.submit_new(&generate(20)).await?);
        }
        ids
    };
    let estimates: Vec<Estimate> = wait_for("estimates of every job", FINISH, || async {
        let views = futures::future::join_all(jobs.iter().map(|id| farm.job(id))).await;
        let views: Vec<_> = views.into_iter().collect::<Result<_, _>>().ok()?;
        (views[0].state == JobState::Running
            && views[1..].iter().all(|v| v.state == JobState::Queued))
        .then_some(())?;
        views.into_iter().map(|v| v.estimate).collect()
    })
    .await
    .context("a running job and three waiting ones, all estimated")?;
    let now = Utc::now();
    assert!(estimates[0].start_at <= now, "running: {:?}", estimates[0]);
    for pair in estimates.windows(2) {
        assert!(
            pair[1].start_at >= pair[0].finish_at - chrono::Duration::milliseconds(1),
            "queue order: {pair:?}"
        );
    }
    for e in &estimates {
        // 20 steps at the rate of a 10-step run: about twice its time, well above nothing.
        assert!(e.finish_at > e.start_at, "{e:?}");
        assert!(e.basis.contains("sdxl 0.25mp on w1"), "{e:?}");
    }

    // `vnfarm watch` on the last: its estimate while it waits, and its finish once it runs.
    let last = jobs[3].to_string();
    let url = farm.url("");
    let watched = tokio::task::spawn_blocking(move || {
        Command::new(bin_dir().join("vnfarm"))
            .env_clear()
            .args(["--url", &url, "watch", &last])
            .output()
    })
    .await??;
    let stderr = String::from_utf8_lossy(&watched.stderr);
    assert!(watched.status.success(), "{}: {stderr}", watched.status);
    assert!(stderr.contains("estimated start "), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("started ") && l.contains(", finish ")),
        "{stderr}"
    );
    for id in &jobs {
        farm.wait_finished(*id, FINISH).await?;
    }
    Ok(())
}
