//! The command line's grammar (clap derive): every command, flag and default, and nothing else.
//!
//! Defaults for job parameters equal the ones `vnfarm_proto::spec` applies when a field is omitted, so
//! a submission built from flags means what the same JSON without those fields would mean.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use vnfarm_proto::{JobId, LoraRef, ModelFileRole, PipelineImage, Priority, Role, Sampler};

use crate::values::{InputArg, parse_input, parse_lora, parse_pipeline_image, parse_scale};

#[derive(Debug, Parser)]
#[command(
    name = "vnfarm",
    version,
    about = "Submit, watch and fetch render-farm jobs"
)]
pub struct Cli {
    /// Base URL of the scheduler's HTTP API.
    #[arg(
        long,
        global = true,
        env = "VNFARM_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub url: String,
    /// API token, sent as `Authorization: Bearer <token>`.
    #[arg(long, global = true, env = "VNFARM_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit a job, print its id and (unless --no-watch) watch it.
    #[command(subcommand)]
    Submit(Box<SubmitCommand>),
    /// Follow a job until it finishes; exit 0 when it completed, 1 when it failed or was cancelled.
    Watch { job_id: JobId },
    /// List jobs, newest first.
    List(ListArgs),
    /// Print a job as pretty JSON.
    Show { job_id: JobId },
    /// Cancel a job (or a pipeline's unfinished jobs).
    Cancel { job_id: JobId },
    /// Download a job's output images (a pipeline's: each job's into DIR/<job-id>/).
    Fetch {
        job_id: JobId,
        /// Directory to write the PNG files into.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// List the workers the scheduler knows and their last heartbeat.
    Workers,
    /// The queue: whether the farm is paused, and each person's waiting and running jobs, GPU time
    /// today, limits and why their work waits.
    Queue,
    /// Pause the farm (admins), or one person's work with --person (leads): nothing more of it is
    /// dispatched; running jobs finish.
    Pause {
        #[arg(long)]
        person: Option<String>,
    },
    /// Resume the farm, or one person's work with --person.
    Resume {
        #[arg(long)]
        person: Option<String>,
    },
    /// Move a waiting job (or a pipeline's waiting jobs) to the front of the queue (leads).
    Front { job_id: JobId },
    /// People's API tokens (an admin's token, or none on a loopback scheduler without one).
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// The model catalogue in the bucket: files jobs name by catalogue name or sha256:<hex>.
    Models {
        /// A TOML file with the store's `[storage]` table (a worker's configuration file will do).
        #[arg(long, env = "VNFARM_STORAGE_CONFIG")]
        storage: PathBuf,
        #[command(subcommand)]
        command: ModelsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Give a person a token and print it (it is shown this once; the farm keeps its hash).
    Create {
        name: String,
        /// artist (submit; see and cancel their own jobs), lead (everyone's jobs), admin (tokens).
        #[arg(long, value_parser = parse_role)]
        role: Role,
    },
    /// List everyone who has had a token (never the tokens).
    List,
    /// Revoke a person's token: every scheduler refuses it from now on.
    Revoke { name: String },
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("{s:?} is not a role: artist, lead or admin"))
}

#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// Upload a safetensors file (once, under its sha256) and name it in the catalogue.
    Push {
        file: PathBuf,
        /// What the file is: lora, checkpoint, component, transformer, text_encoder, vae, upscaler.
        #[arg(long, value_parser = str::parse::<ModelFileRole>)]
        role: ModelFileRole,
        /// The catalogue name (default: the file name without `.safetensors`).
        #[arg(long)]
        name: Option<String>,
    },
    /// List the catalogue's names.
    List,
}

#[derive(Debug, Subcommand)]
pub enum SubmitCommand {
    /// SDXL text-to-image.
    Generate {
        #[command(flatten)]
        base: BaseArgs,
        /// Images to make; image n uses seed + n.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// A LoRA, as name[:weight] (weight 1 when omitted): a file of the worker's LoRA folder,
        /// else the model catalogue's name, or sha256:<hex>[:weight]; repeatable.
        #[arg(long = "lora", value_parser = parse_lora)]
        loras: Vec<LoraRef>,
        #[command(flatten)]
        options: SubmitOptions,
    },
    /// Instruction edit of one image.
    Edit {
        #[command(flatten)]
        edit: EditArgs,
        #[command(flatten)]
        options: SubmitOptions,
    },
    /// Real-ESRGAN upscale of one image.
    Upscale {
        #[command(flatten)]
        upscale: UpscaleArgs,
        #[command(flatten)]
        options: SubmitOptions,
    },
    /// A generate, edits of its image, and upscales of any of those.
    Pipeline {
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        options: SubmitOptions,
    },
    /// A complete Submission as JSON.
    File {
        /// Path of the JSON file; `-` reads standard input.
        path: PathBuf,
        #[command(flatten)]
        options: SubmitOptions,
    },
}

/// Envelope flags every `submit` takes.
#[derive(Debug, Args)]
pub struct SubmitOptions {
    /// Scheduling class (default batch; for `submit file`, the file's own value).
    #[arg(long, value_enum)]
    pub priority: Option<PriorityArg>,
    /// Same key, same job: a resubmission returns the job the first one created.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Print the job id and return without watching.
    #[arg(long)]
    pub no_watch: bool,
}

