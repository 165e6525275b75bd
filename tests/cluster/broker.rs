//! A three-node RabbitMQ cluster, one node per box namespace, started the way
//! `reference/fleet.md` ("Checked on this machine") found to work: Debian's server script from
//! `/usr/lib/rabbitmq/bin` under a clean environment with an empty `RABBITMQ_CONF_ENV_FILE` (the
//! system's pins the node to `rabbit@localhost` on 127.0.0.1), long names on the box's address,
//! per-node directories, one cookie in a per-cluster `HOME`, `pause_minority`, and
//! `net_ticktime` 10 so a cut link is noticed in about 13 s rather than 72. The system node on
//! 127.0.0.1:5672 is never touched.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::net::Host;

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
pub const AMQP_PORT: u16 = 5672;
/// The test's own broker user, with every right in the farm's vhost: the audit reads every node's
/// copy of the stream with it (`guest` may only connect from loopback). The farm's processes log
/// in as the users of deploy/rabbitmq/definitions.json instead.
pub const USER: &str = "vnfarm";
/// Every user's password (the test's and the definitions' roles).
pub const PASSWORD: &str = "vnfarm-cluster-test";
/// deploy/rabbitmq/definitions.json's vhost, where the farm runs.
pub const VHOST: &str = "vnfarm";
/// The definitions' users; a worker box's is `vnfarm-worker-<id>`, made by
/// deploy/rabbitmq/add-worker-user.
pub const SCHEDULER_USER: &str = "vnfarm-scheduler";
pub const SUBMITTER_USER: &str = "vnfarm-submitter";
pub const MONITORING_USER: &str = "vnfarm-monitoring";
const DEFINITIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/rabbitmq/definitions.json"
);
const ADD_WORKER_USER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/rabbitmq/add-worker-user"
);

/// The RabbitMQ user of worker box `id`.
pub fn worker_user(id: &str) -> String {
    format!("vnfarm-worker-{id}")
}
/// AMQP heartbeat the farm's clients ask for, in seconds: a connection across a cut link is given
/// up by both ends after about two of them (RabbitMQ's default is 60 s). 2 s was tried: the active
/// scheduler then lost a healthy local node's connection ("no heartbeat received") while the
/// cluster handled another box's cut, on this two-core machine.
const HEARTBEAT_S: u32 = 5;
/// The schedulers' heartbeat: the standby takes over only once the broker has given up the active
/// one's connection (its leader token then comes back), so this bounds the takeover after a box is
/// cut. With 5 s the broker gave it up 10–13 s after the cut (takeovers of 13 s); with 3 s the
/// takeovers were 8.0 and 8.7 s, and no healthy scheduler connection was lost. Workers keep 5 s.
const SCHEDULER_HEARTBEAT_S: u32 = 3;
/// `net_ticktime`: nodes notice that a peer is unreachable after 1 to 1.25 × this. fleet.md
/// checked 10 (a cut noticed after ~13 s); 6 keeps a client of a node on the cut box from holding
/// the leader token past the takeover target.
const NET_TICKTIME_S: u32 = 6;
/// How long the broker's own dead-lettering waits for the target queue's confirm before it
/// publishes again. RabbitMQ's default, 3 min, held jobs that expired in a worker queue during a
/// partition for 3 min after the heal (the redispatch queue's leader was on the cut node): the
/// broker's side of fleet.md's client trap 2. The same as the clients' `confirm_timeout_ms`.
const DEAD_LETTER_CONFIRM_TIMEOUT_MS: u32 = 10_000;
/// A node boots in 9–15 s on two idle cores (fleet.md); a loaded machine takes longer.
const BOOT: Duration = Duration::from_secs(120);

/// One node of the cluster: its box, its directory, and the server script while it runs.
pub struct Node {
    host: Host,
    dir: PathBuf,
    home: PathBuf,
    server: Option<Child>,
}

impl Node {
    pub fn name(&self) -> String {
        format!("rabbit@{}", self.host.address)
    }

    pub fn address(&self) -> Ipv4Addr {
        self.host.address
    }

    /// The test's own AMQP URL of this node (see [`USER`]).
    pub fn url(&self) -> String {
        self.url_as(USER)
    }

