//! [`Upscaler`]: an RRDBNet kept on its device, upscaling images as Real-ESRGAN's
//! `RealESRGANer.enhance` does (`realesrgan/utils.py`, BSD-3-Clause), with vnfarm's tiling.
//!
//! What `enhance` does, and so what this does:
//! - samples scaled to [0, 1] by their bit depth (8 or 16 bits; Real-ESRGAN guesses the depth
//!   from the largest sample, this reads it from the decoder), cast to the compute dtype;
//! - reflect padding of `pre_pad` pixels at the bottom and right, then to a multiple of the
//!   pixel-unshuffle factor (×2 models: 2), both cut off the output again (replicate padding where
//!   the image is too small to reflect, where Python would fail);
//! - greyscale images run as RGB with the grey replicated, and come back grey as OpenCV's
//!   `BGR2GRAY` (`0.114·B + 0.587·G + 0.299·R`) of the output;
//! - an alpha channel runs through the network too (as RGB, `alpha_upsampler="realesrgan"`), its
//!   output turned grey the same way; here it shares each forward with the colour tile (batch 2);
//! - outputs clamped to [0, 1], scaled and rounded (ties to even) to the input's bit depth; grey +
//!   alpha stays grey + alpha (OpenCV would have read it as colour);
//! - an outscale other than the network's (×2 from a ×4 model) resamples the finished image with
//!   OpenCV's Lanczos-4 ([`crate::imageops::lanczos4`]).
//!
//! That resampling is host work only (about 0.8 s for a 4096² RGB8 image on one core of a 2-core
//! VM in the dev profile), so it is a step of its own: [`Upscaler::upscale_network`] hands back an
//! [`Upscaled`] image at the network's scale, and [`Upscaled::finish`] resamples it on whatever
//! thread the caller chooses (the worker's blocking pool, beside the PNG encode, while the engine
//! runs the next job). [`Upscaler::upscale`] does both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use image::{DynamicImage, ImageBuffer};
use tch::{Device, Kind, Tensor};

use crate::error::{GenerateError, LoadError, contain_backend_panics};
use crate::esrgan::config::RrdbConfig;
use crate::esrgan::keys::{self, CheckpointInfo, Naming};
use crate::esrgan::rrdbnet::{MemoryFormat, RrdbNet};
use crate::esrgan::tiling::{TileSettings, ceil_div, run_tiled};
use crate::imageops::lanczos4::{self, Layout};
use crate::loading::weights::Weights;

/// How one image is upscaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpscaleOptions {
    /// Output size ÷ input size; `None` is the network's own scale. Other values resample the
    /// network's output with Lanczos-4 (Real-ESRGAN's `outscale`).
    pub outscale: Option<i64>,
    pub tiles: TileSettings,
    /// Real-ESRGAN's `pre_pad` (its `RealESRGANer` default is 10, its `inference_realesrgan.py`
    /// passes 0).
    pub pre_pad: i64,
}

/// Channels of an image as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channels {
    Luma,
    LumaAlpha,
    Rgb,
    Rgba,
}

impl Channels {
    fn count(self) -> usize {
        match self {
            Channels::Luma => 1,
            Channels::LumaAlpha => 2,
            Channels::Rgb => 3,
            Channels::Rgba => 4,
        }
    }
    fn alpha(self) -> bool {
        matches!(self, Channels::LumaAlpha | Channels::Rgba)
    }
    fn grey(self) -> bool {
        matches!(self, Channels::Luma | Channels::LumaAlpha)
    }
}

/// An upscaled image at the network's scale and the size the job asked for: what is left of an
/// upscale once the network has run (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Upscaled {
    image: DynamicImage,
    width: u32,
    height: u32,
}

