//! The worker's Prometheus metrics (DESIGN §8), registered into one explicit registry.
//!
//! Every label takes values from a closed set (job kinds, outcomes, stages, models, resolution
//! classes, cache results, failure kinds, storage operations, worker states); `vnfarm_worker_info`
//! carries this worker's id, one series per process. Label values an alert or a dashboard's
//! `rate()` depends on are created at zero here, so a first failure shows as an increase.

use prometheus::{
    Counter, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
    register_counter_with_registry, register_histogram_vec_with_registry,
    register_histogram_with_registry, register_int_counter_vec_with_registry,
    register_int_counter_with_registry, register_int_gauge_vec_with_registry,
    register_int_gauge_with_registry,
};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vnfarm_proto::{FailureKind, WorkerState};

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
    /// Shared encodings through storage, by `op` (`fetch`, `publish`) and `result` (`found`,
    /// `missing`, `error`, `timeout`, `invalid`; `ok`, `error`).
    pub shared_encodings_total: IntCounterVec,
    /// Jobs per work message (1 for a single job).
    pub batch_jobs: Histogram,
    /// The GPU's memory as its runtime reports it (`total`, `free`), when the engine runs on one;
    /// updated with each heartbeat.
    pub gpu_memory_bytes: IntGaugeVec,
    /// 1 while jobs are on the engine; `rate(vnfarm_worker_busy_seconds_total)` is the busy ratio.
    /// Both are kept by [`Metrics::engine_busy`], [`Metrics::engine_idle`] and
    /// [`Metrics::account_busy`].
    busy: IntGauge,
    busy_seconds_total: Counter,
    /// Since when the engine's busy time has not been counted, while it is busy, and how many
    /// messages are on it (several when they overlap: one's last run beside the next one's).
    busy_since: Arc<Mutex<Busy>>,
    pub amqp_connected: IntGauge,
    pub amqp_reconnects_total: IntCounter,
    /// Storage errors, by operation.
    pub storage_errors_total: IntCounterVec,
    /// Messages that could not be decoded or were too large.
    pub malformed_messages_total: IntCounter,
    /// Seconds per denoising step of a job (its `denoise` stage over its steps; in a batch, the
    /// job's share), by model and the output's [`resolution`] class.
    pub denoise_step_seconds: HistogramVec,
    /// Jobs (or undecodable messages) this worker sent to the dead-letter exchange, by failure kind.
    pub dead_letters_total: IntCounterVec,
    /// 1 for the state the worker heartbeats (`warming`, `ready`, `draining`), 0 for the others.
    pub state: IntGaugeVec,
    /// 1, labelled with the worker's id, engine and version (to name an `instance` on dashboards).
    pub info: IntGaugeVec,
    /// 1, labelled with where the engine settings came from (`measured` by `vnfarm-worker check`,
    /// `presets`, or `none` for the test pattern) and their id; set once the engine has loaded.
    pub settings_info: IntGaugeVec,
}

/// Job kinds (`Task::kind_name`).
pub const KINDS: [&str; 3] = ["generate", "edit", "upscale"];
/// Outcomes of `worker_jobs_total`.
pub const OUTCOMES: [&str; 5] = [
    "completed",
    "already_completed",
    "failed",
    "cancelled",
    "requeued",
];
/// States of `worker_state`.
pub const STATES: [WorkerState; 3] = [
    WorkerState::Warming,
    WorkerState::Ready,
    WorkerState::Draining,
];
/// Failure kinds a worker dead-letters (`JobError::disposition`).
pub const DEAD_LETTER_FAILURES: [FailureKind; 6] = [
    FailureKind::Malformed,
    FailureKind::InvalidSpec,
    FailureKind::BadInput,
    FailureKind::DeadlineExceeded,
    FailureKind::Engine,
    FailureKind::NoWorker,
];

