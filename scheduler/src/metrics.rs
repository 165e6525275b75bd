//! The scheduler's Prometheus metrics (DESIGN §8), registered into one explicit registry.

use prometheus::{
    Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
    register_histogram_vec_with_registry, register_histogram_with_registry,
    register_int_counter_vec_with_registry, register_int_counter_with_registry,
    register_int_gauge_vec_with_registry, register_int_gauge_with_registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub jobs_submitted_total: IntCounterVec,
    /// Jobs that reached a terminal state while this scheduler was live, by kind and outcome.
    pub jobs_finished_total: IntCounterVec,
    /// Seconds from `queued` to a worker's `started`, by kind.
    pub queue_wait_seconds: HistogramVec,
    /// Seconds from `started` to `completed`, by kind.
    pub job_run_seconds: HistogramVec,
    /// Active jobs by state.
    pub jobs: IntGaugeVec,
    /// Queued jobs waiting for a worker, by model and priority.
    pub backlog: IntGaugeVec,
    /// Jobs held in memory (active and retained finished ones).
    pub registry_jobs: IntGauge,
    /// 1 while this scheduler is the active one (0: a standby).
    pub scheduler_active: IntGauge,
    /// Registry snapshots written, by outcome (`written`, `failed`, `too_large`).
    pub snapshots_total: IntCounterVec,
    /// Size of the last snapshot written.
    pub snapshot_bytes: IntGauge,
    /// Workers by state (`ready`, `warming`, `draining`, `gone`).
    pub workers: IntGaugeVec,
    /// Messages dispatched, by the policy's decision (`registry::Decision`).
    pub dispatches_total: IntCounterVec,
    /// Jobs per dispatched message.
    pub dispatch_batch_jobs: Histogram,
    /// Jobs that came back from a worker queue, by reason.
    pub requeues_total: IntCounterVec,
    pub amqp_connected: IntGauge,
    pub amqp_reconnects_total: IntCounter,
    pub malformed_messages_total: IntCounter,
    pub events_applied_total: IntCounter,
    pub sse_clients: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = vnfarm_config::process::metrics_registry();
        let buckets = vec![
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0,
        ];
        // Each metric is created and registered in one step. Names and labels are static, valid and
        // distinct, so neither can fail.
        let r = &registry;
        Self {
            jobs_submitted_total: register_int_counter_vec_with_registry!(
                "jobs_submitted_total",
                "Jobs accepted, by kind",
                &["kind"],
                r
            )
            .unwrap(),
            jobs_finished_total: register_int_counter_vec_with_registry!(
                "jobs_finished_total",
                "Jobs finished, by kind and outcome",
                &["kind", "outcome"],
                r
            )
            .unwrap(),
            queue_wait_seconds: register_histogram_vec_with_registry!(
                "queue_wait_seconds",
                "Seconds from queued to started",
                &["kind"],
                buckets.clone(),
                r
            )
            .unwrap(),
            job_run_seconds: register_histogram_vec_with_registry!(
                "job_run_seconds",
                "Seconds from started to completed",
                &["kind"],
                buckets,
                r
            )
            .unwrap(),
            jobs: register_int_gauge_vec_with_registry!(
                "jobs",
                "Active jobs by state",
                &["state"],
                r
            )
            .unwrap(),
            backlog: register_int_gauge_vec_with_registry!(
                "backlog_jobs",
                "Queued jobs waiting for a worker, by model and priority",
                &["model", "priority"],
                r
            )
            .unwrap(),
            registry_jobs: register_int_gauge_with_registry!(
                "registry_jobs",
                "Jobs held in the scheduler's memory, active and retained finished ones",
                r
            )
            .unwrap(),
            scheduler_active: register_int_gauge_with_registry!(
                "scheduler_active",
                "1 while this scheduler is the active one, 0 while it is a standby",
                r
            )
            .unwrap(),
            snapshots_total: register_int_counter_vec_with_registry!(
                "snapshots_total",
                "Registry snapshots, by outcome",
                &["outcome"],
                r
            )
            .unwrap(),
            snapshot_bytes: register_int_gauge_with_registry!(
                "snapshot_bytes",
                "Size of the last registry snapshot written",
                r
            )
            .unwrap(),
            workers: register_int_gauge_vec_with_registry!(
                "workers",
                "Known workers by state",
                &["state"],
                r
            )
            .unwrap(),
            dispatches_total: register_int_counter_vec_with_registry!(
                "dispatches_total",
                "Messages dispatched, by the policy's decision",
                &["decision"],
                r
            )
            .unwrap(),
            dispatch_batch_jobs: register_histogram_with_registry!(
                "dispatch_batch_jobs",
                "Jobs per dispatched message",
                vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0],
                r
            )
            .unwrap(),
            requeues_total: register_int_counter_vec_with_registry!(
                "requeues_total",
                "Jobs returned from worker queues, by reason",
                &["reason"],
                r
            )
            .unwrap(),
            amqp_connected: register_int_gauge_with_registry!(
                "amqp_connected",
                "1 while connected to the broker",
                r
            )
            .unwrap(),
            amqp_reconnects_total: register_int_counter_with_registry!(
                "amqp_reconnects_total",
                "Failed broker connection attempts and lost connections",
                r
            )
            .unwrap(),
            malformed_messages_total: register_int_counter_with_registry!(
                "malformed_messages_total",
                "Messages dead-lettered as undecodable, too large or invalid",
                r
            )
            .unwrap(),
            events_applied_total: register_int_counter_with_registry!(
                "events_applied_total",
                "Job events read from the event stream",
                r
            )
            .unwrap(),
            sse_clients: register_int_gauge_with_registry!(
                "sse_clients",
                "Connected Server-Sent Events clients",
                r
            )
            .unwrap(),
            registry,
        }
    }

    pub fn render(&self) -> String {
        vnfarm_config::process::render_metrics(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
