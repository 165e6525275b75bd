//! `vnfarm-worker bench` end to end: the studio's workloads (`bench workload`) through the worker
//! binary on a local queue, its storage a directory: with the test-pattern engine (every job
//! completed, outputs and manifests stored with their provenance, messages overlapping when two are
//! in hand, the report's numbers consistent), and with the tiny SDXL, Qwen and Real-ESRGAN models.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use vnfarm_tests::bin_dir;

use crate::engines::{engine_env, models, sdxl_folder, tiny_sdxl};

fn worker() -> Command {
    Command::new(bin_dir().join("vnfarm-worker"))
}

/// Writes a workload file with `bench workload`.
fn workload(
    dir: &Path,
    kind: &str,
    count: u32,
    extra: &[&str],
) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join(format!("{kind}.jsonl"));
    let out = worker()
        .args(["bench", "workload", "--kind", kind, "--count"])
        .arg(count.to_string())
        .args(extra)
        .arg("--out")
        .arg(&path)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(path)
}

/// Runs `bench` on the work files with `env`; returns the reports, by work file name.
fn bench(
    dir: &Path,
    config: &str,
    work: &[&Path],
    env: Vec<(String, String)>,
) -> anyhow::Result<Vec<Value>> {
    let config_path = dir.join("worker.toml");
    std::fs::write(&config_path, config)?;
    let out_dir = dir.join("out");
    let mut cmd = worker();
    cmd.arg("bench").arg("--config").arg(&config_path);
    for w in work {
        cmd.arg("--work").arg(w);
    }
    let out = cmd.arg("--out").arg(&out_dir).envs(env).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    work.iter()
        .map(|w| {
            let name = w.file_stem().unwrap().to_string_lossy();
            let text = std::fs::read_to_string(out_dir.join(format!("bench-report-{name}.json")))?;
            Ok(serde_json::from_str(&text)?)
        })
        .collect()
}

