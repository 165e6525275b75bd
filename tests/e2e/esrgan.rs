//! The Real-ESRGAN engine inside the worker, end to end through the scheduler, RabbitMQ and S3,
//! with the tiny random-weight RRDBNet of `worker/models/fixtures/esrgan` on the CPU (fp32):
//! uploaded RGBA, grey and 16-bit images come back in their own layout and equal Real-ESRGAN's
//! `enhance` for the same weights (`make_esrgan_fixtures.py`); a pipeline's upscale step runs on
//! the SDXL base it follows; progress counts tiles; a cancel stops between tiles; the manifest names
//! the network's file by its sha256 and size.

use image::DynamicImage;
use serde_json::{Value, json};
use tch::{Device, Kind};
use vnfarm_models::esrgan::rrdbnet::MemoryFormat;
use vnfarm_models::esrgan::tiling::{Blend, TileSettings};
use vnfarm_models::esrgan::upscaler::{UpscaleOptions, Upscaler};
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_proto::ModelFamily;
use vnfarm_proto::http::{JobState, JobView, Progress};
use vnfarm_scheduler::scheduler::inline_image;
use vnfarm_tests::{Farm, WorkerOptions};

use crate::FINISH;
use crate::engines::{engine_env, models, sdxl_folder, tiny_sdxl};

/// The tiny ×4 model with 64-pixel tiles and a 16-pixel overlap, feathered; optionally SDXL too.
fn esrgan_worker(with_sdxl: bool) -> WorkerOptions {
    let esrgan = engine_env(
        "ESRGAN",
        [
            (
                "MODEL",
                models().join("esrgan/tiny_x4.pth").display().to_string(),
            ),
            ("DEVICE", "cpu".into()),
            ("DTYPE", "fp32".into()),
            ("SETTINGS__TILE", "64".into()),
            ("SETTINGS__TILE_OVERLAP", "16".into()),
        ],
    );
    let sdxl = if with_sdxl {
        tiny_sdxl(&sdxl_folder())
    } else {
        Vec::new()
    };
    WorkerOptions::default().with_env(esrgan).with_env(sdxl)
}

async fn output(farm: &Farm, job: &JobView) -> anyhow::Result<DynamicImage> {
    let outputs = farm.outputs(job).await?;
    Ok(image::load_from_memory(
        outputs.first().expect("an output"),
    )?)
}

/// The image's samples against a reference tensor of the fixture (`[H, W, C]` or `[H, W]`):
/// the largest absolute difference.
fn max_diff(img: &DynamicImage, reference: &tch::Tensor) -> i64 {
    let (w, h) = (i64::from(img.width()), i64::from(img.height()));
    let c = i64::from(img.color().channel_count());
    let samples: Vec<i64> = if img.color().bytes_per_pixel() / img.color().channel_count() == 2 {
        img.as_bytes()
            .chunks(2)
            .map(|b| i64::from(u16::from_ne_bytes([b[0], b[1]])))
            .collect()
    } else {
        img.as_bytes().iter().map(|&b| i64::from(b)).collect()
    };
    let shape = if c == 1 { vec![h, w] } else { vec![h, w, c] };
    assert_eq!(reference.size(), shape, "image size");
    (tch::Tensor::from_slice(&samples).view(shape.as_slice()) - reference.to_kind(Kind::Int64))
        .abs()
        .max()
        .int64_value(&[])
}

/// The tiny model as the worker runs it (its default memory format, channels-last).
fn library_upscaler() -> anyhow::Result<Upscaler> {
    let mut up = Upscaler::load(
        &models().join("esrgan/tiny_x4.pth"),
        Device::Cpu,
        Kind::Float,
    )?;
    up.set_memory_format(MemoryFormat::ChannelsLast);
    Ok(up)
}

/// The job's last progress is `tiles` of `tiles`. A job dispatched twice (its first dispatch was
/// given back under load, and the redelivery found the finished manifest) has no progress of its
/// last run to show, which is fine.
fn assert_tiles(job: &JobView, tiles: u32) {
    if job.progress.is_none() && job.dispatches > 1 {
        println!("progress not kept over a redispatch: {job:?}");
        return;
    }
    let all = Progress {
        step: tiles,
        total: tiles,
    };
    assert_eq!(job.progress, Some(all), "{job:?}");
}

