//! The Qwen2.5-VL vision tower (`Qwen2_5_VisionTransformerPretrainedModel`): patchified pixels
//! `[N_patches, C·T·P·P]` and each image's patch grid `(t, h, w)` in, one `out_hidden_size` embedding
//! per 2×2 block of patches out (`[N_patches / merge², out_hidden]`, images in order), the embeddings
//! that replace the `<|image_pad|>` tokens of the language model.
//!
//! Ported from transformers 5.24.0 `models/qwen2_5_vl/modeling_qwen2_5_vl.py` and `vision_utils.py`
//! (`get_vision_position_ids`, `get_vision_window_index`, `get_vision_cu_seqlens`), Apache-2.0,
//! Copyright The Qwen team, Alibaba Group and the HuggingFace Inc. team.
//!
//! Field names equal the checkpoint keys below the vision root (`patch_embed.proj`,
//! `blocks.N.{norm1, norm2, attn.qkv, attn.proj, mlp.{gate,up,down}_proj}`, `merger.{ln_q, mlp.0,
//! mlp.2}`); the root is `model.visual` (transformers ≥ 5) or `visual` (older transformers,
//! ComfyUI's single file), see [`vision_prefix`].
//!
//! Invariants of the forward pass, as in the reference:
//! - patches arrive in spatial-merge order (each 2×2 block of patches consecutive), as the image
//!   processor writes them; the tower reorders the blocks into window order once, before the first
//!   block, and puts the merged tokens back into image order after the merger;
//! - window blocks attend within windows of `window_size / patch / merge` merged tokens per side
//!   (smaller at the right and bottom edges); the `fullatt_block_indexes` blocks attend within each
//!   frame of each image; no token ever attends across images;
//! - RoPE is applied in fp32 and cast back, RMSNorm statistics are fp32 (as the reference).

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError};
use crate::loading::weights::{WeightStore, Weights, load_layers};
use crate::nn::rope::apply_rotate_half;
use crate::nn::{AttentionImpl, Linear, RmsNorm, attention};

/// The vision roots a checkpoint may use, most specific first: transformers ≥ 5 saves
/// `Qwen2_5_VLForConditionalGeneration` as `model.visual.*` (beside `model.language_model.*`);
/// older transformers and ComfyUI's `qwen_2.5_vl_7b_fp8_scaled.safetensors` use `visual.*`.
pub const VISION_PREFIXES: [&str; 2] = ["model.visual", "visual"];

/// The vision root of a text-encoder checkpoint (one of [`VISION_PREFIXES`]), found by its patch
/// embedding; `None` when the checkpoint has no vision tower (a text-only export).
pub fn vision_prefix(store: &WeightStore) -> Option<&'static str> {
    VISION_PREFIXES
        .into_iter()
        .find(|p| store.contains(&format!("{p}.patch_embed.proj.weight")))
}

/// MLP activation of the vision blocks (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x * sigmoid(x)`; the only one Qwen2.5-VL checkpoints use.
    Silu,
}

/// `Qwen2_5_VLVisionConfig` fields the tower needs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct VisionConfig {
    pub depth: i64,
    pub hidden_size: i64,
    pub hidden_act: Activation,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub in_channels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub spatial_merge_size: i64,
    /// Window side in pixels: windows are `window_size / patch_size / spatial_merge_size` merged
    /// tokens per side.
    pub window_size: i64,
    pub out_hidden_size: i64,
    /// Blocks that attend over whole frames instead of windows.
    pub fullatt_block_indexes: Vec<i64>,
    /// Base of the 2-D rotary embedding (`rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// Epsilon of every RMSNorm (`norm1`, `norm2`, `merger.ln_q`); fixed in transformers' code.
    pub rms_norm_eps: f64,
}

