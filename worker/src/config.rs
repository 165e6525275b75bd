//! The worker's typed configuration, validated before any I/O.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use vnfarm_bus::AmqpConfig;
use vnfarm_config::ConfigError;
use vnfarm_proto::{ModelFamily, WorkerId};
use vnfarm_storage::StorageConfig;

use crate::engine::EngineConfig;
use crate::engine::shared_encodings::SharedEncodingsConfig;
use crate::model_cache::ModelCacheConfig;

/// Every key may be left out: `#[serde(default)]` takes it from [`Config::default`].
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// This worker's name; its queue is `<prefix>.worker.<id>`. Defaults to the host name.
    pub worker_id: String,
    pub amqp: AmqpConfig,
    pub storage: StorageConfig,
    pub engine: EngineConfig,
    /// Edit encodings published to and fetched from storage, so that the fleet encodes an input
    /// about once (see `engine::shared_encodings`).
    pub shared_encodings: SharedEncodingsConfig,
    /// Address of `/metrics` and `/healthz`. Port 0 picks a free port.
    pub listen: SocketAddr,
    pub heartbeat_interval_ms: u64,
    /// Jobs the broker may hand this worker before it acknowledges one (its queue's prefetch).
    /// A batch message counts as one.
    pub prefetch: u16,
    /// The most jobs one work message may carry to this worker (advertised as `max_batch`): the
    /// scheduler coalesces edits of the same input, and compatible generates, into batch messages
    /// up to this size, which the engine runs together. 1 turns batching off.
    pub batch_jobs: u32,
    /// After SIGTERM, how long the job in hand may run before it is interrupted and requeued.
    pub drain_grace_s: u64,
    /// Storage operations are tried this many times while storage is unavailable, 200 ms apart and
    /// twice as long each time up to 5 s (`vnfarm_storage::Retries`), before the job is requeued.
    pub storage_attempts: u32,
    /// Where the sha256 of model files persists (`model-hashes.json`), so that a restarted worker
    /// does not hash its checkpoints again.
    pub hash_cache_dir: PathBuf,
    /// Files of the model catalogue fetched for jobs that name them (DESIGN §7b): where, and how
    /// many bytes at most.
    pub model_cache: ModelCacheConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            worker_id: host_name(),
            amqp: AmqpConfig::default(),
            storage: StorageConfig::Local {
                root: "vnfarm-data".into(),
            },
            engine: EngineConfig::default(),
            shared_encodings: SharedEncodingsConfig::default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 9101)),
            heartbeat_interval_ms: 2_000,
            prefetch: 1,
            batch_jobs: 8,
            drain_grace_s: 600,
            storage_attempts: 5,
            hash_cache_dir: "vnfarm-cache".into(),
            model_cache: ModelCacheConfig::default(),
        }
    }
}

/// The host's name as a worker id (lower case, letters, digits and `-`), else `worker`.
fn host_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let id: String = host
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    if id.is_empty() { "worker".into() } else { id }
}

impl Config {
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        vnfarm_config::load_validated(file, env)
    }

    pub fn worker_id(&self) -> WorkerId {
        WorkerId::try_from(self.worker_id.clone()).expect("validated in Config::validate")
    }

    pub fn models(&self) -> Vec<ModelFamily> {
        self.engine.models()
    }
}

