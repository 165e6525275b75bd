//! [`EncodedInputs`] as bytes, so that a worker can hand the encodings of an input set to the
//! others through shared storage instead of each encoding it again.
//!
//! The layout is a safetensors file (the `safetensors` crate): the packed VAE latents
//! (`image_latents`, `[1, N, C]`) and the vision tower's features (`features`, `[T, hidden]`) in
//! their device dtype, with the shapes that give them meaning in the metadata (`latent_shapes`,
//! `grid_thw`, `tokens_per_image`, `last_input_size`, as JSON), a `format` tag and the sha256 of
//! the data (`sha256`). Reading checks everything an edit relies on (tag, checksum, dtypes, ranks,
//! token counts against the shapes, the model's channel and hidden sizes), so a truncated, corrupt
//! or foreign file is an error, never a wrong image. Bytes round-trip exactly: the tensors are copied, not converted.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use crate::qwen_image::encoded::EncodedInputs;
use crate::qwen2_5_vl::text_encoder::ImageFeatures;

/// The `format` metadata of this layout; another value is refused.
pub const FORMAT: &str = "vnfarm.qwen_edit.encodings.v1";

/// Why bytes are not usable encodings.
#[derive(Debug, thiserror::Error)]
#[error("encodings: {0}")]
pub struct EncodingsError(String);

impl EncodingsError {
    /// A libtorch failure while moving the tensors to the device.
    pub fn backend(message: String) -> Self {
        Self(message)
    }
}

fn err(message: impl Into<String>) -> EncodingsError {
    EncodingsError(message.into())
}

/// What the loading pipeline needs the encodings to be: dtype, device and width of each tensor.
#[derive(Debug, Clone, Copy)]
pub struct Expected {
    pub latents_kind: Kind,
    pub latents_device: Device,
    /// Packed latent channels (the transformer's `in_channels`).
    pub latent_channels: i64,
    pub features_kind: Kind,
    pub features_device: Device,
    /// The text model's hidden size.
    pub hidden: i64,
}

fn dtype_of(kind: Kind) -> Result<Dtype, EncodingsError> {
    match kind {
        Kind::BFloat16 => Ok(Dtype::BF16),
        Kind::Half => Ok(Dtype::F16),
        Kind::Float => Ok(Dtype::F32),
        other => Err(err(format!("{other:?} tensors are not stored"))),
    }
}

/// The tensor's bytes on the host, contiguous, in its own dtype.
fn host_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let n = t.numel();
    let mut bytes = vec![0u8; n * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut bytes, n);
    bytes
}

fn dims(t: &Tensor) -> Vec<usize> {
    t.size().iter().map(|&d| d as usize).collect()
}