impl Default for VisionConfig {
    /// transformers' `Qwen2_5_VLVisionConfig` defaults (including its `hidden_size` of 3584, which
    /// no released checkpoint uses: their configs all say 1280).
    fn default() -> Self {
        Self {
            depth: 32,
            hidden_size: 3584,
            hidden_act: Activation::Silu,
            intermediate_size: 3420,
            num_heads: 16,
            in_channels: 3,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: 112,
            out_hidden_size: 3584,
            fullatt_block_indexes: vec![7, 15, 23, 31],
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
        }
    }
}

impl VisionConfig {
    /// `vision_config` of Qwen/Qwen2.5-VL-7B-Instruct `config.json` (also the text encoder of
    /// Qwen/Qwen-Image-Edit-2509, `text_encoder/config.json`).
    pub fn qwen2_5_vl_7b() -> Self {
        Self {
            hidden_size: 1280,
            out_hidden_size: 3584,
            ..Self::default()
        }
    }

    /// The tiny test tower of `fixtures/qwen/common.py` (`build_tiny()`): 2 blocks, hidden 16, 2 heads,
    /// the last block full-attention; patch, merge and window sizes as the real model.
    pub fn tiny() -> Self {
        Self {
            depth: 2,
            hidden_size: 16,
            intermediate_size: 16,
            num_heads: 2,
            out_hidden_size: 16,
            fullatt_block_indexes: vec![1],
            ..Self::default()
        }
    }

    /// Reads the `vision_config` object of a transformers `config.json` (or a bare vision config
    /// object). Missing keys take transformers' defaults; `in_chans` (the released configs' name)
    /// and `in_channels`, `depth` and `num_hidden_layers`, `num_heads` and `num_attention_heads`
    /// are accepted alike.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let root: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let v = root.get("vision_config").unwrap_or(&root);
        if !v.is_object() {
            return Err("`vision_config` is not an object".into());
        }
        let d = Self::default();
        let int = |keys: &[&str], default: i64| -> Result<i64, String> {
            match keys.iter().find_map(|k| v.get(*k)) {
                None => Ok(default),
                Some(x) => x
                    .as_i64()
                    .ok_or_else(|| format!("`vision_config.{}` is not an integer", keys[0])),
            }
        };
        let hidden_act = match v.get("hidden_act").map(|a| a.as_str()) {
            None | Some(Some("silu")) => Activation::Silu,
            Some(other) => return Err(format!("unsupported vision `hidden_act` {other:?}")),
        };
        let fullatt_block_indexes = match v.get("fullatt_block_indexes") {
            None => d.fullatt_block_indexes.clone(),
            Some(a) => a
                .as_array()
                .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
                .ok_or("`vision_config.fullatt_block_indexes` is not a list of integers")?,
        };
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|t| t.as_f64().ok_or("`rope_theta` is not a number"))
            .transpose()?
            .unwrap_or(d.rope_theta);
        let config = Self {
            depth: int(&["depth", "num_hidden_layers"], d.depth)?,
            hidden_size: int(&["hidden_size"], d.hidden_size)?,
            hidden_act,
            intermediate_size: int(&["intermediate_size"], d.intermediate_size)?,
            num_heads: int(&["num_heads", "num_attention_heads"], d.num_heads)?,
            in_channels: int(&["in_channels", "in_chans"], d.in_channels)?,
            patch_size: int(&["patch_size", "spatial_patch_size"], d.patch_size)?,
            temporal_patch_size: int(&["temporal_patch_size"], d.temporal_patch_size)?,
            spatial_merge_size: int(&["spatial_merge_size"], d.spatial_merge_size)?,
            window_size: int(&["window_size"], d.window_size)?,
            out_hidden_size: int(&["out_hidden_size"], d.out_hidden_size)?,
            fullatt_block_indexes,
            rope_theta,
            rms_norm_eps: d.rms_norm_eps,
        };
        config.validate()?;
        Ok(config)
    }

    /// The structural constraints the tower relies on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("depth", self.depth),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_heads", self.num_heads),
            ("in_channels", self.in_channels),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("spatial_merge_size", self.spatial_merge_size),
            ("out_hidden_size", self.out_hidden_size),
        ];
        if let Some((k, v)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("vision `{k}` must be positive, is {v}"));
        }
        if self.hidden_size % self.num_heads != 0 || self.head_dim() % 4 != 0 {
            return Err(format!(
                "vision hidden_size {} / num_heads {} must give a head dim divisible by 4 (2-D RoPE)",
                self.hidden_size, self.num_heads
            ));
        }
        if self.merged_window() < 1 {
            return Err(format!(
                "vision window_size {} is smaller than one merged token ({} pixels)",
                self.window_size,
                self.patch_size * self.spatial_merge_size
            ));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads
    }

    /// Values per patch: `in_channels · temporal_patch_size · patch_size²` (1176 for the real model).
    pub fn patch_dim(&self) -> i64 {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches merged into one output token (`spatial_merge_size²`).
    pub fn merge_unit(&self) -> i64 {
        self.spatial_merge_size * self.spatial_merge_size
    }

    /// Window side in merged tokens (transformers' `vit_merger_window_size`).
    pub fn merged_window(&self) -> i64 {
        self.window_size / self.spatial_merge_size / self.patch_size
    }
}

