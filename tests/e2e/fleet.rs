//! The short form of the fleet benchmark (`fleet-bench --quick`): the same workload through the
//! affinity policy and both baselines. Timings are the benchmark's business (docs/performance.md);
//! this checks what must hold whatever the machine's speed: every job finishes under every policy,
//! and under affinity each edited input is encoded about once and same-input edits travel in
//! batches.

use vnfarm_tests::fleet::{self, RunConfig, Workload};

#[tokio::test(flavor = "multi_thread")]
async fn the_affinity_policy_encodes_each_input_about_once() -> anyhow::Result<()> {
    let config = RunConfig::quick();
    let workload = Workload::new(&config);
    let mut reports = Vec::new();
    for policy in ["affinity", "least_loaded", "round_robin"] {
        let report = fleet::run_policy(policy, &config, &workload).await?;
        assert_eq!(
            report.jobs,
            workload.jobs(),
            "{policy}: every job is in the log"
        );
        assert_eq!(
            report.completed, report.jobs,
            "{policy}: every job completed"
        );
        reports.push(report);
    }
    println!("{}", fleet::render(&config, &reports));
    let affinity = &reports[0];
    assert!(
        affinity.encodes_per_input() <= 1.1,
        "affinity: {} encodes for {} inputs",
        affinity.encodes,
        affinity.distinct_inputs
    );
    assert!(affinity.batch_max > 1, "same-input edits share messages");
    for baseline in &reports[1..] {
        assert_eq!(
            baseline.batch_max, 1,
            "{}: one job per message",
            baseline.policy
        );
        assert!(
            baseline.encodes >= affinity.encodes,
            "{} encoded less than affinity",
            baseline.policy
        );
    }
    Ok(())
}
