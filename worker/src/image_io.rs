//! Decoding untrusted input images within limits, and encoding outputs as PNG with their generation
//! parameters in a `tEXt` chunk (key `parameters`, as A1111 and most viewers read it).
//!
//! Inputs decode as stored ([`decode_input_as_stored`]: 8- or 16-bit grey, grey + alpha, RGB or RGBA,
//! which is what upscales keep), and for the generative models end as 8-bit RGB
//! ([`decode_input`], [`flatten_to_rgb8`]), or as a typed error that says why not:
//! - greyscale (any bit depth) and palette PNGs expand to RGB (the decoder applies the palette and
//!   `tRNS`, then grey is replicated into the three channels);
//! - 16-bit samples become 8-bit by rounding `v * 255 / 65535`;
//! - alpha (RGBA, grey+alpha, palette with `tRNS`) is flattened onto white,
//!   `round(c * a + 255 * (1 - a))` with `a` in 0..=1: a sprite on a transparent background is
//!   meant to be seen on a page, and a transparent pixel's colour channels are often arbitrary
//!   (black, or garbage left by the editor), which dropping the alpha would expose;
//! - CMYK JPEGs (Adobe/Photoshop style) are converted to RGB by the decoder, as Pillow does;
//! - sizes are checked from the header before any pixel is decoded: empty and over-large images are
//!   rejected, and the decoder runs under the same limits; truncated or corrupt data is an error.

use image::{DynamicImage, ImageFormat, ImageReader, Rgb, RgbImage, Rgba};
use vnfarm_proto::spec::MAX_INPUT_SIDE;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("input is not a PNG, JPEG or WebP image")]
    UnknownFormat,
    #[error("input image is {width}x{height}; at most {max} pixels a side")]
    TooLarge { width: u32, height: u32, max: u32 },
    #[error("input image is {width}x{height}; it has no pixels")]
    Empty { width: u32, height: u32 },
    #[error("input image uses a feature the decoder does not support: {0}")]
    Unsupported(String),
    #[error("input image cannot be decoded: {0}")]
    Corrupt(String),
}

impl From<image::ImageError> for ImageError {
    fn from(e: image::ImageError) -> Self {
        match e {
            image::ImageError::Unsupported(e) => ImageError::Unsupported(e.to_string()),
            other => ImageError::Corrupt(other.to_string()),
        }
    }
}

/// Decodes PNG, JPEG or WebP to 8-bit RGB (see the module docs for each kind of input); checks the
/// size from the header before decoding any pixels.
pub fn decode_input(bytes: &[u8]) -> Result<RgbImage, ImageError> {
    decode_input_as_stored(bytes).map(flatten_to_rgb8)
}

/// Decodes PNG, JPEG or WebP keeping alpha, greyscale and 16-bit samples (palettes and CMYK are
/// expanded by the decoder): the result is one of the 8- or 16-bit grey, grey + alpha, RGB and
/// RGBA layouts. Checks the size from the header before decoding any pixels.
pub fn decode_input_as_stored(bytes: &[u8]) -> Result<DynamicImage, ImageError> {
    let reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        _ => return Err(ImageError::UnknownFormat),
    }
    let (width, height) = reader.into_dimensions()?;
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    if width > MAX_INPUT_SIDE || height > MAX_INPUT_SIDE {
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
    Ok(match reader.decode()? {
        img @ (DynamicImage::ImageLuma8(_)
        | DynamicImage::ImageLumaA8(_)
        | DynamicImage::ImageRgb8(_)
        | DynamicImage::ImageRgba8(_)
        | DynamicImage::ImageLuma16(_)
        | DynamicImage::ImageLumaA16(_)
        | DynamicImage::ImageRgb16(_)
        | DynamicImage::ImageRgba16(_)) => img,
        // Float layouts (none of the three formats decodes to them today): 16-bit RGBA carries
        // every value a PNG, JPEG or WebP can hold.
        other => DynamicImage::ImageRgba16(other.to_rgba16()),
    })
}

