//! Position ids of the Qwen2.5-VL language model (M-RoPE): three ids per token (temporal, height,
//! width). Text tokens advance all three together; the `<|image_pad|>` tokens of an image get the
//! temporal, row and column index of their merged patch, offset by the position the image starts at,
//! and the text after the image continues at `start + max(h, w) / merge`.
//!
//! Ported from transformers 5.24.0 `models/qwen2_5_vl/modeling_qwen2_5_vl.py`
//! (`Qwen2_5_VLModel.get_rope_index`, `get_vision_position_ids`), Apache-2.0, Copyright The Qwen team,
//! Alibaba Group and the HuggingFace Inc. team. As there, tokens are grouped into runs of one
//! modality (`mm_token_type_ids`: 1 for `image_token_id`, 0 otherwise), each image run takes the
//! next grid, and padding (attention mask 0) takes no position and keeps id 0.
//!
//! The angles themselves are computed by the language model ([`super::language_model`]).

use tch::Tensor;

use crate::error::GenerateError;

/// How the language model's position ids are built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionMode {
    /// M-RoPE from the image grids ([`get_rope_index`]): what Qwen2.5-VL was trained with, and what
    /// the Edit pipelines compute with transformers < 5.15 (or with `mm_token_type_ids` forwarded,
    /// diffusers PR #14189).
    #[default]
    Mrope,
    /// `0..L` on all three axes: what diffusers 0.42.1 computes with transformers ≥ 5.15, whose
    /// Qwen2.5-VL needs `mm_token_type_ids` that the pipeline does not forward (diffusers issue
    /// #14194). Only for bit-parity with that reference.
    Sequential,
}

/// M-RoPE position ids `[3][L]` of one unpadded sequence: `input_ids` with the `<|image_pad|>`
/// runs (id `image_token_id`) of images with patch grids `grids` (`(t, h, w)` in patches, before
/// the `merge × merge` merge), in order.
///
/// Errors: fewer grids than image runs, a run whose length is not its grid's `t·h·w / merge²`, a
/// grid not divisible by the merge size, or grids left over.
pub fn get_rope_index(
    input_ids: &[i64],
    image_token_id: i64,
    grids: &[(i64, i64, i64)],
    spatial_merge_size: i64,
) -> Result<[Vec<i64>; 3], GenerateError> {
    let m = spatial_merge_size;
    let bad = |why: String| GenerateError::InvalidRequest(format!("position ids: {why}"));
    let mut out: [Vec<i64>; 3] = [
        Vec::with_capacity(input_ids.len()),
        Vec::with_capacity(input_ids.len()),
        Vec::with_capacity(input_ids.len()),
    ];
    let mut grids_left = grids.iter();
    let mut current = 0i64;
    let mut i = 0usize;
    while i < input_ids.len() {
        let is_image = input_ids[i] == image_token_id;
        let run = input_ids[i..]
            .iter()
            .take_while(|&&t| (t == image_token_id) == is_image)
            .count();
        if !is_image {
            for p in current..current + run as i64 {
                for axis in &mut out {
                    axis.push(p);
                }
            }
            current += run as i64;
        } else {
            let &(t, h, w) = grids_left.next().ok_or_else(|| {
                bad(format!(
                    "more image-token runs than the {} grids",
                    grids.len()
                ))
            })?;
            if m <= 0 || t <= 0 || h <= 0 || w <= 0 || h % m != 0 || w % m != 0 {
                return Err(bad(format!(
                    "grid (t {t}, h {h}, w {w}) is not a positive multiple of the merge size {m}"
                )));
            }
            let (gh, gw) = (h / m, w / m);
            if t * gh * gw != run as i64 {
                return Err(bad(format!(
                    "an image run of {run} tokens does not match grid (t {t}, h {h}, w {w}) ({} tokens)",
                    t * gh * gw
                )));
            }
            // `get_vision_position_ids(current, grid, 1, merge, time_interval=1)`.
            for ti in 0..t {
                for hi in 0..gh {
                    for wi in 0..gw {
                        out[0].push(ti + current);
                        out[1].push(hi + current);
                        out[2].push(wi + current);
                    }
                }
            }
            current += gh.max(gw);
        }
        i += run;
    }
    if grids_left.next().is_some() {
        return Err(bad(format!(
            "{} grids for fewer image-token runs",
            grids.len()
        )));
    }
    Ok(out)
}

