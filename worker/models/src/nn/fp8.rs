//! fp8 GEMMs with per-row scales (CUDA only: `torch._scaled_mm`, cuBLASLt / CUTLASS on fp8 tensor
//! cores; a box without them, such as a Radeon 8060S, never enables them).
//!
//! A [`Fp8Linear`] holds a Linear's weight as e4m3fn with one fp32 scale per output channel, and
//! multiplies activations that come quantised per row ([`RowQuantized`]: one scale per token, so no
//! calibration is needed and one token's outlier does not coarsen the others). The activations are
//! quantised by the fused kernel that produces them (`qwen_image::kernels`: the modulated
//! LayerNorm before q/k/v and FF up, the GELU before FF down), so the quantisation costs no pass of
//! its own: quantising in a separate pass costs about as much as the fp8 GEMM saves
//! (docs/performance.md, "where the transformer step's time goes"). [`RowQuantized::of`] is that
//! quantisation in libtorch's operators, for inputs the kernels do not cover and for tests.
//!
//! The idea (static per-channel weight scales, per-token activation scales produced by the kernel
//! before the GEMM) is that of fp8 DiT serving stacks such as LightX2V's and SGLang's (Apache-2.0);
//! the code is ours.

use tch::{Kind, Tensor};

use crate::nn::Linear;

/// e4m3fn's largest finite value.
pub const E4M3_MAX: f64 = 448.0;

/// `_scaled_mm` wants both GEMM dimensions of the activation and the weight in multiples of 16.
const ALIGN: i64 = 16;

/// Activations `[…, K]` as e4m3fn values with one fp32 scale per row (`[…, 1]`): `x ≈ values ·
/// scale`, the row's largest magnitude quantised to ±448.
#[derive(Debug)]
pub struct RowQuantized {
    pub values: Tensor,
    pub scale: Tensor,
}

impl RowQuantized {
    /// `x` quantised per row in libtorch's operators (what the fused kernels compute in one pass,
    /// up to their rounding of the scaled values).
    pub fn of(x: &Tensor) -> Self {
        let x = x.to_kind(Kind::Float);
        let amax = x.abs().amax([-1], true);
        let scale = (&amax / E4M3_MAX).where_self(&amax.gt(0.0), &amax.ones_like());
        let values = (&x / &scale)
            .clamp(-E4M3_MAX, E4M3_MAX)
            .to_kind(Kind::Float8e4m3fn);
        Self { values, scale }
    }

    /// The values the quantised rows stand for, in `kind`.
    pub fn dequantize(&self, kind: Kind) -> Tensor {
        (self.values.to_kind(Kind::Float) * &self.scale).to_kind(kind)
    }

    /// Rows (all dims but the last, multiplied).
    fn rows(&self) -> i64 {
        let size = self.values.size();
        size[..size.len() - 1].iter().product()
    }
}

/// One or more Linears (concatenated over outputs, as a fused q/k/v projection) with e4m3fn
/// weights and per-output-channel scales, for [`Fp8Linear::forward`]. Holds the source weights it
/// was made from, so that a LoRA that replaces one of them since is noticed
/// ([`Fp8Linear::made_from`]) and their memory is not reused by another tensor meanwhile.
#[derive(Debug)]
pub struct Fp8Linear {
    /// `[N, K]` e4m3fn, row-major (what `_scaled_mm` takes transposed, as column-major `[K, N]`).
    weight: Tensor,
    /// `[1, N]` fp32.
    scale: Tensor,
    /// `[N]` bf16 (`_scaled_mm`'s bias is in the output's dtype).
    bias: Option<Tensor>,
    sources: Vec<Tensor>,
}

