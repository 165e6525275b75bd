//! `ResnetBlock2D`, `Downsample2D` and `Upsample2D` shared by the UNet and the VAE, after diffusers
//! `models/resnet.py`, `models/downsampling.py`, `models/upsampling.py` (Apache-2.0).

use tch::Tensor;

use crate::error::LoadError;
use crate::loading::lora::LoraModule;
use crate::loading::weights::Weights;
use crate::nn::fused::{self, NormKernels};
use crate::nn::{Conv2d, GroupNorm, Linear};

/// `ResnetBlock2D` with `time_embedding_norm="default"` and `output_scale_factor=1`.
#[derive(Debug)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Option<Linear>,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
    norm_kernels: NormKernels,
}

impl ResnetBlock2D {
    /// `temb_channels = None` for the VAE.
    pub fn new(
        w: &Weights,
        in_ch: i64,
        out_ch: i64,
        temb_channels: Option<i64>,
        groups: i64,
        eps: f64,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            norm1: GroupNorm::new(&w.pp("norm1"), groups, in_ch, eps)?,
            conv1: Conv2d::new(&w.pp("conv1"), in_ch, out_ch, 3, 1, 1)?,
            time_emb_proj: match temb_channels {
                Some(t) => Some(Linear::new(&w.pp("time_emb_proj"), t, out_ch, true)?),
                None => None,
            },
            norm2: GroupNorm::new(&w.pp("norm2"), groups, out_ch, eps)?,
            conv2: Conv2d::new(&w.pp("conv2"), out_ch, out_ch, 3, 1, 1)?,
            conv_shortcut: if in_ch != out_ch {
                Some(Conv2d::new(&w.pp("conv_shortcut"), in_ch, out_ch, 1, 1, 0)?)
            } else {
                None
            },
            norm_kernels: NormKernels::Aten,
        })
    }

    /// Which kernels run the two GroupNorms ([`NormKernels`], default libtorch's).
    pub fn set_norm_kernels(&mut self, k: NormKernels) {
        self.norm_kernels = k;
    }

    /// Peak memory as diffusers': each activation is freed as soon as the next one exists (SiLU in
    /// place on the fresh norm output, `h` dropped before `conv2`). Convolution biases are folded
    /// into the per-channel term added right after them (the time embedding, the shortcut's bias),
    /// which saves libtorch's separate bias pass: docs/performance.md, kernels attempt 9.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Tensor {
        if self.norm_kernels == NormKernels::Fused {
            return self.forward_fused(x, temb);
        }
        self.forward_normed(x, temb, &mut |norm, t| norm.forward(t))
    }

    /// [`ResnetBlock2D::forward`] with the fused kernels ([`fused`]): each GroupNorm applies its
    /// SiLU in the same pass, the time embedding (with conv1's bias) is added inside the second
    /// one instead of in a pass of its own over conv1's output, and conv2's bias (with the
    /// shortcut's) is added with the residual in one pass.
    fn forward_fused(&self, x: &Tensor, temb: Option<&Tensor>) -> Tensor {
        let k = self.norm_kernels;
        let a = fused::group_norm(&self.norm1, x, None, true, k);
        let (h, t) = self.conv1_and_time(&a, temb);
        drop(a);
        let a = fused::group_norm(&self.norm2, &h, t.as_ref(), true, k);
        drop(h);
        // conv2 and the shortcut without their biases; both biases and the residual in one pass.
        let h = self.conv2.forward_with_bias(&a, None);
        drop(a);
        let (r, bias) = match &self.conv_shortcut {
            Some(s) => (
                s.forward_with_bias(x, None),
                self.shortcut_and_conv2_bias(s),
            ),
            None => (
                x.shallow_clone(),
                self.conv2.bias.as_ref().map(Tensor::shallow_clone),
            ),
        };
        fused::bias_residual(&h, &r, bias.as_ref(), k)
    }

    /// [`ResnetBlock2D::forward`] with each of its two GroupNorms applied by `norm` (the VAE's
    /// tiled decode normalises tiles with whole-image statistics this way).
    pub fn forward_normed(
        &self,
        x: &Tensor,
        temb: Option<&Tensor>,
        norm: &mut dyn FnMut(&GroupNorm, &Tensor) -> Tensor,
    ) -> Tensor {
        let a = norm(&self.norm1, x).silu_();
        let (mut h, t) = self.conv1_and_time(&a, temb);
        if let Some(t) = t {
            h += t.unsqueeze(-1).unsqueeze(-1);
        }
        drop(a);
        let a = norm(&self.norm2, &h).silu_();
        drop(h);
        self.output(x, a)
    }

    /// conv1 of the first activation `a` and the per-channel term still to add to it: with a time
    /// embedding, `proj(silu(temb))` plus conv1's bias, which rides on it (one pass over the
    /// output adds both), and conv1 runs without its bias; otherwise conv1 with its bias and none.
    fn conv1_and_time(&self, a: &Tensor, temb: Option<&Tensor>) -> (Tensor, Option<Tensor>) {
        match (&self.time_emb_proj, temb) {
            (Some(proj), Some(temb)) => {
                let mut t = proj.forward(&temb.silu());
                if let Some(b) = &self.conv1.bias {
                    t += b;
                }
                (self.conv1.forward_with_bias(a, None), Some(t))
            }
            _ => (self.conv1.forward(a), None),
        }
    }

    /// The shortcut's bias plus conv2's: the one per-channel term of the block's output.
    fn shortcut_and_conv2_bias(&self, shortcut: &Conv2d) -> Option<Tensor> {
        match (&shortcut.bias, &self.conv2.bias) {
            (Some(b1), Some(b2)) => Some(b1 + b2),
            (b1, b2) => b1.as_ref().or(b2.as_ref()).map(Tensor::shallow_clone),
        }
    }

    /// conv2 of the second activation `a`, plus the shortcut of the block's input `x`.
    fn output(&self, x: &Tensor, a: Tensor) -> Tensor {
        match &self.conv_shortcut {
            Some(s) => {
                // conv2's bias rides on the shortcut's.
                let h = self.conv2.forward_with_bias(&a, None);
                drop(a);
                let bias = self.shortcut_and_conv2_bias(s);
                s.forward_with_bias(x, bias.as_ref()) + h
            }
            None => {
                let h = self.conv2.forward(&a);
                drop(a);
                x + h
            }
        }
    }
}

