//! The shipped configuration files load with the binaries' own loaders, and bad ones are rejected;
//! the RabbitMQ definitions name what the topology declares and grant each role what its code
//! uses (on a real broker: `permissions.rs`).

use std::collections::BTreeSet;
use std::path::Path;

use regex::Regex;
use serde_json::Value;
use vnfarm_proto::topology::{
    self, CANCEL_ROUTING_KEY, HEARTBEAT_ROUTING_PATTERN, JOB_EVENTS_PATTERN, MARKER_ROUTING_PREFIX,
    PEOPLE_ROUTING_PREFIX, Topology, YIELD_ROUTING_KEY,
};
use vnfarm_proto::{JobId, WorkerId};

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
    assert_eq!(worker.engine.kind(), vnfarm_worker::engine::EngineKind::Tch);
    assert_eq!(
        worker.models(),
        [
            vnfarm_proto::ModelFamily::Sdxl,
            vnfarm_proto::ModelFamily::QwenEdit,
            vnfarm_proto::ModelFamily::Esrgan
        ]
    );
}

#[test]
fn engine_settings_are_checked_before_anything_loads() {
    let load = |pairs: &[(&str, &str)]| {
        let env = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        vnfarm_worker::Config::load(Some(&deploy("worker.toml")), env.collect::<Vec<_>>())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let err = load(&[("VNFARM_ENGINE__SDXL__DEVICE", "gpu0")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.device: "), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__VAE_DTYPE", "fp16")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.vae_dtype: "), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__WARM_UP", "[[1000, 7]]")]).unwrap_err();
    assert!(err.starts_with("engine.sdxl.warm_up: "), "{err}");
    // A tch worker cannot claim a family it has no model for.
    let err = vnfarm_worker::Config::load(
        None,
        [
            (
                "VNFARM_ENGINE__SDXL__CHECKPOINT",
                "/models/sdxl.safetensors",
            ),
            ("VNFARM_ENGINE__MODELS", "[\"sdxl\", \"esrgan\"]"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("engine.models: `esrgan`"), "{err}");
    let err = load(&[("VNFARM_ENGINE__ESRGAN__SETTINGS__TILE_OVERLAP", "300")]).unwrap_err();
    assert!(err.starts_with("engine.esrgan.settings"), "{err}");
    let err = load(&[("VNFARM_ENGINE__ESRGAN__BLEND", "smooth")]).unwrap_err();
    assert!(err.contains("blend"), "{err}");
    let err = load(&[("VNFARM_ENGINE__SDXL__SETTINGS__ATTENTION", "flash")]).unwrap_err();
    assert!(err.contains("attention"), "{err}");
    load(&[("VNFARM_ENGINE__SDXL__SETTINGS__ATTENTION", "matmul")]).expect("matmul attention");
    load(&[("VNFARM_ENGINE__SDXL__SETTINGS", "cuda")]).expect("a preset by name");
    let err = load(&[("VNFARM_ENGINE__SDXL__SETTINGS", "fastest")]).unwrap_err();
    assert!(err.contains("fastest"), "{err}");
    let err = load(&[
        (
            "VNFARM_ENGINE__SETTINGS_FILE",
            "/var/lib/vnfarm/settings.json",
        ),
        ("VNFARM_ENGINE__SDXL__SETTINGS", "cuda"),
    ])
    .unwrap_err();
    assert!(
        err.starts_with("engine.sdxl.settings: engine.settings_file decides"),
        "{err}"
    );
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__SETTINGS__FP8", "fp4")]).unwrap_err();
    assert!(err.contains("fp8"), "{err}");
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__MODEL_DIR", "/models/qwen")]).unwrap_err();
    assert!(
        err.starts_with("engine.qwen_edit: give `model_dir`"),
        "{err}"
    );
    let err = load(&[("VNFARM_ENGINE__QWEN_EDIT__WARM_UP", "[[1000, 1000]]")]).unwrap_err();
    assert!(err.starts_with("engine.qwen_edit.warm_up: "), "{err}");
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

pub fn definitions() -> Value {
    let path = deploy("rabbitmq/definitions.json");
    let text = std::fs::read_to_string(&path).expect("deploy/rabbitmq/definitions.json");
    serde_json::from_str(&text).expect("definitions.json is JSON")
}

/// Whether RabbitMQ grants `name` under the permission regex `re`: the broker searches the name
/// (Erlang's `re:run`, unanchored), as `is_match` does.
pub fn grants(re: &str, name: &str) -> bool {
    Regex::new(re)
        .unwrap_or_else(|e| panic!("{re}: {e}"))
        .is_match(name)
}

/// `kind` (configure, write, read) of `user` in `vhost`.
pub fn permission<'a>(d: &'a Value, vhost: &str, user: &str, kind: &str) -> &'a str {
    d["permissions"]
        .as_array()
        .expect("permissions")
        .iter()
        .find(|p| p["user"] == user && p["vhost"] == vhost)
        .unwrap_or_else(|| panic!("no permissions for {user} in {vhost}"))[kind]
        .as_str()
        .expect("a regex")
}

