//! Fixture files that hold no weights of their own: the tensors of a committed fixture under other
//! names, in another encoding or another container, written at test time so that the tree stores
//! each set of weights once. Each function names the file it replaces and derives it the way the
//! generator script wrote that file; every one was checked against the committed file, tensor for
//! tensor and byte for byte, before that file was deleted.
//!
//! Files are written once per test process under `CARGO_TARGET_TMPDIR/derived-fixtures/`, to a
//! temporary name first and then renamed, so test binaries running side by side never read half a
//! file. Shared by the model crate's tests (`support::derived`) and the end-to-end tests (the
//! `tests` crate includes this file with `#[path]`); every function takes the model crate's
//! `fixtures/` folder.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};
use vnfarm_models::loading::pth::PthFile;
use vnfarm_models::loading::safetensors::SafetensorsFile;
use vnfarm_models::qwen_image::keys::wan_vae_key;
use vnfarm_models::qwen_image::vae::QwenVaeConfig;

/// `comfy/vae_wan.safetensors`: the tiny Qwen VAE of `qwen/qwen_tiny/vae/` under the Wan 2.1 /
/// ComfyUI key names (`make_qwen_fixtures.py`, `wan_vae_name`), the same F16 tensors.
pub fn qwen_vae_wan(fixtures: &Path) -> PathBuf {
    derive("qwen/vae_wan.safetensors", || {
        let src = fixtures.join("qwen/qwen_tiny/vae/diffusion_pytorch_model.safetensors");
        let f = open(&src);
        let nrb = QwenVaeConfig::tiny().num_res_blocks;
        let tensors = f
            .names()
            .map(|k| {
                let wan = wan_vae_name(k, nrb).unwrap_or_else(|| panic!("no Wan name for {k}"));
                // The loader's own mapping must lead back (it is checked against diffusers'
                // `convert_wan_vae_to_diffusers` on the real layout by the generator script).
                assert_eq!(wan_vae_key(&wan, nrb).as_deref(), Some(k), "{wan}");
                (wan, native(&f, k))
            })
            .collect();
        serialize(tensors, &[("format", "pt")])
    })
}

/// `comfy/text_encoder_fp8_scaled.safetensors`: the tiny text encoder of `qwen/qwen_tiny/
/// text_encoder/` (both shards) as ComfyUI's legacy "scaled fp8" (`make_qwen_fixtures.py`,
/// `write_comfy_text_encoder`): each Linear weight `v` as `q = (v / s)` in F8_E4M3 with
/// `<layer>.scale_weight = s`, `s = max|v| / 448` (`common.scaled_fp8`), and the `scaled_fp8`
/// sentinel; every other tensor as it is (F16). The folder stores exactly those Linear weights in
/// F32 (their values `q·s` are not fp16 numbers), which is how they are recognised here.
pub fn qwen_text_encoder_fp8_scaled(fixtures: &Path) -> PathBuf {
    derive("qwen/text_encoder_fp8_scaled.safetensors", || {
        let dir = fixtures.join("qwen/qwen_tiny/text_encoder");
        let mut out = vec![(
            "scaled_fp8".to_string(),
            Tensor::zeros([0], (Kind::Float8e4m3fn, Device::Cpu)),
        )];
        for shard in shards(&dir) {
            let f = open(&shard);
            for k in f.names() {
                let v = native(&f, k);
                if v.kind() != Kind::Float {
                    out.push((k.to_string(), v));
                    continue;
                }
                let layer = k
                    .strip_suffix(".weight")
                    .filter(|_| v.dim() == 2)
                    .unwrap_or_else(|| panic!("{k}: an F32 tensor that is no Linear weight"));
                let s = v.abs().max() / 448.0;
                let q = (&v / &s).to_kind(Kind::Float8e4m3fn);
                assert!(
                    (q.to_kind(Kind::Float) * &s).equal(&v),
                    "{k} is not exactly q·s in scaled fp8"
                );
                out.push((k.to_string(), q));
                out.push((format!("{layer}.scale_weight"), s));
            }
        }
        serialize(out, &[("format", "pt")])
    })
}

