//! Jobs as resources: submit, list, read, cancel, and a job's images (the original route for
//! command-line clients, and signed links for browsers). A job is shown as proto's [`JobView`],
//! built here from the registry's record, with its [`Blocker`] put in words.
//!
//! Every job has an owner, the person who submitted it. An artist lists, reads and cancels only
//! their own jobs (listing simply leaves the others out; naming another's job answers 403); a
//! lead or an admin, everyone's. An archived job (answered from its manifest) records no owner,
//! so reading it takes `see_all`.

use std::time::Duration;

use chrono::{DateTime, Utc};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use vnfarm_proto::http::{ArchivedJobView, Failure, JobState, JobView, Submitted};
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{JobId, Manifest, Permission, Submission, WorkerId, decode_json};
use vnfarm_storage::StorageError;

use super::Api;
use super::auth::Caller;
use super::error::ApiError;
use super::extract::{Body, Path, Query};
use super::files::ImageLinks;
use crate::config::DispatchConfig;
use crate::intake::AcceptError;
use crate::registry::{Blocker, Held, JobRecord, Registry};
use crate::scheduler::CancelError;

/// A job the registry holds, with links to its images.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Job {
    #[serde(flatten)]
    pub view: JobView,
    /// One per output, in order: signed URLs a browser may fetch without the token.
    pub images: Vec<ImageLinks>,
}

/// A completed job past the registry's retention, answered from its manifest in storage, with
/// links to its images.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ArchivedJob {
    #[serde(flatten)]
    pub view: ArchivedJobView,
    pub images: Vec<ImageLinks>,
}

/// `GET /v1/jobs/{id}`: a job the registry holds, or an archived one.
// Built once per request and encoded at once: the size of its variants does not matter.
#[expect(clippy::large_enum_variant)]
#[derive(Debug, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum JobResource {
    Live(Job),
    Archived(ArchivedJob),
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct JobList {
    /// Newest first.
    pub jobs: Vec<Job>,
}

/// The answer to a cancel request: the job stops between steps and reports `cancelled`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CancelRequested {
    pub job_id: JobId,
    /// Always `requested`.
    pub cancel: &'static str,
}

/// `GET /v1/jobs` parameters.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only jobs in this state (`queued`, `dispatched`, `running`, `retrying`, `completed`,
    /// `failed`, `cancelled`).
    pub state: Option<String>,
    /// Only jobs of this kind (`generate`, `edit`, `upscale`, `pipeline`).
    pub kind: Option<String>,
    /// At most this many (default 100, at most 1000).
    pub limit: Option<usize>,
    /// Include the jobs of pipelines (default: only top-level jobs).
    #[serde(default)]
    pub all: bool,
}

/// A job as the API shows it, with why it is not moving in words and its estimate as last made
/// (the caller makes them again first when they are due: `refresh_estimates`).
pub fn view(reg: &Registry, job: &JobRecord, waits: Waits<'_>) -> JobView {
    let estimate = reg.estimate(job);
    JobView {
        id: job.id(),
        kind: job.kind().to_owned(),
        state: job.state(),
        priority: job.priority(),
        parent: job.parent(),
        children: job.children().to_vec(),
        created_at: job.created_at(),
        updated_at: job.updated_at(),
        owner: job.owner().to_owned(),
        cancelled_by: job.cancelled_by().map(str::to_owned),
        moved_by: job.moved_by().map(str::to_owned),
        worker: job.worker().cloned(),
        dispatches: job.dispatches(),
        attempts: job.attempts(),
        progress: job.progress().cloned(),
        outputs: job.outputs().to_vec(),
        manifest: job.manifest().map(str::to_owned),
        failure: job.failure().cloned(),
        waiting_for: reg
            .blocker(job, waits.heartbeat_timeout, waits.dispatch)
            .map(|b| waiting_for(&b, job.failure(), waits.checkpoint_deadline(job))),
        estimate: estimate.clone().and_then(Result::ok),
        no_estimate: estimate.and_then(Result::err),
        submission: job.submission().cloned(),
    }
}

/// The scheduler's settings a job's view puts in words.
#[derive(Clone, Copy, Debug)]
pub struct Waits<'a> {
    pub heartbeat_timeout: Duration,
    /// [`crate::config::Config::checkpoint_wait_s`].
    pub checkpoint_wait_s: u64,
    /// The fair share limits.
    pub dispatch: &'a DispatchConfig,
}

