//! The tiny random-weight engines that the model tests (`esrgan`, `sdxl`, `qwen`) run on the CPU:
//! where the model crate's fixtures are, and the worker settings they share.

use std::path::{Path, PathBuf};

/// The model crate's fixture folder.
pub fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/models/fixtures")
}

/// `settings` of `engine` (`SDXL`, `ESRGAN`, `QWEN_EDIT`) as the worker's environment keys.
pub fn engine_env(
    engine: &str,
    settings: impl IntoIterator<Item = (&'static str, String)>,
) -> Vec<(String, String)> {
    settings
        .into_iter()
        .map(|(key, value)| (format!("VNFARM_ENGINE__{engine}__{key}"), value))
        .collect()
}

/// SDXL from `checkpoint` on the CPU in fp32 (the precision of diffusers' references), warmed at
/// 256², without VAE tiling (diffusers made the references without it; the tiny VAE would tile
/// above 128 px).
pub fn tiny_sdxl(checkpoint: &Path) -> Vec<(String, String)> {
    engine_env(
        "SDXL",
        [
            ("CHECKPOINT", checkpoint.display().to_string()),
            ("DEVICE", "cpu".into()),
            ("DTYPE", "fp32".into()),
            ("VAE_DTYPE", "fp32".into()),
            ("WARM_UP", "[[256, 256]]".into()),
            ("VAE_TILING", "never".into()),
        ],
    )
}

/// The tiny SDXL's diffusers folder.
pub fn sdxl_folder() -> PathBuf {
    models().join("sdxl/sdxl_tiny")
}