impl Upscaled {
    /// The finished image's size.
    pub fn size(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    /// The size the network made it at (the input's times the network's scale).
    pub fn network_size(&self) -> (u32, u32) {
        (self.image.width(), self.image.height())
    }

    /// The image at the asked size: as it is when that is the network's scale, else resampled by
    /// OpenCV's Lanczos-4 (host work: run it off the thread that holds the network).
    pub fn finish(self) -> DynamicImage {
        let (fw, fh) = (self.width, self.height);
        if (self.image.width(), self.image.height()) == (fw, fh) {
            return self.image;
        }
        let from = Layout {
            width: self.image.width() as usize,
            height: self.image.height() as usize,
            channels: usize::from(self.image.color().channel_count()),
        };
        let (w, h) = (fw as usize, fh as usize);
        let r8 = |raw: &[u8]| lanczos4::resize_u8(raw, from, w, h);
        let r16 = |raw: &[u16]| lanczos4::resize_u16(raw, from, w, h);
        // `resize_*` return `w · h · channels` samples, the buffer `from_raw` needs.
        const FITS: &str = "Lanczos-4 returns a buffer of the asked size";
        match self.image {
            DynamicImage::ImageLuma8(i) => {
                DynamicImage::ImageLuma8(ImageBuffer::from_raw(fw, fh, r8(i.as_raw())).expect(FITS))
            }
            DynamicImage::ImageLumaA8(i) => DynamicImage::ImageLumaA8(
                ImageBuffer::from_raw(fw, fh, r8(i.as_raw())).expect(FITS),
            ),
            DynamicImage::ImageRgb8(i) => {
                DynamicImage::ImageRgb8(ImageBuffer::from_raw(fw, fh, r8(i.as_raw())).expect(FITS))
            }
            DynamicImage::ImageRgba8(i) => {
                DynamicImage::ImageRgba8(ImageBuffer::from_raw(fw, fh, r8(i.as_raw())).expect(FITS))
            }
            DynamicImage::ImageLuma16(i) => DynamicImage::ImageLuma16(
                ImageBuffer::from_raw(fw, fh, r16(i.as_raw())).expect(FITS),
            ),
            DynamicImage::ImageLumaA16(i) => DynamicImage::ImageLumaA16(
                ImageBuffer::from_raw(fw, fh, r16(i.as_raw())).expect(FITS),
            ),
            DynamicImage::ImageRgb16(i) => DynamicImage::ImageRgb16(
                ImageBuffer::from_raw(fw, fh, r16(i.as_raw())).expect(FITS),
            ),
            DynamicImage::ImageRgba16(i) => DynamicImage::ImageRgba16(
                ImageBuffer::from_raw(fw, fh, r16(i.as_raw())).expect(FITS),
            ),
            other => unreachable!(
                "an upscale makes 8- or 16-bit grey, grey + alpha, RGB or RGBA, not {:?}",
                other.color()
            ),
        }
    }
}

/// Samples of an image as stored, interleaved.
enum Samples<'a> {
    Eight(&'a [u8]),
    Sixteen(&'a [u16]),
}

/// An RRDBNet on its device, ready to upscale.
#[derive(Debug)]
pub struct Upscaler {
    net: RrdbNet,
    device: Device,
    kind: Kind,
    path: PathBuf,
    info: CheckpointInfo,
}

impl Upscaler {
    /// Loads the checkpoint at `path` (`.pth` or `.safetensors`, BasicSR or ESRGAN names, any
    /// RRDBNet size: read off the tensors) to `device`, computing in `kind`. Fails on tensors the
    /// network does not have, naming them.
    pub fn load(path: &Path, device: Device, kind: Kind) -> Result<Self, LoadError> {
        let (store, info) = keys::open(path)?;
        let config = RrdbConfig::detect(store.names(), |n| store.shape(n)).map_err(|reason| {
            LoadError::Format {
                path: path.to_path_buf(),
                reason,
            }
        })?;
        let store = Arc::new(store);
        let net = RrdbNet::new(&Weights::new(store.clone(), device, kind), config)?;
        let mut unused = store.unused();
        if !unused.is_empty() {
            unused.sort();
            return Err(LoadError::Unexpected {
                path: path.to_path_buf(),
                describe: describe(&config),
                tensors: unused,
            });
        }
        Ok(Self {
            net,
            device,
            kind,
            path: path.to_path_buf(),
            info,
        })
    }

    pub fn config(&self) -> &RrdbConfig {
        &self.net.config
    }

    /// Weights and activations in `format` (NHWC where the device's kernels prefer it).
    pub fn set_memory_format(&mut self, format: MemoryFormat) {
        self.net.set_memory_format(format);
    }

    /// The network itself (parity tests run it on plain tensors).
    pub fn network(&self) -> &RrdbNet {
        &self.net
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// For logs: sizes, naming and where the weights were found.
    pub fn describe(&self) -> String {
        let naming = match self.info.naming {
            Naming::BasicSr => "",
            Naming::Esrgan => ", ESRGAN names",
        };
        let wrapper = self
            .info
            .wrapper
            .as_deref()
            .map(|w| format!(", `{w}`"))
            .unwrap_or_default();
        format!(
            "{}{naming}{wrapper} ({})",
            describe(&self.net.config),
            self.path.display()
        )
    }

    /// The settings the network can run: tiles and overlap aligned to its pixel-unshuffle.
    pub fn effective(&self, tiles: &TileSettings) -> TileSettings {
        tiles.aligned(self.net.config.unshuffle())
    }

    /// Runs one forward per distinct tile shape of `tiles` (at `max_batch` tiles) that images of
    /// `sizes` (`(height, width)`, padded as a job's are with `pre_pad`) are cut into, or, with no
    /// sizes, the shapes of a 3 × 3 grid of tiles: kernels are chosen and memory pools sized
    /// before the first job. A shape first seen by a job costs that job its kernel choice (cuDNN
    /// plans: tens of ms per convolution shape, per thread).
    pub fn warm_up(
        &self,
        tiles: &TileSettings,
        sizes: &[(i64, i64)],
        pre_pad: i64,
    ) -> Result<(), GenerateError> {
        let tiles = self.effective(tiles);
        tiles.validate().map_err(GenerateError::InvalidRequest)?;
        let grid = tiles.tile.map_or(256, |t| 3 * t);
        let mut shapes: Vec<[i64; 2]> = if sizes.is_empty() {
            tiles.shapes(grid, grid)
        } else {
            let side = |n| self.network_side(n, pre_pad);
            sizes
                .iter()
                .flat_map(|&(h, w)| tiles.shapes(side(h), side(w)))
                .collect()
        };
        shapes.sort_unstable();
        shapes.dedup();
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            let _guard = tch::no_grad_guard();
            for [h, w] in shapes {
                let x = Tensor::zeros(
                    [tiles.max_batch as i64, self.net.config.num_in_ch, h, w],
                    (self.kind, self.device),
                );
                let _ = self.net.forward(&x);
            }
            crate::nn::stream::synchronize_current(self.device);
            Ok(())
        }))
    }

