//! Noise schedulers matching diffusers: the shared training schedule (betas, ᾱ, σ), timestep
//! spacing, and the [`Scheduler`] enum over the samplers the farm offers.
//!
//! After diffusers `schedulers/scheduling_euler_discrete.py`,
//! `scheduling_euler_ancestral_discrete.py` and `scheduling_dpmsolver_multistep.py` (Apache-2.0).
//! Betas and ᾱ are computed with torch in fp32 as diffusers does; sigma schedules are computed in
//! f64 from those fp32 values and rounded to fp32, like numpy does there.

mod dpm_solver;
mod euler;
mod euler_ancestral;
mod flow_match;

pub use dpm_solver::DpmSolverMultistep;
pub use euler::EulerDiscrete;
pub use euler_ancestral::EulerAncestralDiscrete;
pub use flow_match::{FlowMatchConfig, FlowMatchEulerDiscrete, TimeShiftType, pipeline_sigmas};

use tch::{Device, Kind, Tensor};

/// What the noise predictor outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictionType {
    #[default]
    Epsilon,
    VPrediction,
}

/// How inference timesteps are spread over the training range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimestepSpacing {
    Linspace,
    Leading,
    Trailing,
}

/// The beta schedule of training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BetaSchedule {
    Linear,
    ScaledLinear,
}

/// `scheduler_config.json` fields shared by the samplers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    pub num_train_timesteps: i64,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: BetaSchedule,
    pub prediction_type: PredictionType,
    pub timestep_spacing: TimestepSpacing,
    pub steps_offset: i64,
}

impl SchedulerConfig {
    /// SDXL base 1.0 `scheduler/scheduler_config.json` (EulerDiscreteScheduler; models.md §3).
    pub fn sdxl() -> Self {
        Self {
            num_train_timesteps: 1000,
            beta_start: 0.00085,
            beta_end: 0.012,
            beta_schedule: BetaSchedule::ScaledLinear,
            prediction_type: PredictionType::Epsilon,
            timestep_spacing: TimestepSpacing::Leading,
            steps_offset: 1,
        }
    }

    /// Parses a diffusers `scheduler_config.json`, defaulting absent fields to [`Self::sdxl`].
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::sdxl();
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        Ok(Self {
            num_train_timesteps: v
                .get("num_train_timesteps")
                .and_then(|x| x.as_i64())
                .unwrap_or(d.num_train_timesteps),
            beta_start: v
                .get("beta_start")
                .and_then(|x| x.as_f64())
                .unwrap_or(d.beta_start),
            beta_end: v
                .get("beta_end")
                .and_then(|x| x.as_f64())
                .unwrap_or(d.beta_end),
            beta_schedule: match s("beta_schedule").as_deref() {
                None | Some("scaled_linear") => BetaSchedule::ScaledLinear,
                Some("linear") => BetaSchedule::Linear,
                Some(o) => return Err(format!("unsupported beta_schedule {o}")),
            },
            prediction_type: match s("prediction_type").as_deref() {
                None | Some("epsilon") => PredictionType::Epsilon,
                Some("v_prediction") => PredictionType::VPrediction,
                Some(o) => return Err(format!("unsupported prediction_type {o}")),
            },
            timestep_spacing: match s("timestep_spacing").as_deref() {
                None | Some("leading") => TimestepSpacing::Leading,
                Some("linspace") => TimestepSpacing::Linspace,
                Some("trailing") => TimestepSpacing::Trailing,
                Some(o) => return Err(format!("unsupported timestep_spacing {o}")),
            },
            steps_offset: v
                .get("steps_offset")
                .and_then(|x| x.as_i64())
                .unwrap_or(d.steps_offset),
        })
    }

    /// ᾱ of training as fp32 values: `cumprod(1 - β)` with β from torch in fp32.
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        let n = self.num_train_timesteps;
        let opts = (Kind::Float, Device::Cpu);
        let betas = match self.beta_schedule {
            BetaSchedule::Linear => Tensor::linspace(self.beta_start, self.beta_end, n, opts),
            BetaSchedule::ScaledLinear => {
                Tensor::linspace(self.beta_start.sqrt(), self.beta_end.sqrt(), n, opts)
                    .pow_tensor_scalar(2)
            }
        };
        let ac = (1.0f64 - betas).cumprod(0, Kind::Float);
        Vec::<f32>::try_from(&ac).expect("a 1-D fp32 CPU tensor converts to Vec<f32>")
    }

    /// `σ_t = sqrt((1 - ᾱ_t) / ᾱ_t)` in fp32, ascending in t.
    pub fn train_sigmas(&self) -> Vec<f32> {
        self.alphas_cumprod()
            .iter()
            .map(|&a| ((1.0 - a) / a).sqrt())
            .collect()
    }

    /// Euler-family timesteps for `n` steps, by `timestep_spacing` (descending).
    pub fn spaced_timesteps(&self, n: usize) -> Vec<f64> {
        let train = self.num_train_timesteps as f64;
        let n_f = n as f64;
        match self.timestep_spacing {
            TimestepSpacing::Linspace => (0..n)
                .rev()
                .map(|i| {
                    let v = if n == 1 {
                        0.0
                    } else {
                        (train - 1.0) * i as f64 / (n_f - 1.0)
                    };
                    f64::from(v as f32)
                })
                .collect(),
            TimestepSpacing::Leading => {
                let ratio = (self.num_train_timesteps / n as i64) as f64;
                (0..n)
                    .rev()
                    .map(|i| (i as f64 * ratio).round() + self.steps_offset as f64)
                    .collect()
            }
            TimestepSpacing::Trailing => {
                let ratio = train / n_f;
                let mut v = Vec::new();
                let mut t = train;
                while t > 0.0 {
                    v.push(t.round() - 1.0);
                    t -= ratio;
                }
                v
            }
        }
    }
}

