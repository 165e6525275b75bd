//! Names that exist (DESIGN §7b): a submission that names a checkpoint or a LoRA which no worker
//! has advertised and the model catalogue does not hold is refused, naming the field and the names
//! that do exist, so a typo fails at once instead of waiting for a worker that will never come. A
//! name some worker had waits for one ([`crate::config::Config::checkpoint_wait_s`]).
//!
//! The LoRA names found in the catalogue go into the job's `queued` event with their hashes, so
//! that dispatch prefers the workers whose model cache holds the files; so does a checkpoint name
//! that no worker advertises and the catalogue holds as a checkpoint, which then routes the job
//! to the workers that serve the catalogue's checkpoints (`registry/names.rs`).
//!
//! What cannot be told refuses nothing: right after a start (before every live worker has beaten
//! once), while a worker lists no LoRAs, and while the catalogue cannot be read.

use std::collections::BTreeMap;

use vnfarm_proto::catalogue::{ContentHash, ModelRef, blob_key};
use vnfarm_proto::{GenerateSpec, JobSpec, LoraRef, ModelFileRole, ValidationError};
use vnfarm_storage::{Catalogue, CatalogueError};

use crate::intake::AcceptError;
use crate::registry::AdvertisedNames;
use crate::scheduler::Scheduler;

/// The most existing names a refusal lists.
const LISTED_NAMES: usize = 20;

/// What a submission names a file as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Checkpoint,
    Lora,
}

impl Kind {
    fn words(self) -> &'static str {
        match self {
            Kind::Checkpoint => "checkpoint",
            Kind::Lora => "LoRA",
        }
    }

    fn role(self) -> ModelFileRole {
        match self {
            Kind::Checkpoint => ModelFileRole::Checkpoint,
            Kind::Lora => ModelFileRole::Lora,
        }
    }

    fn advertised(self, names: &AdvertisedNames, name: &str) -> bool {
        match self {
            Kind::Checkpoint => names.checkpoints.contains(name),
            Kind::Lora => names.may_have_lora(name),
        }
    }
}

/// A file a submission names, with its field.
struct Named {
    field: String,
    kind: Kind,
    name: String,
}

/// Every checkpoint and LoRA a submission names, as given (before the fleet's default checkpoint
/// is filled in).
fn named(job: &JobSpec) -> Vec<Named> {
    fn loras(at: &str, loras: &[LoraRef], out: &mut Vec<Named>) {
        out.extend(loras.iter().enumerate().map(|(i, l)| Named {
            field: format!("{at}.loras[{i}].name"),
            kind: Kind::Lora,
            name: l.name.clone(),
        }));
    }
    fn generate(at: &str, g: &GenerateSpec, out: &mut Vec<Named>) {
        out.extend(g.checkpoint.iter().map(|c| Named {
            field: format!("{at}.checkpoint"),
            kind: Kind::Checkpoint,
            name: c.clone(),
        }));
        loras(at, &g.loras, out);
    }
    let mut out = Vec::new();
    match job {
        JobSpec::Generate(g) => generate("job", g, &mut out),
        JobSpec::Edit(e) => loras("job", &e.loras, &mut out),
        JobSpec::Upscale(_) => {}
        JobSpec::Pipeline(p) => {
            generate("job.base", &p.base, &mut out);
            for (i, edit) in p.edits.iter().enumerate() {
                loras(&format!("job.edits[{i}]"), &edit.loras, &mut out);
            }
        }
    }
    out
}

/// What the catalogue says of a name.
enum Lookup {
    /// It holds the file, with this hash.
    Found(ContentHash),
    /// Its entry of that name is a file of another role.
    OtherRole(ModelFileRole),
    Absent,
    /// It cannot be read now.
    Unknown,
}

impl Scheduler {
    /// Resolves the LoRA names of a submission to the catalogue's files (for the `queued` event:
    /// the workers that hold them are preferred), and refuses a checkpoint or LoRA that exists
    /// nowhere (see the module's doc).
    pub(crate) async fn resolve_names(
        &self,
        job: &JobSpec,
    ) -> Result<BTreeMap<String, ContentHash>, AcceptError> {
        let mut files = BTreeMap::new();
        let named = named(job);
        if named.is_empty() {
            return Ok(files);
        }
        let may_refuse = self.has_heard_the_fleet();
        let advertised = self.registry().advertised_names();
        let catalogue = Catalogue::new(self.storage().clone());
        for n in named {
            let on_a_worker = n.kind.advertised(&advertised, &n.name);
            // A checkpoint a worker advertises is that worker's file (it shadows the catalogue's):
            // nothing to look up. A LoRA's lookup finds the file that dispatch prefers workers
            // for; so does a checkpoint's, which also routes the job to the workers that fetch
            // the catalogue's checkpoints.
            if n.kind == Kind::Checkpoint && on_a_worker {
                continue;
            }
            match self.look_up(&catalogue, &n).await {
                Lookup::Found(hash) => {
                    files.insert(n.name, hash);
                }
                Lookup::Unknown => {}
                Lookup::Absent | Lookup::OtherRole(_) if !may_refuse || on_a_worker => {}
                Lookup::OtherRole(role) => return Err(wrong_role(n, role)),
                Lookup::Absent => return Err(refusal(&catalogue, n, &advertised).await),
            }
        }
        Ok(files)
    }

