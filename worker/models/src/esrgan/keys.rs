//! Checkpoint names of RRDBNet and opening a checkpoint in any accepted format.
//!
//! Files: `.pth` as Real-ESRGAN releases them (PyTorch zip, `{"params_ema": …}` or
//! `{"params": …}`, read by [`crate::loading::pth`]) or `.safetensors`; the format is told by the
//! file's first bytes, not its name. Names: BasicSR's (Real-ESRGAN and most converted files), or
//! the original ESRGAN's (`RRDBNet_arch.py` of xinntao/ESRGAN, which many community ×4 models still
//! use), mapped to BasicSR's:
//!
//! | ESRGAN | BasicSR |
//! |---|---|
//! | `model.0` | `conv_first` |
//! | `model.1.sub.N.RDBk.convj.0` | `body.N.rdbk.convj` |
//! | `model.1.sub.<num_block>` | `conv_body` |
//! | `model.3` / `model.6` | `conv_up1` / `conv_up2` |
//! | `model.8` / `model.10` | `conv_hr` / `conv_last` |
//!
//! A `params_ema.` / `params.` / `module.` prefix on every key (flattened wrappers, DataParallel)
//! is dropped. Keys that map to nothing keep their name, so the model reports them as unexpected.

use std::path::Path;
use std::sync::Arc;

use crate::error::LoadError;
use crate::loading::pth::PthFile;
use crate::loading::safetensors::SafetensorsFile;
use crate::loading::weights::{TensorFile, WeightStore};

/// Which names a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    BasicSr,
    Esrgan,
}

impl Naming {
    pub fn detect<'a>(mut keys: impl Iterator<Item = &'a str>) -> Self {
        if keys.any(|k| k.starts_with("model.0.")) {
            Naming::Esrgan
        } else {
            Naming::BasicSr
        }
    }
}

/// The BasicSR name of ESRGAN tensor `key`, or `None` when it has no counterpart.
pub fn esrgan_key(key: &str) -> Option<String> {
    let (head, leaf) = key.rsplit_once('.')?;
    let fixed = match head {
        "model.0" => Some("conv_first"),
        "model.3" => Some("conv_up1"),
        "model.6" => Some("conv_up2"),
        "model.8" => Some("conv_hr"),
        "model.10" => Some("conv_last"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(format!("{name}.{leaf}"));
    }
    let rest = head.strip_prefix("model.1.sub.")?;
    match rest.split('.').collect::<Vec<_>>().as_slice() {
        [n] if n.parse::<u32>().is_ok() => Some(format!("conv_body.{leaf}")),
        [n, rdb, conv, "0"] if n.parse::<u32>().is_ok() => {
            let k = rdb.strip_prefix("RDB")?;
            let j = conv.strip_prefix("conv")?;
            Some(format!("body.{n}.rdb{k}.conv{j}.{leaf}"))
        }
        _ => None,
    }
}

/// What [`open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub naming: Naming,
    /// For `.pth`: the wrapper key the weights were under (`params_ema`, `params`).
    pub wrapper: Option<String>,
}

/// A store over the checkpoint at `path` in BasicSR names, whatever its format and naming.
pub fn open(path: &Path) -> Result<(WeightStore, CheckpointInfo), LoadError> {
    let mut head = [0u8; 9];
    let n = {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(source) => {
                    return Err(LoadError::Io {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
        }
        n
    };
    // safetensors: an 8-byte header length, then the JSON header.
    let (file, wrapper) = if n == 9 && head[8] == b'{' {
        (
            TensorFile::Safetensors(Arc::new(SafetensorsFile::open(path)?)),
            None,
        )
    } else {
        let pth = PthFile::open(path)?;
        let wrapper = pth.wrapper().map(str::to_string);
        (TensorFile::Pth(Arc::new(pth)), wrapper)
    };
    let keys = file.names();
    let any = |p: &str| keys.iter().any(|k| k.starts_with(p));
    let prefix = if any("params_ema.") {
        Some("params_ema.")
    } else if any("params.") {
        Some("params.")
    } else if !keys.is_empty() && keys.iter().all(|k| k.starts_with("module.")) {
        Some("module.")
    } else {
        None
    };
    // With a flattened wrapper only the preferred set is read.
    let strip = |k: &str| -> Option<String> {
        match prefix {
            Some(p) => k.strip_prefix(p).map(str::to_string),
            None => Some(k.to_string()),
        }
    };
    let stripped: Vec<String> = keys.iter().filter_map(|k| strip(k)).collect();
    let naming = Naming::detect(stripped.iter().map(String::as_str));
    let store = WeightStore::renamed_file(file, |k| {
        let k = strip(k)?;
        Some(match naming {
            Naming::BasicSr => k,
            Naming::Esrgan => esrgan_key(&k).unwrap_or(k),
        })
    });
    Ok((store, CheckpointInfo { naming, wrapper }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn esrgan_names_map_to_basicsr_names() {
        let cases = [
            ("model.0.weight", Some("conv_first.weight")),
            (
                "model.1.sub.5.RDB2.conv4.0.bias",
                Some("body.5.rdb2.conv4.bias"),
            ),
            ("model.1.sub.23.weight", Some("conv_body.weight")),
            ("model.3.bias", Some("conv_up1.bias")),
            ("model.6.weight", Some("conv_up2.weight")),
            ("model.8.weight", Some("conv_hr.weight")),
            ("model.10.bias", Some("conv_last.bias")),
            ("model.13.weight", None),
            ("model.1.sub.0.RDB1.conv1.1.weight", None),
        ];
        for (k, want) in cases {
            assert_eq!(esrgan_key(k).as_deref(), want, "{k}");
        }
    }
}
