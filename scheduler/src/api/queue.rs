//! The queue's routes: its state (`GET /v1/queue`), pausing and resuming the farm or one person's
//! work, and moving a waiting job to the front (DESIGN §7a, "Fair share and queue control").

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::Utc;
use vnfarm_proto::Permission;
use vnfarm_proto::http::{JobView, PauseView, PersonQueue, QueueView};
use vnfarm_proto::people::{ADMIN, check_name};

use super::Api;
use super::auth::Caller;
use super::error::ApiError;
use super::extract::Path;
use super::jobs::{held_in_words, parse_id, view};
use crate::queue::{QueueError, Scope};
use crate::registry::Pause;

fn answer(e: QueueError) -> ApiError {
    match e {
        QueueError::NotFound(_) => ApiError::not_found("id", e.to_string()),
        QueueError::NotWaiting(..) => ApiError::new(StatusCode::CONFLICT, "id", e.to_string()),
        QueueError::Unavailable(_) => ApiError::unavailable(e.to_string()),
    }
}

fn pause_view(p: &Pause) -> PauseView {
    PauseView {
        by: p.by.clone(),
        at: p.at,
    }
}

/// The queue as this scheduler holds it, as `caller` may see it: everyone's share for a role that
/// sees all jobs, one's own otherwise.
fn queue_view(api: &Api, caller: &Caller) -> QueueView {
    let sees_all = caller.role().grants(Permission::SeeAll);
    let reg = api.scheduler.registry();
    let dispatch = &api.scheduler.config().dispatch;
    let today = Utc::now().date_naive();
    let shares = reg.shares();
    let people = reg
        .sharers(today)
        .into_iter()
        .filter(|name| sees_all || name == caller.name())
        .map(|name| {
            let limits = dispatch.limits_of(&name);
            PersonQueue {
                waiting: reg.waiting_of(&name),
                running: reg.running_of(&name),
                gpu_minutes_today: shares.used_on(&name, today) / 60.0,
                max_running: limits.max_running,
                daily_gpu_minutes: limits.daily_gpu_minutes,
                paused: shares.paused().get(&name).map(pause_view),
                held: reg.held(&name, dispatch, today).map(|h| held_in_words(&h)),
                name,
            }
        })
        .collect();
    QueueView {
        you: caller.name().to_owned(),
        role: caller.role(),
        farm_paused: shares.farm_paused().map(pause_view),
        people,
    }
}

pub async fn show(State(api): State<Api>, Extension(caller): Extension<Caller>) -> Json<QueueView> {
    Json(queue_view(&api, &caller))
}

async fn set(
    api: Api,
    caller: Caller,
    scope: Scope,
    pause: bool,
) -> Result<Json<QueueView>, ApiError> {
    api.scheduler
        .set_paused(scope.clone(), pause, caller.name())
        .await
        .map_err(answer)?;
    let what = if pause { "paused" } else { "resumed" };
    match &scope {
        Scope::Farm => tracing::info!(by = caller.name(), "the farm {what}"),
        Scope::Person(whose) => tracing::info!(person = %whose, by = caller.name(), "work {what}"),
    }
    Ok(Json(queue_view(&api, &caller)))
}

pub async fn pause_farm(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<QueueView>, ApiError> {
    set(api, caller, Scope::Farm, true).await
}

pub async fn resume_farm(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<QueueView>, ApiError> {
    set(api, caller, Scope::Farm, false).await
}

/// A person's name from the path: a person's, or `admin` (the configuration's token and the
/// intake queue submit as it).
fn person(name: String) -> Result<Scope, ApiError> {
    if name != ADMIN {
        check_name(&name).map_err(|m| ApiError::invalid("name", m))?;
    }
    Ok(Scope::Person(name))
}

pub async fn pause_person(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<QueueView>, ApiError> {
    set(api, caller, person(name)?, true).await
}

pub async fn resume_person(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<QueueView>, ApiError> {
    set(api, caller, person(name)?, false).await
}

pub async fn front(
    State(api): State<Api>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_id(&id)?;
    api.scheduler
        .move_to_front(id, caller.name())
        .await
        .map_err(answer)?;
    tracing::info!(job_id = %id, by = caller.name(), "moved to the front");
    let reg = api.scheduler.registry();
    let job = reg
        .job(id)
        .ok_or_else(|| ApiError::not_found("id", format!("no job {id}")))?;
    Ok(Json(view(&reg, job, api.waits())))
}
