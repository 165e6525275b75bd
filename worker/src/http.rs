//! The worker's HTTP endpoints: `/metrics` (Prometheus text) and `/healthz`.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::worker::Worker;

pub fn router(worker: Worker) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(worker)
}

async fn metrics(State(worker): State<Worker>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        worker.metrics().render(),
    )
}

async fn healthz(State(worker): State<Worker>) -> impl IntoResponse {
    let connected = worker.metrics().amqp_connected.get() == 1;
    let status = if connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "worker": worker.id(),
        "state": worker.lifecycle().state(),
        "amqp_connected": connected,
        "engine": worker.engine().name(),
        "running": worker.hand().running(),
    });
    (status, axum::Json(body))
}
