//! The HTTP API (for the web front end and the `vnfarm` command line).
//!
//! | method and path | what |
//! | --- | --- |
//! | `POST /v1/jobs` | submit a [`Submission`]; 201 with `{"job_id"}` (200 for an idempotent repeat) |
//! | `GET /v1/jobs?state=&kind=&limit=` | list jobs, newest first |
//! | `GET /v1/jobs/{id}` | one job |
//! | `POST /v1/jobs/{id}/cancel` | cancel a job or a pipeline |
//! | `GET /v1/jobs/{id}/events` | Server-Sent Events of one job (history, then live; ends after a final event) |
//! | `GET /v1/events` | Server-Sent Events of every job (live; `Last-Event-ID` resumes) |
//! | `GET /v1/jobs/{id}/outputs/{n}` | output image `n` (PNG) |
//! | `GET /v1/workers` | known workers and their last heartbeat |
//! | `GET /v1/schema` | JSON Schema of a submission |
//! | `GET /metrics`, `GET /healthz` | Prometheus metrics; readiness |
//!
//! Errors are JSON: `{"error": {"field": "job.width", "message": "..."}}`. When a token is configured,
//! `/v1/*` requires `Authorization: Bearer <token>`.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::topology::{manifest_key, output_key};
use vnfarm_proto::{JobId, MAX_MESSAGE_BYTES, Manifest, Submission, decode_json};
use vnfarm_storage::StorageError;

use crate::intake::AcceptError;
use crate::registry::JobState;
use crate::scheduler::{CancelError, Scheduler};

pub fn router(scheduler: Scheduler) -> Router {
    let v1 = Router::new()
        .route("/jobs", post(submit).get(list_jobs))
        .route("/jobs/{id}", get(get_job))
        .route("/jobs/{id}/cancel", post(cancel))
        .route("/jobs/{id}/events", get(job_events))
        .route("/jobs/{id}/outputs/{n}", get(output))
        .route("/events", get(all_events))
        .route("/workers", get(workers))
        .route("/schema", get(schema))
        .layer(middleware::from_fn_with_state(scheduler.clone(), gate))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_MESSAGE_BYTES));
    Router::new()
        .nest("/v1", v1)
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(scheduler)
}

fn error(status: StatusCode, field: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"field": field, "message": message.into()}})),
    )
        .into_response()
}

/// Token check, and 503 until the event stream has been replayed.
async fn gate(State(s): State<Scheduler>, request: Request, next: Next) -> Response {
    if let Some(token) = &s.config.api_token {
        let expected = format!("Bearer {token}");
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(expected.as_str()) {
            return error(
                StatusCode::UNAUTHORIZED,
                "authorization",
                "a valid bearer token is required",
            );
        }
    }
    if !s.is_ready() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            ".",
            "the scheduler is replaying its event stream; retry shortly",
        );
    }
    next.run(request).await
}

async fn submit(State(s): State<Scheduler>, body: Bytes) -> Response {
    let submission: Submission = match decode_json(&body) {
        Ok(sub) => sub,
        Err(e) => return error(StatusCode::UNPROCESSABLE_ENTITY, &e.field, e.message),
    };
    match s.accept(submission).await {
        Ok(submitted) => {
            let Some(accepted) = s.accepted(submitted.clone(), Duration::from_secs(10)).await
            else {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ".",
                    format!(
                        "{submitted:?} was queued but is not visible yet; retry with the same idempotency key"
                    ),
                );
            };
            let (id, created) = (accepted.job_id, accepted.created);
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (
                status,
                [(header::LOCATION, format!("/v1/jobs/{id}"))],
                Json(json!({"job_id": id})),
            )
                .into_response()
        }
        Err(AcceptError::Invalid(e)) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, &e.field, e.message)
        }
        Err(AcceptError::Unavailable(m)) => error(StatusCode::SERVICE_UNAVAILABLE, ".", m),
    }
}

// The error is returned straight to axum as the response; boxing it would gain nothing.
#[allow(clippy::result_large_err)]
fn parse_id(id: &str) -> Result<JobId, Response> {
    id.parse().map_err(|_| {
        error(
            StatusCode::BAD_REQUEST,
            "id",
            format!("{id:?} is not a job id"),
        )
    })
}

