//! Spatial transformer of the UNet: `Transformer2DModel` (GroupNorm, proj_in, `BasicTransformerBlock`s,
//! proj_out, residual) with self- and cross-attention and a GEGLU feed-forward. After diffusers
//! `models/transformers/transformer_2d.py`, `models/attention.py`, `models/attention_processor.py`
//! (Apache-2.0); keys `norm`, `proj_in`, `transformer_blocks.N.{norm1,attn1,norm2,attn2,norm3,ff}`,
//! `proj_out`.

use tch::Tensor;

use crate::dtype::is_fp8;
use crate::error::LoadError;
use crate::loading::lora::LoraModule;
use crate::loading::weights::{Weights, load_layers};
use crate::nn::fused::{self, NormKernels};
use crate::nn::{
    AttentionImpl, Conv2d, FfGelu, GroupNorm, LayerNorm, Linear, attention, is_channels_last,
    linear_gelu_epilogue,
};

/// diffusers `Attention` as used by `BasicTransformerBlock`: bias-free q/k/v, `to_out.0` with bias.
#[derive(Debug)]
pub struct CrossAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl CrossAttention {
    pub fn new(
        w: &Weights,
        query_dim: i64,
        context_dim: i64,
        heads: i64,
        head_dim: i64,
    ) -> Result<Self, LoadError> {
        let inner = heads * head_dim;
        Ok(Self {
            to_q: Linear::new(&w.pp("to_q"), query_dim, inner, false)?,
            to_k: Linear::new(&w.pp("to_k"), context_dim, inner, false)?,
            to_v: Linear::new(&w.pp("to_v"), context_dim, inner, false)?,
            to_out: Linear::new(&w.pp("to_out.0"), inner, query_dim, true)?,
            heads,
            head_dim,
        })
    }

    /// `x` `[B, Lq, Dq]`, `context` `[B, Lk, Dk]` (or `x` itself for self-attention).
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
        let ctx = context.unwrap_or(x);
        let (b, lq, _) = x.size3().expect("attention input is [B, L, D]");
        let lk = ctx.size()[1];
        let split = |t: Tensor, l: i64| t.view([b, l, self.heads, self.head_dim]).transpose(1, 2);
        let q = split(self.to_q.forward(x), lq);
        let k = split(self.to_k.forward(ctx), lk);
        let v = split(self.to_v.forward(ctx), lk);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let o = attention(&q, &k, &v, None, scale, imp);
        self.to_out.forward(&o.transpose(1, 2).contiguous().view([
            b,
            lq,
            self.heads * self.head_dim,
        ]))
    }
}

/// `FeedForward(activation_fn="geglu")`: `net.0.proj` to 2x inner, `h * gelu(gate)`, `net.2`.
#[derive(Debug)]
struct FeedForward {
    proj: Linear,
    out: Linear,
    gelu: FfGelu,
}

impl FeedForward {
    fn new(w: &Weights, dim: i64) -> Result<Self, LoadError> {
        let inner = 4 * dim;
        Ok(Self {
            proj: Linear::new(&w.pp("net.0.proj"), dim, 2 * inner, true)?,
            out: Linear::new(&w.pp("net.2"), inner, dim, true)?,
            gelu: FfGelu::Separate,
        })
    }

    /// `net.0.proj` as two matmuls over the two row halves of its weight (views of the one tensor,
    /// so a LoRA fused into it applies to both): each half comes out contiguous, and the GELU and
    /// the product run as libtorch's vectorised kernels. Splitting one matmul's output with `chunk`
    /// leaves both halves strided, which those kernels run unvectorised: in diffusers' UNet at
    /// batch 8, 1024² on the H200 the GELU and the product took 14 % of the forward's kernel time
    /// (docs/performance.md, kernels attempt 7).
    fn forward(&self, x: &Tensor) -> Tensor {
        let w = if is_fp8(self.proj.weight.kind()) {
            self.proj.dense_weight(x.kind())
        } else {
            self.proj.weight.shallow_clone()
        };
        let inner = w.size()[0] / 2;
        let half = |t: &Tensor, n: i64| t.narrow(0, n * inner, inner);
        let mut h = x.linear(&half(&w, 0), self.proj.bias.as_ref().map(|b| half(b, 0)));
        let gate = match (self.gelu, &self.proj.bias) {
            (FfGelu::Epilogue, Some(b)) => linear_gelu_epilogue(x, &half(&w, 1), &half(b, 1)),
            _ => x
                .linear(&half(&w, 1), self.proj.bias.as_ref().map(|b| half(b, 1)))
                .gelu_("none"),
        };
        let _ = h.g_mul_(&gate);
        self.out.forward(&h)
    }
}