/// The encodings as a safetensors file.
pub fn to_bytes(e: &EncodedInputs) -> Result<Vec<u8>, EncodingsError> {
    let latents = host_bytes(&e.image_latents);
    let features = host_bytes(&e.features.features);
    let views = [
        (
            "image_latents",
            TensorView::new(
                dtype_of(e.image_latents.kind())?,
                dims(&e.image_latents),
                &latents,
            ),
        ),
        (
            "features",
            TensorView::new(
                dtype_of(e.features.features.kind())?,
                dims(&e.features.features),
                &features,
            ),
        ),
    ];
    let views = views
        .into_iter()
        .map(|(name, view)| {
            view.map(|v| (name, v))
                .map_err(|e| err(format!("{name}: {e:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let json = |v: serde_json::Value| v.to_string();
    let sha256 = data_sha256(&[&latents, &features]);
    let metadata: HashMap<String, String> = [
        ("format".to_string(), FORMAT.to_string()),
        ("sha256".into(), sha256),
        (
            "latent_shapes".into(),
            json(serde_json::json!(e.latent_shapes)),
        ),
        (
            "grid_thw".into(),
            json(serde_json::json!(e.features.grid_thw)),
        ),
        (
            "tokens_per_image".into(),
            json(serde_json::json!(e.features.tokens_per_image)),
        ),
        (
            "last_input_size".into(),
            json(serde_json::json!(e.last_input_size)),
        ),
    ]
    .into_iter()
    .collect();
    safetensors::tensor::serialize(views, &Some(metadata)).map_err(|e| err(format!("{e:?}")))
}

/// Hex sha256 of the tensors' bytes, in order.
fn data_sha256(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    hex::encode(h.finalize())
}

fn meta<T: serde::de::DeserializeOwned>(
    metadata: &HashMap<String, String>,
    key: &str,
) -> Result<T, EncodingsError> {
    let text = metadata
        .get(key)
        .ok_or_else(|| err(format!("no `{key}` in the metadata")))?;
    serde_json::from_str(text).map_err(|e| err(format!("`{key}`: {e}")))
}

fn tensor(
    file: &SafeTensors<'_>,
    name: &str,
    kind: Kind,
    device: Device,
) -> Result<Tensor, EncodingsError> {
    let view = file
        .tensor(name)
        .map_err(|e| err(format!("{name}: {e:?}")))?;
    if view.dtype() != dtype_of(kind)? {
        return Err(err(format!(
            "{name} is {:?}, this model computes in {kind:?}",
            view.dtype()
        )));
    }
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    Ok(Tensor::from_data_size(view.data(), &shape, kind).to_device(device))
}

/// Encodings read back from [`to_bytes`]'s layout onto the devices in `expected`, or why they are
/// not usable by this model.
pub fn from_bytes(bytes: &[u8], expected: &Expected) -> Result<EncodedInputs, EncodingsError> {
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| err(format!("header: {e:?}")))?;
    let metadata = header
        .metadata()
        .as_ref()
        .ok_or_else(|| err("no metadata"))?;
    let format: String = metadata
        .get("format")
        .cloned()
        .ok_or_else(|| err("no `format` in the metadata"))?;
    if format != FORMAT {
        return Err(err(format!("format `{format}`, expected `{FORMAT}`")));
    }
    let latent_shapes: Vec<(i64, i64, i64)> = meta(metadata, "latent_shapes")?;
    let grid_thw: Vec<(i64, i64, i64)> = meta(metadata, "grid_thw")?;
    let tokens_per_image: Vec<i64> = meta(metadata, "tokens_per_image")?;
    let last_input_size: (u32, u32) = meta(metadata, "last_input_size")?;

    let file = SafeTensors::deserialize(bytes).map_err(|e| err(format!("{e:?}")))?;
    let data = |name: &str| {
        file.tensor(name)
            .map(|v| v.data())
            .map_err(|e| err(format!("{name}: {e:?}")))
    };
    let sha256 = data_sha256(&[data("image_latents")?, data("features")?]);
    if metadata.get("sha256") != Some(&sha256) {
        return Err(err("the data does not match its sha256 (damaged)"));
    }
    let image_latents = tensor(
        &file,
        "image_latents",
        expected.latents_kind,
        expected.latents_device,
    )?;
    let features = tensor(
        &file,
        "features",
        expected.features_kind,
        expected.features_device,
    )?;

    if latent_shapes.is_empty() || latent_shapes.len() > 3 || latent_shapes.len() != grid_thw.len()
    {
        return Err(err(format!(
            "{} latent shapes for {} images",
            latent_shapes.len(),
            grid_thw.len()
        )));
    }
    if grid_thw.len() != tokens_per_image.len() {
        return Err(err("grid_thw and tokens_per_image differ in length"));
    }
    if last_input_size.0 == 0 || last_input_size.1 == 0 {
        return Err(err("an empty last input size"));
    }
    let positive = |&(t, h, w): &(i64, i64, i64)| t > 0 && h > 0 && w > 0;
    if !latent_shapes.iter().all(positive) || !grid_thw.iter().all(positive) {
        return Err(err("a shape with a zero or negative side"));
    }
    let tokens: i64 = latent_shapes.iter().map(|(t, h, w)| t * h * w).sum();
    if image_latents.size() != [1, tokens, expected.latent_channels] {
        return Err(err(format!(
            "image_latents {:?}, expected [1, {tokens}, {}]",
            image_latents.size(),
            expected.latent_channels
        )));
    }
    let rows: i64 = tokens_per_image.iter().sum();
    if tokens_per_image.iter().any(|&t| t <= 0) || features.size() != [rows, expected.hidden] {
        return Err(err(format!(
            "features {:?}, expected [{rows}, {}]",
            features.size(),
            expected.hidden
        )));
    }
    Ok(EncodedInputs {
        image_latents,
        latent_shapes,
        features: ImageFeatures {
            grid_thw,
            features,
            tokens_per_image,
        },
        last_input_size,
    })
}
