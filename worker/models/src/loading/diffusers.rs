//! Diffusers model folders: a component's `config.json`, and its weights as one file, as shards
//! listed in `{base}.safetensors.index.json`, or as the `{base}.fp16.safetensors` variant.
//!
//! Invariant: every failure names the file it concerns ([`LoadError`]).

use std::path::Path;
use std::sync::Arc;

use crate::error::LoadError;
use crate::loading::safetensors::SafetensorsFile;
use crate::loading::weights::{Transform, WeightStore};

/// Reads and parses a config file; a parse failure names the file.
pub fn read_config<T>(
    path: &Path,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<T, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|reason| LoadError::Config {
        path: path.to_path_buf(),
        reason,
    })
}

pub fn open(path: &Path) -> Result<Arc<SafetensorsFile>, LoadError> {
    SafetensorsFile::open(path).map(Arc::new)
}

/// A diffusers component's weights `dir/{base}.safetensors`; else the sharded
/// `{base}.safetensors.index.json` (`weight_map` of tensor → shard file); else the
/// `{base}.fp16.safetensors` variant.
pub fn component_store(
    dir: &Path,
    base: &str,
    rename: fn(&str) -> Option<String>,
) -> Result<WeightStore, LoadError> {
    let single = dir.join(format!("{base}.safetensors"));
    let index = dir.join(format!("{base}.safetensors.index.json"));
    let fp16 = dir.join(format!("{base}.fp16.safetensors"));
    if single.exists() || !(index.exists() || fp16.exists()) {
        return Ok(WeightStore::renamed(open(&single)?, rename));
    }
    if !index.exists() {
        return Ok(WeightStore::renamed(open(&fp16)?, rename));
    }
    let map: serde_json::Value = read_config(&index, |t| {
        serde_json::from_str(t).map_err(|e| e.to_string())
    })?;
    let weight_map = map
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| LoadError::Config {
            path: index.clone(),
            reason: "no `weight_map` object".into(),
        })?;
    let mut shards: Vec<&str> = weight_map.values().filter_map(|v| v.as_str()).collect();
    shards.sort_unstable();
    shards.dedup();
    let mut store = WeightStore::default();
    for shard in shards {
        let file = open(&dir.join(shard))?;
        let idx = store.add_file(file.clone());
        for key in file.names() {
            if let Some(name) = rename(key) {
                store.insert(name, idx, key.to_string(), Transform::Identity);
            }
        }
    }
    Ok(store)
}