impl Api {
    /// What a job's view puts in words, from this scheduler's configuration.
    pub fn waits(&self) -> Waits<'_> {
        Waits {
            heartbeat_timeout: self.scheduler.heartbeat_timeout(),
            checkpoint_wait_s: self.scheduler.config().checkpoint_wait_s,
            dispatch: &self.scheduler.config().dispatch,
        }
    }
}

impl Waits<'_> {
    /// When a job that waits for a gone checkpoint fails, if it does.
    fn checkpoint_deadline(self, job: &JobRecord) -> Option<DateTime<Utc>> {
        (self.checkpoint_wait_s > 0).then(|| {
            job.updated_at()
                + chrono::Duration::seconds(self.checkpoint_wait_s.min(i64::MAX as u64) as i64)
        })
    }
}

/// A blocker in words, for people reading a job; `checkpoint_deadline` is when it fails should no
/// worker of its checkpoint come.
fn waiting_for(
    blocker: &Blocker,
    failure: Option<&Failure>,
    checkpoint_deadline: Option<DateTime<Utc>>,
) -> String {
    match blocker {
        Blocker::Retrying => format!(
            "a transient failure ({}); it runs again",
            failure.map_or("", |f| f.message.as_str())
        ),
        Blocker::Starting(Some(w)) => format!("sent to worker {w}; waiting for it to start"),
        Blocker::Starting(None) => "sent to a worker; waiting for it to start".into(),
        Blocker::PipelineJobs => "its pipeline's jobs to finish".into(),
        Blocker::Cancelling => "cancelling".into(),
        Blocker::BeingDispatched => "being dispatched".into(),
        Blocker::Inputs(jobs) => format!(
            "input job {} to complete",
            jobs.iter()
                .map(JobId::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Blocker::NoWorker(route)
            if let (Some(_), Some(until)) = (&route.checkpoint, checkpoint_deadline) =>
        {
            format!(
                "no live worker serves {route}; it runs when one does, and fails at {} if none \
                 has while other workers of its model are up",
                until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            )
        }
        Blocker::NoWorker(route) => {
            format!("no live worker serves {route}; it runs when one does")
        }
        Blocker::Holders(workers) => format!(
            "worker {} to free a slot: it holds this input's encodings (for a while, then any \
             worker)",
            workers
                .iter()
                .map(WorkerId::to_string)
                .collect::<Vec<_>>()
                .join(" or ")
        ),
        Blocker::FreeSlot => "a free worker slot".into(),
        Blocker::Share(held) => held_in_words(held),
    }
}

/// Why a person's work waits, in words.
pub(crate) fn held_in_words(held: &Held) -> String {
    let when = |at: &DateTime<Utc>| at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    match held {
        Held::FarmPaused(p) => format!(
            "the farm to be resumed: {} paused it at {}",
            p.by,
            when(&p.at)
        ),
        Held::Paused(p) => format!(
            "its owner's work to be resumed: {} paused it at {}",
            p.by,
            when(&p.at)
        ),
        Held::AtCap { running, cap } => format!(
            "one of its owner's {running} jobs on workers to finish: a person runs at most {cap} at once"
        ),
        Held::Quota { used_s, quota_s } => format!(
            "tomorrow (00:00 UTC): its owner used {:.0} of their {:.0} GPU minutes for today",
            used_s / 60.0,
            quota_s / 60.0
        ),
    }
}

/// Makes the estimates again when they are due: the queue is copied under the registry's lock,
/// simulated on a blocking thread without it, and stored (DESIGN §5, "Estimates").
async fn refresh_estimates(api: &Api) {
    let work = api
        .scheduler
        .registry()
        .estimates_due(api.waits().heartbeat_timeout);
    let Some(work) = work else { return };
    match tokio::task::spawn_blocking(move || work.make()).await {
        Ok(made) => api.scheduler.registry().store_estimates(made),
        // Given up on after a while by `estimates_due`; the views show the last ones meanwhile.
        Err(e) => tracing::error!(error = %e, "making the estimates failed"),
    }
}

/// A job id from the path, or 400 naming `id`.
pub fn parse_id(id: &str) -> Result<JobId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request("id", format!("{id:?} is not a job id")))
}

