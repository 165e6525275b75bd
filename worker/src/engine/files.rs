//! The files a job's images are made from, as the engines name them for the manifest.

use std::path::{Path, PathBuf};

use vnfarm_proto::ModelFileRole;

/// A file a job's images were made from, as the engine read it (hashed later, for the manifest).
#[derive(Clone, Debug, PartialEq)]
pub struct UsedFile {
    /// A LoRA's name as the job names it; else the file's name.
    pub name: String,
    pub path: PathBuf,
    pub role: ModelFileRole,
    /// A LoRA's strength (the job's weight, or the configured one for a LoRA fused at load).
    pub strength: Option<f32>,
}

impl UsedFile {
    /// A file known by its own name.
    pub fn named_by_file(path: &Path, role: ModelFileRole) -> Self {
        Self {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_owned(),
            role,
            strength: None,
        }
    }
}

/// The weight files of a diffusers folder (every `.safetensors`, `.bin`, `.pth`, `.ckpt` or `.sft`
/// under it, sorted), as `Component`s. A folder that holds a component twice (a full and an
/// `fp16` variant) lists both: the manifest names what the folder held, which pins it down.
pub fn weight_files(dir: &Path) -> Vec<UsedFile> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        // An unreadable folder fails the load itself; here it only lists nothing.
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| {
                ["safetensors", "bin", "pth", "ckpt", "sft"]
                    .iter()
                    .any(|w| e == *w)
            }) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
        .into_iter()
        .map(|path| {
            let name = path
                .strip_prefix(dir)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            UsedFile {
                name,
                path,
                role: ModelFileRole::Component,
                strength: None,
            }
        })
        .collect()
}
