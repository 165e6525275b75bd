//! Condition images → vision-tower input, as the Edit-Plus pipeline prepares them:
//! 1. the pipeline's own resize ([`condition_resize`]): Pillow LANCZOS to
//!    [`calculate_dimensions`]`(condition_image_size, w / h)` (≈ 384² pixels, sides multiples of 32);
//! 2. the Qwen2-VL image processor ([`preprocess`]): [`smart_resize`] to multiples of
//!    `patch_size · merge_size` (28) within `[min_pixels, max_pixels]`, Pillow BICUBIC, rescale by
//!    1/255, normalise with the CLIP mean/std, repeat to `temporal_patch_size` frames, patchify in
//!    spatial-merge order → `pixel_values [N, C·T·P·P]` (1176 per patch) and one `(t, h, w)` grid per
//!    image.
//!
//! Ported from transformers 5.24.0 `models/qwen2_vl/image_processing_pil_qwen2_vl.py` (`smart_resize`,
//! `patchify`, `_preprocess`) and `image_transforms.py` (`rescale`, `normalize`), and diffusers 0.42.1
//! `pipelines/qwenimage/pipeline_qwenimage_edit_plus.py` (`calculate_dimensions`,
//! `CONDITION_IMAGE_SIZE`, the `VaeImageProcessor.resize` call), Apache-2.0, Copyright The Qwen team,
//! Alibaba Group and the HuggingFace Inc. team.
//!
//! Invariant: with Pillow-exact resizing ([`crate::imageops::resample`]) the values are
//! bit-identical to the reference: the rescale is done in f64 then cast to f32 (`rescale`), the
//! normalisation in f32 with f32 mean/std (`normalize`), exactly as numpy does.

use image::RgbImage;
use tch::Tensor;

use crate::error::GenerateError;
use crate::imageops::resample::{Filter, resize};

/// The image-processor settings (`preprocessor_config.json` of a `Qwen2VLImageProcessor`) plus
/// the pipeline's condition-image area.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ImageProcessorConfig {
    /// Smallest pixel count after [`smart_resize`] (`size.shortest_edge` / `min_pixels`).
    pub min_pixels: i64,
    /// Largest pixel count after [`smart_resize`] (`size.longest_edge` / `max_pixels`).
    pub max_pixels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub merge_size: i64,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    /// The pipeline's `CONDITION_IMAGE_SIZE`: the pixel area condition images are first resized to
    /// (`pipeline_qwenimage_edit_plus.py`, 384 · 384).
    pub condition_image_size: i64,
}

/// OpenAI CLIP normalisation (`OPENAI_CLIP_MEAN`, `OPENAI_CLIP_STD`).
const CLIP_MEAN: [f64; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
const CLIP_STD: [f64; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

impl Default for ImageProcessorConfig {
    /// transformers' `Qwen2VLImageProcessor` defaults (`min_pixels` 56², `max_pixels` 28²·1280, patch
    /// 14, temporal patch 2, merge 2, CLIP mean/std, 1/255) and diffusers' `CONDITION_IMAGE_SIZE`.
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            rescale_factor: 1.0 / 255.0,
            condition_image_size: 384 * 384,
        }
    }
}

