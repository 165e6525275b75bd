//! Observing a running scheduler from outside: its Prometheus metrics, how long it takes to serve
//! after it starts, and fields of its log lines.

use std::time::{Duration, Instant};

use anyhow::bail;
use vnfarm_tests::{Farm, Role};

/// How often readiness is polled while a start is timed.
const POLL: Duration = Duration::from_millis(20);

/// A metric of the first scheduler's `/metrics`, summed over the series whose labels include every
/// `name="value"` of `labels` (0 when there is none).
pub async fn metric(farm: &Farm, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    let text = farm.scheduler_metrics().await?;
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric, series_labels) = series.split_once('{').unwrap_or((series, ""));
        if metric != name {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| series_labels.contains(&format!("{k}=\"{v}\"")))
        {
            sum += value.parse::<f64>()?;
        }
    }
    Ok(sum)
}

/// Jobs the scheduler has seen complete while it ran (replayed history is not counted).
pub async fn completed(farm: &Farm) -> anyhow::Result<u64> {
    let n = metric(
        farm,
        "vnfarm_jobs_finished_total",
        &[("outcome", "completed")],
    )
    .await?;
    Ok(n as u64)
}

/// How long a scheduler took, from `launched`, to answer `/healthz` (the stream replayed up to its
/// marker) and to report itself active (leader token held, caught up again, dispatching).
#[derive(Clone, Copy, Debug)]
pub struct ServeTimes {
    pub ready: Duration,
    pub active: Duration,
}

pub async fn wait_serving(
    farm: &Farm,
    slot: usize,
    launched: Instant,
    timeout: Duration,
) -> anyhow::Result<ServeTimes> {
    let mut ready = None;
    loop {
        match farm.role(slot).await {
            Some(Role::Active) => {
                let active = launched.elapsed();
                return Ok(ServeTimes {
                    ready: ready.unwrap_or(active),
                    active,
                });
            }
            Some(Role::Standby) => {
                ready.get_or_insert_with(|| launched.elapsed());
            }
            None => {}
        }
        if launched.elapsed() > timeout {
            bail!(
                "the scheduler was not serving {timeout:?} after its start\n{}",
                farm.scheduler_logs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The value of `field` in the last line of `log` that holds `message` (the text format of the
/// scheduler's logs: `... message field=value ...`, possibly with terminal colour codes).
pub fn log_field(log: &str, message: &str, field: &str) -> Option<String> {
    let line = log.lines().rev().find(|l| l.contains(message))?;
    let plain = strip_ansi(line);
    let needle = format!("{field}=");
    plain
        .split_whitespace()
        .find_map(|token| token.strip_prefix(&needle))
        .map(str::to_owned)
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequence: ESC [ parameters final-byte.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_fields_are_read_through_colour_codes() {
        let log = "2026 INFO x: event stream replayed \u{1b}[3mevents\u{1b}[0m\u{1b}[2m=\u{1b}[0m1000 \u{1b}[3mseconds\u{1b}[0m\u{1b}[2m=\u{1b}[0m1.5\n";
        assert_eq!(
            log_field(log, "event stream replayed", "seconds").as_deref(),
            Some("1.5")
        );
        assert_eq!(
            log_field(log, "event stream replayed", "events").as_deref(),
            Some("1000")
        );
        assert_eq!(log_field(log, "snapshot loaded", "seconds"), None);
    }
}