/// `comfy/transformer_fp8_e4m3fn.safetensors`: the tiny transformer of `qwen/qwen_tiny/
/// transformer/` with bare diffusers keys (`make_qwen_fixtures.py`, `write_comfy_transformer`):
/// every Linear weight (the 2-D `.weight`s) cast to F8_E4M3 (scale 1: the values are fp8 numbers),
/// every other tensor BF16 where that holds it exactly, else F32.
pub fn qwen_transformer_fp8(fixtures: &Path) -> PathBuf {
    derive("qwen/transformer_fp8_e4m3fn.safetensors", || {
        serialize(transformer_fp8_tensors(fixtures, ""), &[("format", "pt")])
    })
}

/// `comfy/transformer_fp8_e4m3fn_prefixed.safetensors`: [`qwen_transformer_fp8`] with every key
/// under `model.diffusion_model.`.
pub fn qwen_transformer_fp8_prefixed(fixtures: &Path) -> PathBuf {
    derive("qwen/transformer_fp8_e4m3fn_prefixed.safetensors", || {
        let tensors = transformer_fp8_tensors(fixtures, "model.diffusion_model.");
        serialize(tensors, &[("format", "pt")])
    })
}

fn transformer_fp8_tensors(fixtures: &Path, prefix: &str) -> Vec<(String, Tensor)> {
    let f = open(&fixtures.join("qwen/qwen_tiny/transformer/diffusion_pytorch_model.safetensors"));
    f.names()
        .map(|k| {
            let v = native(&f, k).to_kind(Kind::Float);
            let t = if v.dim() == 2 && k.ends_with(".weight") {
                let q = v.to_kind(Kind::Float8e4m3fn);
                assert!(q.to_kind(Kind::Float).equal(&v), "{k} is not fp8");
                q
            } else {
                exact_in(&v, Kind::BFloat16).unwrap_or(v)
            };
            (format!("{prefix}{k}"), t)
        })
        .collect()
}

/// `sdxl/sdxl_tiny_ldm.safetensors`: the tiny SDXL of `sdxl/sdxl_tiny/` as one ldm-named single
/// file in F16 (`make_sdxl_fixtures.py`, `write_single_file`: `unet_to_ldm`, `vae_to_ldm`, CLIP-L
/// under `conditioner.embedders.0.transformer.text_model.`, `open_clip_to_ldm`).
pub fn sdxl_tiny_ldm(fixtures: &Path) -> PathBuf {
    derive("sdxl/sdxl_tiny_ldm.safetensors", || {
        let dir = fixtures.join("sdxl/sdxl_tiny");
        let component = |c: &str, file: &str| {
            let f = open(&dir.join(c).join(file));
            f.names()
                .map(|k| (k.to_string(), native(&f, k)))
                .collect::<BTreeMap<_, _>>()
        };
        let mut out = Vec::new();
        out.extend(unet_to_ldm(
            &component("unet", "diffusion_pytorch_model.safetensors"),
            2,
        ));
        out.extend(vae_to_ldm(
            component("vae", "diffusion_pytorch_model.safetensors"),
            2,
        ));
        for (k, v) in component("text_encoder", "model.safetensors") {
            // Single files carry transformers' classic `text_model.` prefix.
            let k = if k.starts_with("text_model.") {
                k
            } else {
                format!("text_model.{k}")
            };
            out.push((format!("conditioner.embedders.0.transformer.{k}"), v));
        }
        out.extend(open_clip_to_ldm(&component(
            "text_encoder_2",
            "model.safetensors",
        )));
        let out = out
            .into_iter()
            .map(|(k, v)| (k, v.to_kind(Kind::Half)))
            .collect();
        serialize(out, &[("format", "pt")])
    })
}

/// `esrgan/tiny_x4.safetensors`: the `params_ema` weights of `esrgan/tiny_x4.pth`, bare keys
/// (`make_esrgan_fixtures.py`).
pub fn esrgan_tiny_x4(fixtures: &Path) -> PathBuf {
    derive("esrgan/tiny_x4.safetensors", || {
        serialize(pth_tensors(&fixtures.join("esrgan/tiny_x4.pth")), &[])
    })
}