pub async fn submit(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let s = &api.scheduler;
    let submission: Submission =
        decode_json(&body).map_err(|e| ApiError::invalid(e.field, e.message))?;
    let submitted = match s.accept(submission, caller.owner()).await {
        Ok(submitted) => submitted,
        Err(AcceptError::Invalid(e)) => return Err(ApiError::invalid(e.field, e.message)),
        Err(AcceptError::Unavailable(m)) => return Err(ApiError::unavailable(m)),
    };
    let Some(accepted) = s.accepted(submitted.clone(), Duration::from_secs(10)).await else {
        return Err(ApiError::unavailable(format!(
            "{submitted:?} was queued but is not visible yet; retry with the same idempotency key"
        )));
    };
    let id = accepted.job_id;
    let status = if accepted.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        [(header::LOCATION, format!("/v1/jobs/{id}"))],
        Json(Submitted { job_id: id }),
    )
        .into_response())
}

pub async fn get_job(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    if api.scheduler.registry().contains(id) {
        refresh_estimates(&api).await;
    }
    let view = {
        let reg = api.scheduler.registry();
        reg.job(id).map(|job| view(&reg, job, api.waits()))
    };
    if let Some(view) = view {
        caller.may(
            Permission::Read,
            Permission::SeeAll,
            &view.owner,
            &format!("reading job {id}"),
        )?;
        let images = api.image_links(&view.outputs);
        return Ok(Json(JobResource::Live(Job { view, images })).into_response());
    }
    let archived = archived_job(&api, id).await?;
    caller.require(
        Permission::SeeAll,
        &format!("reading archived job {id} (its manifest records no owner)"),
    )?;
    Ok(Json(JobResource::Archived(archived)).into_response())
}

/// 403 unless the caller may act on job `id` (`own` on their own, `any` on another's); a job
/// the registry does not hold is anyone's to ask about, and answers as it would (404, archived).
fn check_owner(
    api: &Api,
    caller: &Caller,
    id: JobId,
    (own, any): (Permission, Permission),
    what: &str,
) -> Result<(), ApiError> {
    let owner = api
        .scheduler
        .registry()
        .job(id)
        .map(|j| j.owner().to_owned());
    match owner {
        Some(owner) => caller.may(own, any, &owner, what),
        None => Ok(()),
    }
}

/// A job the registry no longer holds (finished before the retention horizon): answered from its
/// manifest in storage when it completed; a failed or cancelled one that old is not known any more.
async fn archived_job(api: &Api, id: JobId) -> Result<ArchivedJob, ApiError> {
    let not_found = || {
        ApiError::not_found(
            "id",
            format!(
                "job {id} not found (finished jobs past the retention are answered only when they completed)"
            ),
        )
    };
    let key = manifest_key(id);
    let bytes = match api.scheduler.storage().get(&key).await {
        Ok(bytes) => bytes,
        Err(StorageError::NotFound { .. }) => return Err(not_found()),
        Err(e) => {
            api.scheduler.metrics().storage_error("get", &e);
            return Err(ApiError::unavailable(e.to_string()));
        }
    };
    let manifest = serde_json::from_slice::<Manifest>(&bytes).map_err(|_| not_found())?;
    let outputs: Vec<String> = manifest.outputs.iter().map(|o| o.key.clone()).collect();
    Ok(ArchivedJob {
        images: api.image_links(&outputs),
        view: ArchivedJobView {
            id,
            kind: manifest.task.kind_name().to_owned(),
            state: JobState::Completed,
            archived: true,
            worker: manifest.worker,
            attempts: manifest.attempt,
            outputs,
            manifest: key,
            updated_at: manifest.finished_at,
            task: Some(manifest.task),
        },
    })
}

