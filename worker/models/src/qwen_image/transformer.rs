//! The QwenImage diffusion transformer (`QwenImageTransformer2DModel`, 20 B parameters at real
//! size): packed latent tokens of the target and reference images plus the text encoder's hidden
//! states in, the flow prediction for every image token out.
//!
//! Ported from diffusers 0.42.1 `models/transformers/transformer_qwenimage.py` (Apache-2.0,
//! Copyright 2025 Qwen-Image Team, The HuggingFace Team): `QwenTimestepProjEmbeddings`,
//! `QwenDoubleStreamAttnProcessor2_0`, `QwenImageTransformerBlock`, `QwenImageTransformer2DModel`,
//! with `AdaLayerNormContinuous` and `FeedForward("gelu-approximate")` from `normalization.py` and
//! `attention.py`. The 3-D RoPE is in [`super::rope`].
//!
//! Field names equal the checkpoint keys (`img_in`, `txt_norm`, `txt_in`,
//! `time_text_embed.timestep_embedder.linear_{1,2}`, `transformer_blocks.N.{img_mod.1, txt_mod.1,
//! attn.{to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj, to_out.0, to_add_out, norm_q,
//! norm_k, norm_added_q, norm_added_k}, img_mlp.net.{0.proj, 2}, txt_mlp.net.{0.proj, 2}}`,
//! `norm_out.linear`, `proj_out`). ComfyUI's single file uses the same names, optionally under
//! `model.diffusion_model.` or `diffusion_model.` ([`transformer_store`]).
//!
//! Invariants, as the reference:
//! - the timestep is σ in [0, 1] (the pipeline passes `t / 1000`); `time_proj` scales it by 1000;
//! - blocks modulate with (shift, scale, gate) per half, `norm_out` with (scale, shift);
//! - joint attention runs over `cat([text, image])`; with a prompt mask the padded text keys are
//!   masked out for every query (image keys never are), and the text RoPE positions are those of
//!   the padded length regardless of the mask; without a mask no mask tensor is built;
//! - RoPE and the RMSNorm statistics are computed in fp32 and cast back.
//!
//! The adaLN modulations (`img_mod`, `txt_mod`, `norm_out.linear` of SiLU(temb)) depend on the
//! timestep alone. [`QwenImageTransformer2DModel::step_modulations`] computes them for a whole
//! schedule with one GEMM per layer (M = steps: the 113 MB of modulation weights per block are
//! read once, not once per step) and keeps the last schedule's, so that every edit with the same
//! schedule reuses them; [`QwenImageTransformer2DModel::forward_step`] takes them in place of the
//! timestep. Any change of the weights (`linears_mut`, the only way to them) drops the cache.

use std::path::Path;
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use crate::dtype::is_fp8;
use crate::error::{GenerateError, LoadError};
use crate::loading::diffusers::component_store;
use crate::loading::safetensors::SafetensorsFile;
use crate::loading::weights::{WeightStore, Weights, load_layers};
use crate::nn::embeddings::timestep_features;
use crate::nn::fp8::Fp8Linear;
use crate::nn::{AttentionImpl, FfGelu, Linear, RmsNorm, attention};
use crate::nn::{layer_norm_without_affine, linear_gelu_epilogue};
use crate::qwen_image::kernels::{
    BlockKernels, StreamQkv, gelu_fp8, joint_qkv, residual_norm, residual_norm_fp8,
};
use crate::qwen_image::rope::{ImageShape, QwenEmbedRope, RopeTables};

/// Key prefixes of single-file checkpoints, stripped by [`transformer_store`] (ComfyUI's full
/// checkpoints and its bare diffusion-model files).
pub const KEY_PREFIXES: [&str; 2] = ["model.diffusion_model.", "diffusion_model."];

/// The diffusers name of a checkpoint key: [`KEY_PREFIXES`] stripped, otherwise unchanged.
pub fn diffusers_key(key: &str) -> Option<String> {
    let bare = KEY_PREFIXES
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .unwrap_or(key);
    Some(bare.to_string())
}

/// A single-file transformer checkpoint (diffusers names, bare or under a [`KEY_PREFIXES`]
/// prefix; any dtype per tensor, fp8 Linear weights with or without a scale).
pub fn transformer_store(file: Arc<SafetensorsFile>) -> WeightStore {
    WeightStore::renamed(file, diffusers_key)
}

/// A diffusers `transformer/` folder: `diffusion_pytorch_model.safetensors`, or its shards with
/// the `.safetensors.index.json`.
pub fn transformer_folder_store(dir: &Path) -> Result<WeightStore, LoadError> {
    component_store(dir, "diffusion_pytorch_model", diffusers_key)
}

/// `QwenImageTransformer2DModel` config, plus the constants its code fixes (as fields).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QwenImageTransformerConfig {
    pub patch_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub num_layers: i64,
    pub attention_head_dim: i64,
    pub num_attention_heads: i64,
    pub joint_attention_dim: i64,
    /// Head-dimension split of the 3-D RoPE (frame, height, width); sums to `attention_head_dim`.
    pub axes_dims_rope: [i64; 3],
    /// RoPE base (`QwenEmbedRope(theta=10000)`).
    pub rope_theta: f64,
    /// Epsilon of every LayerNorm and RMSNorm (`eps=1e-6` throughout the reference).
    pub norm_eps: f64,
    /// Sinusoidal timestep features (`Timesteps(num_channels=256)`).
    pub time_proj_dim: i64,
    /// `Timesteps(scale=1000)`: σ in [0, 1] becomes the 0–1000 timestep.
    pub time_proj_scale: f64,
    /// `FeedForward(mult=4)`: MLP hidden size over model width.
    pub mlp_ratio: i64,
}

impl Default for QwenImageTransformerConfig {
    /// The defaults of `QwenImageTransformer2DModel.__init__`, which are the released model's.
    fn default() -> Self {
        Self {
            patch_size: 2,
            in_channels: 64,
            out_channels: 16,
            num_layers: 60,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 3584,
            axes_dims_rope: [16, 56, 56],
            rope_theta: 10000.0,
            norm_eps: 1e-6,
            time_proj_dim: 256,
            time_proj_scale: 1000.0,
            mlp_ratio: 4,
        }
    }
}

