//! The `[engine]` configuration: which implementation serves which model families, each model's
//! section, and the settings file; validated before anything loads.

use std::path::PathBuf;

use serde::Deserialize;
use vnfarm_proto::ModelFamily;

use super::device::parse_device;
use super::esrgan::EsrganConfig;
use super::files::UsedFile;
use super::lora_dir::AdvertisedLoras;
use super::qwen_edit::QwenEditEngineConfig;
use super::sdxl::SdxlConfig;
use super::test_pattern::TestPatternConfig;

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Which implementation serves the models. Unset: `tch` when a model section (`sdxl`,
    /// `qwen_edit`, `esrgan`) is configured, else `test_pattern`.
    #[serde(default)]
    pub kind: Option<EngineKind>,
    /// Model families this worker serves (and advertises in its heartbeat). Unset: every family
    /// for `test_pattern`, the configured ones for `tch`.
    #[serde(default)]
    pub models: Option<Vec<ModelFamily>>,
    #[serde(default)]
    pub test_pattern: TestPatternConfig,
    /// SDXL on libtorch, for `generate` jobs.
    #[serde(default)]
    pub sdxl: Option<SdxlConfig>,
    /// Qwen-Image-Edit-2509 on libtorch, for `edit` jobs. A worker may hold it and SDXL at once.
    #[serde(default)]
    pub qwen_edit: Option<QwenEditEngineConfig>,
    /// Real-ESRGAN on libtorch, for `upscale` jobs (and pipelines' upscales).
    #[serde(default)]
    pub esrgan: Option<EsrganConfig>,
    /// The settings file `vnfarm-worker check` wrote on this box: it decides every configured
    /// engine's settings (and sets the process variables it measured), and is refused when it was
    /// measured on another device, libtorch build or model files. Unset: each engine's `settings`
    /// (by default the portable preset).
    #[serde(default)]
    pub settings_file: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Deterministic CPU images; a fixture for exercising the job system without weights.
    TestPattern,
    /// The models, natively on libtorch.
    Tch,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::TestPattern => "test-pattern",
            EngineKind::Tch => "tch",
        }
    }
}

impl EngineConfig {
    pub fn kind(&self) -> EngineKind {
        let any_model = self.sdxl.is_some() || self.qwen_edit.is_some() || self.esrgan.is_some();
        self.kind.unwrap_or(if any_model {
            EngineKind::Tch
        } else {
            EngineKind::TestPattern
        })
    }

    /// The families with a configured model (`tch`).
    fn configured(&self) -> Vec<ModelFamily> {
        let sdxl = self.sdxl.iter().map(|_| ModelFamily::Sdxl);
        let qwen = self.qwen_edit.iter().map(|_| ModelFamily::QwenEdit);
        let esrgan = self.esrgan.iter().map(|_| ModelFamily::Esrgan);
        sdxl.chain(qwen).chain(esrgan).collect()
    }

    pub fn models(&self) -> Vec<ModelFamily> {
        match (&self.models, self.kind()) {
            (Some(models), _) => models.clone(),
            (None, EngineKind::TestPattern) => ModelFamily::ALL.to_vec(),
            (None, EngineKind::Tch) => self.configured(),
        }
    }

    /// The SDXL checkpoints this worker holds, by name (advertised in heartbeats).
    pub fn checkpoints(&self) -> Vec<String> {
        match self.kind() {
            EngineKind::TestPattern => self.test_pattern.checkpoints.clone(),
            EngineKind::Tch => self.sdxl.iter().map(SdxlConfig::name).collect(),
        }
    }

    /// How many checkpoints of the model catalogue it keeps loaded besides its own (advertised
    /// in heartbeats; 0: it serves only its own): `engine.sdxl.catalogue_checkpoints`, or the
    /// test-pattern engine's claim.
    pub fn catalogue_checkpoints(&self) -> u32 {
        match self.kind() {
            EngineKind::TestPattern => self.test_pattern.catalogue_checkpoints,
            EngineKind::Tch => self.sdxl.as_ref().map_or(0, |c| c.catalogue_checkpoints),
        }
    }

    /// The LoRA names it advertises: the files of its engines' `lora_dir`s, or what the
    /// test-pattern engine claims.
    pub fn advertised_loras(&self) -> AdvertisedLoras {
        match self.kind() {
            EngineKind::TestPattern => AdvertisedLoras::Claimed(self.test_pattern.loras.clone()),
            EngineKind::Tch => {
                let sdxl = self.sdxl.iter().filter_map(|c| c.lora_dir.clone());
                let qwen = self.qwen_edit.iter().filter_map(|c| c.lora_dir.clone());
                AdvertisedLoras::Folders(sdxl.chain(qwen).collect())
            }
        }
    }

    /// Every file the configured engines load (what the worker starts hashing at once); jobs may
    /// add their LoRAs.
    pub fn files(&self) -> Vec<UsedFile> {
        match self.kind() {
            EngineKind::TestPattern => self.test_pattern.files(),
            EngineKind::Tch => {
                let sdxl = self.sdxl.iter().flat_map(SdxlConfig::files);
                let qwen = self.qwen_edit.iter().flat_map(QwenEditEngineConfig::files);
                let esrgan = self.esrgan.iter().flat_map(EsrganConfig::files);
                sdxl.chain(qwen).chain(esrgan).collect()
            }
        }
    }

    /// The GPU the models run on, if any: the first configured model's `cuda:N`.
    pub fn gpu(&self) -> Option<usize> {
        if self.kind() == EngineKind::TestPattern {
            return None;
        }
        let sdxl = self.sdxl.iter().map(|c| c.device.as_str());
        let qwen = self.qwen_edit.iter().map(|c| c.device.as_str());
        sdxl.chain(qwen).find_map(|name| match parse_device(name) {
            Ok(tch::Device::Cuda(n)) => Some(n),
            Ok(_) | Err(_) => None,
        })
    }

    pub fn validate(&self) -> Result<(), String> {
        let models = self.models();
        if models.is_empty() {
            return Err(match self.kind() {
                EngineKind::TestPattern => {
                    "engine.models: a worker must serve at least one model family".into()
                }
                EngineKind::Tch => "engine: the tch engine needs a model section \
                                    (engine.sdxl.checkpoint = \"/path/to/model.safetensors\", \
                                    engine.qwen_edit or engine.esrgan)"
                    .into(),
            });
        }
        if self.kind() == EngineKind::Tch {
            let configured = self.configured();
            if let Some(missing) = models.iter().find(|m| !configured.contains(m)) {
                return Err(format!(
                    "engine.models: `{}` has no model configured for the tch engine \
                     (configured: {})",
                    missing.as_str(),
                    configured
                        .iter()
                        .map(|m| m.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        if self.settings_file.is_some() {
            let named = [
                (
                    "sdxl",
                    self.sdxl.as_ref().is_some_and(|c| c.settings.is_some()),
                ),
                (
                    "qwen_edit",
                    self.qwen_edit
                        .as_ref()
                        .is_some_and(|c| c.settings.is_some()),
                ),
                (
                    "esrgan",
                    self.esrgan.as_ref().is_some_and(|c| c.settings.is_some()),
                ),
            ];
            if let Some((engine, _)) = named.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "engine.{engine}.settings: engine.settings_file decides the settings; \
                     remove one of the two"
                ));
            }
        }
        if let Some(sdxl) = &self.sdxl {
            sdxl.validate()?;
        }
        if let Some(qwen) = &self.qwen_edit {
            qwen.validate()?;
        }
        if let Some(esrgan) = &self.esrgan {
            esrgan.validate()?;
        }
        self.test_pattern.validate()
    }
}
