//! The handful of layers every component is built from (Linear, Conv2d, GroupNorm, LayerNorm,
//! RmsNorm), holding plain tensors loaded through [`Weights`]; the attention kernel choice;
//! [`embeddings`] (timestep embeddings); [`tiling`] (VAE tile-and-blend).
//!
//! Layer semantics follow `torch.nn` exactly so that diffusers checkpoints load unchanged. A
//! [`Linear`] may hold its weight in fp8 (see [`crate::loading::weights::Fp8Mode`]): it is then
//! upcast to the activations' dtype, times its per-tensor scale, at every call.

pub mod cuda_graph;
pub mod embeddings;
pub mod fp8;
pub mod fused;
pub mod ops;
pub mod rope;
pub mod stream;
pub mod tiling;

use tch::{Kind, Tensor};

use crate::dtype::is_fp8;
use crate::error::LoadError;
use crate::loading::weights::Weights;

/// Memory order of convolution activations (and weights, where a model converts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryFormat {
    /// NCHW, as the PyTorch references run.
    #[default]
    Contiguous,
    /// NHWC (`torch.channels_last`): the layout tensor-core convolution kernels want.
    ChannelsLast,
}

/// Whether `x` (`[N, C, H, W]`) is laid out channels-last (NHWC strides) rather than NCHW.
pub fn is_channels_last(x: &Tensor) -> bool {
    let (size, stride) = (x.size(), x.stride());
    size.len() == 4 && size[1] > 1 && stride[1] == 1 && stride[3] == size[1]
}

/// How attention is computed. Both give the same result up to float rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionImpl {
    /// `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels where
    /// libtorch has them).
    #[default]
    Sdpa,
    /// Plain `softmax(q k^T * scale) v` with matmuls, for debugging and odd backends.
    Matmul,
}

/// How a feed-forward's GELU is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfGelu {
    /// The model's own GELU as a kernel of its own after the matmul: what diffusers computes
    /// (erf GELU in SDXL), so parity is exact.
    #[default]
    Separate,
    /// GELU in the matmul's epilogue ([`ops::addmm_gelu`]: cuBLASLt on CUDA, where it is the tanh
    /// approximation; the CPU computes erf GELU after the matmul), which saves a pass over the
    /// widest activation of each block. For a model trained with erf GELU (SDXL) the output on
    /// CUDA moves by the approximation's error (below 5e-4 per activation; measured in
    /// docs/performance.md, kernels attempt 8). Needs the operator shim (`ops::BUILT_IN`).
    Epilogue,
}

/// `gelu(x @ weight^T + bias)` over the last dim of `x`, the GELU in the matmul's epilogue
/// ([`ops::addmm_gelu`]: tanh-approximated on CUDA, erf on the CPU); where the operator shim is
/// not built in, the matmul and then erf GELU.
pub fn linear_gelu_epilogue(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
    let mut shape = x.size();
    let x2 = x.reshape([-1, *shape.last().expect("linear input has a last dim")]);
    let Some(y) = ops::addmm_gelu(bias, &x2, &weight.tr()) else {
        return x.linear(weight, Some(bias)).gelu("none");
    };
    *shape.last_mut().expect("checked above") = weight.size()[0];
    y.view(shape.as_slice())
}

/// Multi-head attention on `[B, H, L, D]` tensors with an optional additive mask broadcastable to
/// `[B, H, Lq, Lk]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    imp: AttentionImpl,
) -> Tensor {
    match imp {
        AttentionImpl::Sdpa => {
            Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, false)
        }
        AttentionImpl::Matmul => {
            let mut w = q.matmul(&k.transpose(-1, -2)) * scale;
            if let Some(m) = mask {
                w += m;
            }
            w.softmax(-1, w.kind()).matmul(v)
        }
    }
}

/// `torch.nn.Linear`, with the weight either dense in the compute dtype or resident in fp8.
#[derive(Debug)]
pub struct Linear {
    /// `[out, in]`: the cursor's dtype, or an fp8 kind when kept resident in fp8.
    pub weight: Tensor,
    /// The fp8 weight's per-tensor scale (a 0-d fp32 tensor on the weight's device): the real
    /// weight is `weight.float() * scale`. `None` for dense weights and unscaled fp8.
    pub weight_scale: Option<Tensor>,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(w: &Weights, in_dim: i64, out_dim: i64, bias: bool) -> Result<Self, LoadError> {
        let (weight, weight_scale) = w.get_linear_weight("weight", &[out_dim, in_dim])?;
        Ok(Self {
            weight,
            weight_scale,
            bias: if bias {
                Some(w.get("bias", &[out_dim])?)
            } else {
                None
            },
        })
    }

