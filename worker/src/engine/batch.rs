//! Helpers the engines share to run the jobs of a batch: result slots for the jobs that can run,
//! grouping by a key, and running a group together or, when that fails in a way one job may owe,
//! job by job.

use super::error::EngineError;
use super::job::{EngineJob, EngineOutput};

/// A batch's result slots (one per job, `None` until answered), with the jobs that can run and
/// what `prepare` made of each; a job `prepare` refuses is answered with its error.
pub(crate) struct Runnable<P> {
    pub results: Vec<Option<Result<EngineOutput, EngineError>>>,
    /// Indices into the batch of the jobs that can run, in order.
    pub runnable: Vec<usize>,
    /// What `prepare` made of each runnable job, in the same order.
    pub prepared: Vec<P>,
}

impl<P> Runnable<P> {
    pub fn of(
        jobs: &[&EngineJob],
        mut prepare: impl FnMut(&EngineJob) -> Result<P, EngineError>,
    ) -> Self {
        let mut out = Self {
            results: jobs.iter().map(|_| None).collect(),
            runnable: Vec::new(),
            prepared: Vec::new(),
        };
        for (i, job) in jobs.iter().enumerate() {
            match prepare(job) {
                Ok(p) => {
                    out.runnable.push(i);
                    out.prepared.push(p);
                }
                Err(e) => out.results[i] = Some(Err(e)),
            }
        }
        out
    }
}

/// The results of a batch, a job left unanswered failing (a bug, said so, rather than a lost job).
pub(crate) fn answered(
    results: Vec<Option<Result<EngineOutput, EngineError>>>,
) -> Vec<Result<EngineOutput, EngineError>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Failed("the engine skipped the job".into()))))
        .collect()
}

/// The jobs of a batch in groups: each group holds the indices of jobs with equal `key`, in
/// order, and the groups come in the order of their first job.
pub fn groups<K: PartialEq>(jobs: &[&EngineJob], key: impl Fn(&EngineJob) -> K) -> Vec<Vec<usize>> {
    let mut groups: Vec<(K, Vec<usize>)> = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let k = key(job);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(i),
            None => groups.push((k, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// Runs `group` (indices into `jobs`) together with `run`, which answers one output per job in the
/// group's order. When the group fails in a way that may be one job's fault, each job runs alone,
/// so that only that job fails; a cancelled group reports each job with its own reason.
pub fn together_or_alone(
    jobs: &[&EngineJob],
    group: &[usize],
    mut run: impl FnMut(&[usize]) -> Result<Vec<EngineOutput>, EngineError>,
) -> Vec<(usize, Result<EngineOutput, EngineError>)> {
    let own = |i: usize, e: &EngineError| match e {
        EngineError::Cancelled(reason) => {
            EngineError::Cancelled(jobs[i].cancel.requested().unwrap_or(*reason))
        }
        other => other.clone(),
    };
    match run(group) {
        Ok(outputs) if outputs.len() == group.len() => group
            .iter()
            .copied()
            .zip(outputs.into_iter().map(Ok))
            .collect(),
        Ok(outputs) => {
            let e = EngineError::Failed(format!(
                "the engine answered {} outputs for {} jobs",
                outputs.len(),
                group.len()
            ));
            group.iter().map(|&i| (i, Err(e.clone()))).collect()
        }
        Err(e) if group.len() > 1 && e.may_be_one_jobs() => {
            tracing::warn!(jobs = group.len(), error = %e, "a batch failed; running its jobs one by one");
            group
                .iter()
                .map(|&i| {
                    let alone = run(&[i]).and_then(|mut outputs| {
                        outputs.pop().ok_or_else(|| {
                            EngineError::Failed("the engine answered no output".into())
                        })
                    });
                    (i, alone.map_err(|e| own(i, &e)))
                })
                .collect()
        }
        Err(e) => group.iter().map(|&i| (i, Err(own(i, &e)))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::error::CancelReason;
    use crate::engine::job::tests::job;
    use vnfarm_proto::{StageTimings, Task};

    fn output() -> EngineOutput {
        EngineOutput {
            images: Vec::new(),
            seeds: Vec::new(),
            timings: StageTimings::default(),
            encode_cache: None,
            files: Vec::new(),
        }
    }

    fn generate() -> Task {
        vnfarm_proto::decode_json(br#"{"kind": "generate", "prompt": "a lighthouse", "seed": 1}"#)
            .expect("a valid task")
    }

    #[test]
    fn a_group_that_fails_together_runs_again_job_by_job() {
        let jobs: Vec<EngineJob> = (0..3).map(|_| job(generate())).collect();
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let mut calls = Vec::new();
        let results = together_or_alone(&refs, &[0, 1, 2], |members| {
            calls.push(members.to_vec());
            if members.contains(&1) {
                Err(EngineError::InvalidInput("job 1's prompt".into()))
            } else {
                Ok(members.iter().map(|_| output()).collect())
            }
        });
        assert_eq!(calls, [vec![0, 1, 2], vec![0], vec![1], vec![2]]);
        let ok: Vec<(usize, bool)> = results.iter().map(|(i, r)| (*i, r.is_ok())).collect();
        assert_eq!(ok, [(0, true), (1, false), (2, true)]);
    }

    #[test]
    fn a_cancelled_or_lost_group_is_not_run_again() {
        let jobs: Vec<EngineJob> = (0..2).map(|_| job(generate())).collect();
        jobs[0].cancel.request(CancelReason::User);
        jobs[1].cancel.request(CancelReason::Shutdown);
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let mut calls = 0;
        let results = together_or_alone(&refs, &[0, 1], |_| {
            calls += 1;
            Err(EngineError::Cancelled(CancelReason::Shutdown))
        });
        assert_eq!(calls, 1);
        assert!(matches!(
            results[0].1,
            Err(EngineError::Cancelled(CancelReason::User))
        ));
        assert!(matches!(
            results[1].1,
            Err(EngineError::Cancelled(CancelReason::Shutdown))
        ));
        let results = together_or_alone(&refs, &[0, 1], |_| {
            calls += 1;
            Err(EngineError::DeviceLost("CUDA error".into()))
        });
        assert_eq!(calls, 2, "a device failure is nobody's job's fault");
        assert!(
            results
                .iter()
                .all(|(_, r)| matches!(r, Err(EngineError::DeviceLost(_))))
        );
    }

    #[test]
    fn groups_keep_the_order_of_their_first_job() {
        let jobs: Vec<EngineJob> = (0..5).map(|_| job(generate())).collect();
        let refs: Vec<&EngineJob> = jobs.iter().collect();
        let keys = ["b", "a", "b", "c", "a"];
        let index = |j: &EngineJob| refs.iter().position(|r| r.job_id == j.job_id).unwrap();
        assert_eq!(
            groups(&refs, |j| keys[index(j)]),
            [vec![0, 2], vec![1, 4], vec![3]]
        );
    }
}
