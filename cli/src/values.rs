//! What the value of one `submit` flag means: the parsers clap calls on `--input`, `--lora`,
//! `--upscale` and `--scale` (text in, a typed value or a message out), and an `--input` file read
//! into an inline image when the submission is built.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use vnfarm_proto::catalogue::HASH_REF_PREFIX;
use vnfarm_proto::spec::MAX_INLINE_IMAGE_BYTES;
use vnfarm_proto::{ImageRef, JobId, LoraRef, PipelineImage};

/// An `--input` as given: a file still to be read, or a reference the scheduler resolves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputArg {
    File(PathBuf),
    Ref(ImageRef),
}

impl InputArg {
    /// Reads a file input into an inline (base64) reference.
    pub fn resolve(&self) -> anyhow::Result<ImageRef> {
        match self {
            InputArg::Ref(image) => Ok(image.clone()),
            InputArg::File(path) => {
                let bytes =
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                if bytes.len() > MAX_INLINE_IMAGE_BYTES {
                    bail!(
                        "{}: {} bytes is over the {} MiB limit for an inline image",
                        path.display(),
                        bytes.len(),
                        MAX_INLINE_IMAGE_BYTES / (1024 * 1024)
                    );
                }
                Ok(ImageRef::Inline(
                    base64::engine::general_purpose::STANDARD.encode(bytes),
                ))
            }
        }
    }
}

/// `KEY` (under `inputs/` or `results/`), `@file.png`, or `job:<uuid>[:index]`.
pub fn parse_input(s: &str) -> Result<InputArg, String> {
    if let Some(path) = s.strip_prefix('@') {
        if path.is_empty() {
            return Err("@ must be followed by a file path".into());
        }
        return Ok(InputArg::File(PathBuf::from(path)));
    }
    if let Some(rest) = s.strip_prefix("job:") {
        let (id, index) = rest.split_once(':').unwrap_or((rest, "0"));
        let job: JobId = id
            .parse()
            .map_err(|e| format!("{id:?} is not a job id: {e}"))?;
        let index = index
            .parse()
            .map_err(|_| format!("{index:?} is not an output index"))?;
        return Ok(InputArg::Ref(ImageRef::JobOutput { job, index }));
    }
    if s.starts_with("inputs/") || s.starts_with("results/") {
        return Ok(InputArg::Ref(ImageRef::Stored(s.to_owned())));
    }
    Err("expected a key under inputs/ or results/, @file.png, or job:<uuid>[:index]".into())
}

/// `name` or `name:weight`.
pub fn parse_lora(s: &str) -> Result<LoraRef, String> {
    // `sha256:<hex>[:weight]`: the first colon is the reference's own.
    let (prefix, s) = match s.strip_prefix(HASH_REF_PREFIX) {
        Some(rest) => (HASH_REF_PREFIX, rest),
        None => ("", s),
    };
    let (name, weight) = match s.rsplit_once(':') {
        Some((name, weight)) => {
            let w: f32 = weight
                .parse()
                .map_err(|_| format!("{weight:?} is not a LoRA weight"))?;
            if !w.is_finite() {
                return Err(format!("{weight:?} is not a finite LoRA weight"));
            }
            (name, w)
        }
        None => (s, 1.0),
    };
    if name.is_empty() {
        return Err("the LoRA name is empty".into());
    }
    Ok(LoraRef {
        name: format!("{prefix}{name}"),
        weight,
    })
}

/// `base` or `edit:N`.
pub fn parse_pipeline_image(s: &str) -> Result<PipelineImage, String> {
    if s == "base" {
        return Ok(PipelineImage::Base);
    }
    let n = s
        .strip_prefix("edit:")
        .ok_or_else(|| format!("{s:?} is not `base` or `edit:N`"))?;
    n.parse()
        .map(PipelineImage::Edit)
        .map_err(|_| format!("{n:?} is not an edit index"))
}

pub fn parse_scale(s: &str) -> Result<u32, String> {
    match s {
        "2" => Ok(2),
        "4" => Ok(4),
        _ => Err(format!("{s:?}: the scale is 2 or 4")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_parse_into_image_refs() {
        let id = JobId::new();
        assert_eq!(
            parse_input(&format!("job:{id}:1")),
            Ok(InputArg::Ref(ImageRef::JobOutput { job: id, index: 1 }))
        );
        assert_eq!(
            parse_input(&format!("job:{id}")),
            Ok(InputArg::Ref(ImageRef::JobOutput { job: id, index: 0 }))
        );
        assert_eq!(
            parse_input("inputs/a.png"),
            Ok(InputArg::Ref(ImageRef::Stored("inputs/a.png".into())))
        );
        assert_eq!(
            parse_input("results/x/0.png"),
            Ok(InputArg::Ref(ImageRef::Stored("results/x/0.png".into())))
        );
        for bad in [
            "a.png",
            "/etc/passwd",
            "job:nope",
            &format!("job:{id}:x"),
            "@",
            "s3://b/inputs/a",
        ] {
            assert!(parse_input(bad).is_err(), "{bad}");
        }
    }
}
