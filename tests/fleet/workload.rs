//! The fleet benchmark's workload: made once from a seed, submitted the same way to every policy.

use std::time::{Duration, Instant};

use anyhow::bail;
use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use vnfarm_proto::JobId;

use super::RunConfig;
use crate::Farm;

/// Images are small: the stage delays, not the pixels, stand for the work.
const SIDE: u32 = 256;
/// A mixed workload's sides (three resolution classes: 0.25, 0.5 and 1 megapixel), generate steps
/// and edit steps.
const MIXED_SIDES: [u32; 3] = [512, 768, 1024];
const MIXED_STEPS: [u32; 3] = [12, 20, 30];
const MIXED_EDIT_STEPS: [u32; 2] = [4, 8];
/// How far apart the edits of a burst arrive (an artist sending variants one by one).
const BURST_SPACING: Duration = Duration::from_millis(60);

#[derive(Clone, Debug)]
pub enum Item {
    /// A base and edits of it, in one submission.
    Pipeline {
        edits: usize,
    },
    Generate {
        count: u32,
    },
    /// Edits of one uploaded image, submitted one by one.
    EditBurst {
        upload: usize,
        edits: usize,
    },
    /// An edit of the first image of an earlier item of this workload.
    EditOf {
        item: usize,
    },
}

#[derive(Clone, Debug)]
pub struct Timed {
    /// When it is submitted, from the start of the run.
    pub at: Duration,
    pub interactive: bool,
    pub item: Item,
    pub shape: Shape,
}

/// An item's image size and steps.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub side: u32,
    pub steps: u32,
    pub edit_steps: u32,
}

impl Shape {
    /// Every item's, unless the workload is mixed.
    pub const UNIFORM: Shape = Shape {
        side: SIDE,
        steps: 20,
        edit_steps: 4,
    };

    /// Every shape a mixed workload draws from (the estimates' warm-up runs one job of each
    /// class).
    pub fn mixed() -> impl Iterator<Item = Shape> {
        MIXED_SIDES.into_iter().map(|side| Shape {
            side,
            steps: MIXED_STEPS[1],
            edit_steps: MIXED_EDIT_STEPS[0],
        })
    }
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub items: Vec<Timed>,
    pub uploads: usize,
}

impl Workload {
    pub fn new(config: &RunConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(config.seed);
        // Shapes from a stream of their own, so a mixed workload has the same items.
        let mut shapes = StdRng::seed_from_u64(config.seed.wrapping_add(1));
        let mut shape = move || {
            if !config.mixed {
                return Shape::UNIFORM;
            }
            let mut pick = |options: &[u32]| options[shapes.random_range(0..options.len())];
            Shape {
                side: pick(&MIXED_SIDES),
                steps: pick(&MIXED_STEPS),
                edit_steps: pick(&MIXED_EDIT_STEPS),
            }
        };
        let mut items = Vec::new();
        let mut uploads = 0;
        let mut pick = |rng: &mut StdRng, earlier: usize| -> Item {
            match rng.random_range(0..10) {
                0..=3 => Item::Pipeline {
                    edits: rng.random_range(3..=10),
                },
                4..=5 => Item::Generate {
                    count: rng.random_range(1..=2),
                },
                6..=8 => {
                    uploads += 1;
                    Item::EditBurst {
                        upload: uploads - 1,
                        edits: rng.random_range(3..=8),
                    }
                }
                _ if earlier > 0 => Item::EditOf {
                    item: rng.random_range(0..earlier),
                },
                _ => Item::Generate { count: 1 },
            }
        };
        for _ in 0..config.backlog_items {
            let item = pick(&mut rng, items.len());
            items.push(Timed {
                at: Duration::ZERO,
                interactive: false,
                item,
                shape: shape(),
            });
        }
        for n in 0..config.interactive_items {
            let at = config.arrival_seconds * (n as f64 + rng.random::<f64>())
                / config.interactive_items.max(1) as f64;
            let item = pick(&mut rng, items.len());
            items.push(Timed {
                at: Duration::from_secs_f64(at),
                interactive: true,
                item,
                shape: shape(),
            });
        }
        Self { items, uploads }
    }