/// `BasicTransformerBlock` (layer_norm, self-attn, cross-attn, GEGLU feed-forward).
#[derive(Debug)]
struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: CrossAttention,
    norm2: LayerNorm,
    attn2: CrossAttention,
    norm3: LayerNorm,
    ff: FeedForward,
}

impl BasicTransformerBlock {
    fn new(w: &Weights, dim: i64, heads: i64, context_dim: i64) -> Result<Self, LoadError> {
        let head_dim = dim / heads;
        Ok(Self {
            norm1: LayerNorm::new(&w.pp("norm1"), dim, 1e-5)?,
            attn1: CrossAttention::new(&w.pp("attn1"), dim, dim, heads, head_dim)?,
            norm2: LayerNorm::new(&w.pp("norm2"), dim, 1e-5)?,
            attn2: CrossAttention::new(&w.pp("attn2"), dim, context_dim, heads, head_dim)?,
            norm3: LayerNorm::new(&w.pp("norm3"), dim, 1e-5)?,
            ff: FeedForward::new(&w.pp("ff"), dim)?,
        })
    }

    fn forward(&self, x: &Tensor, context: &Tensor, imp: AttentionImpl) -> Tensor {
        let x = x + self.attn1.forward(&self.norm1.forward(x), None, imp);
        let x = &x
            + self
                .attn2
                .forward(&self.norm2.forward(&x), Some(context), imp);
        &x + self.ff.forward(&self.norm3.forward(&x))
    }

    /// [`BasicTransformerBlock::forward`] with each residual add and the LayerNorm after it as one
    /// [`fused::add_layer_norm`]: `normed` is `norm1(x)`, and with `next` (the next block's
    /// `norm1`) the last residual add is fused with it too, returning `(x', next(x'))`.
    fn forward_fused(
        &self,
        x: &Tensor,
        normed: &Tensor,
        context: &Tensor,
        imp: AttentionImpl,
        next: Option<&LayerNorm>,
    ) -> (Tensor, Option<Tensor>) {
        let k = NormKernels::Fused;
        let a = self.attn1.forward(normed, None, imp);
        let (x, n2) = fused::add_layer_norm(x, &a, &self.norm2, k);
        let a = self.attn2.forward(&n2, Some(context), imp);
        let (x, n3) = fused::add_layer_norm(&x, &a, &self.norm3, k);
        let f = self.ff.forward(&n3);
        match next {
            Some(norm) => {
                let (x, n) = fused::add_layer_norm(&x, &f, norm, k);
                (x, Some(n))
            }
            None => (x + f, None),
        }
    }
}

/// proj_in / proj_out: Linear for SDXL (`use_linear_projection`), 1x1 conv for SD1.x-style configs.
#[derive(Debug)]
enum Proj {
    Linear(Linear),
    Conv(Conv2d),
}

/// `Transformer2DModel` in its continuous-input form.
#[derive(Debug)]
pub struct Transformer2DModel {
    norm: GroupNorm,
    proj_in: Proj,
    transformer_blocks: Vec<BasicTransformerBlock>,
    proj_out: Proj,
    attention: AttentionImpl,
    norm_kernels: NormKernels,
}

/// Sizes of one spatial transformer.
#[derive(Debug, Clone, Copy)]
pub struct Transformer2DConfig {
    pub channels: i64,
    pub heads: i64,
    pub layers: i64,
    pub context_dim: i64,
    pub groups: i64,
    pub use_linear_projection: bool,
}

