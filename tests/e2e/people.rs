//! People and keys against a real farm (two schedulers, a worker, RabbitMQ and S3): the admin
//! (the configuration's `api_token`) makes tokens for two artists and a lead with the `vnfarm`
//! command line; every route is tried with each person's token; the owner of a job and who
//! cancelled it are on the job and in its events; a revoked token is refused at once by the
//! scheduler that revoked it, by the standby, and by a scheduler started afterwards.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, ensure};
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use vnfarm_proto::PersonEventKind;
use vnfarm_proto::http::{JobState, JobView};
use vnfarm_tests::{Farm, WorkerOptions, bin_dir, png_bytes, sse, wait_for};

use crate::FINISH;

pub(crate) const ADMIN_TOKEN: &str = "people-test-admin-token-0123";

/// Runs `vnfarm --token <token> <args>` against scheduler `url`.
pub(crate) fn vnfarm(url: &str, token: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(bin_dir().join("vnfarm"))
        .env_clear()
        .args(["--url", url, "--token", token])
        .args(args)
        .output()?)
}

/// `vnfarm tokens create NAME --role ROLE` as the admin; returns the token it printed.
pub(crate) fn create_token(farm: &Farm, name: &str, role: &str) -> anyhow::Result<String> {
    let out = vnfarm(
        &farm.url(""),
        ADMIN_TOKEN,
        &["tokens", "create", name, "--role", role],
    )?;
    ensure!(
        out.status.success(),
        "tokens create {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout)?.trim().to_owned();
    ensure!(
        token.starts_with("vnfarm_") && token.len() == 71,
        "{token:?}"
    );
    Ok(token)
}

/// One person's view of one scheduler.
pub(crate) struct Person {
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
}

impl Person {
    pub(crate) fn new(base: &str, token: &str) -> anyhow::Result<Self> {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {token}").parse()?,
        );
        Ok(Self {
            http: reqwest::Client::builder()
                .default_headers(headers)
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
            base: base.to_owned(),
        })
    }

    /// `method path` with an optional JSON body: the status and the body (JSON, or null).
    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(StatusCode, Value)> {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.timeout(Duration::from_secs(20)).send().await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    pub(crate) async fn get(&self, path: &str) -> anyhow::Result<(StatusCode, Value)> {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub(crate) async fn post(
        &self,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(StatusCode, Value)> {
        self.call(reqwest::Method::POST, path, body).await
    }

    pub(crate) async fn submit(&self, body: &Value) -> anyhow::Result<String> {
        let (status, answer) = self.post("/v1/jobs", Some(body)).await?;
        ensure!(status == StatusCode::CREATED, "{status} {answer}");
        Ok(answer["job_id"].as_str().context("job_id")?.to_owned())
    }

    pub(crate) async fn job(&self, id: &str) -> anyhow::Result<JobView> {
        let (status, job) = self.get(&format!("/v1/jobs/{id}")).await?;
        ensure!(status == StatusCode::OK, "{status} {job}");
        Ok(serde_json::from_value(job)?)
    }

    pub(crate) async fn wait_finished(&self, id: &str) -> anyhow::Result<JobView> {
        wait_for(&format!("job {id} to finish"), FINISH, || async {
            self.job(id).await.ok().filter(|j| j.state.is_terminal())
        })
        .await
    }

    /// The ids of the jobs `GET /v1/jobs?all=true` lists.
    async fn listed(&self) -> anyhow::Result<Vec<String>> {
        let (status, list) = self.get("/v1/jobs?all=true&limit=1000").await?;
        ensure!(status == StatusCode::OK, "{status} {list}");
        Ok(list["jobs"]
            .as_array()
            .context("jobs")?
            .iter()
            .filter_map(|j| j["id"].as_str().map(str::to_owned))
            .collect())
    }

    /// The events `GET /v1/events?after=0` sends until one of job `until` ends.
    async fn events_until(&self, until: &str) -> anyhow::Result<Vec<Value>> {
        let response = self
            .http
            .get(format!("{}/v1/events?after=0", self.base))
            .send()
            .await?;
        ensure!(response.status() == StatusCode::OK, "{}", response.status());
        let mut body = std::pin::pin!(sse::json(response.bytes_stream()));
        let mut events = Vec::new();
        let deadline = tokio::time::Instant::now() + FINISH;
        loop {
            let event = tokio::time::timeout_at(deadline, body.next())
                .await?
                .context("the event stream ended")??;
            let done = event["job_id"] == until && event["event"] == "completed";
            events.push(event);
            if done {
                return Ok(events);
            }
        }
    }
}

/// A farm whose schedulers want `ADMIN_TOKEN`, which the harness's own client (waiting for
/// workers, killing and starting schedulers) sends: an active scheduler in slot 0, a standby in the
/// slot returned, and worker `w1` with 40 ms steps and `worker_env`.
pub(crate) async fn guarded_farm(
    name: &str,
    worker_env: Vec<(String, String)>,
) -> anyhow::Result<(Farm, usize)> {
    let mut farm = Farm::new(name).await?;
    farm.scheduler_env
        .push(("VNFARM_API_TOKEN".into(), ADMIN_TOKEN.into()));
    farm.http = Person::new("", ADMIN_TOKEN)?.http;
    farm.start_scheduler_at(0).await?;
    let standby = farm.add_scheduler();
    farm.start_scheduler_at(standby).await?;
    let options = WorkerOptions {
        step_ms: 40,
        ..WorkerOptions::default()
    };
    farm.start_worker("w1", options.with_env(worker_env))
        .await?;
    Ok((farm, standby))
}

/// A refusal: `status`, field `authorization`, and a message naming `needs`.
pub(crate) fn refused(
    answer: &(StatusCode, Value),
    status: StatusCode,
    needs: &str,
) -> anyhow::Result<()> {
    let (got, body) = answer;
    ensure!(*got == status, "{got} {body}, wanted {status}");
    ensure!(body["error"]["field"] == "authorization", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    ensure!(
        message.contains(needs),
        "{message:?} does not name {needs:?}"
    );
    Ok(())
}

fn generate(prompt: &str, extra: Value) -> Value {
    let mut job =
        json!({"kind": "generate", "prompt": prompt, "width": 256, "height": 256, "steps": 2});
    for (k, v) in extra.as_object().into_iter().flatten() {
        job[k] = v.clone();
    }
    json!({"schema_version": 1, "job": job})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_peoples_tokens_and_roles_are_enforced_on_every_route() -> anyhow::Result<()> {
    // Steps slow enough for a long job to be cancelled while it runs.
    let (mut farm, standby) = guarded_farm("people", Vec::new()).await?;
    let urls = farm.scheduler_urls();

    // The admin makes three tokens with the command line; only an admin may.
    let ann_token = create_token(&farm, "ann", "artist")?;
    let bo_token = create_token(&farm, "bo", "artist")?;
    let lee_token = create_token(&farm, "lee", "lead")?;
    let out = vnfarm(&farm.url(""), ADMIN_TOKEN, &["tokens", "list"])?;
    let listing = String::from_utf8(out.stdout)?;
    for (name, role) in [("ann", "artist"), ("bo", "artist"), ("lee", "lead")] {
        ensure!(
            listing
                .lines()
                .any(|l| l.starts_with(name) && l.contains(role) && l.contains("live")),
            "{listing}"
        );
    }
    ensure!(
        !listing.contains(&ann_token[7..]),
        "a listing never shows a token"
    );
    let again = vnfarm(
        &farm.url(""),
        ADMIN_TOKEN,
        &["tokens", "create", "ann", "--role", "admin"],
    )?;
    ensure!(
        !again.status.success()
            && String::from_utf8_lossy(&again.stderr).contains("already has a token"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    let [ann, bo, lee] = [&ann_token, &bo_token, &lee_token].map(|t| Person::new(&urls[0], t));
    let (ann, bo, lee) = (ann?, bo?, lee?);
    // The standby read the same tokens from the stream.
    let bo_standby = Person::new(&urls[standby], &bo_token)?;
    wait_for("the standby to take bo's token", FINISH, || async {
        let (status, _) = bo_standby.get("/v1/workers").await.ok()?;
        (status == StatusCode::OK).then_some(())
    })
    .await?;

    // Ann's jobs: one that runs, one that waits for a checkpoint no worker has (only the model
    // catalogue: a name that exists, so it is accepted; it stays in the scheduler's hands, and its
    // `cancelled` is the scheduler's), one pipeline.
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../worker/models/fixtures/sdxl/lora/kohya.safetensors");
    vnfarm_storage::Catalogue::new(farm.storage.clone())
        .push(
            &fixture,
            vnfarm_proto::ModelFileRole::Checkpoint,
            Some("catalogue-only"),
        )
        .await?;
    let done = ann.submit(&generate("ann's", json!({}))).await?;
    let waiting = ann
        .submit(&generate(
            "ann's waiting",
            json!({"checkpoint": "catalogue-only"}),
        ))
        .await?;
    let pipeline = ann
        .submit(&json!({"schema_version": 1, "job": {"kind": "pipeline",
            "base": {"prompt": "ann's base", "width": 256, "height": 256, "steps": 2},
            "edits": [{"instruction": "smile", "steps": 2}]}}))
        .await?;
    let finished = ann.wait_finished(&done).await?;
    ensure!(finished.state == JobState::Completed, "{finished:?}");
    ensure!(finished.owner == "ann", "{finished:?}");
    let whole = ann.wait_finished(&pipeline).await?;
    ensure!(whole.state == JobState::Completed, "{whole:?}");
    for child in &whole.children {
        let child = ann.job(&child.to_string()).await?;
        ensure!(
            child.owner == "ann",
            "a pipeline's jobs are its owner's: {child:?}"
        );
    }

    // Bo, another artist, sees none of it and may touch none of it; each refusal names what is
    // missing.
    let mut ann_jobs = vec![done.clone(), waiting.clone(), pipeline.clone()];
    ann_jobs.extend(whole.children.iter().map(ToString::to_string));
    ensure!(bo.listed().await?.is_empty(), "bo lists none of ann's jobs");
    for id in [&done, &waiting] {
        refused(
            &bo.get(&format!("/v1/jobs/{id}")).await?,
            StatusCode::FORBIDDEN,
            "`see_all` (role lead or admin); bo is an artist",
        )?;
        refused(
            &bo.get(&format!("/v1/jobs/{id}/events")).await?,
            StatusCode::FORBIDDEN,
            "see_all",
        )?;
        refused(
            &bo.post(&format!("/v1/jobs/{id}/cancel"), None).await?,
            StatusCode::FORBIDDEN,
            "`cancel_any` (role lead or admin)",
        )?;
    }
    refused(
        &bo.get(&format!("/v1/jobs/{done}/outputs/0")).await?,
        StatusCode::FORBIDDEN,
        "see_all",
    )?;
    for answer in [
        bo.get("/v1/tokens").await?,
        bo.post("/v1/tokens", Some(&json!({"name": "eve", "role": "admin"})))
            .await?,
        bo.post("/v1/tokens/ann/revoke", None).await?,
        // A lead is not an admin either.
        lee.post("/v1/tokens", Some(&json!({"name": "eve", "role": "admin"})))
            .await?,
    ] {
        refused(&answer, StatusCode::FORBIDDEN, "`tokens` (role admin)")?;
    }
    // What an artist may do, bo does: read the farm, upload, submit, follow his own job.
    for path in ["/v1/workers", "/v1/schema", "/v1/openapi.json", "/metrics"] {
        let (status, _) = bo.get(path).await?;
        ensure!(status == StatusCode::OK, "bo GET {path}: {status}");
    }
    let upload = bo
        .http
        .post(format!("{}/v1/uploads", bo.base))
        .header("content-type", "image/png")
        .body(png_bytes(64, 64, 3))
        .send()
        .await?;
    ensure!(
        upload.status() == StatusCode::CREATED,
        "{}",
        upload.status()
    );
    let bos = bo.submit(&generate("bo's", json!({}))).await?;
    let bos_job = bo.wait_finished(&bos).await?;
    ensure!(
        bos_job.owner == "bo" && bos_job.state == JobState::Completed,
        "{bos_job:?}"
    );
    ensure!(
        bo.listed().await? == [bos.clone()],
        "bo lists his own job only"
    );
    let (status, _) = bo.get(&format!("/v1/jobs/{bos}/outputs/0")).await?;
    ensure!(status == StatusCode::OK, "bo reads his own image: {status}");
    // The all-jobs stream carries bo's own jobs only.
    let events = bo.events_until(&bos).await?;
    ensure!(
        events.iter().all(|e| e["job_id"] == bos.as_str()),
        "bo's event stream shows another's job: {events:?}"
    );
    let lees_events = lee.events_until(&bos).await?;
    ensure!(
        lees_events.iter().any(|e| e["job_id"] == done.as_str()),
        "a lead's stream shows everyone's jobs"
    );

    // The lead sees everyone's and cancels ann's; the cancel names him.
    let listed = lee.listed().await?;
    for id in ann_jobs.iter().chain([&bos]) {
        ensure!(listed.contains(id), "the lead lists {id}: {listed:?}");
    }
    ensure!(lee.job(&waiting).await?.owner == "ann");
    let (status, body) = lee
        .post(&format!("/v1/jobs/{waiting}/cancel"), None)
        .await?;
    ensure!(status == StatusCode::ACCEPTED, "{status} {body}");
    let cancelled = ann.wait_finished(&waiting).await?;
    ensure!(cancelled.state == JobState::Cancelled, "{cancelled:?}");
    let response = ann
        .http
        .get(format!("{}/v1/jobs/{waiting}/events", ann.base))
        .send()
        .await?;
    let history: Vec<Value> = sse::json(response.bytes_stream())
        .take(10)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let event = history
        .iter()
        .find(|e| e["event"] == "cancelled")
        .with_context(|| format!("no cancelled event: {history:?}"))?;
    ensure!(event["by"] == "lee", "{event}");
    ensure!(
        history[0]["owner"] == "ann",
        "the queued event names the owner: {}",
        history[0]
    );
    ensure!(
        cancelled.cancelled_by.as_deref() == Some("lee"),
        "{cancelled:?}"
    );
    // A job already on its worker: the worker writes `cancelled`, and who asked is on the job, on
    // the standby too.
    let long = ann
        .submit(&generate("ann's long", json!({"steps": 150})))
        .await?;
    wait_for("ann's long job to run", FINISH, || async {
        let job = ann.job(&long).await.ok()?;
        (job.state == JobState::Running).then_some(())
    })
    .await?;
    let (status, body) = lee.post(&format!("/v1/jobs/{long}/cancel"), None).await?;
    ensure!(status == StatusCode::ACCEPTED, "{status} {body}");
    let stopped = ann.wait_finished(&long).await?;
    ensure!(
        stopped.state == JobState::Cancelled && stopped.cancelled_by.as_deref() == Some("lee"),
        "{stopped:?}"
    );
    let lee_standby = Person::new(&urls[standby], &lee_token)?;
    let seen = lee_standby.job(&long).await?;
    ensure!(seen.cancelled_by.as_deref() == Some("lee"), "{seen:?}");
    // Ann may cancel her own (finished: 409, not 403).
    let (status, _) = ann.post(&format!("/v1/jobs/{done}/cancel"), None).await?;
    ensure!(status == StatusCode::CONFLICT, "{status}");

    // The CLI shows owners.
    let out = vnfarm(&farm.url(""), &lee_token, &["list"])?;
    let listing = String::from_utf8(out.stdout)?;
    ensure!(
        listing.lines().next().unwrap_or("").contains("OWNER"),
        "{listing}"
    );
    ensure!(
        listing
            .lines()
            .any(|l| l.starts_with(&done) && l.contains(" ann ")),
        "{listing}"
    );

    // Revoke bo: refused at once here, by the standby, and by a scheduler started afterwards.
    let out = vnfarm(&farm.url(""), ADMIN_TOKEN, &["tokens", "revoke", "bo"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    refused(
        &bo.get("/v1/jobs").await?,
        StatusCode::UNAUTHORIZED,
        "revoked",
    )?;
    wait_for(
        "the standby to refuse bo's token",
        Duration::from_secs(5),
        || async {
            let (status, _) = bo_standby.get("/v1/jobs").await.ok()?;
            (status == StatusCode::UNAUTHORIZED).then_some(())
        },
    )
    .await?;
    farm.kill_scheduler_at(0);
    farm.start_scheduler_at(0).await?;
    refused(
        &bo.get("/v1/jobs").await?,
        StatusCode::UNAUTHORIZED,
        "revoked",
    )?;
    ensure!(
        ann.job(&done).await?.owner == "ann",
        "ann's token still opens the restarted one"
    );
    let out = vnfarm(&farm.url(""), ADMIN_TOKEN, &["tokens", "list"])?;
    let listing = String::from_utf8(out.stdout)?;
    ensure!(
        listing
            .lines()
            .any(|l| l.starts_with("bo ") && l.contains("revoked")),
        "{listing}"
    );
    // The stream holds each token's SHA-256 and never the token.
    let log = vnfarm_tests::stream::read_all(&farm).await?;
    ensure!(log.undecodable == 0, "every message of the stream decodes");
    let made: Vec<(&str, &str)> = log
        .people
        .iter()
        .filter_map(|e| match &e.kind {
            PersonEventKind::TokenCreated { token_sha256, .. } => {
                Some((e.person.as_str(), token_sha256.as_str()))
            }
            _ => None,
        })
        .collect();
    let digest = |t: &str| hex::encode(Sha256::digest(t.as_bytes()));
    ensure!(
        made == [
            ("ann", digest(&ann_token).as_str()),
            ("bo", digest(&bo_token).as_str()),
            ("lee", digest(&lee_token).as_str()),
        ],
        "{made:?}"
    );
    let rest: Vec<(&str, String)> = log
        .people
        .iter()
        .filter_map(|e| match &e.kind {
            PersonEventKind::TokenCreated { .. } => None,
            PersonEventKind::TokenRevoked { by } => {
                Some((e.person.as_str(), format!("revoked by {by}")))
            }
            PersonEventKind::CancelRequested { job_id } => {
                Some((e.person.as_str(), format!("cancel {job_id}")))
            }
            _ => None,
        })
        .collect();
    ensure!(
        rest == [
            ("lee", format!("cancel {long}")),
            ("bo", "revoked by admin".to_owned())
        ],
        "{rest:?}"
    );
    let text = format!("{:?}", log.people);
    for token in [&ann_token, &bo_token, &lee_token] {
        ensure!(!text.contains(&token[7..]), "a token in the stream");
    }

    // The configuration's token keeps working as the admin's, and its jobs are admin's.
    let admin = Person::new(&urls[standby], ADMIN_TOKEN)?;
    let admins = admin.submit(&generate("the admin's", json!({}))).await?;
    ensure!(admin.wait_finished(&admins).await?.owner == "admin");
    Ok(())
}