/// Converts any decoded layout to 8-bit RGB: exact for 8-bit RGB and grey, rounding for 16 bits,
/// alpha flattened onto white at the source bit depth.
pub fn flatten_to_rgb8(img: DynamicImage) -> RgbImage {
    match img {
        DynamicImage::ImageRgb8(rgb) => rgb,
        DynamicImage::ImageLuma8(_) => img.to_rgb8(),
        DynamicImage::ImageRgba8(_) | DynamicImage::ImageLumaA8(_) => {
            let rgba = img.to_rgba8();
            RgbImage::from_fn(rgba.width(), rgba.height(), |x, y| {
                let Rgba([r, g, b, a]) = *rgba.get_pixel(x, y);
                Rgb([r, g, b].map(|c| over_white(c.into(), a.into(), 255) as u8))
            })
        }
        DynamicImage::ImageRgb16(_) | DynamicImage::ImageLuma16(_) => {
            let rgb = img.to_rgb16();
            RgbImage::from_fn(rgb.width(), rgb.height(), |x, y| {
                Rgb(rgb.get_pixel(x, y).0.map(u16_to_u8))
            })
        }
        // 16-bit with alpha, and any float layout a future decoder might produce: 16 bits carry
        // every 8-bit result exactly.
        _ => {
            let rgba = img.to_rgba16();
            RgbImage::from_fn(rgba.width(), rgba.height(), |x, y| {
                let Rgba([r, g, b, a]) = *rgba.get_pixel(x, y);
                Rgb([r, g, b].map(|c| u16_to_u8(over_white(c, a, 65535))))
            })
        }
    }
}

/// `round((c * a + max * (max - a)) / max)`: colour `c` at opacity `a / max` over white, in integers.
fn over_white(c: u16, a: u16, max: u16) -> u16 {
    let (c, a, max) = (u64::from(c), u64::from(a), u64::from(max));
    // c, a <= max, so the result is at most max.
    ((c * a + max * (max - a) + max / 2) / max) as u16
}

/// `round(v * 255 / 65535)`.
fn u16_to_u8(v: u16) -> u8 {
    ((u32::from(v) * 255 + 65535 / 2) / 65535) as u8
}

