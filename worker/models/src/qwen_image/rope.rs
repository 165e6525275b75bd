//! QwenImage's 3-D rotary position embedding (`QwenEmbedRope` with `scale_rope=True`): the angle
//! tables for the image tokens (frame, height, width) and the text tokens, cached per
//! `(img_shapes, text length)`.
//!
//! Ported from diffusers 0.42.1 `models/transformers/transformer_qwenimage.py` (`QwenEmbedRope`,
//! Apache-2.0, Copyright 2025 Qwen-Image Team, The HuggingFace Team).
//!
//! Positions, as the reference:
//! - the head dimension is split into `axes_dims` (frame, height, width), each axis rotating
//!   `axes_dims[i] / 2` interleaved pairs with frequencies `1 / theta^(2k / axes_dims[i])`;
//! - image `idx` of `img_shapes` (the target is 0, references follow) has frame positions
//!   `idx .. idx + frames`, and centred height/width positions `-(h - h/2) .. h/2 - 1`;
//! - every text token has the same position `p` on all three axes, `p` running from
//!   `max over images of max(h/2, w/2)` for the whole padded text length (the prompt mask does not
//!   move positions).
//!
//! The reference reads its angles from a 4096-row table; positions here are computed directly, so
//! they equal the reference wherever it is defined (every position below 4096) and continue the
//! same formula beyond.

use std::collections::HashMap;
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

/// One image of a packed sequence: `(frames, height, width)` in patches (latent size / patch).
pub type ImageShape = (i64, i64, i64);

/// The cos/sin tables of one forward pass, fp32, `[tokens, head_dim / 2]`.
#[derive(Debug)]
pub struct RopeTables {
    pub img_cos: Tensor,
    pub img_sin: Tensor,
    pub txt_cos: Tensor,
    pub txt_sin: Tensor,
    /// `cos + i·sin` (complex64), what the attention multiplies by.
    pub img_cis: Tensor,
    pub txt_cis: Tensor,
}

impl RopeTables {
    /// The same tables (shared storage, no copy).
    pub fn shallow_clone(&self) -> Self {
        Self {
            img_cos: self.img_cos.shallow_clone(),
            img_sin: self.img_sin.shallow_clone(),
            txt_cos: self.txt_cos.shallow_clone(),
            txt_sin: self.txt_sin.shallow_clone(),
            img_cis: self.img_cis.shallow_clone(),
            txt_cis: self.txt_cis.shallow_clone(),
        }
    }
}

/// What the tables depend on: the image shapes and the (padded) text length.
type RopeKey = (Vec<ImageShape>, i64);

/// Cached tables of this many `(img_shapes, text length)` keys at most; the cache is emptied when
/// it is full (a render uses one key for all its steps).
const CACHE_LIMIT: usize = 32;

/// `QwenEmbedRope(theta, axes_dim, scale_rope=True)` on one device.
#[derive(Debug)]
pub struct QwenEmbedRope {
    theta: f64,
    axes_dims: [i64; 3],
    device: Device,
    cache: Mutex<HashMap<RopeKey, RopeTables>>,
}

impl QwenEmbedRope {
    /// `axes_dims` must be even (checked by the transformer config).
    pub fn new(theta: f64, axes_dims: [i64; 3], device: Device) -> Self {
        Self {
            theta,
            axes_dims,
            device,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The device the tables are made on (the model's).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The tables for `img_shapes` (all positive, checked by the caller) and `txt_len` text tokens,
    /// from the cache (sharing its storage) when this key was seen before.
    pub fn tables(&self, img_shapes: &[ImageShape], txt_len: i64) -> RopeTables {
        let key = (img_shapes.to_vec(), txt_len);
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = cache.get(&key) {
            return t.shallow_clone();
        }
        let tables = self.compute(img_shapes, txt_len);
        if cache.len() >= CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(key, tables.shallow_clone());
        tables
    }

    /// `rope_params`: angles `pos ⊗ 1/theta^(arange(0, dim, 2)/dim)`, `[n, dim/2]` fp32.
    fn angles(&self, positions: &Tensor, dim: i64) -> Tensor {
        let exponent =
            Tensor::arange_start_step(0, dim, 2, (Kind::Float, self.device)) / dim as f64;
        let inv_freq = Tensor::pow_scalar(self.theta, &exponent).reciprocal();
        positions.to_kind(Kind::Float).outer(&inv_freq)
    }

    /// Centred positions `[-(n - n/2), …, -1, 0, …, n/2 - 1]` (`scale_rope=True`).
    fn centred(&self, n: i64) -> Tensor {
        Tensor::arange(n, (Kind::Int64, self.device)) - (n - n / 2)
    }

    /// `_compute_video_freqs(frame, height, width, idx)` as angles `[f*h*w, head_dim/2]`.
    fn video_angles(&self, (frames, height, width): ImageShape, idx: i64) -> Tensor {
        let [d_f, d_h, d_w] = self.axes_dims;
        let f = self
            .angles(
                &Tensor::arange_start(idx, idx + frames, (Kind::Int64, self.device)),
                d_f,
            )
            .view([frames, 1, 1, -1])
            .expand([frames, height, width, d_f / 2], false);
        let h = self
            .angles(&self.centred(height), d_h)
            .view([1, height, 1, -1])
            .expand([frames, height, width, d_h / 2], false);
        let w = self
            .angles(&self.centred(width), d_w)
            .view([1, 1, width, -1])
            .expand([frames, height, width, d_w / 2], false);
        Tensor::cat(&[f, h, w], -1).reshape([frames * height * width, -1])
    }

    fn compute(&self, img_shapes: &[ImageShape], txt_len: i64) -> RopeTables {
        let img: Vec<Tensor> = img_shapes
            .iter()
            .enumerate()
            .map(|(idx, &shape)| self.video_angles(shape, idx as i64))
            .collect();
        let img = Tensor::cat(&img, 0);
        let max_vid_index = img_shapes
            .iter()
            .map(|&(_, h, w)| (h / 2).max(w / 2))
            .max()
            .unwrap_or(0)
            .max(0);
        let positions = Tensor::arange_start(
            max_vid_index,
            max_vid_index + txt_len,
            (Kind::Int64, self.device),
        );
        let txt = Tensor::cat(&self.axes_dims.map(|d| self.angles(&positions, d)), -1);
        let (img_cos, img_sin, txt_cos, txt_sin) = (img.cos(), img.sin(), txt.cos(), txt.sin());
        RopeTables {
            img_cis: Tensor::complex(&img_cos, &img_sin),
            txt_cis: Tensor::complex(&txt_cos, &txt_sin),
            img_cos,
            img_sin,
            txt_cos,
            txt_sin,
        }
    }
}
