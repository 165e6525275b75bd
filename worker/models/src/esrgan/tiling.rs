//! Tiled inference of an image-to-image network with an integer scale, on the grid of
//! Real-ESRGAN's `RealESRGANer.tile_process`: tile cores of `tile` pixels from the top-left corner
//! (the last row and column smaller), each run with `overlap` pixels of context on every side
//! that lies inside the image.
//!
//! Merging ([`Blend`]): `Crop` keeps each tile's core, exactly as `tile_process` does (a hard cut
//! where neighbouring cores meet). `Feather` (the default) cross-fades two neighbours linearly
//! over `overlap` pixels centred on that cut: at output pixel centres `c` within
//! `[B − overlap·s/2, B + overlap·s/2)` around the boundary `B`, the right (lower) tile weighs
//! `(c − P) / (Q − P)` and the left (upper) one the rest, the weights of a pixel sum to exactly
//! what one tile gives alone, and each tile's outermost `overlap/2` pixels of context (computed
//! with the least context themselves) are never used. With `overlap` 0 both are a plain cut.
//!
//! Invariants:
//! - every output pixel is written by one tile (`Crop`) or by weights summing to 1 (`Feather`,
//!   which needs `2·overlap ≤ tile` so that only neighbours meet);
//! - device memory is bounded by one row of tiles: the output is assembled one tile row at a time
//!   in an fp32 strip (`rows of that tile row × output width`), and each strip is handed to the
//!   caller's sink as soon as no later tile can touch it; rows shared with the next tile row
//!   (feathering) are carried over;
//! - tiles of one row with the same input shape run together, at most `max_batch` per forward;
//!   cancellation is checked before every forward, progress reported after each.

use tch::{Kind, Tensor};

use crate::error::GenerateError;

/// How neighbouring tiles are merged (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Blend {
    /// Real-ESRGAN's `tile_process`: each tile contributes its core, neighbours meet at a cut.
    Crop,
    /// Linear cross-fade over `overlap` pixels centred on the cut.
    #[default]
    Feather,
}

/// How an image is split for the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSettings {
    /// Side of a tile's core in input pixels; `None` runs the whole image in one forward.
    pub tile: Option<i64>,
    /// Context on each side of a core, in input pixels (Real-ESRGAN's `tile_pad`).
    pub overlap: i64,
    pub blend: Blend,
    /// Tiles per forward (tiles of one row with the same shape are batched).
    pub max_batch: usize,
}

impl TileSettings {
    /// The whole image in one forward.
    pub fn whole() -> Self {
        Self {
            tile: None,
            overlap: 0,
            blend: Blend::Crop,
            max_batch: 1,
        }
    }

    /// Checks the settings, naming what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(tile) = self.tile {
            if tile < 1 {
                return Err(format!("tile must be at least 1, got {tile}"));
            }
            if self.overlap < 0 || 2 * self.overlap > tile {
                return Err(format!(
                    "overlap {} must be between 0 and half the tile ({tile})",
                    self.overlap
                ));
            }
        }
        if self.max_batch == 0 {
            return Err("max_batch must be at least 1".into());
        }
        Ok(())
    }

    /// These settings with the tile a multiple of `align` (rounded down, at least `align`) and
    /// the overlap one too (rounded up): a network that pixel-unshuffles its input by `align`
    /// needs every tile's sides and offsets to be multiples of it.
    pub fn aligned(&self, align: i64) -> Self {
        let mut s = *self;
        if align > 1 {
            s.tile = self.tile.map(|t| (t - t % align).max(align));
            s.overlap = ceil_div(self.overlap, align) * align;
            if let Some(t) = s.tile {
                s.overlap = s.overlap.min(t / 2 / align * align);
            }
        }
        s
    }

    /// Number of tiles for an input of `h × w` (the progress total).
    pub fn count(&self, h: i64, w: i64) -> usize {
        match self.tile {
            None => 1,
            Some(t) => (ceil_div(h, t) * ceil_div(w, t)) as usize,
        }
    }

    /// The distinct input shapes `[h, w]` of the tiles of an `h × w` input.
    pub fn shapes(&self, h: i64, w: i64) -> Vec<[i64; 2]> {
        let ys = spans(h, self, 1);
        let xs = spans(w, self, 1);
        let mut shapes: Vec<[i64; 2]> = ys
            .iter()
            .flat_map(|y| {
                xs.iter()
                    .map(move |x| [y.input.1 - y.input.0, x.input.1 - x.input.0])
            })
            .collect();
        shapes.sort_unstable();
        shapes.dedup();
        shapes
    }
}

