//! Cost of switching per-job SDXL LoRAs at real size: the SDXL base UNet and both text encoders
//! (shapes from `fixtures/sdxl/reference/sdxl_base_tables.json.gz`), every weight a LoRA can patch
//! filled with random values in the compute dtype (the rest stays a zero placeholder: it plays no
//! part in fusing), and a random kohya LoRA (sgm UNet names, `lora_te1_` / `lora_te2_`, alpha, fp16
//! like sd-scripts' files) over every attention and feed-forward Linear of the UNet (to_q, to_k,
//! to_v, to_out.0, ff.net.0.proj, ff.net.2) and every attention and MLP Linear of both text
//! encoders.
//!
//! ```sh
//! lora_bench [--rank 128] [--iters 5] [--dtype bf16|fp32] [--cpu] [--dir DIR] [--tables FILE]
//! ```
//!
//! `--tables`: the shape tables, gzipped JSON (default: this crate's fixture, by its path at build
//! time; give the repository's copy when the binary runs elsewhere).
//!
//! Times, through `JobLoras::set` as the worker's engine calls it (`SdxlPipeline::set_loras`):
//! `apply` (base → set A: open the file, fuse, keep the originals), `same` (set A again: nothing to
//! do), `switch` (A → B: restore, then fuse another file), `restore` (→ no LoRA). The first apply
//! is reported apart (page cache, first pinned allocation), then `--iters` rounds of each. One
//! JSON object per line: `{"name", "ms_median", "ms_min", "ms_max"}`; each timed call ends with a
//! device synchronize. Restores are checked bit for bit against a copy of the base.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tch::{Cuda, Device, Kind, Tensor};
use vnfarm_models::loading::lora::{
    Component, JobLoras, LoraModule, LoraSpec, LoraTarget, TargetRef,
};
use vnfarm_models::loading::weights::{WeightStore, Weights};
use vnfarm_models::nn::AttentionImpl;
use vnfarm_models::sdxl::clip::{ClipTextConfig, ClipTextModel, canonical_key};
use vnfarm_models::sdxl::unet::{UNet2DConditionModel, UNetConfig};

struct Opts {
    rank: i64,
    iters: usize,
    kind: Kind,
    device: Device,
    dir: PathBuf,
    tables: PathBuf,
}

fn parse() -> anyhow::Result<Opts> {
    let mut o = Opts {
        rank: 128,
        iters: 5,
        kind: Kind::BFloat16,
        device: Device::Cuda(0),
        dir: std::env::temp_dir().join("vnfarm-lora-bench"),
        tables: Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/sdxl/reference/sdxl_base_tables.json.gz"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--rank" => o.rank = value()?.parse()?,
            "--iters" => o.iters = value()?.parse()?,
            "--dtype" => {
                o.kind = match value()?.as_str() {
                    "bf16" => Kind::BFloat16,
                    "fp16" => Kind::Half,
                    "fp32" => Kind::Float,
                    other => anyhow::bail!("--dtype {other}: bf16, fp16 or fp32"),
                }
            }
            "--cpu" => o.device = Device::Cpu,
            "--dir" => o.dir = PathBuf::from(value()?),
            "--tables" => o.tables = PathBuf::from(value()?),
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(o)
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        Cuda::synchronize(i as i64);
    }
}

/// The real-size components, patchable weights random, everything else placeholders.
fn models(o: &Opts) -> anyhow::Result<(UNet2DConditionModel, ClipTextModel, ClipTextModel)> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&o.tables)?).read_to_string(&mut text)?;
    let t: serde_json::Value = serde_json::from_str(&text)?;
    let store = |k: &str| -> Arc<WeightStore> {
        let table: HashMap<String, Vec<i64>> = t["shapes"][k]
            .as_object()
            .expect("a shape table")
            .iter()
            .filter_map(|(name, s)| {
                let name = if k.starts_with("clip") {
                    canonical_key(name)?
                } else {
                    name.clone()
                };
                let shape = s.as_array()?.iter().filter_map(|d| d.as_i64()).collect();
                Some((name, shape))
            })
            .collect();
        Arc::new(WeightStore::placeholders(table))
    };
    let w = |k: &str| Weights::new(store(k), o.device, o.kind);
    let imp = AttentionImpl::Sdpa;
    let mut unet = UNet2DConditionModel::new(&w("unet"), &UNetConfig::sdxl_base(), imp)?;
    let mut l = ClipTextModel::new(&w("clip_l"), &ClipTextConfig::sdxl_clip_l(), imp)?;
    let mut g = ClipTextModel::new(&w("clip_g"), &ClipTextConfig::sdxl_clip_g(), imp)?;
    let mut params = 0i64;
    for target in [
        &mut unet as &mut dyn LoraTarget,
        &mut l as &mut dyn LoraTarget,
        &mut g as &mut dyn LoraTarget,
    ] {
        for (_, m) in target.lora_modules() {
            let w = match m {
                LoraModule::Linear(l) => &mut l.weight,
                LoraModule::Conv2d(c) => &mut c.weight,
            };
            *w = (Tensor::randn(w.size(), (Kind::Float, o.device)) * 0.02).to_kind(o.kind);
            params += w.numel() as i64;
        }
    }
    sync(o.device);
    println!(
        "{}",
        serde_json::json!({"name": "patchable_params", "value": params})
    );
    Ok((unet, l, g))
}

