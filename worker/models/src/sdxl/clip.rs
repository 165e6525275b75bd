//! CLIP text transformers: OpenAI CLIP ViT-L/14 (`CLIPTextModel`, SDXL `text_encoder`) and OpenCLIP
//! ViT-bigG/14 (`CLIPTextModelWithProjection`, SDXL `text_encoder_2`).
//!
//! Field names equal the transformers checkpoint keys (`text_model.encoder.layers.N.self_attn.q_proj`,
//! …). Written after `transformers/models/clip/modeling_clip.py` (Apache-2.0) and candle's
//! `stable_diffusion/clip.rs` (MIT/Apache-2.0); the output SDXL needs is the penultimate hidden state
//! (not normalised) plus, for bigG, `text_projection(final_layer_norm(last)[eos])`.

use tch::{Kind, Tensor};

use crate::error::LoadError;
use crate::loading::lora::{LoraModule, LoraTarget};
use crate::loading::weights::{Weights, load_layers};
use crate::nn::{AttentionImpl, LayerNorm, Linear, attention};

/// The canonical name of a transformers CLIP text-model key: transformers ≥ 5 saves
/// `CLIPTextModel` without the `text_model.` prefix (`embeddings.*`, `encoder.*`,
/// `final_layer_norm.*`) while older files and single-file checkpoints carry it; both load.
/// `position_ids` buffers are dropped (positions are always `0..L`).
pub fn canonical_key(key: &str) -> Option<String> {
    if key.ends_with("position_ids") {
        None
    } else if key.starts_with("text_model.") || key.starts_with("text_projection") {
        Some(key.to_string())
    } else {
        Some(format!("text_model.{key}"))
    }
}

/// MLP activation of the text transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x * sigmoid(1.702 x)` (OpenAI CLIP).
    QuickGelu,
    /// exact erf GELU (OpenCLIP bigG).
    Gelu,
}

/// `CLIPTextConfig` fields the model needs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct ClipTextConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub max_position_embeddings: i64,
    pub hidden_act: Activation,
    pub layer_norm_eps: f64,
    /// `Some(dim)` for `CLIPTextModelWithProjection` (a bias-free `text_projection`).
    pub projection_dim: Option<i64>,
}

impl ClipTextConfig {
    /// SDXL base `text_encoder/config.json` (openai/clip-vit-large-patch14 text tower).
    pub fn sdxl_clip_l() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: Activation::QuickGelu,
            layer_norm_eps: 1e-5,
            projection_dim: None,
        }
    }

    /// SDXL base `text_encoder_2/config.json` (laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower).
    pub fn sdxl_clip_g() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 1280,
            intermediate_size: 5120,
            num_hidden_layers: 32,
            num_attention_heads: 20,
            max_position_embeddings: 77,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            projection_dim: Some(1280),
        }
    }

    /// The tiny test encoder of diffusers'
    /// `tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py::get_dummy_components`,
    /// `with_projection` for `text_encoder_2`.
    pub fn tiny(with_projection: bool) -> Self {
        Self {
            vocab_size: 1000,
            hidden_size: 32,
            intermediate_size: 37,
            num_hidden_layers: 5,
            num_attention_heads: 4,
            max_position_embeddings: 77,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-5,
            projection_dim: with_projection.then_some(32),
        }
    }

    /// Parses a transformers `config.json` (`architectures` decides whether a projection exists).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let int = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_i64)
                .ok_or_else(|| format!("missing integer `{k}`"))
        };
        let with_projection = v
            .get("architectures")
            .and_then(|a| a.as_array())
            .is_some_and(|a| {
                a.iter()
                    .any(|s| s.as_str() == Some("CLIPTextModelWithProjection"))
            });
        let act = match v.get("hidden_act").and_then(|a| a.as_str()) {
            Some("quick_gelu") => Activation::QuickGelu,
            Some("gelu") => Activation::Gelu,
            other => return Err(format!("unsupported hidden_act {other:?}")),
        };
        Ok(Self {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: int("num_attention_heads")?,
            max_position_embeddings: int("max_position_embeddings")?,
            hidden_act: act,
            layer_norm_eps: v
                .get("layer_norm_eps")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(1e-5),
            projection_dim: if with_projection {
                Some(int("projection_dim")?)
            } else {
                None
            },
        })
    }
}

#[derive(Debug)]
struct ClipAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    heads: i64,
    head_dim: i64,
}