impl QwenImageTransformerConfig {
    /// Qwen/Qwen-Image-Edit-2509 `transformer/config.json` (patch 2, in 64, out 16, 60 layers,
    /// 24 heads of 128, joint dim 3584, RoPE axes (16, 56, 56), no guidance embedding).
    pub fn qwen_image_edit_2509() -> Self {
        Self::default()
    }

    /// The tiny test transformer of `fixtures/qwen/common.py` (diffusers 0.42.1
    /// `tests/pipelines/qwenimage/test_qwenimage_edit_plus.py::get_dummy_components`).
    pub fn tiny() -> Self {
        Self {
            patch_size: 2,
            in_channels: 16,
            out_channels: 4,
            num_layers: 2,
            attention_head_dim: 16,
            num_attention_heads: 3,
            joint_attention_dim: 16,
            axes_dims_rope: [8, 4, 4],
            ..Self::default()
        }
    }

    /// Parses a diffusers `transformer/config.json`. Missing keys take the reference defaults;
    /// `out_channels: null` means `in_channels`. Flags of other Qwen-Image variants that this port
    /// does not implement are rejected by name.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if !v.is_object() {
            return Err("the transformer config is not a JSON object".into());
        }
        for (flag, what) in [
            ("guidance_embeds", "guidance embedding"),
            (
                "zero_cond_t",
                "zero-timestep conditioning of reference tokens (Edit-2511)",
            ),
            ("use_additional_t_cond", "additional timestep conditioning"),
            ("use_layer3d_rope", "layered 3-D RoPE"),
        ] {
            match v.get(flag) {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
                Some(serde_json::Value::Bool(true)) => {
                    return Err(format!("`{flag}: true` ({what}) is not supported"));
                }
                Some(other) => return Err(format!("`{flag}` is not a boolean: {other}")),
            }
        }
        let d = Self::default();
        let int = |k: &str, default: i64| -> Result<i64, String> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(x) => x.as_i64().ok_or_else(|| format!("`{k}` is not an integer")),
            }
        };
        let in_channels = int("in_channels", d.in_channels)?;
        let axes_dims_rope = match v.get("axes_dims_rope") {
            None => d.axes_dims_rope,
            Some(a) => {
                let dims: Vec<i64> = a
                    .as_array()
                    .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
                    .ok_or("`axes_dims_rope` is not a list of integers")?;
                <[i64; 3]>::try_from(dims.as_slice())
                    .map_err(|_| format!("`axes_dims_rope` has {} entries, not 3", dims.len()))?
            }
        };
        let config = Self {
            patch_size: int("patch_size", d.patch_size)?,
            in_channels,
            out_channels: int("out_channels", in_channels)?,
            num_layers: int("num_layers", d.num_layers)?,
            attention_head_dim: int("attention_head_dim", d.attention_head_dim)?,
            num_attention_heads: int("num_attention_heads", d.num_attention_heads)?,
            joint_attention_dim: int("joint_attention_dim", d.joint_attention_dim)?,
            axes_dims_rope,
            ..d
        };
        config.validate()?;
        Ok(config)
    }

    /// The structural constraints the model relies on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("patch_size", self.patch_size),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("num_layers", self.num_layers),
            ("attention_head_dim", self.attention_head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("joint_attention_dim", self.joint_attention_dim),
            ("time_proj_dim", self.time_proj_dim),
            ("mlp_ratio", self.mlp_ratio),
        ];
        if let Some((k, v)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("`{k}` must be positive, is {v}"));
        }
        let axes = self.axes_dims_rope;
        if axes.iter().any(|d| *d <= 0 || d % 2 != 0) {
            return Err(format!(
                "`axes_dims_rope` {axes:?} must be positive and even"
            ));
        }
        if axes.iter().sum::<i64>() != self.attention_head_dim {
            return Err(format!(
                "`axes_dims_rope` {axes:?} must sum to attention_head_dim {}",
                self.attention_head_dim
            ));
        }
        Ok(())
    }

    /// Model width `num_attention_heads * attention_head_dim`.
    pub fn inner_dim(&self) -> i64 {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Channels of one output token, `patch_size² * out_channels`.
    pub fn out_token_dim(&self) -> i64 {
        self.patch_size * self.patch_size * self.out_channels
    }
}

/// `QwenTimestepProjEmbeddings`: `Timesteps(256, flip_sin_to_cos, shift 0, scale 1000)` then
/// `TimestepEmbedding` (`timestep_embedder.linear_2(silu(linear_1(·)))`). The embedder's Linears
/// are held here (not in a shared `TimestepEmbedding`) so that LoRA fusing can reach them.
#[derive(Debug)]
struct QwenTimestepProjEmbeddings {
    linear_1: Linear,
    linear_2: Linear,
    proj_dim: i64,
    proj_scale: f64,
}

impl QwenTimestepProjEmbeddings {
    fn new(w: &Weights, c: &QwenImageTransformerConfig) -> Result<Self, LoadError> {
        let w = w.pp("timestep_embedder");
        let dim = c.inner_dim();
        Ok(Self {
            linear_1: Linear::new(&w.pp("linear_1"), c.time_proj_dim, dim, true)?,
            linear_2: Linear::new(&w.pp("linear_2"), dim, dim, true)?,
            proj_dim: c.time_proj_dim,
            proj_scale: c.time_proj_scale,
        })
    }

    /// `timestep` `[B]` already in the activations' dtype → `[B, inner]`.
    fn forward(&self, timestep: &Tensor, kind: Kind) -> Tensor {
        let proj =
            timestep_features(timestep, self.proj_dim, true, 0.0, self.proj_scale).to_kind(kind);
        self.linear_2.forward(&self.linear_1.forward(&proj).silu())
    }
}

