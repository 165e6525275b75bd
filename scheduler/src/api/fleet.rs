//! `GET /v1/workers`: the fleet as the registry knows it from heartbeats.

use axum::Json;
use axum::extract::State;
use vnfarm_proto::http::{Fleet, Worker};

use super::Api;

pub async fn workers(State(api): State<Api>) -> Json<Fleet> {
    let timeout = api.scheduler.heartbeat_timeout();
    let reg = api.scheduler.registry();
    let workers = reg
        .workers()
        .map(|w| Worker {
            id: w.id().clone(),
            alive: w.alive(timeout),
            state: w.state_name(timeout).to_owned(),
            assigned: w.assigned().collect(),
            heartbeat: w.last_heartbeat().map(|(_, hb)| hb.clone()),
            seconds_since_heartbeat: w.last_heartbeat().map(|(at, _)| at.elapsed().as_secs_f64()),
        })
        .collect();
    Json(Fleet { workers })
}
