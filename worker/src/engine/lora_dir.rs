//! A worker's LoRA folder: where the `loras` of jobs are found by name, for every engine that takes
//! them (SDXL generates, Qwen edits). A name is a file name (`proto`'s `is_file_name`: no path
//! separators, no leading dot), looked up as `<dir>/<name>`, else `<dir>/<name>.safetensors`; a
//! name that is not there is the job's error, naming the LoRA and the folder.

use std::path::PathBuf;

use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_proto::{LoraRef, ModelFileRole};

use super::{EngineError, UsedFile};

#[derive(Clone, Debug)]
pub struct LoraDir {
    dir: Option<PathBuf>,
    /// The configuration key that sets `dir`, for the error of a worker without one.
    setting: &'static str,
}

impl LoraDir {
    pub fn new(dir: Option<PathBuf>, setting: &'static str) -> Self {
        Self { dir, setting }
    }

    /// The job's LoRA files with their strengths, in the job's order.
    pub fn resolve(&self, loras: &[LoraRef]) -> Result<Vec<LoraSpec>, EngineError> {
        if loras.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.dir.as_ref().ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "the job names LoRAs but this worker has no {}",
                self.setting
            ))
        })?;
        loras
            .iter()
            .map(|l| {
                let plain = dir.join(&l.name);
                let path = if plain.is_file() {
                    plain
                } else {
                    dir.join(format!("{}.safetensors", l.name))
                };
                if !path.is_file() {
                    return Err(EngineError::InvalidInput(format!(
                        "LoRA `{}` is not in {}",
                        l.name,
                        dir.display()
                    )));
                }
                Ok(LoraSpec {
                    path,
                    strength: f64::from(l.weight),
                })
            })
            .collect()
    }

    /// The job's LoRAs as files its images are made from (by the job's names, with their
    /// weights). A job whose LoRAs are not found fails before it makes an image: nothing to list.
    pub fn used_files(&self, loras: &[LoraRef]) -> Vec<UsedFile> {
        let Ok(specs) = self.resolve(loras) else {
            return Vec::new();
        };
        loras
            .iter()
            .zip(specs)
            .map(|(l, spec)| UsedFile {
                name: l.name.clone(),
                path: spec.path,
                role: ModelFileRole::Lora,
                strength: Some(l.weight),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lora_is_found_by_its_name_with_or_without_the_extension() {
        let dir = std::env::temp_dir().join(format!(
            "vnfarm-lora-dir-{}-{}",
            std::process::id(),
            vnfarm_proto::JobId::new()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ink.safetensors"), b"w").unwrap();
        std::fs::write(dir.join("old.pt"), b"w").unwrap();
        let loras = LoraDir::new(Some(dir.clone()), "engine.sdxl.lora_dir");
        let named = |name: &str, weight: f32| LoraRef {
            name: name.into(),
            weight,
        };
        let specs = loras
            .resolve(&[
                named("ink", 0.5),
                named("old.pt", 1.0),
                named("ink.safetensors", -1.0),
            ])
            .unwrap();
        let found: Vec<(PathBuf, f64)> = specs.into_iter().map(|s| (s.path, s.strength)).collect();
        assert_eq!(
            found,
            [
                (dir.join("ink.safetensors"), 0.5),
                (dir.join("old.pt"), 1.0),
                (dir.join("ink.safetensors"), -1.0)
            ]
        );
        let files = loras.used_files(&[named("ink", 0.5)]);
        assert_eq!(
            (files[0].name.as_str(), files[0].strength),
            ("ink", Some(0.5))
        );

        let missing = loras.resolve(&[named("ink", 1.0), named("nope", 1.0)]);
        assert!(
            matches!(&missing, Err(EngineError::InvalidInput(m)) if m.contains("`nope`")),
            "{missing:?}"
        );
        assert!(loras.used_files(&[named("nope", 1.0)]).is_empty());
        let none = LoraDir::new(None, "engine.sdxl.lora_dir").resolve(&[named("ink", 1.0)]);
        assert!(
            matches!(&none, Err(EngineError::InvalidInput(m)) if m.contains("engine.sdxl.lora_dir")),
            "{none:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
