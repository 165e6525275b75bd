//! [`EncodedInputs`]: an edit set's inputs after the VAE and the vision tower, which the pipeline's
//! `encode_inputs` makes once and every variant's edit reads, and which `encodings` writes as bytes
//! for other workers. A module of its own so that the byte form does not import the pipeline, which
//! imports the byte form.

use tch::Tensor;

use crate::qwen2_5_vl::text_encoder::ImageFeatures;

/// The inputs of one edit set, encoded once: what every variant shares.
#[derive(Debug)]
pub struct EncodedInputs {
    /// Packed, normalised VAE latents of every input, concatenated along the tokens `[1, N, C*4]`.
    pub image_latents: Tensor,
    /// `(1, h/2, w/2)` latent grid of each input, after the target's in `img_shapes`.
    pub latent_shapes: Vec<(i64, i64, i64)>,
    /// The vision tower's features of the condition copies.
    pub features: ImageFeatures,
    /// Size of the last input (the default output aspect ratio).
    pub last_input_size: (u32, u32),
}

impl EncodedInputs {
    /// Device bytes held (for the encode cache's bound).
    pub fn bytes(&self) -> usize {
        tensor_bytes(&self.image_latents) + tensor_bytes(&self.features.features)
    }
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}
