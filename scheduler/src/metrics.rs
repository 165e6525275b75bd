//! The scheduler's Prometheus metrics (DESIGN §8), registered into one explicit registry.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
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
    /// Queued jobs waiting for a worker, by model.
    pub backlog: IntGaugeVec,
    /// Workers by state (`ready`, `warming`, `draining`, `gone`).
    pub workers: IntGaugeVec,
    /// Dispatch decisions by policy branch (`least_loaded`).
    pub dispatches_total: IntCounterVec,
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
        let registry = Registry::new_custom(Some("vnfarm".into()), None)
            .expect("the prefix 'vnfarm' is a valid metric name");
        let buckets = vec![
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0,
        ];
        // Names and labels are static and valid, so construction and registration cannot fail.
        let m = Self {
            jobs_submitted_total: IntCounterVec::new(
                Opts::new("jobs_submitted_total", "Jobs accepted, by kind"),
                &["kind"],
            )
            .unwrap(),
            jobs_finished_total: IntCounterVec::new(
                Opts::new("jobs_finished_total", "Jobs finished, by kind and outcome"),
                &["kind", "outcome"],
            )
            .unwrap(),
            queue_wait_seconds: HistogramVec::new(
                HistogramOpts::new("queue_wait_seconds", "Seconds from queued to started")
                    .buckets(buckets.clone()),
                &["kind"],
            )
            .unwrap(),
            job_run_seconds: HistogramVec::new(
                HistogramOpts::new("job_run_seconds", "Seconds from started to completed")
                    .buckets(buckets),
                &["kind"],
            )
            .unwrap(),
            jobs: IntGaugeVec::new(Opts::new("jobs", "Active jobs by state"), &["state"]).unwrap(),
            backlog: IntGaugeVec::new(
                Opts::new("backlog_jobs", "Queued jobs waiting for a worker, by model"),
                &["model"],
            )
            .unwrap(),
            workers: IntGaugeVec::new(Opts::new("workers", "Known workers by state"), &["state"])
                .unwrap(),
            dispatches_total: IntCounterVec::new(
                Opts::new("dispatches_total", "Dispatch decisions by policy branch"),
                &["decision"],
            )
            .unwrap(),
            requeues_total: IntCounterVec::new(
                Opts::new(
                    "requeues_total",
                    "Jobs returned from worker queues, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
            amqp_connected: IntGauge::new("amqp_connected", "1 while connected to the broker")
                .unwrap(),
            amqp_reconnects_total: IntCounter::new(
                "amqp_reconnects_total",
                "Failed broker connection attempts and lost connections",
            )
            .unwrap(),
            malformed_messages_total: IntCounter::new(
                "malformed_messages_total",
                "Messages dead-lettered as undecodable, too large or invalid",
            )
            .unwrap(),
            events_applied_total: IntCounter::new(
                "events_applied_total",
                "Job events read from the event stream",
            )
            .unwrap(),
            sse_clients: IntGauge::new("sse_clients", "Connected Server-Sent Events clients")
                .unwrap(),
            registry,
        };
        for c in [
            Box::new(m.jobs_submitted_total.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.jobs_finished_total.clone()),
            Box::new(m.queue_wait_seconds.clone()),
            Box::new(m.job_run_seconds.clone()),
            Box::new(m.jobs.clone()),
            Box::new(m.backlog.clone()),
            Box::new(m.workers.clone()),
            Box::new(m.dispatches_total.clone()),
            Box::new(m.requeues_total.clone()),
            Box::new(m.amqp_connected.clone()),
            Box::new(m.amqp_reconnects_total.clone()),
            Box::new(m.malformed_messages_total.clone()),
            Box::new(m.events_applied_total.clone()),
            Box::new(m.sse_clients.clone()),
        ] {
            m.registry.register(c).unwrap();
        }
        m
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(buf).expect("the Prometheus text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
