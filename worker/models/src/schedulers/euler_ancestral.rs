//! `EulerAncestralDiscreteScheduler`: Euler to σ_down plus fresh noise scaled by σ_up each step.

use tch::{Kind, Tensor};

use super::euler::EulerDiscrete;
use super::{SchedulerConfig, euler_x0};

/// Euler's σ schedule, model-input scaling and initial noise, with an ancestral step.
#[derive(Debug)]
pub struct EulerAncestralDiscrete {
    pub euler: EulerDiscrete,
}

impl EulerAncestralDiscrete {
    pub fn new(config: &SchedulerConfig, steps: usize) -> Self {
        Self {
            euler: EulerDiscrete::new(config, steps),
        }
    }

    pub fn step(
        &self,
        model_output: &Tensor,
        i: usize,
        sample: &Tensor,
        noise: &mut dyn FnMut(&[i64]) -> Tensor,
    ) -> Tensor {
        let kind = model_output.kind();
        let sample = sample.to_kind(Kind::Float);
        let sigmas = &self.euler.sigmas;
        let sigma = sigmas[i];
        let x0 = euler_x0(self.euler.prediction, model_output, &sample, sigma);
        let (from, to) = (sigma, sigmas[i + 1]);
        // fp32 like the 0-dim tensors diffusers computes these with.
        let sigma_up =
            f64::from(((to * to * (from * from - to * to) / (from * from)) as f32).sqrt());
        let sigma_down = f64::from(((to * to - sigma_up * sigma_up) as f32).sqrt());
        let derivative = (&sample - x0) / sigma;
        let prev = sample + derivative * (sigma_down - sigma);
        let n = noise(&model_output.size()).to_device(prev.device());
        (prev + n * sigma_up).to_kind(kind)
    }
}
