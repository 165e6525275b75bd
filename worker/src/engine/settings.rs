//! Which settings the configured engines run: each engine's configured choice (by default the
//! portable preset), or the box's settings file verified against this box (its device, libtorch
//! build and model files); and what the heartbeat then says ([`vnfarm_proto::SettingsInUse`]).
//! The values, the file and its fingerprint are [`crate::tuning`]'s.

use std::collections::BTreeMap;
use std::path::Path;

use vnfarm_models::settings::{EsrganSettings, QwenSettings, SdxlSettings};
use vnfarm_proto::{SettingsInUse, SettingsSource};

use crate::tuning::fingerprint::{self, DeviceIdentity};
use crate::tuning::{self, BoxSettings, SettingsFileError};

use super::device::parse_device;
use super::{EngineConfig, UsedFile};

/// Each configured engine's settings, from the settings file (verified against this box) or from
/// the configuration.
pub(crate) struct EngineSettings {
    pub sdxl: SdxlSettings,
    pub qwen_edit: QwenSettings,
    pub esrgan: EsrganSettings,
    pub in_use: SettingsInUse,
}

impl EngineSettings {
    pub fn choose(config: &EngineConfig) -> anyhow::Result<Self> {
        let Some(path) = &config.settings_file else {
            return Ok(Self {
                sdxl: config
                    .sdxl
                    .as_ref()
                    .and_then(|c| c.settings)
                    .map_or_else(Default::default, |s| s.resolve()),
                qwen_edit: config
                    .qwen_edit
                    .as_ref()
                    .and_then(|c| c.settings)
                    .map_or_else(Default::default, |s| s.resolve()),
                esrgan: config
                    .esrgan
                    .as_ref()
                    .and_then(|c| c.settings)
                    .map_or_else(Default::default, |s| s.resolve()),
                in_use: presets_in_use(config),
            });
        };
        let mut loaded = BoxSettings::read(path)?;
        let device = device_of(config);
        if let tch::Device::Cuda(_) = device {
            anyhow::ensure!(
                tch::Cuda::is_available(),
                "engine.settings_file: no GPU is visible to libtorch to compare with the file's"
            );
        }
        let models = model_identities(config)
            .map_err(|e| anyhow::anyhow!("engine.settings_file: reading the model files: {e}"))?;
        loaded.verify(path, &DeviceIdentity::of(device), &models)?;
        if let Some(warning) = &loaded.warning {
            tracing::warn!(file = %path.display(), "{warning}");
        }
        let missing = |engine: &str| SettingsFileError::Missing {
            path: path.clone(),
            engine: engine.to_owned(),
        };
        let s = &loaded.settings;
        let sdxl = match (&config.sdxl, s.sdxl) {
            (Some(_), None) => return Err(missing("sdxl").into()),
            (_, found) => found.unwrap_or_default(),
        };
        let qwen_edit = match (&config.qwen_edit, s.qwen_edit) {
            (Some(_), None) => return Err(missing("qwen_edit").into()),
            (_, found) => found.unwrap_or_default(),
        };
        let esrgan = match (&config.esrgan, s.esrgan) {
            (Some(_), None) => return Err(missing("esrgan").into()),
            (_, found) => found.unwrap_or_default(),
        };
        tracing::info!(
            file = %path.display(),
            id = %loaded.id,
            measured_at = %s.measured_at,
            ?sdxl,
            ?qwen_edit,
            ?esrgan,
            "engine settings from the box's settings file"
        );
        Ok(Self {
            sdxl,
            qwen_edit,
            esrgan,
            in_use: tuning::file_in_use(&loaded),
        })
    }
}

/// What the heartbeat says when no file is used: each configured engine's preset.
pub fn presets_in_use(config: &EngineConfig) -> SettingsInUse {
    let mut names = Vec::new();
    if let Some(c) = &config.sdxl {
        names.push(format!(
            "sdxl={}",
            c.settings.as_ref().map_or("portable", |s| s.name())
        ));
    }
    if let Some(c) = &config.qwen_edit {
        names.push(format!(
            "qwen_edit={}",
            c.settings.as_ref().map_or("portable", |s| s.name())
        ));
    }
    if let Some(c) = &config.esrgan {
        names.push(format!(
            "esrgan={}",
            c.settings.as_ref().map_or("portable", |s| s.name())
        ));
    }
    SettingsInUse {
        source: SettingsSource::Presets,
        id: names.join(" "),
        measured_at: None,
        warning: None,
    }
}

/// The device the models run on, as the engines open it: the first configured engine's (SDXL,
/// Qwen, Real-ESRGAN), the CPU where none names a GPU.
pub fn device_of(config: &EngineConfig) -> tch::Device {
    let sdxl = config.sdxl.iter().map(|c| c.device.as_str());
    let qwen = config.qwen_edit.iter().map(|c| c.device.as_str());
    let esrgan = config.esrgan.iter().map(|c| c.device.as_str());
    sdxl.chain(qwen)
        .chain(esrgan)
        .find_map(|name| parse_device(name).ok())
        .unwrap_or(tch::Device::Cpu)
}

/// Each configured engine's model files, as a fingerprint lists them.
pub fn model_identities(
    config: &EngineConfig,
) -> std::io::Result<BTreeMap<String, Vec<fingerprint::ModelFileIdentity>>> {
    let mut models = BTreeMap::new();
    let mut add = |engine: &str, files: Vec<UsedFile>| -> std::io::Result<()> {
        let ids = files
            .iter()
            .map(|f| fingerprint::ModelFileIdentity::of(Path::new(&f.path)))
            .collect::<std::io::Result<Vec<_>>>()?;
        models.insert(engine.to_owned(), ids);
        Ok(())
    };
    if let Some(c) = &config.sdxl {
        add("sdxl", c.files())?;
    }
    if let Some(c) = &config.qwen_edit {
        add("qwen_edit", c.files())?;
    }
    if let Some(c) = &config.esrgan {
        add("esrgan", c.files())?;
    }
    Ok(models)
}