/// The attention segments of one layout (windows, or whole frames): consecutive runs of the
/// window-ordered sequence, each attending only within itself.
///
/// Segments are grouped by length, and each group runs as one batched attention call over
/// `[segments, heads, length, head_dim]`. Why not the alternatives: a block-diagonal additive
/// mask makes every block attend over all N² pairs (quadratic memory, ~120 MB per mask at 1024²
/// pixels in fp32) and keeps SDPA off its mask-free fused kernels; a loop over segments (what
/// transformers does without flash attention) issues one tiny call per window, hundreds per block
/// for a large image. Windows come in at most four lengths per image (full, right edge, bottom edge,
/// corner), so grouping needs a handful of calls, computes exactly each segment's own softmax, and
/// uses only `index_select` and plain SDPA/matmul (no CUDA-only varlen kernels).
#[derive(Debug)]
struct Segments {
    /// One batched call per distinct segment length.
    groups: Vec<SegmentGroup>,
    /// Rows of the concatenated group outputs in sequence order; `None` when they already are.
    restore: Option<Tensor>,
}

#[derive(Debug)]
struct SegmentGroup {
    /// Sequence rows of the group's segments, segment after segment; `None` for `0..N`.
    rows: Option<Tensor>,
    count: i64,
    len: i64,
}

impl Segments {
    /// Groups the segments given by cumulative boundaries `cu` (`cu[0] = 0`, last = N); empty
    /// segments are skipped.
    fn new(cu: &[i64], device: Device) -> Self {
        let mut by_len: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
        for pair in cu.windows(2) {
            let len = pair[1] - pair[0];
            if len > 0 {
                by_len.entry(len).or_default().push(pair[0]);
            }
        }
        let total = cu.last().copied().unwrap_or(0);
        if by_len.len() == 1 {
            // All segments have one length and tile 0..N in order: no gather needed.
            if let Some((&len, starts)) = by_len.iter().next() {
                return Self {
                    groups: vec![SegmentGroup {
                        rows: None,
                        count: starts.len() as i64,
                        len,
                    }],
                    restore: None,
                };
            }
        }
        let mut order: Vec<i64> = Vec::with_capacity(total as usize);
        let mut groups = Vec::with_capacity(by_len.len());
        for (len, starts) in by_len {
            let rows: Vec<i64> = starts.iter().flat_map(|&s| s..s + len).collect();
            order.extend_from_slice(&rows);
            groups.push(SegmentGroup {
                rows: Some(Tensor::from_slice(&rows).to_device(device)),
                count: starts.len() as i64,
                len,
            });
        }
        Self {
            groups,
            restore: Some(Tensor::from_slice(&inverse_permutation(&order)).to_device(device)),
        }
    }

