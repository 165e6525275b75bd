//! `GET /v1/workers`: the fleet as the registry knows it from heartbeats.

use axum::Json;
use axum::extract::State;
use schemars::JsonSchema;
use serde::Serialize;
use vnfarm_proto::{Heartbeat, JobId, WorkerId};

use super::Api;

#[derive(Debug, Serialize, JsonSchema)]
pub struct Fleet {
    pub workers: Vec<Worker>,
}

/// One worker and its last heartbeat.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Worker {
    pub id: WorkerId,
    /// Heard from within the heartbeat timeout.
    pub alive: bool,
    /// `ready`, `warming`, `draining` or `gone` (silent past the heartbeat timeout).
    pub state: &'static str,
    /// Jobs the scheduler sent it that have not finished.
    pub assigned: Vec<JobId>,
    pub heartbeat: Option<Heartbeat>,
    pub seconds_since_heartbeat: Option<f64>,
}

pub async fn workers(State(api): State<Api>) -> Json<Fleet> {
    let timeout = api.scheduler.heartbeat_timeout();
    let reg = api.scheduler.registry();
    let workers = reg
        .workers()
        .map(|w| Worker {
            id: w.id().clone(),
            alive: w.alive(timeout),
            state: w.state_name(timeout),
            assigned: w.assigned().collect(),
            heartbeat: w.last_heartbeat().map(|(_, hb)| hb.clone()),
            seconds_since_heartbeat: w.last_heartbeat().map(|(at, _)| at.elapsed().as_secs_f64()),
        })
        .collect();
    Json(Fleet { workers })
}