/// `FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate")`: `net.0.proj`, GELU (tanh),
/// `net.2`.
#[derive(Debug)]
struct FeedForward {
    proj_in: Linear,
    proj_out: Linear,
}

impl FeedForward {
    fn new(w: &Weights, dim: i64, hidden: i64) -> Result<Self, LoadError> {
        Ok(Self {
            proj_in: Linear::new(&w.pp("net").pp(0).pp("proj"), dim, hidden, true)?,
            proj_out: Linear::new(&w.pp("net").pp(2), hidden, dim, true)?,
        })
    }

    /// With `FfGelu::Epilogue` on CUDA the GELU-tanh runs in the FF-up GEMM's cuBLASLt epilogue
    /// (the same tanh approximation); elsewhere (and on the CPU, whose epilogue is erf GELU) as
    /// its own kernel.
    fn forward(&self, x: &Tensor, gelu: FfGelu) -> Tensor {
        let hidden = match (&self.proj_in.bias, gelu) {
            (Some(bias), FfGelu::Epilogue) if x.device().is_cuda() => {
                linear_gelu_epilogue(x, &self.proj_in.dense_weight(x.kind()), bias)
            }
            _ => self.proj_in.forward(x).gelu("tanh"),
        };
        self.proj_out.forward(&hidden)
    }
}

/// The block's `Attention` with `QwenDoubleStreamAttnProcessor2_0`: image projections `to_*`,
/// text projections `add_*_proj`, per-head RMSNorm on queries and keys, RoPE per stream, one
/// attention over `cat([text, image])`.
#[derive(Debug)]
struct JointAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    add_q_proj: Linear,
    add_k_proj: Linear,
    add_v_proj: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    to_out: Linear,
    to_add_out: Linear,
    heads: i64,
    head_dim: i64,
    /// `to_q`, `to_k`, `to_v` as one Linear (`[3·inner, inner]`) whose storage the three share
    /// ([`JointAttention::fuse_qkv`]); `None` unless fused.
    img_qkv: Option<Linear>,
    /// The same for `add_q_proj`, `add_k_proj`, `add_v_proj`.
    txt_qkv: Option<Linear>,
}

/// `[q, k, v]` Linears as one: the weights (and biases) concatenated over outputs into one tensor,
/// and each Linear's own weight and bias replaced by its view of it, so that memory does not grow.
/// `None` (nothing changed) where a weight is fp8 (per-tensor scales differ) or a bias is missing.
fn fuse_linears(parts: [&mut Linear; 3]) -> Option<Linear> {
    if parts
        .iter()
        .any(|l| is_fp8(l.weight.kind()) || l.bias.is_none() || l.weight_scale.is_some())
    {
        return None;
    }
    let weight = Tensor::cat(&parts.each_ref().map(|l| l.weight.shallow_clone()), 0);
    let bias = Tensor::cat(
        &parts
            .each_ref()
            .map(|l| l.bias.as_ref().expect("checked above").shallow_clone()),
        0,
    );
    let mut start = 0;
    for l in parts {
        let rows = l.weight.size()[0];
        l.weight = weight.narrow(0, start, rows);
        l.bias = Some(bias.narrow(0, start, rows));
        start += rows;
    }
    Some(Linear {
        weight,
        weight_scale: None,
        bias: Some(bias),
    })
}

/// Whether `parts` still hold their views of `fused`'s weight and bias, in order.
fn holds_views(fused: &Linear, parts: [&Linear; 3]) -> bool {
    let (w, b) = (
        &fused.weight,
        fused.bias.as_ref().expect("a fused Linear has a bias"),
    );
    let elt = w.kind().elt_size_in_bytes();
    let mut start = 0usize;
    parts.iter().all(|l| {
        let rows = l.weight.size()[0] as usize;
        let ok = l.weight.data_ptr() as usize
            == w.data_ptr() as usize + start * w.size()[1] as usize * elt
            && l.bias
                .as_ref()
                .is_some_and(|lb| lb.data_ptr() as usize == b.data_ptr() as usize + start * elt);
        start += rows;
        ok
    })
}

/// `[q, k, v]` projections of `x`: one GEMM through `fused` where the three Linears still hold
/// their views of it (a LoRA fused since replaces a weight, and the three GEMMs run again), each
/// result then a view `[B, S, inner]` of the `[B, S, 3·inner]` output; three GEMMs otherwise.
fn project_qkv(fused: Option<&Linear>, parts: [&Linear; 3], x: &Tensor) -> [Tensor; 3] {
    match fused.filter(|f| holds_views(f, parts)) {
        Some(f) => {
            let y = f.forward(x);
            let mut start = 0;
            parts.map(|l| {
                let rows = l.weight.size()[0];
                let v = y.narrow(-1, start, rows);
                start += rows;
                v
            })
        }
        None => parts.map(|l| l.forward(x)),
    }
}

impl JointAttention {
    fn new(w: &Weights, c: &QwenImageTransformerConfig) -> Result<Self, LoadError> {
        let dim = c.inner_dim();
        let hd = c.attention_head_dim;
        let lin = |name: &str| Linear::new(&w.pp(name), dim, dim, true);
        let norm = |name: &str| RmsNorm::new(&w.pp(name), hd, c.norm_eps);
        Ok(Self {
            to_q: lin("to_q")?,
            to_k: lin("to_k")?,
            to_v: lin("to_v")?,
            add_q_proj: lin("add_q_proj")?,
            add_k_proj: lin("add_k_proj")?,
            add_v_proj: lin("add_v_proj")?,
            norm_q: norm("norm_q")?,
            norm_k: norm("norm_k")?,
            norm_added_q: norm("norm_added_q")?,
            norm_added_k: norm("norm_added_k")?,
            to_out: Linear::new(&w.pp("to_out").pp(0), dim, dim, true)?,
            to_add_out: lin("to_add_out")?,
            heads: c.num_attention_heads,
            head_dim: hd,
            img_qkv: None,
            txt_qkv: None,
        })
    }

