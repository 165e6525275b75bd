//! The settings file `vnfarm-worker check` writes and the worker loads (`engine.settings_file`):
//! each engine's measured settings, the process environment the measurement chose (ROCm
//! variables), and the fingerprint of what it was measured on.
//!
//! A worker refuses a file measured on another device, another libtorch build or other model files
//! (the measurement says nothing about them), and one of a format it does not know. A file written
//! by another vnfarm build is used with a warning, which the heartbeat carries, saying to re-run the
//! check.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vnfarm_models::settings::{EsrganSettings, QwenSettings, SdxlSettings};

use super::fingerprint::{DeviceIdentity, ModelFileIdentity, libtorch_build, vnfarm_build};

/// The `format` this version writes and reads.
pub const FORMAT: &str = "vnfarm-box-settings/1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoxSettings {
    pub format: String,
    pub measured_at: DateTime<Utc>,
    pub fingerprint: Fingerprint,
    /// Variables the worker sets before libtorch starts (unless the operator set them).
    #[serde(default)]
    pub environment: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdxl: Option<SdxlSettings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qwen_edit: Option<QwenSettings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub esrgan: Option<EsrganSettings>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fingerprint {
    pub device: DeviceIdentity,
    pub libtorch: String,
    pub vnfarm: String,
    /// Each measured engine's model files.
    pub models: BTreeMap<String, Vec<ModelFileIdentity>>,
}

/// Why a settings file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SettingsFileError {
    #[error("engine.settings_file: cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("engine.settings_file: {path} is not a settings file of this version ({reason})")]
    Format { path: PathBuf, reason: String },
    #[error(
        "engine.settings_file: {path} was measured on {measured} and this box has {here}; \
         run `vnfarm-worker check` on this box and point engine.settings_file at what it writes"
    )]
    Foreign {
        path: PathBuf,
        measured: String,
        here: String,
    },
    #[error(
        "engine.settings_file: {path} has no settings for {engine}; run `vnfarm-worker check` with this configuration"
    )]
    Missing { path: PathBuf, engine: String },
}

/// A loaded file, with its id and any warning.
#[derive(Clone, Debug)]
pub struct LoadedSettings {
    pub settings: BoxSettings,
    /// The first 12 hex digits of the file's sha256.
    pub id: String,
    pub warning: Option<String>,
}

impl BoxSettings {
    /// Reads and parses a file, checking its format (not its fingerprint: see [`verify`]).
    ///
    /// [`verify`]: LoadedSettings::verify
    pub fn read(path: &Path) -> Result<LoadedSettings, SettingsFileError> {
        let bytes = std::fs::read(path).map_err(|source| SettingsFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let format_error = |reason: String| SettingsFileError::Format {
            path: path.to_path_buf(),
            reason,
        };
        // The format first, so that a newer file is reported as such and not by its first new key.
        let head: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| format_error(e.to_string()))?;
        match head.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(format_error(format!(
                    "format {other}, this worker reads {FORMAT}"
                )));
            }
            None => return Err(format_error("no `format`".into())),
        }
        let settings: BoxSettings = serde_path_to_error::deserialize(head)
            .map_err(|e| format_error(format!("{}: {}", e.path(), e.inner())))?;
        let id = hex::encode(Sha256::digest(&bytes))[..12].to_owned();
        Ok(LoadedSettings {
            settings,
            id,
            warning: None,
        })
    }

    pub fn write(&self, path: &Path) -> std::io::Result<String> {
        let mut text = serde_json::to_string_pretty(self).expect("settings serialize to JSON");
        text.push('\n');
        std::fs::write(path, &text)?;
        Ok(hex::encode(Sha256::digest(text.as_bytes()))[..12].to_owned())
    }
}

