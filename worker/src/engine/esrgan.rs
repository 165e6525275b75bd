//! The Real-ESRGAN engine: `upscale` jobs (a pipeline's upscales are upscale jobs too) on
//! [`vnfarm_models::esrgan::upscaler::Upscaler`], kept warm for the worker's life.
//!
//! An image runs through the network tile by tile (the job's `tile` / `tile_overlap`, else this
//! engine's settings); progress is tiles done / total and cancellation is checked before every
//! forward. The job's `scale` is the output's: a model of another scale is resampled to it
//! (Lanczos-4, as Real-ESRGAN's `outscale`) after the engine's run, on the worker's blocking pool
//! beside the PNG encode ([`OutputImage::Upscaled`]), so the engine (and its device) does not wait
//! for that host work. The input's layout is kept: an alpha channel is
//! upscaled by the network as Real-ESRGAN does, grey stays grey, 16-bit samples stay 16-bit.
//! At start the model is loaded and every tile shape of the configured tiling runs once.

use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;
use vnfarm_models::esrgan::tiling::{Blend, TileSettings};
use vnfarm_models::esrgan::upscaler::{UpscaleOptions, Upscaler};
use vnfarm_models::settings::EsrganSettings;
use vnfarm_proto::spec::{MAX_INPUT_SIDE, MAX_UPSCALE_TILE, MIN_UPSCALE_TILE};
use vnfarm_proto::{ModelFileRole, StageTimings, Task};

use crate::tuning::SettingsChoice;

use super::device::{Dtype, engine_error, open_device, parse_device};
use super::{Cancel, EngineError, EngineJob, EngineOutput, OutputImage, Progress, UsedFile};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EsrganConfig {
    /// The model: a `.pth` as Real-ESRGAN releases them (`RealESRGAN_x4plus_anime_6B.pth`,
    /// `RealESRGAN_x4plus.pth`, `RealESRGAN_x2plus.pth`; original ESRGAN names load too) or its
    /// `.safetensors` conversion. Its size and scale are read off the tensors.
    pub model: PathBuf,
    /// `cuda`, `cuda:N` (ROCm devices are `cuda` too) or `cpu`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Compute precision: fp16 is Real-ESRGAN's own (`half=True`); fp32 on the CPU.
    #[serde(default = "default_dtype")]
    pub dtype: Dtype,
    /// `feather` (neighbouring tiles cross-fade over the overlap) or `crop` (Real-ESRGAN's hard
    /// cut, for outputs identical to its `tile_process`).
    #[serde(default)]
    pub blend: Blend,
    /// Tiles of the same shape per forward.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// Real-ESRGAN's `pre_pad`: reflect padding at the bottom and right, cut off again.
    #[serde(default)]
    pub pre_pad: u32,
    /// Layout and tiling choices (`vnfarm_models::settings::EsrganSettings`): a preset's name or a
    /// table (`memory_format`: `channels_last`, 15–20 % faster and less memory on the measured
    /// NVIDIA GPU, or `contiguous`, NCHW as Real-ESRGAN runs; `tile`, the tile side in input pixels
    /// for jobs that do not say and for the warm-up; `tile_overlap`, the context around each tile,
    /// at most a quarter of it). With `engine.settings_file` the file decides.
    #[serde(default)]
    pub settings: Option<SettingsChoice<EsrganSettings>>,
    /// Input image sizes `[width, height]` whose tile shapes the warm-up runs (each tile shape is
    /// slow once per process while its kernels are chosen). Empty: the sizes `engine.sdxl` and
    /// `engine.qwen_edit` warm up at (the images the farm makes, which upscales enlarge) or,
    /// without those engines, every shape of a 3 × 3 grid of tiles.
    #[serde(default)]
    pub warm_up: Vec<[u32; 2]>,
}

// Field defaults rather than a struct-wide `#[serde(default)]`: `model` is required, and a
// `Default` of the whole section would let one without it decode.
fn default_device() -> String {
    "cuda".into()
}
fn default_dtype() -> Dtype {
    Dtype::Fp16
}
fn default_max_batch() -> u32 {
    1
}

