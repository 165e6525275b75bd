//! Fair share and queue control against a real farm (two schedulers, one worker, RabbitMQ, S3):
//! two artists' backlogs take turns on the one worker, also after the active scheduler is killed
//! and the standby takes over; a lead's pause of one person's work holds across that takeover and
//! across a restarted scheduler taking over in its turn; a job moved to the front goes first; an
//! admin's farm-wide pause stops all dispatch until resumed; the queue's routes refuse the roles
//! that lack their permissions, naming what is missing.

use std::time::Duration;

use anyhow::{Context, ensure};
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use vnfarm_proto::http::{JobState, JobView, QueueView};
use vnfarm_tests::{sse, wait_for};

use crate::FINISH;
use crate::people::{ADMIN_TOKEN, Person, create_token, guarded_farm, refused, vnfarm};

/// One generate of `steps` steps (a job of about `steps` × the worker's 40 ms step).
fn generate(prompt: &str, steps: u32) -> Value {
    json!({"schema_version": 1, "job": {"kind": "generate", "prompt": prompt,
        "width": 256, "height": 256, "steps": steps}})
}

/// Whether `job` waits with `waiting_for` saying `words`.
fn waits_for(job: &JobView, words: &str) -> bool {
    job.state == JobState::Queued
        && job
            .waiting_for
            .as_deref()
            .is_some_and(|w| w.contains(words))
}