impl vnfarm_config::Validate for Config {
    fn validate(&self) -> Result<(), String> {
        WorkerId::try_from(self.worker_id.clone()).map_err(|e| format!("worker_id: {e}"))?;
        self.amqp.validate()?;
        self.storage.validate("storage")?;
        self.engine.validate()?;
        self.shared_encodings.validate()?;
        if self.heartbeat_interval_ms < 100 {
            return Err("heartbeat_interval_ms: must be at least 100".into());
        }
        if !(1..=64).contains(&self.prefetch) {
            return Err("prefetch: must be 1..=64".into());
        }
        if !(1..=64).contains(&self.batch_jobs) {
            return Err("batch_jobs: must be 1..=64".into());
        }
        if self.storage_attempts == 0 {
            return Err("storage_attempts: must be at least 1".into());
        }
        self.model_cache.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::device::Dtype;
    use crate::engine::qwen_edit::SchedulerChoice;
    use crate::engine::sdxl::VaeTiling;
    use crate::engine::{EsrganConfig, QwenEditEngineConfig, SdxlConfig, TestPatternConfig};

    fn load(toml: &str) -> Config {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.toml");
        std::fs::write(&path, toml).unwrap();
        Config::load(Some(&path), Vec::new()).unwrap()
    }

    /// What a worker runs with when its file says nothing (deploy/worker.toml and the README's
    /// table state these).
    #[test]
    fn an_empty_file_gives_the_documented_defaults() {
        let c = load("");
        // The host name, made a valid worker id.
        assert!(
            WorkerId::try_from(c.worker_id.clone()).is_ok(),
            "{}",
            c.worker_id
        );
        assert_eq!(
            c.storage,
            StorageConfig::Local {
                root: "vnfarm-data".into()
            }
        );
        assert_eq!(c.listen, SocketAddr::from(([127, 0, 0, 1], 9101)));
        assert_eq!(c.heartbeat_interval_ms, 2_000);
        assert_eq!(c.prefetch, 1);
        assert_eq!(c.batch_jobs, 8);
        assert_eq!(c.drain_grace_s, 600);
        assert_eq!(c.storage_attempts, 5);
        assert_eq!(c.hash_cache_dir, PathBuf::from("vnfarm-cache"));
        assert_eq!(
            c.model_cache,
            ModelCacheConfig {
                dir: "vnfarm-models".into(),
                max_bytes: 100 << 30
            }
        );
        assert!(c.shared_encodings.enabled);
        assert_eq!(c.shared_encodings.fetch_timeout_ms, 2_000);
        assert_eq!(c.engine, EngineConfig::default());
        assert_eq!(
            c.engine.test_pattern,
            TestPatternConfig {
                step_ms: 20,
                edit_step_ms: None,
                encode_ms: 30,
                decode_ms: 30,
                encode_cache_entries: 32,
                encoding_kib: 2048,
                batch_step_cost: 1.0,
                area_scaling: 0.0,
                load_ms: 0,
                checkpoints: Vec::new(),
                catalogue_checkpoints: 0,
                loras: None,
                model_files: Vec::new(),
                device_failure_prompt: None,
                gpu_memory_mib: None,
                gpu_memory_used_mib: 0,
            }
        );
    }

    #[test]
    fn a_model_section_names_its_files_and_the_rest_is_defaulted() {
        let c = load(
            "[engine.sdxl]\ncheckpoint = \"/m/sdxl.safetensors\"\n\
             [engine.qwen_edit]\nmodel_dir = \"/m/qwen\"\n\
             [[engine.qwen_edit.loras]]\npath = \"/m/lightning.safetensors\"\n\
             [engine.esrgan]\nmodel = \"/m/x4.pth\"\n",
        );
        let sdxl: &SdxlConfig = c.engine.sdxl.as_ref().unwrap();
        assert_eq!(sdxl.device, "cuda");
        assert_eq!((sdxl.dtype, sdxl.vae_dtype), (Dtype::Bf16, Dtype::Bf16));
        assert_eq!(sdxl.vae_tiling, VaeTiling::Auto);
        assert_eq!(sdxl.warm_up, [[1024, 1024]]);
        assert_eq!(sdxl.max_batch, 4);
        assert_eq!(
            (&sdxl.name, &sdxl.settings, &sdxl.lora_dir),
            (&None, &None, &None)
        );
        let qwen: &QwenEditEngineConfig = c.engine.qwen_edit.as_ref().unwrap();
        assert_eq!(qwen.device, "cuda");
        assert_eq!(qwen.scheduler, SchedulerChoice::Lightning);
        assert_eq!(qwen.warm_up, [[1024, 1024]]);
        assert_eq!(qwen.max_batch, 1);
        assert_eq!(qwen.encode_cache_mib, 2048);
        assert_eq!(qwen.condition_image_area, 384 * 384);
        assert_eq!(qwen.vae_image_area, 1024 * 1024);
        assert_eq!(qwen.loras[0].strength, 1.0);
        assert_eq!(
            (
                &qwen.transformer,
                &qwen.text_encoder,
                &qwen.vae,
                &qwen.config_dir
            ),
            (&None, &None, &None, &None)
        );
        let esrgan: &EsrganConfig = c.engine.esrgan.as_ref().unwrap();
        assert_eq!(esrgan.device, "cuda");
        assert_eq!(esrgan.dtype, Dtype::Fp16);
        assert_eq!(esrgan.max_batch, 1);
        assert_eq!(esrgan.pre_pad, 0);
    }
}