/// The parameters of an SDXL generate, shared by `generate` and a pipeline's base.
#[derive(Debug, Args)]
pub struct BaseArgs {
    /// Prompt; A1111-style weights `(word:1.2)` and `BREAK` are understood.
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value = "")]
    pub negative: String,
    #[arg(long, default_value_t = 1024)]
    pub width: u32,
    #[arg(long, default_value_t = 1024)]
    pub height: u32,
    #[arg(long, default_value_t = 20)]
    pub steps: u32,
    #[arg(long, default_value_t = 4.5)]
    pub cfg: f32,
    #[arg(long, value_enum, default_value_t = SamplerArg::Euler)]
    pub sampler: SamplerArg,
    /// Omitted: the scheduler picks one and records it.
    #[arg(long)]
    pub seed: Option<u64>,
    /// SDXL checkpoint by name (`vnfarm workers` lists what the fleet holds). Omitted: the fleet's
    /// default.
    #[arg(long)]
    pub checkpoint: Option<String>,
}

#[derive(Debug, Args)]
pub struct EditArgs {
    /// Input image: a stored key (inputs/... or results/...), @file.png, or job:<uuid>[:index].
    /// Repeat for up to three images, in the order the instruction calls them "picture 1", "picture 2", ….
    #[arg(long = "input", value_parser = parse_input, required = true)]
    pub inputs: Vec<InputArg>,
    /// Output width and height (multiples of 16, both or neither). Unset: about one megapixel at the
    /// last input's aspect ratio.
    #[arg(long, requires = "height")]
    pub width: Option<u32>,
    #[arg(long, requires = "width")]
    pub height: Option<u32>,
    /// What to change, in words.
    #[arg(long)]
    pub instruction: String,
    #[arg(long, default_value_t = 4)]
    pub steps: u32,
    #[arg(long, default_value_t = 1.0)]
    pub cfg: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A LoRA to fuse, as name[:weight] (weight 1 when omitted); repeatable.
    #[arg(long = "lora", value_parser = parse_lora)]
    pub loras: Vec<LoraRef>,
}

#[derive(Debug, Args)]
pub struct UpscaleArgs {
    /// Input image: a stored key (inputs/... or results/...), @file.png, or job:<uuid>[:index].
    #[arg(long, value_parser = parse_input)]
    pub input: InputArg,
    #[command(flatten)]
    pub params: UpscaleParams,
}

/// Upscale parameters, shared by `upscale` and every upscale of a pipeline.
#[derive(Debug, Args)]
pub struct UpscaleParams {
    /// 2 or 4.
    #[arg(long, default_value_t = 2, value_parser = parse_scale)]
    pub scale: u32,
    /// Tile side in input pixels (64–2048); default: the worker's setting.
    #[arg(long)]
    pub tile: Option<u32>,
    /// Context around each tile in pixels (at most a quarter of the tile); default: the worker's.
    #[arg(long)]
    pub tile_overlap: Option<u32>,
}

#[derive(Debug, Args)]
pub struct PipelineArgs {
    #[command(flatten)]
    pub base: BaseArgs,
    /// An edit of the base image; repeatable, in order (the first is edit:0).
    #[arg(long = "edit")]
    pub edits: Vec<String>,
    /// Steps of every edit.
    #[arg(long, default_value_t = 4)]
    pub edit_steps: u32,
    /// Guidance of every edit.
    #[arg(long, default_value_t = 1.0)]
    pub edit_cfg: f32,
    /// A LoRA fused into every edit, as name[:weight]; repeatable.
    #[arg(long = "lora", value_parser = parse_lora)]
    pub loras: Vec<LoraRef>,
    /// A LoRA fused into the base generate (SDXL), as name[:weight]; repeatable.
    #[arg(long = "base-lora", value_parser = parse_lora)]
    pub base_loras: Vec<LoraRef>,
    /// An image to upscale: `base` or `edit:N`; repeatable.
    #[arg(long = "upscale", value_parser = parse_pipeline_image)]
    pub upscales: Vec<PipelineImage>,
    #[command(flatten)]
    pub upscale_params: UpscaleParams,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only jobs in this state (queued, dispatched, running, retrying, completed, failed, cancelled).
    #[arg(long)]
    pub state: Option<String>,
    /// Only jobs of this kind (generate, edit, upscale, pipeline).
    #[arg(long)]
    pub kind: Option<String>,
    /// At most this many (the scheduler caps it at 1000).
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Include the jobs a pipeline expanded into.
    #[arg(long)]
    pub all: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SamplerArg {
    #[value(name = "euler")]
    Euler,
    #[value(name = "euler_ancestral")]
    EulerAncestral,
    #[value(name = "dpmpp_two_m_karras")]
    DpmppTwoMKarras,
}

impl From<SamplerArg> for Sampler {
    fn from(s: SamplerArg) -> Self {
        match s {
            SamplerArg::Euler => Sampler::Euler,
            SamplerArg::EulerAncestral => Sampler::EulerAncestral,
            SamplerArg::DpmppTwoMKarras => Sampler::DpmppTwoMKarras,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PriorityArg {
    Interactive,
    Batch,
}

impl From<PriorityArg> for Priority {
    fn from(p: PriorityArg) -> Self {
        match p {
            PriorityArg::Interactive => Priority::Interactive,
            PriorityArg::Batch => Priority::Batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn grammar_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
