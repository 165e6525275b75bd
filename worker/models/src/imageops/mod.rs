//! Image operations whose exact bytes matter to parity with the Python pipelines (which resize
//! with Pillow before any tensor exists).
//! - [`resample`]: Pillow's `Image.resize` for 8-bit RGB, byte for byte.

pub mod resample;

pub use resample::{Filter, ResizeError, resize};