/// Every job completed, its outputs and its manifest stored under the storage root, the manifest
/// naming the job, the worker and (for model engines) the files with their hashes.
fn assert_stored(dir: &Path, report: &Value, jobs: u64, pipelines: u64, model_files: bool) {
    assert_eq!(report["jobs"], jobs, "{report:#}");
    assert_eq!(report["completed"], jobs, "{report:#}");
    assert_eq!(report["failed"], 0);
    assert_eq!(report["pipelines"], pipelines, "{report:#}");
    assert_eq!(
        report["events"]["started"], jobs,
        "one started event per job"
    );
    assert!(report["events"]["progress"].as_u64().unwrap() > 0);
    let wall = report["wall_s"].as_f64().unwrap();
    let busy = report["busy_fraction"].as_f64().unwrap();
    assert!(wall > 0.0 && busy > 0.0 && busy <= 1.0 + 1e-6, "{report:#}");
    let per_hour = report["jobs_per_hour"].as_f64().unwrap();
    assert!((per_hour - jobs as f64 * 3600.0 / wall).abs() < 1e-6 * per_hour);
    let storage = dir.join("out/storage");
    for job in report["job_records"].as_array().unwrap() {
        let id = job["job_id"].as_str().unwrap();
        assert_eq!(job["outcome"], "completed", "{job:#}");
        let outputs = job["outputs"].as_array().unwrap();
        assert!(!outputs.is_empty(), "{job:#}");
        for key in outputs {
            let png = std::fs::read(storage.join(key.as_str().unwrap())).unwrap();
            assert!(png.starts_with(b"\x89PNG"), "{key}");
            // The generation parameters ride in a text chunk.
            assert!(png.windows(10).any(|w| w == b"parameters"), "{key}");
        }
        let manifest: Value = serde_json::from_slice(
            &std::fs::read(storage.join(format!("results/{id}/manifest.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(manifest["job_id"], id);
        assert_eq!(manifest["worker"], "bench");
        assert_eq!(manifest["outputs"].as_array().unwrap().len(), outputs.len());
        if model_files {
            let files = manifest["model_files"].as_array().unwrap();
            assert!(!files.is_empty(), "{manifest:#}");
            assert!(
                files
                    .iter()
                    .all(|f| f["sha256"].as_str().unwrap().len() == 64)
            );
        }
    }
}

#[test]
fn the_bench_runs_the_studio_workloads_through_the_worker_with_messages_overlapping()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let studio = workload(dir.path(), "studio", 3, &["--side", "256", "--steps", "6"])?;
    let mix = workload(dir.path(), "mix", 1, &["--side", "256", "--steps", "6"])?;
    let config = format!(
        "worker_id = \"bench\"\nprefetch = 2\nhash_cache_dir = \"{0}/hashes\"\n[model_cache]\ndir = \"{0}/models\"\n",
        dir.path().display()
    );
    let reports = bench(dir.path(), &config, &[&studio, &mix], Vec::new())?;
    assert_eq!(reports[0]["engine"], "test-pattern");
    assert_eq!(reports[0]["in_flight"], 2);
    // 3 × (1 base + 3 edits in one message + 1 upscale); the mix: a generate pair, a portrait, 4
    // edits of the pair's first, an upscale of its second.
    assert_stored(dir.path(), &reports[0], 15, 3, false);
    assert_stored(dir.path(), &reports[1], 8, 2, false);
    assert_eq!(reports[0]["messages"], 9);
    assert_eq!(reports[1]["by_kind"]["edit"], 4);
    // Two messages in hand: one was taken before another ended.
    let records = reports[0]["job_records"].as_array().unwrap();
    let overlapped = records.iter().any(|a| {
        records.iter().any(|b| {
            a["line"] != b["line"]
                && a["dequeued_s"].as_f64() < b["ended_s"].as_f64()
                && b["dequeued_s"].as_f64() < a["ended_s"].as_f64()
        })
    });
    assert!(overlapped, "no two messages were in hand at once");
    // An edit is taken only once the base it reads is stored.
    for edit in records.iter().filter(|r| r["kind"] == "edit") {
        let base_ended = records
            .iter()
            .filter(|r| r["kind"] == "generate")
            .map(|r| r["ended_s"].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        assert!(
            edit["dequeued_s"].as_f64().unwrap() >= base_ended,
            "{edit:#}"
        );
    }
    Ok(())
}

#[test]
fn the_bench_runs_the_tiny_models() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let studio = workload(
        dir.path(),
        "studio",
        1,
        &[
            "--side",
            "64",
            "--steps",
            "3",
            "--edit-steps",
            "2",
            "--edit-side",
            "256",
        ],
    )?;
    let qwen = crate::qwen::tiny_qwen(56 * 56, 64 * 64);
    let esrgan = [
        (
            "MODEL",
            models().join("esrgan/tiny_x4.pth").display().to_string(),
        ),
        ("DEVICE", "cpu".into()),
        ("DTYPE", "fp32".into()),
    ];
    let mut env = tiny_sdxl(&sdxl_folder());
    env.push(("VNFARM_ENGINE__SDXL__WARM_UP".into(), "[[64, 64]]".into()));
    env.extend(engine_env("QWEN_EDIT", qwen));
    env.extend(engine_env("ESRGAN", esrgan));
    let config = format!(
        "worker_id = \"bench\"\nprefetch = 2\nhash_cache_dir = \"{0}/hashes\"\n[model_cache]\ndir = \"{0}/models\"\n",
        dir.path().display()
    );
    let reports = bench(dir.path(), &config, &[&studio], env)?;
    assert_eq!(reports[0]["engine"], "tch");
    assert_stored(dir.path(), &reports[0], 5, 1, true);
    // No GPU here: the engine's compute is on the host's clock.
    assert_eq!(reports[0]["busy_clock"], "host");
    assert!(reports[0]["engine_runs"].as_u64().unwrap() >= 3);
    Ok(())
}