async fn get_job(State(s): State<Scheduler>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    {
        let reg = s.registry();
        if let Some(job) = reg.job(id) {
            return Json(reg.view(job, s.heartbeat_timeout())).into_response();
        }
    }
    archived_job(&s, id).await
}

/// A job the registry no longer holds (finished before the retention horizon): answered from its
/// manifest in storage when it completed; a failed or cancelled one that old is not known any more.
async fn archived_job(s: &Scheduler, id: JobId) -> Response {
    let not_found = || {
        error(
            StatusCode::NOT_FOUND,
            "id",
            format!(
                "job {id} not found (finished jobs past the retention are answered only when they completed)"
            ),
        )
    };
    let key = manifest_key(id);
    let bytes = match s.storage.get(&key).await {
        Ok(bytes) => bytes,
        Err(StorageError::NotFound { .. }) => return not_found(),
        Err(e) => {
            s.metrics.storage_error("get", &e);
            return error(StatusCode::SERVICE_UNAVAILABLE, ".", e.to_string());
        }
    };
    let Ok(manifest) = serde_json::from_slice::<Manifest>(&bytes) else {
        return not_found();
    };
    Json(json!({
        "id": id,
        "kind": manifest.task.kind_name(),
        "state": "completed",
        "archived": true,
        "worker": manifest.worker,
        "attempts": manifest.attempt,
        "outputs": manifest.outputs.iter().map(|o| &o.key).collect::<Vec<_>>(),
        "manifest": key,
        "updated_at": manifest.finished_at,
        "task": manifest.task,
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    kind: Option<String>,
    limit: Option<usize>,
    /// Include jobs that belong to a pipeline (default: only top-level jobs).
    #[serde(default)]
    all: bool,
}

async fn list_jobs(State(s): State<Scheduler>, Query(q): Query<ListQuery>) -> Response {
    let state = match q.state.as_deref().map(|st| JobState::parse(st).ok_or(st)) {
        Some(Err(st)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "state",
                format!("unknown state {st:?}"),
            );
        }
        Some(Ok(st)) => Some(st),
        None => None,
    };
    let limit = q.limit.unwrap_or(100).min(1000);
    let timeout = s.heartbeat_timeout();
    let reg = s.registry();
    let jobs: Vec<_> = reg
        .jobs_newest_first()
        .filter(|j| q.all || j.parent().is_none())
        .filter(|j| state.is_none_or(|st| j.state() == st))
        .filter(|j| q.kind.as_deref().is_none_or(|k| j.kind() == k))
        .take(limit)
        .map(|j| reg.view(j, timeout))
        .collect();
    Json(json!({"jobs": jobs})).into_response()
}

async fn cancel(State(s): State<Scheduler>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    match s.cancel(id).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(json!({"job_id": id, "cancel": "requested"})),
        )
            .into_response(),
        Err(e @ CancelError::NotFound(_)) => error(StatusCode::NOT_FOUND, "id", e.to_string()),
        Err(e @ CancelError::Finished(..)) => error(StatusCode::CONFLICT, "id", e.to_string()),
        Err(e @ CancelError::Unavailable(_)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, ".", e.to_string())
        }
    }
}

fn sse_event(ev: &SequencedEvent) -> SseEvent {
    SseEvent::default()
        .id(ev.seq.to_string())
        .event(ev.event.kind.name())
        .data(serde_json::to_string(ev).expect("events serialize to JSON"))
}