    /// Pre-processing of `enhance`: to the device and compute dtype, `pre_pad`, then padding to a
    /// multiple of the unshuffle factor (both at the bottom and right): to [`Self::network_side`].
    fn prepare(&self, x: &Tensor, pre_pad: i64) -> Tensor {
        let x = x.to_device(self.device).to_kind(self.kind);
        let (_, _, h, w) = x.size4().expect("images are [B, C, H, W]");
        let x = pad_bottom_right(&x, pre_pad, pre_pad);
        let (h2, w2) = (self.network_side(h, pre_pad), self.network_side(w, pre_pad));
        pad_bottom_right(&x, h2 - h - pre_pad, w2 - w - pre_pad)
    }

    /// An image side of `n` pixels as the network takes it: after `pre_pad`, rounded up to a
    /// multiple of the pixel-unshuffle.
    fn network_side(&self, n: i64, pre_pad: i64) -> i64 {
        let m = self.net.config.unshuffle();
        ceil_div(n + pre_pad, m) * m
    }

    /// `[B, 3, H, W]` fp32 in [0, 1] → `[B, 3, H·s, W·s]` fp32 in [0, 1] on the CPU: the network's
    /// output after pre- and post-processing, before any rounding (what parity tests compare).
    pub fn upscale_tensor(
        &self,
        x: &Tensor,
        options: &UpscaleOptions,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<Tensor, GenerateError> {
        let (b, c, h, w) = x.size4()?;
        let s = self.net.config.scale;
        let out = Tensor::zeros([b, c, h * s, w * s], (Kind::Float, Device::Cpu));
        let mut sink = |strip: &Tensor, row0: i64| -> Result<(), GenerateError> {
            let rows = (h * s - row0).min(strip.size()[2]);
            if rows > 0 {
                let part = strip.narrow(2, 0, rows).narrow(3, 0, w * s).clamp(0.0, 1.0);
                out.narrow(2, row0, rows)
                    .copy_(&part.to_device(Device::Cpu));
            }
            Ok(())
        };
        self.run(x, options, &mut sink, progress, cancel)?;
        Ok(out)
    }

    fn run(
        &self,
        x: &Tensor,
        options: &UpscaleOptions,
        sink: &mut dyn FnMut(&Tensor, i64) -> Result<(), GenerateError>,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<(), GenerateError> {
        let tiles = self.effective(&options.tiles);
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            let _guard = tch::no_grad_guard();
            let input = self.prepare(x, options.pre_pad.max(0));
            run_tiled(
                &input,
                self.net.config.scale,
                &tiles,
                &|t| self.net.forward(t),
                sink,
                progress,
                cancel,
            )
        }))
    }

    /// Upscales `image` (8- or 16-bit; grey, grey + alpha, RGB or RGBA), keeping its layout; see
    /// the module docs. `progress(done, total)` counts tiles; `cancel` is checked between tiles.
    pub fn upscale(
        &self,
        image: &DynamicImage,
        options: &UpscaleOptions,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<DynamicImage, GenerateError> {
        Ok(self
            .upscale_network(image, options, progress, cancel)?
            .finish())
    }

    /// [`Upscaler::upscale`] up to the network's scale: the image as the network made it, with the
    /// resampling to `options.outscale` left to [`Upscaled::finish`].
    pub fn upscale_network(
        &self,
        image: &DynamicImage,
        options: &UpscaleOptions,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<Upscaled, GenerateError> {
        // libtorch failures outside the tiled run too (the upload of a large input running out of
        // device memory) come back as errors the worker can classify.
        contain_backend_panics(std::panic::AssertUnwindSafe(|| {
            self.upscale_image(image, options, progress, cancel)
        }))
    }

    fn upscale_image(
        &self,
        image: &DynamicImage,
        options: &UpscaleOptions,
        progress: &mut dyn FnMut(usize, usize),
        cancel: &dyn Fn() -> bool,
    ) -> Result<Upscaled, GenerateError> {
        let (channels, samples) = split(image)?;
        let (w, h) = (image.width() as i64, image.height() as i64);
        let cn = channels.count();
        let s = self.net.config.scale;
        let (ow, oh) = (w * s, h * s);
        // Samples → [B, 3, H, W] fp32 in [0, 1]: colour (grey replicated), then alpha as RGB.
        let (raw, max) = match &samples {
            Samples::Eight(v) => (Tensor::from_slice(v).to_device(self.device), 255.0),
            Samples::Sixteen(v) => {
                let f: Vec<f32> = v.iter().map(|&x| f32::from(x)).collect();
                (Tensor::from_slice(&f).to_device(self.device), 65535.0)
            }
        };
        let hwc = raw.view([h, w, cn as i64]).to_kind(Kind::Float) / max;
        let colour = if channels.grey() {
            hwc.narrow(2, 0, 1).expand([h, w, 3], false)
        } else {
            hwc.narrow(2, 0, 3)
        };
        let mut planes = vec![colour.permute([2, 0, 1])];
        if channels.alpha() {
            planes.push(
                hwc.narrow(2, cn as i64 - 1, 1)
                    .expand([h, w, 3], false)
                    .permute([2, 0, 1]),
            );
        }
        let x = Tensor::stack(&planes, 0);
        drop((raw, hwc, planes));

        let sixteen = matches!(samples, Samples::Sixteen(_));
        let mut out8 = Vec::new();
        let mut out16 = Vec::new();
        if sixteen {
            out16 = vec![0u16; (ow * oh) as usize * cn];
        } else {
            out8 = vec![0u8; (ow * oh) as usize * cn];
        }
        let mut sink = |strip: &Tensor, row0: i64| -> Result<(), GenerateError> {
            let rows = (oh - row0).min(strip.size()[2]);
            if rows <= 0 {
                return Ok(());
            }
            let part = strip.narrow(2, 0, rows).narrow(3, 0, ow).clamp(0.0, 1.0);
            // [B, 3, r, W] → interleaved [r, W, cn] in the output's channel order.
            let grey = |i: i64| {
                let p = part.get(i);
                p.get(2) * 0.114 + p.get(1) * 0.587 + p.get(0) * 0.299
            };
            let mut chans: Vec<Tensor> = if channels.grey() {
                vec![grey(0)]
            } else {
                (0..3).map(|c| part.get(0).get(c)).collect()
            };
            if channels.alpha() {
                chans.push(grey(1));
            }
            let hwc = Tensor::stack(&chans, 2);
            let at = (row0 * ow) as usize * cn;
            let n = (rows * ow) as usize * cn;
            if sixteen {
                let q = (hwc * 65535.0)
                    .round()
                    .to_kind(Kind::Int)
                    .to_device(Device::Cpu);
                let v = Vec::<i32>::try_from(q.reshape([-1]))?;
                for (o, x) in out16[at..at + n].iter_mut().zip(v) {
                    *o = x as u16;
                }
            } else {
                let q = (hwc * 255.0)
                    .round()
                    .to_kind(Kind::Uint8)
                    .to_device(Device::Cpu);
                q.reshape([-1]).copy_data_u8(&mut out8[at..at + n], n);
            }
            Ok(())
        };
        self.run(&x, options, &mut sink, progress, cancel)?;

        let outscale = options.outscale.unwrap_or(s);
        let (fw, fh) = (ow as u32, oh as u32);
        let bad = || GenerateError::InvalidRequest("output buffer does not match its size".into());
        let image = match (channels, sixteen) {
            (Channels::Luma, false) => {
                DynamicImage::ImageLuma8(ImageBuffer::from_raw(fw, fh, out8).ok_or_else(bad)?)
            }
            (Channels::LumaAlpha, false) => {
                DynamicImage::ImageLumaA8(ImageBuffer::from_raw(fw, fh, out8).ok_or_else(bad)?)
            }
            (Channels::Rgb, false) => {
                DynamicImage::ImageRgb8(ImageBuffer::from_raw(fw, fh, out8).ok_or_else(bad)?)
            }
            (Channels::Rgba, false) => {
                DynamicImage::ImageRgba8(ImageBuffer::from_raw(fw, fh, out8).ok_or_else(bad)?)
            }
            (Channels::Luma, true) => {
                DynamicImage::ImageLuma16(ImageBuffer::from_raw(fw, fh, out16).ok_or_else(bad)?)
            }
            (Channels::LumaAlpha, true) => {
                DynamicImage::ImageLumaA16(ImageBuffer::from_raw(fw, fh, out16).ok_or_else(bad)?)
            }
            (Channels::Rgb, true) => {
                DynamicImage::ImageRgb16(ImageBuffer::from_raw(fw, fh, out16).ok_or_else(bad)?)
            }
            (Channels::Rgba, true) => {
                DynamicImage::ImageRgba16(ImageBuffer::from_raw(fw, fh, out16).ok_or_else(bad)?)
            }
        };
        Ok(Upscaled {
            image,
            width: (w * outscale) as u32,
            height: (h * outscale) as u32,
        })
    }
}

/// "RRDBNet ×4, 6 blocks, 64 features".
fn describe(c: &RrdbConfig) -> String {
    format!(
        "RRDBNet ×{}, {} blocks, {} features, growth {}",
        c.scale, c.num_block, c.num_feat, c.num_grow_ch
    )
}

/// The image's layout and its samples; float images are refused.
fn split(image: &DynamicImage) -> Result<(Channels, Samples<'_>), GenerateError> {
    Ok(match image {
        DynamicImage::ImageLuma8(i) => (Channels::Luma, Samples::Eight(i.as_raw())),
        DynamicImage::ImageLumaA8(i) => (Channels::LumaAlpha, Samples::Eight(i.as_raw())),
        DynamicImage::ImageRgb8(i) => (Channels::Rgb, Samples::Eight(i.as_raw())),
        DynamicImage::ImageRgba8(i) => (Channels::Rgba, Samples::Eight(i.as_raw())),
        DynamicImage::ImageLuma16(i) => (Channels::Luma, Samples::Sixteen(i.as_raw())),
        DynamicImage::ImageLumaA16(i) => (Channels::LumaAlpha, Samples::Sixteen(i.as_raw())),
        DynamicImage::ImageRgb16(i) => (Channels::Rgb, Samples::Sixteen(i.as_raw())),
        DynamicImage::ImageRgba16(i) => (Channels::Rgba, Samples::Sixteen(i.as_raw())),
        other => {
            return Err(GenerateError::InvalidRequest(format!(
                "{:?} images are not upscaled: 8- or 16-bit grey, grey + alpha, RGB or RGBA only",
                other.color()
            )));
        }
    })
}

/// Reflect padding of `ph` rows at the bottom and `pw` columns at the right (`F.pad(x, (0, pw, 0,
/// ph), "reflect")`), replicate where a side is too short to reflect.
fn pad_bottom_right(x: &Tensor, ph: i64, pw: i64) -> Tensor {
    if ph == 0 && pw == 0 {
        return x.shallow_clone();
    }
    let (_, _, h, w) = x.size4().expect("images are [B, C, H, W]");
    let mode = if ph < h && pw < w {
        "reflect"
    } else {
        "replicate"
    };
    x.pad([0, pw, 0, ph], mode, None)
}
