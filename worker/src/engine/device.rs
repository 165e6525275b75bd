//! What the libtorch engines share: device names and dtypes in the config, and the classification
//! of pipeline failures into engine errors (out of memory is retried, a device failure stops the
//! worker, a bad request fails the job).

use serde::Deserialize;
use tch::{Device, Kind};
use vnfarm_models::error::GenerateError;

use super::{CancelReason, EngineError};

/// Precision of a model's weights and activations.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    Fp32,
    Fp16,
    #[default]
    Bf16,
}

impl Dtype {
    pub fn kind(self) -> Kind {
        match self {
            Dtype::Fp32 => Kind::Float,
            Dtype::Fp16 => Kind::Half,
            Dtype::Bf16 => Kind::BFloat16,
        }
    }
}

/// `cuda`, `cuda:N` or `cpu`, without touching the device.
pub fn parse_device(name: &str) -> Result<Device, String> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("`{other}` is not `cuda`, `cuda:N` or `cpu`")),
    }
}

/// The device, checked against what libtorch sees; `field` names the setting in errors.
pub fn open_device(name: &str, field: &str) -> anyhow::Result<Device> {
    let device = parse_device(name).map_err(anyhow::Error::msg)?;
    if let Device::Cuda(i) = device {
        let count = tch::Cuda::device_count();
        anyhow::ensure!(
            count > 0,
            "{field} is `{name}` but libtorch sees no CUDA/ROCm device \
             (tch::Cuda::is_available() is false); set {field} = \"cpu\" to run on the CPU"
        );
        anyhow::ensure!(
            (i as i64) < count,
            "{field} is `{name}` but libtorch sees {count} device(s)"
        );
    }
    Ok(device)
}

/// Runs `warm_up` once per configured `[width, height]` (kernel compilation, memory pools) before
/// the worker takes jobs, logging each; the first failure names the model and the size.
pub fn warm_up_sizes(
    model: &str,
    sizes: &[[u32; 2]],
    mut warm_up: impl FnMut(u32, u32) -> Result<(), GenerateError>,
) -> anyhow::Result<()> {
    for &[w, h] in sizes {
        let started = std::time::Instant::now();
        warm_up(w, h).map_err(|e| anyhow::anyhow!("{model} warm-up at {w}x{h}: {e}"))?;
        tracing::info!(
            model,
            width = w,
            height = h,
            seconds = started.elapsed().as_secs_f64(),
            "warmed up"
        );
    }
    Ok(())
}

/// The engine error a pipeline failure becomes (see `EngineError` for what the worker does with
/// each); `cancelled` is why the jobs were stopped, if they were.
pub fn engine_error(e: GenerateError, cancelled: Option<CancelReason>) -> EngineError {
    match e {
        GenerateError::Cancelled => EngineError::Cancelled(cancelled.unwrap_or(CancelReason::User)),
        GenerateError::InvalidRequest(m) | GenerateError::Tokenizer(m) => {
            EngineError::InvalidInput(m)
        }
        GenerateError::Backend(m) if is_out_of_memory(&m) => EngineError::OutOfMemory(m),
        GenerateError::Backend(m) if is_device_failure(&m) => EngineError::DeviceLost(m),
        GenerateError::Torch(e) if is_out_of_memory(&e.to_string()) => {
            EngineError::OutOfMemory(e.to_string())
        }
        GenerateError::Backend(m) => EngineError::Failed(m),
        GenerateError::Torch(e) => EngineError::Failed(e.to_string()),
    }
}

/// Errors after which the device context cannot be trusted: CUDA/HIP runtime errors ("CUDA error: an
/// illegal memory access was encountered", "HIP error: …") and device-side asserts. Out-of-memory
/// errors are not among them: the allocator recovers from those.
fn is_device_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    !is_out_of_memory(message)
        && (m.contains("cuda error") || m.contains("hip error") || m.contains("device-side assert"))
}

/// libtorch's allocator messages: "CUDA out of memory", "HIP out of memory", CPU "DefaultCPUAllocator:
/// not enough memory".
fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("out of memory") || m.contains("not enough memory")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_without_touching_hardware() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(parse_device("cuda:3"), Ok(Device::Cuda(3)));
        assert!(parse_device("gpu").is_err());
        assert!(parse_device("cuda:x").is_err());
    }

    #[test]
    fn out_of_memory_is_told_apart() {
        let cancel = None;
        assert!(matches!(
            engine_error(
                GenerateError::Backend("CUDA out of memory. Tried to allocate 2.00 GiB".into()),
                cancel
            ),
            EngineError::OutOfMemory(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend(
                    "CUDA error: an illegal memory access was encountered".into()
                ),
                cancel
            ),
            EngineError::DeviceLost(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend("device-side assert triggered".into()),
                cancel
            ),
            EngineError::DeviceLost(_)
        ));
        assert!(matches!(
            engine_error(
                GenerateError::Backend("expected a 4-D tensor, got 3-D".into()),
                cancel
            ),
            EngineError::Failed(_)
        ));
        assert!(matches!(
            engine_error(GenerateError::InvalidRequest("size".into()), cancel),
            EngineError::InvalidInput(_)
        ));
        assert!(matches!(
            engine_error(GenerateError::Cancelled, Some(CancelReason::Shutdown)),
            EngineError::Cancelled(CancelReason::Shutdown)
        ));
    }
}
