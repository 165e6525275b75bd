//! The handful of layers every component is built from (Linear, Conv2d, GroupNorm, LayerNorm,
//! RmsNorm), holding plain tensors loaded through [`Weights`]; the attention kernel choice;
//! [`embeddings`] (timestep embeddings); [`tiling`] (VAE tile-and-blend).
//!
//! Layer semantics follow `torch.nn` exactly so that diffusers checkpoints load unchanged. A
//! [`Linear`] may hold its weight in fp8 (see [`crate::loading::weights::Fp8Mode`]): it is then
//! upcast to the activations' dtype, times its per-tensor scale, at every call; or, through
//! [`Linear::forward_fp8`] on a GPU, multiplied in fp8 by `_scaled_mm` with the activations
//! quantised per call ([`Fp8Input`]).

pub mod embeddings;
pub mod rope;
pub mod tiling;

use tch::{Kind, Tensor};

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

/// Whether `kind` is one of the 8-bit float kinds.
pub fn is_fp8(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float8e4m3fn | Kind::Float8e5m2 | Kind::Float8e4m3fnuz | Kind::Float8e5m2fnuz
    )
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

    /// Replaces a dense weight by its float8_e4m3fn quantisation with a per-tensor scale
    /// (`amax / 448`), the layout fp8-resident checkpoints load into, so that
    /// [`Linear::forward_fp8`] multiplies it in fp8. Already-fp8 weights are left as they are.
    pub fn quantise_to_fp8(&mut self) {
        if is_fp8(self.weight.kind()) {
            return;
        }
        let (q, scale) = quantise_fp8(&self.weight.to_kind(Kind::Float), Kind::Float8e4m3fn);
        self.weight = q;
        self.weight_scale = Some(scale);
    }

    /// [`Linear::forward`], except that an e4m3fn weight with a scale, on a CUDA device, is
    /// multiplied in fp8 (`torch._scaled_mm`, fp32 accumulation, output in `x`'s dtype) with `x`
    /// quantised per tensor. `x` is quantised at most once per `shared` slot, so layers that
    /// read the same input (q, k, v) share one quantisation. Dense weights take
    /// [`Linear::forward`] unchanged.
    pub fn forward_fp8(&self, x: &Tensor, shared: &mut Option<Fp8Input>) -> Tensor {
        let (Some(scale), Kind::Float8e4m3fn) = (&self.weight_scale, self.weight.kind()) else {
            return self.forward(x);
        };
        if !x.device().is_cuda() {
            return self.forward(x);
        }
        self.scaled_mm(x, scale, shared)
    }

    /// The fp8 product of [`Linear::forward_fp8`] on any device (the CPU's `_scaled_mm` serves
    /// the unit test).
    fn scaled_mm(&self, x: &Tensor, scale: &Tensor, shared: &mut Option<Fp8Input>) -> Tensor {
        let input = shared.get_or_insert_with(|| Fp8Input::quantise(x));
        let out_dim = self.weight.size()[0];
        // `_scaled_mm` takes the second operand column-major: the `[out, in]` weight transposed.
        let y = input.data.internal_scaled_mm(
            &self.weight.tr(),
            &input.scale,
            scale,
            self.bias.as_ref(),
            None::<&Tensor>,
            x.kind(),
            false,
        );
        let mut shape = x.size();
        *shape
            .last_mut()
            .expect("a Linear input has a feature dimension") = out_dim;
        y.view(shape.as_slice())
    }
}

/// Activations quantised for [`Linear::forward_fp8`]: `[rows, in]` float8_e4m3fn and the 0-d
/// fp32 per-tensor scale (`amax / 448`, dynamic: measured on every call).
#[derive(Debug)]
pub struct Fp8Input {
    data: Tensor,
    scale: Tensor,
}

impl Fp8Input {
    pub fn quantise(x: &Tensor) -> Self {
        let features = *x
            .size()
            .last()
            .expect("a Linear input has a feature dimension");
        let x = x.reshape([-1, features]);
        // amax as one reduction: the ∞-norm of the flattened input, accumulated in fp32.
        let amax = x
            .view([-1])
            .linalg_norm(f64::INFINITY, None::<&[i64]>, false, Kind::Float)
            .clamp_min(1e-12);
        let scale = &amax / 448.0;
        // Scale and cast in one kernel: the product is written straight into the fp8 output.
        // |x| · 448 / amax ≤ 448 up to rounding, and e4m3fn rounds anything below 464 to 448.
        let inverse = 448.0 / amax;
        let data = x.empty_like().to_kind(Kind::Float8e4m3fn);
        let data = x
            .f_mul_out(&data, &inverse)
            // A backend without fp8 stores in its elementwise kernels: scale, then cast.
            .unwrap_or_else(|_| (&x * &inverse).to_kind(Kind::Float8e4m3fn));
        Self { data, scale }
    }
}

/// fp32 `w` to fp8 `kind` with a per-tensor scale `amax / fp8_max` (1 for an all-zero tensor),
/// rounding to nearest. Returns (fp8 weight, 0-d fp32 scale), both on `w`'s device.
pub fn quantise_fp8(w: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let max = match kind {
        Kind::Float8e4m3fn => 448.0,
        Kind::Float8e4m3fnuz => 240.0,
        _ => 57344.0, // e5m2, e5m2fnuz
    };
    let amax = w.abs().max();
    let scale = (&amax / max).where_self(&amax.gt(0.0), &amax.ones_like());
    // The clamp only catches the last-bit overshoot of `w / scale` at ±amax.
    let q = (w / &scale).clamp(-max, max).to_kind(kind);
    (q, scale)
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
        x.conv2d(
            &self.weight,
            self.bias.as_ref(),
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

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = x.to_kind(Kind::Float);
        let variance = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = (xf * (variance + self.eps).rsqrt()).to_kind(kind);
        normed * &self.weight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fp8 product against the dense one on the same (bf16) weights: e4m3fn keeps 3 mantissa
    /// bits, so each element carries up to 2⁻⁴ relative rounding in both operands.
    #[test]
    fn fp8_product_matches_the_dense_linear_within_fp8_rounding() {
        tch::manual_seed(0);
        let dense = Linear {
            weight: Tensor::randn([48, 64], (Kind::Float, tch::Device::Cpu))
                .to_kind(Kind::BFloat16),
            weight_scale: None,
            bias: Some(
                Tensor::randn([48], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16),
            ),
        };
        let x = (Tensor::randn([2, 16, 64], (Kind::Float, tch::Device::Cpu)) * 3.0)
            .to_kind(Kind::BFloat16);
        let want = dense.forward(&x).to_kind(Kind::Float);
        let mut q = Linear {
            weight: dense.weight.copy(),
            weight_scale: None,
            bias: dense.bias.as_ref().map(Tensor::copy),
        };
        q.quantise_to_fp8();
        assert_eq!(q.weight.kind(), Kind::Float8e4m3fn);
        let scale = q
            .weight_scale
            .as_ref()
            .expect("quantised with a scale")
            .copy();
        // On the CPU `forward_fp8` takes the dense path: exactly `forward` on the dequantised weight.
        let fallback = q.forward_fp8(&x, &mut None);
        assert!(fallback.equal(&q.forward(&x)));
        let got = q.scaled_mm(&x, &scale, &mut None);
        assert_eq!(got.size(), vec![2, 16, 48]);
        assert_eq!(got.kind(), Kind::BFloat16);
        let rel = (got.to_kind(Kind::Float) - &want).norm().double_value(&[])
            / want.norm().double_value(&[]);
        assert!(rel < 0.05, "relative error {rel}");
    }
}