/// Writes a random kohya LoRA of `rank` over the attention and feed-forward Linears.
fn write_lora(
    path: &Path,
    seed: i64,
    o: &Opts,
    unet: &mut UNet2DConditionModel,
    l: &mut ClipTextModel,
    g: &mut ClipTextModel,
) -> anyhow::Result<(usize, u64)> {
    tch::manual_seed(seed);
    let ldm: HashMap<String, String> = unet
        .lora_aliases()
        .into_iter()
        .map(|(alias, name)| (name, alias))
        .collect();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let attention = [
        ".to_q",
        ".to_k",
        ".to_v",
        ".to_out.0",
        ".ff.net.0.proj",
        ".ff.net.2",
    ];
    let text = [".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2"];
    let mut add = |flat: String, out: i64, inp: i64| {
        let r = o.rank;
        // Drawn on the device (fast), stored on the host in fp16 as sd-scripts saves.
        let draw = |shape: [i64; 2], scale: f64| {
            (Tensor::randn(shape, (Kind::Float, o.device)) * scale)
                .to_kind(Kind::Half)
                .to_device(Device::Cpu)
        };
        let down = draw([r, inp], 1.0 / (inp as f64).sqrt());
        let up = draw([out, r], 0.01);
        tensors.push((format!("{flat}.lora_down.weight"), down));
        tensors.push((format!("{flat}.lora_up.weight"), up));
        tensors.push((
            format!("{flat}.alpha"),
            Tensor::scalar_tensor(r as f64 / 2.0, (Kind::Half, Device::Cpu)),
        ));
    };
    for (name, m) in unet.lora_modules() {
        let LoraModule::Linear(lin) = m else { continue };
        if !attention.iter().any(|s| name.ends_with(s)) {
            continue;
        }
        let flat = format!("lora_unet_{}", ldm[&name].replace('.', "_"));
        let s = lin.weight.size();
        add(flat, s[0], s[1]);
    }
    for (prefix, te) in [("lora_te1_", l), ("lora_te2_", g)] {
        for (name, m) in te.lora_modules() {
            let LoraModule::Linear(lin) = m else { continue };
            if !text.iter().any(|s| name.ends_with(s)) {
                continue;
            }
            let s = lin.weight.size();
            add(format!("{prefix}{}", name.replace('.', "_")), s[0], s[1]);
        }
    }
    let modules = tensors.len() / 3;
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, path)?;
    Ok((modules, std::fs::metadata(path)?.len()))
}

fn report(name: &str, mut ms: Vec<f64>) {
    ms.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    println!(
        "{}",
        serde_json::json!({"name": name, "ms_median": ms[ms.len() / 2], "ms_min": ms[0],
            "ms_max": ms[ms.len() - 1], "n": ms.len()})
    );
}

fn main() -> anyhow::Result<()> {
    let o = parse()?;
    let _guard = tch::no_grad_guard();
    let started = Instant::now();
    let (mut unet, mut l, mut g) = models(&o)?;
    std::fs::create_dir_all(&o.dir)?;
    let a = o.dir.join(format!("a_rank{}.safetensors", o.rank));
    let b = o.dir.join(format!("b_rank{}.safetensors", o.rank));
    for (path, seed) in [(&a, 1), (&b, 2)] {
        let (modules, bytes) = write_lora(path, seed, &o, &mut unet, &mut l, &mut g)?;
        println!(
            "{}",
            serde_json::json!({"name": "lora_file", "path": path, "modules": modules, "bytes": bytes})
        );
    }
    println!(
        "{}",
        serde_json::json!({"name": "setup", "s": started.elapsed().as_secs_f64()})
    );
    let base: Vec<Tensor> = all_weights(&mut unet, &mut l, &mut g)
        .iter()
        .map(|w| w.to_device(Device::Cpu))
        .collect();

    let set_a = [LoraSpec {
        path: a,
        strength: 0.8,
    }];
    let set_b = [LoraSpec {
        path: b,
        strength: 0.6,
    }];
    let mut loras = JobLoras::default();
    let mut time = |specs: &[LoraSpec], loras: &mut JobLoras| -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut targets = [
            TargetRef {
                component: Component::Denoiser,
                target: &mut unet,
            },
            TargetRef {
                component: Component::TextEncoder,
                target: &mut l,
            },
            TargetRef {
                component: Component::TextEncoder2,
                target: &mut g,
            },
        ];
        loras.set(specs, &mut targets)?;
        sync(o.device);
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    report("first_apply", vec![time(&set_a, &mut loras)?]);
    report("first_restore", vec![time(&[], &mut loras)?]);
    let (mut apply, mut same, mut switch, mut restore) = (vec![], vec![], vec![], vec![]);
    for _ in 0..o.iters {
        apply.push(time(&set_a, &mut loras)?);
        same.push(time(&set_a, &mut loras)?);
        switch.push(time(&set_b, &mut loras)?);
        restore.push(time(&[], &mut loras)?);
    }
    report("apply", apply);
    report("same_set", same);
    report("switch", switch);
    report("restore", restore);

    let now = all_weights(&mut unet, &mut l, &mut g);
    let exact = base
        .iter()
        .zip(&now)
        .all(|(b, n)| b.equal(&n.to_device(Device::Cpu)));
    println!(
        "{}",
        serde_json::json!({"name": "restored_bit_for_bit", "value": exact, "weights": now.len()})
    );
    anyhow::ensure!(exact, "the restored weights differ from the base");
    Ok(())
}

/// Every patchable weight (shallow), in a fixed order.
fn all_weights(
    unet: &mut UNet2DConditionModel,
    l: &mut ClipTextModel,
    g: &mut ClipTextModel,
) -> Vec<Tensor> {
    let mut out = Vec::new();
    for target in [
        unet as &mut dyn LoraTarget,
        l as &mut dyn LoraTarget,
        g as &mut dyn LoraTarget,
    ] {
        for (_, m) in target.lora_modules() {
            out.push(match m {
                LoraModule::Linear(l) => l.weight.shallow_clone(),
                LoraModule::Conv2d(c) => c.weight.shallow_clone(),
            });
        }
    }
    out
}
