//! Typed errors of the model crate: what a caller (the worker) branches on.
//!
//! Loading errors always name the tensor and the file they concern, so that an operator can tell a
//! truncated download from a checkpoint of the wrong architecture.

use std::path::PathBuf;

/// Why weights could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a safetensors file: {reason}")]
    BadHeader { path: PathBuf, reason: String },
    #[error(
        "{path} is truncated: tensor `{tensor}` needs bytes {start}..{end} of the data section but the file only holds {available}"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        start: usize,
        end: usize,
        available: usize,
    },
    #[error("tensor `{tensor}` is missing from {path}")]
    Missing { path: PathBuf, tensor: String },
    #[error("tensor `{tensor}` in {path} has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        tensor: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error("tensor `{tensor}` in {path} has unsupported dtype {dtype}")]
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    /// Tensors the model does not have: another architecture, or another size of this one.
    #[error("{path} has tensors the model does not use ({describe}): {}", .tensors.join(", "))]
    Unexpected {
        path: PathBuf,
        /// What the loader took the file for (e.g. "RRDBNet ×4, 23 blocks").
        describe: String,
        tensors: Vec<String>,
    },
    /// `cuda_graphs` was asked for where graphs cannot be captured (no CUDA device, or a binary
    /// built without the shim).
    #[error("cuda_graphs: {0}")]
    CudaGraphs(#[from] crate::nn::cuda_graph::GraphError),
    /// A setting this binary or device cannot honour.
    #[error("{setting}: {reason}")]
    Setting {
        setting: &'static str,
        reason: String,
    },
    #[error("torch error while loading `{tensor}` from {path}: {source}")]
    Torch {
        path: PathBuf,
        tensor: String,
        #[source]
        source: tch::TchError,
    },
}

/// Why a generation request failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The cancel callback returned true between two denoising steps.
    #[error("generation cancelled")]
    Cancelled,
    /// The request is outside what the model can do (sizes, steps, prompt).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The tokenizer rejected the prompt.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// libtorch failed (out of memory, device error).
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    /// libtorch failed inside an operation that tch reports by panicking (e.g. device out of
    /// memory in the middle of a forward pass); the panic was contained and its message is here.
    #[error("libtorch failed during generation: {0}")]
    Backend(String),
}

/// Runs `f`, turning a libtorch failure that tch reported by panicking (out of device memory, a
/// device error inside an operation) into [`GenerateError::Backend`] with the libtorch message, so
/// a request cannot bring the worker down.
pub fn contain_backend_panics<T>(
    f: impl FnOnce() -> Result<T, GenerateError> + std::panic::UnwindSafe,
) -> Result<T, GenerateError> {
    std::panic::catch_unwind(f).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(GenerateError::Backend(first_line_of_torch_error(&message)))
    })
}

/// The libtorch message of a tch panic (`called Result::unwrap() on an Err value: Torch("msg\n
/// Exception raised from …")`) without the unwrap preamble and the C++ backtrace.
fn first_line_of_torch_error(panic: &str) -> String {
    let msg = panic.split_once("Torch(\"").map_or(panic, |(_, rest)| rest);
    msg.split("\\n")
        .next()
        .unwrap_or(msg)
        .trim_end_matches("\")")
        .to_string()
}
