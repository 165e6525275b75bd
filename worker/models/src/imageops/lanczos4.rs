//! OpenCV's `cv2.resize(img, (w, h), interpolation=cv2.INTER_LANCZOS4)` for interleaved 8-bit
//! and 16-bit images of any channel count: what Real-ESRGAN's `enhance` applies when the requested
//! outscale differs from the network's (×2 from a ×4 model).
//!
//! Written from OpenCV's `imgproc/src/resize.cpp` (Apache-2.0): pixel-centre mapping
//! `fx = (float)((dx + 0.5) · sw/dw − 0.5)`, 8 taps at `floor(fx) − 3 …` with edge pixels
//! replicated, coefficients from `interpolateLanczos4` (windowed sinc, normalised to sum 1). 8-bit
//! images are filtered in fixed point (coefficients × 2048 rounded to `short`, horizontal sums in
//! `int`, vertical sums rounded off by 22 bits and saturated); 16-bit images in `float`, rounded to
//! nearest (ties to even) and saturated. No antialiasing when shrinking, as in OpenCV.
//!
//! Output rows are computed in bands of [`BAND`] rows on rayon's pool, each band with its own cache
//! of horizontally filtered source rows (a band recomputes the few rows it shares with the one
//! above): the bytes do not depend on the split, and memory stays at a few rows per thread. A
//! ×4 network's 4096² output resampled to 2048² is one of an upscale's host steps.

use rayon::prelude::*;

/// Output rows per parallel band.
const BAND: usize = 32;

/// `interpolateLanczos4`: the 8 tap weights for fractional position `x` in [0, 1).
fn lanczos4_coeffs(x: f32) -> [f32; 8] {
    const S45: f64 = std::f64::consts::FRAC_1_SQRT_2;
    const CS: [[f64; 2]; 8] = [
        [1.0, 0.0],
        [-S45, -S45],
        [0.0, 1.0],
        [S45, -S45],
        [-1.0, 0.0],
        [S45, S45],
        [0.0, -1.0],
        [-S45, S45],
    ];
    let mut c = [0f32; 8];
    let y0 = -f64::from(x + 3.0) * std::f64::consts::PI * 0.25;
    let (s0, c0) = (y0.sin(), y0.cos());
    let mut sum = 0f32;
    for (i, coeff) in c.iter_mut().enumerate() {
        let y0_ = x + 3.0 - i as f32;
        *coeff = if y0_.abs() >= 1e-6 {
            let y = -f64::from(y0_) * std::f64::consts::PI * 0.25;
            ((CS[i][0] * s0 + CS[i][1] * c0) / (y * y)) as f32
        } else {
            // The centre tap at an integer position: after normalisation, 1 there and ~0 elsewhere.
            1e30
        };
        sum += *coeff;
    }
    let inv = 1.0 / sum;
    for coeff in &mut c {
        *coeff *= inv;
    }
    c
}

/// Per output index along one axis: the first source index of the 8 taps (unclamped) and their
/// weights.
fn taps(src: usize, dst: usize) -> Vec<(i64, [f32; 8])> {
    let inv_scale = dst as f64 / src as f64;
    let scale = 1.0 / inv_scale;
    (0..dst)
        .map(|d| {
            let f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let s = f.floor();
            (s as i64 - 3, lanczos4_coeffs(f - s))
        })
        .collect()
}

fn clamp_index(i: i64, n: usize) -> usize {
    i.clamp(0, n as i64 - 1) as usize
}

/// An interleaved image: `width × height` pixels of `channels` samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
}

/// Source rows filtered horizontally, computed once each and kept while later output rows may
/// need them (the tap windows only move down), so memory stays at a few rows.
struct RowCache<T, F: FnMut(usize) -> Vec<T>> {
    rows: std::collections::VecDeque<(usize, Vec<T>)>,
    make: F,
}

impl<T, F: FnMut(usize) -> Vec<T>> RowCache<T, F> {
    /// The 8 rows of a tap window starting at `s0`, clamped into `0..height`.
    fn window(&mut self, s0: i64, height: usize) -> [&Vec<T>; 8] {
        let first = clamp_index(s0, height);
        while self.rows.front().is_some_and(|(i, _)| *i < first) {
            self.rows.pop_front();
        }
        for k in 0..8 {
            let i = clamp_index(s0 + k, height);
            if !self.rows.iter().any(|(j, _)| *j == i) {
                let row = (self.make)(i);
                self.rows.push_back((i, row));
            }
        }
        std::array::from_fn(|k| {
            let i = clamp_index(s0 + k as i64, height);
            &self
                .rows
                .iter()
                .find(|(j, _)| *j == i)
                .expect("filled above")
                .1
        })
    }
}