    /// The weight in `kind` (dequantised if stored in fp8).
    pub fn dense_weight(&self, kind: Kind) -> Tensor {
        if !is_fp8(self.weight.kind()) {
            return self.weight.to_kind(kind);
        }
        match &self.weight_scale {
            // In fp32 like the reference dequantisation (`w.float() * scale`), then to `kind`.
            Some(scale) => (self.weight.to_kind(Kind::Float) * scale).to_kind(kind),
            None => self.weight.to_kind(kind),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        if is_fp8(self.weight.kind()) {
            x.linear(&self.dense_weight(x.kind()), self.bias.as_ref())
        } else {
            x.linear(&self.weight, self.bias.as_ref())
        }
    }
}

/// `torch.nn.Conv2d` (square kernel, no dilation, one group).
#[derive(Debug)]
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    stride: i64,
    padding: i64,
}

impl Conv2d {
    pub fn new(
        w: &Weights,
        in_ch: i64,
        out_ch: i64,
        kernel: i64,
        stride: i64,
        padding: i64,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.get("weight", &[out_ch, in_ch, kernel, kernel])?,
            bias: Some(w.get("bias", &[out_ch])?),
            stride,
            padding,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with_bias(x, self.bias.as_ref())
    }

    /// The convolution with `bias` in place of its own (`None`: none). libtorch adds a
    /// convolution's bias after cuDNN / MIOpen as a pass of its own over the output, so a block
    /// that adds another per-channel term right after (ResNet's time embedding, a shortcut) folds
    /// the two into one pass this way.
    pub fn forward_with_bias(&self, x: &Tensor, bias: Option<&Tensor>) -> Tensor {
        x.conv2d(
            &self.weight,
            bias,
            [self.stride, self.stride],
            [self.padding, self.padding],
            [1, 1],
            1,
        )
    }
}

/// `x` (`[N, C, H, W]`) with the same values in channels-last memory order (NHWC strides), as
/// `x.to(memory_format=torch.channels_last)`: convolutions that see it run their NHWC kernels and
/// return channels-last outputs.
pub fn channels_last(x: &Tensor) -> Tensor {
    x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])
}

/// Per-(sample, group) statistics of a [`GroupNorm`] input: mean and biased variance (as
/// `torch.nn.GroupNorm` normalises with), fp32, `[N, G]`.
#[derive(Debug)]
pub struct GroupStats {
    pub mean: Tensor,
    pub var: Tensor,
}

/// `torch.nn.GroupNorm` with affine parameters.
#[derive(Debug)]
pub struct GroupNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    groups: i64,
    eps: f64,
}

