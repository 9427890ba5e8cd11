//! SwiGLU, the decoders' feed-forward activation: `silu(gate) * up`.

use crate::dispatch::simd_dispatch;
use crate::exp::exp_nonpositive;
use crate::parallel::for_each_piece;
use crate::KernelError;

/// In place: `gate = gate * sigmoid(gate) * up`, element by element, within a
/// few float32 ulps of the exact function (the exp is [`exp_nonpositive`]'s
/// fit). Uses up to `threads` threads (the caller's included) when the buffer
/// is large.
pub fn swiglu(gate: &mut [f32], up: &[f32], threads: usize) -> Result<(), KernelError> {
    if gate.len() != up.len() {
        return Err(KernelError::Shape(format!(
            "gate has {} values, up {}",
            gate.len(),
            up.len()
        )));
    }
    for_each_piece(gate, 1, threads, |piece, start| {
        swiglu_piece(piece, &up[start..start + piece.len()])
    });
    Ok(())
}

simd_dispatch! {
    fn swiglu_piece<FMA>(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = silu_one::<FMA>(*g) * u;
        }
    }
}

#[inline(always)]
fn silu_one<const FMA: bool>(x: f32) -> f32 {
    // The sigmoid from e^-|x| <= 1, which never overflows: 1 / (1 + e) for
    // x >= 0, e / (1 + e) below. Compare-selects, so the loop vectorizes.
    let negative = x < 0.0;
    let e = exp_nonpositive::<FMA>(if negative { x } else { -x });
    let numerator = if negative { e } else { 1.0 };
    let silu = x * numerator / (1.0 + e);
    // Below -88, e^x is under the smallest normal float, where the exp
    // clamps; x e^x is zero to float32 there.
    if x < -88.0 {
        -0.0
    } else {
        silu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_float64_swiglu() {
        let n: usize = 300_001;
        let gate: Vec<f32> = (0..n)
            .map(|i| -100.0 + 200.0 * i as f32 / n as f32)
            .collect();
        // Up values of both signs and several sizes, out of step with gate.
        let up: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
            .collect();
        crate::dispatch::tests::each_build(|build, threads| {
            let mut got = gate.clone();
            swiglu(&mut got, &up, threads).unwrap();
            let mut worst = 0.0f64;
            for ((&g, &u), &y) in gate.iter().zip(&up).zip(&got) {
                let (g, u) = (g as f64, u as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                // Relative to max(|want|, |u|): float32 rounding of the inputs.
                worst = worst.max((y as f64 - want).abs() / want.abs().max(u.abs()).max(1e-30));
            }
            assert!(
                worst < 1e-6,
                "{build} build, threads {threads}: worst relative error {worst:e}"
            );
        });
    }

    #[test]
    fn keeps_signs_zeros_and_extremes() {
        let mut gate = [0.0f32, -0.0, 1000.0, -1000.0, f32::MAX, -f32::MAX];
        swiglu(&mut gate, &[3.0; 6], 1).unwrap();
        assert_eq!(gate[..2], [0.0, 0.0]);
        assert_eq!(gate[2], 3000.0);
        assert!(gate[3] <= 0.0 && gate[3] > -1e-30, "{}", gate[3]);
        assert_eq!(gate[4], f32::INFINITY);
        assert!(gate[5] <= 0.0 && gate[5] > -1e-30, "{}", gate[5]);
    }

    #[test]
    fn refuses_buffers_of_different_lengths() {
        let mut gate = [1.0f32; 4];
        assert!(matches!(
            swiglu(&mut gate, &[1.0; 3], 1),
            Err(KernelError::Shape(_))
        ));
    }
}
