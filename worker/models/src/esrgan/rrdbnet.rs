//! RRDBNet, the generator of ESRGAN and Real-ESRGAN, mirroring BasicSR
//! `basicsr/archs/rrdbnet_arch.py` (XPixelGroup/BasicSR, BSD-3-Clause): [`ResidualDenseBlock`],
//! [`Rrdb`] and [`RrdbNet`], with the same tensor names (`conv_first`, `body.N.rdbK.convJ`,
//! `conv_body`, `conv_up1`, `conv_up2`, `conv_hr`, `conv_last`).
//!
//! Numerics follow the reference operation for operation (in-place LeakyReLU and residual
//! updates round exactly as the out-of-place Python expressions do), so an fp32 forward matches
//! BasicSR's up to the convolution kernels' own rounding.

use tch::Tensor;

use crate::error::LoadError;
use crate::esrgan::config::RrdbConfig;
use crate::loading::weights::Weights;
use crate::nn::{Conv2d, channels_last};

/// Memory order of the network's weights and activations (shared with the SDXL VAE).
pub use crate::nn::MemoryFormat;

/// "Empirically, we use 0.2 to scale the residual for better performance" (BasicSR).
const RESIDUAL_SCALE: f64 = 0.2;
/// `nn.LeakyReLU(negative_slope=0.2)`.
const NEGATIVE_SLOPE: f64 = 0.2;

/// `LeakyReLU(0.2)` in place. tch 0.24 binds `leaky_relu` only with its default slope (0.01);
/// `leaky_relu_backward(grad = x, self = x, slope)` computes `x > 0 ? x : x · slope`, the
/// forward's own formula with the same scalar arithmetic, and its `grad_input` (out) variant
/// written into `x` itself (every element reads only its own position) makes it in place, as
/// BasicSR's `inplace=True` is.
fn leaky_relu_(x: &Tensor) {
    // The returned handle aliases `x`.
    let _ = x.leaky_relu_backward_grad_input(x, x, NEGATIVE_SLOPE, false);
}

/// `ResidualDenseBlock`: five 3×3 convs, each seeing the block input and every earlier output.
#[derive(Debug)]
pub struct ResidualDenseBlock {
    conv1: Conv2d,
    conv2: Conv2d,
    conv3: Conv2d,
    conv4: Conv2d,
    conv5: Conv2d,
}

impl ResidualDenseBlock {
    fn convs(&mut self) -> [&mut Conv2d; 5] {
        [
            &mut self.conv1,
            &mut self.conv2,
            &mut self.conv3,
            &mut self.conv4,
            &mut self.conv5,
        ]
    }