pub async fn list_jobs(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    let state = match q.state.as_deref() {
        Some(st) => Some(
            JobState::parse(st)
                .ok_or_else(|| ApiError::bad_request("state", format!("unknown state {st:?}")))?,
        ),
        None => None,
    };
    const KINDS: [&str; 4] = ["generate", "edit", "upscale", "pipeline"];
    if let Some(kind) = q.kind.as_deref()
        && !KINDS.contains(&kind)
    {
        return Err(ApiError::bad_request(
            "kind",
            format!("unknown kind {kind:?}; one of {}", KINDS.join(", ")),
        ));
    }
    let limit = q.limit.unwrap_or(100).min(1000);
    let waits = api.waits();
    let everyone = caller.role().grants(Permission::SeeAll);
    refresh_estimates(&api).await;
    let views: Vec<JobView> = {
        let reg = api.scheduler.registry();
        let reg = &*reg;
        reg.jobs_newest_first()
            .filter(|j| everyone || j.owner() == caller.name())
            .filter(|j| q.all || j.parent().is_none())
            .filter(|j| state.is_none_or(|st| j.state() == st))
            .filter(|j| q.kind.as_deref().is_none_or(|k| j.kind() == k))
            .take(limit)
            .map(|j| view(reg, j, waits))
            .collect()
    };
    let jobs = views
        .into_iter()
        .map(|view| Job {
            images: api.image_links(&view.outputs),
            view,
        })
        .collect();
    Ok(Json(JobList { jobs }).into_response())
}

pub async fn cancel(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<CancelRequested>), ApiError> {
    let id = parse_id(&id)?;
    check_owner(
        &api,
        &caller,
        id,
        (Permission::CancelOwn, Permission::CancelAny),
        &format!("cancelling job {id}"),
    )?;
    match api.scheduler.cancel(id, caller.name()).await {
        Ok(()) => Ok((
            StatusCode::ACCEPTED,
            Json(CancelRequested {
                job_id: id,
                cancel: "requested",
            }),
        )),
        Err(e @ CancelError::NotFound(_)) => Err(ApiError::not_found("id", e.to_string())),
        Err(e @ CancelError::Finished(..)) => {
            Err(ApiError::new(StatusCode::CONFLICT, "id", e.to_string()))
        }
        Err(e @ CancelError::Unavailable(_)) => Err(ApiError::unavailable(e.to_string())),
    }
}

/// Output image `n` of a job (PNG), for clients that send the token.
pub async fn output(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path((id, n)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let what = format!("reading job {id}'s images");
    if api.scheduler.registry().contains(id) {
        check_owner(
            &api,
            &caller,
            id,
            (Permission::Read, Permission::SeeAll),
            &what,
        )?;
    } else {
        caller.require(
            Permission::SeeAll,
            &format!("{what} (a job past the registry's retention records no owner)"),
        )?;
    }
    let n: u32 = n
        .parse()
        .map_err(|_| ApiError::bad_request("n", format!("{n:?} is not an image index")))?;
    match api.scheduler.storage().get(&output_key(id, n)).await {
        Ok(bytes) => Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response()),
        Err(StorageError::NotFound { key }) => {
            Err(ApiError::not_found("n", format!("{key} not found")))
        }
        Err(e) => {
            api.scheduler.metrics().storage_error("get", &e);
            Err(ApiError::unavailable(e.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::ModelFamily;

    use super::*;
    use crate::registry::Route;

    #[test]
    fn a_blocker_reads_as_what_the_job_waits_for() {
        let route = Route {
            model: ModelFamily::Sdxl,
            checkpoint: Some("novaAnimeXL".into()),
            catalogue: None,
        };
        assert_eq!(
            waiting_for(&Blocker::NoWorker(route.clone()), None, None),
            "no live worker serves sdxl checkpoint novaAnimeXL; it runs when one does"
        );
        let at = "2026-12-03T10:00:00Z".parse().unwrap();
        assert_eq!(
            waiting_for(&Blocker::NoWorker(route), None, Some(at)),
            "no live worker serves sdxl checkpoint novaAnimeXL; it runs when one does, and fails \
             at 2026-12-03T10:00:00Z if none has while other workers of its model are up"
        );
        let any_sdxl = Route {
            model: ModelFamily::Sdxl,
            checkpoint: None,
            catalogue: None,
        };
        assert_eq!(
            waiting_for(&Blocker::NoWorker(any_sdxl), None, Some(at)),
            "no live worker serves sdxl; it runs when one does",
            "only a named checkpoint's wait ends"
        );
        let holders = Blocker::Holders(vec!["a".parse().unwrap(), "b".parse().unwrap()]);
        assert!(
            waiting_for(&holders, None, None).starts_with("worker a or b to free a slot"),
            "{}",
            waiting_for(&holders, None, None)
        );
    }
}
