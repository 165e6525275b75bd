//! The scheduler's typed configuration, validated before any I/O.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;
use vnfarm_bus::AmqpConfig;
use vnfarm_config::ConfigError;
use vnfarm_storage::StorageConfig;

/// Every key is optional: a missing one takes its value from [`Config::default`].
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub amqp: AmqpConfig,
    pub storage: StorageConfig,
    /// HTTP API address. Port 0 picks a free port.
    pub listen: SocketAddr,
    /// Bearer token required on `/v1/*`. Required when `listen` is not a loopback address.
    pub api_token: Option<String>,
    /// A worker silent for this long is considered gone and gets no new jobs.
    pub heartbeat_timeout_ms: u64,
    /// How long a dispatched job may wait in a worker's queue before it comes back to be dispatched
    /// elsewhere (the worker died or stalled). Jobs are only sent to a free slot, so a live worker
    /// takes them at once.
    pub dispatch_ttl_ms: u64,
    /// A job dispatched this many times without finishing fails with `delivery_limit`.
    pub max_dispatches: u32,
    /// Finished jobs kept in memory (a pipeline counts once, with its jobs). Older ones are
    /// answered from their manifest in storage; their idempotency keys are forgotten with them.
    pub retain_jobs: usize,
    /// Finished jobs older than this (by their final event's time) are forgotten.
    pub retain_age_s: u64,
    /// The active scheduler snapshots its registry after this many events (and at least every
    /// five minutes while events arrive), so a restart replays no more than that.
    pub snapshot_every_events: u64,
    /// The SDXL checkpoint (by the name workers advertise) of generate jobs that name none,
    /// recorded in the job at submission. Unset: such jobs go to any SDXL worker.
    pub default_checkpoint: Option<String>,
    /// A generate naming a checkpoint that workers have advertised (or the model catalogue holds)
    /// but that no live worker serves while other workers of its model are up waits this long
    /// after its last change, then fails with `no_worker`. 0: it waits for as long as it takes. A
    /// name no worker ever advertised and the catalogue does not hold is refused at submission.
    pub checkpoint_wait_s: u64,
    pub dispatch: DispatchConfig,
    /// Origins (`https://studio.example:8443`) whose pages may call the API from a browser (CORS).
    pub cors_origins: Vec<String>,
    /// Largest input image `POST /v1/uploads` takes, in bytes.
    pub upload_max_bytes: usize,
    /// Most pixels (width × height) of an input image, checked from its header before decoding.
    pub upload_max_pixels: u64,
    /// Largest LoRA file `POST /v1/models/loras` takes, in bytes (streamed through a temporary
    /// file, never held in memory).
    pub lora_upload_max_bytes: u64,
    /// How long the image URLs in the API's answers stay valid (signed URLs, presigned S3 URLs).
    pub url_ttl_s: u64,
}

/// The largest `lora_upload_max_bytes` (16 GiB: beyond any LoRA).
const MAX_LORA_UPLOAD: u64 = 16 << 30;

/// How jobs are matched to workers (DESIGN §5).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DispatchConfig {
    pub policy: Policy,
    /// Most jobs in one batch message (a worker's own `max_batch` may lower it); 1 sends one job
    /// per message. Default 8: each job of a message is reported when its own run ends, and a
    /// message of batch work gives its unstarted jobs back when interactive work needs the worker
    /// (a yield), so batch messages keep an input's edits on one worker without holding up
    /// interactive arrivals (docs/performance.md, fleet attempts 4 and 5).
    pub max_batch: u32,
    /// How long an edit waits for the busy worker that holds its input's encodings before any
    /// worker may take it.
    pub affinity_wait_ms: u64,
    /// Edits of an input that arrive this soon after the first are sent with it, in one batch.
    pub coalesce_window_ms: u64,
    /// With this many edits of one input waiting, a second worker takes some (a hot input).
    pub spill_after: u32,
    /// Affinity yields to the least-loaded worker when the holder has more than `imbalance_abs`
    /// jobs more than the least-loaded worker of the model and more than `imbalance_rel` times
    /// its load (SGLang's cache-aware router's rule).
    pub imbalance_abs: u32,
    pub imbalance_rel: f64,
    /// Fair share (DESIGN §7a): at most this many of one person's jobs on workers at once
    /// (dispatched or running); 0, the default, sets no cap.
    pub max_running_per_person: u32,
    /// A person's GPU time per UTC day, in minutes, after which their waiting work waits for the
    /// next day; 0, the default, sets no quota.
    pub daily_gpu_minutes_per_person: u32,
    /// One person's own limits, by name (`[dispatch.person.ann]`), over the two above.
    pub person: BTreeMap<String, PersonLimits>,
}