fn resume_from(headers: &HeaderMap, after: Option<u64>) -> Option<u64> {
    after.or_else(|| {
        headers
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    /// Resume after this sequence number (same as the `Last-Event-ID` header).
    after: Option<u64>,
}

/// One job's events: its history after the resume point, then live events until a final one.
async fn job_events(
    State(s): State<Scheduler>,
    Path(id): Path<String>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let after = resume_from(&headers, q.after);
    // Subscribe before reading the history, so nothing falls between the two.
    let live = s.events.subscribe();
    let (history, finished) = {
        let reg = s.registry();
        let Some(job) = reg.job(id) else {
            return error(StatusCode::NOT_FOUND, "id", format!("job {id} not found"));
        };
        let history: Vec<SequencedEvent> = job
            .events()
            .into_iter()
            .filter(|e| after.is_none_or(|a| e.seq > a))
            .collect();
        (history, job.state().is_terminal())
    };
    let scope = if finished {
        Scope::Finished
    } else {
        Scope::Job(id)
    };
    event_stream(&s, live, history, after, scope)
}

/// Every job's events, live; with a resume point, the recent history after it first.
async fn all_events(
    State(s): State<Scheduler>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Response {
    let after = resume_from(&headers, q.after);
    let live = s.events.subscribe();
    let history: Vec<SequencedEvent> = match after {
        Some(a) => s.registry().recent_after(a),
        None => Vec::new(),
    };
    event_stream(&s, live, history, after, Scope::All)
}

/// Which live events a stream carries after its history.
#[derive(Clone, Copy)]
enum Scope {
    /// Every job's, until the client leaves.
    All,
    /// One running job's, until its final event.
    Job(JobId),
    /// None: the job was already final, the history is everything.
    Finished,
}

/// Server-Sent Events: `history`, then the live events of `scope`, never one at or before the last
/// sequence number sent. Ends when the client leaves, the scheduler shuts down, a job's stream has
/// sent the job's final event, or the client lags behind the broadcast (it resumes with
/// Last-Event-ID).
fn event_stream(
    s: &Scheduler,
    mut live: tokio::sync::broadcast::Receiver<SequencedEvent>,
    history: Vec<SequencedEvent>,
    after: Option<u64>,
    scope: Scope,
) -> Response {
    let metrics = s.metrics.clone();
    let shutdown = s.shutdown.clone();
    let stream = async_stream(move |tx| async move {
        metrics.sse_clients.inc();
        let mut last = after;
        let mut open = true;
        for ev in &history {
            last = Some(ev.seq);
            open = tx.send(sse_event(ev)).await.is_ok();
            if !open {
                break;
            }
        }
        while open && !matches!(scope, Scope::Finished) {
            let next = tokio::select! { _ = shutdown.cancelled() => break, n = live.recv() => n };
            let ev = match next {
                Ok(ev) => ev,
                Err(RecvError::Lagged(_)) | Err(RecvError::Closed) => break,
            };
            let ends_job = match scope {
                Scope::Job(id) if ev.event.job_id != id => continue,
                Scope::Job(_) => ev.event.kind.is_terminal(),
                Scope::All | Scope::Finished => false,
            };
            if last.is_some_and(|l| ev.seq <= l) {
                continue;
            }
            last = Some(ev.seq);
            open = tx.send(sse_event(&ev)).await.is_ok() && !ends_job;
        }
        metrics.sse_clients.dec();
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A stream fed by a task through a small channel.
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<SseEvent, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<SseEvent>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok(ev), rx))
    })
}

async fn output(State(s): State<Scheduler>, Path((id, n)): Path<(String, u32)>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    match s.storage.get(&output_key(id, n)).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, "image/png")], bytes).into_response(),
        Err(StorageError::NotFound { key }) => {
            error(StatusCode::NOT_FOUND, "n", format!("{key} not found"))
        }
        Err(e) => {
            s.metrics.storage_error("get", &e);
            error(StatusCode::SERVICE_UNAVAILABLE, ".", e.to_string())
        }
    }
}

async fn workers(State(s): State<Scheduler>) -> Response {
    let timeout = s.heartbeat_timeout();
    let reg = s.registry();
    let workers: Vec<_> = reg
        .workers()
        .map(|w| {
            json!({
                "id": w.id(),
                "alive": w.alive(timeout),
                "state": w.state_name(timeout),
                "assigned": w.assigned().collect::<Vec<_>>(),
                "heartbeat": w.last_heartbeat().map(|(_, hb)| hb),
                "seconds_since_heartbeat": w.last_heartbeat().map(|(at, _)| at.elapsed().as_secs_f64()),
            })
        })
        .collect();
    Json(json!({"workers": workers})).into_response()
}

async fn schema() -> Response {
    Json(vnfarm_proto::submission_schema()).into_response()
}

async fn metrics(State(s): State<Scheduler>) -> Response {
    s.update_gauges();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(s): State<Scheduler>) -> Response {
    let ready = s.is_ready();
    let connected = s.metrics.amqp_connected.get() == 1;
    let status = if ready && connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let role = if s.is_active() { "active" } else { "standby" };
    (
        status,
        Json(json!({"ready": ready, "amqp_connected": connected, "role": role})),
    )
        .into_response()
}
