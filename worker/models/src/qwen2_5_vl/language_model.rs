//! The Qwen2.5-VL language model (`Qwen2_5_VLTextModel`, a Qwen2 decoder): token embeddings, decoder
//! layers (RMSNorm → grouped-query self-attention with M-RoPE → residual, RMSNorm → SwiGLU MLP →
//! residual) and the final RMSNorm. Qwen-Image uses its last hidden state (after the final norm,
//! what `output_hidden_states[-1]` is) as the prompt embedding; `lm_head` is never loaded.
//!
//! Ported from transformers 5.24.0 `models/qwen2_5_vl/modeling_qwen2_5_vl.py`
//! (`Qwen2_5_VLRotaryEmbedding`, `Qwen2_5_VLAttention`, `Qwen2MLP`, `Qwen2_5_VLDecoderLayer`,
//! `Qwen2_5_VLTextModel`), Apache-2.0, Copyright The Qwen team, Alibaba Group and the HuggingFace
//! Inc. team.
//!
//! Field names equal the checkpoint keys below the language-model root (`embed_tokens`,
//! `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
//! mlp.{gate,up,down}_proj}`, `norm`); the root is `model.language_model` (transformers ≥ 5) or
//! `model` (older transformers, ComfyUI's single file), see [`language_model_prefix`].
//!
//! Numerics as the reference: the rotary angles are computed in fp32 and cast to the activations'
//! dtype before rotating; RMSNorm statistics are fp32; attention is causal plus a key-padding mask
//! (an additive mask through [`crate::nn::attention`]).

use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError};
use crate::loading::weights::{WeightStore, Weights, load_layers};
use crate::nn::rope::apply_rotate_half;
use crate::nn::{AttentionImpl, Linear, RmsNorm, attention};
use crate::qwen2_5_vl::config::TextConfig;

/// The language-model roots a checkpoint may use, most specific first: transformers ≥ 5 saves
/// `model.language_model.*`; older transformers and ComfyUI's `qwen_2.5_vl_7b_fp8_scaled.safetensors`
/// use `model.*`.
pub const LANGUAGE_MODEL_PREFIXES: [&str; 2] = ["model.language_model", "model"];

/// The language-model root of a text-encoder checkpoint (one of [`LANGUAGE_MODEL_PREFIXES`]),
/// found by its token embedding.
pub fn language_model_prefix(store: &WeightStore) -> Option<&'static str> {
    LANGUAGE_MODEL_PREFIXES
        .into_iter()
        .find(|p| store.contains(&format!("{p}.embed_tokens.weight")))
}

