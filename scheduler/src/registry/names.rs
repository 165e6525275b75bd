//! Which model names the workers advertise, which workers a job's named checkpoint may go to
//! (one advertising the name, or for a checkpoint the catalogue holds, one that serves the
//! catalogue's checkpoints), and the jobs whose named checkpoint no live worker serves any more
//! (DESIGN §7b, "Names that exist", "Checkpoints from the catalogue").

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use vnfarm_proto::{Heartbeat, JobId};

use super::{Registry, Route};

/// Whether a worker of this beat may run the route's checkpoint: none named; the name among the
/// checkpoints it advertises; or, for a name that stood for a catalogue file at acceptance, it
/// serves the catalogue's checkpoints (it fetches the file, DESIGN §7b). A name a worker
/// advertises is its own file, which shadows the catalogue's, as a `lora_dir` does.
pub(super) fn serves_checkpoint(hb: &Heartbeat, route: &Route) -> bool {
    let Some(checkpoint) = &route.checkpoint else {
        return true;
    };
    hb.checkpoints.contains(checkpoint)
        || (route.catalogue.is_some() && hb.catalogue_checkpoints.is_some_and(|n| n > 0))
}

/// The checkpoint and LoRA names of every worker this scheduler has heard from, live or gone: a
/// name one of them had is known (it waits for a worker), a name none had is refused unless the
/// catalogue holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdvertisedNames {
    pub checkpoints: BTreeSet<String>,
    /// None when a worker does not list its LoRAs (one before that field, a test-pattern engine
    /// that claims none): any LoRA name may then exist.
    pub loras: Option<BTreeSet<String>>,
}

impl AdvertisedNames {
    /// Whether a job's LoRA name is one of the advertised files (`<name>` or
    /// `<name>.safetensors`, as a worker's folder looks it up), or may be.
    pub fn may_have_lora(&self, name: &str) -> bool {
        self.loras.as_ref().is_none_or(|loras| {
            loras.contains(name) || loras.contains(&format!("{name}.safetensors"))
        })
    }
}

impl Registry {
    /// What the workers it has heard from advertise, by their latest beats.
    pub fn advertised_names(&self) -> AdvertisedNames {
        let mut names = AdvertisedNames {
            checkpoints: BTreeSet::new(),
            loras: Some(BTreeSet::new()),
        };
        for (_, beat) in self.workers.values().filter_map(|w| w.last_heartbeat()) {
            names.checkpoints.extend(beat.checkpoints.iter().cloned());
            match (&mut names.loras, &beat.loras) {
                (Some(all), Some(these)) => all.extend(these.iter().cloned()),
                (all, _) => *all = None,
            }
        }
        names
    }

    /// Waiting jobs that name a checkpoint no live worker advertises while live workers serve
    /// their model, unchanged since before `before`: the workers that had the checkpoint are gone
    /// and no other can run them. A farm whose workers of the model are all gone (an outage, an
    /// upgrade) fails nothing: its jobs wait for it.
    pub fn unserved_checkpoints(
        &self,
        before: DateTime<Utc>,
        timeout: Duration,
    ) -> Vec<(JobId, Route)> {
        let mut unserved = Vec::new();
        for (route, ready) in self.jobs.ready() {
            if route.checkpoint.is_none() {
                continue;
            }
            let alive = || self.workers.values().filter(|w| w.alive(timeout));
            let advertised = alive().any(|w| {
                w.advertises_model(route.model)
                    && w.last_heartbeat()
                        .is_some_and(|(_, hb)| serves_checkpoint(hb, route))
            });
            let model_up = alive().any(|w| w.advertises_model(route.model));
            if advertised || !model_up {
                continue;
            }
            unserved.extend(
                ready
                    .values()
                    .flatten()
                    .map(|&(_, _, id)| id)
                    .filter(|id| self.jobs[id].updated_at() < before)
                    .map(|id| (id, route.clone())),
            );
        }
        unserved
    }
}

#[cfg(test)]
mod tests {
    use vnfarm_proto::{Heartbeat, ModelFamily};

    use super::*;
    use crate::registry::testing::{Stream, affinity, generate, later, worker};

    const T: Duration = Duration::from_secs(60);