    /// Attention of `q`, `k`, `v` (`[N, H, D]`) within each segment, `[N, H, D]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, imp: AttentionImpl) -> Tensor {
        let (_, h, d) = q.size3().expect("vision q is [N, H, D]");
        let outs: Vec<Tensor> = self
            .groups
            .iter()
            .map(|g| {
                let batch = |t: &Tensor| {
                    let rows = match &g.rows {
                        Some(r) => t.index_select(0, r),
                        None => t.shallow_clone(),
                    };
                    rows.reshape([g.count, g.len, h, d]).transpose(1, 2)
                };
                attention(&batch(q), &batch(k), &batch(v), None, scale, imp)
                    .transpose(1, 2)
                    .reshape([g.count * g.len, h, d])
            })
            .collect();
        let cat = if outs.len() == 1 {
            outs.into_iter().next().expect("one group")
        } else {
            Tensor::cat(&outs, 0)
        };
        match &self.restore {
            Some(r) => cat.index_select(0, r),
            None => cat,
        }
    }
}

/// `argsort` of a permutation of `0..n`.
fn inverse_permutation(p: &[i64]) -> Vec<i64> {
    let mut inv = vec![0i64; p.len()];
    for (i, &j) in p.iter().enumerate() {
        inv[j as usize] = i as i64;
    }
    inv
}

/// Everything the forward pass derives from `grid_thw` alone (transformers' `vision_utils`),
/// computed on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionLayout {
    /// `(h, w)` patch coordinates of every patch in input (spatial-merge) order
    /// (`get_vision_position_ids`).
    pub positions: Vec<(i64, i64)>,
    /// Merged-token indices in window order (`get_vision_window_index`'s `window_index`).
    pub window_index: Vec<i64>,
    /// Patch boundaries of the windows in window order, starting at 0 (`cu_window_seqlens` after
    /// `unique_consecutive`).
    pub cu_window_seqlens: Vec<i64>,
    /// Patch boundaries of every frame of every image (`cu_seqlens`).
    pub cu_seqlens: Vec<i64>,
}

impl VisionLayout {
    /// The layout of images with patch grids `grid_thw`; an error names a grid the tower cannot take
    /// (a zero or negative size, `h` or `w` not a multiple of the merge size, too many patches).
    pub fn new(config: &VisionConfig, grid_thw: &[(i64, i64, i64)]) -> Result<Self, GenerateError> {
        Self::patch_count(config, grid_thw)?;
        let m = config.spatial_merge_size;
        let win = config.merged_window();
        let unit = config.merge_unit();
        let mut layout = Self {
            positions: Vec::new(),
            window_index: Vec::new(),
            cu_window_seqlens: vec![0],
            cu_seqlens: vec![0],
        };
        let mut merged_base = 0i64;
        for &(t, h, w) in grid_thw {
            let frame = h * w;
            // Positions: patch (row, col) with each m×m block consecutive, repeated per frame.
            let mut frame_pos = Vec::with_capacity(frame as usize);
            for bh in 0..h / m {
                for bw in 0..w / m {
                    for ih in 0..m {
                        for iw in 0..m {
                            frame_pos.push((bh * m + ih, bw * m + iw));
                        }
                    }
                }
            }
            for _ in 0..t {
                layout.positions.extend_from_slice(&frame_pos);
                let last = *layout.cu_seqlens.last().unwrap_or(&0);
                layout.cu_seqlens.push(last + frame);
            }
            // Windows: win×win merged tokens, row-major over windows, per frame.
            let (lh, lw) = (h / m, w / m);
            for f in 0..t {
                for wy in 0..(lh + win - 1) / win {
                    for wx in 0..(lw + win - 1) / win {
                        let mut n = 0;
                        for y in wy * win..((wy + 1) * win).min(lh) {
                            for x in wx * win..((wx + 1) * win).min(lw) {
                                layout
                                    .window_index
                                    .push(merged_base + f * lh * lw + y * lw + x);
                                n += 1;
                            }
                        }
                        let last = *layout.cu_window_seqlens.last().unwrap_or(&0);
                        layout.cu_window_seqlens.push(last + n * unit);
                    }
                }
            }
            merged_base += t * lh * lw;
        }
        Ok(layout)
    }

