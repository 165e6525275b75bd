//! The SDXL UNet forward replayed from a CUDA graph ([`crate::nn::cuda_graph`]): one capture per
//! input shape, then per denoising step four small device copies into the graph's static inputs,
//! one replay, and one copy out of its static output. What it saves is the host's time launching
//! the forward's ~2000 kernels one by one, which bounds the step at CFG batch 2.
//!
//! The forward itself is [`UNet2DConditionModel::forward`] unchanged: it makes no host↔device
//! transfer or synchronisation once its inputs are on the device (the timestep features are built
//! with device-side `arange`), so it captures as it is.

use tch::{Device, Kind, Tensor};

use crate::nn::cuda_graph::{CudaGraph, GraphError};
use crate::sdxl::unet::{AddedCond, UNet2DConditionModel};

/// Eager forwards on the graph's side stream before the capture (as `torch.cuda.graph`'s users
/// do): the first sets up cuBLAS and cuDNN for that stream, the second runs as the capture will.
const WARM_UP: usize = 2;

/// Shapes, dtypes and device of the five inputs: a new value means a new capture.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    shapes: [Vec<i64>; 5],
    kinds: [Kind; 5],
    device: Device,
}

impl Key {
    fn of(inputs: [&Tensor; 5], device: Device) -> Self {
        Self {
            shapes: inputs.map(Tensor::size),
            kinds: inputs.map(Tensor::kind),
            device,
        }
    }
}

/// One captured forward. Field order is drop order: the output (in the graph's memory pool) and
/// the static inputs go before the graph that reads and writes them.
#[derive(Debug)]
struct Captured {
    key: Key,
    out: Tensor,
    /// `sample`, `timestep`, `context`, `text_embeds`, `time_ids`, on the device.
    inputs: [Tensor; 5],
    graph: CudaGraph,
}

/// A UNet forward through a CUDA graph, captured on first use and again whenever the inputs'
/// shapes change (one graph is kept: its memory pool holds the forward's activations, and is
/// handed back to the device when the graph is dropped).
#[derive(Debug, Default)]
pub struct GraphedUNet {
    captured: Option<Captured>,
    captures: usize,
}

impl GraphedUNet {
    pub fn new() -> Self {
        Self::default()
    }

    /// `unet.forward(sample, timestep, context, added)` replayed from the graph for these
    /// shapes (captured now if there is none). Returns a fresh tensor: the graph's output buffer is
    /// rewritten by the next replay. The UNet's weights must be the ones it was captured with
    /// ([`GraphedUNet::invalidate`] after replacing them).
    pub fn forward(
        &mut self,
        unet: &UNet2DConditionModel,
        sample: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        added: &AddedCond<'_>,
    ) -> Result<Tensor, GraphError> {
        let _no_grad = tch::no_grad_guard();
        let device = sample.device();
        let given = [sample, timestep, context, added.text_embeds, added.time_ids];
        let key = Key::of(given, device);
        if self.captured.as_ref().is_none_or(|c| c.key != key) {
            // The old graph's pool is freed before the new capture takes its own.
            self.captured = None;
            self.captured = Some(capture(unet, key, given, device)?);
            self.captures += 1;
        }
        let c = self
            .captured
            .as_mut()
            .expect("a graph was captured for these shapes above");
        for (dst, src) in c.inputs.iter_mut().zip(given) {
            dst.f_copy_(src)
                .map_err(|e| GraphError::Backend(format!("filling the graph's inputs: {e}")))?;
        }
        c.graph.replay()?;
        Ok(c.out.copy())
    }

    /// Drops the captured graph (the UNet's weights were replaced: the graph reads the old ones).
    pub fn invalidate(&mut self) {
        self.captured = None;
    }

    /// How many graphs were captured so far (shape changes and invalidations recapture).
    pub fn captures(&self) -> usize {
        self.captures
    }
}

fn capture(
    unet: &UNet2DConditionModel,
    key: Key,
    given: [&Tensor; 5],
    device: Device,
) -> Result<Captured, GraphError> {
    let mut graph = CudaGraph::new(device)?;
    let inputs = given.map(|t| t.to_device(device).copy());
    let [sample, timestep, context, text_embeds, time_ids] = &inputs;
    let added = AddedCond {
        text_embeds,
        time_ids,
    };
    graph.on_side_stream(|| {
        for _ in 0..WARM_UP {
            drop(unet.forward(sample, timestep, context, &added));
        }
    })?;
    let out = graph.capture(|| unet.forward(sample, timestep, context, &added))?;
    Ok(Captured {
        key,
        out,
        inputs,
        graph,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_shape_and_dtype() {
        let a = Tensor::zeros([2, 4, 8, 8], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([2, 4, 8, 16], (Kind::Float, Device::Cpu));
        let c = Tensor::zeros([2, 4, 8, 8], (Kind::BFloat16, Device::Cpu));
        let t = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let k = |s: &Tensor| Key::of([s, &t, &t, &t, &t], Device::Cpu);
        assert_eq!(k(&a), k(&a.zeros_like()));
        assert_ne!(k(&a), k(&b));
        assert_ne!(k(&a), k(&c));
    }
}