/// The most negative finite value of `kind`, the additive mask of a masked-out key (as
/// transformers' `torch.finfo(dtype).min`); adding it to a finite score stays finite.
fn mask_min(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        Kind::BFloat16 => -3.389_531_389_251_535e38,
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// `Qwen2_5_VLRotaryEmbedding` (default rope type): per-axis angles `pos · θ_i`, `θ_i =
/// theta^(-2i/head_dim)`, then frequency `i` takes the temporal, height or width angle by
/// `mrope_section` (sections in turn, axis `section index % 3`), duplicated for the two halves.
#[derive(Debug)]
struct RotaryEmbedding {
    /// `[head_dim / 2]` fp32.
    inv_freq: Tensor,
    mrope_section: Vec<i64>,
}

impl RotaryEmbedding {
    fn new(config: &TextConfig, device: Device) -> Self {
        let dim = config.head_dim();
        let exponent = Tensor::arange_start_step(0, dim, 2, (Kind::Float, device)) / dim as f64;
        Self {
            inv_freq: Tensor::pow_scalar(config.rope_theta, &exponent).reciprocal(),
            mrope_section: config.mrope_section.clone(),
        }
    }

    /// `(cos, sin)` `[B, L, head_dim]` in `kind` for position ids `[3, B, L]` (int64).
    fn forward(&self, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = position_ids
            .to_device(self.inv_freq.device())
            .to_kind(Kind::Float)
            .unsqueeze(-1)
            * &self.inv_freq;
        let recompose = |f: Tensor| {
            let parts: Vec<Tensor> = f
                .split_with_sizes(&self.mrope_section, -1)
                .iter()
                .enumerate()
                .map(|(i, m)| m.select(0, (i % 3) as i64))
                .collect();
            let f = Tensor::cat(&parts, -1);
            Tensor::cat(&[&f, &f], -1).to_kind(kind)
        };
        (recompose(freqs.cos()), recompose(freqs.sin()))
    }
}

#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(w: &Weights, c: &TextConfig) -> Result<Self, LoadError> {
        let (d, hd) = (c.hidden_size, c.head_dim());
        Ok(Self {
            q_proj: Linear::new(&w.pp("q_proj"), d, c.num_attention_heads * hd, true)?,
            k_proj: Linear::new(&w.pp("k_proj"), d, c.num_key_value_heads * hd, true)?,
            v_proj: Linear::new(&w.pp("v_proj"), d, c.num_key_value_heads * hd, true)?,
            o_proj: Linear::new(&w.pp("o_proj"), c.num_attention_heads * hd, d, false)?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
        })
    }

    /// `x` `[B, L, D]`; `cos`/`sin` `[B, 1, L, head_dim]`; `mask` additive `[B, 1, L, L]`.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        imp: AttentionImpl,
    ) -> Tensor {
        let (b, l, _) = x.size3().expect("language model activations are [B, L, D]");
        let heads = |t: Tensor, n: i64| t.view([b, l, n, self.head_dim]).transpose(1, 2);
        let q = heads(self.q_proj.forward(x), self.heads);
        let k = heads(self.k_proj.forward(x), self.kv_heads);
        let v = heads(self.v_proj.forward(x), self.kv_heads);
        let q = apply_rotate_half(&q, cos, sin);
        let k = apply_rotate_half(&k, cos, sin);
        // `repeat_kv`: query head i uses key/value head i / (heads / kv_heads).
        let rep = self.heads / self.kv_heads;
        let repeat = |t: Tensor| {
            if rep == 1 {
                t
            } else {
                t.unsqueeze(2)
                    .expand([b, self.kv_heads, rep, l, self.head_dim], false)
                    .reshape([b, self.heads, l, self.head_dim])
            }
        };
        let (k, v) = (repeat(k), repeat(v));
        let scale = (self.head_dim as f64).powf(-0.5);
        let o = attention(&q, &k, &v, Some(mask), scale, imp);
        self.o_proj.forward(
            &o.transpose(1, 2)
                .reshape([b, l, self.heads * self.head_dim]),
        )
    }
}

/// `Qwen2MLP`: `down(silu(gate(x)) * up(x))`, no biases.
#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(w: &Weights, c: &TextConfig) -> Result<Self, LoadError> {
        let (d, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_proj: Linear::new(&w.pp("gate_proj"), d, i, false)?,
            up_proj: Linear::new(&w.pp("up_proj"), d, i, false)?,
            down_proj: Linear::new(&w.pp("down_proj"), i, d, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj
            .forward(&(self.gate_proj.forward(x).silu() * self.up_proj.forward(x)))
    }
}

