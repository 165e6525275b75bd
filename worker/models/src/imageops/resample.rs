//! Pillow-exact resizing of 8-bit RGB images: `PIL.Image.resize(size, filter)` with the default
//! `box` and `reducing_gap=None`, giving the same bytes as Pillow.
//!
//! Ported from Pillow 13.0.0 `src/libImaging/Resample.c` (`ImagingResample`, the separable
//! convolution) and, for `Filter::Nearest`, `src/libImaging/Geometry.c` (`ImagingScaleAffine`, which
//! `Image.resize` uses for NEAREST) and `src/_imaging.c` (`_resize`). Pillow is
//! Copyright © 1997-2011 by Secret Labs AB, © 1995-2011 by Fredrik Lundh and contributors, © 2010 by
//! Jeffrey A. Clark and contributors, under the HPND (MIT-CMU) licence.
//!
//! What is reproduced exactly, because each of them changes output bytes:
//! - filter kernels evaluated in `f64` with Pillow's operation order; the support widened by the
//!   scale when downsampling; window bounds rounded by truncation as in C; weights divided by their
//!   sum;
//! - the 8-bit fixed-point path: weights scaled by `2^PRECISION_BITS` (22) and rounded half away from
//!   zero, the accumulator seeded with one half, the result shifted and clipped to 0..=255;
//! - the pass order (horizontal first, unless the height shrinks by more than twice what the width
//!   shrinks, then vertical first), each pass rounding to 8 bits, and a pass skipped when its side
//!   keeps its size (same size: a plain copy).
//!
//! Each pass computes its output rows on rayon's pool (every output sample depends on the input
//! alone, so the bytes do not depend on the split): a 1024² → 384² Lanczos is one of an edit's
//! host steps before its first GPU work.
//!
//! The accumulator is `i64` where Pillow uses `int`: for normalised weights the C sum never leaves
//! the `int` range, so the results agree, and nothing here can overflow on any input.
//!
//! Parity: `tests/parity/resample.rs` checks byte identity against Pillow on the cases written by
//! `fixtures/resample/make_resample_fixtures.py`.

use image::RgbImage;
use rayon::prelude::*;

/// Resampling filter, named as in `PIL.Image.Resampling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Pillow's NEAREST: the source pixel under each target pixel's centre.
    Nearest,
    /// Triangle kernel, support 1.
    Bilinear,
    /// Keys cubic with `a = -0.5`, support 2 (also what the Qwen2-VL image processor uses).
    Bicubic,
    /// `sinc(x) * sinc(x / 3)`, support 3 (diffusers' `VaeImageProcessor.resize`).
    Lanczos,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    /// Pillow raises `ValueError("height and width must be > 0")`.
    #[error("cannot resize to {width}x{height}: width and height must be > 0")]
    EmptyTarget { width: u32, height: u32 },
    /// Pillow would fill the target with black; that is never what a caller wants.
    #[error("cannot resize an empty {width}x{height} image")]
    EmptySource { width: u32, height: u32 },
}

/// Fixed-point fraction bits: 8 bits of result, 2 bits of headroom for kernels with negative lobes
/// (sums of partial products above 1 or below 0), in a 32-bit accumulator.
const PRECISION_BITS: u32 = 32 - 8 - 2;

impl Filter {
    /// Half-width of the kernel at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Nearest => 0.0,
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Nearest => 0.0,
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 { 1.0 - x } else { 0.0 }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

/// Resizes `img` to `width`x`height` exactly as Pillow's `Image.resize((width, height), filter)`.
///
/// Zero-sized targets and empty sources are errors (Pillow rejects the first and blackens the
/// second). Memory is the caller's to bound: the output holds `3 * width * height` bytes.
pub fn resize(
    img: &RgbImage,
    width: u32,
    height: u32,
    filter: Filter,
) -> Result<RgbImage, ResizeError> {
    if width == 0 || height == 0 {
        return Err(ResizeError::EmptyTarget { width, height });
    }
    let (in_w, in_h) = img.dimensions();
    if in_w == 0 || in_h == 0 {
        return Err(ResizeError::EmptySource {
            width: in_w,
            height: in_h,
        });
    }
    if (in_w, in_h) == (width, height) {
        return Ok(img.clone());
    }
    let plane = Plane::from_image(img);
    let out = match filter {
        Filter::Nearest => nearest(&plane, width as usize, height as usize),
        Filter::Bilinear | Filter::Bicubic | Filter::Lanczos => {
            convolve(plane, width as usize, height as usize, filter)
        }
    };
    Ok(out.into_image())
}

/// A row-major 3-channel 8-bit image with `usize` sides (no widening casts in the loops).
struct Plane {
    width: usize,
    height: usize,
    data: Vec<u8>,
}

impl Plane {
    fn from_image(img: &RgbImage) -> Self {
        Plane {
            width: img.width() as usize,
            height: img.height() as usize,
            data: img.as_raw().clone(),
        }
    }