    /// Jobs the workload makes (a pipeline counts its base and edits).
    pub fn jobs(&self) -> usize {
        self.items
            .iter()
            .map(|t| match t.item {
                Item::Pipeline { edits } => 1 + edits,
                Item::Generate { .. } | Item::EditOf { .. } => 1,
                Item::EditBurst { edits, .. } => edits,
            })
            .sum()
    }
}

pub(super) fn generate(n: usize, count: u32, shape: Shape) -> Value {
    json!({"kind": "generate", "prompt": format!("fleet generate {n}"), "width": shape.side,
        "height": shape.side, "steps": shape.steps, "count": count})
}

pub(super) fn edit(input: Value, what: &str, shape: Shape) -> Value {
    json!({"kind": "edit", "input": input, "instruction": what, "width": shape.side,
        "height": shape.side, "steps": shape.edit_steps})
}

/// What one item made: the top-level jobs to wait for, and the job of its first image.
#[derive(Clone, Debug)]
pub struct Submitted {
    pub top: Vec<JobId>,
    pub first_image: JobId,
}

/// Submits every item at its time.
pub async fn submit(farm: &Farm, workload: &Workload) -> anyhow::Result<Vec<Submitted>> {
    for n in 0..workload.uploads {
        let png = crate::png_bytes(SIDE, SIDE, n as u8);
        farm.storage
            .put(&upload_key(n), Bytes::from(png), "image/png")
            .await?;
    }
    let started = Instant::now();
    let mut made: Vec<Submitted> = Vec::with_capacity(workload.items.len());
    for (n, timed) in workload.items.iter().enumerate() {
        if let Some(wait) = timed.at.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let priority = if timed.interactive {
            "interactive"
        } else {
            "batch"
        };
        let post = |job: Value| {
            let body = json!({"schema_version": 1, "priority": priority, "job": job});
            async move {
                match farm.submit(&body).await? {
                    (_, Ok(answer)) => Ok(answer.job_id),
                    (status, Err(refused)) => bail!("submission refused ({status}): {refused:?}"),
                }
            }
        };
        let shape = timed.shape;
        let item = match &timed.item {
            Item::Pipeline { edits } => {
                let edits: Vec<Value> = (0..*edits)
                    .map(|e| json!({"instruction": format!("variant {e}"), "steps": shape.edit_steps}))
                    .collect();
                let job = json!({"kind": "pipeline", "base": {"prompt": format!("fleet pipeline {n}"),
                    "width": shape.side, "height": shape.side, "steps": shape.steps}, "edits": edits});
                let id = post(job).await?;
                let base = *farm
                    .job(id)
                    .await?
                    .children
                    .first()
                    .ok_or_else(|| anyhow::anyhow!("pipeline {id} lists no jobs"))?;
                Submitted {
                    top: vec![id],
                    first_image: base,
                }
            }
            Item::Generate { count } => {
                let id = post(generate(n, *count, shape)).await?;
                Submitted {
                    top: vec![id],
                    first_image: id,
                }
            }
            Item::EditBurst { upload, edits } => {
                let mut burst = Vec::new();
                for e in 0..*edits {
                    if e > 0 {
                        tokio::time::sleep(BURST_SPACING).await;
                    }
                    let input = json!({"stored": upload_key(*upload)});
                    burst.push(post(edit(input, &format!("burst {n} variant {e}"), shape)).await?);
                }
                Submitted {
                    first_image: burst[0],
                    top: burst,
                }
            }
            Item::EditOf { item } => {
                let of = made[*item].first_image;
                let input = json!({"job_output": {"job": of, "index": 0}});
                let id = post(edit(input, &format!("edit {n} of item {item}"), shape)).await?;
                Submitted {
                    top: vec![id],
                    first_image: id,
                }
            }
        };
        made.push(item);
    }
    Ok(made)
}

pub(super) fn upload_key(n: usize) -> String {
    format!("inputs/fleet-upload-{n}.png")
}