/// A person's own limits (`[dispatch.person.<name>]`); a key left out takes the farm's, and 0
/// lifts the limit for them.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PersonLimits {
    pub max_running: Option<u32>,
    pub daily_gpu_minutes: Option<u32>,
}

/// The limits that apply to one person (`None`: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_running: Option<u32>,
    pub daily_gpu_minutes: Option<u32>,
}

impl DispatchConfig {
    /// The limits of `person`: their own where set, else the farm's.
    pub fn limits_of(&self, person: &str) -> Limits {
        let own = self.person.get(person);
        let pick = |own: Option<u32>, farm: u32| Some(own.unwrap_or(farm)).filter(|n| *n > 0);
        Limits {
            max_running: pick(own.and_then(|p| p.max_running), self.max_running_per_person),
            daily_gpu_minutes: pick(
                own.and_then(|p| p.daily_gpu_minutes),
                self.daily_gpu_minutes_per_person,
            ),
        }
    }
}

/// Which worker gets a job.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Edits go to the worker holding their input's encodings (batched up to `max_batch`);
    /// compatible generates batch; otherwise the least-loaded worker. The default: on the fleet
    /// benchmark, with one job per message, it matches or beats `least_loaded` on throughput,
    /// encodes and latency by priority on both profiles (docs/performance.md, fleet attempt 2).
    #[default]
    Affinity,
    /// One job per message to the least-loaded worker (the dispatch before affinity; a baseline).
    LeastLoaded,
    /// One job per message to the next worker in turn (a baseline).
    RoundRobin,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Affinity => "affinity",
            Policy::LeastLoaded => "least_loaded",
            Policy::RoundRobin => "round_robin",
        }
    }
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            max_batch: 8,
            affinity_wait_ms: 3_000,
            coalesce_window_ms: 50,
            spill_after: 12,
            imbalance_abs: 8,
            imbalance_rel: 2.0,
            max_running_per_person: 0,
            daily_gpu_minutes_per_person: 0,
            person: BTreeMap::new(),
        }
    }
}

impl DispatchConfig {
    fn validate(&self) -> Result<(), String> {
        if !(1..=64).contains(&self.max_batch) {
            return Err("dispatch.max_batch: must be 1..=64".into());
        }
        if self.affinity_wait_ms > 600_000 {
            return Err("dispatch.affinity_wait_ms: at most 600000".into());
        }
        if self.coalesce_window_ms > 10_000 {
            return Err("dispatch.coalesce_window_ms: at most 10000".into());
        }
        if self.spill_after < 2 {
            return Err("dispatch.spill_after: must be at least 2".into());
        }
        if !(self.imbalance_rel.is_finite() && self.imbalance_rel >= 1.0) {
            return Err("dispatch.imbalance_rel: must be a number of at least 1".into());
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp: AmqpConfig::default(),
            storage: StorageConfig::Local {
                root: "vnfarm-data".into(),
            },
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_token: None,
            heartbeat_timeout_ms: 6_000,
            dispatch_ttl_ms: 15_000,
            max_dispatches: 4,
            retain_jobs: 10_000,
            retain_age_s: 7 * 24 * 3600,
            snapshot_every_events: 5_000,
            default_checkpoint: None,
            checkpoint_wait_s: 900,
            dispatch: DispatchConfig::default(),
            cors_origins: Vec::new(),
            upload_max_bytes: 32 * 1024 * 1024,
            upload_max_pixels: 4096 * 4096,
            lora_upload_max_bytes: 2 << 30,
            url_ttl_s: 3600,
        }
    }
}

