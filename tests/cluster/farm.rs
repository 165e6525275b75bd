//! The farm on the boxes: on each a RabbitMQ node and a test-pattern worker; the active scheduler
//! on box 1 and the standby on box 2; an `s3s-fs` server on the storage box. Every process runs in
//! its box's namespace (`ip netns exec`, which execs the program, so a child's pid is the
//! program's) and knows every broker node (`amqp.urls`).

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;
use vnfarm_storage::{Storage, StorageConfig};
use vnfarm_tests::{Role, S3_KEY, S3_SECRET, bin_dir, wait_for};

use crate::broker::{Cluster, SCHEDULER_USER, worker_user};
use crate::net::{Host, Network};

pub const PREFIX: &str = "vnfarm";
const BUCKET: &str = "vnfarm-cluster";
const S3_PORT: u16 = 9000;
/// Every scheduler listens on this port of its box on all its addresses (the bridge and the
/// observation link); `api_token` is required off loopback.
const API_PORT: u16 = 8080;
pub const API_TOKEN: &str = "vnfarm-cluster-test-token";
/// The boxes (by index) that run a scheduler: the active one first, then the standby.
pub const SCHEDULER_BOXES: [usize; 2] = [0, 1];
/// Starting a process and seeing it ready: loading the engine, replaying the stream.
const READY: Duration = Duration::from_secs(120);

/// A process of the farm, killed (and reaped) when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        // Already gone (it exited on its own) is fine: the point is that it no longer runs.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The whole installation. Dropping it stops every process, then removes the network.
pub struct ClusterFarm {
    pub storage: Storage,
    /// Sends the API token on every request.
    pub http: reqwest::Client,
    schedulers: Vec<Option<Process>>,
    workers: Vec<Option<Process>>,
    /// Held for its `Drop`, which stops the server.
    _s3: Process,
    pub cluster: Cluster,
    pub net: Network,
    dir: tempfile::TempDir,
}

impl ClusterFarm {
    /// Builds the network, boots and joins the cluster, starts S3, the schedulers (waiting for an
    /// active one and a standby) and a worker per box (waiting until each is alive).
    pub async fn start(boxes: u8) -> anyhow::Result<Self> {
        Self::start_on(boxes, usize::from(boxes)).await
    }

    /// [`ClusterFarm::start`] with broker nodes on the first `nodes` boxes only: every process of
    /// every box then uses those (one node: the farm on a single broker, for the replication bench).
    pub async fn start_on(boxes: u8, nodes: usize) -> anyhow::Result<Self> {
        let net = Network::create(boxes)?;
        let dir = tempfile::Builder::new()
            .prefix("vnfarm-cluster-")
            .tempdir()?;
        let began = Instant::now();
        let worker_ids: Vec<String> = (0..usize::from(boxes)).map(worker_id).collect();
        let cluster = Cluster::boot(&net.boxes[..nodes], dir.path(), &worker_ids).await?;
        println!(
            "cluster of {nodes} nodes booted and joined in {:.1} s",
            began.elapsed().as_secs_f64()
        );
        let s3 = start_s3(&net.storage, dir.path())?;
        let storage = Storage::open(&storage_config(net.storage.address))
            .await
            .context("creating the bucket")?;
        let http = reqwest::Client::builder()
            .default_headers(auth_headers())
            .timeout(Duration::from_secs(10))
            .build()?;
        let mut farm = ClusterFarm {
            storage,
            http,
            schedulers: SCHEDULER_BOXES.iter().map(|_| None).collect(),
            workers: (0..boxes).map(|_| None).collect(),
            _s3: s3,
            cluster,
            net,
            dir,
        };
        for (slot, b) in SCHEDULER_BOXES.iter().enumerate() {
            farm.start_scheduler(slot)?;
            let role = farm.wait_ready(slot).await?;
            println!("scheduler {slot} on box {} is {role:?}", b + 1);
        }
        for n in 0..farm.workers.len() {
            farm.start_worker(n)?;
        }
        for n in 0..farm.workers.len() {
            farm.wait_worker(n).await?;
        }
        println!(
            "farm ready {:.1} s after the start",
            began.elapsed().as_secs_f64()
        );
        Ok(farm)
    }

    pub fn box_host(&self, n: usize) -> &Host {
        &self.net.boxes[n]
    }

    /// The API base URL of every scheduler slot on the bridge (as a client reaches it).
    pub fn scheduler_urls(&self) -> Vec<String> {
        SCHEDULER_BOXES
            .iter()
            .map(|&b| format!("http://{}:{API_PORT}", self.net.boxes[b].address))
            .collect()
    }