impl Fp8Linear {
    /// `parts` as one fp8 Linear over their concatenated outputs, on their device. Weights already
    /// in e4m3fn keep their bytes, each part's per-tensor scale (or 1) becoming its channels'
    /// scales; dense weights (and other fp8 kinds) are quantised per output channel
    /// (`amax / 448`). `None` where the parts disagree in input width or device, some have a bias
    /// and others not, or a width is not a multiple of 16.
    pub fn of(parts: &[&Linear]) -> Option<Self> {
        let first = parts.first()?;
        let k = first.weight.size()[1];
        let device = first.weight.device();
        let with_bias = first.bias.is_some();
        let ok = parts.iter().all(|l| {
            let s = l.weight.size();
            s.len() == 2
                && s[1] == k
                && s[0] % ALIGN == 0
                && l.weight.device() == device
                && l.bias.is_some() == with_bias
        });
        if !ok || k % ALIGN != 0 {
            return None;
        }
        let _guard = tch::no_grad_guard();
        let (weights, scales): (Vec<Tensor>, Vec<Tensor>) = parts
            .iter()
            .map(|l| {
                let n = l.weight.size()[0];
                if l.weight.kind() == Kind::Float8e4m3fn {
                    let scale = match &l.weight_scale {
                        Some(s) => s.to_kind(Kind::Float).reshape([-1]).expand([n], false),
                        None => Tensor::ones([n], (Kind::Float, device)),
                    };
                    (l.weight.shallow_clone(), scale.contiguous())
                } else {
                    let q = RowQuantized::of(&l.dense_weight(Kind::Float));
                    (q.values, q.scale.reshape([n]))
                }
            })
            .unzip();
        let bias = with_bias.then(|| {
            Tensor::cat(
                &parts
                    .iter()
                    .map(|l| {
                        l.bias
                            .as_ref()
                            .expect("checked above")
                            .to_kind(Kind::BFloat16)
                    })
                    .collect::<Vec<_>>(),
                0,
            )
        });
        Some(Self {
            weight: Tensor::cat(&weights, 0).contiguous(),
            scale: Tensor::cat(&scales, 0).view([1, -1]),
            bias,
            sources: parts.iter().map(|l| l.weight.shallow_clone()).collect(),
        })
    }

    /// Whether `device` multiplies fp8 (one 16×16×16 `_scaled_mm`): CUDA devices with fp8 tensor
    /// cores (compute capability 8.9 and up) do; others (older GPUs, a Radeon 8060S, the CPU)
    /// answer with the error libtorch gives.
    pub fn probe(device: tch::Device) -> Result<(), String> {
        if !device.is_cuda() {
            return Err(format!("fp8 GEMMs need a CUDA device, not {device:?}"));
        }
        let a = Tensor::zeros([16, 16], (Kind::Float, device)).to_kind(Kind::Float8e4m3fn);
        let one = Tensor::ones([], (Kind::Float, device));
        a.f_internal_scaled_mm(
            &a.tr(),
            &one,
            &one,
            None::<&Tensor>,
            None::<&Tensor>,
            Kind::BFloat16,
            false,
        )
        .map(|_| ())
        .map_err(|e| format!("this device has no fp8 GEMM: {e}"))
    }

    /// Whether this was made from `parts`' current weights (a LoRA fused or restored since
    /// replaces them).
    pub fn made_from(&self, parts: &[&Linear]) -> bool {
        parts.len() == self.sources.len()
            && parts
                .iter()
                .zip(&self.sources)
                .all(|(l, s)| l.weight.data_ptr() == s.data_ptr())
    }

    /// Whether [`forward`](Self::forward) takes `rows` rows (a multiple of 16).
    pub fn takes_rows(rows: i64) -> bool {
        rows > 0 && rows % ALIGN == 0
    }

    /// Output channels.
    pub fn out_features(&self) -> i64 {
        self.weight.size()[0]
    }

    /// `x · Wᵀ + b` in bf16, `[…, N]`, from rows quantised per row ([`takes_rows`](Self::takes_rows)
    /// rows, checked by the caller): one `_scaled_mm` with the row and channel scales applied in
    /// its epilogue and fast accumulation.
    pub fn forward(&self, x: &RowQuantized) -> Tensor {
        let size = x.values.size();
        let k = size[size.len() - 1];
        let rows = x.rows();
        debug_assert!(Self::takes_rows(rows), "{rows} rows for an fp8 GEMM");
        let out = x
            .values
            .reshape([rows, k])
            .f_internal_scaled_mm(
                &self.weight.tr(),
                &x.scale.reshape([rows, 1]),
                &self.scale,
                self.bias.as_ref(),
                None::<&Tensor>,
                Kind::BFloat16,
                true,
            )
            .unwrap_or_else(|e| panic!("fp8 GEMM [{rows}, {k}] × {:?}: {e}", self.weight.size()));
        let mut shape = size;
        *shape.last_mut().expect("a last dim") = self.out_features();
        out.view(shape.as_slice())
    }