    pub fn new(w: &Weights, num_feat: i64, num_grow_ch: i64) -> Result<Self, LoadError> {
        let conv = |j: i64, out: i64| {
            Conv2d::new(
                &w.pp(format!("conv{j}")),
                num_feat + (j - 1) * num_grow_ch,
                out,
                3,
                1,
                1,
            )
        };
        Ok(Self {
            conv1: conv(1, num_grow_ch)?,
            conv2: conv(2, num_grow_ch)?,
            conv3: conv(3, num_grow_ch)?,
            conv4: conv(4, num_grow_ch)?,
            conv5: conv(5, num_feat)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let x1 = self.conv1.forward(x);
        leaky_relu_(&x1);
        let x2 = self.conv2.forward(&Tensor::cat(&[x, &x1], 1));
        leaky_relu_(&x2);
        let x3 = self.conv3.forward(&Tensor::cat(&[x, &x1, &x2], 1));
        leaky_relu_(&x3);
        let x4 = self.conv4.forward(&Tensor::cat(&[x, &x1, &x2, &x3], 1));
        leaky_relu_(&x4);
        let mut x5 = self
            .conv5
            .forward(&Tensor::cat(&[x, &x1, &x2, &x3, &x4], 1));
        // x5 * 0.2 + x
        let _ = x5.g_mul_scalar_(RESIDUAL_SCALE);
        let _ = x5.g_add_(x);
        x5
    }
}

/// `RRDB`: three dense blocks and a scaled residual.
#[derive(Debug)]
pub struct Rrdb {
    rdb1: ResidualDenseBlock,
    rdb2: ResidualDenseBlock,
    rdb3: ResidualDenseBlock,
}

impl Rrdb {
    pub fn new(w: &Weights, num_feat: i64, num_grow_ch: i64) -> Result<Self, LoadError> {
        Ok(Self {
            rdb1: ResidualDenseBlock::new(&w.pp("rdb1"), num_feat, num_grow_ch)?,
            rdb2: ResidualDenseBlock::new(&w.pp("rdb2"), num_feat, num_grow_ch)?,
            rdb3: ResidualDenseBlock::new(&w.pp("rdb3"), num_feat, num_grow_ch)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let out = self.rdb1.forward(x);
        let out = self.rdb2.forward(&out);
        let mut out = self.rdb3.forward(&out);
        let _ = out.g_mul_scalar_(RESIDUAL_SCALE);
        let _ = out.g_add_(x);
        out
    }
}

/// `RRDBNet`: trunk of RRDBs at input resolution, then two nearest ×2 upsamplings with convs.
#[derive(Debug)]
pub struct RrdbNet {
    pub config: RrdbConfig,
    format: MemoryFormat,
    conv_first: Conv2d,
    body: Vec<Rrdb>,
    conv_body: Conv2d,
    conv_up1: Conv2d,
    conv_up2: Conv2d,
    conv_hr: Conv2d,
    conv_last: Conv2d,
}

impl RrdbNet {
    pub fn new(w: &Weights, config: RrdbConfig) -> Result<Self, LoadError> {
        let nf = config.num_feat;
        let u = config.unshuffle();
        let conv = |name: &str, i: i64, o: i64| Conv2d::new(&w.pp(name), i, o, 3, 1, 1);
        let body = w.pp("body");
        Ok(Self {
            config,
            format: MemoryFormat::Contiguous,
            conv_first: conv("conv_first", config.num_in_ch * u * u, nf)?,
            body: (0..config.num_block)
                .map(|n| Rrdb::new(&body.pp(n), nf, config.num_grow_ch))
                .collect::<Result<_, _>>()?,
            conv_body: conv("conv_body", nf, nf)?,
            conv_up1: conv("conv_up1", nf, nf)?,
            conv_up2: conv("conv_up2", nf, nf)?,
            conv_hr: conv("conv_hr", nf, nf)?,
            conv_last: conv("conv_last", nf, config.num_out_ch)?,
        })
    }

    /// Puts every weight in `format`; inputs follow at each forward.
    pub fn set_memory_format(&mut self, format: MemoryFormat) {
        if format == self.format {
            return;
        }
        let mut convs: Vec<&mut Conv2d> = vec![
            &mut self.conv_first,
            &mut self.conv_body,
            &mut self.conv_up1,
            &mut self.conv_up2,
            &mut self.conv_hr,
            &mut self.conv_last,
        ];
        for block in &mut self.body {
            for rdb in [&mut block.rdb1, &mut block.rdb2, &mut block.rdb3] {
                convs.extend(rdb.convs());
            }
        }
        for conv in convs {
            conv.weight = match format {
                MemoryFormat::Contiguous => conv.weight.contiguous(),
                MemoryFormat::ChannelsLast => channels_last(&conv.weight),
            };
        }
        self.format = format;
    }

    pub fn memory_format(&self) -> MemoryFormat {
        self.format
    }

    /// `[B, num_in_ch, H, W]` in [0, 1] (any range works) → `[B, num_out_ch, H·s, W·s]`, in the
    /// weights' dtype; H and W must be multiples of the unshuffle factor for ×2 / ×1 models.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let u = self.config.unshuffle();
        let feat = if u > 1 {
            x.pixel_unshuffle(u)
        } else {
            x.shallow_clone()
        };
        let feat = match self.format {
            MemoryFormat::Contiguous => feat,
            MemoryFormat::ChannelsLast => channels_last(&feat),
        };
        let mut feat = self.conv_first.forward(&feat);
        let mut trunk = self.body.iter().fold(None::<Tensor>, |acc, block| {
            Some(block.forward(acc.as_ref().unwrap_or(&feat)))
        });
        let body_feat = self
            .conv_body
            .forward(trunk.take().as_ref().unwrap_or(&feat));
        let _ = feat.g_add_(&body_feat);
        drop(body_feat);
        let feat = self.conv_up1.forward(&upsample2(&feat));
        leaky_relu_(&feat);
        let feat = self.conv_up2.forward(&upsample2(&feat));
        leaky_relu_(&feat);
        let hr = self.conv_hr.forward(&feat);
        drop(feat);
        leaky_relu_(&hr);
        self.conv_last.forward(&hr)
    }
}

/// `F.interpolate(x, scale_factor=2, mode="nearest")` (the scale is passed on, as Python does).
fn upsample2(x: &Tensor) -> Tensor {
    let (_, _, h, w) = x.size4().expect("feature maps are 4-D");
    x.upsample_nearest2d([2 * h, 2 * w], Some(2.0), Some(2.0))
}
