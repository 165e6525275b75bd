//! A pipeline's jobs, derived from its spec.
//!
//! A pipeline is one `queued` event: it lists its jobs' ids, and every reader (each scheduler, on
//! every replay; the fleet benchmark) derives their specs from the pipeline's own with
//! [`pipeline_jobs`], so a pipeline is either wholly known or not at all.

use crate::spec::{EditSpec, ImageRef, JobSpec, PipelineImage, Submission, UpscaleSpec};
use crate::{JobId, SCHEMA_VERSION};

/// How many jobs a pipeline expands into (0 for any other job).
pub fn pipeline_size(submission: &Submission) -> usize {
    match &submission.job {
        JobSpec::Pipeline(p) => 1 + p.edits.len() + p.upscales.len(),
        JobSpec::Generate(_) | JobSpec::Edit(_) | JobSpec::Upscale(_) => 0,
    }
}

/// The jobs of a pipeline with the given ids: its base generate, the edits of the base image, the
/// upscales. Edits and upscales take their input from the job they depend on. `Some(vec![])` for a
/// job that is not a pipeline (with no ids); `None` when the ids do not fit the spec.
///
/// Deterministic: the registry derives a pipeline's jobs from its one `queued` event with this, on
/// every scheduler and on every replay.
pub fn pipeline_jobs(submission: &Submission, ids: &[JobId]) -> Option<Vec<Submission>> {
    if ids.len() != pipeline_size(submission) {
        return None;
    }
    let JobSpec::Pipeline(p) = &submission.job else {
        return Some(Vec::new());
    };
    let mut ids = ids.iter().copied();
    let mut child = |job: JobSpec| Submission {
        schema_version: SCHEMA_VERSION,
        job_id: ids.next(),
        idempotency_key: None,
        priority: submission.priority,
        deadline: submission.deadline,
        job,
    };
    let base = child(JobSpec::Generate(p.base.clone()));
    let base_id = base.job_id?;
    let mut out = vec![base];
    let mut edit_ids = Vec::new();
    for e in &p.edits {
        // Picture 1 is the base; the variants keep its size (floored to the model's multiple of 16),
        // so a pipeline's images line up.
        let inputs: Vec<ImageRef> = std::iter::once(ImageRef::JobOutput {
            job: base_id,
            index: 0,
        })
        .chain(e.references.iter().cloned())
        .collect();
        let edit = child(JobSpec::Edit(EditSpec {
            input: None,
            inputs,
            width: Some(p.base.width / 16 * 16),
            height: Some(p.base.height / 16 * 16),
            instruction: e.instruction.clone(),
            steps: e.steps,
            cfg: e.cfg,
            seed: e.seed,
            loras: e.loras.clone(),
        }));
        edit_ids.push(edit.job_id?);
        out.push(edit);
    }
    for u in &p.upscales {
        let source = match u.of {
            PipelineImage::Base => base_id,
            PipelineImage::Edit(n) => *edit_ids.get(n)?,
        };
        out.push(child(JobSpec::Upscale(UpscaleSpec {
            input: ImageRef::JobOutput {
                job: source,
                index: 0,
            },
            scale: u.scale,
            tile: u.tile,
            tile_overlap: u.tile_overlap,
        })));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_json;

    fn pipeline() -> Submission {
        decode_json(
            br#"{"schema_version": 1, "job": {"kind": "pipeline", "base": {"prompt": "x", "width": 1000},
                "edits": [{"instruction": "smile"}], "upscales": [{"of": {"edit": 0}}]}}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_pipelines_jobs_take_their_inputs_from_the_jobs_before_them() {
        let ids: Vec<JobId> = (0..3).map(|_| JobId::new()).collect();
        let jobs = pipeline_jobs(&pipeline(), &ids).unwrap();
        let names: Vec<&str> = jobs.iter().map(|j| j.job.kind_name()).collect();
        assert_eq!(names, ["generate", "edit", "upscale"]);
        let JobSpec::Edit(edit) = &jobs[1].job else {
            unreachable!()
        };
        assert_eq!(
            edit.inputs,
            [ImageRef::JobOutput {
                job: ids[0],
                index: 0
            }]
        );
        assert_eq!(
            edit.width,
            Some(992),
            "the base's size floored to a multiple of 16"
        );
        let JobSpec::Upscale(upscale) = &jobs[2].job else {
            unreachable!()
        };
        assert_eq!(
            upscale.input,
            ImageRef::JobOutput {
                job: ids[1],
                index: 0
            }
        );
        assert!(jobs.iter().zip(&ids).all(|(j, id)| j.job_id == Some(*id)));
    }

    #[test]
    fn ids_that_do_not_fit_the_spec_derive_nothing() {
        assert!(pipeline_jobs(&pipeline(), &[JobId::new()]).is_none());
        assert_eq!(pipeline_size(&pipeline()), 3);
    }
}