/// Sequential position ids `0..len` on all three axes.
pub fn sequential_positions(len: usize) -> [Vec<i64>; 3] {
    let p: Vec<i64> = (0..len as i64).collect();
    [p.clone(), p.clone(), p]
}

/// Position ids `[3, B, L]` (int64, CPU) of a padded batch, as transformers' `get_rope_index`
/// with an attention mask: row `b` of `input_ids` (`[B][L]`) keeps the tokens where
/// `attention_mask[b]` is non-zero (left, right or any padding), those get the positions of
/// [`get_rope_index`] (or sequential ones) in order, and padding keeps 0.
pub fn masked_position_ids(
    input_ids: &[Vec<i64>],
    attention_mask: &[Vec<i64>],
    grids: &[Vec<(i64, i64, i64)>],
    image_token_id: i64,
    spatial_merge_size: i64,
    mode: PositionMode,
) -> Result<Tensor, GenerateError> {
    let b = input_ids.len();
    let len = input_ids.first().map_or(0, Vec::len);
    if attention_mask.len() != b
        || grids.len() != b
        || input_ids
            .iter()
            .chain(attention_mask)
            .any(|r| r.len() != len)
    {
        return Err(GenerateError::InvalidRequest(format!(
            "position ids: input ids, attention mask and grids disagree on the batch shape [{b}, {len}]"
        )));
    }
    let mut flat = vec![0i64; 3 * b * len];
    for bi in 0..b {
        let keep: Vec<usize> = (0..len).filter(|&j| attention_mask[bi][j] != 0).collect();
        let ids: Vec<i64> = keep.iter().map(|&j| input_ids[bi][j]).collect();
        let pos = match mode {
            PositionMode::Mrope => {
                get_rope_index(&ids, image_token_id, &grids[bi], spatial_merge_size)?
            }
            PositionMode::Sequential => sequential_positions(ids.len()),
        };
        for (axis, p) in pos.iter().enumerate() {
            for (&j, &v) in keep.iter().zip(p) {
                flat[(axis * b + bi) * len + j] = v;
            }
        }
    }
    Ok(Tensor::from_slice(&flat).reshape([3, b as i64, len as i64]))
}

/// Position ids `[3, B, L]` (int64, CPU) of a batch of sequences padded to `len` (right padding:
/// each sequence's tokens first), each sequence with its own image grids. Padding positions are
/// 0, as transformers leaves them.
pub fn batch_position_ids(
    sequences: &[Vec<i64>],
    grids: &[Vec<(i64, i64, i64)>],
    len: usize,
    image_token_id: i64,
    spatial_merge_size: i64,
    mode: PositionMode,
) -> Result<Tensor, GenerateError> {
    if sequences.len() != grids.len() {
        return Err(GenerateError::InvalidRequest(format!(
            "position ids: {} sequences but {} grid lists",
            sequences.len(),
            grids.len()
        )));
    }
    let b = sequences.len();
    let mut flat = vec![0i64; 3 * b * len];
    for (bi, (ids, g)) in sequences.iter().zip(grids).enumerate() {
        if ids.len() > len {
            return Err(GenerateError::InvalidRequest(format!(
                "position ids: sequence {bi} has {} tokens, more than the padded length {len}",
                ids.len()
            )));
        }
        let pos = match mode {
            PositionMode::Mrope => get_rope_index(ids, image_token_id, g, spatial_merge_size)?,
            PositionMode::Sequential => sequential_positions(ids.len()),
        };
        for (axis, p) in pos.iter().enumerate() {
            let start = (axis * b + bi) * len;
            flat[start..start + p.len()].copy_from_slice(p);
        }
    }
    Ok(Tensor::from_slice(&flat).reshape([3, b as i64, len as i64]))
}