    /// Fuses (or, with `fused = false`, stops using) each stream's q, k, v projections into one
    /// GEMM. Memory-neutral: the three Linears keep views of the fused weight.
    fn fuse_qkv(&mut self, fused: bool) {
        if !fused {
            (self.img_qkv, self.txt_qkv) = (None, None);
            return;
        }
        // Fused again where a LoRA replaced a weight since.
        if !self
            .img_qkv
            .as_ref()
            .is_some_and(|f| holds_views(f, [&self.to_q, &self.to_k, &self.to_v]))
        {
            self.img_qkv = fuse_linears([&mut self.to_q, &mut self.to_k, &mut self.to_v]);
        }
        let txt = [&self.add_q_proj, &self.add_k_proj, &self.add_v_proj];
        if !self.txt_qkv.as_ref().is_some_and(|f| holds_views(f, txt)) {
            self.txt_qkv = fuse_linears([
                &mut self.add_q_proj,
                &mut self.add_k_proj,
                &mut self.add_v_proj,
            ]);
        }
    }

    /// Returns `(image output, text output)`. `mask` is the additive joint mask `[B, 1, 1, L+N]`.
    fn forward(
        &self,
        img: ImageIn<'_>,
        txt: &Tensor,
        rope: &RopeTables,
        mask: Option<&Tensor>,
        imp: AttentionImpl,
        kernels: BlockKernels,
    ) -> (Tensor, Tensor) {
        let seq_txt = txt.size()[1];
        let [img_q, img_k, img_v] = match img {
            ImageIn::Hidden(x) => project_qkv(
                self.img_qkv.as_ref(),
                [&self.to_q, &self.to_k, &self.to_v],
                x,
            ),
            ImageIn::Projected(qkv) => qkv,
        };
        let [txt_q, txt_k, txt_v] = project_qkv(
            self.txt_qkv.as_ref(),
            [&self.add_q_proj, &self.add_k_proj, &self.add_v_proj],
            txt,
        );
        // [B, H, L + N, D], text first.
        let [q, k, v] = joint_qkv(
            StreamQkv {
                q: &txt_q,
                k: &txt_k,
                v: &txt_v,
                norm_q: &self.norm_added_q,
                norm_k: &self.norm_added_k,
                cos: &rope.txt_cos,
                sin: &rope.txt_sin,
                cis: &rope.txt_cis,
            },
            StreamQkv {
                q: &img_q,
                k: &img_k,
                v: &img_v,
                norm_q: &self.norm_q,
                norm_k: &self.norm_k,
                cos: &rope.img_cos,
                sin: &rope.img_sin,
                cis: &rope.img_cis,
            },
            self.heads,
            self.head_dim,
            kernels.qk_norm_rope,
        );
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let out = attention(&q, &k, &v, mask, scale, imp)
            .transpose(1, 2)
            .flatten(2, 3);
        let total = out.size()[1];
        let txt_out = out.narrow(1, 0, seq_txt).contiguous();
        let img_out = out.narrow(1, seq_txt, total - seq_txt).contiguous();
        (
            self.to_out.forward(&img_out),
            self.to_add_out.forward(&txt_out),
        )
    }
}

/// The image stream's input to the joint attention: its normalised hidden state, which the
/// attention projects, or q, k and v already projected (by the fp8 GEMM).
enum ImageIn<'a> {
    Hidden(&'a Tensor),
    Projected([Tensor; 3]),
}

/// The image stream's q/k/v (one GEMM), FF-up and FF-down projections as fp8 GEMMs
/// ([`BlockKernels::fp8_gemm`]), made from the block's Linears by
/// [`QwenImageTransformer2DModel::set_block_kernels`] and used while those still hold the weights
/// they were made from.
#[derive(Debug)]
struct ImageFp8 {
    qkv: Fp8Linear,
    ff_up: Fp8Linear,
    ff_down: Fp8Linear,
}

impl ImageFp8 {
    fn of(attn: &JointAttention, mlp: &FeedForward) -> Option<Self> {
        Some(Self {
            qkv: Fp8Linear::of(&[&attn.to_q, &attn.to_k, &attn.to_v])?,
            ff_up: Fp8Linear::of(&[&mlp.proj_in])?,
            ff_down: Fp8Linear::of(&[&mlp.proj_out])?,
        })
    }

    fn current(&self, attn: &JointAttention, mlp: &FeedForward) -> bool {
        self.qkv.made_from(&[&attn.to_q, &attn.to_k, &attn.to_v])
            && self.ff_up.made_from(&[&mlp.proj_in])
            && self.ff_down.made_from(&[&mlp.proj_out])
    }
}

/// `(shift, scale, gate)` `[B, dim]` each, from one third-split of a modulation `[B, 3*dim]`
/// (views of it, in place).
fn mod_terms(params: &Tensor) -> [Tensor; 3] {
    let p = params.chunk(3, -1);
    [
        p[0].shallow_clone(),
        p[1].shallow_clone(),
        p[2].shallow_clone(),
    ]
}

/// `QwenImageTransformerBlock`: dual-stream (image, text) block with adaLN modulation.
#[derive(Debug)]
pub struct QwenImageTransformerBlock {
    img_mod: Linear,
    txt_mod: Linear,
    attn: JointAttention,
    img_mlp: FeedForward,
    txt_mlp: FeedForward,
    eps: f64,
    /// The image stream's fp8 GEMMs, where [`BlockKernels::fp8_gemm`] made them.
    img_fp8: Option<ImageFp8>,
}

impl QwenImageTransformerBlock {
    fn new(w: &Weights, c: &QwenImageTransformerConfig) -> Result<Self, LoadError> {
        let dim = c.inner_dim();
        Ok(Self {
            img_mod: Linear::new(&w.pp("img_mod").pp(1), dim, 6 * dim, true)?,
            txt_mod: Linear::new(&w.pp("txt_mod").pp(1), dim, 6 * dim, true)?,
            attn: JointAttention::new(&w.pp("attn"), c)?,
            img_mlp: FeedForward::new(&w.pp("img_mlp"), dim, dim * c.mlp_ratio)?,
            txt_mlp: FeedForward::new(&w.pp("txt_mlp"), dim, dim * c.mlp_ratio)?,
            eps: c.norm_eps,
            img_fp8: None,
        })
    }

