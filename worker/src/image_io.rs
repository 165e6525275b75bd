//! Decoding untrusted input images within limits, and encoding outputs as PNG with their generation
//! parameters in a `tEXt` chunk (key `parameters`, as A1111 and most viewers read it).

use image::{ImageFormat, ImageReader, RgbImage};
use vnfarm_proto::spec::MAX_INPUT_SIDE;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("input is not a PNG, JPEG or WebP image")]
    UnknownFormat,
    #[error("input image is {width}x{height}; at most {max} pixels a side")]
    TooLarge { width: u32, height: u32, max: u32 },
    #[error("input image cannot be decoded: {0}")]
    Corrupt(String),
}

/// Decodes PNG, JPEG or WebP; checks the size from the header before decoding any pixels.
pub fn decode_input(bytes: &[u8]) -> Result<RgbImage, ImageError> {
    let reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        _ => return Err(ImageError::UnknownFormat),
    }
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    if width > MAX_INPUT_SIDE || height > MAX_INPUT_SIDE || width == 0 || height == 0 {
        return Err(ImageError::TooLarge {
            width,
            height,
            max: MAX_INPUT_SIDE,
        });
    }
    let mut reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_INPUT_SIDE);
    limits.max_image_height = Some(MAX_INPUT_SIDE);
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    Ok(img.to_rgb8())
}

/// Encodes RGB8 as PNG with `parameters` text.
pub fn encode_png(image: &RgbImage, parameters: &str) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, image.width(), image.height());
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        // Latin-1 only in tEXt; iTXt carries UTF-8 prompts.
        encoder
            .add_itxt_chunk("parameters".into(), parameters.into())
            .expect("iTXt keyword 'parameters' is valid");
        let mut writer = encoder
            .write_header()
            .expect("writing a PNG header to a Vec cannot fail");
        writer
            .write_image_data(image.as_raw())
            .expect("buffer length matches the declared size");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_round_trips_with_parameters() {
        let img = RgbImage::from_fn(8, 4, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let bytes = encode_png(&img, "prompt: a cat (smiling)");
        assert_eq!(decode_input(&bytes).unwrap(), img);
        let decoder = png::Decoder::new(std::io::Cursor::new(&bytes));
        let reader = decoder.read_info().unwrap();
        let text = &reader.info().utf8_text[0];
        assert_eq!(text.keyword, "parameters");
        assert_eq!(text.get_text().unwrap(), "prompt: a cat (smiling)");
    }

    #[test]
    fn garbage_and_huge_images_are_rejected() {
        assert!(matches!(
            decode_input(b"not an image at all"),
            Err(ImageError::UnknownFormat)
        ));
        let mut truncated = encode_png(&RgbImage::new(64, 64), "x");
        truncated.truncate(60);
        assert!(decode_input(&truncated).is_err());
        let huge = encode_png(&RgbImage::new(4097, 1), "x");
        assert!(matches!(
            decode_input(&huge),
            Err(ImageError::TooLarge { width: 4097, .. })
        ));
    }
}
