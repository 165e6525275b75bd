//! The short form of the fleet benchmark (`fleet-bench --quick`): the same workload through the
//! affinity policy (with and without batch messages) and both baselines. Timings are the
//! benchmark's business (docs/performance.md); this checks what must hold whatever the machine's
//! speed: every job finishes under every set-up, affinity encodes edited inputs far less often than
//! least-loaded dispatch, and same-input edits travel in batches when batches are allowed.

use vnfarm_tests::fleet::{self, RunConfig, VARIANTS, Workload};

#[tokio::test(flavor = "multi_thread")]
async fn every_policy_completes_the_workload_and_affinity_encodes_less() -> anyhow::Result<()> {
    let config = RunConfig::quick();
    let workload = Workload::new(&config);
    let mut reports = Vec::new();
    for variant in VARIANTS {
        let report = fleet::run_policy(variant, &config, &workload).await?;
        let name = variant.name;
        assert_eq!(
            report.jobs,
            workload.jobs(),
            "{name}: every job is in the log"
        );
        assert_eq!(report.completed, report.jobs, "{name}: every job completed");
        reports.push(report);
    }
    println!("{}", fleet::render(&config, &reports));
    let baseline = &reports[2];
    assert_eq!(baseline.policy, "least_loaded");
    for (variant, report) in VARIANTS.iter().zip(&reports) {
        if variant.policy == "affinity" {
            // Step 4b's goal is at most 1.1 on a saturated farm (docs/performance.md). This short
            // form leaves workers idle, and idle workers take held edits (work conservation), so
            // what must hold here is: never more encodes than sending each edit anywhere, and far
            // fewer where batch messages keep an input's edits together.
            let bound = if variant.max_batch > 1 { 0.8 } else { 1.0 };
            assert!(
                report.encodes_per_input() <= bound * baseline.encodes_per_input(),
                "{}: {} encodes for {} inputs, least_loaded {}",
                variant.name,
                report.encodes,
                report.distinct_inputs,
                baseline.encodes
            );
        }
        if variant.max_batch == 1 {
            assert_eq!(report.batch_max, 1, "{}: one job per message", variant.name);
        } else {
            assert!(
                report.batch_max > 1,
                "{}: same-input edits share messages",
                variant.name
            );
        }
    }
    Ok(())
}
