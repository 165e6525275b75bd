//! The worker's Prometheus metrics (DESIGN §8), registered into one explicit registry.

use prometheus::{
    Counter, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
    register_counter_with_registry, register_histogram_vec_with_registry,
    register_histogram_with_registry, register_int_counter_vec_with_registry,
    register_int_counter_with_registry, register_int_gauge_vec_with_registry,
    register_int_gauge_with_registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Jobs finished, by kind and outcome (`completed`, `already_completed` for a redelivery of a job
    /// whose results were stored, `failed`, `cancelled`, `requeued`).
    pub jobs_total: IntCounterVec,
    /// Seconds per stage (`download`, `encode`, `encode_prompt`, `denoise`, `decode`, `upload`), by kind.
    pub stage_seconds: HistogramVec,
    /// Whole-job seconds, by kind.
    pub job_seconds: HistogramVec,
    pub model_load_seconds: Histogram,
    /// Edits whose input encodings were in the engine's encode cache (`hit`) or were encoded for
    /// them (`miss`).
    pub encode_cache_total: IntCounterVec,
    /// Jobs per work message (1 for a single job).
    pub batch_jobs: Histogram,
    /// The GPU's memory as its runtime reports it (`total`, `free`), when the engine runs on one;
    /// updated with each heartbeat.
    pub gpu_memory_bytes: IntGaugeVec,
    /// 1 while jobs are on the engine; `rate(vnfarm_worker_busy_seconds_total)` is the busy ratio.
    pub busy: IntGauge,
    pub busy_seconds_total: Counter,
    pub amqp_connected: IntGauge,
    pub amqp_reconnects_total: IntCounter,
    /// Storage errors, by operation.
    pub storage_errors_total: IntCounterVec,
    /// Messages that could not be decoded or were too large.
    pub malformed_messages_total: IntCounter,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = vnfarm_config::process::metrics_registry();
        let stage_buckets = vec![
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0,
        ];
        // Each metric is created and registered in one step. Names and labels are static, valid and
        // distinct, so neither can fail.
        let r = &registry;
        Self {
            jobs_total: register_int_counter_vec_with_registry!(
                "worker_jobs_total",
                "Jobs finished by this worker",
                &["kind", "outcome"],
                r
            )
            .unwrap(),
            stage_seconds: register_histogram_vec_with_registry!(
                "worker_stage_seconds",
                "Seconds per job stage",
                &["kind", "stage"],
                stage_buckets.clone(),
                r
            )
            .unwrap(),
            job_seconds: register_histogram_vec_with_registry!(
                "worker_job_seconds",
                "Seconds per job, delivery to ack",
                &["kind"],
                stage_buckets,
                r
            )
            .unwrap(),
            model_load_seconds: register_histogram_with_registry!(
                "worker_model_load_seconds",
                "Seconds to load the engine",
                r
            )
            .unwrap(),
            encode_cache_total: register_int_counter_vec_with_registry!(
                "worker_encode_cache_total",
                "Edits whose input encodings were cached (hit) or encoded for them (miss)",
                &["result"],
                r
            )
            .unwrap(),
            batch_jobs: register_histogram_with_registry!(
                "worker_batch_jobs",
                "Jobs per work message",
                vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0],
                r
            )
            .unwrap(),
            gpu_memory_bytes: register_int_gauge_vec_with_registry!(
                "worker_gpu_memory_bytes",
                "GPU memory as the device runtime reports it",
                &["kind"],
                r
            )
            .unwrap(),
            busy: register_int_gauge_with_registry!(
                "worker_busy",
                "1 while jobs are on the engine",
                r
            )
            .unwrap(),
            busy_seconds_total: register_counter_with_registry!(
                "worker_busy_seconds_total",
                "Seconds the engine spent on jobs",
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
            storage_errors_total: register_int_counter_vec_with_registry!(
                "storage_errors_total",
                "Storage operations that failed",
                &["op"],
                r
            )
            .unwrap(),
            malformed_messages_total: register_int_counter_with_registry!(
                "malformed_messages_total",
                "Messages dead-lettered as undecodable or too large",
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
        m.encode_cache_total.with_label_values(&["hit"]).inc_by(3);
        m.batch_jobs.observe(4.0);
        m.gpu_memory_bytes.with_label_values(&["free"]).set(1 << 30);
        let text = m.render();
        assert!(
            text.contains("vnfarm_worker_encode_cache_total{result=\"hit\"} 3"),
            "{text}"
        );
        assert!(text.contains("vnfarm_worker_batch_jobs_count 1"), "{text}");
        assert!(
            text.contains("vnfarm_worker_gpu_memory_bytes{kind=\"free\"} 1073741824"),
            "{text}"
        );
    }
}
