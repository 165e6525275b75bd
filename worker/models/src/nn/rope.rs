//! Applying rotary position embeddings (RoPE) in the two layouts the models use. The angles
//! (`cos`, `sin`) are computed by each model, since each builds its positions differently
//! (QwenImage's centred 3-D video positions, Qwen2.5-VL's 2-D vision and 3-axis M-RoPE ids).

use tch::{Kind, Tensor};

/// Rotation of interleaved pairs `(x[2k], x[2k+1])` by angle `k`, as diffusers'
/// `apply_rotary_emb_qwen(..., use_real=False)`: `x` in fp32 viewed as complex numbers, times the
/// complex table `cis = cos + i·sin` (broadcast to `[..., D/2]`), back to `x`'s dtype. One complex
/// multiply instead of the real form's dozen kernels (measured: docs/performance.md).
pub fn apply_interleaved(x: &Tensor, cis: &Tensor) -> Tensor {
    let kind = x.kind();
    let mut shape = x.size();
    let d = shape.pop().unwrap_or(0);
    let mut pairs = shape;
    pairs.extend([d / 2, 2]);
    let xc = x.to_kind(Kind::Float).reshape(&pairs).view_as_complex();
    (xc * cis).view_as_real().flatten(-2, -1).to_kind(kind)
}

/// `cat(-x2, x1)` of the two halves of the last dimension (transformers' `rotate_half`).
pub fn rotate_half(x: &Tensor) -> Tensor {
    let d = x.size().last().copied().unwrap_or(0);
    let halves = x.split(d / 2, -1);
    Tensor::cat(&[-&halves[1], halves[0].shallow_clone()], -1)
}

/// `x * cos + rotate_half(x) * sin` (transformers' Qwen2/Qwen2.5-VL layout: the first and second
/// halves of the head dimension are the pairs). `cos` and `sin` broadcast to `x`; the caller
/// chooses the dtype (the vision tower upcasts to fp32, the language model does not).
pub fn apply_rotate_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    x * cos + rotate_half(x) * sin
}
