//! `EulerDiscreteScheduler` (s_churn = 0, linear interpolation of σ, final σ = 0).

use tch::{Kind, Tensor};

use super::{PredictionType, SchedulerConfig, TimestepSpacing, euler_x0, interp};

#[derive(Debug)]
pub struct EulerDiscrete {
    pub timesteps: Vec<f64>,
    pub sigmas: Vec<f64>,
    spacing: TimestepSpacing,
    pub(super) prediction: PredictionType,
}

impl EulerDiscrete {
    pub fn new(config: &SchedulerConfig, steps: usize) -> Self {
        let train = config.train_sigmas();
        let timesteps = config.spaced_timesteps(steps);
        let mut sigmas: Vec<f64> = timesteps
            .iter()
            .map(|&t| f64::from(interp(t, &train) as f32))
            .collect();
        sigmas.push(0.0);
        Self {
            timesteps,
            sigmas,
            spacing: config.timestep_spacing,
            prediction: config.prediction_type,
        }
    }

    /// `σ_max` for linspace/trailing spacing, `sqrt(σ_max² + 1)` for leading.
    pub fn init_noise_sigma(&self) -> f64 {
        let max = self.sigmas.iter().copied().fold(0.0, f64::max);
        match self.spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max,
            TimestepSpacing::Leading => f64::from(((max * max + 1.0) as f32).sqrt()),
        }
    }

    pub fn scale_model_input(&self, sample: &Tensor, i: usize) -> Tensor {
        let s = self.sigmas[i];
        sample / (s * s + 1.0).sqrt()
    }

    pub fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Tensor {
        let kind = model_output.kind();
        let sample = sample.to_kind(Kind::Float);
        let sigma = self.sigmas[i];
        let x0 = euler_x0(self.prediction, model_output, &sample, sigma);
        let derivative = (&sample - x0) / sigma;
        let dt = self.sigmas[i + 1] - sigma;
        (sample + derivative * dt).to_kind(kind)
    }
}