    /// This node's AMQP URL for `user`, in the farm's vhost.
    pub fn url_as(&self, user: &str) -> String {
        let heartbeat = if user == SCHEDULER_USER {
            SCHEDULER_HEARTBEAT_S
        } else {
            HEARTBEAT_S
        };
        format!(
            "amqp://{user}:{PASSWORD}@{}:{AMQP_PORT}/{VHOST}?heartbeat={heartbeat}",
            self.host.address
        )
    }

    /// Starts the server (on the data it has, after a kill) without waiting for it.
    pub fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join("server.out"))?;
        let mut command = self.host.command("env");
        command
            .arg("-i")
            .args(self.env())
            .arg(format!(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel net_ticktime {NET_TICKTIME_S}"
            ))
            .arg(SERVER)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.server = Some(command.spawn().context("starting rabbitmq-server")?);
        Ok(())
    }

    /// Waits until the node serves: `await_startup` answers only once the node is registered
    /// with its epmd, so it is retried until then.
    pub async fn wait_started(&self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + BOOT;
        loop {
            match self.ctl(&["await_startup", "--timeout", "30"]).await {
                Ok(_) => return Ok(()),
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(e.context(format!("node {} did not start", self.name())));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// SIGKILLs the Erlang VM (its pid file's process) and reaps the server script.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let pid = std::fs::read_to_string(self.dir.join("pid")).context("the node's pid file")?;
        let status = Command::new("kill").args(["-KILL", pid.trim()]).status()?;
        anyhow::ensure!(
            status.success(),
            "kill -KILL {} (node {})",
            pid.trim(),
            self.name()
        );
        if let Some(mut server) = self.server.take() {
            server.wait()?;
        }
        Ok(())
    }

    /// `rabbitmqctl -n <node> args…`, from the node's own namespace (the CLI is an Erlang node
    /// too, and needs that namespace's epmd); the output when it succeeds.
    pub async fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut command = self.host.command("env");
        command
            .arg("-i")
            .args(self.env())
            .arg(CTL)
            .args(["--longnames", "-n", &self.name()])
            .args(args);
        let what = format!("rabbitmqctl {} on {}", args.join(" "), self.name());
        let out = tokio::task::spawn_blocking(move || command.output())
            .await
            .context("rabbitmqctl task")?
            .with_context(|| what.clone())?;
        if !out.status.success() {
            bail!("{what}: {}", String::from_utf8_lossy(&out.stdout).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The command line of [`Node::ctl`] without its arguments, for a script that runs
    /// `$RABBITMQCTL args…` (deploy/rabbitmq/add-worker-user); no part holds a space.
    fn ctl_command_line(&self) -> String {
        let mut words = vec![
            "ip".to_owned(),
            "netns".into(),
            "exec".into(),
            self.host.ns.clone(),
        ];
        words.push("env".into());
        words.push("-i".into());
        words.extend(self.env());
        words.extend([
            CTL.to_owned(),
            "--longnames".into(),
            "-n".into(),
            self.name(),
        ]);
        words.join(" ")
    }

    /// The environment of the server and of the CLI: everything the node is told.
    fn env(&self) -> Vec<String> {
        let dir = self.dir.display();
        vec![
            "PATH=/usr/bin:/bin:/usr/sbin:/sbin".into(),
            "LANG=C.UTF-8".into(),
            format!("HOME={}", self.home.display()),
            format!("RABBITMQ_CONF_ENV_FILE={dir}/env.conf"),
            "RABBITMQ_USE_LONGNAME=true".into(),
            format!("RABBITMQ_NODENAME={}", self.name()),
            format!("RABBITMQ_MNESIA_BASE={dir}/mnesia"),
            format!("RABBITMQ_LOG_BASE={dir}/log"),
            format!("RABBITMQ_CONFIG_FILE={dir}/rabbitmq"),
            format!("RABBITMQ_ADVANCED_CONFIG_FILE={dir}/advanced.config"),
            format!("RABBITMQ_PID_FILE={dir}/pid"),
            format!("RABBITMQ_ENABLED_PLUGINS_FILE={dir}/enabled_plugins"),
        ]
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.server.is_some() {
            // The network's guard kills whatever is left in the namespace; this reaps our child.
            if let Err(e) = self.kill() {
                eprintln!("stopping {}: {e:#}", self.name());
            }
        }
    }
}

/// The cluster: every node started, joined to the first, and the farm's user created.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// Boots a node on each of `boxes`, joins them into one cluster and installs the deploy
    /// definitions for the workers `worker_ids` ([`Cluster::install`]).
    pub async fn boot(boxes: &[Host], root: &Path, worker_ids: &[String]) -> anyhow::Result<Self> {
        let home = root.join("home");
        std::fs::create_dir_all(&home)?;
        let cookie = home.join(".erlang.cookie");
        std::fs::write(
            &cookie,
            format!("vnfarm-cluster-{}", uuid::Uuid::new_v4().simple()),
        )?;
        set_mode(&cookie, 0o400)?;
        let mut nodes = Vec::new();
        for host in boxes {
            let dir = root.join(&host.ns);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(dir.join("env.conf"), "")?;
            std::fs::write(dir.join("enabled_plugins"), "[].\n")?;
            std::fs::write(
                dir.join("rabbitmq.conf"),
                format!(
                    "listeners.tcp.1 = {}:{AMQP_PORT}\n\
                     cluster_partition_handling = pause_minority\n\
                     consumer_timeout = 7200000\n",
                    host.address
                ),
            )?;
            // Not in rabbitmq.conf's schema: an application setting.
            std::fs::write(
                dir.join("advanced.config"),
                format!(
                    "[{{rabbit, [{{dead_letter_worker_publisher_confirm_timeout, \
                     {DEAD_LETTER_CONFIRM_TIMEOUT_MS}}}]}}].\n"
                ),
            )?;
            let mut node = Node {
                host: host.clone(),
                dir,
                home: home.clone(),
                server: None,
            };
            node.start()?;
            nodes.push(node);
        }
        let cluster = Cluster { nodes };
        for node in &cluster.nodes {
            node.wait_started().await?;
        }
        let first = cluster.nodes[0].name();
        for node in &cluster.nodes[1..] {
            node.ctl(&["stop_app"]).await?;
            node.ctl(&["join_cluster", &first]).await?;
            node.ctl(&["start_app"]).await?;
        }
        cluster.install(worker_ids).await?;
        Ok(cluster)
    }

    /// Loads deploy/rabbitmq/definitions.json (the vhost, the topology, the policies and a user
    /// per role), makes each worker box's user and queue with deploy/rabbitmq/add-worker-user, as
    /// an operator adding a box does, sets every user's password, and adds the test's own user.
    async fn install(&self, worker_ids: &[String]) -> anyhow::Result<()> {
        let node = &self.nodes[0];
        node.ctl(&["import_definitions", DEFINITIONS]).await?;
        for id in worker_ids {
            let status = Command::new(ADD_WORKER_USER)
                .arg(id)
                .env("RABBITMQ_VHOST", VHOST)
                .env("RABBITMQCTL", node.ctl_command_line())
                .stdout(Stdio::null())
                .status()
                .context("running deploy/rabbitmq/add-worker-user")?;
            anyhow::ensure!(status.success(), "add-worker-user {id}: {status}");
        }
        let mut users = vec![
            SCHEDULER_USER.to_owned(),
            SUBMITTER_USER.into(),
            MONITORING_USER.into(),
        ];
        users.extend(worker_ids.iter().map(|id| worker_user(id)));
        // The import runs in the background on the broker: a user takes its password once it
        // exists.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        for user in &users {
            while let Err(e) = node.ctl(&["change_password", user, PASSWORD]).await {
                if tokio::time::Instant::now() > deadline {
                    return Err(e.context(format!("user {user} of the definitions")));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        node.ctl(&["add_user", USER, PASSWORD]).await?;
        node.ctl(&["set_permissions", "-p", VHOST, USER, ".*", ".*", ".*"])
            .await?;
        Ok(())
    }

    /// The test's own URL of every node (see [`USER`]).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// deploy/rabbitmq/definitions.json's role matrix ([`vnfarm_tests::access`]) on this cluster,
    /// each role logged in to another node; the attempts that came out otherwise than they must.
    pub async fn wrong_outcomes(&self, box1: &str, box2: &str) -> anyhow::Result<Vec<String>> {
        let node = |i: usize| &self.nodes[i % self.nodes.len()];
        let connect = |user: String, i: usize| async move {
            lapin::Connection::connect(
                &node(i).url_as(&user),
                lapin::ConnectionProperties::default(),
            )
            .await
            .with_context(|| format!("logging in as {user} on {}", node(i).name()))
        };
        let worker = connect(worker_user(box1), 0).await?;
        let worker2 = connect(worker_user(box2), 1).await?;
        let submitter = connect(SUBMITTER_USER.into(), 2).await?;
        let monitoring = connect(MONITORING_USER.into(), 0).await?;
        let scheduler = connect(SCHEDULER_USER.into(), 1).await?;
        let roles = vnfarm_tests::access::Roles {
            worker: &worker,
            worker2: &worker2,
            submitter: &submitter,
            monitoring: &monitoring,
            scheduler: &scheduler,
        };
        let id = |id: &str| -> anyhow::Result<vnfarm_proto::WorkerId> {
            id.parse()
                .map_err(|e: String| anyhow::anyhow!("worker id {id:?}: {e}"))
        };
        let (box1, box2) = (id(box1)?, id(box2)?);
        let wrong =
            vnfarm_tests::access::wrong_outcomes(&roles, crate::farm::PREFIX, &box1, &box2).await?;
        for connection in [worker, worker2, submitter, monitoring, scheduler] {
            // Probe consumers' unacknowledged deliveries go back to their queues.
            let _ = connection.close(200, "probes done".into()).await;
        }
        Ok(wrong)
    }

    /// Every node's URL for `user`.
    pub fn urls_as(&self, user: &str) -> Vec<String> {
        self.nodes.iter().map(|n| n.url_as(user)).collect()
    }

    /// The node on the box at `address`.
    pub fn node_at(&mut self, address: Ipv4Addr) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.address() == address)
            .expect("every box runs a node")
    }

    /// Waits until every node lists all of them as running (a healed partition has rejoined).
    /// RabbitMQ 3.10's `pause_minority` has, once in this test's runs here (2026-12-05, after
    /// `active_partition`), left a node reporting the partition past the whole `timeout` (Mnesia's
    /// `inconsistent_database, starting_partitioned_network`); then the nodes that still report
    /// one are restarted (`stop_app`, `start_app`: RabbitMQ's documented recovery from a partition,
    /// what an operator does), said on the test's output, and waited for once more. The farm's own
    /// audit is unchanged by it: nothing may be lost or duplicated either way.
    pub async fn wait_whole(&self, timeout: Duration) -> anyhow::Result<()> {
        let Err(e) = self.wait_whole_once(timeout).await else {
            return Ok(());
        };
        let mut restarted = Vec::new();
        for node in &self.nodes {
            let partitioned = match node.ctl(&["cluster_status", "--formatter", "json"]).await {
                Ok(status) => serde_json::from_str::<serde_json::Value>(&status)
                    .map(|s| match &s["partitions"] {
                        serde_json::Value::Object(p) => !p.is_empty(),
                        serde_json::Value::Array(p) => !p.is_empty(),
                        _ => false,
                    })
                    .unwrap_or(true),
                Err(_) => true,
            };
            if partitioned {
                node.ctl(&["stop_app"]).await?;
                node.ctl(&["start_app"]).await?;
                restarted.push(node.name());
            }
        }
        if restarted.is_empty() {
            return Err(e);
        }
        println!(
            "RabbitMQ did not heal on its own ({e}): restarted the app on {} (its documented \
             recovery from a partition)",
            restarted.join(", ")
        );
        self.wait_whole_once(timeout).await
    }

    async fn wait_whole_once(&self, timeout: Duration) -> anyhow::Result<()> {
        let names: Vec<String> = self.nodes.iter().map(Node::name).collect();
        let deadline = tokio::time::Instant::now() + timeout;
        'poll: loop {
            if tokio::time::Instant::now() > deadline {
                bail!("the cluster did not become whole within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            for node in &self.nodes {
                let Ok(status) = node.ctl(&["cluster_status", "--formatter", "json"]).await else {
                    continue 'poll;
                };
                let Ok(status) = serde_json::from_str::<serde_json::Value>(&status) else {
                    continue 'poll;
                };
                let running = status["running_nodes"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let partitioned = match &status["partitions"] {
                    serde_json::Value::Object(p) => !p.is_empty(),
                    serde_json::Value::Array(p) => !p.is_empty(),
                    _ => false,
                };
                if partitioned
                    || !names
                        .iter()
                        .all(|n| running.iter().any(|r| r == n.as_str()))
                {
                    continue 'poll;
                }
            }
            return Ok(());
        }
    }
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}
