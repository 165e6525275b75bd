//! Which kernel and layout settings each engine runs, and where they came from.
//!
//! - [`choice`]: an engine's `settings` key in the configuration (a preset's name or a table);
//! - [`file`]: the settings file `vnfarm-worker check` writes, its format and its verification;
//! - [`fingerprint`]: what a file was measured on (device, libtorch build, model files, vnfarm).
//!
//! With `engine.settings_file` set, the file decides every configured engine's settings and the
//! configuration may name none; without it, each engine runs its configured choice, by default
//! the portable preset. Either way the worker reports what it runs in its heartbeat
//! ([`vnfarm_proto::SettingsInUse`]).

pub mod choice;
pub mod file;
pub mod fingerprint;

use std::collections::BTreeMap;
use std::path::Path;

pub use choice::SettingsChoice;
pub use file::{BoxSettings, LoadedSettings, SettingsFileError};
use vnfarm_proto::{SettingsInUse, SettingsSource};

use crate::engine::EngineConfig;

/// Sets the variables a settings file chose, before libtorch starts (call it first in `main`,
/// before any thread exists). A variable the operator set is left alone and logged, since their
/// word wins over a measurement. Reading errors are left to the engine's load, which reports them.
#[allow(unsafe_code)]
pub fn apply_environment(config: &EngineConfig) -> Vec<String> {
    let Some(path) = &config.settings_file else {
        return Vec::new();
    };
    let Ok(loaded) = BoxSettings::read(path) else {
        return Vec::new();
    };
    let mut notes = Vec::new();
    for (key, value) in &loaded.settings.environment {
        match std::env::var(key) {
            Ok(own) if &own != value => notes.push(format!(
                "{key}={own} is set; the settings file measured {key}={value}"
            )),
            Ok(_) => {}
            Err(_) => {
                // SAFETY: called at the start of `main`, before the async runtime, the engine
                // thread or anything else that could read the environment concurrently exists.
                unsafe { std::env::set_var(key, value) };
                notes.push(format!("{key}={value} (from the settings file)"));
            }
        }
    }
    notes
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

/// What the heartbeat says for a verified file.
pub fn file_in_use(loaded: &LoadedSettings) -> SettingsInUse {
    SettingsInUse {
        source: SettingsSource::Measured,
        id: loaded.id.clone(),
        measured_at: Some(loaded.settings.measured_at),
        warning: loaded.warning.clone(),
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
        .find_map(|name| crate::engine::device::parse_device(name).ok())
        .unwrap_or(tch::Device::Cpu)
}

/// Each configured engine's model files, as a fingerprint lists them.
pub fn model_identities(
    config: &EngineConfig,
) -> std::io::Result<BTreeMap<String, Vec<fingerprint::ModelFileIdentity>>> {
    let mut models = BTreeMap::new();
    let mut add = |engine: &str, files: Vec<crate::engine::UsedFile>| -> std::io::Result<()> {
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