    fn named(checkpoint: &str) -> vnfarm_proto::Submission {
        let mut s = generate();
        if let vnfarm_proto::JobSpec::Generate(g) = &mut s.job {
            g.checkpoint = Some(checkpoint.into());
        }
        s
    }

    #[test]
    fn names_are_every_heard_workers_and_loras_unknown_while_one_lists_none() {
        let mut r = Registry::default();
        r.heartbeat(Heartbeat {
            checkpoints: vec!["nova".into()],
            loras: Some(vec!["ink.safetensors".into()]),
            ..worker("a", 1)
        });
        let names = r.advertised_names();
        assert_eq!(names.checkpoints, BTreeSet::from(["nova".to_owned()]));
        assert!(names.may_have_lora("ink") && names.may_have_lora("ink.safetensors"));
        assert!(!names.may_have_lora("inc"));
        r.heartbeat(worker("old", 1));
        assert!(
            r.advertised_names().may_have_lora("inc"),
            "a worker that lists no LoRAs may have any"
        );
    }

    #[test]
    fn a_job_whose_checkpoint_left_with_its_workers_is_unserved_while_its_model_is_up() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let job = s.queue(&mut r, named("gone"));
        let later = Utc::now() + chrono::Duration::seconds(1);
        assert!(
            r.unserved_checkpoints(later, T).is_empty(),
            "no SDXL worker at all: it waits for the farm"
        );
        r.heartbeat(worker("plain", 1));
        let unserved = r.unserved_checkpoints(later, T);
        assert_eq!(unserved.len(), 1, "{unserved:?}");
        assert_eq!(unserved[0].0, job);
        assert_eq!(unserved[0].1.model, ModelFamily::Sdxl);
        let earlier = Utc::now() - chrono::Duration::seconds(60);
        assert!(
            r.unserved_checkpoints(earlier, T).is_empty(),
            "not waiting that long yet"
        );
        r.heartbeat(Heartbeat {
            checkpoints: vec!["gone".into()],
            state: vnfarm_proto::WorkerState::Warming,
            ..worker("back", 1)
        });
        assert!(
            r.unserved_checkpoints(later, T).is_empty(),
            "a worker that advertises it, even warming, will serve it"
        );
    }

    fn fetching(id: &str, n: u32, cached: &[&str]) -> Heartbeat {
        Heartbeat {
            catalogue_checkpoints: Some(n),
            model_cache: Some(cached.iter().map(|h| (*h).to_owned()).collect()),
            ..worker(id, 2)
        }
    }

    #[test]
    fn a_catalogue_checkpoint_goes_to_a_worker_that_fetches_them_the_holder_first() {
        let mut r = Registry::default();
        let mut s = Stream::new();
        let hash = "c".repeat(64);
        let sha = vnfarm_proto::catalogue::ContentHash::try_from(hash.clone()).unwrap();
        let policy = crate::config::DispatchConfig {
            max_batch: 1,
            ..affinity()
        };
        r.heartbeat(worker("plain", 2));
        r.heartbeat(fetching("off", 0, &[]));
        let job = s.queue_with_files(&mut r, named("cat"), [("cat".into(), sha.clone())].into());
        assert_eq!(
            r.job(job).unwrap().route().unwrap().catalogue,
            Some(sha.clone())
        );
        assert!(
            r.plan_dispatch(&policy, later(0), T).dispatches.is_empty(),
            "no worker serves catalogue checkpoints"
        );
        let later_by = Utc::now() + chrono::Duration::seconds(1);
        assert_eq!(r.unserved_checkpoints(later_by, T).len(), 1);
        r.heartbeat(fetching("fetches", 1, &[]));
        r.heartbeat(fetching("holds", 1, &[&hash]));
        assert!(r.unserved_checkpoints(later_by, T).is_empty());
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert_eq!(plan.dispatches.len(), 1, "{plan:?}");
        assert_eq!(
            plan.dispatches[0].worker.as_str(),
            "holds",
            "the worker whose cache holds the file"
        );
        // The same name without a catalogue file (a checkpoint some worker advertised) does not
        // go to a fetching worker: it waits for one that has it.
        let other = s.queue(&mut r, named("cat"));
        let plan = r.plan_dispatch(&policy, later(0), T);
        assert!(
            plan.dispatches.iter().all(|d| !d.jobs.contains(&other)),
            "{plan:?}"
        );
    }
}
