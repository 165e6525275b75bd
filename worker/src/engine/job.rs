//! What the async side hands an engine and gets back: a job with its decoded inputs and its
//! cancellation flag, its step progress, and its output.

use image::{DynamicImage, RgbImage};
use vnfarm_models::esrgan::upscaler::Upscaled;
use vnfarm_proto::{JobId, ModelFamily, StageTimings, Task};

use super::cancel::Cancel;
use super::catalogue_checkpoints::FetchedCheckpoint;
use super::encode_cache::CacheLookup;
use super::files::UsedFile;
use super::lora_dir::FetchedLoras;

/// One unit of work for an engine: a task with its decoded input images, in the task's order, and
/// the job's own cancellation flag.
#[derive(Debug)]
pub struct EngineJob {
    pub job_id: JobId,
    pub task: Task,
    pub inputs: Vec<InputImage>,
    pub cancel: Cancel,
    /// Its LoRAs from the model catalogue, fetched before it came (the folder's own are found by
    /// the engine).
    pub fetched: FetchedLoras,
    /// A generate's checkpoint from the model catalogue, fetched before it came (none for the
    /// engine's own checkpoint).
    pub checkpoint: Option<FetchedCheckpoint>,
}

/// A decoded input image and the sha256 (hex) of the bytes it was decoded from: the key of its
/// encodings in an engine's cache.
#[derive(Debug, Clone)]
pub struct InputImage {
    /// 8-bit RGB, alpha flattened onto white: what the generative models take.
    pub image: RgbImage,
    /// The image as stored, for tasks that keep its layout (upscales), when that layout is not
    /// 8-bit RGB (alpha, greyscale, 16-bit samples); `None` otherwise.
    pub stored: Option<DynamicImage>,
    pub sha256: String,
}

/// The content key of an input set: the model family, then each input's sha256 in prompt order.
pub fn content_key(inputs: &[InputImage]) -> String {
    let shas: Vec<&str> = inputs.iter().map(|i| i.sha256.as_str()).collect();
    format!("{}:{}", ModelFamily::QwenEdit.as_str(), shas.join("+"))
}

impl InputImage {
    /// The image in its stored layout (for upscales): `stored`, else the RGB8 image.
    pub fn into_stored(self) -> DynamicImage {
        self.stored.unwrap_or(DynamicImage::ImageRgb8(self.image))
    }
}

#[derive(Debug)]
pub struct EngineOutput {
    /// In the layout the engine made: 8-bit RGB, or an upscale's input layout.
    pub images: Vec<OutputImage>,
    /// Seed of each image, where the model uses one.
    pub seeds: Vec<Option<u64>>,
    /// Per stage. In a batch, a shared stage's time is split across the jobs that shared it, except
    /// `encode`, which only the job that encoded the inputs reports.
    pub timings: StageTimings,
    /// For a job that encodes inputs (an edit): whether the encodings were in the cache.
    pub encode_cache: Option<CacheLookup>,
    /// The model and LoRA files that made the images ([`Engine::files`](super::Engine::files); the engines leave it
    /// empty and [`Engine::run_batch`](super::Engine::run_batch) fills it in).
    pub files: Vec<UsedFile>,
}

/// An image an engine made, as the engine hands it back: finished, or with host work left that
/// runs off the engine thread (on the blocking pool, beside the PNG encode), so the engine starts
/// its next run at once.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputImage {
    Finished(DynamicImage),
    /// An upscale at its network's scale, resampled to the job's by [`OutputImage::finish`].
    Upscaled(Upscaled),
}

impl OutputImage {
    /// The finished image's width and height.
    pub fn size(&self) -> (u32, u32) {
        match self {
            OutputImage::Finished(image) => (image.width(), image.height()),
            OutputImage::Upscaled(upscaled) => upscaled.size(),
        }
    }

    /// The finished image: host work for an upscale whose scale is not its network's (see
    /// [`Upscaled::finish`]).
    pub fn finish(self) -> DynamicImage {
        match self {
            OutputImage::Finished(image) => image,
            OutputImage::Upscaled(upscaled) => upscaled.finish(),
        }
    }
}

impl From<DynamicImage> for OutputImage {
    fn from(image: DynamicImage) -> Self {
        OutputImage::Finished(image)
    }
}

/// Step progress reported by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub step: u32,
    pub total: u32,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn job(task: Task) -> EngineJob {
        EngineJob {
            job_id: JobId::new(),
            task,
            inputs: Vec::new(),
            cancel: Cancel::default(),
            fetched: FetchedLoras::default(),
            checkpoint: None,
        }
    }

    /// An edit of the stored image `input` (a blank 32×32 image with `input`'s hash as its sha256).
    pub(crate) fn edit(input: &str, instruction: &str) -> EngineJob {
        use sha2::{Digest, Sha256};
        let mut job = job(Task::Edit(vnfarm_proto::EditSpec {
            input: Some(vnfarm_proto::ImageRef::Stored(input.into())),
            inputs: Vec::new(),
            instruction: instruction.into(),
            width: None,
            height: None,
            steps: 4,
            cfg: 1.0,
            seed: Some(3),
            loras: Vec::new(),
        }));
        job.inputs.push(InputImage {
            image: image::RgbImage::new(32, 32),
            stored: None,
            sha256: hex::encode(Sha256::digest(input.as_bytes())),
        });
        job
    }
}