    /// The number of patches of `grid_thw`, checked before anything is allocated: every size
    /// positive, `h` and `w` multiples of the merge size, at most `i32::MAX` patches in all.
    pub fn patch_count(
        config: &VisionConfig,
        grid_thw: &[(i64, i64, i64)],
    ) -> Result<i64, GenerateError> {
        let m = config.spatial_merge_size;
        let mut total = 0i64;
        for (i, &(t, h, w)) in grid_thw.iter().enumerate() {
            let bad = |why: &str| {
                GenerateError::InvalidRequest(format!(
                    "vision image {i}: grid (t {t}, h {h}, w {w}) {why}"
                ))
            };
            if t <= 0 || h <= 0 || w <= 0 || h % m != 0 || w % m != 0 {
                return Err(bad(&format!(
                    "must be positive with h and w multiples of {m}"
                )));
            }
            total = t
                .checked_mul(h)
                .and_then(|n| n.checked_mul(w))
                .and_then(|n| n.checked_add(total))
                .filter(|&n| n <= i64::from(i32::MAX))
                .ok_or_else(|| bad("has too many patches"))?;
        }
        Ok(total)
    }

    /// Number of patches.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Patch indices in window order: each merged token's `merge²` patches, tokens in
    /// `window_index` order (`permute_input_for_window_attn`).
    fn patch_order(&self, unit: i64) -> Vec<i64> {
        self.window_index
            .iter()
            .flat_map(|&t| t * unit..(t + 1) * unit)
            .collect()
    }
}

/// The 2-D rotary embedding (`Qwen2_5_VLVisionRotaryEmbedding`, "axial"): a patch at `(h, w)`
/// rotates the first quarter-pairs by `h · θ_i` and the next by `w · θ_i`, `θ_i = theta^(-4i/head_dim)`.
#[derive(Debug)]
struct VisionRotaryEmbedding {
    /// `[head_dim / 4]` fp32.
    inv_freq: Tensor,
}

impl VisionRotaryEmbedding {
    fn new(config: &VisionConfig, device: Device) -> Self {
        let spatial_dim = config.head_dim() / 2;
        let exponent = Tensor::arange_start_step(0, spatial_dim, 2, (Kind::Float, device))
            / spatial_dim as f64;
        Self {
            inv_freq: Tensor::pow_scalar(config.rope_theta, &exponent).reciprocal(),
        }
    }

    /// Angles `[N, head_dim / 2]` (fp32): `cat(h · inv_freq, w · inv_freq)` per patch (what
    /// transformers < 5 called `rot_pos_emb`).
    fn angles(&self, positions: &[(i64, i64)]) -> Tensor {
        let device = self.inv_freq.device();
        let (hs, ws): (Vec<i64>, Vec<i64>) = positions.iter().copied().unzip();
        let axis = |p: Vec<i64>| {
            Tensor::from_slice(&p)
                .to_device(device)
                .to_kind(Kind::Float)
                .unsqueeze(-1)
                * &self.inv_freq
        };
        Tensor::cat(&[axis(hs), axis(ws)], -1)
    }
}

#[derive(Debug)]
struct VisionAttention {
    qkv: Linear,
    proj: Linear,
    heads: i64,
    head_dim: i64,
}

impl VisionAttention {
    fn new(w: &Weights, c: &VisionConfig) -> Result<Self, LoadError> {
        let d = c.hidden_size;
        Ok(Self {
            qkv: Linear::new(&w.pp("qkv"), d, 3 * d, true)?,
            proj: Linear::new(&w.pp("proj"), d, d, true)?,
            heads: c.num_heads,
            head_dim: c.head_dim(),
        })
    }

