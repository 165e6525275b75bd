//! Image operations whose exact bytes matter to parity with the Python pipelines (which resize
//! with Pillow before any tensor exists).
//! - [`resample`]: Pillow's `Image.resize` for 8-bit RGB, byte for byte.
//! - [`rgb8_to_tensor`] / [`tensor_to_rgb8`]: images to and from the VAEs' [-1, 1] tensors, as
//!   diffusers' `VaeImageProcessor` converts them (shared by every pipeline).

pub mod lanczos4;
pub mod resample;

pub use resample::{Filter, ResizeError, resize};

use image::RgbImage;
use tch::{Device, Kind, Tensor};

use crate::error::GenerateError;

/// RGB8 → `[1, 3, H, W]` in [-1, 1] on `device` in `kind`: diffusers' `VaeImageProcessor.preprocess`
/// (`x / 255` in fp32, then `2x − 1`), cast last. The bytes go to the device as they are (a quarter
/// of the fp32 upload) and are converted there: IEEE fp32 division and products round alike on
/// every device, so the values are the host's.
pub fn rgb8_to_tensor(image: &RgbImage, device: Device, kind: Kind) -> Tensor {
    let (w, h) = image.dimensions();
    let x = Tensor::from_slice(image.as_raw())
        .to_device(device)
        .view([1, i64::from(h), i64::from(w), 3])
        .permute([0, 3, 1, 2])
        .to_kind(Kind::Float)
        / 255.0;
    (x * 2.0 - 1.0).to_kind(kind)
}

/// `[1, 3, H, W]` in [-1, 1] → RGB8: diffusers' `postprocess` (`(x / 2 + 0.5).clamp(0, 1)`, then
/// `round(255 · x)` in `numpy_to_pil`), computed in fp32.
pub fn tensor_to_rgb8(x: &Tensor) -> Result<RgbImage, GenerateError> {
    let x = (x.to_kind(Kind::Float) / 2.0 + 0.5).clamp(0.0, 1.0);
    let u8s = (x * 255.0)
        .round()
        .to_kind(Kind::Uint8)
        .permute([0, 2, 3, 1])
        .contiguous()
        .to_device(Device::Cpu);
    let (_, h, w, _) = u8s.size4()?;
    let data = Vec::<u8>::try_from(u8s.reshape([-1]))?;
    RgbImage::from_raw(w as u32, h as u32, data)
        .ok_or_else(|| GenerateError::InvalidRequest("decoded image has an unexpected size".into()))
}