async fn upscale(farm: &Farm, image: &[u8], scale: u32) -> anyhow::Result<JobView> {
    let input = serde_json::to_value(inline_image(image))?;
    let job = farm
        .run(
            &json!({"schema_version": 1,
                "job": {"kind": "upscale", "input": input, "scale": scale}}),
            FINISH,
        )
        .await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );
    Ok(job)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upscales_keep_alpha_grey_and_16_bits_and_match_realesrgan() -> anyhow::Result<()> {
    let reference = SafetensorsFile::open(models().join("esrgan/reference/esrgan.safetensors"))?;
    let want = |name: &str| {
        reference
            .load(name, Device::Cpu, Kind::Int64)
            .expect("reference image")
    };
    let inputs = models().join("esrgan/inputs");
    let mut farm = Farm::in_process("esrgan-upscale").await?;
    farm.start_scheduler().await?;
    farm.start_worker("esrgan-1", esrgan_worker(false)).await?;
    let workers = farm.workers().await?;
    let loaded = workers[0].heartbeat.as_ref().map(|h| h.models.clone());
    assert_eq!(loaded, Some(vec![ModelFamily::Esrgan]), "{workers:?}");

    // 37×29 fits one 64-pixel tile: Real-ESRGAN's full-frame references apply.
    let cases = [
        ("rgba8_37x29.png", 4, "x4_rgba_full.image"),
        ("rgba8_37x29.png", 2, "x4_rgba_outscale2_full.image"),
        ("grey8_37x29.png", 4, "x4_grey_full.image"),
        ("rgb16_23x19.png", 4, "x4_rgb16_full.image"),
    ];
    for (file, scale, name) in cases {
        let bytes = std::fs::read(inputs.join(file))?;
        let job = upscale(&farm, &bytes, scale).await?;
        let out = output(&farm, &job).await?;
        let input = image::load_from_memory(&bytes)?;
        assert_eq!(out.color(), input.color(), "{file}: the layout is kept");
        let d = max_diff(&out, &want(name));
        println!("{file} ×{scale}: max |difference| {d} from Real-ESRGAN");
        assert!(d <= 1, "{file} ×{scale}: {d} from Real-ESRGAN");
        assert_tiles(&job, 1);
    }

    // 200×150 at 64-pixel tiles: 4 × 3 tiles, counted as progress; the output equals the
    // library's for the same settings.
    let img = image::RgbImage::from_fn(200, 150, |x, y| {
        image::Rgb([(x + y) as u8, (3 * x) as u8, (200 - y) as u8])
    });
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)?;
    let job = upscale(&farm, &png, 4).await?;
    assert_tiles(&job, 12);
    let out = output(&farm, &job).await?;
    let up = library_upscaler()?;
    let options = UpscaleOptions {
        outscale: Some(4),
        tiles: TileSettings {
            tile: Some(64),
            overlap: 16,
            blend: Blend::Feather,
            max_batch: 1,
        },
        pre_pad: 0,
    };
    let local = up.upscale(
        &DynamicImage::ImageRgb8(img),
        &options,
        &mut |_, _| {},
        &|| false,
    )?;
    assert!(
        out.as_bytes() == local.as_bytes(),
        "the worker's output is the library's"
    );

    // Provenance through the real engine: the manifest names the network's file by its bytes.
    let model = models().join("esrgan/tiny_x4.pth");
    let bytes = std::fs::read(&model)?;
    // `results/<job>/0.png` → `results/<job>/manifest.json`.
    let output = job.outputs.first().expect("an output");
    let manifest_key = output.replace("0.png", "manifest.json");
    let manifest: Value = serde_json::from_slice(&farm.storage.get(&manifest_key).await?)?;
    assert_eq!(
        manifest["model_files"],
        json!([{
            "name": "tiny_x4.pth",
            "sha256": hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes)),
            "size": bytes.len(),
            "path": model.canonicalize()?.display().to_string(),
            "role": "upscaler",
        }]),
        "{manifest}"
    );
    Ok(())
}

/// A pipeline (an SDXL base, then an upscale of it) on one worker holding both models; and a long
/// upscale cancelled between tiles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_upscales_its_base_and_a_cancel_stops_between_tiles() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("esrgan-pipeline").await?;
    farm.start_scheduler().await?;
    farm.start_worker("esrgan-2", esrgan_worker(true)).await?;
    let pipeline = farm
        .run(
            &json!({"schema_version": 1, "job": {"kind": "pipeline",
                "base": {"prompt": "1girl, classroom", "width": 256, "height": 256, "steps": 2, "seed": 5},
                "upscales": [{"of": "base", "scale": 2}]}}),
            FINISH,
        )
        .await?;
    assert_eq!(
        pipeline.state,
        JobState::Completed,
        "{pipeline:?}\n{}",
        farm.worker_logs()
    );
    let children = &pipeline.children;
    let base = output(&farm, &farm.job(children[0]).await?).await?;
    let upscaled = farm.job(children[1]).await?;
    assert_tiles(&upscaled, 16);
    let out = output(&farm, &upscaled).await?;
    assert_eq!((out.width(), out.height()), (512, 512));
    // The upscale is of the base: the library's ×2 of the stored base image, byte for byte.
    let up = library_upscaler()?;
    let options = UpscaleOptions {
        outscale: Some(2),
        tiles: TileSettings {
            tile: Some(64),
            overlap: 16,
            blend: Blend::Feather,
            max_batch: 1,
        },
        pre_pad: 0,
    };
    let local = up.upscale(&base, &options, &mut |_, _| {}, &|| false)?;
    assert!(
        out.as_bytes() == local.as_bytes(),
        "the upscale is of the base"
    );

    // A 1024² input at 64-pixel tiles is 256 tiles: cancelled after the first, it stops.
    let img = image::RgbImage::from_fn(1024, 1024, |x, y| {
        image::Rgb([(x / 4) as u8, (y / 4) as u8, ((x ^ y) & 0xFF) as u8])
    });
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)?;
    let input = serde_json::to_value(inline_image(&png))?;
    let id = farm
        .submit_new(&json!({"schema_version": 1,
            "job": {"kind": "upscale", "input": input, "scale": 4}}))
        .await?;
    farm.wait_step(id, 1, FINISH).await?;
    farm.cancel(id).await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(job.state, JobState::Cancelled, "{job:?}");
    let step = job.progress.as_ref().map_or(0, |p| p.step);
    assert!(step < 256, "{job:?}");
    assert!(
        farm.storage
            .list(&format!("results/{id}/"))
            .await?
            .is_empty(),
        "a cancelled upscale leaves nothing in storage"
    );
    Ok(())
}
