//! The handful of layers every component is built from (Linear, Conv2d, GroupNorm, LayerNorm),
//! holding plain tensors loaded through [`Weights`]; plus the attention kernel choice.
//!
//! Layer semantics follow `torch.nn` exactly so that diffusers checkpoints load unchanged.

use tch::Tensor;

use crate::error::LoadError;
use crate::weights::Weights;

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

/// `torch.nn.Linear`.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(w: &Weights, in_dim: i64, out_dim: i64, bias: bool) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.get("weight", &[out_dim, in_dim])?,
            bias: if bias {
                Some(w.get("bias", &[out_dim])?)
            } else {
                None
            },
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
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

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.group_norm(
            self.groups,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            true,
        )
    }
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