impl GroupNorm {
    pub fn new(w: &Weights, groups: i64, channels: i64, eps: f64) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.get("weight", &[channels])?,
            bias: w.get("bias", &[channels])?,
            groups,
            eps,
        })
    }

    /// From its affine parameters (`[C]` each), for benches and tests.
    pub fn from_parts(weight: Tensor, bias: Tensor, groups: i64, eps: f64) -> Self {
        Self {
            weight,
            bias,
            groups,
            eps,
        }
    }

    /// libtorch's kernel for NCHW inputs. Its GPU kernel reads NCHW only: an NHWC input would be
    /// copied to NCHW and the output be NCHW, which the next NHWC convolution copies back. NHWC
    /// inputs on a GPU are therefore normalised here, staying NHWC: one `var_mean` (Welford in
    /// fp32 inside the kernel, results rounded to the activations' dtype) and one `addcmul` with
    /// per-channel scale and shift in the activations' dtype. Measured on the SDXL VAE decoder
    /// (NHWC after its mid-block attention, as in diffusers): 2.1× faster decodes, images within
    /// 0.1/255 of libtorch's kernel (docs/performance.md).
    pub fn forward(&self, x: &Tensor) -> Tensor {
        if is_channels_last(x) && x.device() != tch::Device::Cpu {
            return self.forward_nhwc(x);
        }
        x.group_norm(
            self.groups,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            true,
        )
    }

    fn forward_nhwc(&self, x: &Tensor) -> Tensor {
        let (n, c, h, w) = x.size4().expect("GroupNorm input is [N, C, H, W]");
        let (g, kind) = (self.groups, x.kind());
        // [N, H·W, G, C/G]: a view of the NHWC memory.
        let v = x.permute([0, 2, 3, 1]).reshape([n, h * w, g, c / g]);
        let (var, mean) = v.var_mean_correction(&[1, 3][..], 0, true);
        let rstd = (var.to_kind(Kind::Float) + self.eps).rsqrt();
        let scale = rstd * self.weight.to_kind(Kind::Float).view([1, 1, g, c / g]);
        let shift = self.bias.to_kind(Kind::Float).view([1, 1, g, c / g])
            - mean.to_kind(Kind::Float) * &scale;
        shift
            .to_kind(kind)
            .addcmul(&v, &scale.to_kind(kind))
            .view([n, h, w, c])
            .permute([0, 3, 1, 2])
    }

    /// The statistics [`GroupNorm::forward`] normalises `x` (`[N, C, H, W]`) with, in fp32.
    pub fn stats(&self, x: &Tensor) -> GroupStats {
        let (n, c, h, w) = x.size4().expect("GroupNorm input is [N, C, H, W]");
        let (var, mean) = x
            .to_kind(Kind::Float)
            .reshape([n, self.groups, (c / self.groups) * h * w])
            .var_mean_correction(&[2][..], 0, false);
        GroupStats { mean, var }
    }

    /// Normalises `x` with given statistics (for instance those of a whole image while `x` is a
    /// tile of it): `(x − mean) / sqrt(var + eps) · weight + bias`, one fp32 `addcmul` per
    /// element (per-channel scale and shift in fp32, as libtorch's kernel computes), rounded to
    /// `x`'s dtype once.
    pub fn forward_with(&self, x: &Tensor, stats: &GroupStats) -> Tensor {
        let (n, c, _, _) = x.size4().expect("GroupNorm input is [N, C, H, W]");
        let g = self.groups;
        let rstd = (&stats.var + self.eps).rsqrt().view([n, g, 1]);
        let scale = rstd * self.weight.to_kind(Kind::Float).view([1, g, c / g]);
        let shift = self.bias.to_kind(Kind::Float).view([1, g, c / g])
            - stats.mean.view([n, g, 1]) * &scale;
        let (scale, shift) = (scale.view([n, c, 1, 1]), shift.view([n, c, 1, 1]));
        shift.addcmul(x, &scale).to_kind(x.kind())
    }
}

/// `torch.nn.LayerNorm(dim, elementwise_affine=False)` over the last dimension (the adaLN blocks of
/// diffusion transformers, which modulate the normalised values themselves).
pub fn layer_norm_without_affine(x: &Tensor, dim: i64, eps: f64) -> Tensor {
    x.layer_norm([dim], None::<&Tensor>, None::<&Tensor>, eps, true)
}

/// `torch.nn.LayerNorm` over the last dimension, with affine parameters.
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    dim: i64,
    eps: f64,
}

impl LayerNorm {
    pub fn new(w: &Weights, dim: i64, eps: f64) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.get("weight", &[dim])?,
            bias: w.get("bias", &[dim])?,
            dim,
            eps,
        })
    }

    /// From its affine parameters (`[dim]` each), for benches and tests.
    pub fn from_parts(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        let dim = weight.size()[0];
        Self {
            weight,
            bias,
            dim,
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm(
            [self.dim],
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            true,
        )
    }
}

/// RMSNorm over the last dimension with a learned weight, as transformers' `Qwen2RMSNorm` and
/// diffusers' `RMSNorm`: the mean square is taken in fp32, the normalised values are cast back to
/// the input dtype, then scaled by the weight.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(w: &Weights, dim: i64, eps: f64) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.get("weight", &[dim])?,
            eps,
        })
    }

    /// From its weight (`[dim]`), for benches and tests.
    pub fn from_parts(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = x.to_kind(Kind::Float);
        let variance = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = (xf * (variance + self.eps).rsqrt()).to_kind(kind);
        normed * &self.weight
    }
}