/// The jobs of `ids` (all finished) in the order they first started, by the offsets of their
/// `started` events in their histories.
async fn start_order(person: &Person, ids: &[String]) -> anyhow::Result<Vec<String>> {
    let mut started: Vec<(u64, String)> = Vec::new();
    for id in ids {
        let response = person
            .http
            .get(format!("{}/v1/jobs/{id}/events", person.base))
            .send()
            .await?;
        ensure!(response.status() == StatusCode::OK, "{}", response.status());
        // A finished job's history, then the stream ends.
        let events: Vec<Value> = sse::json(response.bytes_stream())
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<anyhow::Result<_>>()?;
        let seq = events
            .iter()
            .find(|e| e["event"] == "started")
            .and_then(|e| e["seq"].as_u64())
            .with_context(|| format!("job {id} has no started event: {events:?}"))?;
        started.push((seq, id.clone()));
    }
    started.sort();
    Ok(started.into_iter().map(|(_, id)| id).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_and_pauses_hold_across_a_takeover_and_a_restart() -> anyhow::Result<()> {
    // One job per message, so the order of starts is the order of dispatch.
    let (mut farm, standby) =
        guarded_farm("queue", vec![("VNFARM_BATCH_JOBS".into(), "1".into())]).await?;
    let urls = farm.scheduler_urls();
    let ann_token = create_token(&farm, "ann", "artist")?;
    let bo_token = create_token(&farm, "bo", "artist")?;
    let lee_token = create_token(&farm, "lee", "lead")?;
    let people = |url: &str| -> anyhow::Result<(Person, Person, Person, Person)> {
        Ok((
            Person::new(url, &ann_token)?,
            Person::new(url, &bo_token)?,
            Person::new(url, &lee_token)?,
            Person::new(url, ADMIN_TOKEN)?,
        ))
    };
    let (ann, bo, lee, _) = people(&urls[0])?;

    // The queue's routes refuse the roles that lack their permission, naming it.
    refused(
        &ann.post("/v1/people/bo/pause", None).await?,
        StatusCode::FORBIDDEN,
        "`pause_person` (role lead or admin); ann is an artist",
    )?;
    refused(
        &lee.post("/v1/queue/pause", None).await?,
        StatusCode::FORBIDDEN,
        "`pause_farm` (role admin); lee is a lead",
    )?;

    // Ann queues 10 jobs, then bo 4: they take turns on the worker rather than bo waiting for all
    // of ann's. The active scheduler is killed after the third start; the standby carries on.
    let mut ann_jobs = Vec::new();
    for i in 0..10 {
        ann_jobs.push(ann.submit(&generate(&format!("ann {i}"), 6)).await?);
    }
    let mut bo_jobs = Vec::new();
    for i in 0..4 {
        bo_jobs.push(bo.submit(&generate(&format!("bo {i}"), 6)).await?);
    }
    refused(
        &ann.post(&format!("/v1/jobs/{}/front", ann_jobs[9]), None)
            .await?,
        StatusCode::FORBIDDEN,
        "`reorder` (role lead or admin)",
    )?;
    // An artist's view of the queue is their own row; a lead's everyone's.
    let (status, mine) = ann.get("/v1/queue").await?;
    ensure!(status == StatusCode::OK, "{status} {mine}");
    let mine: QueueView = serde_json::from_value(mine)?;
    ensure!(
        mine.you == "ann" && mine.people.iter().all(|p| p.name == "ann"),
        "{mine:?}"
    );
    let all: Vec<String> = ann_jobs.iter().chain(&bo_jobs).cloned().collect();
    wait_for("three jobs to start", FINISH, || async {
        let mut n = 0;
        for id in &all {
            if lee.job(id).await.ok()?.state != JobState::Queued {
                n += 1;
            }
        }
        (n >= 3).then_some(())
    })
    .await?;
    let active = farm.active_scheduler(FINISH).await?;
    farm.kill_scheduler_at(active);
    let survivor = if active == 0 { standby } else { 0 };
    let (_, _, lee, _) = people(&urls[survivor])?;
    for id in ann_jobs.iter().chain(&bo_jobs) {
        lee.wait_finished(id).await?;
    }
    let order = start_order(&lee, &all).await?;
    let position = |id: &String| order.iter().position(|o| o == id);
    let last_bo = bo_jobs
        .iter()
        .filter_map(position)
        .max()
        .context("bo's starts")?;
    let ann_before: usize = ann_jobs
        .iter()
        .filter_map(position)
        .filter(|p| *p < last_bo)
        .count();
    // Taking turns puts bo's 4th job after ann's 4th (5 with the takeover's slack); first come,
    // first served would put it after all 10.
    ensure!(
        ann_before <= 5,
        "bo's last job started after {ann_before} of ann's: {order:?}"
    );

    // Lee pauses ann's work (with the command line); bo's still runs, ann's waits, saying so.
    farm.start_scheduler_at(active).await?;
    let out = vnfarm(&urls[survivor], &lee_token, &["pause", "--person", "ann"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ann, bo, _, _) = people(&urls[survivor])?;
    let paused_job = ann.submit(&generate("ann paused", 2)).await?;
    let bo_job = bo.submit(&generate("bo runs", 2)).await?;
    ensure!(bo.wait_finished(&bo_job).await?.state == JobState::Completed);
    let waiting = ann.job(&paused_job).await?;
    ensure!(waits_for(&waiting, "lee paused it"), "{waiting:?}");
    // A restarted scheduler (started again above, a standby now) takes over and holds the pause.
    wait_for(
        "the restarted scheduler to be a standby",
        FINISH,
        || async {
            farm.role(active)
                .await
                .filter(|r| *r == vnfarm_tests::Role::Standby)
        },
    )
    .await?;
    farm.kill_scheduler_at(survivor);
    ensure!(farm.active_scheduler(FINISH).await? == active);
    let (ann, _, lee, admin) = people(&urls[active])?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let still = ann.job(&paused_job).await?;
    ensure!(
        waits_for(&still, "lee paused it"),
        "after the takeover: {still:?}"
    );
    let (_, queue) = lee.get("/v1/queue").await?;
    let queue: QueueView = serde_json::from_value(queue)?;
    let ann_row = queue
        .people
        .iter()
        .find(|p| p.name == "ann")
        .context("ann's row")?;
    ensure!(
        ann_row.paused.as_ref().is_some_and(|p| p.by == "lee") && ann_row.waiting == 1,
        "{queue:?}"
    );

    // The admin pauses the farm: nothing starts; lee moves ann's newest job to the front and
    // resumes ann; on the farm's resume that job goes before ann's older one.
    let (status, body) = admin.post("/v1/queue/pause", None).await?;
    ensure!(status == StatusCode::OK, "{status} {body}");
    let newer = ann.submit(&generate("ann newer", 2)).await?;
    let (status, moved) = lee.post(&format!("/v1/jobs/{newer}/front"), None).await?;
    ensure!(status == StatusCode::OK, "{status} {moved}");
    let moved: JobView = serde_json::from_value(moved)?;
    ensure!(moved.moved_by.as_deref() == Some("lee"), "{moved:?}");
    let (status, body) = lee.post("/v1/people/ann/resume", None).await?;
    ensure!(status == StatusCode::OK, "{status} {body}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    for id in [&paused_job, &newer] {
        let job = ann.job(id).await?;
        ensure!(
            waits_for(&job, "the farm to be resumed"),
            "the farm is paused: {job:?}"
        );
    }
    let out = vnfarm(&urls[active], ADMIN_TOKEN, &["resume"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for id in [&paused_job, &newer] {
        ensure!(ann.wait_finished(id).await?.state == JobState::Completed);
    }
    let order = start_order(&lee, &[paused_job.clone(), newer.clone()]).await?;
    ensure!(
        order == vec![newer.clone(), paused_job.clone()],
        "{order:?}"
    );
    let listing = vnfarm(&urls[active], &lee_token, &["queue"])?;
    let listing = String::from_utf8(listing.stdout)?;
    ensure!(
        listing.lines().any(|l| l.starts_with("ann")) && !listing.contains("paused"),
        "{listing}"
    );
    Ok(())
}