    /// `x` `[N, D]` in window order; `cos`/`sin` `[N, 1, head_dim]` fp32.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        segments: &Segments,
        imp: AttentionImpl,
    ) -> Tensor {
        let n = x.size()[0];
        let kind = x.kind();
        let qkv = self
            .qkv
            .forward(x)
            .reshape([n, 3, self.heads, self.head_dim]);
        let rope = |t: Tensor| apply_rotate_half(&t.to_kind(Kind::Float), cos, sin).to_kind(kind);
        let q = rope(qkv.select(1, 0));
        let k = rope(qkv.select(1, 1));
        let v = qkv.select(1, 2);
        let scale = (self.head_dim as f64).powf(-0.5);
        let o = segments.attend(&q, &k, &v, scale, imp);
        self.proj
            .forward(&o.reshape([n, self.heads * self.head_dim]))
    }
}

#[derive(Debug)]
struct VisionMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
}

impl VisionMlp {
    fn new(w: &Weights, c: &VisionConfig) -> Result<Self, LoadError> {
        let (d, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_proj: Linear::new(&w.pp("gate_proj"), d, i, true)?,
            up_proj: Linear::new(&w.pp("up_proj"), d, i, true)?,
            down_proj: Linear::new(&w.pp("down_proj"), i, d, true)?,
            act: c.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let gate = match self.act {
            Activation::Silu => self.gate_proj.forward(x).silu(),
        };
        self.down_proj.forward(&(gate * self.up_proj.forward(x)))
    }
}

#[derive(Debug)]
struct VisionBlock {
    norm1: RmsNorm,
    norm2: RmsNorm,
    attn: VisionAttention,
    mlp: VisionMlp,
}

impl VisionBlock {
    fn new(w: &Weights, c: &VisionConfig) -> Result<Self, LoadError> {
        Ok(Self {
            norm1: RmsNorm::new(&w.pp("norm1"), c.hidden_size, c.rms_norm_eps)?,
            norm2: RmsNorm::new(&w.pp("norm2"), c.hidden_size, c.rms_norm_eps)?,
            attn: VisionAttention::new(&w.pp("attn"), c)?,
            mlp: VisionMlp::new(&w.pp("mlp"), c)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        segments: &Segments,
        imp: AttentionImpl,
    ) -> Tensor {
        let h = x + self
            .attn
            .forward(&self.norm1.forward(x), cos, sin, segments, imp);
        &h + self.mlp.forward(&self.norm2.forward(&h))
    }
}

/// `Qwen2_5_VLPatchMerger`: RMSNorm, then each `merge²` consecutive patches concatenated and
/// projected by `Linear → GELU (erf) → Linear` to the language model's width.
#[derive(Debug)]
struct PatchMerger {
    ln_q: RmsNorm,
    mlp_0: Linear,
    mlp_2: Linear,
    merged_dim: i64,
}

impl PatchMerger {
    fn new(w: &Weights, c: &VisionConfig) -> Result<Self, LoadError> {
        let merged_dim = c.hidden_size * c.merge_unit();
        Ok(Self {
            ln_q: RmsNorm::new(&w.pp("ln_q"), c.hidden_size, c.rms_norm_eps)?,
            mlp_0: Linear::new(&w.pp("mlp.0"), merged_dim, merged_dim, true)?,
            mlp_2: Linear::new(&w.pp("mlp.2"), merged_dim, c.out_hidden_size, true)?,
            merged_dim,
        })
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = self.ln_q.forward(x).reshape([-1, self.merged_dim]);
        self.mlp_2.forward(&self.mlp_0.forward(&x).gelu("none"))
    }
}

/// The Qwen2.5-VL vision tower (`Qwen2_5_VisionTransformerPretrainedModel`).
#[derive(Debug)]
pub struct VisionTransformer {
    /// `patch_embed.proj`: the bias-free Conv3d with kernel = stride = `[T, P, P]`, held as the
    /// equivalent Linear over the flattened `C·T·P·P` values of a patch (fp8-aware like any Linear).
    patch_embed: Linear,
    rotary: VisionRotaryEmbedding,
    blocks: Vec<VisionBlock>,
    merger: PatchMerger,
    config: VisionConfig,
    kind: Kind,
    attention: AttentionImpl,
}

impl VisionTransformer {
    /// Builds the tower from `w` positioned at the vision root (see [`vision_prefix`]).
    pub fn new(
        w: &Weights,
        config: &VisionConfig,
        attention: AttentionImpl,
    ) -> Result<Self, LoadError> {
        let c = config;
        let proj = w.pp("patch_embed.proj");
        // The 5-D Conv3d weight, read as the [hidden, C·T·P·P] Linear it is (no copy: a view).
        let (weight, weight_scale) = proj.get_linear_weight(
            "weight",
            &[
                c.hidden_size,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
        )?;
        let patch_embed = Linear {
            weight: weight.reshape([c.hidden_size, c.patch_dim()]),
            weight_scale,
            bias: None,
        };
        let blocks = load_layers(c.depth, |i| VisionBlock::new(&w.pp("blocks").pp(i), c))?;
        Ok(Self {
            patch_embed,
            rotary: VisionRotaryEmbedding::new(c, w.device),
            blocks,
            merger: PatchMerger::new(&w.pp("merger"), c)?,
            config: c.clone(),
            kind: w.kind,
            attention,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Where the weights live.
    pub fn device(&self) -> Device {
        self.rotary.inv_freq.device()
    }

    /// The rotary angles `[N, head_dim / 2]` (fp32) of every patch of `grid_thw`, in input
    /// (spatial-merge) order: `cat(h · inv_freq, w · inv_freq)`; transformers < 5's `rot_pos_emb`.
    pub fn rot_pos_emb(&self, grid_thw: &[(i64, i64, i64)]) -> Result<Tensor, GenerateError> {
        let layout = VisionLayout::new(&self.config, grid_thw)?;
        Ok(self.rotary.angles(&layout.positions))
    }

    /// Embeds `pixel_values` `[N_patches, C·T·P·P]` (patches of all images concatenated, each
    /// image's in spatial-merge order, as the image processor writes them) of images with patch
    /// grids `grid_thw`. Returns `[N_patches / merge², out_hidden_size]` in the weights' dtype,
    /// images in order (transformers' `pooler_output`).
    pub fn forward(
        &self,
        pixel_values: &Tensor,
        grid_thw: &[(i64, i64, i64)],
    ) -> Result<Tensor, GenerateError> {
        let c = &self.config;
        let n = VisionLayout::patch_count(c, grid_thw)?;
        let expected = [n, c.patch_dim()];
        if pixel_values.size() != expected {
            return Err(GenerateError::InvalidRequest(format!(
                "vision pixel_values have shape {:?}, the grids {grid_thw:?} need {expected:?}",
                pixel_values.size()
            )));
        }
        if n == 0 {
            return Ok(Tensor::zeros(
                [0, c.out_hidden_size],
                (self.kind, self.device()),
            ));
        }
        let layout = VisionLayout::new(c, grid_thw)?;
        let device = self.device();
        let order = layout.patch_order(c.merge_unit());
        let order_t = Tensor::from_slice(&order).to_device(device);

        let x = self
            .patch_embed
            .forward(&pixel_values.to_device(device).to_kind(self.kind));
        let mut x = x.index_select(0, &order_t);

        // Positions in window order, then the doubled angles as transformers' recomposition.
        let positions: Vec<(i64, i64)> = order
            .iter()
            .map(|&i| layout.positions[i as usize])
            .collect();
        let angles = self.rotary.angles(&positions);
        let emb = Tensor::cat(&[&angles, &angles], -1).unsqueeze(-2);
        let (cos, sin) = (emb.cos(), emb.sin());

        let windows = Segments::new(&layout.cu_window_seqlens, device);
        let frames = Segments::new(&layout.cu_seqlens, device);
        for (i, block) in self.blocks.iter().enumerate() {
            let segments = if c.fullatt_block_indexes.contains(&(i as i64)) {
                &frames
            } else {
                &windows
            };
            x = block.forward(&x, &cos, &sin, segments, self.attention);
        }
        let merged = self.merger.forward(&x);
        let reverse =
            Tensor::from_slice(&inverse_permutation(&layout.window_index)).to_device(device);
        Ok(merged.index_select(0, &reverse))
    }
}
