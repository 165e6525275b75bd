//! `FlowMatchEulerDiscreteScheduler` as the Qwen-Image pipelines drive it: a rectified-flow Euler
//! sampler whose σ schedule is resolution-shifted (`mu` from the target's token count) and
//! optionally stretched to a terminal σ; `step` is `x + (σ_next − σ) · v`.
//!
//! After diffusers 0.42.1 `schedulers/scheduling_flow_match_euler_discrete.py` and the
//! `calculate_shift` / custom-σ code of `pipelines/qwenimage/pipeline_qwenimage_edit_plus.py`
//! (Copyright The HuggingFace Team, Apache-2.0).
//!
//! Numerics follow diffusers operation by operation: the pipeline's σ are `np.linspace` in f64,
//! cast to f32 by `set_timesteps`; the shift and the terminal stretch then run in numpy f32 (numpy 2
//! treats Python floats as weak scalars, so `exp(mu)` and `1 - shift_terminal` are rounded to f32
//! first); timesteps are `σ · num_train_timesteps` in f32. Every value below is therefore an f32
//! widened to f64. The step runs in fp32 like diffusers' (`sample.to(float32) + dt · v`).
//!
//! Supported: dynamic (exponential / linear) or static shifting, `shift_terminal`,
//! `invert_sigmas`. Rejected with an error: Karras / exponential / beta σ and stochastic sampling
//! (no Qwen configuration uses them).

use tch::{Kind, Tensor};

/// How `mu` bends the σ schedule when `use_dynamic_shifting` is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeShiftType {
    /// `σ' = e^μ / (e^μ + (1/σ − 1))`.
    Exponential,
    /// `σ' = μ / (μ + (1/σ − 1))`.
    Linear,
}

/// The fields of a `FlowMatchEulerDiscreteScheduler` `scheduler_config.json` this port implements.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowMatchConfig {
    pub num_train_timesteps: i64,
    /// Static shift `s` (`σ' = sσ / (1 + (s − 1)σ)`), used when dynamic shifting is off.
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub base_shift: f64,
    pub max_shift: f64,
    pub base_image_seq_len: i64,
    pub max_image_seq_len: i64,
    pub time_shift_type: TimeShiftType,
    /// Stretch the shifted schedule so that its last σ equals this value.
    pub shift_terminal: Option<f64>,
    pub invert_sigmas: bool,
}

impl Default for FlowMatchConfig {
    /// The constructor defaults of diffusers' `FlowMatchEulerDiscreteScheduler.__init__`.
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            time_shift_type: TimeShiftType::Exponential,
            shift_terminal: None,
            invert_sigmas: false,
        }
    }
}