    /// Makes (`on`) or drops the image stream's fp8 GEMMs; kept where still made from the current
    /// weights. Returns whether the block has them.
    fn prepare_fp8(&mut self, on: bool) -> bool {
        if !on {
            self.img_fp8 = None;
            return false;
        }
        if !self
            .img_fp8
            .as_ref()
            .is_some_and(|f| f.current(&self.attn, &self.img_mlp))
        {
            // Dropped first: the stale copy's memory serves the new one.
            self.img_fp8 = None;
            self.img_fp8 = ImageFp8::of(&self.attn, &self.img_mlp);
        }
        self.img_fp8.is_some()
    }

    /// Returns `(text, image)` hidden states, like the reference.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        (img_mod, txt_mod): (&Tensor, &Tensor),
        rope: &RopeTables,
        mask: Option<&Tensor>,
        imp: AttentionImpl,
        kernels: BlockKernels,
    ) -> (Tensor, Tensor) {
        let img_mod = img_mod.chunk(2, -1);
        let txt_mod = txt_mod.chunk(2, -1);
        let [img_shift1, img_scale1, img_gate1] = mod_terms(&img_mod[0]);
        let [img_shift2, img_scale2, img_gate2] = mod_terms(&img_mod[1]);
        let [txt_shift1, txt_scale1, txt_gate1] = mod_terms(&txt_mod[0]);
        let [txt_shift2, txt_scale2, txt_gate2] = mod_terms(&txt_mod[1]);
        let eps = self.eps;
        let norm = |x: &Tensor, shift: &Tensor, scale: &Tensor| {
            residual_norm(x, None, Some((shift, scale)), eps, kernels)
                .1
                .expect("a modulation was passed")
        };

        // The image stream's fp8 GEMMs where made, current, and the token count is one they take.
        let size = img.size();
        let fp8 = self.img_fp8.as_ref().filter(|f| {
            kernels.fp8_gemm
                && img.device().is_cuda()
                && Fp8Linear::takes_rows(size[0] * size[1])
                && f.current(&self.attn, &self.img_mlp)
        });
        let txt_in = norm(txt, &txt_shift1, &txt_scale1);
        let (img_attn, txt_attn) = match fp8 {
            Some(f) => {
                let x = residual_norm_fp8(img, None, (&img_shift1, &img_scale1), eps, kernels).1;
                let qkv = f.qkv.forward(&x);
                let inner = qkv.size()[2] / 3;
                let part = |i: i64| qkv.narrow(-1, i * inner, inner);
                let projected = ImageIn::Projected([part(0), part(1), part(2)]);
                self.attn
                    .forward(projected, &txt_in, rope, mask, imp, kernels)
            }
            None => {
                let img_in = norm(img, &img_shift1, &img_scale1);
                self.attn
                    .forward(ImageIn::Hidden(&img_in), &txt_in, rope, mask, imp, kernels)
            }
        };
        // The gated residual of the attention and LayerNorm 2 with its modulation (one pass where
        // both are fused), then the feed-forward.
        let img_residual = Some((&img_attn, &img_gate1));
        let img_modulation = (&img_shift2, &img_scale2);
        let (img, img_ff) = match fp8 {
            Some(f) => {
                let (img, x) = residual_norm_fp8(img, img_residual, img_modulation, eps, kernels);
                let hidden = f.ff_up.forward(&x);
                (img, f.ff_down.forward(&gelu_fp8(&hidden)))
            }
            None => {
                let (img, img_in) =
                    residual_norm(img, img_residual, Some(img_modulation), eps, kernels);
                let img_in = img_in.expect("a modulation was passed");
                let img_ff = self.img_mlp.forward(&img_in, kernels.ff_gelu);
                (img, img_ff)
            }
        };
        let (txt, txt_in) = residual_norm(
            txt,
            Some((&txt_attn, &txt_gate1)),
            Some((&txt_shift2, &txt_scale2)),
            eps,
            kernels,
        );
        let txt_in = txt_in.expect("a modulation was passed");
        let (img, _) = residual_norm(&img, Some((&img_ff, &img_gate2)), None, eps, kernels);
        let txt_ff = self.txt_mlp.forward(&txt_in, kernels.ff_gelu);
        let (txt, _) = residual_norm(&txt, Some((&txt_ff, &txt_gate2)), None, eps, kernels);

        // The reference clips fp16 activations to the fp16 range after every block.
        if img.kind() == Kind::Half {
            (txt.clamp(-65504.0, 65504.0), img.clamp(-65504.0, 65504.0))
        } else {
            (txt, img)
        }
    }
}

/// `AdaLayerNormContinuous(elementwise_affine=False)`: `LN(x) * (1 + scale) + shift` with
/// `(scale, shift) = linear(silu(temb)).chunk(2)` (scale first, unlike the blocks).
#[derive(Debug)]
struct AdaLayerNormContinuous {
    linear: Linear,
    dim: i64,
    eps: f64,
}

impl AdaLayerNormContinuous {
    /// `emb` = `linear(silu(temb))` `[B, 2·dim]`.
    fn forward(&self, x: &Tensor, emb: &Tensor) -> Tensor {
        let emb = emb.chunk(2, 1);
        let (scale, shift) = (emb[0].unsqueeze(1), emb[1].unsqueeze(1));
        layer_norm_without_affine(x, self.dim, self.eps) * (scale + 1.0) + shift
    }
}

