//! Exact (erf) GELU.

use crate::dispatch::{madd, simd_dispatch};
use crate::parallel::for_each_piece;

/// erf(z) ~= z P(z^2) / Q(z^2) on [-4, 4]: the same fit as
/// `mlx_embed.ops._ERF_P` / `_ERF_Q` (regenerate with `ops._fit_erf(5, 5)`),
/// max error 2.2e-8. Lowest degree first; the float64 digits are kept whole so
/// the two can be compared, and the compiler rounds them to f32.
#[allow(clippy::excessive_precision)]
const ERF_P: [f32; 6] = [
    1.128_378_978_971_809_5,
    0.196_229_605_121_974_15,
    0.053_464_160_480_915_734,
    0.004_002_538_479_012_231,
    0.000_287_969_932_223_569_1,
    1.974_418_855_487_038e-6,
];
#[allow(clippy::excessive_precision)]
const ERF_Q: [f32; 6] = [
    1.0,
    0.507_235_142_168_026_1,
    0.116_467_702_129_894_77,
    0.015_442_337_596_287_003,
    0.001_215_998_484_148_373_6,
    3.747_274_160_079_845_4e-5,
];

/// In place: `x * (1 + erf(x / sqrt 2)) / 2`, the GELU of BERT-family models,
/// within ~2 float32 ulps of the exact function. Uses up to `threads` threads
/// (the caller's included) when the buffer is large.
pub fn gelu(data: &mut [f32], threads: usize) {
    for_each_piece(data, 1, threads, |piece, _| gelu_piece(piece));
}

simd_dispatch! {
    fn gelu_piece<FMA>(data: &mut [f32]) {
        for v in data.iter_mut() {
            *v = gelu_one::<FMA>(*v);
        }
    }
}

#[inline(always)]
fn horner<const FMA: bool>(coeffs: &[f32; 6], t: f32) -> f32 {
    let mut acc = coeffs[5];
    for &c in coeffs[..5].iter().rev() {
        acc = madd::<FMA>(acc, t, c);
    }
    acc
}

#[inline(always)]
pub(crate) fn gelu_one<const FMA: bool>(x: f32) -> f32 {
    let z = x * std::f32::consts::FRAC_1_SQRT_2;
    // |erf(4)| = 1 - 1.5e-8: clamping is exact in float32. Compare-selects
    // rather than clamp() so the loop vectorizes without NaN blends.
    #[allow(clippy::manual_clamp)]
    let z = if z > 4.0 {
        4.0
    } else if z < -4.0 {
        -4.0
    } else {
        z
    };
    let t = z * z;
    let erf = z * horner::<FMA>(&ERF_P, t) / horner::<FMA>(&ERF_Q, t);
    let half = 0.5 * x;
    madd::<FMA>(half, erf, half)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf in float64 (Abramowitz-Stegun 7.1.26 is too coarse; this is the
    /// series / continued-fraction pair, good to ~1e-15).
    fn erf64(x: f64) -> f64 {
        if x.abs() < 2.5 {
            let (mut term, mut sum, x2) = (x, x, x * x);
            for n in 1..200 {
                term *= -x2 / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...))))
            let a = x.abs();
            let mut frac = a;
            for k in (1..100).rev() {
                frac = a + (k as f64 / 2.0) / frac;
            }
            let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / frac;
            (1.0 - erfc).copysign(x)
        }
    }

    #[test]
    fn matches_a_float64_gelu() {
        let xs: Vec<f32> = (0..=400_001)
            .map(|i| -20.0 + 40.0 * i as f32 / 400_001.0)
            .collect();
        crate::dispatch::tests::each_build(|build, threads| {
            let mut got = xs.clone();
            gelu(&mut got, threads);
            let mut worst_abs = 0.0f64;
            for (&x, &g) in xs.iter().zip(&got) {
                let want = 0.5 * x as f64 * (1.0 + erf64(x as f64 / std::f64::consts::SQRT_2));
                let err = (g as f64 - want).abs();
                // Relative to max(|x|, 1): float32 rounding of x itself.
                worst_abs = worst_abs.max(err / (x.abs() as f64).max(1.0));
            }
            assert!(
                worst_abs < 3e-7,
                "{build} build, threads {threads}: worst scaled error {worst_abs:e}"
            );
        });
        let mut zero = [0.0f32, -0.0];
        gelu(&mut zero, 1);
        assert_eq!(zero[0], 0.0);
    }
}
