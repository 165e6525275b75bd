//! VAE tiling: the [`Tiling`] setting callers choose, and diffusers' tile-and-blend scheme
//! ([`tiled`]) for 2-D maps: overlapping input tiles mapped one at a time, each output tile
//! blended linearly into the (already blended) tile above and the one to its left, cropped, and
//! the crops concatenated.
//!
//! After diffusers `AutoencoderKLQwenImage.tiled_encode` / `tiled_decode` and `blend_v` / `blend_h`
//! (`models/autoencoders/autoencoder_kl_qwenimage.py`, Apache-2.0), restricted to one frame.

use tch::Tensor;

/// Whether a VAE call tiles; each VAE states its exact rule (`sdxl::vae::AutoencoderKL::encode`,
/// `qwen_image::vae::QwenVae::with_tiling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tiling {
    /// The model decides: the SDXL VAE tiles when its estimated working memory exceeds its
    /// `memory_budget_mib` (seam-free tiles), the Qwen VAE when a side exceeds its
    /// `tiling_threshold` pixels.
    Auto,
    /// Tile whatever the size (the Qwen VAE still skips inputs that fit in one tile, as
    /// diffusers' `enable_tiling()` does).
    Always,
    Never,
}

/// One axis pair (height, width) of a tile grid; all sizes in elements of the tensor they apply
/// to (input tiles and strides in input elements, blend and crop in output elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileGrid {
    /// Input tile size `[h, w]` (edge tiles are smaller).
    pub tile: [i64; 2],
    /// Input stride between tile origins `[h, w]`.
    pub stride: [i64; 2],
    /// Output rows / columns blended with the neighbour above / to the left.
    pub blend: [i64; 2],
    /// Output rows / columns each tile contributes (from its top-left corner).
    pub crop: [i64; 2],
    /// Size the concatenated result is finally cropped to.
    pub out: [i64; 2],
}

/// Maps `x` (`[B, C, H, W]`) tile by tile through `f` as described by `grid` and reassembles the
/// outputs (diffusers' `tiled_encode` / `tiled_decode` for one frame).
pub fn tiled(x: &Tensor, grid: &TileGrid, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
    let size = x.size();
    let (h, w) = (size[2], size[3]);
    let step = |s: i64| s.max(1) as usize;
    let mut rows: Vec<Vec<Tensor>> = Vec::new();
    for i in (0..h).step_by(step(grid.stride[0])) {
        let row = (0..w)
            .step_by(step(grid.stride[1]))
            .map(|j| {
                let t =
                    x.narrow(2, i, grid.tile[0].min(h - i))
                        .narrow(3, j, grid.tile[1].min(w - j));
                f(&t)
            })
            .collect();
        rows.push(row);
    }
    let mut out_rows = Vec::with_capacity(rows.len());
    for i in 0..rows.len() {
        let mut out_row = Vec::with_capacity(rows[i].len());
        for j in 0..rows[i].len() {
            let mut t = rows[i][j].shallow_clone();
            if i > 0 {
                t = blend_axis(&rows[i - 1][j], &t, grid.blend[0], 2);
            }
            if j > 0 {
                t = blend_axis(&rows[i][j - 1], &t, grid.blend[1], 3);
            }
            // diffusers blends in place, so later neighbours see the blended tile.
            rows[i][j] = t.shallow_clone();
            let th = t.size()[2].min(grid.crop[0]);
            let tw = t.size()[3].min(grid.crop[1]);
            out_row.push(t.narrow(2, 0, th).narrow(3, 0, tw));
        }
        out_rows.push(Tensor::cat(&out_row, 3));
    }
    let all = Tensor::cat(&out_rows, 2);
    let full = all.size();
    all.narrow(2, 0, grid.out[0].min(full[2]))
        .narrow(3, 0, grid.out[1].min(full[3]))
}

/// diffusers `blend_v` (axis 2) / `blend_h` (axis 3): the first `extent` rows of `b` become
/// `a[-extent + y] * (1 - y/extent) + b[y] * (y/extent)`, with `extent` limited to both sizes.
pub fn blend_axis(a: &Tensor, b: &Tensor, extent: i64, axis: i64) -> Tensor {
    let na = a.size()[axis as usize];
    let nb = b.size()[axis as usize];
    let extent = extent.min(na).min(nb);
    if extent <= 0 {
        return b.shallow_clone();
    }
    let mut parts = Vec::with_capacity(extent as usize + 1);
    for y in 0..extent {
        let r = y as f64 / extent as f64;
        parts.push(a.narrow(axis, na - extent + y, 1) * (1.0 - r) + b.narrow(axis, y, 1) * r);
    }
    parts.push(b.narrow(axis, extent, nb - extent));
    Tensor::cat(&parts, axis)
}
