//! `vnfarm-worker check` end to end on the CPU with the tiny fixtures (SDXL's diffusers folder and
//! Real-ESRGAN's `.pth`): it writes a report, a summary and a settings file; a worker configured with that
//! file loads it, says so in its heartbeat and runs a job; a worker given the same file with another
//! device in its fingerprint refuses to start and says why.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use vnfarm_proto::SettingsSource;
use vnfarm_proto::http::JobState;
use vnfarm_tests::{Farm, WorkerOptions, bin_dir, wait_for};

use crate::FINISH;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/models/fixtures")
}

/// The engines of the check and of the workers: the tiny SDXL, Qwen-Image-Edit (its single files,
/// written from the tiny diffusers folder at test time) and Real-ESRGAN, in fp32 on the CPU.
fn engine_env() -> Vec<(String, String)> {
    let sdxl = fixtures().join("sdxl");
    let qwen = |f: fn(&Path) -> PathBuf| f(&fixtures()).display().to_string();
    [
        // The diffusers folder: its component configs come with it.
        (
            "SDXL__CHECKPOINT",
            sdxl.join("sdxl_tiny").display().to_string(),
        ),
        ("SDXL__DEVICE", "cpu".into()),
        ("SDXL__DTYPE", "fp32".into()),
        ("SDXL__VAE_DTYPE", "fp32".into()),
        ("SDXL__WARM_UP", "[[128, 128]]".into()),
        (
            "ESRGAN__MODEL",
            fixtures().join("esrgan/tiny_x4.pth").display().to_string(),
        ),
        ("ESRGAN__DEVICE", "cpu".into()),
        ("ESRGAN__DTYPE", "fp32".into()),
        (
            "QWEN_EDIT__TRANSFORMER",
            qwen(crate::derived::qwen_transformer_fp8),
        ),
        (
            "QWEN_EDIT__TEXT_ENCODER",
            qwen(crate::derived::qwen_text_encoder_fp8_scaled),
        ),
        ("QWEN_EDIT__VAE", qwen(crate::derived::qwen_vae_wan)),
        (
            "QWEN_EDIT__CONFIG_DIR",
            fixtures().join("qwen/qwen_tiny").display().to_string(),
        ),
        ("QWEN_EDIT__DEVICE", "cpu".into()),
        ("QWEN_EDIT__DTYPE", "fp32".into()),
        ("QWEN_EDIT__VAE_DTYPE", "fp32".into()),
        // The smallest edit size (the default warms up a 1024² edit: minutes on a CI machine's
        // CPU in a debug build, past the wait for the worker's settings).
        ("QWEN_EDIT__WARM_UP", "[[256, 256]]".into()),
        // Small copies of the input for the vision tower and the VAE (about 1 MP by default,
        // minutes on a CI machine's CPU in a debug build).
        ("QWEN_EDIT__CONDITION_IMAGE_AREA", (56 * 56).to_string()),
        ("QWEN_EDIT__VAE_IMAGE_AREA", (64 * 64).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (format!("VNFARM_ENGINE__{k}"), v))
    .collect()
}

fn worker(settings_file: &Path) -> WorkerOptions {
    let mut extra_env = engine_env();
    extra_env.push((
        "VNFARM_ENGINE__SETTINGS_FILE".into(),
        settings_file.display().to_string(),
    ));
    WorkerOptions {
        extra_env,
        ..WorkerOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_checks_itself_and_the_worker_runs_what_it_measured() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let started = std::time::Instant::now();
    let run = Command::new(bin_dir().join("vnfarm-worker"))
        .args(["check", "--quick", "--out"])
        .arg(out.path())
        .arg("--fixtures")
        .arg(fixtures())
        .envs(engine_env())
        // A variable measured as a candidate: the environment sets are compared on the CPU too.
        .args(["--env-candidate", "VNFARM_TEST_CHECK_PROBE=1"])
        // A candidate that takes its process down, as a crashing kernel compiler would.
        .env(
            "VNFARM_TEST_CHECK_ABORT_AT",
            "sdxl.candidate.ff_gelu_epilogue",
        )
        .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("check took {:?}\n{stdout}", started.elapsed());
    assert!(run.status.success(), "{}\n{stdout}\n{stderr}", run.status);

    // The report: the environment, every engine's checks and timings, what was chosen.
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json"))?)?;
    assert_eq!(
        report["environment"]["device"]["backend"], "cpu",
        "{report:#}"
    );
    assert!(
        report["environment"]["libtorch"]
            .as_str()
            .unwrap()
            .starts_with("2.")
    );
    assert_eq!(
        report["environment"]["variables"].as_array().unwrap().len(),
        8,
        "every ROCm variable is reported, set or not"
    );
    assert!(!report["environment"]["sdpa"].as_array().unwrap().is_empty());
    for engine in ["sdxl", "esrgan"] {
        let e = &report["engines"][engine];
        assert!(e["chosen"].is_object(), "{engine} chose settings: {e:#}");
        let checks = e["checks"].as_array().unwrap();
        let outcome = |id: &str| {
            checks
                .iter()
                .find(|c| c["id"] == id)
                .map(|c| c["outcome"].as_str().unwrap().to_owned())
        };
        let parity = format!(
            "{engine}.cpu_parity.{}",
            if engine == "sdxl" { "unet" } else { "forward" }
        );
        assert_eq!(outcome(&parity).as_deref(), Some("pass"), "{engine}: {e:#}");
        assert!(
            !e["timings"].as_array().unwrap().is_empty(),
            "{engine} was timed"
        );
    }
    let sdxl_checks = report["engines"]["sdxl"]["checks"].as_array().unwrap();
    for id in [
        "sdxl.cpu_parity.vae",
        "sdxl.cpu_parity.text_encoders",
        "sdxl.fixture_parity",
    ] {
        assert!(
            sdxl_checks
                .iter()
                .any(|c| c["id"] == id && c["outcome"] == "pass"),
            "{id}: {sdxl_checks:#?}"
        );
    }
    let qwen_checks = report["engines"]["qwen_edit"]["checks"].as_array().unwrap();
    for id in [
        "qwen_edit.cpu_parity.transformer_blocks",
        "qwen_edit.cpu_parity.vae",
        "qwen_edit.cpu_parity.edit",
    ] {
        assert!(
            qwen_checks
                .iter()
                .any(|c| c["id"] == id && c["outcome"] == "pass"),
            "{id}: {qwen_checks:#?}"
        );
    }
    let esrgan_checks = report["engines"]["esrgan"]["checks"].as_array().unwrap();
    assert!(
        esrgan_checks
            .iter()
            .any(|c| c["id"] == "esrgan.fixture_parity" && c["outcome"] == "pass"),
        "{esrgan_checks:#?}"
    );
    assert!(
        summary_line_exists(&out, "driver      "),
        "the driver line is in the summary"
    );
    // CUDA graphs cannot run on the CPU: the candidate is marked failed (or skipped where the shims
    // are not built) with its reason, and the command still succeeded.
    let graphs = sdxl_checks
        .iter()
        .find(|c| c["id"] == "sdxl.candidate.cuda_graphs")
        .expect("the graph candidate was tried");
    assert_ne!(graphs["outcome"], "pass", "{graphs}");
    assert!(!graphs["detail"].as_str().unwrap().is_empty());
    assert_eq!(
        report["verify"]["checks"][0]["outcome"], "pass",
        "{:#}",
        report["verify"]
    );
    let summary = std::fs::read_to_string(out.path().join("summary.txt"))?;
    assert!(summary.contains("PASS  sdxl.cpu_parity.unet"), "{summary}");
    assert!(
        summary.contains("variable    TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL="),
        "{summary}"
    );

    // The settings file: the fingerprint of this box, each engine's settings.
    let settings_path = out.path().join("settings.json");
    let settings: Value = serde_json::from_str(&std::fs::read_to_string(&settings_path)?)?;
    assert_eq!(settings["format"], "vnfarm-box-settings/1");
    assert_eq!(settings["fingerprint"]["device"]["backend"], "cpu");
    assert!(
        settings["sdxl"].is_object() && settings["esrgan"].is_object(),
        "{settings:#}"
    );
    // The diffusers folder's four weight files, each by its size and a sample of its bytes.
    let files = settings["fingerprint"]["models"]["sdxl"]
        .as_array()
        .unwrap();
    assert_eq!(files.len(), 4, "{files:#?}");
    assert!(
        files
            .iter()
            .all(|f| f["sample"].as_str().unwrap().contains(':'))
    );

    // A worker with the file: loads it, says so, runs a job.
    let mut farm = Farm::new("check").await?;
    farm.start_scheduler().await?;
    farm.start_worker("tuned", worker(&settings_path)).await?;
    // The settings are known once the engines loaded (the first heartbeats say `warming`).
    let in_use = wait_for(
        "a heartbeat with the settings",
        Duration::from_secs(60),
        || async {
            let workers = farm.workers().await.ok()?;
            workers.into_iter().next()?.heartbeat?.settings
        },
    )
    .await
    .map_err(|e| e.context(farm.worker_logs()))?;
    assert_eq!(in_use.source, SettingsSource::Measured, "{in_use:#?}");
    assert_eq!(in_use.id.len(), 12, "{in_use:?}");
    let id = farm
        .submit_new(&json!({"schema_version": 1, "job": {
            "kind": "generate", "prompt": "1girl", "seed": 1, "steps": 2,
            "width": 256, "height": 256, "cfg": 4.5,
        }}))
        .await?;
    let job = farm.wait_finished(id, FINISH).await?;
    assert_eq!(
        job.state,
        JobState::Completed,
        "{job:?}\n{}",
        farm.worker_logs()
    );

    // The same file claiming another device: refused, with what to do.
    let mut foreign = settings.clone();
    foreign["fingerprint"]["device"] =
        json!({"backend": "cuda", "name": "NVIDIA H200", "arch": "sm_90"});
    let foreign_path = out.path().join("foreign.json");
    std::fs::write(&foreign_path, serde_json::to_string_pretty(&foreign)?)?;
    farm.launch_worker("foreign", worker(&foreign_path))?;
    let status = wait_for(
        "the worker to refuse the file",
        Duration::from_secs(60),
        || std::future::ready(farm.worker_mut("foreign").try_wait().ok().flatten()),
    )
    .await?;
    let log = farm.log("foreign.log");
    assert!(!status.success(), "{status}\n{log}");
    assert!(
        log.contains("was measured on cuda NVIDIA H200 (sm_90)")
            && log.contains("vnfarm-worker check"),
        "the refusal names the device and what to run:\n{log}"
    );
    Ok(())
}

fn summary_line_exists(out: &tempfile::TempDir, prefix: &str) -> bool {
    std::fs::read_to_string(out.path().join("summary.txt"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with(prefix))
}
