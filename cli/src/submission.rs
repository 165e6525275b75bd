//! Turning `submit` flags into a [`Submission`]: the builders (the flags' values are parsed by
//! [`crate::values`]).
//!
//! Everything here builds the typed `vnfarm_proto` structures and leaves bounds to
//! [`Submission::validate`] on the scheduler, which names the offending field; only what the
//! scheduler cannot see (a file that is not there, a flag that does not parse) is checked locally.

use std::io::Read as _;
use std::path::Path;

use anyhow::Context as _;
use vnfarm_proto::spec::{PipelineEdit, PipelineUpscale};
use vnfarm_proto::{
    EditSpec, GenerateSpec, JobSpec, PipelineSpec, SCHEMA_VERSION, Submission, UpscaleSpec,
    decode_json,
};

use crate::args::{BaseArgs, SubmitCommand, SubmitOptions};
use crate::values::InputArg;

impl SubmitCommand {
    pub fn options(&self) -> &SubmitOptions {
        match self {
            SubmitCommand::Generate { options, .. }
            | SubmitCommand::Edit { options, .. }
            | SubmitCommand::Upscale { options, .. }
            | SubmitCommand::Pipeline { options, .. }
            | SubmitCommand::File { options, .. } => options,
        }
    }
}

/// The submission a `submit` command stands for. Reads `@file` inputs and the job file.
pub fn build(cmd: &SubmitCommand) -> anyhow::Result<Submission> {
    let job = match cmd {
        SubmitCommand::Generate {
            base, count, loras, ..
        } => JobSpec::Generate(GenerateSpec {
            count: *count,
            loras: loras.clone(),
            ..generate_spec(base)
        }),
        SubmitCommand::Edit { edit, .. } => {
            let mut inputs = edit
                .inputs
                .iter()
                .map(InputArg::resolve)
                .collect::<anyhow::Result<Vec<_>>>()?;
            let input = (inputs.len() == 1).then(|| inputs.remove(0));
            JobSpec::Edit(EditSpec {
                input,
                inputs,
                width: edit.width,
                height: edit.height,
                instruction: edit.instruction.clone(),
                steps: edit.steps,
                cfg: edit.cfg,
                seed: edit.seed,
                loras: edit.loras.clone(),
            })
        }
        SubmitCommand::Upscale { upscale, .. } => JobSpec::Upscale(UpscaleSpec {
            input: upscale.input.resolve()?,
            scale: upscale.params.scale,
            tile: upscale.params.tile,
            tile_overlap: upscale.params.tile_overlap,
        }),
        SubmitCommand::Pipeline { pipeline: p, .. } => JobSpec::Pipeline(PipelineSpec {
            base: GenerateSpec {
                loras: p.base_loras.clone(),
                ..generate_spec(&p.base)
            },
            edits: p
                .edits
                .iter()
                .map(|instruction| PipelineEdit {
                    instruction: instruction.clone(),
                    references: Vec::new(),
                    steps: p.edit_steps,
                    cfg: p.edit_cfg,
                    seed: None,
                    loras: p.loras.clone(),
                })
                .collect(),
            upscales: p
                .upscales
                .iter()
                .map(|of| PipelineUpscale {
                    of: *of,
                    scale: p.upscale_params.scale,
                    tile: p.upscale_params.tile,
                    tile_overlap: p.upscale_params.tile_overlap,
                })
                .collect(),
        }),
        SubmitCommand::File { path, options } => {
            let mut submission = read_submission(path)?;
            if let Some(priority) = options.priority {
                submission.priority = priority.into();
            }
            if let Some(key) = &options.idempotency_key {
                submission.idempotency_key = Some(key.clone());
            }
            return Ok(submission);
        }
    };
    let options = cmd.options();
    Ok(Submission {
        schema_version: SCHEMA_VERSION,
        job_id: None,
        idempotency_key: options.idempotency_key.clone(),
        priority: options.priority.map(Into::into).unwrap_or_default(),
        deadline: None,
        job,
    })
}

/// A generate of one image (the spec's `count` default).
fn generate_spec(base: &BaseArgs) -> GenerateSpec {
    GenerateSpec {
        prompt: base.prompt.clone(),
        negative_prompt: base.negative.clone(),
        width: base.width,
        height: base.height,
        steps: base.steps,
        cfg: base.cfg,
        sampler: base.sampler.into(),
        seed: base.seed,
        count: 1,
        checkpoint: base.checkpoint.clone(),
        loras: Vec::new(),
    }
}

