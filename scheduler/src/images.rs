//! Input images as the scheduler accepts them (uploads and inline inputs), and gallery thumbnails.
//!
//! An input is verified by decoding it whole, so a truncated or corrupt file is refused at the door
//! rather than on a worker. The decoder is bounded before it allocates: the header's size is
//! checked against the side and pixel limits first, and the decode itself runs under `image`'s
//! allocation limit, so a decompression bomb (a small file declaring a huge image) is refused
//! without its pixels ever being allocated. Decoding is CPU work: callers run these functions on a
//! blocking thread.

use std::io::Cursor;

use image::{ImageFormat, ImageReader, Limits};
use vnfarm_proto::spec::MAX_INPUT_SIDE;

/// The formats an input may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InputFormat {
    Png,
    Jpeg,
    Webp,
}

impl InputFormat {
    pub fn extension(self) -> &'static str {
        match self {
            InputFormat::Png => "png",
            InputFormat::Jpeg => "jpg",
            InputFormat::Webp => "webp",
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            InputFormat::Png => "image/png",
            InputFormat::Jpeg => "image/jpeg",
            InputFormat::Webp => "image/webp",
        }
    }
}

/// Bounds of an accepted input.
#[derive(Clone, Copy, Debug)]
pub struct InputLimits {
    pub max_bytes: usize,
    /// Largest side, at most [`MAX_INPUT_SIDE`] (what the models take).
    pub max_side: u32,
    pub max_pixels: u64,
}

impl Default for InputLimits {
    fn default() -> Self {
        Self {
            max_bytes: vnfarm_proto::spec::MAX_INLINE_IMAGE_BYTES,
            max_side: MAX_INPUT_SIDE,
            max_pixels: u64::from(MAX_INPUT_SIDE) * u64::from(MAX_INPUT_SIDE),
        }
    }
}

/// What a verified input is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifiedImage {
    pub format: InputFormat,
    pub width: u32,
    pub height: u32,
}

/// Checks that `bytes` are a whole PNG, JPEG or WebP image within `limits`; the error says why not.
pub fn verify(bytes: &[u8], limits: InputLimits) -> Result<VerifiedImage, String> {
    if bytes.len() > limits.max_bytes {
        return Err(format!(
            "the image is {} bytes; at most {} are accepted",
            bytes.len(),
            limits.max_bytes
        ));
    }
    let reader = || {
        ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| e.to_string())
    };
    let format = match reader()?.format() {
        Some(ImageFormat::Png) => InputFormat::Png,
        Some(ImageFormat::Jpeg) => InputFormat::Jpeg,
        Some(ImageFormat::WebP) => InputFormat::Webp,
        Some(other) => {
            return Err(format!(
                "a {other:?} image; only PNG, JPEG and WebP are accepted"
            ));
        }
        None => return Err("not a PNG, JPEG or WebP image".into()),
    };
    let (width, height) = reader()?
        .into_dimensions()
        .map_err(|e| format!("cannot read the image header: {e}"))?;
    let max = limits.max_side.min(MAX_INPUT_SIDE);
    if width == 0 || height == 0 || width > max || height > max {
        return Err(format!(
            "the image is {width}x{height}; at most {max} pixels a side"
        ));
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels {
        return Err(format!(
            "the image has {pixels} pixels; at most {} are accepted",
            limits.max_pixels
        ));
    }
    let mut decoder = reader()?;
    decoder.limits(decode_limits(width, height));
    decoder
        .decode()
        .map_err(|e| format!("the image does not decode: {e}"))?;
    Ok(VerifiedImage {
        format,
        width,
        height,
    })
}

/// The decoder may allocate the declared image (up to 16-bit RGBA) and no more.
fn decode_limits(width: u32, height: u32) -> Limits {
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(u64::from(width) * u64::from(height) * 8 + (1 << 20));
    limits
}

/// Longest side of a gallery thumbnail.
pub const THUMBNAIL_SIDE: u32 = 320;

/// A JPEG of at most [`THUMBNAIL_SIDE`] pixels a side of an image the farm stored (a worker's PNG
/// or a verified input).
pub fn thumbnail(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())?;
    let mut limits = Limits::default();
    limits.max_image_width = Some(4 * vnfarm_proto::spec::MAX_UPSCALE_OUTPUT_SIDE);
    limits.max_image_height = Some(4 * vnfarm_proto::spec::MAX_UPSCALE_OUTPUT_SIDE);
    reader.limits(limits);
    let image = reader.decode().map_err(|e| e.to_string())?;
    // `thumbnail` would also enlarge a small image; a small one is only re-encoded.
    let small = if image.width() > THUMBNAIL_SIDE || image.height() > THUMBNAIL_SIDE {
        image.thumbnail(THUMBNAIL_SIDE, THUMBNAIL_SIDE)
    } else {
        image
    }
    .into_rgb8();
    let mut out = Cursor::new(Vec::new());
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 85)
        .encode_image(&small)
        .map_err(|e| e.to_string())?;
    Ok(out.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn accepts_whole_images() {
        let v = verify(&png(40, 30), InputLimits::default()).unwrap();
        assert_eq!((v.format, v.width, v.height), (InputFormat::Png, 40, 30));
        let thumb = thumbnail(&png(1000, 500)).unwrap();
        let t = image::load_from_memory(&thumb).unwrap();
        assert_eq!(
            (t.width(), t.height()),
            (THUMBNAIL_SIDE, THUMBNAIL_SIDE / 2)
        );
    }

    #[test]
    fn refuses_what_it_cannot_use() {
        let limits = InputLimits::default();
        assert!(verify(b"GIF89a....", limits).unwrap_err().contains("Gif"));
        assert!(verify(b"hello", limits).unwrap_err().contains("not a PNG"));
        let whole = png(64, 64);
        let truncated = &whole[..whole.len() / 2];
        assert!(
            verify(truncated, limits)
                .unwrap_err()
                .contains("does not decode")
        );
        let small = InputLimits {
            max_pixels: 1000,
            ..limits
        };
        assert!(verify(&whole, small).unwrap_err().contains("pixels"));
    }

    /// A PNG whose header declares 4096x4096 (64 MiB of RGBA pixels) around a few bytes of data:
    /// refused by the pixel limit from its header, before anything is allocated.
    #[test]
    fn a_decompression_bomb_is_refused_before_it_allocates() {
        let mut bomb = png(8, 8);
        // IHDR's data starts at byte 16 (signature 8, length 4, type 4): width, height big-endian.
        bomb[16..20].copy_from_slice(&4096u32.to_be_bytes());
        bomb[20..24].copy_from_slice(&4096u32.to_be_bytes());
        let crc = crc32fast::hash(&bomb[12..29]);
        bomb[29..33].copy_from_slice(&crc.to_be_bytes());
        let limits = InputLimits {
            max_pixels: 2048 * 2048,
            ..InputLimits::default()
        };
        let e = verify(&bomb, limits).unwrap_err();
        assert!(e.contains("16777216 pixels"), "{e}");
        // Within the pixel limit, the decoder finds the data missing.
        let e = verify(&bomb, InputLimits::default()).unwrap_err();
        assert!(e.contains("does not decode"), "{e}");
    }
}
