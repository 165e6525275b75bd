//! The faults of a three-box farm, each made real (a SIGKILL, a veth taken down) and each ending
//! with the farm whole again: the killed processes restarted, the link up, the cluster rejoined.
//! Two of them measure what the issue sets targets for: the longest gap in accepted submissions
//! while a broker node is down, and how long the standby takes to lead after the active
//! scheduler's box is cut off.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use vnfarm_tests::Role;

use crate::farm::{ClusterFarm, SCHEDULER_BOXES};
use crate::workload::{self, Client, Kind};

/// How long a link stays cut (the 30 s: past `net_ticktime`, so the cluster partitions).
const LINK_CUT: Duration = Duration::from_secs(30);
const ACTIVE_CUT: Duration = Duration::from_secs(30);
/// The active scheduler's cut lasts past [`ACTIVE_CUT`] until the standby leads, at most this
/// long: when the event stream's leader is on the cut box, RabbitMQ 3.10's stream coordinator
/// elects a new writer 20–31 s after the cut and no term can begin before (docs/performance.md),
/// so a takeover past 30 s is a missed target to report, not a broken promise.
const ACTIVE_CUT_MAX: Duration = Duration::from_secs(90);
const STORAGE_CUT: Duration = Duration::from_secs(20);
/// A SIGKILLed node stays down this long before it is restarted.
const NODE_DOWN: Duration = Duration::from_secs(5);
/// Healing: a minority node rejoins about 3 s after its link is back (fleet.md); a restarted
/// node boots in 5–7 s on idle cores.
const HEAL: Duration = Duration::from_secs(120);
/// How often the probe submits and the role watch polls.
const PROBE_EVERY: Duration = Duration::from_millis(100);
const ROLE_EVERY: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL box 1's broker node, restart it after [`NODE_DOWN`].
    BrokerNodeKill,
    /// Box 3 (a worker and a node) off the bridge for [`LINK_CUT`].
    LinkCut,
    /// The active scheduler's box off the bridge for [`ACTIVE_CUT`] (longer if the standby, on
    /// the majority, has not taken over by then; at most [`ACTIVE_CUT_MAX`]).
    ActivePartition,
    /// Every process of the standby scheduler's box SIGKILLed (scheduler, worker, node), then
    /// started again.
    BoxKill,
    /// The storage box off the bridge for [`STORAGE_CUT`].
    StorageCut,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::BrokerNodeKill,
        Fault::LinkCut,
        Fault::ActivePartition,
        Fault::BoxKill,
        Fault::StorageCut,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::BrokerNodeKill => "broker_node_kill",
            Fault::LinkCut => "link_cut",
            Fault::ActivePartition => "active_partition",
            Fault::BoxKill => "box_kill",
            Fault::StorageCut => "storage_cut",
        }
    }

    pub fn parse(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// What the faults measured.
#[derive(Debug, Default)]
pub struct Measurements {
    /// Longest gap in accepted submissions while a broker node was down (and until it was back).
    pub accept_gaps: Vec<Duration>,
    /// From the cut of the active scheduler's box to the standby reporting itself active.
    pub takeovers: Vec<Duration>,
    /// How long both schedulers said they were active at once (over the observation links).
    pub both_active: Vec<Duration>,
}

/// Runs one fault and returns a line about it.
pub async fn inject(
    fault: Fault,
    farm: &mut ClusterFarm,
    client: &Client,
    measured: &mut Measurements,
) -> anyhow::Result<String> {
    match fault {
        Fault::BrokerNodeKill => {
            let probe = Probe::start(client);
            let host = farm.box_host(0).clone();
            let node = farm.cluster.node_at(host.address);
            node.kill()?;
            tokio::time::sleep(NODE_DOWN).await;
            node.start()?;
            node.wait_started().await?;
            farm.cluster.wait_whole(HEAL).await?;
            let gap = probe.finish().await;
            measured.accept_gaps.push(gap);
            Ok(format!(
                "node rabbit@{} killed, down {NODE_DOWN:?}; longest gap in accepted submissions {:.2} s",
                host.address,
                gap.as_secs_f64()
            ))
        }
        Fault::LinkCut => {
            let host = farm.box_host(2).clone();
            farm.net.cut(&host)?;
            tokio::time::sleep(LINK_CUT).await;
            farm.net.restore(&host)?;
            farm.cluster.wait_whole(HEAL).await?;
            Ok(format!(
                "{} cut for {LINK_CUT:?}, cluster whole again",
                host.ns
            ))
        }
        Fault::ActivePartition => active_partition(farm, measured).await,
        Fault::BoxKill => {
            let active = farm.wait_active(HEAL).await?;
            let standby = 1 - active;
            let n = SCHEDULER_BOXES[standby];
            farm.kill_box(n)?;
            let began = Instant::now();
            farm.restart_box(n).await?;
            farm.cluster.wait_whole(HEAL).await?;
            Ok(format!(
                "box {} (standby scheduler, worker, node) killed; back in {:.1} s",
                n + 1,
                began.elapsed().as_secs_f64()
            ))
        }
        Fault::StorageCut => {
            let host = farm.net.storage.clone();
            farm.net.cut(&host)?;
            tokio::time::sleep(STORAGE_CUT).await;
            farm.net.restore(&host)?;
            Ok(format!("{} cut for {STORAGE_CUT:?}", host.ns))
        }
    }
}

/// Cuts the active scheduler's box off and watches both schedulers' roles (every
/// [`ROLE_EVERY`], over the observation links) until the cut ends: when the standby leads, and
/// for how long both said they did.
async fn active_partition(
    farm: &mut ClusterFarm,
    measured: &mut Measurements,
) -> anyhow::Result<String> {
    let old = farm.wait_active(HEAL).await?;
    let new = 1 - old;
    let host = farm.box_host(SCHEDULER_BOXES[old]).clone();
    farm.net.cut(&host)?;
    let cut = Instant::now();
    let mut took_over = None;
    let mut both = Duration::ZERO;
    let mut old_active_until = Duration::ZERO;
    while cut.elapsed() < ACTIVE_CUT || (took_over.is_none() && cut.elapsed() < ACTIVE_CUT_MAX) {
        let polled = Instant::now();
        let (old_role, new_role) = tokio::join!(farm.role(old), farm.role(new));
        if new_role == Some(Role::Active) {
            took_over.get_or_insert(cut.elapsed());
        }
        if old_role == Some(Role::Active) {
            old_active_until = cut.elapsed();
            if new_role == Some(Role::Active) {
                both += polled.elapsed().max(ROLE_EVERY);
            }
        }
        tokio::time::sleep(ROLE_EVERY).await;
    }
    let lasted = cut.elapsed();
    farm.net.restore(&host)?;
    farm.cluster.wait_whole(HEAL).await?;
    let Some(took_over) = took_over else {
        anyhow::bail!("the standby did not take over within {ACTIVE_CUT_MAX:?} of the cut");
    };
    measured.takeovers.push(took_over);
    measured.both_active.push(both);
    farm.wait_ready(old).await?;
    Ok(format!(
        "{} (active scheduler {old}) cut for {:.1} s: scheduler {new} active after {:.2} s; \
         the cut one said active until {:.2} s; both said active for {:.2} s",
        host.ns,
        lasted.as_secs_f64(),
        took_over.as_secs_f64(),
        old_active_until.as_secs_f64(),
        both.as_secs_f64()
    ))
}

/// Submits a small generate every [`PROBE_EVERY`] (recorded in the client's ledger, so the audit
/// covers them) and notes when each is accepted.
struct Probe {
    began: Instant,
    accepted: Arc<Mutex<Vec<Instant>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Probe {
    fn start(client: &Client) -> Self {
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let task = {
            let (client, accepted, stop) = (client.clone(), accepted.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(rand::random());
                let mut submissions = JoinSet::new();
                let mut tick = tokio::time::interval(PROBE_EVERY);
                let mut slot = 0;
                while !stop.is_cancelled() {
                    tick.tick().await;
                    let job = workload::generate(&mut rng);
                    let (key, body) =
                        client.register(Kind::Generate, job, workload::priority(&mut rng));
                    let (client, accepted) = (client.clone(), accepted.clone());
                    slot = (slot + 1) % client.schedulers();
                    submissions.spawn(async move {
                        if client.submit(&key, &body, slot).await.is_some() {
                            accepted
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(Instant::now());
                        }
                    });
                }
                submissions.join_all().await;
            })
        };
        Probe {
            began: Instant::now(),
            accepted,
            stop,
            task,
        }
    }

    /// Stops submitting, waits for the answers, and returns the longest time without an
    /// acceptance (from the probe's start to its last acceptance).
    async fn finish(self) -> Duration {
        self.stop.cancel();
        if let Err(e) = self.task.await {
            eprintln!("the probe's task failed: {e}");
        }
        let mut times = self
            .accepted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        times.sort();
        let mut previous = self.began;
        let mut longest = Duration::ZERO;
        for t in times {
            longest = longest.max(t - previous);
            previous = t;
        }
        longest
    }
}