    fn zeroed(width: usize, height: usize) -> Self {
        Plane {
            width,
            height,
            data: vec![0; width * height * 3],
        }
    }

    fn into_image(self) -> RgbImage {
        let (w, h) = (self.width as u32, self.height as u32);
        RgbImage::from_raw(w, h, self.data)
            .expect("invariant: data holds width * height * 3 bytes and both sides came from u32")
    }

    fn row(&self, y: usize) -> &[u8] {
        &self.data[y * self.width * 3..(y + 1) * self.width * 3]
    }
}

/// `ImagingScaleAffine` for a pure scale: source positions accumulated in `f64` from the first
/// pixel centre, truncated; a position that lands outside the source leaves the pixel black (the
/// `fill` Pillow passes), which accumulated rounding could in principle cause at the far edge.
fn nearest(src: &Plane, width: usize, height: usize) -> Plane {
    let ax = src.width as f64 / width as f64;
    let ay = src.height as f64 / height as f64;
    let coord = |v: f64| if v < 0.0 { None } else { Some(v as usize) };
    let mut xo = ax * 0.5;
    let mut xs = Vec::with_capacity(width);
    for _ in 0..width {
        xs.push(coord(xo).filter(|&x| x < src.width));
        xo += ax;
    }
    let mut out = Plane::zeroed(width, height);
    let mut yo = ay * 0.5;
    for y in 0..height {
        if let Some(yi) = coord(yo).filter(|&yi| yi < src.height) {
            let row_in = src.row(yi);
            let row_out = &mut out.data[y * width * 3..(y + 1) * width * 3];
            for (px, xi) in row_out.chunks_exact_mut(3).zip(&xs) {
                if let Some(xi) = xi {
                    px.copy_from_slice(&row_in[xi * 3..xi * 3 + 3]);
                }
            }
        }
        yo += ay;
    }
    out
}

/// Fixed-point weights of one output line's window: the input samples `start..start + weights.len()`.
struct Window {
    start: usize,
    weights: Vec<i32>,
}

/// `precompute_coeffs` followed by `normalize_coeffs_8bpc`, for resizing a side of `in_size` samples
/// to `out_size`.
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Vec<Window> {
    // Pillow computes `in1 - in0` of the box in `float`; for the whole image that is `in_size`.
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let inv_filterscale = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; the clamps follow.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let taps: Vec<f64> = (xmin..xmax)
                .map(|x| filter.weight((x as f64 - center + 0.5) * inv_filterscale))
                .collect();
            let sum: f64 = taps.iter().sum();
            let weights = taps
                .into_iter()
                .map(|w| if sum != 0.0 { w / sum } else { w })
                .map(|w| {
                    let scaled = w * f64::from(1u32 << PRECISION_BITS);
                    if w < 0.0 {
                        (-0.5 + scaled) as i32
                    } else {
                        (0.5 + scaled) as i32
                    }
                })
                .collect();
            Window {
                // xmin >= 0 by the clamp above.
                start: xmin as usize,
                weights,
            }
        })
        .collect()
}

/// Rounds a fixed-point sum (seeded with one half) to 8 bits, clipping as Pillow's `clip8` table.
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const HALF: i64 = 1 << (PRECISION_BITS - 1);