/// A Submission from a JSON file, or standard input for `-`, decoded as strictly as the scheduler does.
fn read_submission(path: &Path) -> anyhow::Result<Submission> {
    let bytes = if path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("reading the submission from stdin")?;
        bytes
    } else {
        std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
    };
    decode_json(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: {}: {}", path.display(), e.field, e.message))
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use vnfarm_proto::{ImageRef, JobId, LoraRef, Priority, Sampler};

    use super::*;
    use crate::args::{Cli, Command};
    use crate::values::parse_lora;

    fn submission(args: &[&str]) -> Submission {
        let cli = Cli::try_parse_from(["vnfarm", "submit"].iter().chain(args)).unwrap();
        let Command::Submit(cmd) = cli.command else {
            panic!("not a submit command")
        };
        build(&cmd).unwrap()
    }

    fn parse_error(args: &[&str]) -> String {
        Cli::try_parse_from(["vnfarm", "submit"].iter().chain(args))
            .unwrap_err()
            .to_string()
    }

    /// What the scheduler would decode from the same submission without the defaulted fields.
    fn decoded(json: serde_json::Value) -> Submission {
        decode_json(json.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn generate_defaults_match_the_spec_defaults() {
        let sub = submission(&["generate", "--prompt", "a cat"]);
        let expected = decoded(
            serde_json::json!({"schema_version": 1, "job": {"kind": "generate", "prompt": "a cat"}}),
        );
        assert_eq!(sub, expected);
    }

    #[test]
    fn generate_flags_are_carried() {
        let sub = submission(&[
            "generate",
            "--prompt",
            "p",
            "--negative",
            "n",
            "--width",
            "832",
            "--height",
            "1216",
            "--steps",
            "30",
            "--cfg",
            "6.5",
            "--sampler",
            "dpmpp_two_m_karras",
            "--seed",
            "42",
            "--count",
            "3",
            "--priority",
            "interactive",
            "--idempotency-key",
            "k1",
            "--no-watch",
        ]);
        assert_eq!(sub.priority, Priority::Interactive);
        assert_eq!(sub.idempotency_key.as_deref(), Some("k1"));
        let JobSpec::Generate(g) = sub.job else {
            panic!("{:?}", sub.job)
        };
        assert_eq!(
            (g.negative_prompt.as_str(), g.width, g.height, g.steps),
            ("n", 832, 1216, 30)
        );
        assert_eq!(
            (g.cfg, g.sampler, g.seed, g.count),
            (6.5, Sampler::DpmppTwoMKarras, Some(42), 3)
        );
        // It serializes with the wire names.
        let json = serde_json::to_value(submission(&[
            "generate",
            "--prompt",
            "p",
            "--sampler",
            "euler_ancestral",
        ]))
        .unwrap();
        assert_eq!(json["job"]["sampler"], "euler_ancestral");
        assert_eq!(json["job"]["kind"], "generate");
        let sub = submission(&[
            "generate", "--prompt", "p", "--lora", "ink:0.8", "--lora", "detail",
        ]);
        let JobSpec::Generate(g) = sub.job else {
            panic!("not a generate")
        };
        let loras: Vec<(&str, f32)> = g
            .loras
            .iter()
            .map(|l| (l.name.as_str(), l.weight))
            .collect();
        assert_eq!(loras, [("ink", 0.8), ("detail", 1.0)]);
    }

    #[test]
    fn pipeline_flags_build_the_pipeline_spec() {
        let sub = submission(&[
            "pipeline",
            "--prompt",
            "a girl",
            "--width",
            "832",
            "--seed",
            "5",
            "--edit",
            "make her smile",
            "--edit",
            "make her angry",
            "--lora",
            "lightning:0.5",
            "--base-lora",
            "ink:0.8",
            "--upscale",
            "base",
            "--upscale",
            "edit:1",
            "--scale",
            "4",
        ]);
        let expected = decoded(
            serde_json::json!({"schema_version": 1, "job": {"kind": "pipeline",
            "base": {"prompt": "a girl", "width": 832, "seed": 5, "loras": [{"name": "ink", "weight": 0.8}]},
            "edits": [
                {"instruction": "make her smile", "loras": [{"name": "lightning", "weight": 0.5}]},
                {"instruction": "make her angry", "loras": [{"name": "lightning", "weight": 0.5}]}],
            "upscales": [{"of": "base", "scale": 4}, {"of": {"edit": 1}, "scale": 4}]}}),
        );
        assert_eq!(sub, expected);
    }

    #[test]
    fn file_inputs_become_inline_base64() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.png");
        std::fs::write(&path, b"\x89PNG fake").unwrap();
        let sub = submission(&[
            "edit",
            "--input",
            &format!("@{}", path.display()),
            "--instruction",
            "smile",
        ]);
        let JobSpec::Edit(e) = &sub.job else {
            panic!("{:?}", sub.job)
        };
        let input = e.input.as_ref().expect("one --input is `input`");
        assert_eq!(input, &ImageRef::Inline("iVBORyBmYWtl".into()));
        assert_eq!(input.inline_bytes().unwrap().unwrap(), b"\x89PNG fake");
        assert_eq!((e.steps, e.cfg, e.seed), (4, 1.0, None));

        let missing =
            Cli::try_parse_from(["vnfarm", "submit", "upscale", "--input", "@/no/such.png"])
                .unwrap();
        let Command::Submit(cmd) = missing.command else {
            panic!()
        };
        assert!(format!("{:#}", build(&cmd).unwrap_err()).contains("/no/such.png"));
    }

    #[test]
    fn edit_and_upscale_flags() {
        let id = JobId::new();
        let sub = submission(&[
            "edit",
            "--input",
            &format!("job:{id}:1"),
            "--instruction",
            "smile",
            "--steps",
            "8",
            "--lora",
            "a.safetensors",
            "--lora",
            "b:-0.25",
        ]);
        let expected = decoded(
            serde_json::json!({"schema_version": 1, "job": {"kind": "edit",
            "input": {"job_output": {"job": id, "index": 1}}, "instruction": "smile", "steps": 8,
            "loras": [{"name": "a.safetensors"}, {"name": "b", "weight": -0.25}]}}),
        );
        assert_eq!(sub, expected);

        let sub = submission(&[
            "upscale",
            "--input",
            "inputs/a.png",
            "--scale",
            "4",
            "--tile",
            "256",
            "--tile-overlap",
            "16",
        ]);
        let expected = decoded(
            serde_json::json!({"schema_version": 1, "job": {"kind": "upscale",
            "input": {"stored": "inputs/a.png"}, "scale": 4, "tile": 256, "tile_overlap": 16}}),
        );
        assert_eq!(sub, expected);
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        for (args, needle) in [
            (
                &[
                    "edit",
                    "--input",
                    "inputs/a.png",
                    "--instruction",
                    "x",
                    "--lora",
                    "a:heavy",
                ][..],
                "heavy",
            ),
            (
                &[
                    "edit",
                    "--input",
                    "inputs/a.png",
                    "--instruction",
                    "x",
                    "--lora",
                    "a:NaN",
                ],
                "finite",
            ),
            (
                &[
                    "edit",
                    "--input",
                    "inputs/a.png",
                    "--instruction",
                    "x",
                    "--lora",
                    ":1",
                ],
                "empty",
            ),
            (
                &["edit", "--input", "a.png", "--instruction", "x"],
                "inputs/",
            ),
            (
                &["upscale", "--input", "inputs/a.png", "--scale", "3"],
                "2 or 4",
            ),
            (
                &["pipeline", "--prompt", "p", "--upscale", "edit"],
                "edit:N",
            ),
            (
                &["pipeline", "--prompt", "p", "--upscale", "edit:x"],
                "edit index",
            ),
            (&["generate", "--prompt", "p", "--sampler", "ddim"], "ddim"),
        ] {
            let message = parse_error(args);
            assert!(message.contains(needle), "{args:?}: {message}");
        }
        assert_eq!(
            parse_lora("x:2"),
            Ok(LoraRef {
                name: "x".into(),
                weight: 2.0
            })
        );
        let hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        for (arg, weight) in [
            (format!("sha256:{hash}"), 1.0),
            (format!("sha256:{hash}:0.5"), 0.5),
        ] {
            assert_eq!(
                parse_lora(&arg),
                Ok(LoraRef {
                    name: format!("sha256:{hash}"),
                    weight
                })
            );
        }
    }

    #[test]
    fn a_job_file_is_decoded_strictly_and_overridden_by_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.json");
        std::fs::write(&path, r#"{"schema_version": 1, "priority": "interactive", "job": {"kind": "generate", "prompt": "x"}}"#).unwrap();
        let sub = submission(&["file", path.to_str().unwrap(), "--idempotency-key", "k"]);
        assert_eq!(
            (sub.priority, sub.idempotency_key.as_deref()),
            (Priority::Interactive, Some("k"))
        );
        let sub = submission(&["file", path.to_str().unwrap(), "--priority", "batch"]);
        assert_eq!(sub.priority, Priority::Batch);

        std::fs::write(
            &path,
            r#"{"schema_version": 1, "job": {"kind": "generate", "prompt": "x", "colour": 1}}"#,
        )
        .unwrap();
        let cli =
            Cli::try_parse_from(["vnfarm", "submit", "file", path.to_str().unwrap()]).unwrap();
        let Command::Submit(cmd) = cli.command else {
            panic!()
        };
        let message = build(&cmd).unwrap_err().to_string();
        assert!(message.contains("job"), "{message}");
    }
}