/// The label of a worker state.
pub fn state_name(state: WorkerState) -> &'static str {
    match state {
        WorkerState::Warming => "warming",
        WorkerState::Ready => "ready",
        WorkerState::Draining => "draining",
    }
}

/// The resolution class of an output, for `denoise_step_seconds` (the scheduler's estimates
/// learn their rates by the same classes).
pub use vnfarm_proto::resolution_class as resolution;

impl Metrics {
    pub fn new() -> Self {
        let registry = vnfarm_metrics::registry();
        let stage_buckets = vec![
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0,
        ];
        // Each metric is created and registered in one step. Names and labels are static, valid and
        // distinct, so neither can fail.
        let r = &registry;
        let metrics = Self {
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
                "Edits whose input encodings were cached (hit), fetched from shared storage (fetched) or encoded for them (miss)",
                &["result"],
                r
            )
            .unwrap(),
            shared_encodings_total: register_int_counter_vec_with_registry!(
                "worker_shared_encodings_total",
                "Shared encodings fetched from or published to storage, by op and result",
                &["op", "result"],
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
            denoise_step_seconds: register_histogram_vec_with_registry!(
                "worker_denoise_step_seconds",
                "Seconds per denoising step of a job, by model and output resolution class",
                &["model", "resolution"],
                vec![
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0
                ],
                r
            )
            .unwrap(),
            dead_letters_total: register_int_counter_vec_with_registry!(
                "dead_letters_total",
                "Messages this worker dead-lettered, by failure kind",
                &["failure"],
                r
            )
            .unwrap(),
            state: register_int_gauge_vec_with_registry!(
                "worker_state",
                "1 for the state the worker is in (warming, ready, draining)",
                &["state"],
                r
            )
            .unwrap(),
            info: register_int_gauge_vec_with_registry!(
                "worker_info",
                "1, labelled with the worker's id, engine and version",
                &["worker", "engine", "version"],
                r
            )
            .unwrap(),
            settings_info: register_int_gauge_vec_with_registry!(
                "worker_settings_info",
                "1, labelled with the engine settings in use: their source (measured or presets) and id",
                &["source", "id"],
                r
            )
            .unwrap(),
            busy_since: Arc::default(),
            registry,
        };
        metrics.initialise_labels();
        metrics
    }

    /// Creates at zero the series alerts and rates rely on (see the module's note).
    fn initialise_labels(&self) {
        for kind in KINDS {
            for outcome in OUTCOMES {
                self.jobs_total.with_label_values(&[kind, outcome]);
            }
        }
        for result in ["hit", "miss", "fetched"] {
            self.encode_cache_total.with_label_values(&[result]);
        }
        for (op, result) in [
            ("fetch", "found"),
            ("fetch", "missing"),
            ("fetch", "error"),
            ("fetch", "timeout"),
            ("fetch", "invalid"),
            ("publish", "ok"),
            ("publish", "error"),
        ] {
            self.shared_encodings_total.with_label_values(&[op, result]);
        }
        for op in ["get", "put"] {
            self.storage_errors_total.with_label_values(&[op]);
        }
        for failure in DEAD_LETTER_FAILURES {
            self.dead_letters_total
                .with_label_values(&[failure.as_str()]);
        }
        self.set_state(WorkerState::Warming);
    }

    /// A message's jobs went on the engine at `now`.
    pub fn engine_busy(&self, now: Instant) {
        self.account_busy(now);
        let mut busy = self.busy_since();
        busy.messages += 1;
        busy.since.get_or_insert(now);
        self.busy.set(1);
    }

    /// The engine finished a message's jobs at `now`; it is idle once no message is on it.
    pub fn engine_idle(&self, now: Instant) {
        self.account_busy(now);
        let mut busy = self.busy_since();
        busy.messages = busy.messages.saturating_sub(1);
        if busy.messages == 0 {
            busy.since = None;
            self.busy.set(0);
        }
    }