impl ClipAttention {
    fn new(w: &Weights, c: &ClipTextConfig) -> Result<Self, LoadError> {
        let d = c.hidden_size;
        Ok(Self {
            q_proj: Linear::new(&w.pp("q_proj"), d, d, true)?,
            k_proj: Linear::new(&w.pp("k_proj"), d, d, true)?,
            v_proj: Linear::new(&w.pp("v_proj"), d, d, true)?,
            out_proj: Linear::new(&w.pp("out_proj"), d, d, true)?,
            heads: c.num_attention_heads,
            head_dim: d / c.num_attention_heads,
        })
    }

    fn forward(&self, x: &Tensor, mask: &Tensor, imp: AttentionImpl) -> Tensor {
        let (b, l, d) = x.size3().expect("CLIP hidden states are [B, L, D]");
        let split = |t: Tensor| t.view([b, l, self.heads, self.head_dim]).transpose(1, 2);
        let q = split(self.q_proj.forward(x));
        let k = split(self.k_proj.forward(x));
        let v = split(self.v_proj.forward(x));
        let scale = (self.head_dim as f64).powf(-0.5);
        let o = attention(&q, &k, &v, Some(mask), scale, imp);
        self.out_proj
            .forward(&o.transpose(1, 2).contiguous().view([b, l, d]))
    }
}

#[derive(Debug)]
struct ClipMlp {
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl ClipMlp {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.fc1.forward(x);
        let h = match self.act {
            Activation::QuickGelu => &h * (&h * 1.702).sigmoid(),
            Activation::Gelu => h.gelu("none"),
        };
        self.fc2.forward(&h)
    }
}

#[derive(Debug)]
struct ClipEncoderLayer {
    self_attn: ClipAttention,
    layer_norm1: LayerNorm,
    mlp: ClipMlp,
    layer_norm2: LayerNorm,
}

impl ClipEncoderLayer {
    fn new(w: &Weights, c: &ClipTextConfig) -> Result<Self, LoadError> {
        let d = c.hidden_size;
        Ok(Self {
            self_attn: ClipAttention::new(&w.pp("self_attn"), c)?,
            layer_norm1: LayerNorm::new(&w.pp("layer_norm1"), d, c.layer_norm_eps)?,
            mlp: ClipMlp {
                fc1: Linear::new(&w.pp("mlp.fc1"), d, c.intermediate_size, true)?,
                fc2: Linear::new(&w.pp("mlp.fc2"), c.intermediate_size, d, true)?,
                act: c.hidden_act,
            },
            layer_norm2: LayerNorm::new(&w.pp("layer_norm2"), d, c.layer_norm_eps)?,
        })
    }

    fn forward(&self, x: &Tensor, mask: &Tensor, imp: AttentionImpl) -> Tensor {
        let h = x + self
            .self_attn
            .forward(&self.layer_norm1.forward(x), mask, imp);
        &h + self.mlp.forward(&self.layer_norm2.forward(&h))
    }
}

/// What SDXL needs from one text encoder call.
#[derive(Debug)]
pub struct ClipOutput {
    /// `hidden_states[-2]`: output of the second-to-last layer, no final layer norm. `[B, L, D]`.
    pub penultimate: Tensor,
    /// `last_hidden_state`: final layer output after `final_layer_norm`. `[B, L, D]`.
    pub last_hidden: Tensor,
    /// `pooler_output`: `last_hidden` at the EOS position (argmax of the ids). `[B, D]`.
    pub pooled: Tensor,
    /// `text_embeds = text_projection(pooled)` for encoders with a projection. `[B, P]`.
    pub text_embeds: Option<Tensor>,
}

/// A CLIP text transformer (`CLIPTextModel` or `CLIPTextModelWithProjection`).
#[derive(Debug)]
pub struct ClipTextModel {
    token_embedding: Tensor,
    position_embedding: Tensor,
    layers: Vec<ClipEncoderLayer>,
    final_layer_norm: LayerNorm,
    text_projection: Option<Linear>,
    config: ClipTextConfig,
    attention: AttentionImpl,
}

