//! How fast interactive work arrives, by class, learned from the stream's `queued` events alone,
//! so that every scheduler learns the same from the same events (a snapshot carries it, inside
//! [`super::Rates`]). Interactive work submitted after a batch job overtakes it (§5), so a
//! waiting batch job's estimate counts on the capacity that work will take (the simulation's
//! `Stretch`).
//!
//! The rate is an exponentially weighted count of the interactive jobs queued, each weighing
//! e^(−age / [`MEAN_AGE`]), over the same weight integrated across the time this farm has been
//! watched (since the first job it queued, and at least [`MIN_WATCHED`]): a farm watched for less
//! than `MEAN_AGE` is not taken for a quiet one, and one that has just begun is not taken for a
//! busy one on the strength of a single arrival. The jobs' work (steps × images) is kept beside
//! the count, so a class's expected seconds come from the same rates as any other job's.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Class, Work};

/// The age at which an arrival weighs 1/e: the rate follows what the last few minutes brought.
pub(super) const MEAN_AGE: Duration = Duration::from_secs(600);
/// Arrivals count as if spread over at least this long.
pub(super) const MIN_WATCHED: Duration = Duration::from_secs(60);

/// The interactive jobs queued, decayed to `at`, by class (durable: part of a snapshot).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Arrivals {
    /// When the first job (of any priority) was queued: the rate is over the time since.
    since: Option<DateTime<Utc>>,
    /// The time the sums below are decayed to: the latest arrival's.
    at: Option<DateTime<Utc>>,
    by_class: Vec<Arrived>,
}

/// The decayed sums of one class's interactive arrivals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Arrived {
    class: Class,
    jobs: f64,
    units: f64,
}

/// What is expected to arrive of one class: jobs per second, of a mean work each.
#[derive(Clone, Debug, PartialEq)]
pub(in crate::registry) struct Expected {
    pub(in crate::registry) per_second: f64,
    /// The mean job's work, to be priced by the rates like any job's.
    pub(in crate::registry) work: Work,
}

/// e^(−seconds / MEAN_AGE).
fn weight(seconds: f64) -> f64 {
    (-seconds.max(0.0) / MEAN_AGE.as_secs_f64()).exp()
}

fn seconds(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    (to - from).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6
}

impl Arrivals {
    /// Learns from a job queued at `at`: any job starts the watch; an interactive one with a
    /// known amount of work (not a pipeline: its jobs are queued with it) counts as an arrival.
    /// The events of one stream come in order, though the schedulers' clocks that stamp them may
    /// disagree a little: an arrival stamped before `at` is counted at its own age.
    pub(super) fn queued(&mut self, work: Option<&Work>, interactive: bool, at: DateTime<Utc>) {
        self.since = Some(self.since.map_or(at, |s| s.min(at)));
        let Some(work) = work.filter(|_| interactive) else {
            return;
        };
        let decay = match self.at {
            Some(last) if last > at => {
                let w = weight(seconds(at, last));
                self.add(work, w);
                return;
            }
            Some(last) => weight(seconds(last, at)),
            None => 1.0,
        };
        for arrived in &mut self.by_class {
            arrived.jobs *= decay;
            arrived.units *= decay;
        }
        self.at = Some(at);
        self.add(work, 1.0);
    }

    fn add(&mut self, work: &Work, weight: f64) {
        match self.by_class.iter_mut().find(|a| a.class == work.class) {
            Some(arrived) => {
                arrived.jobs += weight;
                arrived.units += weight * work.units;
            }
            None => self.by_class.push(Arrived {
                class: work.class.clone(),
                jobs: weight,
                units: weight * work.units,
            }),
        }
    }

    /// What is expected to arrive per second from `now`, by class (none for a class with no
    /// interactive arrival).
    pub(super) fn expected(&self, now: DateTime<Utc>) -> Vec<Expected> {
        let (Some(since), Some(at)) = (self.since, self.at) else {
            return Vec::new();
        };
        let tau = MEAN_AGE.as_secs_f64();
        let watched = seconds(since, now).max(MIN_WATCHED.as_secs_f64());
        // ∫ e^(−age / τ) over the ages watched.
        let window = tau * (1.0 - weight(watched));
        let decay = weight(seconds(at, now));
        self.by_class
            .iter()
            .filter(|a| a.jobs > 0.0)
            .map(|a| Expected {
                per_second: a.jobs * decay / window,
                work: Work {
                    class: a.class.clone(),
                    units: a.units / a.jobs,
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::ModelFamily;

    use super::*;

    fn work(units: f64) -> Work {
        Work {
            class: Class {
                model: ModelFamily::Sdxl,
                resolution: "1mp".into(),
            },
            units,
        }
    }

    /// One interactive job every 2 s, of 10 or 30 units in turn, on a farm watched for two
    /// minutes (a batch job started the watch and counts for nothing else): 0.5 jobs per second
    /// of 20 units, give or take the discreteness of the arrivals.
    #[test]
    fn the_rate_is_the_weighted_count_over_the_time_watched() {
        let t0 = Utc::now();
        let at = |s: i64| t0 + chrono::Duration::seconds(s);
        let mut arrivals = Arrivals::default();
        arrivals.queued(Some(&work(20.0)), false, at(0));
        assert!(
            arrivals.expected(at(10)).is_empty(),
            "no interactive work yet"
        );
        for n in 0..60 {
            let units = 10.0 + f64::from(n % 2) * 20.0;
            arrivals.queued(Some(&work(units)), true, at(1 + 2 * i64::from(n)));
        }
        let expected = arrivals.expected(at(120));
        assert_eq!(expected.len(), 1);
        let rate = expected[0].per_second;
        assert!((rate - 0.5).abs() < 0.005, "{rate}");
        let units = expected[0].work.units;
        assert!((units - 20.0).abs() < 0.1, "{units}");
        // Two minutes later with nothing new, the rate has decayed and is spread over more time.
        let later = arrivals.expected(at(240))[0].per_second;
        assert!(later < 0.5 * rate, "{later}");
        // A single arrival on a farm just started counts as if over a minute.
        let mut young = Arrivals::default();
        young.queued(Some(&work(1.0)), true, at(0));
        let rate = young.expected(at(1))[0].per_second;
        let over_a_minute = weight(1.0) / (600.0 * (1.0 - (-0.1f64).exp()));
        assert!((rate - over_a_minute).abs() < 1e-9, "{rate}");
    }
}