impl LoadedSettings {
    /// Compares the file's fingerprint with this box: `device` as libtorch opened it, this
    /// process's libtorch and vnfarm builds, and `models`, each engine's files as configured.
    /// Another device, libtorch or model file refuses the file; another vnfarm build sets the
    /// warning.
    pub fn verify(
        &mut self,
        path: &Path,
        device: &DeviceIdentity,
        models: &BTreeMap<String, Vec<ModelFileIdentity>>,
    ) -> Result<(), SettingsFileError> {
        let fp = &self.settings.fingerprint;
        let foreign = |measured: String, here: String| SettingsFileError::Foreign {
            path: path.to_path_buf(),
            measured,
            here,
        };
        if &fp.device != device {
            return Err(foreign(describe(&fp.device), describe(device)));
        }
        let libtorch = libtorch_build();
        if fp.libtorch != libtorch {
            return Err(foreign(
                format!("libtorch {}", fp.libtorch),
                format!("libtorch {libtorch}"),
            ));
        }
        for (engine, files) in models {
            let Some(measured) = fp.models.get(engine) else {
                return Err(SettingsFileError::Missing {
                    path: path.to_path_buf(),
                    engine: engine.clone(),
                });
            };
            let samples = |f: &[ModelFileIdentity]| {
                let mut s: Vec<String> = f.iter().map(|m| m.sample.clone()).collect();
                s.sort();
                s
            };
            if samples(measured) != samples(files) {
                let list = |f: &[ModelFileIdentity]| {
                    f.iter()
                        .map(|m| m.path.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(foreign(
                    format!("{engine} files {}", list(measured)),
                    format!("other {engine} files ({})", list(files)),
                ));
            }
        }
        let vnfarm = vnfarm_build();
        if fp.vnfarm != vnfarm {
            self.warning = Some(format!(
                "measured with vnfarm {} and run by {vnfarm}: re-run `vnfarm-worker check`",
                fp.vnfarm
            ));
        }
        Ok(())
    }
}

fn describe(d: &DeviceIdentity) -> String {
    format!("{} {} ({})", d.backend.name(), d.name, d.arch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::fingerprint::Backend;

    fn sample_file(dir: &Path) -> (BoxSettings, PathBuf) {
        let device = DeviceIdentity::of(tch::Device::Cpu);
        let model = dir.join("model.safetensors");
        std::fs::write(&model, b"weights").unwrap();
        let models = BTreeMap::from([(
            "sdxl".to_owned(),
            vec![ModelFileIdentity::of(&model).unwrap()],
        )]);
        let settings = BoxSettings {
            format: FORMAT.into(),
            measured_at: Utc::now(),
            fingerprint: Fingerprint {
                device,
                libtorch: libtorch_build(),
                vnfarm: vnfarm_build(),
                models,
            },
            environment: BTreeMap::new(),
            sdxl: Some(SdxlSettings::default()),
            qwen_edit: None,
            esrgan: None,
        };
        (settings, model)
    }

    #[test]
    fn a_file_for_this_box_verifies_and_a_foreign_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (settings, model) = sample_file(dir.path());
        let path = dir.path().join("settings.json");
        let id = settings.write(&path).unwrap();
        let here = DeviceIdentity::of(tch::Device::Cpu);
        let models = BTreeMap::from([(
            "sdxl".to_owned(),
            vec![ModelFileIdentity::of(&model).unwrap()],
        )]);
        let mut loaded = BoxSettings::read(&path).unwrap();
        assert_eq!(loaded.id, id);
        loaded.verify(&path, &here, &models).unwrap();
        assert_eq!(loaded.warning, None);

        let gpu = DeviceIdentity {
            backend: Backend::Cuda,
            name: "NVIDIA H200".into(),
            arch: "sm_90".into(),
        };
        let e = loaded.verify(&path, &gpu, &models).unwrap_err().to_string();
        assert!(
            e.contains("NVIDIA H200") && e.contains("vnfarm-worker check"),
            "{e}"
        );

        std::fs::write(&model, b"other weights").unwrap();
        let changed = BTreeMap::from([(
            "sdxl".to_owned(),
            vec![ModelFileIdentity::of(&model).unwrap()],
        )]);
        let e = loaded
            .verify(&path, &here, &changed)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sdxl files"), "{e}");

        let qwen = BTreeMap::from([("qwen_edit".to_owned(), vec![])]);
        let e = loaded.verify(&path, &here, &qwen).unwrap_err().to_string();
        assert!(e.contains("no settings for qwen_edit"), "{e}");
    }

    #[test]
    fn another_vnfarm_build_only_warns() {
        let dir = tempfile::tempdir().unwrap();
        let (mut settings, model) = sample_file(dir.path());
        settings.fingerprint.vnfarm = "0.0.1 (0000000)".into();
        let path = dir.path().join("settings.json");
        settings.write(&path).unwrap();
        let mut loaded = BoxSettings::read(&path).unwrap();
        let models = BTreeMap::from([(
            "sdxl".to_owned(),
            vec![ModelFileIdentity::of(&model).unwrap()],
        )]);
        loaded
            .verify(&path, &DeviceIdentity::of(tch::Device::Cpu), &models)
            .unwrap();
        let w = loaded.warning.unwrap();
        assert!(w.contains("0.0.1") && w.contains("re-run"), "{w}");
    }

    #[test]
    fn a_newer_format_or_a_broken_file_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settings.json");
        std::fs::write(&path, r#"{"format": "vnfarm-box-settings/2"}"#).unwrap();
        let e = BoxSettings::read(&path).unwrap_err().to_string();
        assert!(e.contains("vnfarm-box-settings/2"), "{e}");
        std::fs::write(&path, "{not json").unwrap();
        assert!(matches!(
            BoxSettings::read(&path),
            Err(SettingsFileError::Format { .. })
        ));
        let e = BoxSettings::read(&dir.path().join("none.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read"), "{e}");
    }
}
