//! The shipped configuration files load with the binaries' own loaders, and bad ones are rejected.

use std::path::Path;

fn deploy(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(name)
}

#[test]
fn shipped_configs_are_valid() {
    let scheduler = vnfarm_scheduler::Config::load(Some(&deploy("scheduler.toml")), Vec::new())
        .expect("deploy/scheduler.toml");
    assert_eq!(scheduler.amqp.delivery_limit, 3);
    let worker = vnfarm_worker::Config::load(Some(&deploy("worker.toml")), Vec::new())
        .expect("deploy/worker.toml");
    assert_eq!(worker.worker_id, "box-1");
}

#[test]
fn environment_overrides_and_errors_name_the_field() {
    let env = vec![("VNFARM_WORKER_ID".to_string(), "Box One".to_string())];
    let err = vnfarm_worker::Config::load(Some(&deploy("worker.toml")), env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("worker_id: "), "{err}");
    let env = vec![("VNFARM_API_TOKEN".to_string(), "short".to_string())];
    let err = vnfarm_scheduler::Config::load(Some(&deploy("scheduler.toml")), env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("api_token: "), "{err}");
}
