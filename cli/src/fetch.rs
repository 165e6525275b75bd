//! `vnfarm fetch`: downloads a job's output images as PNG files.
//!
//! Job `J`'s image `n` is written to `DIR/J-n.png`; a pipeline's jobs each get a folder,
//! `DIR/<job-id>/<job-id>-n.png`, so fetching several jobs into one directory never overwrites.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use vnfarm_proto::JobId;

use vnfarm_proto::http::{JobAnswer, JobState};

use crate::client::Api;

/// Downloads every output of `id` (of each of its jobs, for a pipeline) under `out`; prints each path.
pub async fn fetch(api: &Api, id: JobId, out: &Path) -> anyhow::Result<()> {
    let job = match api.job(id).await? {
        JobAnswer::Live(job) if job.is_pipeline() => job,
        answer => {
            if answer.outputs().is_empty() {
                bail!(
                    "job {id} is {} and has no outputs to fetch",
                    answer.state().as_str()
                );
            }
            save_outputs(api, &answer, out).await?;
            return Ok(());
        }
    };
    let mut written = 0;
    for child_id in &job.children {
        let child = api.job(*child_id).await?;
        if let JobAnswer::Live(child) = &child
            && child.state != JobState::Completed
        {
            eprintln!(
                "skipping {} {child_id}: it is {}",
                child.kind,
                child.state.as_str()
            );
            continue;
        }
        written += save_outputs(api, &child, &out.join(child_id.to_string()))
            .await?
            .len();
    }
    if written == 0 {
        bail!(
            "pipeline {id} is {} and none of its jobs has outputs yet",
            job.state.as_str()
        );
    }
    Ok(())
}

async fn save_outputs(api: &Api, job: &JobAnswer, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    tokio::fs::create_dir_all(dir)
        .await
        .with_context(|| format!("creating {}", dir.display()))?;
    let id = job.id();
    let mut paths = Vec::with_capacity(job.outputs().len());
    for n in 0..job.outputs().len() {
        let bytes = api.output(id, n).await?;
        let path = dir.join(format!("{id}-{n}.png"));
        tokio::fs::write(&path, &bytes)
            .await
            .with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
        paths.push(path);
    }
    Ok(paths)
}