/// `QwenImageTransformer2DModel` (dual-stream MMDiT with 3-D RoPE).
#[derive(Debug)]
pub struct QwenImageTransformer2DModel {
    img_in: Linear,
    txt_norm: RmsNorm,
    txt_in: Linear,
    time_text_embed: QwenTimestepProjEmbeddings,
    pos_embed: QwenEmbedRope,
    transformer_blocks: Vec<QwenImageTransformerBlock>,
    norm_out: AdaLayerNormContinuous,
    proj_out: Linear,
    config: QwenImageTransformerConfig,
    imp: AttentionImpl,
    kernels: BlockKernels,
    /// The last schedule's modulations ([`Self::step_modulations`]); dropped by `linears_mut`.
    modulations: Mutex<Option<StepModulations>>,
}

/// The adaLN modulations of every timestep of a schedule: per block `img_mod` and `txt_mod`
/// outputs `[S, 6·dim]`, and `norm_out.linear`'s `[S, 2·dim]`, row `i` for timestep `i`.
#[derive(Debug)]
pub struct StepModulations {
    /// The timesteps' bits (as the scheduler gives them, in [0, 1000]) and the activations' dtype.
    key: (Vec<u64>, Kind),
    blocks: Vec<(Tensor, Tensor)>,
    norm_out: Tensor,
}

impl StepModulations {
    /// How many timesteps it holds.
    pub fn steps(&self) -> usize {
        self.key.0.len()
    }

    /// `norm_out.linear`'s rows, `[S, 2·dim]`.
    pub fn norm_out(&self) -> &Tensor {
        &self.norm_out
    }

    /// The same tensors (new handles: a tensor is not `Sync`, so the cache hands out these).
    fn shallow_clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            blocks: self
                .blocks
                .iter()
                .map(|(i, t)| (i.shallow_clone(), t.shallow_clone()))
                .collect(),
            norm_out: self.norm_out.shallow_clone(),
        }
    }
}