    /// The slot's scheduler's role as its `/healthz` says, read over the observation link (so a
    /// box cut off the bridge still answers); `None` while it does not answer or is not ready.
    pub async fn role(&self, slot: usize) -> Option<Role> {
        let host = &self.net.boxes[SCHEDULER_BOXES[slot]];
        let address = host.observed_at.expect("every box has an observation link");
        let health: Value = self
            .http
            .get(format!("http://{address}:{API_PORT}/healthz"))
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())?
            .json()
            .await
            .ok()?;
        match health["role"].as_str()? {
            "standby" => Some(Role::Standby),
            _ => Some(Role::Active),
        }
    }

    pub async fn wait_ready(&self, slot: usize) -> anyhow::Result<Role> {
        wait_for(&format!("scheduler {slot} to be ready"), READY, || {
            self.role(slot)
        })
        .await
        .map_err(|e| e.context(self.log_tail(&format!("scheduler-{slot}.log"))))
    }

    /// Waits until some scheduler is active; returns its slot.
    pub async fn wait_active(&self, timeout: Duration) -> anyhow::Result<usize> {
        wait_for("an active scheduler", timeout, || async {
            for slot in 0..SCHEDULER_BOXES.len() {
                if self.role(slot).await == Some(Role::Active) {
                    return Some(slot);
                }
            }
            None
        })
        .await
    }

    /// Waits until a scheduler that answers lists worker `n` alive.
    pub async fn wait_worker(&self, n: usize) -> anyhow::Result<()> {
        let id = worker_id(n);
        wait_for(&format!("worker {id} to be alive"), READY, || async {
            for base in self.scheduler_urls() {
                let Ok(response) = self.http.get(format!("{base}/v1/workers")).send().await else {
                    continue;
                };
                let Ok(workers) = response.json::<Value>().await else {
                    continue;
                };
                let alive = workers["workers"].as_array().is_some_and(|all| {
                    all.iter()
                        .any(|w| w["id"] == id.as_str() && w["alive"] == true)
                });
                if alive {
                    return Some(());
                }
            }
            None
        })
        .await
        .map_err(|e| e.context(self.log_tail(&format!("{id}.log"))))
    }

    /// Starts the scheduler of `slot` on its box (replacing one still running there).
    pub fn start_scheduler(&mut self, slot: usize) -> anyhow::Result<()> {
        self.schedulers[slot] = None;
        let host = self.net.boxes[SCHEDULER_BOXES[slot]].clone();
        let mut env = self.common_env(SCHEDULER_USER);
        env.extend(
            [
                ("VNFARM_LISTEN", format!("0.0.0.0:{API_PORT}")),
                ("VNFARM_API_TOKEN", API_TOKEN.into()),
                ("VNFARM_HEARTBEAT_TIMEOUT_MS", "3000".into()),
                ("VNFARM_DISPATCH_TTL_MS", "2000".into()),
                ("VNFARM_SNAPSHOT_EVERY_EVENTS", "500".into()),
                ("VNFARM_DISPATCH__POLICY", "affinity".into()),
                ("VNFARM_DISPATCH__MAX_BATCH", "8".into()),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
        let child = self.spawn(
            &host,
            "vnfarm-scheduler",
            &format!("scheduler-{slot}.log"),
            env,
        )?;
        self.schedulers[slot] = Some(child);
        Ok(())
    }

    /// Starts box `n`'s worker (replacing one still running there).
    pub fn start_worker(&mut self, n: usize) -> anyhow::Result<()> {
        self.workers[n] = None;
        let host = self.net.boxes[n].clone();
        let id = worker_id(n);
        let mut env = self.common_env(&worker_user(&id));
        env.extend(
            [
                // A worker's user may not declare what the farm shares (deploy/rabbitmq).
                ("VNFARM_AMQP__DECLARE_TOPOLOGY", "false".into()),
                ("VNFARM_WORKER_ID", id.clone()),
                ("VNFARM_LISTEN", "127.0.0.1:9101".into()),
                ("VNFARM_HEARTBEAT_INTERVAL_MS", "300".into()),
                (
                    "VNFARM_HASH_CACHE_DIR",
                    self.dir
                        .path()
                        .join(format!("hash-cache-{id}"))
                        .display()
                        .to_string(),
                ),
                ("VNFARM_ENGINE__TEST_PATTERN__STEP_MS", "10".into()),
                ("VNFARM_ENGINE__TEST_PATTERN__ENCODE_MS", "5".into()),
                ("VNFARM_ENGINE__TEST_PATTERN__DECODE_MS", "5".into()),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
        let child = self.spawn(&host, "vnfarm-worker", &format!("{id}.log"), env)?;
        self.workers[n] = Some(child);
        Ok(())
    }

    /// SIGKILLs every process of box `n`: its worker, its scheduler if it runs one, its broker node.
    pub fn kill_box(&mut self, n: usize) -> anyhow::Result<()> {
        self.workers[n] = None;
        for (slot, &b) in SCHEDULER_BOXES.iter().enumerate() {
            if b == n {
                self.schedulers[slot] = None;
            }
        }
        let address = self.net.boxes[n].address;
        self.cluster.node_at(address).kill()
    }

    /// Starts what [`ClusterFarm::kill_box`] killed again (the node first) and waits for it.
    pub async fn restart_box(&mut self, n: usize) -> anyhow::Result<()> {
        let address = self.net.boxes[n].address;
        let node = self.cluster.node_at(address);
        node.start()?;
        node.wait_started().await?;
        for (slot, &b) in SCHEDULER_BOXES.iter().enumerate() {
            if b == n {
                self.start_scheduler(slot)?;
                self.wait_ready(slot).await?;
            }
        }
        self.start_worker(n)?;
        self.wait_worker(n).await
    }

    /// What every process is told; it logs in to the broker as `user`.
    fn common_env(&self, user: &str) -> Vec<(String, String)> {
        let urls: Vec<String> = self
            .cluster
            .urls_as(user)
            .iter()
            .map(|u| format!("{u:?}"))
            .collect();
        [
            ("VNFARM_AMQP__URLS", format!("[{}]", urls.join(", "))),
            ("VNFARM_AMQP__PREFIX", PREFIX.into()),
            ("VNFARM_STORAGE__BACKEND", "s3".into()),
            ("VNFARM_STORAGE__BUCKET", BUCKET.into()),
            (
                "VNFARM_STORAGE__ENDPOINT",
                format!("http://{}:{S3_PORT}", self.net.storage.address),
            ),
            ("VNFARM_STORAGE__ACCESS_KEY_ID", S3_KEY.into()),
            ("VNFARM_STORAGE__SECRET_ACCESS_KEY", S3_SECRET.into()),
            (
                "RUST_LOG",
                "info,lapin=warn,lapin::returned_messages=error,aws=warn".into(),
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v))
        .into()
    }

    fn spawn(
        &self,
        host: &Host,
        bin: &str,
        log: &str,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Process> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(log))?;
        let child = host
            .command(&bin_dir().join(bin).display().to_string())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {bin} in {}", host.ns))?;
        Ok(Process(child))
    }

    /// The whole log of one process (`scheduler-0.log`, `box1.log`).
    pub fn full_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }

    fn log_tail(&self, name: &str) -> String {
        let text = self.full_log(name);
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        format!(
            "--- {name} (last lines) ---\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// Keeps the logs and the nodes' directories after the run (to examine a failure); returns
    /// where they are.
    pub fn keep_logs(&mut self) -> std::path::PathBuf {
        self.dir.disable_cleanup(true);
        self.dir.path().to_path_buf()
    }
}

/// The worker of box `n` (0-based) is `box<n+1>`.
/// The API token as a client sends it.
pub fn auth_headers() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {API_TOKEN}")
            .parse()
            .expect("the token is a valid header value"),
    );
    headers
}

pub fn worker_id(n: usize) -> String {
    format!("box{}", n + 1)
}

/// Starts `s3s-fs` on the storage box over `<root>/s3` and waits until it listens.
fn start_s3(host: &Host, root: &Path) -> anyhow::Result<Process> {
    let data = root.join("s3");
    std::fs::create_dir_all(&data)?;
    let child = host
        .command("s3s-fs")
        .args([
            "--host",
            &host.address.to_string(),
            "--port",
            &S3_PORT.to_string(),
        ])
        .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
        .arg(&data)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting s3s-fs (`./farm setup` installs it)")?;
    let process = Process(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect((host.address, S3_PORT)).is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "s3s-fs did not listen on {}:{S3_PORT}",
            host.address
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(process)
}

fn storage_config(address: Ipv4Addr) -> StorageConfig {
    StorageConfig::S3 {
        bucket: BUCKET.into(),
        endpoint: Some(format!("http://{address}:{S3_PORT}")),
        region: "us-east-1".into(),
        path_style: true,
        access_key_id: Some(S3_KEY.into()),
        secret_access_key: Some(S3_SECRET.into()),
        create_bucket: true,
        public_endpoint: None,
    }
}
