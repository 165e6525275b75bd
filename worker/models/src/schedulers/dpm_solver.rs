//! `DPMSolverMultistepScheduler` as "DPM++ 2M Karras": `algorithm_type="dpmsolver++"`,
//! `solver_order=2`, `solver_type="midpoint"`, `use_karras_sigmas=True`, `lower_order_final=True`,
//! `final_sigmas_type="zero"` (the last step is first order and lands on the x0 prediction).

use tch::{Kind, Tensor};

use super::{PredictionType, SchedulerConfig};

#[derive(Debug)]
pub struct DpmSolverMultistep {
    pub timesteps: Vec<f64>,
    pub sigmas: Vec<f64>,
    prediction: PredictionType,
    /// The previous step's x0 prediction (the multistep history of order 2).
    previous: Option<Tensor>,
}

/// diffusers `_sigma_to_t`: piecewise-linear interpolation of `log σ` over the fp32 training
/// log-sigmas.
fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let n = log_sigmas.len();
    let count = log_sigmas
        .iter()
        .filter(|&&l| log_sigma - f64::from(l) >= 0.0)
        .count();
    let low = count.saturating_sub(1).min(n - 2);
    let high = low + 1;
    let (lo, hi) = (f64::from(log_sigmas[low]), f64::from(log_sigmas[high]));
    let w = ((lo - log_sigma) / (lo - hi)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * high as f64
}

impl DpmSolverMultistep {
    pub fn new(config: &SchedulerConfig, steps: usize) -> Self {
        let train = config.train_sigmas();
        let log_sigmas: Vec<f32> = train.iter().map(|s| s.ln()).collect();
        let sigma_min = f64::from(train[0]);
        let sigma_max = f64::from(train[train.len() - 1]);
        let rho = 7.0;
        let (min_inv, max_inv) = (sigma_min.powf(1.0 / rho), sigma_max.powf(1.0 / rho));
        let karras: Vec<f64> = (0..steps)
            .map(|i| {
                let ramp = if steps == 1 {
                    0.0
                } else {
                    i as f64 / (steps - 1) as f64
                };
                (max_inv + ramp * (min_inv - max_inv)).powf(rho)
            })
            .collect();
        let timesteps = karras
            .iter()
            .map(|&s| sigma_to_t(s, &log_sigmas).round_ties_even())
            .collect();
        let mut sigmas: Vec<f64> = karras.iter().map(|&s| f64::from(s as f32)).collect();
        sigmas.push(0.0);
        Self {
            timesteps,
            sigmas,
            prediction: config.prediction_type,
            previous: None,
        }
    }

    /// `(α_t, σ_t)` of a VP model at noise level `sigma`: `α = 1/sqrt(σ²+1)`, `σ_t = σ α`.
    fn alpha_sigma(sigma: f64) -> (f64, f64) {
        let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
        (alpha, sigma * alpha)
    }

    pub fn step(&mut self, model_output: &Tensor, i: usize, sample: &Tensor) -> Tensor {
        let kind = model_output.kind();
        let n = self.timesteps.len();
        let (alpha_s0, sigma_s0) = Self::alpha_sigma(self.sigmas[i]);
        let x0 = match self.prediction {
            PredictionType::Epsilon => (sample - model_output * sigma_s0) / alpha_s0,
            PredictionType::VPrediction => sample * alpha_s0 - model_output * sigma_s0,
        };
        let sample = sample.to_kind(Kind::Float);
        let (alpha_t, sigma_t) = Self::alpha_sigma(self.sigmas[i + 1]);
        let lambda_t = alpha_t.ln() - sigma_t.ln();
        let lambda_s0 = alpha_s0.ln() - sigma_s0.ln();
        let h = lambda_t - lambda_s0;
        // lower_order_final with final_sigmas_type "zero": the last step is always first order.
        let first_order = i + 1 == n || self.previous.is_none();
        let out = if first_order {
            &sample * (sigma_t / sigma_s0) - &x0 * (alpha_t * ((-h).exp() - 1.0))
        } else {
            let m1 = self
                .previous
                .as_ref()
                .expect("second-order steps follow a recorded first step");
            let (alpha_s1, sigma_s1) = Self::alpha_sigma(self.sigmas[i - 1]);
            let lambda_s1 = alpha_s1.ln() - sigma_s1.ln();
            let r0 = (lambda_s0 - lambda_s1) / h;
            let d1 = (&x0 - m1) * (1.0 / r0);
            let c = alpha_t * ((-h).exp() - 1.0);
            &sample * (sigma_t / sigma_s0) - &x0 * c - d1 * (0.5 * c)
        };
        self.previous = Some(x0);
        out.to_kind(kind)
    }
}