/// `⌈a / b⌉` for `a ≥ 0`, `b > 0` (`i64::div_ceil` is not stable).
pub(crate) fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// One tile along one axis.
#[derive(Debug, Clone)]
struct Span {
    /// Input range `[start, end)` fed to the network.
    input: (i64, i64),
    /// Output range `[start, end)` this tile contributes to (absolute output coordinates).
    output: (i64, i64),
    /// Weights over `output` (`Feather` with a neighbour); `None`: the tile's values are taken.
    weights: Option<Vec<f32>>,
}

/// The tiles along an axis of `len` input pixels at network scale `s`.
fn spans(len: i64, settings: &TileSettings, s: i64) -> Vec<Span> {
    let Some(tile) = settings.tile else {
        return vec![Span {
            input: (0, len),
            output: (0, len * s),
            weights: None,
        }];
    };
    let o = settings.overlap;
    let n = ceil_div(len, tile);
    (0..n)
        .map(|i| {
            let (a, b) = (i * tile, ((i + 1) * tile).min(len));
            let input = ((a - o).max(0), (b + o).min(len));
            if settings.blend == Blend::Crop || n == 1 {
                return Span {
                    input,
                    output: (a * s, b * s),
                    weights: None,
                };
            }
            // Weights at pixel centres over the tile's whole output, then trimmed to where > 0.
            let half = (o * s) as f64 / 2.0;
            let ramp = |boundary: i64, c: f64| -> f64 {
                let (p, q) = (
                    boundary as f64 - half,
                    (boundary as f64 + half).min((len * s) as f64),
                );
                if q > p {
                    ((c - p) / (q - p)).clamp(0.0, 1.0)
                } else if c >= boundary as f64 {
                    1.0
                } else {
                    0.0
                }
            };
            let w: Vec<f64> = (input.0 * s..input.1 * s)
                .map(|u| {
                    let c = u as f64 + 0.5;
                    let rising = if i > 0 { ramp(a * s, c) } else { 1.0 };
                    let falling = if i + 1 < n { 1.0 - ramp(b * s, c) } else { 1.0 };
                    rising * falling
                })
                .collect();
            let first = w.iter().position(|&v| v > 0.0).unwrap_or(0);
            let last = w.iter().rposition(|&v| v > 0.0).map_or(0, |p| p + 1);
            Span {
                input,
                output: (input.0 * s + first as i64, input.0 * s + last as i64),
                weights: Some(w[first..last].iter().map(|&v| v as f32).collect()),
            }
        })
        .collect()
}