/// `Downsample2D(use_conv=True)`: a stride-2 3x3 conv. The VAE variant (`padding=0`) pads
/// right/bottom by one first.
#[derive(Debug)]
pub struct Downsample2D {
    conv: Conv2d,
    asymmetric_pad: bool,
}

impl Downsample2D {
    pub fn new(w: &Weights, channels: i64, padding: i64) -> Result<Self, LoadError> {
        Ok(Self {
            conv: Conv2d::new(&w.pp("conv"), channels, channels, 3, 2, padding)?,
            asymmetric_pad: padding == 0,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        if self.asymmetric_pad {
            self.conv.forward(&x.constant_pad_nd([0, 1, 0, 1]))
        } else {
            self.conv.forward(x)
        }
    }
}

/// `Upsample2D(use_conv=True)`: nearest x2 (or to an explicit size), then a 3x3 conv.
#[derive(Debug)]
pub struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    pub fn new(w: &Weights, channels: i64) -> Result<Self, LoadError> {
        Ok(Self {
            conv: Conv2d::new(&w.pp("conv"), channels, channels, 3, 1, 1)?,
        })
    }

    /// `size = None` doubles both sides; `Some([h, w])` matches a skip connection of odd size.
    pub fn forward(&self, x: &Tensor, size: Option<[i64; 2]>) -> Tensor {
        let (_, _, h, w) = x.size4().expect("Upsample2D input is [B, C, H, W]");
        let out = size.unwrap_or([2 * h, 2 * w]);
        let up = if out == [2 * h, 2 * w] {
            x.upsample_nearest2d(out, Some(2.0), Some(2.0))
        } else {
            x.upsample_nearest2d(out, None, None)
        };
        self.conv.forward(&up)
    }
}

/// The modules LoRAs patch (LyCORIS LoCon's convolutions), by diffusers name under `prefix`.
impl ResnetBlock2D {
    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        out.push((format!("{prefix}conv1"), (&mut self.conv1).into()));
        out.push((format!("{prefix}conv2"), (&mut self.conv2).into()));
        if let Some(l) = &mut self.time_emb_proj {
            out.push((format!("{prefix}time_emb_proj"), l.into()));
        }
        if let Some(c) = &mut self.conv_shortcut {
            out.push((format!("{prefix}conv_shortcut"), c.into()));
        }
    }
}

impl Downsample2D {
    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        out.push((format!("{prefix}conv"), (&mut self.conv).into()));
    }
}

impl Upsample2D {
    pub fn lora_modules<'a>(&'a mut self, prefix: &str, out: &mut Vec<(String, LoraModule<'a>)>) {
        out.push((format!("{prefix}conv"), (&mut self.conv).into()));
    }
}