impl FlowMatchConfig {
    /// `Qwen/Qwen-Image-Edit` `scheduler/scheduler_config.json` (models.md §3.4, read from a
    /// mirror of the repository: https://adg.csdn.net/695257405b9f5f31781b9cd0.html; the 2509
    /// repository ships the same scheduler, which is also what the fixtures' `common.py` uses).
    pub fn qwen_image() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: true,
            base_shift: 0.5,
            max_shift: 0.9,
            base_image_seq_len: 256,
            max_image_seq_len: 8192,
            time_shift_type: TimeShiftType::Exponential,
            shift_terminal: Some(0.02),
            invert_sigmas: false,
        }
    }

    /// Qwen-Image-Lightning's scheduler (ModelTC/Qwen-Image-Lightning `generate_with_diffusers.py`
    /// and diffusers `docs/source/en/api/pipelines/qwenimage.md`; models.md §0.5, §3.4):
    /// `base_shift = max_shift = ln 3`, so μ = ln 3 at every resolution (a constant shift of 3),
    /// no terminal stretch.
    pub fn qwen_image_lightning() -> Self {
        Self {
            base_shift: 3f64.ln(),
            max_shift: 3f64.ln(),
            shift_terminal: None,
            ..Self::qwen_image()
        }
    }

    /// Parses a diffusers `scheduler_config.json`; absent fields take diffusers' constructor
    /// defaults. Options this port does not implement are errors naming the field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::default();
        let f = |k: &str, default: f64| -> Result<f64, String> {
            match v.get(k) {
                None => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| format!("`{k}` must be a number, got {x}")),
            }
        };
        let i = |k: &str, default: i64| -> Result<i64, String> {
            match v.get(k) {
                None => Ok(default),
                Some(x) => x
                    .as_i64()
                    .ok_or_else(|| format!("`{k}` must be an integer, got {x}")),
            }
        };
        let b = |k: &str| -> Result<bool, String> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(false),
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| format!("`{k}` must be a bool, got {x}")),
            }
        };
        for unsupported in [
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "stochastic_sampling",
        ] {
            if b(unsupported)? {
                return Err(format!(
                    "`{unsupported}: true` is not supported by this FlowMatchEulerDiscrete port"
                ));
            }
        }
        let time_shift_type = match v.get("time_shift_type").and_then(|x| x.as_str()) {
            None | Some("exponential") => TimeShiftType::Exponential,
            Some("linear") => TimeShiftType::Linear,
            Some(o) => {
                return Err(format!(
                    "`time_shift_type` must be exponential or linear, got {o}"
                ));
            }
        };
        let shift_terminal = match v.get("shift_terminal") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => Some(
                x.as_f64()
                    .ok_or_else(|| format!("`shift_terminal` must be a number, got {x}"))?,
            ),
        };
        let config = Self {
            num_train_timesteps: i("num_train_timesteps", d.num_train_timesteps)?,
            shift: f("shift", d.shift)?,
            use_dynamic_shifting: b("use_dynamic_shifting")?,
            // diffusers allows `null` here (then dynamic shifting cannot be used).
            base_shift: f("base_shift", d.base_shift)?,
            max_shift: f("max_shift", d.max_shift)?,
            base_image_seq_len: i("base_image_seq_len", d.base_image_seq_len)?,
            max_image_seq_len: i("max_image_seq_len", d.max_image_seq_len)?,
            time_shift_type,
            // diffusers tests `if self.config.shift_terminal:`, so 0 means "off" too.
            shift_terminal: shift_terminal.filter(|&t| t != 0.0),
            invert_sigmas: b("invert_sigmas")?,
        };
        if config.num_train_timesteps <= 0 {
            return Err("`num_train_timesteps` must be positive".into());
        }
        if config.max_image_seq_len == config.base_image_seq_len && config.use_dynamic_shifting {
            return Err("`max_image_seq_len` must differ from `base_image_seq_len`".into());
        }
        Ok(config)
    }

    /// μ for a target of `image_seq_len` packed latent tokens: the pipelines' `calculate_shift`,
    /// a line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift),
    /// computed in f64 like Python.
    pub fn calculate_shift(&self, image_seq_len: i64) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len - self.base_image_seq_len) as f64;
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }
}

/// A flow-matching Euler schedule prepared for one generation.
#[derive(Debug, Clone)]
pub struct FlowMatchEulerDiscrete {
    config: FlowMatchConfig,
    /// One per step, `σ · num_train_timesteps` (f32 values), what diffusers' loop iterates over.
    pub timesteps: Vec<f64>,
    /// One per step plus the final one (0, or 1 with `invert_sigmas`); f32 values.
    pub sigmas: Vec<f64>,
}

impl FlowMatchEulerDiscrete {
    /// `set_timesteps(num_inference_steps, sigmas=np.linspace(1, 1/N, N), mu=mu)` as the Qwen-Image
    /// pipelines call it. `mu` is required with dynamic shifting (see
    /// [`FlowMatchConfig::calculate_shift`]) and ignored otherwise.
    pub fn new(
        config: &FlowMatchConfig,
        num_inference_steps: usize,
        mu: Option<f64>,
    ) -> Result<Self, String> {
        if num_inference_steps == 0 {
            return Err("num_inference_steps must be at least 1".into());
        }
        Self::with_sigmas(config, &pipeline_sigmas(num_inference_steps), mu)
    }