/// An origin as a browser sends it: scheme, host, optional port; no path.
fn check_origin(origin: &str) -> Result<(), String> {
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .ok_or_else(|| format!("cors_origins: {origin:?} must start with http:// or https://"))?;
    let host_ok = !rest.is_empty()
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !host_ok {
        return Err(format!(
            "cors_origins: {origin:?} must be scheme://host[:port], with no path or trailing slash"
        ));
    }
    Ok(())
}

impl Config {
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        vnfarm_config::load_validated(file, env)
    }
}

impl vnfarm_config::Validate for Config {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        self.storage.validate("storage")?;
        if !self.listen.ip().is_loopback() && self.api_token.as_deref().unwrap_or("").is_empty() {
            return Err(format!(
                "api_token: required when listen ({}) is not a loopback address",
                self.listen
            ));
        }
        if self.api_token.as_ref().is_some_and(|t| t.len() < 16) {
            return Err("api_token: must be at least 16 characters".into());
        }
        if self.heartbeat_timeout_ms < 500 {
            return Err("heartbeat_timeout_ms: must be at least 500".into());
        }
        if self.dispatch_ttl_ms < 1000 {
            return Err("dispatch_ttl_ms: must be at least 1000".into());
        }
        if !(1..=100).contains(&self.max_dispatches) {
            return Err("max_dispatches: must be 1..=100".into());
        }
        if self.retain_jobs == 0 {
            return Err("retain_jobs: must be at least 1".into());
        }
        if self.retain_age_s < 60 {
            return Err("retain_age_s: must be at least 60".into());
        }
        if self.snapshot_every_events < 100 {
            return Err("snapshot_every_events: must be at least 100".into());
        }
        if let Some(name) = &self.default_checkpoint
            && !vnfarm_proto::spec::is_file_name(name)
        {
            return Err(
                "default_checkpoint: must be a checkpoint name of [A-Za-z0-9._-], not starting with '.'"
                    .into(),
            );
        }
        for origin in &self.cors_origins {
            check_origin(origin)?;
        }
        if !(1024..=256 * 1024 * 1024).contains(&self.upload_max_bytes) {
            return Err("upload_max_bytes: must be 1024..=268435456".into());
        }
        if !(1024..=MAX_LORA_UPLOAD).contains(&self.lora_upload_max_bytes) {
            return Err(format!(
                "lora_upload_max_bytes: must be 1024..={MAX_LORA_UPLOAD}"
            ));
        }
        let most = u64::from(vnfarm_proto::spec::MAX_INPUT_SIDE).pow(2);
        if !(1..=most).contains(&self.upload_max_pixels) {
            return Err(format!("upload_max_pixels: must be 1..={most}"));
        }
        if !(60..=7 * 24 * 3600).contains(&self.url_ttl_s) {
            return Err("url_ttl_s: must be 60..=604800".into());
        }
        self.dispatch.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_valid() {
        Config::load(None, env(&[])).unwrap();
    }

