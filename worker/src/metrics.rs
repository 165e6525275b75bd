//! The worker's Prometheus metrics (DESIGN §8), registered into one explicit registry.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Jobs finished, by kind and outcome (`completed`, `failed`, `cancelled`, `requeued`).
    pub jobs_total: IntCounterVec,
    /// Seconds per stage (`download`, `encode`, `denoise`, `decode`, `upload`), by kind.
    pub stage_seconds: HistogramVec,
    /// Whole-job seconds, by kind.
    pub job_seconds: HistogramVec,
    pub model_load_seconds: Histogram,
    /// 1 while a job is on the engine; `rate(vnfarm_worker_busy_seconds_total)` is the busy ratio.
    pub busy: IntGauge,
    pub busy_seconds_total: prometheus::Counter,
    pub amqp_connected: IntGauge,
    pub amqp_reconnects_total: IntCounter,
    /// Storage errors, by operation.
    pub storage_errors_total: IntCounterVec,
    /// Messages that could not be decoded or were too large.
    pub malformed_messages_total: IntCounter,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("vnfarm".into()), None)
            .expect("the prefix 'vnfarm' is a valid metric name");
        let stage_buckets = vec![
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0,
        ];
        let m = Self {
            jobs_total: IntCounterVec::new(
                Opts::new("worker_jobs_total", "Jobs finished by this worker"),
                &["kind", "outcome"],
            )
            .unwrap(),
            stage_seconds: HistogramVec::new(
                HistogramOpts::new("worker_stage_seconds", "Seconds per job stage")
                    .buckets(stage_buckets.clone()),
                &["kind", "stage"],
            )
            .unwrap(),
            job_seconds: HistogramVec::new(
                HistogramOpts::new("worker_job_seconds", "Seconds per job, delivery to ack")
                    .buckets(stage_buckets),
                &["kind"],
            )
            .unwrap(),
            model_load_seconds: Histogram::with_opts(HistogramOpts::new(
                "worker_model_load_seconds",
                "Seconds to load the engine",
            ))
            .unwrap(),
            busy: IntGauge::new("worker_busy", "1 while a job is on the engine").unwrap(),
            busy_seconds_total: prometheus::Counter::new(
                "worker_busy_seconds_total",
                "Seconds the engine spent on jobs",
            )
            .unwrap(),
            amqp_connected: IntGauge::new("amqp_connected", "1 while connected to the broker")
                .unwrap(),
            amqp_reconnects_total: IntCounter::new(
                "amqp_reconnects_total",
                "Failed broker connection attempts and lost connections",
            )
            .unwrap(),
            storage_errors_total: IntCounterVec::new(
                Opts::new("storage_errors_total", "Storage operations that failed"),
                &["op"],
            )
            .unwrap(),
            malformed_messages_total: IntCounter::new(
                "malformed_messages_total",
                "Messages dead-lettered as undecodable or too large",
            )
            .unwrap(),
            registry,
        };
        // Names are static and distinct, so registration cannot fail.
        m.registry.register(Box::new(m.jobs_total.clone())).unwrap();
        m.registry
            .register(Box::new(m.stage_seconds.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.job_seconds.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.model_load_seconds.clone()))
            .unwrap();
        m.registry.register(Box::new(m.busy.clone())).unwrap();
        m.registry
            .register(Box::new(m.busy_seconds_total.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.amqp_connected.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.amqp_reconnects_total.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.storage_errors_total.clone()))
            .unwrap();
        m.registry
            .register(Box::new(m.malformed_messages_total.clone()))
            .unwrap();
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

#[cfg(test)]
mod tests {
    #[test]
    fn renders_prefixed_names() {
        let m = super::Metrics::new();
        m.jobs_total
            .with_label_values(&["generate", "completed"])
            .inc();
        let text = m.render();
        assert!(
            text.contains("vnfarm_worker_jobs_total{kind=\"generate\",outcome=\"completed\"} 1"),
            "{text}"
        );
        assert!(text.contains("vnfarm_amqp_connected 0"));
    }
}