fn topic_permission<'a>(d: &'a Value, user: &str, kind: &str) -> &'a str {
    let t = Topology::default();
    d["topic_permissions"]
        .as_array()
        .expect("topic_permissions")
        .iter()
        .find(|p| p["user"] == user && p["exchange"] == t.events_exchange().as_str())
        .unwrap_or_else(|| panic!("no topic permissions for {user}"))[kind]
        .as_str()
        .expect("a regex")
}

fn box_id(id: &str) -> WorkerId {
    id.parse().expect("a worker id")
}

/// Every name a permission regex is asked about: the topology's, the default exchange's name
/// for permissions (`amq.default`) and a server-named private queue's.
fn all_names(t: &Topology) -> Vec<String> {
    vec![
        t.intake_queue(),
        t.redispatch_queue(),
        t.worker_queue(&box_id("box-1")),
        t.worker_queue(&box_id("box-2")),
        t.events_exchange(),
        t.events_stream(),
        t.leader_queue(),
        t.snapshot_stream(),
        t.dead_exchange(),
        t.dead_watch_queue(),
        t.submissions_exchange(),
        t.give_back_exchange(),
        "amq.default".into(),
        "amq.gen-5bVrm9kXZ2hR".into(),
    ]
}

#[test]
fn definitions_name_what_the_topology_declares() {
    let d = definitions();
    let t = Topology::default();
    let amqp = vnfarm_bus::AmqpConfig::default();
    let names = |key: &str| -> BTreeSet<String> {
        d[key]
            .as_array()
            .expect(key)
            .iter()
            .map(|x| x["name"].as_str().expect("a name").to_owned())
            .collect()
    };
    assert_eq!(names("vhosts"), BTreeSet::from(["vnfarm".to_owned()]));
    assert_eq!(
        names("exchanges"),
        BTreeSet::from([
            t.events_exchange(),
            t.dead_exchange(),
            t.submissions_exchange(),
            t.give_back_exchange(),
        ])
    );
    for x in d["exchanges"].as_array().unwrap() {
        let kind = if x["name"] == t.events_exchange().as_str() {
            "topic"
        } else {
            "fanout"
        };
        assert_eq!(x["type"], kind, "{x}");
        assert_eq!(x["durable"], true, "{x}");
    }
    // The queues the two exchanges bind to, and box-1's (its user may not create it: a queue that
    // dead-letters through the default exchange needs write there to be created, not to be
    // declared again), with the arguments `bus::topology` gives them under the default
    // configuration; the broker test declares them again through those functions.
    assert_eq!(
        names("queues"),
        BTreeSet::from([
            t.intake_queue(),
            t.redispatch_queue(),
            t.worker_queue(&box_id("box-1")),
        ])
    );
    let quorum = |dlx: &str, key: Option<String>| {
        let mut args = serde_json::json!({
            "x-queue-type": "quorum",
            "x-delivery-limit": amqp.delivery_limit,
            "x-dead-letter-exchange": dlx,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        });
        if let Some(key) = key {
            args["x-dead-letter-routing-key"] = key.into();
        }
        args
    };
    for q in d["queues"].as_array().unwrap() {
        let name = q["name"].as_str().unwrap();
        let expected = if name == t.worker_queue(&box_id("box-1")) {
            quorum("", Some(t.redispatch_queue()))
        } else {
            quorum(&t.dead_exchange(), None)
        };
        assert_eq!(q["arguments"], expected, "{name}");
        assert_eq!(q["durable"], true, "{name}");
    }
    let bindings: BTreeSet<(String, String)> = d["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            assert_eq!(b["destination_type"], "queue", "{b}");
            assert_eq!(b["routing_key"], "", "{b}");
            let name = |key: &str| b[key].as_str().expect("a name").to_owned();
            (name("source"), name("destination"))
        })
        .collect();
    assert_eq!(
        bindings,
        BTreeSet::from([
            (t.submissions_exchange(), t.intake_queue()),
            (t.give_back_exchange(), t.redispatch_queue()),
        ])
    );

    // Each policy matches the queues it is for and no other name; none touches a key the clients
    // declare (a policy's delivery limit would cut the leader token's, which is redelivered at
    // every takeover), and the retention policies say what the clients declare by default
    // (where both are set, the broker applies the smaller value).
    let policy = |name: &str| -> &Value {
        d["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no policy {name}"))
    };
    let matched = |p: &Value| -> BTreeSet<String> {
        let pattern = p["pattern"].as_str().unwrap();
        all_names(&t)
            .into_iter()
            .filter(|n| grants(pattern, n))
            .collect()
    };
    let events = policy("vnfarm-events-retention");
    assert_eq!(matched(events), BTreeSet::from([t.events_stream()]));
    assert_eq!(
        events["definition"]["max-age"],
        amqp.events_max_age.as_str()
    );
    assert_eq!(
        events["definition"]["max-length-bytes"],
        amqp.events_max_bytes
    );
    let snapshots = policy("vnfarm-snapshots-retention");
    assert_eq!(matched(snapshots), BTreeSet::from([t.snapshot_stream()]));
    let placement = policy("vnfarm-quorum-placement");
    assert_eq!(
        matched(placement),
        BTreeSet::from([
            t.intake_queue(),
            t.redispatch_queue(),
            t.worker_queue(&box_id("box-1")),
            t.worker_queue(&box_id("box-2")),
            t.leader_queue(),
            t.dead_queue(),
            t.dead_watch_queue(),
        ])
    );
    for p in d["policies"].as_array().unwrap() {
        for key in p["definition"].as_object().unwrap().keys() {
            assert!(
                ["max-age", "max-length-bytes", "queue-leader-locator"].contains(&key.as_str()),
                "policy {}: {key}",
                p["name"]
            );
        }
    }
}

