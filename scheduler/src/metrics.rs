//! The scheduler's Prometheus metrics (DESIGN §8), registered into one explicit registry.
//!
//! Every label takes values from a closed set (job kinds, outcomes, states, models, priorities,
//! policy decisions, failure kinds, the three shared queues, storage operations). Label values an
//! alert or a dashboard's `rate()` depends on are created at zero here, so a first failure shows
//! as an increase rather than as a series appearing out of nowhere.

use prometheus::{
    Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
    register_histogram_vec_with_registry, register_histogram_with_registry,
    register_int_counter_vec_with_registry, register_int_counter_with_registry,
    register_int_gauge_vec_with_registry, register_int_gauge_with_registry,
};
use vnfarm_proto::FailureKind;

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
    pub yields_total: IntCounter,
    /// Jobs that came back from a worker queue, by reason.
    pub requeues_total: IntCounterVec,
    pub amqp_connected: IntGauge,
    pub amqp_reconnects_total: IntCounter,
    pub requests_channel_renewals_total: IntCounter,
    pub malformed_messages_total: IntCounter,
    /// Retries of intake submissions held while storage or the broker was unavailable.
    pub intake_held_retries_total: IntCounter,
    /// Messages the broker dead-lettered (delivery limit) that the dead-letter watch gave a
    /// `failed` event.
    pub dead_letters_watched_total: IntCounter,
    pub events_applied_total: IntCounter,
    pub sse_clients: IntGauge,
    /// Messages this scheduler sent to the dead-letter exchange, by failure kind (submissions
    /// rejected on the intake queue, jobs past their dispatches or the delivery limit).
    pub dead_letters_total: IntCounterVec,
    /// Messages in the shared queues (`intake`, `redispatch`, `dead`), as the broker counts them;
    /// `dead` includes what workers and the broker itself dead-lettered.
    pub queue_messages: IntGaugeVec,
    /// Workers advertising each model, by state (as `workers`).
    pub model_workers: IntGaugeVec,
    /// Storage operations that failed (a missing object is an answer, not an error), by operation.
    pub storage_errors_total: IntCounterVec,
}

/// Job kinds as `JobRecord::kind` names them.
pub const KINDS: [&str; 4] = ["generate", "edit", "upscale", "pipeline"];
/// Outcomes of `jobs_finished_total`.
pub const OUTCOMES: [&str; 3] = ["completed", "failed", "cancelled"];
/// Worker states as `WorkerRecord::state_name` names them.
pub const WORKER_STATES: [&str; 4] = ["ready", "warming", "draining", "gone"];
/// Reasons of `requeues_total`.
pub const REQUEUE_REASONS: [&str; 4] = ["expired", "given_back", "yielded", "delivery_limit"];
/// Failure kinds of the messages a scheduler dead-letters itself.
pub const DEAD_LETTER_FAILURES: [FailureKind; 3] = [
    FailureKind::Malformed,
    FailureKind::InvalidSpec,
    FailureKind::DeliveryLimit,
];
/// Labels of `queue_messages`.
pub const QUEUES: [&str; 3] = ["intake", "redispatch", "dead"];
/// Outcomes of `snapshots_total` (see `snapshot.rs`).
pub const SNAPSHOT_OUTCOMES: [&str; 3] = ["written", "failed", "too_large"];
/// Operations of `storage_errors_total`.
pub const STORAGE_OPS: [&str; 2] = ["get", "put"];