    /// The values a missing key takes, from an empty file and from a file with only a section.
    #[test]
    fn an_empty_file_takes_the_documented_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("scheduler.toml");
        for text in ["", "[dispatch]\n"] {
            std::fs::write(&path, text).unwrap();
            let c = Config::load(Some(&path), env(&[])).unwrap();
            assert_eq!(c.listen, "127.0.0.1:8080".parse::<SocketAddr>().unwrap());
            assert!(
                matches!(&c.storage, StorageConfig::Local { root } if root.as_os_str() == "vnfarm-data")
            );
            assert_eq!(c.api_token, None);
            assert_eq!(
                (c.heartbeat_timeout_ms, c.dispatch_ttl_ms, c.max_dispatches),
                (6_000, 15_000, 4)
            );
            assert_eq!(
                (c.retain_jobs, c.retain_age_s, c.snapshot_every_events),
                (10_000, 604_800, 5_000)
            );
            assert_eq!(c.default_checkpoint, None);
            assert!(c.cors_origins.is_empty());
            assert_eq!(
                (c.upload_max_bytes, c.upload_max_pixels, c.url_ttl_s),
                (33_554_432, 16_777_216, 3600)
            );
            assert_eq!(c.lora_upload_max_bytes, 2_147_483_648);
            let d = &c.dispatch;
            assert_eq!(d.policy, Policy::Affinity);
            assert_eq!(
                (d.max_batch, d.affinity_wait_ms, d.coalesce_window_ms),
                (8, 3_000, 50)
            );
            assert_eq!(
                (d.spill_after, d.imbalance_abs, d.imbalance_rel),
                (12, 8, 2.0)
            );
        }
    }

    #[test]
    fn a_persons_own_limits_override_the_farms() {
        let c = Config::load(
            None,
            env(&[
                ("VNFARM_DISPATCH__MAX_RUNNING_PER_PERSON", "3"),
                ("VNFARM_DISPATCH__DAILY_GPU_MINUTES_PER_PERSON", "120"),
                ("VNFARM_DISPATCH__PERSON__ANN__MAX_RUNNING", "0"),
                ("VNFARM_DISPATCH__PERSON__BO__DAILY_GPU_MINUTES", "30"),
            ]),
        )
        .unwrap();
        let limits = |name| c.dispatch.limits_of(name);
        assert_eq!(
            limits("ann"),
            Limits {
                max_running: None,
                daily_gpu_minutes: Some(120)
            },
            "0 lifts a limit for one person"
        );
        assert_eq!(
            limits("bo"),
            Limits {
                max_running: Some(3),
                daily_gpu_minutes: Some(30)
            }
        );
        assert_eq!(limits("cy"), limits("admin"));
        assert_eq!(
            Config::load(None, env(&[]))
                .unwrap()
                .dispatch
                .limits_of("x"),
            Limits::default()
        );
    }

    #[test]
    fn public_listen_needs_a_token() {
        let e = Config::load(None, env(&[("VNFARM_LISTEN", "0.0.0.0:8080")])).unwrap_err();
        assert!(e.to_string().starts_with("api_token: required"), "{e}");
        Config::load(
            None,
            env(&[
                ("VNFARM_LISTEN", "0.0.0.0:8080"),
                ("VNFARM_API_TOKEN", "0123456789abcdef"),
            ]),
        )
        .unwrap();
    }

    #[test]
    fn cors_origins_are_origins() {
        let ok = Config::load(
            None,
            env(&[("VNFARM_CORS_ORIGINS", r#"["https://studio.example:8443"]"#)]),
        );
        assert_eq!(ok.unwrap().cors_origins, ["https://studio.example:8443"]);
        for bad in [
            r#"["studio.example"]"#,
            r#"["https://studio.example/"]"#,
            r#"["*"]"#,
        ] {
            let e = Config::load(None, env(&[("VNFARM_CORS_ORIGINS", bad)])).unwrap_err();
            assert!(e.to_string().starts_with("cors_origins"), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = Config::load(None, env(&[("VNFARM_STORAGE__BACKEND", "s3")])).unwrap_err();
        assert!(e.to_string().contains("bucket"), "{e}");
        let e = Config::load(None, env(&[("VNFARM_AMQP__URL", "http://x")])).unwrap_err();
        assert!(e.to_string().starts_with("amqp.url"), "{e}");
    }
}