#[test]
fn each_role_is_granted_exactly_the_names_its_code_uses() {
    let d = definitions();
    let t = Topology::default();
    let private = "amq.gen-5bVrm9kXZ2hR".to_owned();
    let default = "amq.default".to_owned();
    let box1 = t.worker_queue(&box_id("box-1"));
    // `vnfarm.dead` names both the dead-letter exchange and the operators' queue: a regex cannot
    // tell them apart.
    let dead = t.dead_exchange();
    // (user, kind, every name it is granted); every other name of `all_names` is refused.
    let expected: Vec<(&str, &str, Vec<String>)> = vec![
        // declare_core and declare_scheduler; its private heartbeat queue.
        (
            "vnfarm-scheduler",
            "configure",
            vec![
                t.intake_queue(),
                t.redispatch_queue(),
                t.events_exchange(),
                t.events_stream(),
                t.leader_queue(),
                t.snapshot_stream(),
                dead.clone(),
                t.dead_watch_queue(),
                t.submissions_exchange(),
                t.give_back_exchange(),
                private.clone(),
            ],
        ),
        // Publishes to the default exchange (dispatch, the leader token, snapshots, renewed
        // submissions), events and dead letters; binds the stream, the dead queues, intake,
        // redispatch and its private queue (a bind needs write on the queue).
        (
            "vnfarm-scheduler",
            "write",
            vec![
                default.clone(),
                t.events_exchange(),
                dead.clone(),
                t.events_stream(),
                t.dead_watch_queue(),
                t.intake_queue(),
                t.redispatch_queue(),
                private.clone(),
            ],
        ),
        // Consumes intake, redispatch, the streams, the leader and dead-watch queues; binds from
        // the four exchanges (a bind needs read on the exchange).
        (
            "vnfarm-scheduler",
            "read",
            vec![
                t.intake_queue(),
                t.redispatch_queue(),
                t.events_exchange(),
                t.events_stream(),
                t.leader_queue(),
                t.snapshot_stream(),
                dead.clone(),
                t.dead_watch_queue(),
                t.submissions_exchange(),
                t.give_back_exchange(),
                private.clone(),
            ],
        ),
        // The worker (amqp.declare_topology = false) declares its own queue and its private
        // control queue, nothing shared; publishes events, dead letters and give-backs, never to
        // the default exchange; binds its private queue to the events exchange (read there) and
        // consumes its two queues.
        (
            "vnfarm-worker-box-1",
            "configure",
            vec![box1.clone(), private.clone()],
        ),
        (
            "vnfarm-worker-box-1",
            "write",
            vec![
                t.events_exchange(),
                dead.clone(),
                t.give_back_exchange(),
                private.clone(),
            ],
        ),
        (
            "vnfarm-worker-box-1",
            "read",
            vec![t.events_exchange(), box1.clone(), private.clone()],
        ),
        ("vnfarm-submitter", "configure", vec![]),
        ("vnfarm-submitter", "write", vec![t.submissions_exchange()]),
        ("vnfarm-submitter", "read", vec![]),
        ("vnfarm-monitoring", "configure", vec![]),
        ("vnfarm-monitoring", "write", vec![]),
        ("vnfarm-monitoring", "read", vec![]),
    ];
    let mut wrong = Vec::new();
    for (user, kind, granted) in &expected {
        let re = permission(&d, "vnfarm", user, kind);
        for name in all_names(&t) {
            if grants(re, &name) != granted.contains(&name) {
                wrong.push(format!(
                    "{user} {kind} {re}: {name} {}",
                    if granted.contains(&name) {
                        "should be granted"
                    } else {
                        "should be refused"
                    }
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // Topic permissions on the events exchange: a worker publishes job events and its own
    // heartbeat, never markers, people's token events (a worker cannot mint a token), control
    // messages or another worker's heartbeat; it binds only
    // its control subscription (the stream's bindings are the scheduler's), so it cannot follow
    // other jobs' events.
    let write = topic_permission(&d, "vnfarm-worker-box-1", "write");
    let job_event = format!("job.{}.started", JobId::new());
    let box1_beat = topology::heartbeat_routing_key(&box_id("box-1"));
    let box2_beat = topology::heartbeat_routing_key(&box_id("box-2"));
    let marker = format!("{MARKER_ROUTING_PREFIX}.{}", JobId::new());
    let token_event = format!("{PEOPLE_ROUTING_PREFIX}.ann.token_created");
    for key in [&job_event, &box1_beat] {
        assert!(grants(write, key), "{write} refuses {key}");
    }
    for key in [
        &box2_beat,
        &marker,
        &token_event,
        CANCEL_ROUTING_KEY,
        YIELD_ROUTING_KEY,
        "job.x",
    ] {
        assert!(!grants(write, key), "{write} grants {key}");
    }
    let read = topic_permission(&d, "vnfarm-worker-box-1", "read");
    let markers = format!("{MARKER_ROUTING_PREFIX}.#");
    for key in [CANCEL_ROUTING_KEY, YIELD_ROUTING_KEY] {
        assert!(grants(read, key), "{read} refuses {key}");
    }
    for key in [
        "#",
        HEARTBEAT_ROUTING_PATTERN,
        "job.*.completed",
        JOB_EVENTS_PATTERN,
        &markers,
    ] {
        assert!(!grants(read, key), "{read} grants {key}");
    }
}

#[test]
fn add_worker_user_makes_the_definitions_worker_for_any_box() {
    let d = definitions();
    let t = Topology::default();
    let out = std::process::Command::new("bash")
        .arg(deploy("rabbitmq/add-worker-user"))
        .args(["box-2", "--print"])
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let mut lines: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
    let for_box2 = |s: &str| s.replace("box-1", "box-2");
    // The last line: import_definitions with the box's queue, compared as JSON.
    let imported = lines.pop().expect("four lines");
    assert_eq!(imported[0], "import_definitions", "{imported:?}");
    let imported: Value = serde_json::from_str(imported[1]).expect("JSON");
    let box1_queue = d["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == t.worker_queue(&box_id("box-1")).as_str())
        .expect("box-1's queue");
    let box2_queue: Value = serde_json::from_str(&for_box2(&box1_queue.to_string())).expect("JSON");
    assert_eq!(imported, serde_json::json!({ "queues": [box2_queue] }));
    let user = "vnfarm-worker-box-2";
    let perm = |kind| for_box2(permission(&d, "vnfarm", "vnfarm-worker-box-1", kind));
    let topic = |kind| for_box2(topic_permission(&d, "vnfarm-worker-box-1", kind));
    let (configure, write, read) = (perm("configure"), perm("write"), perm("read"));
    let (topic_write, topic_read) = (topic("write"), topic("read"));
    let events = t.events_exchange();
    assert_eq!(
        lines,
        [
            vec!["add_user", user],
            vec![
                "set_permissions",
                "-p",
                "vnfarm",
                user,
                configure.as_str(),
                write.as_str(),
                read.as_str()
            ],
            vec![
                "set_topic_permissions",
                "-p",
                "vnfarm",
                user,
                events.as_str(),
                topic_write.as_str(),
                topic_read.as_str()
            ],
        ]
    );
    // The box reads its own queue, not box-1's.
    assert!(grants(&read, &t.worker_queue(&box_id("box-2"))));
    assert!(!grants(&read, &t.worker_queue(&box_id("box-1"))));
    let status = std::process::Command::new("bash")
        .arg(deploy("rabbitmq/add-worker-user"))
        .args(["Box.2", "--print"])
        .output()
        .expect("bash")
        .status;
    assert_eq!(status.code(), Some(64), "an id that is not a worker id");
}
