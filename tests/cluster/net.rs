//! The test's own network: one namespace per box and one for the storage box, each plugged by a veth
//! pair into a bridge that lives in a namespace of its own, plus a veth from the test's (root)
//! namespace into the bridge, so the test reaches every box as a client would. Each box also has a
//! direct *observation* link to the root namespace, outside the bridge, so the test can still read
//! a cut box's `/healthz` (nothing else uses it: no process connects to those addresses).
//!
//! Every address is in 10.77.0.0/16 and every name starts with [`PREFIX`]; nothing is routed
//! anywhere else. [`Network`] removes it all when dropped (on failure and panic too), and
//! [`Network::create`] first removes what a crashed earlier run left behind.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context, bail};

/// Prefix of every namespace and link this test creates (and removes at start when left over).
const PREFIX: &str = "vnc-";
const BRIDGE_NS: &str = "vnc-bridge";
/// The test's own end of the bridge, in the root namespace.
const ROOT_LINK: &str = "vnc-root";
const ROOT_ADDRESS: &str = "10.77.0.100/24";

/// A namespace plugged into the bridge: a box or the storage box.
#[derive(Clone, Debug)]
pub struct Host {
    /// The namespace (`vnc-box1`).
    pub ns: String,
    /// Its address on the bridge, which every process binds and every client dials.
    pub address: Ipv4Addr,
    /// The bridge-side end of its veth: down means the host is cut off.
    bridge_port: String,
    /// Its address on the observation link (`None` for the storage box).
    pub observed_at: Option<Ipv4Addr>,
}

impl Host {
    /// `program args…` inside this host's namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns, program]);
        command
    }
}

/// The boxes (`10.77.0.1` …), the storage box (`10.77.0.10`) and the bridge, until dropped.
pub struct Network {
    pub boxes: Vec<Host>,
    pub storage: Host,
}

impl Network {
    /// Builds `boxes` box namespaces and the storage namespace, after removing leftovers of an
    /// earlier run.
    pub fn create(boxes: u8) -> anyhow::Result<Self> {
        remove_leftovers()?;
        let network = Network {
            boxes: (1..=boxes)
                .map(|n| host(&format!("box{n}"), n, true))
                .collect(),
            storage: host("s3", 10, false),
        };
        ip(&["netns", "add", BRIDGE_NS])?;
        ip(&["-n", BRIDGE_NS, "link", "set", "lo", "up"])?;
        ip(&["-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", BRIDGE_NS, "link", "set", "br0", "up"])?;
        for host in network.boxes.iter().chain([&network.storage]) {
            plug(host)?;
        }
        ip(&[
            "link",
            "add",
            ROOT_LINK,
            "type",
            "veth",
            "peer",
            "name",
            "vnc-root-br",
            "netns",
            BRIDGE_NS,
        ])?;
        ip(&["addr", "add", ROOT_ADDRESS, "dev", ROOT_LINK])?;
        ip(&["link", "set", ROOT_LINK, "up"])?;
        ip(&[
            "-n",
            BRIDGE_NS,
            "link",
            "set",
            "vnc-root-br",
            "master",
            "br0",
            "up",
        ])?;
        Ok(network)
    }

    /// Cuts `host` off the bridge (its processes keep running and keep their addresses).
    pub fn cut(&self, host: &Host) -> anyhow::Result<()> {
        ip(&["-n", BRIDGE_NS, "link", "set", &host.bridge_port, "down"])
    }

    pub fn restore(&self, host: &Host) -> anyhow::Result<()> {
        ip(&["-n", BRIDGE_NS, "link", "set", &host.bridge_port, "up"])
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Err(e) = remove_leftovers() {
            eprintln!("removing the test's network namespaces: {e:#}");
        }
    }
}

fn host(name: &str, n: u8, observed: bool) -> Host {
    Host {
        ns: format!("{PREFIX}{name}"),
        address: Ipv4Addr::new(10, 77, 0, n),
        bridge_port: format!("{PREFIX}{name}-br"),
        observed_at: observed.then(|| Ipv4Addr::new(10, 77, 1, 4 * n + 1)),
    }
}

/// The host's namespace, its veth into the bridge and, for a box, its observation link: a /30 of
/// its own in 10.77.1.0/24 (`4n+1` in the box, `4n+2` in the root namespace).
fn plug(host: &Host) -> anyhow::Result<()> {
    // Named after the namespace: it is created in the root namespace before it moves, so a run
    // that crashed in between leaves it where `remove_leftovers` finds it.
    let inside = &host.ns;
    ip(&["netns", "add", &host.ns])?;
    ip(&["-n", &host.ns, "link", "set", "lo", "up"])?;
    ip(&[
        "link",
        "add",
        inside,
        "type",
        "veth",
        "peer",
        "name",
        &host.bridge_port,
        "netns",
        BRIDGE_NS,
    ])?;
    ip(&["link", "set", inside, "netns", &host.ns])?;
    ip(&[
        "-n",
        &host.ns,
        "addr",
        "add",
        &format!("{}/24", host.address),
        "dev",
        inside,
    ])?;
    ip(&["-n", &host.ns, "link", "set", inside, "up"])?;
    ip(&[
        "-n",
        BRIDGE_NS,
        "link",
        "set",
        &host.bridge_port,
        "master",
        "br0",
        "up",
    ])?;
    if let Some(observed) = host.observed_at {
        let [a, b, c, d] = observed.octets();
        let root_end = Ipv4Addr::new(a, b, c, d + 1);
        let (box_link, root_link) = ("observe".to_owned(), format!("{}-obs", host.ns));
        ip(&[
            "link", "add", &root_link, "type", "veth", "peer", "name", &box_link, "netns", &host.ns,
        ])?;
        ip(&[
            "-n",
            &host.ns,
            "addr",
            "add",
            &format!("{observed}/30"),
            "dev",
            &box_link,
        ])?;
        ip(&["-n", &host.ns, "link", "set", &box_link, "up"])?;
        ip(&["addr", "add", &format!("{root_end}/30"), "dev", &root_link])?;
        ip(&["link", "set", &root_link, "up"])?;
    }
    Ok(())
}

/// Kills every process in the test's namespaces (by the ids `ip netns pids` lists) and deletes
/// the namespaces, which takes their veths (and the root-side ends) with them.
fn remove_leftovers() -> anyhow::Result<()> {
    let listed = output(&["netns", "list"])?;
    let namespaces: Vec<&str> = listed
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|ns| ns.starts_with(PREFIX))
        .collect();
    for ns in &namespaces {
        for pid in output(&["netns", "pids", ns])?.split_whitespace() {
            // A process may have exited since the listing: nothing to kill then.
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    for ns in &namespaces {
        ip(&["netns", "delete", ns])?;
    }
    // A namespace's veths go only once its last process has exited, which may be after this
    // returns: the root namespace's ends (the bridge plug, the observation links, a box's link
    // not yet moved into its namespace) are deleted by name, which takes their peers too.
    for link in output(&["-o", "link", "show"])?.lines() {
        let Some(name) = link.split(": ").nth(1).and_then(|n| n.split('@').next()) else {
            continue;
        };
        // One that vanished since the listing (its namespace was just freed) is gone as wanted.
        let gone = |name: &str| output(&["link", "show", name]).is_err();
        if name.starts_with(PREFIX) && ip(&["link", "delete", name]).is_err() && !gone(name) {
            bail!("cannot delete the leftover link {name}");
        }
    }
    Ok(())
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    output(args).map(drop)
}

fn output(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