    /// Counts the busy time up to `now`. Called at every heartbeat as well as when a run ends, so
    /// the counter advances during a long job and its rate is right over windows shorter than a job
    /// (an SDXL generate on a Strix Halo takes half a minute, a scrape window may be 15 s).
    pub fn account_busy(&self, now: Instant) {
        let mut busy = self.busy_since();
        if let Some(from) = busy.since.as_mut() {
            self.busy_seconds_total
                .inc_by(now.saturating_duration_since(*from).as_secs_f64());
            *from = now.max(*from);
        }
    }

    fn busy_since(&self) -> std::sync::MutexGuard<'_, Busy> {
        // Only a count and an `Instant` are kept under the lock, each written whole.
        self.busy_since.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets `worker_state`: 1 for `state`, 0 for the others.
    pub fn set_state(&self, state: WorkerState) {
        for s in STATES {
            self.state
                .with_label_values(&[state_name(s)])
                .set(i64::from(s == state));
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

/// The engine's busy accounting: how many messages are on it, and since when its busy time has not
/// been counted.
#[derive(Default)]
struct Busy {
    messages: usize,
    since: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use prometheus::proto::MetricType;

    use super::*;

    /// Every family a worker exports: name, type, label names. The README's metrics section and
    /// the dashboards rely on these.
    const FAMILIES: &[(&str, MetricType, &[&str])] = &[
        (
            "vnfarm_worker_jobs_total",
            MetricType::COUNTER,
            &["kind", "outcome"],
        ),
        (
            "vnfarm_worker_stage_seconds",
            MetricType::HISTOGRAM,
            &["kind", "stage"],
        ),
        (
            "vnfarm_worker_job_seconds",
            MetricType::HISTOGRAM,
            &["kind"],
        ),
        (
            "vnfarm_worker_model_load_seconds",
            MetricType::HISTOGRAM,
            &[],
        ),
        (
            "vnfarm_worker_denoise_step_seconds",
            MetricType::HISTOGRAM,
            &["model", "resolution"],
        ),
        (
            "vnfarm_worker_encode_cache_total",
            MetricType::COUNTER,
            &["result"],
        ),
        (
            "vnfarm_worker_shared_encodings_total",
            MetricType::COUNTER,
            &["op", "result"],
        ),
        ("vnfarm_worker_batch_jobs", MetricType::HISTOGRAM, &[]),
        (
            "vnfarm_worker_gpu_memory_bytes",
            MetricType::GAUGE,
            &["kind"],
        ),
        ("vnfarm_worker_busy", MetricType::GAUGE, &[]),
        ("vnfarm_worker_busy_seconds_total", MetricType::COUNTER, &[]),
        ("vnfarm_worker_state", MetricType::GAUGE, &["state"]),
        (
            "vnfarm_worker_info",
            MetricType::GAUGE,
            &["engine", "version", "worker"],
        ),
        (
            "vnfarm_worker_settings_info",
            MetricType::GAUGE,
            &["id", "source"],
        ),
        ("vnfarm_amqp_connected", MetricType::GAUGE, &[]),
        ("vnfarm_amqp_reconnects_total", MetricType::COUNTER, &[]),
        ("vnfarm_storage_errors_total", MetricType::COUNTER, &["op"]),
        ("vnfarm_malformed_messages_total", MetricType::COUNTER, &[]),
        (
            "vnfarm_dead_letters_total",
            MetricType::COUNTER,
            &["failure"],
        ),
    ];

    /// One sample in each family that has no series until something happens.
    fn touch_all(m: &Metrics) {
        m.stage_seconds
            .with_label_values(&["edit", "denoise"])
            .observe(0.4);
        m.job_seconds.with_label_values(&["edit"]).observe(0.5);
        m.model_load_seconds.observe(12.0);
        m.denoise_step_seconds
            .with_label_values(&["qwen-edit", resolution(1024, 1024)])
            .observe(0.1);
        m.batch_jobs.observe(4.0);
        m.gpu_memory_bytes.with_label_values(&["free"]).set(1 << 30);
        m.info
            .with_label_values(&["box-1", "test-pattern", "0.1.0"])
            .set(1);
        m.settings_info
            .with_label_values(&["measured", "box-1-2026-12-01"])
            .set(1);
    }

    #[test]
    fn the_registry_renders_every_family_with_its_type_and_labels() {
        let m = Metrics::new();
        touch_all(&m);
        let text = vnfarm_metrics::check_families(&m.registry, FAMILIES);
        for line in [
            "vnfarm_worker_denoise_step_seconds_count{model=\"qwen-edit\",resolution=\"1mp\"} 1",
            "vnfarm_worker_gpu_memory_bytes{kind=\"free\"} 1073741824",
            "vnfarm_worker_batch_jobs_count 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn alerted_series_exist_at_zero_from_the_start() {
        let text = Metrics::new().render();
        for line in [
            "vnfarm_worker_jobs_total{kind=\"generate\",outcome=\"failed\"} 0",
            "vnfarm_worker_encode_cache_total{result=\"miss\"} 0",
            "vnfarm_dead_letters_total{failure=\"bad_input\"} 0",
            "vnfarm_storage_errors_total{op=\"put\"} 0",
            "vnfarm_worker_state{state=\"warming\"} 1",
            "vnfarm_worker_state{state=\"ready\"} 0",
            "vnfarm_amqp_connected 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn the_engine_stays_busy_until_the_last_of_overlapping_messages_is_done() {
        let m = Metrics::new();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        m.engine_busy(at(0));
        // The next message's runs queue behind the first's.
        m.engine_busy(at(500));
        m.engine_idle(at(1_000));
        assert_eq!(m.busy.get(), 1, "one message is still on the engine");
        m.engine_idle(at(3_000));
        assert_eq!(m.busy.get(), 0);
        m.account_busy(at(4_000));
        assert!(
            (m.busy_seconds_total.get() - 3.0).abs() < 1e-9,
            "{} s: the overlap is counted once",
            m.busy_seconds_total.get()
        );
    }

    #[test]
    fn busy_time_advances_while_the_engine_runs_and_stops_when_it_is_idle() {
        let m = Metrics::new();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        m.account_busy(at(500));
        assert_eq!(
            m.busy_seconds_total.get(),
            0.0,
            "idle time is not busy time"
        );
        m.engine_busy(at(1_000));
        assert_eq!(m.busy.get(), 1);
        m.account_busy(at(3_000));
        assert!(
            (m.busy_seconds_total.get() - 2.0).abs() < 1e-9,
            "counted mid-run"
        );
        m.account_busy(at(3_500));
        m.engine_idle(at(4_000));
        assert!(
            (m.busy_seconds_total.get() - 3.0).abs() < 1e-9,
            "each second once"
        );
        assert_eq!(m.busy.get(), 0);
        m.account_busy(at(9_000));
        assert!((m.busy_seconds_total.get() - 3.0).abs() < 1e-9);
    }

    #[test]
    fn one_state_at_a_time() {
        let m = Metrics::new();
        m.set_state(WorkerState::Ready);
        m.set_state(WorkerState::Draining);
        let on: Vec<&str> = STATES
            .into_iter()
            .map(state_name)
            .filter(|s| m.state.with_label_values(&[s]).get() == 1)
            .collect();
        assert_eq!(on, ["draining"]);
    }

    #[test]
    fn resolutions_fall_into_a_few_classes() {
        for (w, h, class) in [
            (64, 64, "0.25mp"),
            (512, 512, "0.25mp"),
            (768, 768, "0.5mp"),
            (1024, 1024, "1mp"),
            (832, 1216, "1mp"),
            (1280, 720, "1mp"),
            (1536, 1536, "2mp"),
            (2048, 2048, "4mp"),
            (4096, 4096, "8mp"),
            (8192, 8192, "8mp"),
        ] {
            assert_eq!(resolution(w, h), class, "{w}x{h}");
        }
    }
}