/// Runs `forward` over `input` (`[B, C, H, W]` on the device, in the network's dtype) tile by
/// tile and hands the fp32 result to `sink` in horizontal strips, top to bottom: `sink(strip,
/// first_row)` with `strip` `[B, C', rows, W·scale]` on the device. Checks `cancel` before each
/// forward and calls `progress(done, total)` after each.
pub fn run_tiled(
    input: &Tensor,
    scale: i64,
    settings: &TileSettings,
    forward: &dyn Fn(&Tensor) -> Tensor,
    sink: &mut dyn FnMut(&Tensor, i64) -> Result<(), GenerateError>,
    progress: &mut dyn FnMut(usize, usize),
    cancel: &dyn Fn() -> bool,
) -> Result<(), GenerateError> {
    settings.validate().map_err(GenerateError::InvalidRequest)?;
    let (b, _, h, w) = input.size4()?;
    let device = input.device();
    let ys = spans(h, settings, scale);
    let xs = spans(w, settings, scale);
    let total = ys.len() * xs.len();
    let mut done = 0;
    let weights = |span: &Span, shape: [i64; 4]| -> Option<Tensor> {
        span.weights
            .as_ref()
            .map(|v| Tensor::from_slice(v).view(shape).to_device(device))
    };
    let x_weights: Vec<Option<Tensor>> = xs.iter().map(|x| weights(x, [1, 1, 1, -1])).collect();
    let mut carry: Option<Tensor> = None;
    for (i, y) in ys.iter().enumerate() {
        let y_weights = weights(y, [1, 1, -1, 1]);
        let rows = y.output.1 - y.output.0;
        let mut strip: Option<Tensor> = None;
        // Tiles of this row, grouped by input width (their heights are equal).
        let mut order: Vec<usize> = (0..xs.len()).collect();
        order.sort_by_key(|&j| (xs[j].input.1 - xs[j].input.0, j));
        for group in
            order.chunk_by(|&p, &q| xs[p].input.1 - xs[p].input.0 == xs[q].input.1 - xs[q].input.0)
        {
            for batch in group.chunks(settings.max_batch) {
                if cancel() {
                    return Err(GenerateError::Cancelled);
                }
                let tiles: Vec<Tensor> = batch
                    .iter()
                    .map(|&j| {
                        input.narrow(2, y.input.0, y.input.1 - y.input.0).narrow(
                            3,
                            xs[j].input.0,
                            xs[j].input.1 - xs[j].input.0,
                        )
                    })
                    .collect();
                let batched = if tiles.len() == 1 {
                    tiles[0].shallow_clone()
                } else {
                    Tensor::cat(&tiles, 0)
                };
                let out = forward(&batched);
                drop(batched);
                let channels = out.size()[1];
                let strip = strip.get_or_insert_with(|| {
                    let strip =
                        Tensor::zeros([b, channels, rows, w * scale], (Kind::Float, device));
                    // Rows carried over from the previous tile row (they start where this row's
                    // output starts) go in first, so each pixel sums its tiles in grid order.
                    if let Some(c) = carry.take() {
                        let mut top = strip.narrow(2, 0, c.size()[2]);
                        top.copy_(&c);
                    }
                    strip
                });
                for (t, &j) in batch.iter().enumerate() {
                    let x = &xs[j];
                    let mut o = out
                        .narrow(0, t as i64 * b, b)
                        .narrow(2, y.output.0 - y.input.0 * scale, rows)
                        .narrow(3, x.output.0 - x.input.0 * scale, x.output.1 - x.output.0)
                        .to_kind(Kind::Float);
                    let target =
                        strip
                            .narrow(2, 0, rows)
                            .narrow(3, x.output.0, x.output.1 - x.output.0);
                    match settings.blend {
                        Blend::Crop => {
                            let mut target = target;
                            target.copy_(&o);
                        }
                        Blend::Feather => {
                            if let Some(wy) = &y_weights {
                                let _ = o.g_mul_(wy);
                            }
                            if let Some(wx) = &x_weights[j] {
                                let _ = o.g_mul_(wx);
                            }
                            let mut target = target;
                            let _ = target.g_add_(&o);
                        }
                    }
                }
                done += batch.len();
                progress(done, total);
            }
        }
        let strip = strip.expect("every tile row has at least one tile");
        let next_start = ys.get(i + 1).map_or(y.output.1, |n| n.output.0);
        let finished = next_start - y.output.0;
        sink(&strip.narrow(2, 0, finished), y.output.0)?;
        if finished < rows {
            carry = Some(strip.narrow(2, finished, rows - finished).copy());
        }
    }
    Ok(())
}
