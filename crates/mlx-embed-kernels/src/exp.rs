//! `exp` for the non-positive inputs of a max-shifted softmax.

use crate::dispatch::madd;

/// 2^f on [0, 1], degree 5, relative error 7.5e-8: the same fit as
/// `mlx_embed.ops._POW2` (regenerate with `ops._fit_pow2(5)`).
// The digits are ops.py's float64 fit, kept whole so the two can be compared;
// the compiler rounds them to f32.
#[allow(clippy::excessive_precision)]
const POW2: [f32; 6] = [
    0.999_999_925_039_289_3,
    0.693_153_073_767_681_6,
    0.240_153_614_969_209_45,
    0.055_826_318_854_900_79,
    0.008_989_343_820_482_068,
    0.001_877_573_615_488_057_9,
];

/// e^x for x <= 0 as 2^floor(y) (written into the exponent bits) times a
/// polynomial for 2^frac(y), y = x log2(e). Inputs under -87.3 (2^-126, the
/// smallest normal float) return that floor: such weights are below 1e-38 of
/// the row maximum, i.e. zero for any softmax. Only mul/add/floor/integer ops,
/// so a loop of it vectorizes.
#[inline(always)]
pub(crate) fn exp_nonpositive<const FMA: bool>(x: f32) -> f32 {
    let y = x * std::f32::consts::LOG2_E;
    let y = if y < -126.0 { -126.0 } else { y };
    let whole = y.floor();
    let frac = y - whole;
    let mut p = POW2[5];
    p = madd::<FMA>(p, frac, POW2[4]);
    p = madd::<FMA>(p, frac, POW2[3]);
    p = madd::<FMA>(p, frac, POW2[2]);
    p = madd::<FMA>(p, frac, POW2[1]);
    p = madd::<FMA>(p, frac, POW2[0]);
    p * pow2_whole(whole)
}

/// 2^whole for an integer-valued `whole` in [-126, 0], from the bits of
/// whole + 1.5 * 2^23, whose low mantissa bits hold whole as an integer.
/// Rust's `as i32` saturates and checks for NaN, which the compiler could
/// not vectorize (a scalar conversion and two compares per lane: a row's
/// exp cost more than its scores).
#[inline(always)]
fn pow2_whole(whole: f32) -> f32 {
    let shifted = (whole + 12_582_912.0).to_bits();
    f32::from_bits(shifted.wrapping_add(127) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_std_exp_to_float_precision() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            for got in [exp_nonpositive::<false>(x), exp_nonpositive::<true>(x)] {
                worst = worst.max(((got as f64) - want).abs() / want);
            }
        }
        // The fit is 7.5e-8; rounding x*log2(e) to float adds up to
        // |y| * 2^-24 * ln 2 relative error, ~4e-6 at y = -125.
        assert!(worst < 5e-6, "worst relative error {worst:e}");
        // Softmax weights are relative to the row maximum, e^0 = 1: measured
        // against that, the error stays within two float32 ulps of 1.
        let mut worst_abs = 0.0f64;
        for i in 0..=100_000 {
            let x = -20.0 * i as f32 / 100_000.0;
            let got = exp_nonpositive::<true>(x) as f64;
            worst_abs = worst_abs.max((got - (x as f64).exp()).abs());
        }
        assert!(
            worst_abs < 2.4e-7,
            "absolute error on [-20, 0]: {worst_abs:e}"
        );
        assert_eq!(exp_nonpositive::<true>(0.0), POW2[0]);
    }

    #[test]
    fn the_power_of_two_is_exact_over_the_whole_range() {
        for whole in -126..=0 {
            assert_eq!(pow2_whole(whole as f32), 2f32.powi(whole), "2^{whole}");
        }
    }

    #[test]
    fn tiny_inputs_clamp_to_the_smallest_normal() {
        assert_eq!(
            exp_nonpositive::<true>(-1000.0),
            f32::MIN_POSITIVE * POW2[0]
        );
        assert!(exp_nonpositive::<true>(-1e9) > 0.0);
    }
}
