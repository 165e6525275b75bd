//! A worker's LoRA folder: where the `loras` of jobs are found by name, for every engine that takes
//! them (SDXL generates, Qwen edits). A name is a file name (`proto`'s `is_file_name`: no path
//! separators, no leading dot), looked up as `<dir>/<name>`, else `<dir>/<name>.safetensors`; a
//! name that is not there is looked up in the job's files from the model catalogue
//! ([`FetchedLoras`], fetched by the async side before the job reaches the engine: DESIGN §7b), and
//! a name in neither is the job's error, naming the LoRA and the folder.

use std::path::{Path, PathBuf};

use vnfarm_models::loading::lora::LoraSpec;
use vnfarm_proto::{LoraRef, ModelFileRole};

use super::{EngineError, UsedFile};

/// A job's LoRAs that came from the model catalogue: the job's name for each (a catalogue name or
/// `sha256:<hex>`) and the verified file in the model cache. The async side holds the files pinned
/// until the job is settled, so these paths stay valid while the engine and the manifest use them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchedLoras(Vec<(String, PathBuf)>);

impl FetchedLoras {
    pub fn push(&mut self, name: String, path: PathBuf) {
        self.0.push((name, path));
    }

    pub fn get(&self, name: &str) -> Option<&Path> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, path)| path.as_path())
    }
}

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

    /// A LoRA of this folder by the job's name for it, if it is there.
    pub fn local(&self, name: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        // A reference by hash is never a file name of the folder.
        if !vnfarm_proto::spec::is_file_name(name) {
            return None;
        }
        [dir.join(name), dir.join(format!("{name}.safetensors"))]
            .into_iter()
            .find(|path| path.is_file())
    }

    /// The job's LoRA files with their strengths, in the job's order: from the folder first, else
    /// from the catalogue files fetched for the job.
    pub fn resolve(
        &self,
        loras: &[LoraRef],
        fetched: &FetchedLoras,
    ) -> Result<Vec<LoraSpec>, EngineError> {
        loras
            .iter()
            .map(|l| {
                let path = self
                    .local(&l.name)
                    .or_else(|| fetched.get(&l.name).map(Path::to_owned))
                    .ok_or_else(|| {
                        EngineError::InvalidInput(match &self.dir {
                            Some(dir) => format!(
                                "LoRA `{}` is not in {} nor in the model catalogue",
                                l.name,
                                dir.display()
                            ),
                            None => format!(
                                "LoRA `{}` is not in the model catalogue (and this worker has no {})",
                                l.name, self.setting
                            ),
                        })
                    })?;
                Ok(LoraSpec {
                    path,
                    strength: f64::from(l.weight),
                })
            })
            .collect()
    }

    /// The job's LoRAs as files its images are made from (by the job's names, with their
    /// weights). A job whose LoRAs are not found fails before it makes an image: nothing to list.
    pub fn used_files(&self, loras: &[LoraRef], fetched: &FetchedLoras) -> Vec<UsedFile> {
        let Ok(specs) = self.resolve(loras, fetched) else {
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

/// The LoRA names a worker advertises in its heartbeat, so the scheduler can refuse a name that
/// exists nowhere (DESIGN §7b).
#[derive(Clone, Debug)]
pub enum AdvertisedLoras {
    /// Names the configuration claims (the test-pattern engine), or none: it cannot tell.
    Claimed(Option<Vec<String>>),
    /// The files of these folders (the engines' `lora_dir`s), read at each beat.
    Folders(Vec<PathBuf>),
}

impl AdvertisedLoras {
    /// The names, sorted; none when a folder cannot be read (a name may be there: it cannot tell).
    /// Blocking: reads directories.
    pub fn names(&self) -> Option<Vec<String>> {
        let dirs = match self {
            AdvertisedLoras::Claimed(names) => return names.clone(),
            AdvertisedLoras::Folders(dirs) => dirs,
        };
        let mut names = Vec::new();
        for dir in dirs {
            let entries = match std::fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) => {
                    tracing::debug!(dir = %dir.display(), error = %e, "cannot list a LoRA folder; advertising no LoRA names");
                    return None;
                }
            };
            names.extend(
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.path().is_file())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|name| vnfarm_proto::spec::is_file_name(name)),
            );
        }
        names.sort();
        names.dedup();
        Some(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_advertises_its_folders_files_and_nothing_when_one_cannot_be_read() {
        let dir = std::env::temp_dir().join(format!(
            "vnfarm-lora-names-{}-{}",
            std::process::id(),
            vnfarm_proto::JobId::new()
        ));
        std::fs::create_dir_all(dir.join("nested")).unwrap();
        std::fs::write(dir.join("ink.safetensors"), b"w").unwrap();
        std::fs::write(dir.join(".hidden"), b"w").unwrap();
        let folders = AdvertisedLoras::Folders(vec![dir.clone(), dir.clone()]);
        assert_eq!(folders.names(), Some(vec!["ink.safetensors".to_owned()]));
        let missing = AdvertisedLoras::Folders(vec![dir.join("missing")]);
        assert_eq!(missing.names(), None);
        assert_eq!(AdvertisedLoras::Claimed(None).names(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
        let none_fetched = FetchedLoras::default();
        let specs = loras
            .resolve(
                &[
                    named("ink", 0.5),
                    named("old.pt", 1.0),
                    named("ink.safetensors", -1.0),
                ],
                &none_fetched,
            )
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
        let files = loras.used_files(&[named("ink", 0.5)], &none_fetched);
        assert_eq!(
            (files[0].name.as_str(), files[0].strength),
            ("ink", Some(0.5))
        );

        let missing = loras.resolve(&[named("ink", 1.0), named("nope", 1.0)], &none_fetched);
        assert!(
            matches!(&missing, Err(EngineError::InvalidInput(m)) if m.contains("`nope`")),
            "{missing:?}"
        );
        assert!(
            loras
                .used_files(&[named("nope", 1.0)], &none_fetched)
                .is_empty()
        );
        let none =
            LoraDir::new(None, "engine.sdxl.lora_dir").resolve(&[named("ink", 1.0)], &none_fetched);
        assert!(
            matches!(&none, Err(EngineError::InvalidInput(m)) if m.contains("engine.sdxl.lora_dir")),
            "{none:?}"
        );

        // Not in the folder: the job's file from the catalogue; the folder's own file first.
        let mut fetched = FetchedLoras::default();
        fetched.push("style".into(), dir.join("cache-style"));
        fetched.push("ink".into(), dir.join("cache-ink"));
        let specs = loras
            .resolve(&[named("style", 1.0), named("ink", 1.0)], &fetched)
            .unwrap();
        assert_eq!(
            (specs[0].path.clone(), specs[1].path.clone()),
            (dir.join("cache-style"), dir.join("ink.safetensors"))
        );
        let files =
            LoraDir::new(None, "engine.sdxl.lora_dir").used_files(&[named("style", 0.7)], &fetched);
        assert_eq!(
            (files[0].name.as_str(), files[0].path.clone()),
            ("style", dir.join("cache-style"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