impl EsrganConfig {
    /// The network's weights.
    pub fn files(&self) -> Vec<UsedFile> {
        vec![UsedFile::named_by_file(
            &self.model,
            ModelFileRole::Upscaler,
        )]
    }

    pub fn validate(&self) -> Result<(), String> {
        parse_device(&self.device).map_err(|e| format!("engine.esrgan.device: {e}"))?;
        if let Some(choice) = &self.settings {
            validate_settings(&choice.resolve())?;
        }
        if !(1..=16).contains(&self.max_batch) {
            return Err("engine.esrgan.max_batch: must be 1..=16".into());
        }
        if self.pre_pad > 64 {
            return Err("engine.esrgan.pre_pad: at most 64".into());
        }
        for [w, h] in &self.warm_up {
            if !(1..=MAX_INPUT_SIDE).contains(w) || !(1..=MAX_INPUT_SIDE).contains(h) {
                return Err(format!(
                    "engine.esrgan.warm_up: {w}x{h} is not an image size (1..={MAX_INPUT_SIDE} a side)"
                ));
            }
        }
        Ok(())
    }

    /// This configuration warming up at `sizes` where it names no sizes of its own.
    pub fn warming_at(&self, sizes: impl IntoIterator<Item = [u32; 2]>) -> EsrganConfig {
        let mut c = self.clone();
        if c.warm_up.is_empty() {
            c.warm_up = sizes.into_iter().collect();
            c.warm_up.sort_unstable();
            c.warm_up.dedup();
        }
        c
    }

    fn tiles(&self, tile: u32, overlap: u32) -> TileSettings {
        TileSettings {
            tile: Some(i64::from(tile)),
            overlap: i64::from(overlap),
            blend: self.blend,
            max_batch: self.max_batch as usize,
        }
    }
}

/// Why an upscaler's settings cannot run (from the configuration or a settings file).
pub fn validate_settings(s: &EsrganSettings) -> Result<(), String> {
    if !(MIN_UPSCALE_TILE..=MAX_UPSCALE_TILE).contains(&s.tile) {
        return Err(format!(
            "engine.esrgan.settings.tile: {} is outside {MIN_UPSCALE_TILE}..={MAX_UPSCALE_TILE}",
            s.tile
        ));
    }
    if s.tile_overlap > s.tile / 4 {
        return Err(format!(
            "engine.esrgan.settings.tile_overlap: {} is more than a quarter of the tile ({})",
            s.tile_overlap, s.tile
        ));
    }
    Ok(())
}

pub struct EsrganEngine {
    upscaler: Upscaler,
    config: EsrganConfig,
    settings: EsrganSettings,
}

impl EsrganEngine {
    /// Loads the model onto the device and runs every tile shape of the configured tiling once.
    /// Any failure (missing file, a checkpoint that is not an RRDBNet, a refused pickle, no device)
    /// is an error naming what is wrong.
    pub fn load(config: &EsrganConfig, settings: EsrganSettings) -> anyhow::Result<Self> {
        let engine = Self::load_cold(config, settings)?;
        engine.warm_up()?;
        Ok(engine)
    }

    /// [`EsrganEngine::load`] without the warm-up (see [`EsrganEngine::warm_up`]).
    pub fn load_cold(config: &EsrganConfig, settings: EsrganSettings) -> anyhow::Result<Self> {
        validate_settings(&settings).map_err(anyhow::Error::msg)?;
        let device = open_device(&config.device, "engine.esrgan.device")?;
        let started = Instant::now();
        let mut upscaler =
            Upscaler::load(&config.model, device, config.dtype.kind()).map_err(|e| {
                anyhow::anyhow!("loading Real-ESRGAN from {}: {e}", config.model.display())
            })?;
        upscaler.set_memory_format(settings.memory_format);
        tracing::info!(
            model = %upscaler.describe(),
            ?device,
            seconds = started.elapsed().as_secs_f64(),
            "Real-ESRGAN loaded"
        );
        Ok(Self {
            upscaler,
            config: config.clone(),
            settings,
        })
    }

