//! What the kernel says about a running process: resident memory (`/proc/<pid>/status`) and the
//! CPU time it has used (`/proc/<pid>/stat`).

use std::time::Duration;

use anyhow::Context;

/// Resident memory, in KiB.
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    /// `VmRSS`: resident now.
    pub rss_kib: u64,
    /// `VmHWM`: the most that was ever resident.
    pub hwm_kib: u64,
}

pub fn memory(pid: u32) -> anyhow::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// User plus system CPU time the process has used so far.
pub fn cpu(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Field 2, the command name, is in parentheses and may hold spaces: count from the last ')'.
    // After it come field 3 (state) onwards; utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |n: usize| -> anyhow::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("field {n} of /proc/{pid}/stat"))
    };
    let total = ticks(14)? + ticks(15)?;
    Ok(Duration::from_secs_f64(total as f64 / clock_ticks() as f64))
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s times.
fn clock_ticks() -> u64 {
    // sysconf only reads a constant of the C library: no memory is involved.
    #[allow(unsafe_code)]
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100)
}

/// KiB as MiB, for tables.
pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