/// `ImagingResampleInner` with the 8-bit passes.
fn convolve(src: Plane, width: usize, height: usize, filter: Filter) -> Plane {
    let need_horizontal = width != src.width;
    let need_vertical = height != src.height;
    // Pillow: vertical first when the height shrinks by more than twice as many pixels as the width.
    let shrink_h = src.height as i64 - height as i64;
    let shrink_w = src.width as i64 - width as i64;
    let horizontal_first = !(shrink_h > 0 && shrink_h > shrink_w * 2);

    let mut vertical = need_vertical.then(|| coefficients(src.height, height, filter));
    let horizontal = need_horizontal.then(|| coefficients(src.width, width, filter));

    let mut img = src;
    if horizontal_first {
        if let Some(windows) = &horizontal {
            // Only the rows the vertical pass reads; its windows are shifted to match.
            let (first, last) = match &mut vertical {
                Some(v) => {
                    let first = v[0].start;
                    let last = v.last().map_or(img.height, |w| w.start + w.weights.len());
                    for w in v.iter_mut() {
                        w.start -= first;
                    }
                    (first, last)
                }
                None => (0, img.height),
            };
            img = horizontal_pass(&img, first..last, windows);
        }
        if let Some(windows) = &vertical {
            img = vertical_pass(&img, windows);
        }
    } else {
        if let Some(windows) = &vertical {
            img = vertical_pass(&img, windows);
        }
        if let Some(windows) = &horizontal {
            img = horizontal_pass(&img, 0..img.height, windows);
        }
    }
    img
}

fn horizontal_pass(src: &Plane, rows: std::ops::Range<usize>, windows: &[Window]) -> Plane {
    let mut out = Plane::zeroed(windows.len(), rows.len());
    let out_stride = windows.len() * 3;
    out.data
        .par_chunks_exact_mut(out_stride)
        .zip(rows.into_par_iter())
        .for_each(|(row_out, y_in)| {
            let row_in = src.row(y_in);
            for (px, win) in row_out.chunks_exact_mut(3).zip(windows) {
                let mut acc = [HALF; 3];
                let taps = &row_in[win.start * 3..(win.start + win.weights.len()) * 3];
                for (sample, &k) in taps.chunks_exact(3).zip(&win.weights) {
                    for c in 0..3 {
                        acc[c] += i64::from(sample[c]) * i64::from(k);
                    }
                }
                for c in 0..3 {
                    px[c] = clip8(acc[c]);
                }
            }
        });
    out
}

fn vertical_pass(src: &Plane, windows: &[Window]) -> Plane {
    let mut out = Plane::zeroed(src.width, windows.len());
    let stride = src.width * 3;
    out.data
        .par_chunks_exact_mut(stride)
        .zip(windows.par_iter())
        .for_each(|(row_out, win)| {
            for (i, value) in row_out.iter_mut().enumerate() {
                let mut acc = HALF;
                for (dy, &k) in win.weights.iter().enumerate() {
                    acc += i64::from(src.data[(win.start + dy) * stride + i]) * i64::from(k);
                }
                *value = clip8(acc);
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_targets_and_sources_are_errors() {
        let img = RgbImage::new(4, 4);
        assert_eq!(
            resize(&img, 0, 3, Filter::Lanczos),
            Err(ResizeError::EmptyTarget {
                width: 0,
                height: 3
            })
        );
        assert_eq!(
            resize(&RgbImage::new(0, 5), 3, 3, Filter::Bicubic),
            Err(ResizeError::EmptySource {
                width: 0,
                height: 5
            })
        );
    }

    #[test]
    fn a_flat_image_stays_flat_at_any_size() {
        let img = RgbImage::from_pixel(7, 5, image::Rgb([12, 200, 255]));
        for filter in [
            Filter::Nearest,
            Filter::Bilinear,
            Filter::Bicubic,
            Filter::Lanczos,
        ] {
            for (w, h) in [(1, 1), (3, 40), (64, 2), (7, 9)] {
                let out = resize(&img, w, h, filter).unwrap();
                assert_eq!(out.dimensions(), (w, h));
                assert!(
                    out.pixels().all(|p| p.0 == [12, 200, 255]),
                    "{filter:?} {w}x{h}"
                );
            }
        }
    }
}