    /// Runs the tile shapes of the configured warm-up sizes once (see [`Upscaler::warm_up`]).
    pub fn warm_up(&self) -> anyhow::Result<()> {
        let started = Instant::now();
        let settings = &self.settings;
        let tiles = self.config.tiles(settings.tile, settings.tile_overlap);
        let sizes: Vec<(i64, i64)> = (self.config.warm_up.iter())
            .map(|&[w, h]| (i64::from(h), i64::from(w)))
            .collect();
        let pre_pad = i64::from(self.config.pre_pad);
        self.upscaler
            .warm_up(&tiles, &sizes, pre_pad)
            .map_err(|e| {
                anyhow::anyhow!(
                    "Real-ESRGAN warm-up with {}-pixel tiles: {e}",
                    settings.tile
                )
            })?;
        tracing::info!(
            model = "esrgan",
            tile = settings.tile,
            overlap = settings.tile_overlap,
            seconds = started.elapsed().as_secs_f64(),
            "warmed up"
        );
        Ok(())
    }

    /// The files every upscale is made from.
    pub fn files(&self) -> Vec<UsedFile> {
        self.config.files()
    }

    pub fn run(
        &mut self,
        job: EngineJob,
        progress: &mut dyn FnMut(Progress),
        cancel: &Cancel,
    ) -> Result<EngineOutput, EngineError> {
        let Task::Upscale(spec) = &job.task else {
            return Err(EngineError::Unsupported(job.task.model()));
        };
        let tile = spec.tile.unwrap_or(self.settings.tile);
        let overlap = spec.tile_overlap.unwrap_or(self.settings.tile_overlap);
        if overlap > tile / 4 {
            return Err(EngineError::InvalidInput(format!(
                "tile_overlap {overlap} is more than a quarter of the tile ({tile})"
            )));
        }
        let options = UpscaleOptions {
            outscale: Some(i64::from(spec.scale)),
            tiles: self.config.tiles(tile, overlap),
            pre_pad: i64::from(self.config.pre_pad),
        };
        let input =
            job.inputs.into_iter().next().ok_or_else(|| {
                EngineError::InvalidInput("upscale without an input image".into())
            })?;
        let image = input.into_stored();
        let started = Instant::now();
        // The network's part only: a resampling to the job's scale is left to the host, off this
        // thread (`OutputImage::finish`), so the engine is free for the next run meanwhile.
        let out = self
            .upscaler
            .upscale_network(
                &image,
                &options,
                &mut |done, total| {
                    progress(Progress {
                        step: done as u32,
                        total: total as u32,
                    })
                },
                &|| cancel.requested().is_some(),
            )
            .map_err(|e| engine_error(e, cancel.requested()))?;
        let mut timings = StageTimings::default();
        timings.add("upscale", started.elapsed().as_secs_f64());
        Ok(EngineOutput {
            images: vec![OutputImage::Upscaled(out)],
            seeds: vec![None],
            timings,
            encode_cache: None,
            files: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_models::nn::MemoryFormat;

    use super::*;

    fn config(tile: u32, overlap: u32) -> EsrganConfig {
        EsrganConfig {
            model: "m.pth".into(),
            device: "cpu".into(),
            dtype: Dtype::Fp32,
            blend: Blend::Feather,
            max_batch: 1,
            pre_pad: 0,
            warm_up: Vec::new(),
            settings: Some(SettingsChoice::Explicit(EsrganSettings {
                memory_format: MemoryFormat::Contiguous,
                tile,
                tile_overlap: overlap,
            })),
        }
    }

    /// A ×2 upscale on a ×4 network: the engine's run ends at the network's scale (the
    /// resampling is left to the host's pool, so the engine's busy span does not hold it), and the
    /// finished image is the library's whole `upscale`, byte for byte.
    /// Warm-up sizes: the section's own, else the sizes given (the other engines'), each once;
    /// a size no upscale takes is refused; the tiny model warms at them.
    #[test]
    fn the_warm_up_runs_at_the_sizes_the_farm_makes_unless_told_otherwise() {
        let own = EsrganConfig {
            warm_up: vec![[512, 768]],
            ..config(64, 16)
        };
        assert_eq!(own.warming_at([[1024, 1024]]).warm_up, [[512, 768]]);
        let made = [[1024, 1024], [832, 1216], [1024, 1024]];
        assert_eq!(
            config(64, 16).warming_at(made).warm_up,
            [[832, 1216], [1024, 1024]]
        );
        assert!(config(64, 16).warming_at([]).warm_up.is_empty());
        let huge = EsrganConfig {
            warm_up: vec![[8192, 64]],
            ..config(64, 16)
        };
        let e = huge.validate().expect_err("larger than any input");
        assert!(e.starts_with("engine.esrgan.warm_up: 8192x64"), "{e}");

        let settings = EsrganSettings {
            memory_format: MemoryFormat::Contiguous,
            tile: 64,
            tile_overlap: 16,
        };
        let config = EsrganConfig {
            model: std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models/fixtures/esrgan/tiny_x4.pth"),
            settings: Some(SettingsChoice::Explicit(settings)),
            ..config(64, 16)
        };
        for sizes in [vec![], vec![[100, 70]]] {
            let config = EsrganConfig {
                warm_up: sizes,
                ..config.clone()
            };
            let engine = EsrganEngine::load_cold(&config, settings).expect("the tiny model");
            engine.warm_up().expect("warm");
        }
    }

    #[test]
    fn the_resampling_to_the_jobs_scale_is_left_off_the_engine() {
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models/fixtures/esrgan/tiny_x4.pth");
        let settings = EsrganSettings {
            memory_format: MemoryFormat::Contiguous,
            tile: 64,
            tile_overlap: 16,
        };
        let config = EsrganConfig {
            model,
            settings: Some(SettingsChoice::Explicit(settings)),
            ..config(64, 16)
        };
        let mut engine = EsrganEngine::load_cold(&config, settings).expect("the tiny model");
        let input = image::RgbImage::from_fn(37, 29, |x, y| {
            image::Rgb([(7 * x) as u8, (5 * y) as u8, (x * y) as u8])
        });
        for scale in [2, 4] {
            let mut job =
                crate::engine::job::tests::job(Task::Upscale(vnfarm_proto::UpscaleSpec {
                    input: vnfarm_proto::ImageRef::Stored("inputs/a.png".into()),
                    scale,
                    tile: None,
                    tile_overlap: None,
                }));
            job.inputs.push(crate::engine::InputImage {
                image: input.clone(),
                stored: None,
                sha256: String::new(),
            });
            let cancel = job.cancel.clone();
            let mut out = engine.run(job, &mut |_| {}, &cancel).expect("upscaled");
            let Some(OutputImage::Upscaled(upscaled)) = out.images.pop() else {
                panic!("an upscale's image is left to finish on the host");
            };
            assert_eq!(upscaled.size(), (37 * scale, 29 * scale), "×{scale}");
            assert_eq!(
                upscaled.network_size(),
                (37 * 4, 29 * 4),
                "×{scale}: as the ×4 network made it"
            );
            let options = UpscaleOptions {
                outscale: Some(i64::from(scale)),
                tiles: config.tiles(64, 16),
                pre_pad: 0,
            };
            let whole = engine
                .upscaler
                .upscale(
                    &image::DynamicImage::ImageRgb8(input.clone()),
                    &options,
                    &mut |_, _| {},
                    &|| false,
                )
                .expect("the library's upscale");
            assert!(
                upscaled.finish() == whole,
                "×{scale}: finished = whole upscale"
            );
        }
    }

    #[test]
    fn tile_settings_are_checked_and_name_the_field() {
        assert!(config(512, 32).validate().is_ok());
        for (c, field) in [
            (config(32, 0), "engine.esrgan.settings.tile"),
            (config(4096, 0), "engine.esrgan.settings.tile"),
            (config(256, 65), "engine.esrgan.settings.tile_overlap"),
            (
                EsrganConfig {
                    max_batch: 0,
                    ..config(256, 16)
                },
                "engine.esrgan.max_batch",
            ),
            (
                EsrganConfig {
                    device: "gpu".into(),
                    ..config(256, 16)
                },
                "engine.esrgan.device",
            ),
        ] {
            let e = c.validate().unwrap_err();
            assert!(e.starts_with(field), "{e}");
        }
    }
}