impl ClipTextModel {
    /// Builds the model from `w` rooted at the checkpoint root (keys `text_model.*`,
    /// `text_projection.weight`).
    pub fn new(
        w: &Weights,
        config: &ClipTextConfig,
        attention: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let tm = w.pp("text_model");
        let emb = tm.pp("embeddings");
        let d = config.hidden_size;
        let layers = load_layers(config.num_hidden_layers, |i| {
            ClipEncoderLayer::new(&tm.pp("encoder.layers").pp(i), config)
        })?;
        let text_projection = match config.projection_dim {
            Some(p) => Some(Linear::new(&w.pp("text_projection"), d, p, false)?),
            None => None,
        };
        Ok(Self {
            token_embedding: emb.get("token_embedding.weight", &[config.vocab_size, d])?,
            position_embedding: emb.get(
                "position_embedding.weight",
                &[config.max_position_embeddings, d],
            )?,
            layers,
            final_layer_norm: LayerNorm::new(&tm.pp("final_layer_norm"), d, config.layer_norm_eps)?,
            text_projection,
            config: config.clone(),
            attention,
        })
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    /// Where the weights live.
    pub fn device(&self) -> tch::Device {
        self.token_embedding.device()
    }

    /// Runs the encoder on `ids` `[B, L]` (int64). `attention_mask` `[B, L]` (1 keep, 0 drop) masks
    /// keys in addition to the causal mask, as transformers does.
    pub fn forward(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> ClipOutput {
        let (b, l) = ids.size2().expect("token ids are [B, L]");
        let device = ids.device();
        let kind = self.token_embedding.kind();
        let pos = Tensor::arange(l, (Kind::Int64, device));
        let mut x = Tensor::embedding(&self.token_embedding, ids, -1, false, false)
            + Tensor::embedding(&self.position_embedding, &pos, -1, false, false);
        // Additive mask: the dtype's most negative finite value where attention is forbidden.
        let neg = match kind {
            Kind::Half => -65504.0,
            Kind::BFloat16 => -3.3895313892515355e38,
            _ => f64::from(f32::MIN),
        };
        let causal = Tensor::ones([l, l], (kind, device)).triu(1) * neg;
        let causal = causal.view([1, 1, l, l]);
        // Not in place: the key mask broadcasts the causal mask up to [B, 1, L, L].
        let mask = match attention_mask {
            Some(m) => causal + (1.0f64 - m.to_kind(kind)).view([b, 1, 1, l]) * neg,
            None => causal,
        };
        let n = self.layers.len();
        // A one-layer model's penultimate hidden state is its embedding output.
        let mut penultimate = (n == 1).then(|| x.shallow_clone());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &mask, self.attention);
            if i + 2 == n {
                penultimate = Some(x.shallow_clone());
            }
        }
        let last_hidden = self.final_layer_norm.forward(&x);
        let eos = ids.argmax(-1, false);
        let d = self.config.hidden_size;
        let pooled = last_hidden
            .gather(1, &eos.view([b, 1, 1]).expand([b, 1, d], false), false)
            .squeeze_dim(1);
        let text_embeds = self.text_projection.as_ref().map(|p| p.forward(&pooled));
        ClipOutput {
            penultimate: penultimate.unwrap_or(x),
            last_hidden,
            pooled,
            text_embeds,
        }
    }
}

/// The encoder layers' attention and MLP Linears (and the projection) by transformers name, for
/// LoRA fusing. transformers 5 writes CLIPTextModel's names without `text_model.` (diffusers'
/// own LoRA files follow it): those are aliases.
impl LoraTarget for ClipTextModel {
    fn lora_modules(&mut self) -> Vec<(String, LoraModule<'_>)> {
        let mut out: Vec<(String, LoraModule<'_>)> = Vec::new();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("text_model.encoder.layers.{i}");
            let a = &mut l.self_attn;
            out.extend([
                (format!("{p}.self_attn.q_proj"), (&mut a.q_proj).into()),
                (format!("{p}.self_attn.k_proj"), (&mut a.k_proj).into()),
                (format!("{p}.self_attn.v_proj"), (&mut a.v_proj).into()),
                (format!("{p}.self_attn.out_proj"), (&mut a.out_proj).into()),
                (format!("{p}.mlp.fc1"), (&mut l.mlp.fc1).into()),
                (format!("{p}.mlp.fc2"), (&mut l.mlp.fc2).into()),
            ]);
        }
        if let Some(p) = &mut self.text_projection {
            out.push(("text_projection".into(), p.into()));
        }
        out
    }

    fn lora_aliases(&mut self) -> Vec<(String, String)> {
        self.lora_modules()
            .into_iter()
            .filter_map(|(name, _)| {
                let short = name.strip_prefix("text_model.")?.to_string();
                Some((short, name))
            })
            .collect()
    }
}