    /// `set_timesteps(sigmas=sigmas, mu=mu)` with custom σ (f64 values as numpy passes them).
    pub fn with_sigmas(
        config: &FlowMatchConfig,
        sigmas: &[f64],
        mu: Option<f64>,
    ) -> Result<Self, String> {
        if sigmas.is_empty() {
            return Err("at least one sigma is needed".into());
        }
        // `np.array(sigmas).astype(np.float32)`.
        let mut s: Vec<f32> = sigmas.iter().map(|&x| x as f32).collect();
        if config.use_dynamic_shifting {
            let mu = mu.ok_or("`mu` must be given when use_dynamic_shifting is on")?;
            // `time_shift(mu, 1.0, σ)`; `(1/σ − 1) ** 1.0` is exact, and the Python float
            // (`exp(mu)` or `mu`) is rounded to f32 before the f32 array ops.
            let a = match config.time_shift_type {
                TimeShiftType::Exponential => mu.exp() as f32,
                TimeShiftType::Linear => mu as f32,
            };
            for x in &mut s {
                *x = a / (a + (1.0f32 / *x - 1.0f32));
            }
        } else {
            let shift = config.shift as f32;
            let shift_m1 = (config.shift - 1.0) as f32;
            for x in &mut s {
                *x = shift * *x / (1.0f32 + shift_m1 * *x);
            }
        }
        if let Some(terminal) = config.shift_terminal {
            // `stretch_shift_to_terminal`.
            let last = *s.last().expect("sigmas is not empty (checked above)");
            let scale = (1.0f32 - last) / (1.0 - terminal) as f32;
            for x in &mut s {
                *x = 1.0f32 - (1.0f32 - *x) / scale;
            }
        }
        let train = config.num_train_timesteps as f32;
        let (sigmas, last) = if config.invert_sigmas {
            (s.iter().map(|&x| 1.0f32 - x).collect::<Vec<f32>>(), 1.0f32)
        } else {
            (s, 0.0f32)
        };
        if let Some(bad) = sigmas.iter().find(|x| !x.is_finite()) {
            // diffusers computes NaN here, e.g. one step with `shift_terminal` (0/0 stretch).
            return Err(format!(
                "the schedule for {} step(s) is degenerate (σ = {bad}); use more steps",
                sigmas.len()
            ));
        }
        let timesteps = sigmas.iter().map(|&x| f64::from(x * train)).collect();
        let sigmas = sigmas
            .iter()
            .chain(std::iter::once(&last))
            .map(|&x| f64::from(x))
            .collect();
        Ok(Self {
            config: config.clone(),
            timesteps,
            sigmas,
        })
    }

    pub fn config(&self) -> &FlowMatchConfig {
        &self.config
    }

    pub fn num_steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The timestep handed to the Qwen transformer at step `i`: the pipelines pass
    /// `timestep / 1000` (an fp32 division, correctly rounded as on the CPU; CUDA multiplies by
    /// the reciprocal instead, which can differ by one ulp). The transformer scales it back by
    /// 1000 inside its timestep embedding.
    pub fn model_timestep(&self, i: usize) -> f64 {
        f64::from(self.timesteps[i] as f32 / 1000.0f32)
    }

    /// One Euler step `i`: `sample + (σ_{i+1} − σ_i) · model_output`, as diffusers computes it:
    /// the sample upcast to fp32, `dt` a 0-d fp32 tensor multiplied with the model output (torch
    /// type promotion rounds `dt` to a bf16/fp16 output's dtype and multiplies in that dtype), the
    /// sum in fp32. The result is in the sample's dtype; diffusers casts to the model output's
    /// dtype instead, and the Qwen pipelines then cast back to the latents' dtype, so the result is
    /// the same.
    ///
    /// Panics if `i >= num_steps()` (a caller bug, not input).
    pub fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Tensor {
        assert!(
            i < self.num_steps(),
            "step {i} of a {}-step schedule",
            self.num_steps()
        );
        let dt = Tensor::from(self.sigmas[i + 1] as f32 - self.sigmas[i] as f32)
            .to_device(model_output.device());
        let kind = sample.kind();
        // `dt * v` in this order: with the 0-d tensor first, torch casts it to a bf16/fp16 output's
        // dtype; second, its CPU kernel would multiply by the unrounded fp32 value instead.
        (sample.to_kind(Kind::Float) + dt * model_output).to_kind(kind)
    }
}

/// The σ the Qwen pipelines pass: `np.linspace(1.0, 1 / N, N)` in f64.
pub fn pipeline_sigmas(n: usize) -> Vec<f64> {
    linspace(1.0, 1.0 / n as f64, n)
}

/// `np.linspace(start, stop, num)` (endpoint included) in f64, with numpy's arithmetic:
/// `start + arange(num) * step`, the last value set to `stop` exactly.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    match num {
        0 => Vec::new(),
        1 => vec![start],
        _ => {
            let div = (num - 1) as f64;
            let step = (stop - start) / div;
            let mut v: Vec<f64> = (0..num).map(|i| start + i as f64 * step).collect();
            v[num - 1] = stop;
            v
        }
    }
}
