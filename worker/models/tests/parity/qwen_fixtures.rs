//! What the Qwen parity modules share: the `fixtures/qwen/` folder, a reference file with its
//! `fixture` metadata, and the tiny text encoder's folder under both key layouts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::support::load_reference;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("qwen")
}

/// The tiny diffusers folder, `fixtures/qwen/qwen_tiny/`.
pub fn tiny_dir() -> PathBuf {
    fixtures().join("qwen_tiny")
}

/// All tensors of one `fixtures/qwen/reference/` file (floats as fp32, integers as int64) and its
/// `fixture` metadata. Each module adds the readers of its own metadata.
pub struct Reference {
    tensors: HashMap<String, Tensor>,
    pub meta: serde_json::Value,
}

impl Reference {
    pub fn load(file: &str) -> Self {
        let (tensors, f) = load_reference(&fixtures().join("reference").join(file));
        let meta = serde_json::from_str(&f.metadata()["fixture"]).expect("fixture metadata");
        Self { tensors, meta }
    }

    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference tensor {name}"))
    }
}

pub fn ints(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.to_kind(Kind::Int64).flatten(0, -1)).expect("int64 tensor")
}

/// transformers-5 names ↔ older names (`model.X` ↔ `model.language_model.X`, `visual.` ↔
/// `model.visual.`), so that both layouts are tested whichever the fixture writer saved.
pub fn reroot(key: &str) -> Option<String> {
    let k = if let Some(rest) = key.strip_prefix("model.language_model.") {
        format!("model.{rest}")
    } else if let Some(rest) = key.strip_prefix("model.visual.") {
        format!("visual.{rest}")
    } else if let Some(rest) = key.strip_prefix("visual.") {
        format!("model.visual.{rest}")
    } else if let Some(rest) = key.strip_prefix("model.") {
        format!("model.language_model.{rest}")
    } else {
        key.to_string()
    };
    Some(k)
}