/// `esrgan/tiny_x2.safetensors`: the weights of `esrgan/tiny_x2.pth` (`params`), bare keys.
pub fn esrgan_tiny_x2(fixtures: &Path) -> PathBuf {
    derive("esrgan/tiny_x2.safetensors", || {
        serialize(pth_tensors(&fixtures.join("esrgan/tiny_x2.pth")), &[])
    })
}

/// `esrgan/bad/extra_key.safetensors`: [`esrgan_tiny_x4`] plus a key no RRDBNet has,
/// `conv_extra.weight` (zeros, 3×3).
pub fn esrgan_extra_key(fixtures: &Path) -> PathBuf {
    derive("esrgan/extra_key.safetensors", || {
        let mut t = pth_tensors(&fixtures.join("esrgan/tiny_x4.pth"));
        t.push((
            "conv_extra.weight".into(),
            Tensor::zeros([3, 3], (Kind::Float, Device::Cpu)),
        ));
        serialize(t, &[])
    })
}

fn pth_tensors(path: &Path) -> Vec<(String, Tensor)> {
    let f = PthFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.names()
        .map(|k| {
            let kind = f.kind(k).expect("listed");
            let t = f.load(k, Device::Cpu, kind).expect("tensor");
            (k.to_string(), t)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// diffusers -> Wan 2.1 VAE names

/// The Wan 2.1 name of diffusers `AutoencoderKLQwenImage` key `k` (the generator script's
/// `wan_vae_name`: the inverse of diffusers' `convert_wan_vae_to_diffusers`, general in
/// `num_res_blocks`).
fn wan_vae_name(k: &str, num_res_blocks: i64) -> Option<String> {
    const RESNET: [(&str, &str); 5] = [
        ("norm1.gamma", "residual.0.gamma"),
        ("conv1", "residual.2"),
        ("norm2.gamma", "residual.3.gamma"),
        ("conv2", "residual.6"),
        ("conv_shortcut", "shortcut"),
    ];
    let resnet = |rest: &str| {
        RESNET.iter().find_map(|(a, b)| {
            let tail = rest.strip_prefix(a)?;
            (tail.is_empty() || tail.starts_with('.')).then(|| format!("{b}{tail}"))
        })
    };
    for (a, b) in [("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")] {
        if let Some(rest) = k.strip_prefix(a) {
            return Some(format!("{b}{rest}"));
        }
    }
    let (side, rest) = k.split_once('.')?;
    if side != "encoder" && side != "decoder" {
        return None;
    }
    for (a, b) in [
        ("conv_in.", "conv1."),
        ("norm_out.", "head.0."),
        ("conv_out.", "head.2."),
    ] {
        if let Some(tail) = rest.strip_prefix(a) {
            return Some(format!("{side}.{b}{tail}"));
        }
    }
    let p: Vec<&str> = rest.split('.').collect();
    let from = |i: usize| p.get(i..).map(|s| s.join("."));
    let int = |i: usize| p.get(i)?.parse::<i64>().ok();
    match p[0] {
        "mid_block" => {
            let (i, tail) = (int(2)?, from(3)?);
            if p[1] == "attentions" {
                Some(format!("{side}.middle.{}.{tail}", 2 * i + 1))
            } else {
                Some(format!("{side}.middle.{}.{}", 2 * i, resnet(&tail)?))
            }
        }
        "down_blocks" => {
            let (i, tail) = (int(1)?, from(2)?);
            if tail.starts_with("resample.") || tail.starts_with("time_conv.") {
                Some(format!("{side}.downsamples.{i}.{tail}"))
            } else {
                Some(format!("{side}.downsamples.{i}.{}", resnet(&tail)?))
            }
        }
        "up_blocks" => {
            let (b, per) = (int(1)?, num_res_blocks + 2);
            match *p.get(2)? {
                "resnets" => Some(format!(
                    "{side}.upsamples.{}.{}",
                    b * per + int(3)?,
                    resnet(&from(4)?)?
                )),
                "upsamplers" if p.get(3) == Some(&"0") => Some(format!(
                    "{side}.upsamples.{}.{}",
                    b * per + num_res_blocks + 1,
                    from(4)?
                )),
                _ => None,
            }
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// diffusers -> ldm (the generator script's converters, checked there against diffusers' own
// ldm -> diffusers converters)

fn unet_to_ldm(sd: &BTreeMap<String, Tensor>, layers_per_block: usize) -> Vec<(String, Tensor)> {
    let per = layers_per_block + 1;
    let res = |n: &str| match n {
        "norm1" => "in_layers.0",
        "conv1" => "in_layers.2",
        "norm2" => "out_layers.0",
        "conv2" => "out_layers.3",
        "time_emb_proj" => "emb_layers.1",
        "conv_shortcut" => "skip_connection",
        _ => panic!("resnet tensor {n}"),
    };
    const TOP: [(&str, &str); 7] = [
        ("time_embedding.linear_1", "time_embed.0"),
        ("time_embedding.linear_2", "time_embed.2"),
        ("add_embedding.linear_1", "label_emb.0.0"),
        ("add_embedding.linear_2", "label_emb.0.2"),
        ("conv_in", "input_blocks.0.0"),
        ("conv_norm_out", "out.0"),
        ("conv_out", "out.2"),
    ];
    sd.iter()
        .map(|(k, v)| {
            let p: Vec<&str> = k.split('.').collect();
            let int = |i: usize| p[i].parse::<usize>().expect("block index");
            let from = |i: usize| p[i..].join(".");
            let top = TOP.iter().find_map(|(a, b)| {
                k.strip_prefix(a)
                    .filter(|t| t.starts_with('.'))
                    .map(|t| format!("{b}{t}"))
            });
            // The block kind: `mid_block.<kind>.N.…`, `{down,up}_blocks.B.<kind>.N.…`.
            let kind = if p[0] == "mid_block" {
                p[1]
            } else {
                p.get(2).copied().unwrap_or_default()
            };
            let new = top.unwrap_or_else(|| match (p[0], kind) {
                ("down_blocks", "resnets") => format!(
                    "input_blocks.{}.0.{}.{}",
                    int(1) * per + int(3) + 1,
                    res(p[4]),
                    from(5)
                ),
                ("down_blocks", "attentions") => {
                    format!("input_blocks.{}.1.{}", int(1) * per + int(3) + 1, from(4))
                }
                ("down_blocks", "downsamplers") => {
                    format!("input_blocks.{}.0.op.{}", int(1) * per + per, from(5))
                }
                ("mid_block", "resnets") => {
                    format!("middle_block.{}.{}.{}", 2 * int(2), res(p[3]), from(4))
                }
                ("mid_block", _) => format!("middle_block.1.{}", from(3)),
                ("up_blocks", "resnets") => format!(
                    "output_blocks.{}.0.{}.{}",
                    int(1) * per + int(3),
                    res(p[4]),
                    from(5)
                ),
                ("up_blocks", "attentions") => {
                    format!("output_blocks.{}.1.{}", int(1) * per + int(3), from(4))
                }
                ("up_blocks", "upsamplers") => {
                    let attn = format!("up_blocks.{}.attentions.", p[1]);
                    let slot = if sd.keys().any(|x| x.starts_with(&attn)) {
                        2
                    } else {
                        1
                    };
                    format!(
                        "output_blocks.{}.{slot}.conv.{}",
                        int(1) * per + per - 1,
                        from(5)
                    )
                }
                _ => panic!("UNet tensor {k}"),
            });
            (format!("model.diffusion_model.{new}"), v.shallow_clone())
        })
        .collect()
}

fn vae_to_ldm(sd: BTreeMap<String, Tensor>, n_blocks: usize) -> Vec<(String, Tensor)> {
    const ATTN: [(&str, &str); 5] = [
        ("group_norm", "norm"),
        ("to_q", "q"),
        ("to_k", "k"),
        ("to_v", "v"),
        ("to_out.0", "proj_out"),
    ];
    let nin = |s: String| s.replace("conv_shortcut", "nin_shortcut");
    sd.into_iter()
        .map(|(k, mut v)| {
            let (side, rest) = k.split_once('.').expect("dotted key");
            let p: Vec<&str> = rest.split('.').collect();
            let from = |i: usize| p[i..].join(".");
            let new = match (side, p[0]) {
                ("quant_conv" | "post_quant_conv", _) => k.clone(),
                (_, "conv_in" | "conv_out") => format!("{side}.{rest}"),
                (_, "conv_norm_out") => format!("{side}.norm_out.{}", from(1)),
                (_, "mid_block") if p[1] == "resnets" => {
                    let block: usize = p[2].parse().expect("index");
                    format!("{side}.mid.block_{}.{}", block + 1, nin(from(3)))
                }
                (_, "mid_block") => {
                    let tail = from(3);
                    let r = ATTN
                        .iter()
                        .find_map(|(a, b)| {
                            tail.strip_prefix(a)
                                .filter(|t| t.starts_with('.'))
                                .map(|t| format!("mid.attn_1.{b}{t}"))
                        })
                        .unwrap_or_else(|| panic!("VAE attention tensor {k}"));
                    // ldm stores the attention projections as 1x1 convs.
                    if v.dim() == 2 {
                        v = v.unsqueeze(-1).unsqueeze(-1);
                    }
                    format!("{side}.{r}")
                }
                (_, "down_blocks") if p[2] == "resnets" => {
                    format!("{side}.down.{}.block.{}.{}", p[1], p[3], nin(from(4)))
                }
                (_, "down_blocks") => format!("{side}.down.{}.downsample.conv.{}", p[1], from(5)),
                (_, "up_blocks") => {
                    let b = n_blocks - 1 - p[1].parse::<usize>().expect("index");
                    if p[2] == "resnets" {
                        format!("{side}.up.{b}.block.{}.{}", p[3], nin(from(4)))
                    } else {
                        format!("{side}.up.{b}.upsample.conv.{}", from(5))
                    }
                }
                _ => panic!("VAE tensor {k}"),
            };
            (format!("first_stage_model.{new}"), v)
        })
        .collect()
}

fn open_clip_to_ldm(sd: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    const PRE: &str = "conditioner.embedders.1.model.";
    const LAYER: [(&str, &str); 5] = [
        ("layer_norm1", "ln_1"),
        ("layer_norm2", "ln_2"),
        ("self_attn.out_proj", "attn.out_proj"),
        ("mlp.fc1", "mlp.c_fc"),
        ("mlp.fc2", "mlp.c_proj"),
    ];
    let mut out = Vec::new();
    for (k, v) in sd {
        let v = v.shallow_clone();
        if k == "text_model.embeddings.token_embedding.weight" {
            out.push((format!("{PRE}token_embedding.weight"), v));
        } else if k == "text_model.embeddings.position_embedding.weight" {
            out.push((format!("{PRE}positional_embedding"), v));
        } else if let Some(t) = k.strip_prefix("text_model.final_layer_norm.") {
            out.push((format!("{PRE}ln_final.{t}"), v));
        } else if k == "text_projection.weight" {
            out.push((format!("{PRE}text_projection"), v.tr().contiguous()));
        } else if let Some(rest) = k.strip_prefix("text_model.encoder.layers.") {
            let (n, rest) = rest.split_once('.').expect("layer index");
            let base = format!("{PRE}transformer.resblocks.{n}.");
            if let Some(kind) = rest.strip_prefix("self_attn.q_proj.") {
                let part = |x: &str| {
                    sd[&format!("text_model.encoder.layers.{n}.self_attn.{x}_proj.{kind}")]
                        .shallow_clone()
                };
                let qkv = Tensor::cat(&[part("q"), part("k"), part("v")], 0);
                out.push((format!("{base}attn.in_proj_{kind}"), qkv));
            } else if !(rest.starts_with("self_attn.k_proj.")
                || rest.starts_with("self_attn.v_proj."))
            {
                let (a, b) = LAYER
                    .iter()
                    .find(|(a, _)| rest.starts_with(&format!("{a}.")))
                    .unwrap_or_else(|| panic!("CLIP-G tensor {k}"));
                out.push((format!("{base}{b}{}", &rest[a.len()..]), v));
            }
        } else if !k.ends_with("position_ids") {
            panic!("CLIP-G tensor {k}");
        }
    }
    out.push((format!("{PRE}logit_scale"), Tensor::from(4.6052f32)));
    out
}

// ---------------------------------------------------------------------------------------------
// reading and writing

fn open(path: &Path) -> SafetensorsFile {
    SafetensorsFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Tensor `name` of `f` in the dtype it is stored in.
fn native(f: &SafetensorsFile, name: &str) -> Tensor {
    let dtype = &f.info(name).expect("listed").dtype;
    let (kind, _) = vnfarm_models::loading::safetensors::kind_of(dtype)
        .unwrap_or_else(|| panic!("{name}: dtype {dtype}"));
    f.load(name, Device::Cpu, kind)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The shards of a sharded folder (its `model.safetensors.index.json`), in order.
fn shards(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(dir.join("model.safetensors.index.json")).expect("index");
    let index: serde_json::Value = serde_json::from_str(&text).expect("index json");
    let names: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .expect("weight_map")
        .values()
        .map(|v| v.as_str().expect("shard name"))
        .collect();
    names.into_iter().map(|n| dir.join(n)).collect()
}

/// `t` in `kind` when that holds every value exactly.
fn exact_in(t: &Tensor, kind: Kind) -> Option<Tensor> {
    let c = t.to_kind(kind);
    c.to_kind(t.kind()).equal(t).then_some(c)
}

/// The safetensors dtype name of `kind`.
fn dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::Bool => "BOOL",
        Kind::Uint8 => "U8",
        Kind::Int8 => "I8",
        Kind::Float8e5m2 => "F8_E5M2",
        Kind::Float8e4m3fn => "F8_E4M3",
        Kind::Int16 => "I16",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int => "I32",
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Int64 => "I64",
        other => panic!("no safetensors dtype for {other:?}"),
    }
}

/// A safetensors file, laid out as Python's `safetensors.torch.save_file` (0.8) lays it out, so
/// that a derived file is byte for byte the one the generator script wrote: tensors ordered by
/// dtype (the order of the format's `Dtype` enum, last first), then by name; a compact JSON
/// header with `__metadata__` first (when given) and each entry's fields in the order dtype,
/// shape, data_offsets, padded with spaces to a multiple of 8 bytes. Written here because the
/// workspace's `safetensors` crate (0.3) knows no fp8 dtypes.
fn serialize(mut tensors: Vec<(String, Tensor)>, metadata: &[(&str, &str)]) -> Vec<u8> {
    const ORDER: [&str; 12] = [
        "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64",
    ];
    let rank = |t: &Tensor| ORDER.iter().position(|d| *d == dtype(t.kind()));
    tensors.sort_by(|(a, x), (b, y)| rank(y).cmp(&rank(x)).then(a.cmp(b)));
    let text = |s: &str| serde_json::to_string(s).expect("a JSON string");
    let mut entries = Vec::new();
    if !metadata.is_empty() {
        let fields: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", text(k), text(v)))
            .collect();
        entries.push(format!("\"__metadata__\":{{{}}}", fields.join(",")));
    }
    let mut data = Vec::new();
    for (name, t) in &tensors {
        let t = t.contiguous();
        let start = data.len();
        data.resize(start + t.numel() * t.kind().elt_size_in_bytes(), 0);
        t.copy_data_u8(&mut data[start..], t.numel());
        entries.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{start},{}]}}",
            text(name),
            dtype(t.kind()),
            serde_json::to_string(&t.size()).expect("a JSON list"),
            data.len()
        ));
    }
    let mut header = format!("{{{}}}", entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// The path of derived file `name`, written by `bytes` on the first call in this process.
fn derive(name: &str, bytes: impl FnOnce() -> Vec<u8>) -> PathBuf {
    static WRITTEN: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut written = WRITTEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = written.get(name) {
        return path.clone();
    }
    let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("derived-fixtures")
        .join(name);
    let dir = path.parent().expect("a file name");
    std::fs::create_dir_all(dir).expect("derived fixture folder");
    let tmp = dir.join(format!(
        ".{}.{}",
        path.file_name().expect("name").to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes()).expect("write derived fixture");
    std::fs::rename(&tmp, &path).expect("rename derived fixture");
    written.insert(name.to_string(), path.clone());
    path
}
