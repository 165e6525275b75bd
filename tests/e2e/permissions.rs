//! deploy/rabbitmq/definitions.json on the real broker: the scheduler and a worker, each logged in
//! as its own user, run a job that the submitter user handed in, and then every role is tried at
//! what it must not do.
//!
//! The definitions are imported into a vhost of this test's own, with the farm's prefix in place
//! of `vnfarm` and a suffix on every user name, so that tests running side by side and a real
//! installation on the same broker never meet; the vhost and the users go when the test ends,
//! also when it fails.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::{Value, json};
use vnfarm_proto::WorkerId;
use vnfarm_proto::http::JobState;
use vnfarm_proto::topology::Topology;
use vnfarm_tests::access::{Refused, Roles, Try, wrong_outcomes};
use vnfarm_tests::{Farm, WorkerOptions, wait_for};

use crate::FINISH;
use crate::deploy::{definitions, permission};

/// The definitions, imported for one farm; removed from the broker on drop.
struct Installation {
    vhost: String,
    suffix: String,
    password: String,
    users: Vec<String>,
}

fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .output()
        .context("running rabbitmqctl (./farm setup installs RabbitMQ)")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl {} failed:\n{}{}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Installation {
    /// Imports definitions.json for `prefix` (a farm's), sets every user's password and adds a
    /// second worker box, `box-2` (its user and its queue), from the `box-1` template as
    /// `add-worker-user` does.
    async fn import(prefix: &str) -> anyhow::Result<Self> {
        let suffix = format!("t-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let vhost = format!("vnfarm-{suffix}");
        // Names and regexes: `vnfarm.` → `<prefix>.`, the vhost, then the users.
        let text = serde_json::to_string(&definitions())?
            .replace(r"vnfarm\\.", &format!(r"{prefix}\\."))
            .replace("\"vnfarm.", &format!("\"{prefix}."))
            .replace("\"vnfarm\"", &format!("\"{vhost}\""));
        let mut d: Value = serde_json::from_str(&text)?;
        let mut users = Vec::new();
        for u in d["users"].as_array_mut().expect("users") {
            let name = format!("{}-{suffix}", u["name"].as_str().expect("a name"));
            users.push(name.clone());
            u["name"] = name.into();
        }
        for key in ["permissions", "topic_permissions"] {
            for p in d[key].as_array_mut().expect(key) {
                p["user"] = format!("{}-{suffix}", p["user"].as_str().expect("a user")).into();
            }
        }
        let mut installation = Self {
            vhost: vhost.clone(),
            suffix: suffix.clone(),
            password: uuid::Uuid::new_v4().simple().to_string(),
            users: users.clone(),
        };
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(&d)?)?;
        // Debian's rabbitmqctl runs as the `rabbitmq` user; the file holds no secret.
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o644))?;
        let path = file.path().display().to_string();
        tokio::task::spawn_blocking(move || rabbitmqctl(&["import_definitions", &path])).await??;

        // The second box: its permissions are box-1's with its id.
        let box2 = installation.user("vnfarm-worker-box-2");
        let template = installation.user("vnfarm-worker-box-1");
        let perm = |kind| permission(&d, &vhost, &template, kind).replace("box-1", "box-2");
        let (c, w, r) = (perm("configure"), perm("write"), perm("read"));
        let topic_template = d["topic_permissions"][0].clone();
        let topic = |kind: &str| {
            let regex = topic_template[kind].as_str().expect("a regex");
            regex.replace("box-1", "box-2")
        };
        let (tw, tr) = (topic("write"), topic("read"));
        let events = format!("{prefix}.events");
        let box1_queue = format!("{prefix}.worker.box-1");
        let queue = d["queues"]
            .as_array()
            .expect("queues")
            .iter()
            .find(|q| q["name"] == box1_queue.as_str())
            .expect("box-1's queue")
            .to_string()
            .replace("box-1", "box-2");
        let queue_file = tempfile::NamedTempFile::new()?;
        std::fs::write(queue_file.path(), format!(r#"{{"queues": [{queue}]}}"#))?;
        std::fs::set_permissions(queue_file.path(), std::fs::Permissions::from_mode(0o644))?;
        let queue_path = queue_file.path().display().to_string();
        installation.users.push(box2.clone());
        let password = installation.password.clone();
        let vh = vhost.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            rabbitmqctl(&["add_user", &box2, &password])?;
            rabbitmqctl(&["set_permissions", "-p", &vh, &box2, &c, &w, &r])?;
            rabbitmqctl(&["set_topic_permissions", "-p", &vh, &box2, &events, &tw, &tr])?;
            rabbitmqctl(&["import_definitions", &queue_path])
        })
        .await??;
        // The import runs in the background on the broker: a user takes its password once it
        // exists.
        for user in users {
            let password = installation.password.clone();
            wait_for(
                &format!("user {user} to be imported"),
                Duration::from_secs(30),
                || {
                    let (user, password) = (user.clone(), password.clone());
                    async move {
                        tokio::task::spawn_blocking(move || {
                            rabbitmqctl(&["change_password", &user, &password]).ok()
                        })
                        .await
                        .ok()
                        .flatten()
                    }
                },
            )
            .await?;
        }
        Ok(installation)
    }

    /// The name of definitions.json's `user` here.
    fn user(&self, user: &str) -> String {
        format!("{user}-{}", self.suffix)
    }

    fn url(&self, user: &str) -> String {
        format!(
            "amqp://{}:{}@127.0.0.1:5672/{}",
            self.user(user),
            self.password,
            self.vhost
        )
    }

    async fn connect(&self, user: &str) -> anyhow::Result<Connection> {
        Connection::connect(&self.url(user), ConnectionProperties::default())
            .await
            .with_context(|| format!("logging in as {user}"))
    }
}

