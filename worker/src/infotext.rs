//! The PNG `parameters` text chunk: a generate's generation parameters in the layout AUTOMATIC1111's
//! stable-diffusion-webui writes (its "infotext", which image browsers and model sites parse), other
//! tasks' as their JSON.

use vnfarm_proto::manifest::{ModelFile, ModelFileRole};
use vnfarm_proto::{JobId, Sampler, Task};

/// Generation parameters for the PNG `parameters` text chunk. A generate's are in the layout
/// AUTOMATIC1111's stable-diffusion-webui writes (its "infotext", which image browsers and model
/// sites parse): the prompt; `Negative prompt: …` when there is one; then one line of `key: value`
/// fields, a value holding a comma, colon or line break written as a JSON string (A1111's
/// `quote`). The model is named by its checkpoint file (first 10 hex digits of its sha256 and the
/// file's stem). LoRAs are named as A1111 names them: 12 hex digits of the sha256 of a safetensors
/// file's data after its header ("AutoV3"; a file of another format by 10 digits of its sha256), and
/// with their strengths as A1111 writes them into the prompt: `<lora:name:weight>`, appended to it.
/// Other tasks: their JSON and the job.
pub(crate) fn parameters_text(job_id: JobId, task: &Task, files: &[ModelFile]) -> String {
    let Task::Generate(g) = task else {
        return format!(
            "{}\nvnfarm job: {job_id}",
            serde_json::to_string(task).expect("tasks serialize to JSON")
        );
    };
    let (sampler, schedule) = a1111_sampler(g.sampler);
    let mut fields: Vec<(&str, String)> = vec![
        ("Steps", g.steps.to_string()),
        ("Sampler", sampler.to_owned()),
    ];
    if let Some(schedule) = schedule {
        fields.push(("Schedule type", schedule.to_owned()));
    }
    // Python prints a whole float with `.0`.
    let cfg = if g.cfg.fract() == 0.0 {
        format!("{:.1}", g.cfg)
    } else {
        g.cfg.to_string()
    };
    fields.push(("CFG scale", cfg));
    fields.push(("Seed", g.seed.unwrap_or_default().to_string()));
    fields.push(("Size", format!("{}x{}", g.width, g.height)));
    let role = |f: &&ModelFile, role| f.role == Some(role);
    if let Some(model) = files.iter().find(|f| role(f, ModelFileRole::Checkpoint)) {
        let stem = std::path::Path::new(&model.name)
            .file_stem()
            .map_or_else(|| model.name.clone(), |s| s.to_string_lossy().into_owned());
        fields.push(("Model hash", short_hash(&model.sha256).to_owned()));
        fields.push(("Model", stem));
    }
    let loras: Vec<String> = files
        .iter()
        .filter(|f| role(f, ModelFileRole::Lora))
        // A1111 names a LoRA by 12 digits of its data hash (AutoV3); a file that is not
        // safetensors has none, and is named by its file hash as checkpoints are.
        .map(|f| match &f.data_sha256 {
            Some(data) => format!("{}: {}", lora_name(&f.name), data.get(..12).unwrap_or(data)),
            None => format!("{}: {}", lora_name(&f.name), short_hash(&f.sha256)),
        })
        .collect();
    if !loras.is_empty() {
        fields.push(("Lora hashes", loras.join(", ")));
    }
    fields.push(("Version", format!("vnfarm {}", env!("CARGO_PKG_VERSION"))));
    fields.push(("vnfarm job", job_id.to_string()));

    let line = fields
        .iter()
        .map(|(key, value)| format!("{key}: {}", a1111_quote(value)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut text = g.prompt.clone();
    for lora in &g.loras {
        text.push_str(&format!(
            " <lora:{}:{}>",
            lora_name(&lora.name),
            lora.weight
        ));
    }
    if !g.negative_prompt.is_empty() {
        text.push_str("\nNegative prompt: ");
        text.push_str(&g.negative_prompt);
    }
    text.push('\n');
    text.push_str(&line);
    text
}

/// A1111's sampler name and schedule type for ours (its `Schedule type` is left out where the
/// sampler uses its own default, which A1111 reads as `Automatic`).
fn a1111_sampler(sampler: Sampler) -> (&'static str, Option<&'static str>) {
    match sampler {
        Sampler::Euler => ("Euler", None),
        Sampler::EulerAncestral => ("Euler a", None),
        Sampler::DpmppTwoMKarras => ("DPM++ 2M", Some("Karras")),
    }
}

/// A LoRA as A1111 names it in `<lora:…>` and `Lora hashes`: its file name without `.safetensors`.
fn lora_name(name: &str) -> &str {
    name.strip_suffix(".safetensors").unwrap_or(name)
}

/// A1111's short hash: the first 10 hex digits of the sha256.
fn short_hash(sha256: &str) -> &str {
    sha256.get(..10).unwrap_or(sha256)
}

/// A1111's `quote`: a value with a comma, colon or line break as a JSON string, others as they are.
fn a1111_quote(value: &str) -> String {
    if value.contains([',', ':', '\n']) {
        serde_json::to_string(value).expect("strings serialize to JSON")
    } else {
        value.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnfarm_proto::decode_json;

    fn file(name: &str, role: ModelFileRole, sha256: &str) -> ModelFile {
        ModelFile {
            name: name.into(),
            sha256: sha256.into(),
            size: 1,
            path: Some(format!("/models/{name}")),
            role: Some(role),
            data_sha256: None,
            strength: None,
        }
    }

    #[test]
    fn generates_carry_a1111_parameters_for_every_sampler() {
        let job = JobId::new();
        let version = env!("CARGO_PKG_VERSION");
        let checkpoint = file(
            "animagine-xl-4.0.safetensors",
            ModelFileRole::Checkpoint,
            &format!("6327eca98b{}", "0".repeat(54)),
        );
        for (sampler, a1111) in [
            ("euler", "Sampler: Euler"),
            ("euler_ancestral", "Sampler: Euler a"),
            (
                "dpmpp_two_m_karras",
                "Sampler: DPM++ 2M, Schedule type: Karras",
            ),
        ] {
            let task: Task = decode_json(
                format!(
                    r#"{{"kind": "generate", "prompt": "1girl, (masterpiece:1.2)",
                        "negative_prompt": "lowres, bad hands", "steps": 28, "cfg": 4.5,
                        "sampler": "{sampler}", "seed": 123, "width": 832, "height": 1216}}"#
                )
                .as_bytes(),
            )
            .expect("a valid task");
            assert_eq!(
                parameters_text(job, &task, std::slice::from_ref(&checkpoint)),
                format!(
                    "1girl, (masterpiece:1.2)\nNegative prompt: lowres, bad hands\n\
                     Steps: 28, {a1111}, CFG scale: 4.5, Seed: 123, Size: 832x1216, \
                     Model hash: 6327eca98b, Model: animagine-xl-4.0, \
                     Version: vnfarm {version}, vnfarm job: {job}"
                ),
                "{sampler}"
            );
        }
    }

    #[test]
    fn lora_hashes_are_quoted_and_a_missing_negative_prompt_or_model_is_left_out() {
        let job = JobId::new();
        let version = env!("CARGO_PKG_VERSION");
        let task: Task = decode_json(
            br#"{"kind": "generate", "prompt": "a lighthouse", "cfg": 7, "seed": 5,
                 "loras": [{"name": "ink_style", "weight": 0.8}, {"name": "detail.pt"}]}"#,
        )
        .expect("a valid task");
        let files = [
            file(
                "base.safetensors",
                ModelFileRole::Checkpoint,
                &"ab".repeat(32),
            ),
            // A safetensors LoRA is named by its data hash (12 digits), a `.pt` one by its file's.
            ModelFile {
                data_sha256: Some("0123456789ab".repeat(5) + "cdef"),
                ..file("ink_style", ModelFileRole::Lora, &"cd".repeat(32))
            },
            file("detail.pt", ModelFileRole::Lora, &"ef".repeat(32)),
        ];
        assert_eq!(
            parameters_text(job, &task, &files),
            format!(
                "a lighthouse <lora:ink_style:0.8> <lora:detail.pt:1>\nSteps: 20, Sampler: Euler, \
                 CFG scale: 7.0, Seed: 5, Size: 1024x1024, Model hash: ababababab, Model: base, \
                 Lora hashes: \"ink_style: 0123456789ab, detail.pt: efefefefef\", \
                 Version: vnfarm {version}, vnfarm job: {job}"
            )
        );
        // A1111 names a LoRA file without its `.safetensors`.
        assert_eq!(lora_name("ink.safetensors"), "ink");
        // The test-pattern engine loads no file: no model is named.
        let line = parameters_text(job, &task, &[]);
        assert!(!line.contains("Model"), "{line}");
        assert!(line.ends_with(&format!("vnfarm job: {job}")), "{line}");
    }
}
