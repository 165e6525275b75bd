//! Sinusoidal timestep features (`Timesteps`) and the MLP that embeds them (`TimestepEmbedding`),
//! after diffusers `models/embeddings.py` (Apache-2.0): `get_timestep_embedding`,
//! `Timesteps(flip_sin_to_cos, downscale_freq_shift)`, `TimestepEmbedding(linear_1, silu, linear_2)`.

use tch::{Kind, Tensor};

use crate::error::LoadError;
use crate::loading::weights::Weights;
use crate::nn::Linear;

/// `get_timestep_embedding(t, dim, flip_sin_to_cos, downscale_freq_shift, scale)` in fp32, same op
/// order as diffusers: `exp(-ln(10000) * arange(half) / (half - shift))` times the timestep, then
/// times `scale` (after the product: scaling the timestep first rounds differently once the
/// arguments reach hundreds of radians, as QwenImage's `scale = 1000` makes them), `[sin, cos]`
/// (flipped to `[cos, sin]`), a zero column appended for odd `dim`.
pub fn timestep_features(
    t: &Tensor,
    dim: i64,
    flip_sin_to_cos: bool,
    freq_shift: f64,
    scale: f64,
) -> Tensor {
    let half = dim / 2;
    let device = t.device();
    let exponent = Tensor::arange(half, (Kind::Float, device)) * (-(10000f64).ln());
    let exponent = exponent / (half as f64 - freq_shift);
    let freqs = exponent.exp();
    let args = t.to_kind(Kind::Float).unsqueeze(1) * freqs.unsqueeze(0);
    let args = if scale == 1.0 { args } else { args * scale };
    let (sin, cos) = (args.sin(), args.cos());
    let emb = if flip_sin_to_cos {
        Tensor::cat(&[cos, sin], -1)
    } else {
        Tensor::cat(&[sin, cos], -1)
    };
    if dim % 2 == 1 {
        emb.constant_pad_nd([0, 1, 0, 0])
    } else {
        emb
    }
}

/// `TimestepEmbedding`: `linear_2(silu(linear_1(x)))`.
#[derive(Debug)]
pub struct TimestepEmbedding {
    pub linear_1: Linear,
    pub linear_2: Linear,
}

impl TimestepEmbedding {
    pub fn new(w: &Weights, in_dim: i64, out_dim: i64) -> Result<Self, LoadError> {
        Ok(Self {
            linear_1: Linear::new(&w.pp("linear_1"), in_dim, out_dim, true)?,
            linear_2: Linear::new(&w.pp("linear_2"), out_dim, out_dim, true)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.linear_2.forward(&self.linear_1.forward(x).silu())
    }
}
