//! Residual add + layer norm, the step that closes each post-LN block.

use crate::dispatch::simd_dispatch;
use crate::parallel::for_each_piece;
use crate::KernelError;

/// In place over rows of `x` (`[rows, dim]`, dim = `weight.len()`):
/// `x = layer_norm(x + residual) * weight + bias`, with the biased variance
/// and `eps` inside the square root, as BERT's LayerNorm. `residual` has as
/// many rows as `x`, or fewer that repeat over them (a sequence's position
/// rows added to each of a batch's sequences). Uses up to `threads` threads
/// (the caller's included) when the buffer is large.
pub fn add_layer_norm(
    x: &mut [f32],
    residual: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    threads: usize,
) -> Result<(), KernelError> {
    let dim = weight.len();
    if dim == 0 || bias.len() != dim {
        return Err(KernelError::Shape(format!(
            "weight has {dim} and bias {} elements; they must match and be non-empty",
            bias.len()
        )));
    }
    if residual.is_empty()
        || !residual.len().is_multiple_of(dim)
        || !x.len().is_multiple_of(residual.len())
    {
        return Err(KernelError::Shape(format!(
            "x ({}) must be whole rows of {dim}, and residual ({}) as many rows or a \
             non-empty whole number of rows repeating over them",
            x.len(),
            residual.len()
        )));
    }
    let residual_rows = residual.len() / dim;
    for_each_piece(x, dim, threads, |piece, first_row| {
        add_layer_norm_rows(
            piece,
            residual,
            first_row % residual_rows,
            weight,
            bias,
            eps,
        )
    });
    Ok(())
}

simd_dispatch! {
    fn add_layer_norm_rows<FMA>(
        x: &mut [f32],
        residual: &[f32],
        first_residual_row: usize,
        weight: &[f32],
        bias: &[f32],
        eps: f32,
    ) {
        let dim = weight.len();
        let residual_rows = residual.chunks_exact(dim).cycle().skip(first_residual_row);
        for (row, res) in x.chunks_exact_mut(dim).zip(residual_rows) {
            let mut lanes = [0.0f32; 8];
            let mut row_chunks = row.chunks_exact_mut(8);
            let mut res_chunks = res.chunks_exact(8);
            for (r, s) in (&mut row_chunks).zip(&mut res_chunks) {
                for j in 0..8 {
                    r[j] += s[j];
                    lanes[j] += r[j];
                }
            }
            let mut sum: f32 = 0.0;
            for (r, s) in row_chunks.into_remainder().iter_mut().zip(res_chunks.remainder()) {
                *r += *s;
                sum += *r;
            }
            sum += lanes.iter().sum::<f32>();
            let mean = sum / dim as f32;

            // Two passes (mean, then squared deviations): the one-pass E[x^2] -
            // E[x]^2 loses digits when |mean| >> std, as after a residual add.
            let mut lanes = [0.0f32; 8];
            let mut chunks = row.chunks_exact(8);
            for c in &mut chunks {
                for j in 0..8 {
                    let d = c[j] - mean;
                    lanes[j] += d * d;
                }
            }
            let mut squares: f32 = chunks.remainder().iter().map(|&v| (v - mean) * (v - mean)).sum();
            squares += lanes.iter().sum::<f32>();
            let inv_std = 1.0 / (squares / dim as f32 + eps).sqrt();

            for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
                *v = crate::dispatch::madd::<FMA>((*v - mean) * inv_std, w, b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_float64_reference() {
        let dim = 389; // not a multiple of 8
        let rows = 200; // 77,800 floats: two threads split them
        let gen = |i: usize, k: f32| ((i * 7919 + 13) % 997) as f32 / 997.0 * k - k / 2.0 + 30.0;
        let x: Vec<f32> = (0..rows * dim).map(|i| gen(i, 4.0)).collect();
        let res: Vec<f32> = (0..rows * dim).map(|i| gen(i + 5, 2.0)).collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..dim).map(|i| (i % 5) as f32 * 0.01 - 0.02).collect();
        crate::dispatch::tests::each_build(|build, threads| {
            let mut got = x.clone();
            add_layer_norm(&mut got, &res, &w, &b, 1e-12, threads).unwrap();
            for r in 0..rows {
                let row: Vec<f64> = (0..dim)
                    .map(|j| x[r * dim + j] as f64 + res[r * dim + j] as f64)
                    .collect();
                let mean = row.iter().sum::<f64>() / dim as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / dim as f64;
                for j in 0..dim {
                    let want = (row[j] - mean) / (var + 1e-12).sqrt() * w[j] as f64 + b[j] as f64;
                    let g = got[r * dim + j] as f64;
                    assert!(
                        (g - want).abs() < 2e-5,
                        "{build} build: row {r} col {j}: {g} vs {want}"
                    );
                }
            }
        });
    }

    #[test]
    fn repeats_a_shorter_residual_over_the_rows() {
        let dim = 389;
        // Two threads take 150 rows each: the second starts at residual row 150 % 4 = 2.
        let (rows, repeat) = (300, 4);
        assert!(rows * dim >= 2 * crate::parallel::MIN_ELEMENTS_PER_THREAD);
        let gen = |i: usize, k: f32| ((i * 7919 + 13) % 997) as f32 / 997.0 * k - k / 2.0;
        let x: Vec<f32> = (0..rows * dim).map(|i| gen(i, 4.0)).collect();
        let short: Vec<f32> = (0..repeat * dim).map(|i| gen(i + 5, 2.0)).collect();
        let full: Vec<f32> = (0..rows * dim).map(|i| short[i % (repeat * dim)]).collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..dim).map(|i| (i % 5) as f32 * 0.01 - 0.02).collect();
        crate::dispatch::tests::each_build(|build, threads| {
            let (mut want, mut got) = (x.clone(), x.clone());
            add_layer_norm(&mut want, &full, &w, &b, 1e-12, threads).unwrap();
            add_layer_norm(&mut got, &short, &w, &b, 1e-12, threads).unwrap();
            assert!(got == want, "{build} build, {threads} threads");
        });
    }

    #[test]
    fn rejects_mismatched_shapes() {
        let mut x = vec![0.0; 8];
        assert!(add_layer_norm(&mut x, &[0.0; 8], &[1.0; 4], &[0.0; 4], 1e-5, 1).is_ok());
        // One row of 4 repeating over two.
        assert!(add_layer_norm(&mut x, &[0.0; 4], &[1.0; 4], &[0.0; 4], 1e-5, 1).is_ok());
        assert!(add_layer_norm(&mut x, &[0.0; 12], &[1.0; 4], &[0.0; 4], 1e-5, 1).is_err());
        assert!(add_layer_norm(&mut x, &[0.0; 0], &[1.0; 4], &[0.0; 4], 1e-5, 1).is_err());
        assert!(add_layer_norm(&mut x, &[0.0; 6], &[1.0; 3], &[0.0; 3], 1e-5, 1).is_err());
        assert!(add_layer_norm(&mut x, &[0.0; 8], &[1.0; 3], &[0.0; 3], 1e-5, 1).is_err());
        assert!(add_layer_norm(&mut x, &[0.0; 8], &[1.0; 4], &[0.0; 2], 1e-5, 1).is_err());
    }
}