/// Where a forward pass takes its modulations from: the timestep tensor (`[B]`, computed here) or
/// a schedule's precomputed rows.
enum Modulation<'a> {
    Timestep(&'a Tensor),
    Step(&'a StepModulations, usize),
}

impl QwenImageTransformer2DModel {
    /// Builds the model from diffusers-named weights (see [`transformer_store`]). A config that
    /// fails [`QwenImageTransformerConfig::validate`] is a [`LoadError::Config`].
    pub fn new(
        w: &Weights,
        c: &QwenImageTransformerConfig,
        imp: AttentionImpl,
    ) -> Result<Self, LoadError> {
        Self::new_with(w, c, imp, |_, _| Ok(()))
    }

    /// [`Self::new`], with `loaded(i, block)` run on each block as soon as it is loaded, on the
    /// loading thread (the pipeline fuses its load-time LoRAs there, [`Self::block_linears_mut`]).
    pub fn new_with(
        w: &Weights,
        c: &QwenImageTransformerConfig,
        imp: AttentionImpl,
        loaded: impl Fn(i64, &mut QwenImageTransformerBlock) -> Result<(), LoadError> + Sync,
    ) -> Result<Self, LoadError> {
        c.validate().map_err(|reason| LoadError::Config {
            path: "<QwenImageTransformerConfig>".into(),
            reason,
        })?;
        let dim = c.inner_dim();
        let transformer_blocks = load_layers(c.num_layers, |i| {
            let mut block = QwenImageTransformerBlock::new(&w.pp("transformer_blocks").pp(i), c)?;
            loaded(i, &mut block)?;
            Ok(block)
        })?;
        Ok(Self {
            img_in: Linear::new(&w.pp("img_in"), c.in_channels, dim, true)?,
            txt_norm: RmsNorm::new(&w.pp("txt_norm"), c.joint_attention_dim, c.norm_eps)?,
            txt_in: Linear::new(&w.pp("txt_in"), c.joint_attention_dim, dim, true)?,
            time_text_embed: QwenTimestepProjEmbeddings::new(&w.pp("time_text_embed"), c)?,
            pos_embed: QwenEmbedRope::new(c.rope_theta, c.axes_dims_rope, w.device),
            transformer_blocks,
            norm_out: AdaLayerNormContinuous {
                linear: Linear::new(&w.pp("norm_out").pp("linear"), dim, 2 * dim, true)?,
                dim,
                eps: c.norm_eps,
            },
            proj_out: Linear::new(&w.pp("proj_out"), dim, c.out_token_dim(), true)?,
            config: c.clone(),
            imp,
            kernels: BlockKernels::default(),
            modulations: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &QwenImageTransformerConfig {
        &self.config
    }

    /// The attention kernel used from now on.
    pub fn set_attention_impl(&mut self, imp: AttentionImpl) {
        self.imp = imp;
    }

    /// The blocks' elementwise kernels from now on (libtorch's operators until set). Fused ones
    /// are compiled for the model's device here, so that a GPU or driver the run-time compiler
    /// cannot serve is an error now, not a failed job; on the CPU the fused pieces fall back to
    /// libtorch's operators.
    pub fn set_block_kernels(&mut self, kernels: BlockKernels) -> Result<(), String> {
        if kernels.needs_shims() && !crate::nn::ops::BUILT_IN {
            return Err(crate::nn::ops::NOT_BUILT_IN.into());
        }
        if kernels.any_fused() {
            crate::qwen_image::kernels::prepare(self.pos_embed.device())?;
        }
        let _guard = tch::no_grad_guard();
        let fp8 = kernels.fp8_gemm;
        if fp8 {
            Fp8Linear::probe(self.pos_embed.device())?;
        }
        for block in &mut self.transformer_blocks {
            block.attn.fuse_qkv(kernels.fused_qkv);
            if !block.prepare_fp8(fp8) && fp8 {
                return Err(
                    "fp8_gemm: the image stream's projections are not fp8-shaped (widths \
                     multiples of 16, each with a bias)"
                        .into(),
                );
            }
        }
        self.kernels = kernels;
        Ok(())
    }

    /// The blocks' elementwise kernels in use.
    pub fn block_kernels(&self) -> BlockKernels {
        self.kernels
    }

    /// Every Linear under its diffusers module name (`img_in`,
    /// `transformer_blocks.0.attn.to_q`, `transformer_blocks.0.img_mod.1`, …), for LoRA fusing.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        // The weights may change through what this hands out: cached modulations would be stale.
        *self
            .modulations
            .get_mut()
            .unwrap_or_else(|p| p.into_inner()) = None;
        let mut out: Vec<(String, &mut Linear)> = vec![
            ("img_in".into(), &mut self.img_in),
            ("txt_in".into(), &mut self.txt_in),
            (
                "time_text_embed.timestep_embedder.linear_1".into(),
                &mut self.time_text_embed.linear_1,
            ),
            (
                "time_text_embed.timestep_embedder.linear_2".into(),
                &mut self.time_text_embed.linear_2,
            ),
        ];
        for (i, b) in self.transformer_blocks.iter_mut().enumerate() {
            out.extend(Self::block_linears_mut(i as i64, b));
        }
        out.push(("norm_out.linear".into(), &mut self.norm_out.linear));
        out.push(("proj_out".into(), &mut self.proj_out));
        out
    }

    /// The Linear layers outside the blocks, by diffusers module name (with
    /// [`Self::block_linears_mut`] of every block: [`Self::linears_mut`]).
    pub fn outer_linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = self.linears_mut();
        out.retain(|(name, _)| !name.starts_with("transformer_blocks."));
        out
    }

    /// Block `i`'s Linear layers by diffusers module name (`transformer_blocks.{i}.…`).
    pub fn block_linears_mut(
        i: i64,
        b: &mut QwenImageTransformerBlock,
    ) -> Vec<(String, &mut Linear)> {
        let p = format!("transformer_blocks.{i}");
        let a = &mut b.attn;
        Vec::from([
            (format!("{p}.img_mod.1"), &mut b.img_mod),
            (format!("{p}.txt_mod.1"), &mut b.txt_mod),
            (format!("{p}.attn.to_q"), &mut a.to_q),
            (format!("{p}.attn.to_k"), &mut a.to_k),
            (format!("{p}.attn.to_v"), &mut a.to_v),
            (format!("{p}.attn.add_q_proj"), &mut a.add_q_proj),
            (format!("{p}.attn.add_k_proj"), &mut a.add_k_proj),
            (format!("{p}.attn.add_v_proj"), &mut a.add_v_proj),
            (format!("{p}.attn.to_out.0"), &mut a.to_out),
            (format!("{p}.attn.to_add_out"), &mut a.to_add_out),
            (format!("{p}.img_mlp.net.0.proj"), &mut b.img_mlp.proj_in),
            (format!("{p}.img_mlp.net.2"), &mut b.img_mlp.proj_out),
            (format!("{p}.txt_mlp.net.0.proj"), &mut b.txt_mlp.proj_in),
            (format!("{p}.txt_mlp.net.2"), &mut b.txt_mlp.proj_out),
        ])
    }

    /// The RoPE tables (fp32 cos/sin, `[tokens, head_dim/2]`) a forward pass with these image
    /// shapes and text length uses.
    pub fn rope_tables(&self, img_shapes: &[ImageShape], txt_len: i64) -> RopeTables {
        self.pos_embed.tables(img_shapes, txt_len)
    }

    /// One denoising evaluation.
    ///
    /// - `hidden_states` `[B, N, in_channels]`: the packed latent tokens of every image of
    ///   `img_shapes` in order (target first), `N = Σ f·h·w`;
    /// - `encoder_hidden_states` `[B, L, joint_attention_dim]`;
    /// - `encoder_mask` `[B, L]`, 1 for valid and 0 for padded text tokens, or `None` when every
    ///   token is valid (no mask is built then);
    /// - `timestep` `[B]`: σ in [0, 1];
    /// - `img_shapes`: `(frames, h, w)` in patches per image, shared by the batch.
    ///
    /// Returns `[B, N, patch² · out_channels]` (the caller keeps the target's tokens).
    pub fn forward(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_mask: Option<&Tensor>,
        timestep: &Tensor,
        img_shapes: &[ImageShape],
    ) -> Result<Tensor, GenerateError> {
        self.forward_modulated(
            hidden_states,
            encoder_hidden_states,
            encoder_mask,
            Modulation::Timestep(timestep),
            img_shapes,
        )
    }

    /// [`Self::forward`] at timestep `step` of a schedule whose modulations are `modulations`
    /// ([`Self::step_modulations`]), for every sample of the batch.
    pub fn forward_step(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_mask: Option<&Tensor>,
        modulations: &StepModulations,
        step: usize,
        img_shapes: &[ImageShape],
    ) -> Result<Tensor, GenerateError> {
        if step >= modulations.steps() {
            return Err(GenerateError::InvalidRequest(format!(
                "step {step} of a schedule of {} steps",
                modulations.steps()
            )));
        }
        if modulations.key.1 != hidden_states.kind() {
            return Err(GenerateError::InvalidRequest(format!(
                "modulations made for {:?}, activations are {:?}",
                modulations.key.1,
                hidden_states.kind()
            )));
        }
        self.forward_modulated(
            hidden_states,
            encoder_hidden_states,
            encoder_mask,
            Modulation::Step(modulations, step),
            img_shapes,
        )
    }

    /// The modulations of every timestep of `timesteps` (the scheduler's, in [0, 1000]: each is
    /// fed as the pipeline feeds it, `full(t, kind) / 1000`) for activations of `kind`: the last
    /// schedule's when it is the same (no device work), else computed now (one GEMM per modulation
    /// layer with a row per timestep) and kept in its place.
    pub fn step_modulations(&self, timesteps: &[f64], kind: Kind) -> StepModulations {
        let key = (
            timesteps.iter().map(|t| t.to_bits()).collect::<Vec<_>>(),
            kind,
        );
        let mut cached = self.modulations.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = cached.as_ref().filter(|m| m.key == key) {
            return m.shallow_clone();
        }
        let _guard = tch::no_grad_guard();
        let device = self.pos_embed.device();
        let steps: Vec<Tensor> = timesteps
            .iter()
            .map(|&t| Tensor::full([1], t, (kind, device)))
            .collect();
        let timestep = Tensor::cat(&steps, 0) / 1000.0;
        let temb_silu = self.time_text_embed.forward(&timestep, kind).silu();
        let made = StepModulations {
            key,
            blocks: self
                .transformer_blocks
                .iter()
                .map(|b| (b.img_mod.forward(&temb_silu), b.txt_mod.forward(&temb_silu)))
                .collect(),
            norm_out: self.norm_out.linear.forward(&temb_silu),
        };
        *cached = Some(made.shallow_clone());
        made
    }

    fn forward_modulated(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_mask: Option<&Tensor>,
        modulation: Modulation<'_>,
        img_shapes: &[ImageShape],
    ) -> Result<Tensor, GenerateError> {
        let c = &self.config;
        let (b, n, l) = self.check_inputs(
            hidden_states,
            encoder_hidden_states,
            encoder_mask,
            match modulation {
                Modulation::Timestep(t) => Some(t),
                Modulation::Step(..) => None,
            },
            img_shapes,
        )?;
        let kind = hidden_states.kind();
        let img = self.img_in.forward(hidden_states);
        let txt = self
            .txt_in
            .forward(&self.txt_norm.forward(encoder_hidden_states));
        // Every consumer of temb (img_mod, txt_mod, norm_out) applies SiLU first.
        let temb_silu = match modulation {
            Modulation::Timestep(t) => {
                Some(self.time_text_embed.forward(&t.to_kind(kind), kind).silu())
            }
            Modulation::Step(..) => None,
        };
        // A schedule's row `step`, the same for every sample (a view for one sample, a copy per
        // sample for more: `[B, ·]` with dense rows, what the kernels take).
        let row = |m: &Tensor, step: usize| {
            let r = m.narrow(0, step as i64, 1);
            if b == 1 { r } else { r.repeat([b, 1]) }
        };
        let block_mods =
            |i: usize, block: &QwenImageTransformerBlock| match (&modulation, &temb_silu) {
                (Modulation::Step(m, step), _) => {
                    (row(&m.blocks[i].0, *step), row(&m.blocks[i].1, *step))
                }
                (Modulation::Timestep(_), Some(t)) => {
                    (block.img_mod.forward(t), block.txt_mod.forward(t))
                }
                (Modulation::Timestep(_), None) => unreachable!("temb is computed for a timestep"),
            };
        let rope = self.pos_embed.tables(img_shapes, l);

        // Joint mask over keys `[text, image]`: padded text keys get -inf (what SDPA makes of the
        // reference's boolean mask), image keys are always valid.
        let mask = encoder_mask.map(|m| {
            let valid = Tensor::cat(
                &[m.ne(0.0), Tensor::ones([b, n], (Kind::Bool, m.device()))],
                1,
            );
            Tensor::zeros([b, l + n], (kind, m.device()))
                .masked_fill(&valid.logical_not(), f64::NEG_INFINITY)
                .view([b, 1, 1, l + n])
        });

        let (mut txt, mut img) = (txt, img);
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            let (img_mod, txt_mod) = block_mods(i, block);
            (txt, img) = block.forward(
                &img,
                &txt,
                (&img_mod, &txt_mod),
                &rope,
                mask.as_ref(),
                self.imp,
                self.kernels,
            );
        }
        let out_mod = match (&modulation, &temb_silu) {
            (Modulation::Step(m, step), _) => row(&m.norm_out, *step),
            (_, Some(t)) => self.norm_out.linear.forward(t),
            (Modulation::Timestep(_), None) => unreachable!("temb is computed for a timestep"),
        };
        let img = self.norm_out.forward(&img, &out_mod);
        let out = self.proj_out.forward(&img);
        debug_assert_eq!(out.size(), [b, n, c.out_token_dim()]);
        Ok(out)
    }

    /// Shapes and sizes of the inputs; returns `(B, N, L)`.
    fn check_inputs(
        &self,
        hidden_states: &Tensor,
        encoder_hidden_states: &Tensor,
        encoder_mask: Option<&Tensor>,
        timestep: Option<&Tensor>,
        img_shapes: &[ImageShape],
    ) -> Result<(i64, i64, i64), GenerateError> {
        let c = &self.config;
        let bad = |s: String| Err(GenerateError::InvalidRequest(s));
        let hs = hidden_states.size();
        let es = encoder_hidden_states.size();
        let [b, n, ch] = hs[..] else {
            return bad(format!(
                "transformer hidden_states must be [B, N, C], is {hs:?}"
            ));
        };
        if ch != c.in_channels {
            return bad(format!(
                "transformer hidden_states has {ch} channels, the model takes {}",
                c.in_channels
            ));
        }
        let [eb, l, ed] = es[..] else {
            return bad(format!(
                "transformer encoder_hidden_states must be [B, L, D], is {es:?}"
            ));
        };
        if eb != b || ed != c.joint_attention_dim || l == 0 {
            return bad(format!(
                "transformer encoder_hidden_states is {es:?}, expected [{b}, L ≥ 1, {}]",
                c.joint_attention_dim
            ));
        }
        if let Some(timestep) = timestep
            && timestep.size() != [b]
        {
            return bad(format!(
                "transformer timestep must be [{b}], is {:?}",
                timestep.size()
            ));
        }
        if let Some(m) = encoder_mask
            && m.size() != [b, l]
        {
            return bad(format!(
                "transformer encoder mask must be [{b}, {l}], is {:?}",
                m.size()
            ));
        }
        if img_shapes.is_empty() || img_shapes.iter().any(|&(f, h, w)| f < 1 || h < 1 || w < 1) {
            return bad(format!(
                "transformer img_shapes must be non-empty and positive, is {img_shapes:?}"
            ));
        }
        let tokens: i64 = img_shapes.iter().map(|&(f, h, w)| f * h * w).sum();
        if tokens != n {
            return bad(format!(
                "transformer img_shapes {img_shapes:?} hold {tokens} tokens, hidden_states has {n}"
            ));
        }
        Ok((b, n, l))
    }
}