impl Transformer2DModel {
    pub fn new(
        w: &Weights,
        c: Transformer2DConfig,
        attention: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let ch = c.channels;
        let proj = |name: &str| -> Result<Proj, LoadError> {
            Ok(if c.use_linear_projection {
                Proj::Linear(Linear::new(&w.pp(name), ch, ch, true)?)
            } else {
                Proj::Conv(Conv2d::new(&w.pp(name), ch, ch, 1, 1, 0)?)
            })
        };
        Ok(Self {
            norm: GroupNorm::new(&w.pp("norm"), c.groups, ch, 1e-6)?,
            proj_in: proj("proj_in")?,
            // Most of the UNet's bytes: its layers load on several threads.
            transformer_blocks: load_layers(c.layers, |i| {
                BasicTransformerBlock::new(
                    &w.pp("transformer_blocks").pp(i),
                    ch,
                    c.heads,
                    c.context_dim,
                )
            })?,
            proj_out: proj("proj_out")?,
            attention,
            norm_kernels: NormKernels::Aten,
        })
    }

    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Tensor {
        let (b, c, h, w) = x.size4().expect("Transformer2DModel input is [B, C, H, W]");
        let normed = fused::group_norm(&self.norm, x, None, false, self.norm_kernels);
        let to_seq = |t: &Tensor| t.permute([0, 2, 3, 1]).reshape([b, h * w, c]);
        let mut s = match &self.proj_in {
            Proj::Linear(l) => l.forward(&to_seq(&normed)),
            Proj::Conv(conv) => to_seq(&conv.forward(&normed)),
        };
        drop(normed);
        match self.norm_kernels {
            NormKernels::Aten => {
                for block in &self.transformer_blocks {
                    s = block.forward(&s, context, self.attention);
                }
            }
            NormKernels::Fused => {
                let blocks = &self.transformer_blocks;
                let mut normed = blocks.first().map(|b| b.norm1.forward(&s));
                for (i, block) in blocks.iter().enumerate() {
                    let next = blocks.get(i + 1).map(|b| &b.norm1);
                    let n1 = normed.take().expect("norm1 of this block was computed");
                    (s, normed) = block.forward_fused(&s, &n1, context, self.attention, next);
                }
            }
        }
        let out = match &self.proj_out {
            // An NHWC input gets an NHWC output: the permuted view already is one.
            Proj::Linear(l) if is_channels_last(x) => {
                l.forward(&s).reshape([b, h, w, c]).permute([0, 3, 1, 2])
            }
            Proj::Linear(l) => l
                .forward(&s)
                .reshape([b, h, w, c])
                .permute([0, 3, 1, 2])
                .contiguous(),
            Proj::Conv(conv) => conv.forward(&s.reshape([b, h, w, c]).permute([0, 3, 1, 2])),
        };
        out + x
    }
}

impl Transformer2DModel {
    /// How every feed-forward of this transformer computes its GELU (default: separately, as
    /// diffusers).
    pub fn set_ff_gelu(&mut self, gelu: FfGelu) {
        for b in &mut self.transformer_blocks {
            b.ff.gelu = gelu;
        }
    }

    /// Which kernels run the input GroupNorm and the blocks' residual adds and LayerNorms
    /// ([`NormKernels`], default libtorch's).
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        self.norm_kernels = k;
    }
}

/// The modules LoRAs patch, by diffusers name under `prefix` (`….attentions.0.`).
impl Transformer2DModel {
    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        let proj = |name: &str, p: &'a mut Proj| {
            let m = match p {
                Proj::Linear(l) => LoraModule::Linear(l),
                Proj::Conv(c) => LoraModule::Conv2d(c),
            };
            (format!("{prefix}{name}"), m)
        };
        out.push(proj("proj_in", &mut self.proj_in));
        out.push(proj("proj_out", &mut self.proj_out));
        for (i, b) in self.transformer_blocks.iter_mut().enumerate() {
            let p = format!("{prefix}transformer_blocks.{i}");
            for (name, a) in [("attn1", &mut b.attn1), ("attn2", &mut b.attn2)] {
                out.extend([
                    (format!("{p}.{name}.to_q"), (&mut a.to_q).into()),
                    (format!("{p}.{name}.to_k"), (&mut a.to_k).into()),
                    (format!("{p}.{name}.to_v"), (&mut a.to_v).into()),
                    (format!("{p}.{name}.to_out.0"), (&mut a.to_out).into()),
                ]);
            }
            out.push((format!("{p}.ff.net.0.proj"), (&mut b.ff.proj).into()));
            out.push((format!("{p}.ff.net.2"), (&mut b.ff.out).into()));
        }
    }
}