    /// The same product in libtorch's dense operators, from the dequantised weight (any device:
    /// the reference of the tests, and what a CPU computes).
    pub fn forward_dense(&self, x: &Tensor) -> Tensor {
        let w = (self.weight.to_kind(Kind::Float) * self.scale.view([-1, 1])).to_kind(x.kind());
        x.linear(&w, self.bias.as_ref().map(|b| b.to_kind(x.kind())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(out: i64, inp: i64, seed: i64) -> Linear {
        tch::manual_seed(seed);
        Linear {
            weight: Tensor::randn([out, inp], (Kind::Float, tch::Device::Cpu)) * 0.1,
            weight_scale: None,
            bias: Some(Tensor::randn([out], (Kind::Float, tch::Device::Cpu))),
        }
    }

    #[test]
    fn rows_quantise_to_448_at_their_largest_value_and_a_zero_row_to_zeros() {
        let x = Tensor::from_slice(&[1.0f32, -3.0, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0]).view([2, 4]);
        let q = RowQuantized::of(&x);
        let scale: Vec<f32> = Vec::try_from(q.scale.view([-1])).unwrap();
        assert_eq!(scale, [3.0 / 448.0, 1.0]);
        let back = q.dequantize(Kind::Float);
        assert_eq!(f64::try_from(back.get(0).get(1)).unwrap(), -3.0);
        assert_eq!(
            f64::try_from(back.get(1).abs().max()).unwrap(),
            0.0,
            "a row of zeros stays zeros"
        );
        // Every value within fp8's rounding (2⁻⁴ relative) of the input.
        let err = (&back - &x).abs() - x.abs() / 16.0;
        assert!(f64::try_from(err.max()).unwrap() <= 1e-7);
    }

    #[test]
    fn dense_weights_are_quantised_per_output_channel_and_parts_concatenate() {
        let (q, k, v) = (linear(16, 32, 1), linear(16, 32, 2), linear(32, 32, 3));
        let fused = Fp8Linear::of(&[&q, &k, &v]).expect("fp8-shaped");
        assert_eq!(fused.out_features(), 64);
        assert_eq!(fused.scale.size(), [1, 64]);
        let x = Tensor::randn([4, 32], (Kind::Float, tch::Device::Cpu));
        let got = fused.forward_dense(&x);
        let want = Tensor::cat(&[q.forward(&x), k.forward(&x), v.forward(&x)], 1);
        let rel = f64::try_from((&got - &want).norm() / want.norm()).unwrap();
        assert!(rel < 0.05, "fp8 weights off by {rel:.3} (relative L2)");
        assert!(rel > 0.0, "the weights were quantised");
        assert!(fused.made_from(&[&q, &k, &v]));
        let mut q2 = q;
        q2.weight = q2.weight.copy();
        assert!(
            !fused.made_from(&[&q2, &k, &v]),
            "a replaced weight (a LoRA fused since) is noticed"
        );
    }

    #[test]
    fn e4m3_weights_keep_their_bytes_and_their_scale() {
        let mut l = linear(16, 16, 4);
        l.weight = (&l.weight * 10.0).to_kind(Kind::Float8e4m3fn);
        l.weight_scale = Some(Tensor::from(0.25f32));
        // `_scaled_mm` adds a bf16 bias: one that bf16 holds exactly.
        l.bias = l
            .bias
            .map(|b| b.to_kind(Kind::BFloat16).to_kind(Kind::Float));
        let f = Fp8Linear::of(&[&l]).expect("fp8-shaped");
        let same = f
            .weight
            .view_dtype(Kind::Uint8)
            .eq_tensor(&l.weight.view_dtype(Kind::Uint8))
            .all();
        assert!(bool::try_from(same).unwrap());
        let scales: Vec<f32> = Vec::try_from(f.scale.view([-1])).unwrap();
        assert!(scales.iter().all(|s| *s == 0.25));
        let x = Tensor::randn([2, 16], (Kind::Float, tch::Device::Cpu));
        let rel =
            f64::try_from((f.forward_dense(&x) - l.forward(&x)).norm() / l.forward(&x).norm())
                .unwrap();
        assert!(rel < 1e-6, "the same weights: {rel:.2e}");
    }

    #[test]
    fn widths_that_are_not_multiples_of_16_are_refused() {
        assert!(Fp8Linear::of(&[&linear(24, 32, 5)]).is_none());
        assert!(Fp8Linear::of(&[&linear(16, 20, 6)]).is_none());
        assert!(!Fp8Linear::takes_rows(8) && Fp8Linear::takes_rows(8192));
    }

    #[test]
    fn a_device_without_fp8_gemms_is_refused_by_the_probe() {
        assert!(Fp8Linear::probe(tch::Device::Cpu).is_err());
    }
}
