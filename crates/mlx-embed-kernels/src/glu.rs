//! Gated linear units, the decoders' feed-forward activation:
//! `act(gate) * up` with SiLU (SwiGLU: Qwen, Llama/Mistral) or tanh-GELU
//! (GeGLU: Gemma).

use crate::dispatch::{madd, simd_dispatch};
use crate::exp::exp_nonpositive;
use crate::parallel::for_each_piece;
use crate::KernelError;

/// The gate's activation. Both are `x * sigmoid(s(x))`: SiLU with
/// `s(x) = x`, tanh-GELU (`0.5 x (1 + tanh(z))`) with `s(x) = 2z`,
/// `z = sqrt(2/pi) (x + 0.044715 x^3)`, since `(1 + tanh(z)) / 2 = sigmoid(2z)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `x * sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, PyTorch's
    /// `gelu(approximate="tanh")`.
    GeluTanh,
}

/// In place: `gate = act(gate) * up`, element by element, within 1e-6 of
/// `|up|` of the exact function; where the result is far smaller than that
/// (large negative gates) the relative error reaches ~2e-6 (SiLU) and ~2e-5
/// (tanh-GELU), from rounding the exponent inside `exp_nonpositive`, no
/// worse than MLX's own ops. Uses up to `threads` threads (the caller's
/// included) when the buffer is large.
pub fn gated_linear_unit(
    gate: &mut [f32],
    up: &[f32],
    activation: GateActivation,
    threads: usize,
) -> Result<(), KernelError> {
    if gate.len() != up.len() {
        return Err(KernelError::Shape(format!(
            "gate has {} values, up {}",
            gate.len(),
            up.len()
        )));
    }
    for_each_piece(gate, 1, threads, |piece, start| {
        let up = &up[start..start + piece.len()];
        match activation {
            GateActivation::Silu => silu_piece(piece, up),
            GateActivation::GeluTanh => gelu_tanh_piece(piece, up),
        }
    });
    Ok(())
}

simd_dispatch! {
    fn silu_piece<FMA>(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = x_sigmoid::<FMA>(*g, *g) * u;
        }
    }
}

simd_dispatch! {
    fn gelu_tanh_piece<FMA>(gate: &mut [f32], up: &[f32]) {
        const TWO_SQRT_2_OVER_PI: f32 =
            (2.0 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
        for (g, &u) in gate.iter_mut().zip(up) {
            let x = *g;
            let s = TWO_SQRT_2_OVER_PI * madd::<FMA>(0.044_715 * x * x, x, x);
            *g = x_sigmoid::<FMA>(x, s) * u;
        }
    }
}

/// `x * sigmoid(s)`, for `s` of `x`'s sign.
#[inline(always)]
fn x_sigmoid<const FMA: bool>(x: f32, s: f32) -> f32 {
    // The sigmoid from e^-|s| <= 1, which never overflows: 1 / (1 + e) for
    // s >= 0, e / (1 + e) below. Compare-selects, so the loop vectorizes.
    let negative = s < 0.0;
    let e = exp_nonpositive::<FMA>(if negative { s } else { -s });
    let numerator = if negative { e } else { 1.0 };
    let out = x * numerator / (1.0 + e);
    // Below about -87.3 the exp clamps at the smallest normal float, so x
    // times it would grow with |x| (a -inf gate would give -inf); the exact
    // value there is below 1e-36 of |x|, so flush it.
    if s < -88.0 {
        -0.0
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worst_error(activation: GateActivation, exact: fn(f64) -> f64) -> Vec<(String, f64)> {
        let n: usize = 300_001;
        let gate: Vec<f32> = (0..n)
            .map(|i| -100.0 + 200.0 * i as f32 / n as f32)
            .collect();
        // Up values of both signs and several sizes, out of step with gate.
        let up: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
            .collect();
        let mut out = vec![];
        crate::dispatch::tests::each_build(|build, threads| {
            let mut got = gate.clone();
            gated_linear_unit(&mut got, &up, activation, threads).unwrap();
            let mut worst = 0.0f64;
            for ((&g, &u), &y) in gate.iter().zip(&up).zip(&got) {
                let want = exact(g as f64) * u as f64;
                // An absolute-error floor at |u|: far below it (large negative
                // gates) the exp's rounded exponent costs a few e-6 relative.
                let scale = want.abs().max((u as f64).abs()).max(1e-30);
                worst = worst.max((y as f64 - want).abs() / scale);
            }
            out.push((format!("{build} build, threads {threads}"), worst));
        });
        out
    }

    #[test]
    fn silu_matches_float64() {
        for (run, worst) in worst_error(GateActivation::Silu, |x| x / (1.0 + (-x).exp())) {
            assert!(worst < 1e-6, "{run}: worst relative error {worst:e}");
        }
    }

    #[test]
    fn gelu_tanh_matches_float64() {
        let exact = |x: f64| {
            let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + z.tanh())
        };
        for (run, worst) in worst_error(GateActivation::GeluTanh, exact) {
            assert!(worst < 1e-6, "{run}: worst relative error {worst:e}");
        }
    }

    #[test]
    fn keeps_signs_zeros_and_extremes() {
        for activation in [GateActivation::Silu, GateActivation::GeluTanh] {
            let mut gate = [0.0f32, -0.0, 1000.0, -1000.0, f32::MAX, -f32::MAX];
            gated_linear_unit(&mut gate, &[3.0; 6], activation, 1).unwrap();
            assert_eq!(
                [gate[0].to_bits(), gate[1].to_bits()],
                [0.0f32.to_bits(), (-0.0f32).to_bits()],
                "{activation:?}"
            );
            assert_eq!(gate[2], 3000.0, "{activation:?}");
            for g in [gate[3], gate[5]] {
                assert!(g <= 0.0 && g > -1e-30, "{activation:?}: {g}");
            }
        }
    }

    #[test]
    fn refuses_buffers_of_different_lengths() {
        let mut gate = [1.0f32; 4];
        assert!(matches!(
            gated_linear_unit(&mut gate, &[1.0; 3], GateActivation::Silu, 1),
            Err(KernelError::Shape(_))
        ));
    }
}
