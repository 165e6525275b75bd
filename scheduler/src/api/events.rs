//! Server-Sent Events: one job's (its history, then live until its final event) and every job's
//! (live; with a resume point, the recent history after it first). Each event's `id` is its
//! sequence number in the event stream, so a client that lost its connection resumes with
//! `Last-Event-ID` (or `?after=`) and misses nothing the registry still holds.

use std::convert::Infallible;

use axum::Extension;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use schemars::JsonSchema;
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;
use vnfarm_proto::event::SequencedEvent;
use vnfarm_proto::{JobId, Permission};

use super::Api;
use super::auth::Caller;
use super::error::ApiError;
use super::extract::{Path, Query};
use super::jobs::parse_id;
use crate::scheduler::Scheduler;

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

/// Resume point of an event stream.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamQuery {
    /// Resume after this sequence number (same as the `Last-Event-ID` header).
    pub after: Option<u64>,
}

/// One job's events: its history after the resume point, then live events until a final one.
pub async fn job_events(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let s = &api.scheduler;
    let id = parse_id(&id)?;
    let after = resume_from(&headers, q.after);
    // Subscribe before reading the history, so nothing falls between the two.
    let live = s.subscribe();
    let (history, finished) = {
        let reg = s.registry();
        let Some(job) = reg.job(id) else {
            return Err(ApiError::not_found("id", format!("job {id} not found")));
        };
        caller.may(
            Permission::Read,
            Permission::SeeAll,
            job.owner(),
            &format!("reading job {id}'s events"),
        )?;
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
    Ok(event_stream(s, live, history, after, scope))
}

/// Every job's events, live; with a resume point, the recent history after it first. A caller who
/// may not see every job (an artist) gets their own jobs' events only.
pub async fn all_events(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Response {
    let s = &api.scheduler;
    let after = resume_from(&headers, q.after);
    let live = s.subscribe();
    let owner = (!caller.role().grants(Permission::SeeAll)).then(|| caller.name().to_owned());
    let history: Vec<SequencedEvent> = match after {
        Some(a) => {
            let reg = s.registry();
            reg.recent_after(a)
                .into_iter()
                .filter(|ev| owner.as_deref().is_none_or(|o| owns(&reg, ev, o)))
                .collect()
        }
        None => Vec::new(),
    };
    let scope = match owner {
        Some(owner) => Scope::Owner(owner),
        None => Scope::All,
    };
    event_stream(s, live, history, after, scope)
}

/// Whether the event's job is `owner`'s (a job the registry no longer holds is no one's).
fn owns(reg: &crate::registry::Registry, ev: &SequencedEvent, owner: &str) -> bool {
    reg.job(ev.event.job_id).is_some_and(|j| j.owner() == owner)
}

/// Which live events a stream carries after its history.
#[derive(Clone)]
enum Scope {
    /// Every job's, until the client leaves.
    All,
    /// The jobs of this person, until the client leaves.
    Owner(String),
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
    let metrics = s.metrics().clone();
    let shutdown = s.shutdown().clone();
    let scheduler = s.clone();
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
            let ends_job = match &scope {
                Scope::Job(id) if ev.event.job_id != *id => continue,
                Scope::Job(_) => ev.event.kind.is_terminal(),
                Scope::Owner(owner) if !owns(&scheduler.registry(), &ev, owner) => continue,
                Scope::All | Scope::Owner(_) | Scope::Finished => false,
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