    /// The catalogue's file for a name (an entry of that name, or for `sha256:<hex>` the blob).
    async fn look_up(&self, catalogue: &Catalogue, n: &Named) -> Lookup {
        // A blob has no role: a `sha256:` reference is taken for what the job names it as.
        let found = match ModelRef::parse(&n.name) {
            Some(ModelRef::Hash(sha256)) => self
                .storage()
                .exists(&blob_key(&sha256))
                .await
                .map(|there| there.then_some((sha256, n.kind.role())))
                .map_err(CatalogueError::from),
            Some(ModelRef::Name(name)) => catalogue
                .entry(&name)
                .await
                .map(|e| e.map(|e| (e.sha256, e.role))),
            None => Ok(None),
        };
        match found {
            Ok(Some((hash, role))) if role == n.kind.role() => Lookup::Found(hash),
            Ok(Some((_, role))) => Lookup::OtherRole(role),
            Ok(None) => Lookup::Absent,
            Err(e) => {
                tracing::warn!(name = n.name, error = %e, "cannot read the model catalogue now; accepting the name");
                Lookup::Unknown
            }
        }
    }
}

/// The refusal of a name that exists nowhere, with the names of its kind that do.
async fn refusal(catalogue: &Catalogue, n: Named, advertised: &AdvertisedNames) -> AcceptError {
    let known = known_names(catalogue, n.kind, advertised).await;
    let message = format!(
        "{} `{}` is on no worker and not in the model catalogue; {}",
        n.kind.words(),
        n.name,
        match known.as_slice() {
            [] => format!("there are no {} names yet", n.kind.words()),
            names => format!("names that exist: {}", listed(names)),
        }
    );
    tracing::info!(
        field = n.field,
        name = n.name,
        "submission refused: a name that exists nowhere"
    );
    AcceptError::Invalid(ValidationError {
        field: n.field,
        message,
    })
}

/// The refusal of a name whose catalogue entry is a file of another role (a LoRA named as a
/// checkpoint): the worker would fetch it and fail to load it.
fn wrong_role(n: Named, role: ModelFileRole) -> AcceptError {
    AcceptError::Invalid(ValidationError {
        message: format!(
            "`{}` is a {} in the model catalogue, not a {} (those are pushed with --role {})",
            n.name,
            role.as_str(),
            n.kind.words(),
            n.kind.role().as_str()
        ),
        field: n.field,
    })
}

/// The names of `kind` that exist: the workers' and the catalogue's of that role, sorted.
async fn known_names(
    catalogue: &Catalogue,
    kind: Kind,
    advertised: &AdvertisedNames,
) -> Vec<String> {
    let mut names: Vec<String> = match kind {
        Kind::Checkpoint => advertised.checkpoints.iter().cloned().collect(),
        Kind::Lora => advertised.loras.iter().flatten().cloned().collect(),
    };
    match catalogue.list().await {
        Ok(entries) => names.extend(
            entries
                .into_iter()
                .filter(|e| e.role == kind.role())
                .map(|e| e.name),
        ),
        Err(e) => tracing::warn!(error = %e, "cannot list the model catalogue for a refusal"),
    }
    names.sort();
    names.dedup();
    names
}

/// Up to [`LISTED_NAMES`] names, then how many more.
fn listed(names: &[String]) -> String {
    let shown = names[..names.len().min(LISTED_NAMES)].join(", ");
    match names.len().saturating_sub(LISTED_NAMES) {
        0 => shown,
        more => format!("{shown} and {more} more (vnfarm models list)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipeline_names_its_base_checkpoint_and_every_loras_field() {
        let submission: vnfarm_proto::Submission = serde_json::from_value(serde_json::json!({
            "schema_version": 1,
            "job": {"kind": "pipeline",
                "base": {"prompt": "x", "checkpoint": "nova", "loras": [{"name": "ink"}]},
                "edits": [{"instruction": "smile"}, {"instruction": "frown",
                    "loras": [{"name": "a"}, {"name": "sha256:00"}]}]}
        }))
        .unwrap();
        let named = named(&submission.job);
        let fields: Vec<(&str, Kind, &str)> = named
            .iter()
            .map(|n| (n.field.as_str(), n.kind, n.name.as_str()))
            .collect();
        assert_eq!(
            fields,
            [
                ("job.base.checkpoint", Kind::Checkpoint, "nova"),
                ("job.base.loras[0].name", Kind::Lora, "ink"),
                ("job.edits[1].loras[0].name", Kind::Lora, "a"),
                ("job.edits[1].loras[1].name", Kind::Lora, "sha256:00"),
            ]
        );
    }

    #[test]
    fn a_long_list_of_names_is_cut() {
        let names: Vec<String> = (0..25).map(|i| format!("n{i:02}")).collect();
        let text = listed(&names);
        assert!(text.starts_with("n00, n01"), "{text}");
        assert!(
            text.ends_with("n19 and 5 more (vnfarm models list)"),
            "{text}"
        );
        assert_eq!(listed(&names[..2]), "n00, n01");
    }
}