impl Drop for Installation {
    fn drop(&mut self) {
        if let Err(e) = rabbitmqctl(&["delete_vhost", &self.vhost]) {
            eprintln!("cleaning up: {e}");
        }
        for user in &self.users {
            if let Err(e) = rabbitmqctl(&["delete_user", user]) {
                eprintln!("cleaning up: {e}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rabbitmq_role_does_its_work_and_nothing_else() -> anyhow::Result<()> {
    let mut farm = Farm::in_process("permissions").await?;
    let installation = Installation::import(&farm.prefix).await?;
    let t = Topology::new(farm.prefix.clone());
    let box1: WorkerId = "box-1".parse().expect("a worker id");
    let box2: WorkerId = "box-2".parse().expect("a worker id");

    // The scheduler and a worker, each as its own user, run a job the submitter handed in
    // through the submissions exchange (the only thing it may write to). The worker leaves the
    // shared topology to the scheduler, as the deploy files say.
    farm.scheduler_env.push((
        "VNFARM_AMQP__URL".into(),
        installation.url("vnfarm-scheduler"),
    ));
    farm.start_scheduler().await?;
    let worker_env = vec![
        (
            "VNFARM_AMQP__URL".to_owned(),
            installation.url("vnfarm-worker-box-1"),
        ),
        (
            "VNFARM_AMQP__DECLARE_TOPOLOGY".to_owned(),
            "false".to_owned(),
        ),
    ];
    farm.start_worker(
        "box-1",
        WorkerOptions {
            extra_env: worker_env,
            ..Default::default()
        },
    )
    .await?;
    let submitter = installation.connect("vnfarm-submitter").await?;
    let channel = submitter.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let job_id = uuid::Uuid::now_v7().to_string();
    let body = json!({"schema_version": 1, "job_id": job_id, "priority": "interactive",
        "job": {"kind": "generate", "prompt": "a lighthouse", "width": 256, "height": 256, "steps": 2, "count": 1, "seed": 3}});
    let confirm = channel
        .basic_publish(
            t.submissions_exchange().as_str().into(),
            "".into(),
            BasicPublishOptions::default(),
            &serde_json::to_vec(&body)?,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?
        .await?;
    assert!(confirm.is_ack());
    let job = farm.wait_finished(&job_id, FINISH).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");

    // The queues' arguments in the definitions are the ones declare_core gives them.
    let scheduler = installation.connect("vnfarm-scheduler").await?;
    let config = vnfarm_bus::AmqpConfig {
        prefix: farm.prefix.clone(),
        ..Default::default()
    };
    vnfarm_bus::topology::declare_core(&scheduler.create_channel().await?, &config).await?;

    let worker = installation.connect("vnfarm-worker-box-1").await?;
    let worker2 = installation.connect("vnfarm-worker-box-2").await?;
    let monitoring = installation.connect("vnfarm-monitoring").await?;
    let roles = Roles {
        worker: &worker,
        worker2: &worker2,
        submitter: &submitter,
        monitoring: &monitoring,
        scheduler: &scheduler,
    };
    let wrong = wrong_outcomes(&roles, &farm.prefix, &box1, &box2).await?;
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // Why the definitions and add-worker-user make each box's queue: its user may declare the
    // queue once it exists, but not create it, since creating a queue that dead-letters through
    // the default exchange needs write there.
    let (vhost, queue) = (installation.vhost.clone(), t.worker_queue(&box2));
    tokio::task::spawn_blocking(move || rabbitmqctl(&["delete_queue", "-p", &vhost, &queue]))
        .await??;
    let create = Try::DeclareWorkerQueue(box2.clone());
    assert_eq!(create.run(&worker2, &farm.prefix).await?, Refused);

    // The job system still works after the probes: nothing they did broke the installation.
    let job = farm.job(&job_id).await?;
    assert_eq!(job.state, JobState::Completed, "{job:?}");
    drop(farm);
    drop(installation);
    Ok(())
}