/// The vertical pass: output row `dy` of `stride` samples filled by `fill(rows, weights, row)` from
/// the 8 horizontally filtered source rows (`horizontal`) of its tap window `yt[dy]`; computed in
/// bands of [`BAND`] rows on rayon's pool, each band with its own row cache.
fn vertical_bands<T, W, O>(
    yt: &[(i64, [W; 8])],
    from_height: usize,
    stride: usize,
    horizontal: impl Fn(usize) -> Vec<T> + Copy + Sync,
    fill: impl Fn([&Vec<T>; 8], &[W; 8], &mut [O]) + Sync,
) -> Vec<O>
where
    W: Sync,
    O: Copy + Default + Send,
{
    let mut dst = vec![O::default(); stride * yt.len()];
    if stride == 0 {
        return dst;
    }
    dst.par_chunks_mut(BAND * stride)
        .zip(yt.par_chunks(BAND))
        .for_each(|(band, taps)| {
            let mut cache = RowCache {
                rows: Default::default(),
                make: horizontal,
            };
            for (out, (s0, b)) in band.chunks_mut(stride).zip(taps) {
                fill(cache.window(*s0, from_height), b, out);
            }
        });
    dst
}

/// `cv2.resize(..., INTER_LANCZOS4)` of 8-bit samples (OpenCV's fixed-point path).
pub fn resize_u8(src: &[u8], from: Layout, width: usize, height: usize) -> Vec<u8> {
    assert_eq!(
        src.len(),
        from.width * from.height * from.channels,
        "buffer matches layout"
    );
    let cn = from.channels;
    let fixed = |c: f32| -> i32 {
        // saturate_cast<short>(c * INTER_RESIZE_COEF_SCALE): cvRound, ties to even.
        (c * 2048.0).round_ties_even().clamp(-32768.0, 32767.0) as i32
    };
    let xt: Vec<(i64, [i32; 8])> = taps(from.width, width)
        .into_iter()
        .map(|(s, c)| (s, c.map(fixed)))
        .collect();
    let yt: Vec<(i64, [i32; 8])> = taps(from.height, height)
        .into_iter()
        .map(|(s, c)| (s, c.map(fixed)))
        .collect();
    let horizontal = |y: usize| {
        let row = &src[y * from.width * cn..(y + 1) * from.width * cn];
        let mut out = vec![0i32; width * cn];
        for (dx, (s0, a)) in xt.iter().enumerate() {
            for c in 0..cn {
                let mut v = 0i32;
                for (j, w) in a.iter().enumerate() {
                    v += i32::from(row[clamp_index(s0 + j as i64, from.width) * cn + c]) * w;
                }
                out[dx * cn + c] = v;
            }
        }
        out
    };
    vertical_bands(&yt, from.height, width * cn, horizontal, |srcs, b, out| {
        for (x, o) in out.iter_mut().enumerate() {
            let mut s = 0i32;
            for k in 0..8 {
                s = s.wrapping_add(srcs[k][x].wrapping_mul(b[k]));
            }
            // FixedPtCast<int, uchar, 22>: (s + 2^21) >> 22, saturated.
            *o = (s.wrapping_add(1 << 21) >> 22).clamp(0, 255) as u8;
        }
    })
}

/// `cv2.resize(..., INTER_LANCZOS4)` of 16-bit samples (OpenCV's float path).
pub fn resize_u16(src: &[u16], from: Layout, width: usize, height: usize) -> Vec<u16> {
    assert_eq!(
        src.len(),
        from.width * from.height * from.channels,
        "buffer matches layout"
    );
    let cn = from.channels;
    let xt = taps(from.width, width);
    let yt = taps(from.height, height);
    let horizontal = |y: usize| {
        let row = &src[y * from.width * cn..(y + 1) * from.width * cn];
        let mut out = vec![0f32; width * cn];
        for (dx, (s0, a)) in xt.iter().enumerate() {
            for c in 0..cn {
                let mut v = 0f32;
                for (j, w) in a.iter().enumerate() {
                    v += f32::from(row[clamp_index(s0 + j as i64, from.width) * cn + c]) * w;
                }
                out[dx * cn + c] = v;
            }
        }
        out
    };
    vertical_bands(&yt, from.height, width * cn, horizontal, |srcs, b, out| {
        for (x, o) in out.iter_mut().enumerate() {
            let mut s = 0f32;
            for k in 0..8 {
                s += srcs[k][x] * b[k];
            }
            *o = s.round_ties_even().clamp(0.0, 65535.0) as u16;
        }
    })
}