/// `np.interp(x, arange(len(ys)), ys)`.
pub(crate) fn interp(x: f64, ys: &[f32]) -> f64 {
    if x <= 0.0 {
        return f64::from(ys[0]);
    }
    let last = ys.len() - 1;
    if x >= last as f64 {
        return f64::from(ys[last]);
    }
    let i = x.floor() as usize;
    let frac = x - i as f64;
    f64::from(ys[i]) + (f64::from(ys[i + 1]) - f64::from(ys[i])) * frac
}

/// The samplers a request can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// `EulerDiscreteScheduler` (SDXL's default).
    Euler,
    /// `EulerAncestralDiscreteScheduler` ("Euler a").
    EulerAncestral,
    /// `DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
    /// use_karras_sigmas=True)` ("DPM++ 2M Karras").
    DpmPp2mKarras,
}

/// A scheduler prepared for one generation.
#[derive(Debug)]
pub enum Scheduler {
    Euler(EulerDiscrete),
    EulerAncestral(EulerAncestralDiscrete),
    DpmPp2mKarras(DpmSolverMultistep),
}

impl Scheduler {
    pub fn new(sampler: Sampler, config: &SchedulerConfig, steps: usize) -> Self {
        match sampler {
            Sampler::Euler => Self::Euler(EulerDiscrete::new(config, steps)),
            Sampler::EulerAncestral => {
                Self::EulerAncestral(EulerAncestralDiscrete::new(config, steps))
            }
            Sampler::DpmPp2mKarras => Self::DpmPp2mKarras(DpmSolverMultistep::new(config, steps)),
        }
    }

    /// The timesteps handed to the UNet, one per step.
    pub fn timesteps(&self) -> &[f64] {
        match self {
            Self::Euler(s) => &s.timesteps,
            Self::EulerAncestral(s) => &s.euler.timesteps,
            Self::DpmPp2mKarras(s) => &s.timesteps,
        }
    }

    /// σ per step plus the final one.
    pub fn sigmas(&self) -> &[f64] {
        match self {
            Self::Euler(s) => &s.sigmas,
            Self::EulerAncestral(s) => &s.euler.sigmas,
            Self::DpmPp2mKarras(s) => &s.sigmas,
        }
    }

    /// Standard deviation of the initial noise.
    pub fn init_noise_sigma(&self) -> f64 {
        match self {
            Self::Euler(s) => s.init_noise_sigma(),
            Self::EulerAncestral(s) => s.euler.init_noise_sigma(),
            Self::DpmPp2mKarras(_) => 1.0,
        }
    }

    /// How many times [`Scheduler::step`] draws noise over a whole generation: once per step for
    /// ancestral sampling (diffusers draws even on the last step), never for the others.
    pub fn noise_draws(&self) -> usize {
        match self {
            Self::EulerAncestral(s) => s.euler.timesteps.len(),
            Self::Euler(_) | Self::DpmPp2mKarras(_) => 0,
        }
    }

    /// The UNet input for step `i`.
    pub fn scale_model_input(&self, sample: &Tensor, i: usize) -> Tensor {
        match self {
            Self::Euler(s) => s.scale_model_input(sample, i),
            Self::EulerAncestral(s) => s.euler.scale_model_input(sample, i),
            Self::DpmPp2mKarras(_) => sample.shallow_clone(),
        }
    }

    /// One denoising step `i` from `sample` given the UNet output. `noise` draws `N(0, 1)` of the
    /// given shape (used by ancestral sampling only).
    pub fn step(
        &mut self,
        model_output: &Tensor,
        i: usize,
        sample: &Tensor,
        noise: &mut dyn FnMut(&[i64]) -> Tensor,
    ) -> Tensor {
        match self {
            Self::Euler(s) => s.step(model_output, i, sample),
            Self::EulerAncestral(s) => s.step(model_output, i, sample, noise),
            Self::DpmPp2mKarras(s) => s.step(model_output, i, sample),
        }
    }
}

/// `x0` from the model output for Euler-family samplers (`sigma` of the current step).
pub(crate) fn euler_x0(
    pred: PredictionType,
    model_output: &Tensor,
    sample: &Tensor,
    sigma: f64,
) -> Tensor {
    match pred {
        PredictionType::Epsilon => sample - model_output * sigma,
        PredictionType::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            model_output * (-sigma / s2.sqrt()) + sample / s2
        }
    }
}