/// Encodes an image as PNG with `parameters` text, in its own layout: 8- or 16-bit grey, grey +
/// alpha, RGB or RGBA (any other layout is written as 16-bit RGBA).
pub fn encode_png(image: &DynamicImage, parameters: &str) -> Vec<u8> {
    use png::{BitDepth, ColorType};
    let converted;
    let image = match image {
        DynamicImage::ImageLuma8(_)
        | DynamicImage::ImageLumaA8(_)
        | DynamicImage::ImageRgb8(_)
        | DynamicImage::ImageRgba8(_)
        | DynamicImage::ImageLuma16(_)
        | DynamicImage::ImageLumaA16(_)
        | DynamicImage::ImageRgb16(_)
        | DynamicImage::ImageRgba16(_) => image,
        other => {
            converted = DynamicImage::ImageRgba16(other.to_rgba16());
            &converted
        }
    };
    let (color, depth) = match image {
        DynamicImage::ImageLuma8(_) => (ColorType::Grayscale, BitDepth::Eight),
        DynamicImage::ImageLumaA8(_) => (ColorType::GrayscaleAlpha, BitDepth::Eight),
        DynamicImage::ImageRgba8(_) => (ColorType::Rgba, BitDepth::Eight),
        DynamicImage::ImageLuma16(_) => (ColorType::Grayscale, BitDepth::Sixteen),
        DynamicImage::ImageLumaA16(_) => (ColorType::GrayscaleAlpha, BitDepth::Sixteen),
        DynamicImage::ImageRgb16(_) => (ColorType::Rgb, BitDepth::Sixteen),
        DynamicImage::ImageRgba16(_) => (ColorType::Rgba, BitDepth::Sixteen),
        _ => (ColorType::Rgb, BitDepth::Eight),
    };
    // PNG stores 16-bit samples big-endian.
    let data: std::borrow::Cow<[u8]> = match depth {
        BitDepth::Sixteen => image
            .as_bytes()
            .chunks_exact(2)
            .flat_map(|b| u16::from_ne_bytes([b[0], b[1]]).to_be_bytes())
            .collect::<Vec<u8>>()
            .into(),
        _ => image.as_bytes().into(),
    };
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, image.width(), image.height());
        encoder.set_color(color);
        encoder.set_depth(depth);
        // Latin-1 only in tEXt; iTXt carries UTF-8 prompts.
        encoder
            .add_itxt_chunk("parameters".into(), parameters.into())
            .expect("iTXt keyword 'parameters' is valid");
        let mut writer = encoder
            .write_header()
            .expect("writing a PNG header to a Vec cannot fail");
        writer
            .write_image_data(&data)
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
        let bytes = encode_png(
            &DynamicImage::ImageRgb8(img.clone()),
            "prompt: a cat (smiling)",
        );
        assert_eq!(decode_input(&bytes).unwrap(), img);
        let decoder = png::Decoder::new(std::io::Cursor::new(&bytes));
        let reader = decoder.read_info().unwrap();
        let text = &reader.info().utf8_text[0];
        assert_eq!(text.keyword, "parameters");
        assert_eq!(text.get_text().unwrap(), "prompt: a cat (smiling)");
    }

    #[test]
    fn every_layout_round_trips_as_stored() {
        let rgba = image::RgbaImage::from_fn(5, 3, |x, y| {
            image::Rgba([x as u8, y as u8, 7, 40 * x as u8])
        });
        let la16 = image::ImageBuffer::<image::LumaA<u16>, _>::from_fn(4, 2, |x, y| {
            image::LumaA([x as u16 * 20000 + 1, y as u16 * 60000])
        });
        let rgb16 = image::ImageBuffer::<image::Rgb<u16>, _>::from_fn(3, 3, |x, y| {
            image::Rgb([x as u16 * 30001, y as u16 * 257, 65535])
        });
        let grey = image::GrayImage::from_fn(2, 2, |x, y| image::Luma([(x * 100 + y) as u8]));
        for img in [
            DynamicImage::ImageRgba8(rgba),
            DynamicImage::ImageLumaA16(la16),
            DynamicImage::ImageRgb16(rgb16),
            DynamicImage::ImageLuma8(grey),
        ] {
            let back = decode_input_as_stored(&encode_png(&img, "x")).unwrap();
            assert_eq!(back, img, "{:?}", img.color());
        }
    }

    #[test]
    fn garbage_and_huge_images_are_rejected() {
        assert!(matches!(
            decode_input(b"not an image at all"),
            Err(ImageError::UnknownFormat)
        ));
        let mut truncated = encode_png(&DynamicImage::ImageRgb8(RgbImage::new(64, 64)), "x");
        truncated.truncate(60);
        assert!(decode_input(&truncated).is_err());
        let huge = encode_png(&DynamicImage::ImageRgb8(RgbImage::new(4097, 1)), "x");
        assert!(matches!(
            decode_input(&huge),
            Err(ImageError::TooLarge { width: 4097, .. })
        ));
    }

    /// Encodes raw samples as a PNG of the given layout (big-endian samples for 16 bits, as PNG
    /// stores them).
    fn png_bytes(
        width: u32,
        height: u32,
        color: png::ColorType,
        depth: png::BitDepth,
        palette: Option<(&[u8], &[u8])>,
        data: &[u8],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(color);
        encoder.set_depth(depth);
        if let Some((plte, trns)) = palette {
            encoder.set_palette(plte.to_vec());
            if !trns.is_empty() {
                encoder.set_trns(trns.to_vec());
            }
        }
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(data).unwrap();
        writer.finish().unwrap();
        out
    }

    fn pixels(img: &RgbImage) -> Vec<[u8; 3]> {
        img.pixels().map(|p| p.0).collect()
    }

    #[test]
    fn rgba_is_flattened_onto_white() {
        use png::{BitDepth, ColorType};
        #[rustfmt::skip]
        let data = [
            10, 20, 30, 255, // opaque: unchanged
            0, 0, 0, 0, // transparent black: white
            200, 100, 0, 0, // transparent colour: white too
            0, 0, 0, 128, // half-transparent black: round(255 * 127 / 255)
            255, 0, 100, 51, // round((c * 51 + 255 * 204) / 255)
        ];
        let bytes = png_bytes(5, 1, ColorType::Rgba, BitDepth::Eight, None, &data);
        let img = decode_input(&bytes).unwrap();
        assert_eq!(
            pixels(&img),
            [
                [10, 20, 30],
                [255, 255, 255],
                [255, 255, 255],
                [127, 127, 127],
                [255, 204, 224],
            ]
        );
    }

    #[test]
    fn grey_with_alpha_is_flattened_onto_white() {
        use png::{BitDepth, ColorType};
        let data = [0, 0, 90, 255, 0, 128];
        let bytes = png_bytes(
            3,
            1,
            ColorType::GrayscaleAlpha,
            BitDepth::Eight,
            None,
            &data,
        );
        let img = decode_input(&bytes).unwrap();
        assert_eq!(pixels(&img), [[255; 3], [90; 3], [127; 3]]);
    }

    #[test]
    fn greyscale_pngs_of_any_depth_become_rgb() {
        use png::{BitDepth, ColorType};
        let eight = png_bytes(
            3,
            1,
            ColorType::Grayscale,
            BitDepth::Eight,
            None,
            &[0, 77, 255],
        );
        assert_eq!(
            pixels(&decode_input(&eight).unwrap()),
            [[0; 3], [77; 3], [255; 3]]
        );
        // 1 bit: 0b1010_0000 is white, black, white, black (8 px, one byte).
        let one = png_bytes(
            4,
            1,
            ColorType::Grayscale,
            BitDepth::One,
            None,
            &[0b1010_0000],
        );
        assert_eq!(
            pixels(&decode_input(&one).unwrap()),
            [[255; 3], [0; 3], [255; 3], [0; 3]]
        );
    }

    #[test]
    fn palette_pngs_become_rgb_with_transparent_entries_on_white() {
        use png::{BitDepth, ColorType};
        let plte = [255, 0, 0, 0, 255, 0, 0, 0, 0];
        let opaque = png_bytes(
            3,
            1,
            ColorType::Indexed,
            BitDepth::Eight,
            Some((&plte, &[])),
            &[0, 1, 2],
        );
        assert_eq!(
            pixels(&decode_input(&opaque).unwrap()),
            [[255, 0, 0], [0, 255, 0], [0, 0, 0]]
        );
        // tRNS: entry 2 (black) fully transparent, entry 1 half.
        let trns = [255, 128, 0];
        let keyed = png_bytes(
            3,
            1,
            ColorType::Indexed,
            BitDepth::Eight,
            Some((&plte, &trns)),
            &[0, 1, 2],
        );
        assert_eq!(
            pixels(&decode_input(&keyed).unwrap()),
            [[255, 0, 0], [127, 255, 127], [255, 255, 255]]
        );
    }

    #[test]
    fn sixteen_bit_pngs_round_to_eight_bits() {
        use png::{BitDepth, ColorType};
        // 0, 65535, 128 (-> 0.498, rounds down), 129 (-> 0.502, rounds up), 257 * 100 + 128 (-> 100.498).
        let samples: [u16; 6] = [0, 65535, 128, 129, 25828, 65535];
        let data: Vec<u8> = samples.iter().flat_map(|v| v.to_be_bytes()).collect();
        let rgb = png_bytes(2, 1, ColorType::Rgb, BitDepth::Sixteen, None, &data);
        assert_eq!(
            pixels(&decode_input(&rgb).unwrap()),
            [[0, 255, 0], [1, 100, 255]]
        );

        // Grey+alpha at 16 bits: black at alpha 32768/65535 over white, then to 8 bits.
        let la: Vec<u8> = [0u16, 32768, 65535, 0]
            .iter()
            .flat_map(|v| v.to_be_bytes())
            .collect();
        let bytes = png_bytes(
            2,
            1,
            ColorType::GrayscaleAlpha,
            BitDepth::Sixteen,
            None,
            &la,
        );
        // 65535 * 32767 / 65535 = 32767 -> round(32767 * 255 / 65535) = round(127.498) = 127.
        assert_eq!(pixels(&decode_input(&bytes).unwrap()), [[127; 3], [255; 3]]);
    }

    /// `tests/fixtures/cmyk.jpg` (Photoshop-style inverted CMYK with an Adobe marker) against
    /// Pillow's decode + `convert("RGB")` of the same file (`make_cmyk_fixture.py`, Pillow 13.0.0).
    /// Tolerance 2 per channel, for IDCT and CMYK->RGB rounding that may differ between the two
    /// decoders; measured: 0 (byte-identical, image 0.25.10 / zune-jpeg 0.5.15).
    #[test]
    fn cmyk_jpegs_decode_like_pillow() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let jpeg = std::fs::read(dir.join("cmyk.jpg")).unwrap();
        let expected = image::open(dir.join("cmyk_expected.png"))
            .unwrap()
            .into_rgb8();
        let got = decode_input(&jpeg).unwrap();
        assert_eq!(got.dimensions(), expected.dimensions());
        let max = got
            .as_raw()
            .iter()
            .zip(expected.as_raw())
            .map(|(&a, &b)| a.abs_diff(b))
            .max()
            .unwrap();
        assert!(max <= 2, "max |diff| against Pillow {max}");
    }

    #[test]
    fn zero_sized_and_truncated_inputs_are_errors() {
        // A PNG whose IHDR says 0x4 (CRC fixed up so only the size is wrong).
        let mut zero = encode_png(&DynamicImage::ImageRgb8(RgbImage::new(1, 4)), "x");
        zero[16..20].copy_from_slice(&0u32.to_be_bytes());
        let crc = crc32fast::hash(&zero[12..29]);
        zero[29..33].copy_from_slice(&crc.to_be_bytes());
        // The PNG decoder itself refuses a zero side in IHDR ("Invalid image dimensions");
        // `Empty` catches any format whose header would let one through.
        let err = decode_input(&zero).unwrap_err();
        assert!(
            matches!(err, ImageError::Empty { .. } | ImageError::Corrupt(_)),
            "{err}"
        );
        assert!(err.to_string().contains("dimensions"), "{err}");

        let mut jpeg = Vec::new();
        RgbImage::from_fn(64, 64, |x, y| image::Rgb([x as u8 * 4, y as u8 * 4, 9]))
            .write_to(&mut std::io::Cursor::new(&mut jpeg), ImageFormat::Jpeg)
            .unwrap();
        assert!(decode_input(&jpeg).is_ok());
        jpeg.truncate(jpeg.len() / 2);
        let err = decode_input(&jpeg).unwrap_err();
        assert!(matches!(err, ImageError::Corrupt(_)), "{err}");
    }
}