#[derive(Debug)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn new(w: &Weights, c: &TextConfig) -> Result<Self, LoadError> {
        Ok(Self {
            input_layernorm: RmsNorm::new(&w.pp("input_layernorm"), c.hidden_size, c.rms_norm_eps)?,
            self_attn: Attention::new(&w.pp("self_attn"), c)?,
            post_attention_layernorm: RmsNorm::new(
                &w.pp("post_attention_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
            )?,
            mlp: Mlp::new(&w.pp("mlp"), c)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        imp: AttentionImpl,
    ) -> Tensor {
        let h = x + self
            .self_attn
            .forward(&self.input_layernorm.forward(x), cos, sin, mask, imp);
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

/// The Qwen2.5-VL language model (`Qwen2_5_VLTextModel`) without `lm_head`.
#[derive(Debug)]
pub struct LanguageModel {
    /// `embed_tokens.weight` `[vocab, hidden]`.
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary: RotaryEmbedding,
    config: TextConfig,
    kind: Kind,
    attention: AttentionImpl,
}

impl LanguageModel {
    /// Builds the model from `w` positioned at the language-model root (see
    /// [`language_model_prefix`]).
    pub fn new(
        w: &Weights,
        config: &TextConfig,
        attention: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let c = config;
        let layers = load_layers(c.num_hidden_layers, |i| {
            DecoderLayer::new(&w.pp("layers").pp(i), c)
        })?;
        Ok(Self {
            embed_tokens: w.get("embed_tokens.weight", &[c.vocab_size, c.hidden_size])?,
            layers,
            norm: RmsNorm::new(&w.pp("norm"), c.hidden_size, c.rms_norm_eps)?,
            rotary: RotaryEmbedding::new(c, w.device),
            config: c.clone(),
            kind: w.kind,
            attention,
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    pub fn device(&self) -> Device {
        self.embed_tokens.device()
    }

    /// The weights' dtype (the activations' dtype).
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Token embeddings `[.., hidden]` of `input_ids` (any shape, int64); an id outside the
    /// vocabulary is an error.
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor, GenerateError> {
        if input_ids.numel() > 0 {
            let (lo, hi) = (
                input_ids.min().int64_value(&[]),
                input_ids.max().int64_value(&[]),
            );
            if lo < 0 || hi >= self.config.vocab_size {
                return Err(GenerateError::InvalidRequest(format!(
                    "token ids must be in 0..{}, got {lo}..={hi}",
                    self.config.vocab_size
                )));
            }
        }
        Ok(Tensor::embedding(
            &self.embed_tokens,
            &input_ids.to_device(self.device()),
            -1,
            false,
            false,
        ))
    }

    /// The last hidden state (after the final norm) `[B, L, hidden]` of `inputs_embeds`
    /// `[B, L, hidden]` with M-RoPE `position_ids` `[3, B, L]` (int64) and an optional key-padding
    /// `attention_mask` `[B, L]` (1 = token, 0 = padding; absent = all tokens). Attention is causal.
    pub fn forward(
        &self,
        inputs_embeds: &Tensor,
        position_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, GenerateError> {
        let size = inputs_embeds.size();
        let (b, l) = match size.as_slice() {
            &[b, l, d] if d == self.config.hidden_size => (b, l),
            _ => {
                return Err(GenerateError::InvalidRequest(format!(
                    "language model inputs_embeds have shape {size:?}, expected [B, L, {}]",
                    self.config.hidden_size
                )));
            }
        };
        if position_ids.size() != [3, b, l] {
            return Err(GenerateError::InvalidRequest(format!(
                "language model position_ids have shape {:?}, expected [3, {b}, {l}]",
                position_ids.size()
            )));
        }
        if let Some(m) = attention_mask
            && m.size() != [b, l]
        {
            return Err(GenerateError::InvalidRequest(format!(
                "language model attention_mask has shape {:?}, expected [{b}, {l}]",
                m.size()
            )));
        }
        let device = self.device();
        let x = inputs_embeds.to_device(device).to_kind(self.kind);
        let (cos, sin) = self.rotary.forward(position_ids, self.kind);
        let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let mask = self.additive_mask(b, l, attention_mask);
        let mut h = x;
        for layer in &self.layers {
            h = layer.forward(&h, &cos, &sin, &mask, self.attention);
        }
        Ok(self.norm.forward(&h))
    }

    /// The additive mask `[B, 1, L, L]`: key `j` is visible to query `i` when `j ≤ i` and key `j`
    /// is a token. A query that sees no key (a padding row under left padding) sees all its
    /// causal keys instead, so that its output stays finite; such rows are padding and dropped.
    fn additive_mask(&self, b: i64, l: i64, attention_mask: Option<&Tensor>) -> Tensor {
        let device = self.device();
        let causal = Tensor::ones([l, l], (Kind::Bool, device)).tril(0);
        let allowed = match attention_mask {
            None => causal.unsqueeze(0).expand([b, l, l], false),
            Some(m) => {
                let keys = m.to_device(device).ne(0).unsqueeze(1);
                let both = causal.unsqueeze(0).logical_and(&keys);
                let empty = both.any_dim(-1, true).logical_not();
                both.logical_or(&empty.logical_and(&causal.unsqueeze(0)))
            }
        };
        Tensor::zeros([b, 1, l, l], (self.kind, device))
            .masked_fill(&allowed.logical_not().unsqueeze(1), mask_min(self.kind))
    }
}