impl Metrics {
    pub fn new() -> Self {
        let registry = vnfarm_metrics::registry();
        let buckets = vec![
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0,
        ];
        // Each metric is created and registered in one step. Names and labels are static, valid and
        // distinct, so neither can fail.
        let r = &registry;
        let metrics = Self {
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
            yields_total: register_int_counter_with_registry!(
                "yield_requests_total",
                "Workers asked for the unstarted jobs of a batch message back, for interactive work",
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
            requests_channel_renewals_total: register_int_counter_with_registry!(
                "requests_channel_renewals_total",
                "Fresh channels for the API's requests after one of their publishes got no confirm in time",
                r
            )
            .unwrap(),
            malformed_messages_total: register_int_counter_with_registry!(
                "malformed_messages_total",
                "Messages dead-lettered as undecodable, too large or invalid",
                r
            )
            .unwrap(),
            intake_held_retries_total: register_int_counter_with_registry!(
                "intake_held_retries_total",
                "Retries of intake submissions held while storage or the broker was unavailable",
                r
            )
            .unwrap(),
            dead_letters_watched_total: register_int_counter_with_registry!(
                "dead_letters_watched_total",
                "Messages the broker dead-lettered that the scheduler gave a failed event",
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
            dead_letters_total: register_int_counter_vec_with_registry!(
                "dead_letters_total",
                "Messages this scheduler dead-lettered, by failure kind",
                &["failure"],
                r
            )
            .unwrap(),
            queue_messages: register_int_gauge_vec_with_registry!(
                "queue_messages",
                "Messages in the shared broker queues (intake, redispatch, dead)",
                &["queue"],
                r
            )
            .unwrap(),
            model_workers: register_int_gauge_vec_with_registry!(
                "model_workers",
                "Workers advertising a model, by state",
                &["model", "state"],
                r
            )
            .unwrap(),
            storage_errors_total: register_int_counter_vec_with_registry!(
                "storage_errors_total",
                "Storage operations that failed, by operation",
                &["op"],
                r
            )
            .unwrap(),
            registry,
        };
        metrics.initialise_labels();
        metrics
    }

    /// Creates at zero the series alerts and rates rely on (see the module's note).
    fn initialise_labels(&self) {
        for kind in KINDS {
            self.jobs_submitted_total.with_label_values(&[kind]);
            for outcome in OUTCOMES {
                self.jobs_finished_total.with_label_values(&[kind, outcome]);
            }
        }
        for failure in DEAD_LETTER_FAILURES {
            self.dead_letters_total
                .with_label_values(&[failure.as_str()]);
        }
        for reason in REQUEUE_REASONS {
            self.requeues_total.with_label_values(&[reason]);
        }
        for op in STORAGE_OPS {
            self.storage_errors_total.with_label_values(&[op]);
        }
        for outcome in SNAPSHOT_OUTCOMES {
            self.snapshots_total.with_label_values(&[outcome]);
        }
    }

    /// Counts a failed storage operation (`NotFound` is an answer, not a failure).
    pub fn storage_error(&self, op: &'static str, error: &vnfarm_storage::StorageError) {
        if !matches!(error, vnfarm_storage::StorageError::NotFound { .. }) {
            self.storage_errors_total.with_label_values(&[op]).inc();
        }
    }

    pub fn render(&self) -> String {
        vnfarm_metrics::render(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use prometheus::proto::MetricType;

    use super::*;

    /// Every family the scheduler exports: name, type, label names. The README's metrics section
    /// and the dashboards rely on these.
    const FAMILIES: &[(&str, MetricType, &[&str])] = &[
        (
            "vnfarm_jobs_submitted_total",
            MetricType::COUNTER,
            &["kind"],
        ),
        (
            "vnfarm_jobs_finished_total",
            MetricType::COUNTER,
            &["kind", "outcome"],
        ),
        (
            "vnfarm_queue_wait_seconds",
            MetricType::HISTOGRAM,
            &["kind"],
        ),
        ("vnfarm_job_run_seconds", MetricType::HISTOGRAM, &["kind"]),
        ("vnfarm_jobs", MetricType::GAUGE, &["state"]),
        (
            "vnfarm_backlog_jobs",
            MetricType::GAUGE,
            &["model", "priority"],
        ),
        ("vnfarm_registry_jobs", MetricType::GAUGE, &[]),
        ("vnfarm_scheduler_active", MetricType::GAUGE, &[]),
        ("vnfarm_snapshots_total", MetricType::COUNTER, &["outcome"]),
        ("vnfarm_snapshot_bytes", MetricType::GAUGE, &[]),
        ("vnfarm_workers", MetricType::GAUGE, &["state"]),
        (
            "vnfarm_model_workers",
            MetricType::GAUGE,
            &["model", "state"],
        ),
        (
            "vnfarm_dispatches_total",
            MetricType::COUNTER,
            &["decision"],
        ),
        ("vnfarm_dispatch_batch_jobs", MetricType::HISTOGRAM, &[]),
        ("vnfarm_requeues_total", MetricType::COUNTER, &["reason"]),
        ("vnfarm_yield_requests_total", MetricType::COUNTER, &[]),
        ("vnfarm_amqp_connected", MetricType::GAUGE, &[]),
        ("vnfarm_amqp_reconnects_total", MetricType::COUNTER, &[]),
        (
            "vnfarm_requests_channel_renewals_total",
            MetricType::COUNTER,
            &[],
        ),
        ("vnfarm_malformed_messages_total", MetricType::COUNTER, &[]),
        ("vnfarm_intake_held_retries_total", MetricType::COUNTER, &[]),
        (
            "vnfarm_dead_letters_watched_total",
            MetricType::COUNTER,
            &[],
        ),
        ("vnfarm_events_applied_total", MetricType::COUNTER, &[]),
        ("vnfarm_sse_clients", MetricType::GAUGE, &[]),
        (
            "vnfarm_dead_letters_total",
            MetricType::COUNTER,
            &["failure"],
        ),
        ("vnfarm_queue_messages", MetricType::GAUGE, &["queue"]),
        ("vnfarm_storage_errors_total", MetricType::COUNTER, &["op"]),
    ];

    /// One sample in each family that has no series until something happens.
    fn touch_all(m: &Metrics) {
        m.queue_wait_seconds
            .with_label_values(&["edit"])
            .observe(0.2);
        m.job_run_seconds.with_label_values(&["edit"]).observe(1.5);
        m.jobs.with_label_values(&["queued"]).set(3);
        m.backlog
            .with_label_values(&["qwen-edit", "interactive"])
            .set(2);
        m.snapshots_total.with_label_values(&["written"]).inc();
        m.workers.with_label_values(&["ready"]).set(2);
        m.model_workers.with_label_values(&["sdxl", "ready"]).set(1);
        m.dispatches_total
            .with_label_values(&["affinity_hit"])
            .inc();
        m.dispatch_batch_jobs.observe(4.0);
        m.queue_messages.with_label_values(&["dead"]).set(1);
    }

    #[test]
    fn the_registry_renders_every_family_with_its_type_and_labels() {
        let m = Metrics::new();
        touch_all(&m);
        let text = vnfarm_metrics::check_families(&m.registry, FAMILIES);
        assert!(
            text.contains("vnfarm_dispatches_total{decision=\"affinity_hit\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn alerted_series_exist_at_zero_from_the_start() {
        let text = Metrics::new().render();
        for line in [
            "vnfarm_jobs_finished_total{kind=\"edit\",outcome=\"failed\"} 0",
            "vnfarm_dead_letters_total{failure=\"delivery_limit\"} 0",
            "vnfarm_requeues_total{reason=\"given_back\"} 0",
            "vnfarm_storage_errors_total{op=\"put\"} 0",
            "vnfarm_amqp_reconnects_total 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn a_missing_object_is_not_a_storage_error() {
        let m = Metrics::new();
        let missing = vnfarm_storage::StorageError::NotFound { key: "k".into() };
        m.storage_error("get", &missing);
        assert_eq!(m.storage_errors_total.with_label_values(&["get"]).get(), 0);
        let down = vnfarm_storage::StorageError::Unavailable {
            op: "get",
            key: "k".into(),
            message: "connection refused".into(),
        };
        m.storage_error("get", &down);
        assert_eq!(m.storage_errors_total.with_label_values(&["get"]).get(), 1);
    }
}