impl ImageProcessorConfig {
    /// Reads a `preprocessor_config.json`: `size.{shortest_edge, longest_edge}`, overridden by
    /// `min_pixels` / `max_pixels` when present (as `Qwen2VLImageProcessor.__init__`); other keys
    /// as named; missing keys take the defaults. `do_resize`, `do_rescale`, `do_normalize` and
    /// `do_convert_rgb` must not be false (the pipeline relies on all of them).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if !v.is_object() {
            return Err("the preprocessor config is not a JSON object".into());
        }
        let d = Self::default();
        let int = |value: Option<&serde_json::Value>, key: &str, default: i64| match value
            .filter(|x| !x.is_null())
        {
            None => Ok(default),
            Some(x) => x
                .as_i64()
                .ok_or_else(|| format!("`{key}` is not an integer")),
        };
        let triple = |key: &str, default: [f64; 3]| -> Result<[f64; 3], String> {
            match v.get(key).filter(|x| !x.is_null()) {
                None => Ok(default),
                Some(x) => {
                    let vals: Option<Vec<f64>> = x
                        .as_array()
                        .and_then(|a| a.iter().map(serde_json::Value::as_f64).collect());
                    match vals.as_deref() {
                        Some(&[a, b, c]) => Ok([a, b, c]),
                        _ => Err(format!("`{key}` is not a list of three numbers")),
                    }
                }
            }
        };
        for flag in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
            if v.get(flag).and_then(serde_json::Value::as_bool) == Some(false) {
                return Err(format!("`{flag}: false` is not supported"));
            }
        }
        let size = v.get("size");
        let min_pixels = int(
            size.and_then(|s| s.get("shortest_edge")),
            "size.shortest_edge",
            d.min_pixels,
        )?;
        let max_pixels = int(
            size.and_then(|s| s.get("longest_edge")),
            "size.longest_edge",
            d.max_pixels,
        )?;
        let config = Self {
            min_pixels: int(v.get("min_pixels"), "min_pixels", min_pixels)?,
            max_pixels: int(v.get("max_pixels"), "max_pixels", max_pixels)?,
            patch_size: int(v.get("patch_size"), "patch_size", d.patch_size)?,
            temporal_patch_size: int(
                v.get("temporal_patch_size"),
                "temporal_patch_size",
                d.temporal_patch_size,
            )?,
            merge_size: int(v.get("merge_size"), "merge_size", d.merge_size)?,
            image_mean: triple("image_mean", d.image_mean)?,
            image_std: triple("image_std", d.image_std)?,
            rescale_factor: v
                .get("rescale_factor")
                .filter(|x| !x.is_null())
                .map(|x| x.as_f64().ok_or("`rescale_factor` is not a number"))
                .transpose()?
                .unwrap_or(d.rescale_factor),
            condition_image_size: d.condition_image_size,
        };
        if let Some(r) = v.get("resample").and_then(serde_json::Value::as_i64)
            && r != 3
        {
            return Err(format!(
                "`resample` {r} is not supported (only 3, bicubic, as Qwen2-VL)"
            ));
        }
        config.validate()?;
        Ok(config)
    }

    /// The constraints the processor relies on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("min_pixels", self.min_pixels),
            ("max_pixels", self.max_pixels),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("merge_size", self.merge_size),
            ("condition_image_size", self.condition_image_size),
        ];
        if let Some((k, v)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("image processor `{k}` must be positive, is {v}"));
        }
        if self.image_std.contains(&0.0) {
            return Err("image processor `image_std` has a zero".into());
        }
        Ok(())
    }

    /// `patch_size · merge_size`: the multiple both sides are resized to.
    pub fn factor(&self) -> i64 {
        self.patch_size * self.merge_size
    }

    /// Values per patch: `3 · temporal_patch_size · patch_size²`.
    pub fn patch_dim(&self) -> i64 {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// diffusers' `calculate_dimensions(target_area, ratio)`: `(width, height)` of about
/// `target_area` pixels with aspect `ratio = w / h`, each rounded (half to even, as Python's
/// `round`) to a multiple of 32.
pub fn calculate_dimensions(target_area: f64, ratio: f64) -> (i64, i64) {
    let width = (target_area * ratio).sqrt();
    let height = width / ratio;
    let snap = |x: f64| ((x / 32.0).round_ties_even() * 32.0) as i64;
    (snap(width), snap(height))
}

/// The pipeline's first resize of a condition image: Pillow LANCZOS to
/// `calculate_dimensions(condition_image_size, w / h)`. An image that would become empty is an
/// error.
pub fn condition_resize(
    image: &RgbImage,
    config: &ImageProcessorConfig,
) -> Result<RgbImage, GenerateError> {
    let (w, h) = image.dimensions();
    if w == 0 || h == 0 {
        return Err(GenerateError::InvalidRequest(format!(
            "condition image is {w}x{h}"
        )));
    }
    let (cw, ch) = calculate_dimensions(
        config.condition_image_size as f64,
        f64::from(w) / f64::from(h),
    );
    if cw <= 0 || ch <= 0 || cw > i64::from(u32::MAX) || ch > i64::from(u32::MAX) {
        return Err(GenerateError::InvalidRequest(format!(
            "condition image {w}x{h} resizes to {cw}x{ch} at area {}",
            config.condition_image_size
        )));
    }
    pil_resize(image, cw as u32, ch as u32, Filter::Lanczos)
}

/// `PIL.Image.resize`: a copy when the size is unchanged, else the Pillow-exact resample.
fn pil_resize(image: &RgbImage, w: u32, h: u32, filter: Filter) -> Result<RgbImage, GenerateError> {
    if image.dimensions() == (w, h) {
        Ok(image.clone())
    } else {
        resize(image, w, h, filter).map_err(|e| GenerateError::InvalidRequest(e.to_string()))
    }
}

/// transformers' `smart_resize`: `(height, width)` multiples of `factor`, close to the input's
/// aspect, with the pixel count within `[min_pixels, max_pixels]` (rounding half to even like
/// Python's `round`). An aspect ratio above 200 is an error, as in the reference.
pub fn smart_resize(
    height: i64,
    width: i64,
    factor: i64,
    min_pixels: i64,
    max_pixels: i64,
) -> Result<(i64, i64), GenerateError> {
    if height <= 0 || width <= 0 || factor <= 0 {
        return Err(GenerateError::InvalidRequest(format!(
            "image {width}x{height} cannot be resized to multiples of {factor}"
        )));
    }
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let aspect = hf.max(wf) / hf.min(wf);
    if aspect > 200.0 {
        return Err(GenerateError::InvalidRequest(format!(
            "absolute aspect ratio must be smaller than 200, got {aspect}"
        )));
    }
    let mut h_bar = (hf / ff).round_ties_even() as i64 * factor;
    let mut w_bar = (wf / ff).round_ties_even() as i64 * factor;
    if h_bar * w_bar > max_pixels {
        let beta = (hf * wf / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as i64 * factor);
        w_bar = factor.max((wf / beta / ff).floor() as i64 * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h_bar = (hf * beta / ff).ceil() as i64 * factor;
        w_bar = (wf * beta / ff).ceil() as i64 * factor;
    }
    Ok((h_bar, w_bar))
}

/// The image processor's output for a set of images.
#[derive(Debug)]
pub struct ProcessedImages {
    /// `[N, 3 · T · P · P]` fp32 on the CPU: every image's patches, images in order.
    pub pixel_values: Tensor,
    /// `(t, h, w)` in patches per image (`image_grid_thw`); `t` is 1 for still images.
    pub grid_thw: Vec<(i64, i64, i64)>,
}

impl ProcessedImages {
    /// `<|image_pad|>` tokens of image `i`: `t · h · w / merge²`.
    pub fn tokens_per_image(&self, merge_size: i64) -> Vec<i64> {
        self.grid_thw
            .iter()
            .map(|&(t, h, w)| t * h * w / (merge_size * merge_size))
            .collect()
    }
}

/// `Qwen2VLImageProcessorPil` on already-RGB images (the pipeline's condition images, after
/// [`condition_resize`]).
pub fn preprocess(
    images: &[RgbImage],
    config: &ImageProcessorConfig,
) -> Result<ProcessedImages, GenerateError> {
    config.validate().map_err(GenerateError::InvalidRequest)?;
    let (p, t, m) = (
        config.patch_size as usize,
        config.temporal_patch_size as usize,
        config.merge_size as usize,
    );
    let dim = config.patch_dim() as usize;
    let mean = config.image_mean.map(|x| x as f32);
    let std = config.image_std.map(|x| x as f32);
    let mut values: Vec<f32> = Vec::new();
    let mut grid_thw = Vec::with_capacity(images.len());
    for image in images {
        let (w0, h0) = image.dimensions();
        let (h, w) = smart_resize(
            i64::from(h0),
            i64::from(w0),
            config.factor(),
            config.min_pixels,
            config.max_pixels,
        )?;
        let (gh, gw) = (h / config.patch_size, w / config.patch_size);
        let patches = gh
            .checked_mul(gw)
            .filter(|&n| {
                n <= i64::from(i32::MAX) && u32::try_from(h).is_ok() && u32::try_from(w).is_ok()
            })
            .ok_or_else(|| {
                GenerateError::InvalidRequest(format!(
                    "image {w0}x{h0} resizes to {w}x{h}: too large"
                ))
            })?;
        let resized = pil_resize(image, w as u32, h as u32, Filter::Bicubic)?;
        // Rescale (f64 multiply, cast to f32) then normalise (f32), channel-first.
        let (hu, wu) = (h as usize, w as usize);
        let mut chw = vec![0f32; 3 * hu * wu];
        for (x, y, px) in resized.enumerate_pixels() {
            for c in 0..3 {
                let v = (f64::from(px.0[c]) * config.rescale_factor) as f32;
                chw[(c * hu + y as usize) * wu + x as usize] = (v - mean[c]) / std[c];
            }
        }
        // Patchify: rows (block row, block col, row in block, col in block), columns
        // (channel, frame, pixel row, pixel col); every frame is the same image.
        let start = values.len();
        values.resize(start + patches as usize * dim, 0.0);
        let out = &mut values[start..];
        let (bh, bw) = (gh as usize / m, gw as usize / m);
        let mut row = 0usize;
        for by in 0..bh {
            for bx in 0..bw {
                for my in 0..m {
                    for mx in 0..m {
                        let (py, px) = ((by * m + my) * p, (bx * m + mx) * p);
                        let dst = &mut out[row * dim..(row + 1) * dim];
                        let mut k = 0;
                        for c in 0..3 {
                            for _ in 0..t {
                                for iy in 0..p {
                                    let src = (c * hu + py + iy) * wu + px;
                                    dst[k..k + p].copy_from_slice(&chw[src..src + p]);
                                    k += p;
                                }
                            }
                        }
                        row += 1;
                    }
                }
            }
        }
        grid_thw.push((1, gh, gw));
    }
    let n = (values.len() / dim.max(1)) as i64;
    Ok(ProcessedImages {
        pixel_values: Tensor::from_slice(&values).reshape([n, dim as i64]),
        grid_thw,
    })
}
