//! Fused scale + key mask + softmax over attention scores.

use crate::dispatch::simd_dispatch;
use crate::exp::exp_nonpositive;
use crate::parallel::for_each_piece;
use crate::KernelError;

/// How a flat score buffer is laid out: `[sequences, rows_per_sequence,
/// row_len]`, e.g. `[B, heads * queries, keys]` for attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxShape {
    /// Sequences in the batch (one key length each).
    pub sequences: usize,
    /// Rows that share a sequence's key length (heads x query positions).
    pub rows_per_sequence: usize,
    /// Keys per row, padding included.
    pub row_len: usize,
}

/// In place: each row becomes `softmax(scale * row[..valid])` followed by
/// zeros, where `valid = key_lengths[sequence]`. Keys past a sequence's length
/// are padding and get exactly zero weight. A row with no valid key becomes
/// uniform, as an additive -1e9 mask would make it. Uses up to `threads`
/// threads (the caller's included) when the buffer is large.
pub fn masked_softmax(
    scores: &mut [f32],
    shape: SoftmaxShape,
    key_lengths: &[usize],
    scale: f32,
    threads: usize,
) -> Result<(), KernelError> {
    check(scores, shape, key_lengths, scale)?;
    if scores.is_empty() {
        return Ok(());
    }
    let SoftmaxShape {
        rows_per_sequence,
        row_len,
        ..
    } = shape;
    for_each_piece(scores, row_len, threads, |piece, first_row| {
        softmax_rows(
            piece,
            row_len,
            first_row,
            rows_per_sequence,
            key_lengths,
            scale,
        )
    });
    Ok(())
}

fn check(
    scores: &[f32],
    shape: SoftmaxShape,
    key_lengths: &[usize],
    scale: f32,
) -> Result<(), KernelError> {
    let SoftmaxShape {
        sequences,
        rows_per_sequence,
        row_len,
    } = shape;
    let want = sequences
        .checked_mul(rows_per_sequence)
        .and_then(|n| n.checked_mul(row_len));
    if want != Some(scores.len()) {
        return Err(KernelError::Shape(format!(
            "scores hold {} floats, shape {sequences}x{rows_per_sequence}x{row_len} needs {want:?}",
            scores.len()
        )));
    }
    crate::check_keys(key_lengths, sequences, row_len, scale)
}

simd_dispatch! {
    fn softmax_rows<FMA>(
        rows: &mut [f32],
        row_len: usize,
        first_row: usize,
        rows_per_sequence: usize,
        key_lengths: &[usize],
        scale: f32,
    ) {
        for (i, row) in rows.chunks_exact_mut(row_len).enumerate() {
            let valid = key_lengths[(first_row + i) / rows_per_sequence];
            softmax_row::<FMA>(row, valid, scale);
        }
    }
}

/// The largest value of `row` (-inf for none), in eight lanes then the
/// rest: the one order every softmax here takes its maximum in.
#[inline(always)]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut lane_max = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (m, &v) in lane_max.iter_mut().zip(chunk) {
            // `>` rather than f32::max: a plain compare-select maps to one
            // vector max instruction; max's NaN rules cost extra blends.
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for m in lane_max {
        max = if m > max { m } else { max };
    }
    max
}

/// Overwrites each `v` of `row` with `exp((v - max) * scale)` and returns
/// their sum, in eight lanes then the rest (a fixed order: a row's bits
/// follow its own values alone).
#[inline(always)]
pub(crate) fn exp_shifted_sum<const FMA: bool>(row: &mut [f32], max: f32, scale: f32) -> f32 {
    let mut lane_sum = [0.0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for (s, v) in lane_sum.iter_mut().zip(chunk.iter_mut()) {
            *v = exp_nonpositive::<FMA>((*v - max) * scale);
            *s += *v;
        }
    }
    let mut sum = 0.0f32;
    for v in chunks.into_remainder() {
        *v = exp_nonpositive::<FMA>((*v - max) * scale);
        sum += *v;
    }
    sum + lane_sum.iter().sum::<f32>()
}

#[inline(always)]
pub(crate) fn softmax_row<const FMA: bool>(row: &mut [f32], valid: usize, scale: f32) {
    if valid == 0 {
        row.fill(1.0 / row.len() as f32);
        return;
    }
    let (live, padding) = row.split_at_mut(valid);
    padding.fill(0.0);

    let max = row_max(live);
    let sum = exp_shifted_sum::<FMA>(live, max, scale);

    let inv = 1.0 / sum;
    for v in live.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(row: &[f32], valid: usize, scale: f32) -> Vec<f64> {
        let live: Vec<f64> = row[..valid]
            .iter()
            .map(|&v| v as f64 * scale as f64)
            .collect();
        let max = live.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = live.iter().map(|v| (v - max).exp()).sum();
        let mut out: Vec<f64> = live.iter().map(|v| (v - max).exp() / sum).collect();
        out.resize(row.len(), 0.0);
        out
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 40.0
            })
            .collect()
    }

    #[test]
    fn matches_a_float64_reference_with_masks_and_threads() {
        // Odd sizes exercise the 8-lane remainders; 100k floats are enough for
        // two threads to split the rows.
        let shape = SoftmaxShape {
            sequences: 3,
            rows_per_sequence: 111,
            row_len: 301,
        };
        let lens = [301, 1, 150];
        let input = pseudo_random(3 * 111 * 301, 7);
        crate::dispatch::tests::each_build(|build, threads| {
            let mut got = input.clone();
            masked_softmax(&mut got, shape, &lens, 0.125, threads).unwrap();
            for (r, (row_in, row_out)) in input.chunks(301).zip(got.chunks(301)).enumerate() {
                let want = reference(row_in, lens[r / 111], 0.125);
                for (k, (&g, &w)) in row_out.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - w).abs() < 1e-6,
                        "{build} build: row {r} key {k}: {g} vs {w}"
                    );
                }
                let valid = lens[r / 111];
                assert!(
                    row_out[valid..].iter().all(|&v| v == 0.0),
                    "padding must be exactly 0"
                );
                let total: f64 = row_out.iter().map(|&v| v as f64).sum();
                assert!((total - 1.0).abs() < 1e-5, "row {r} sums to {total}");
            }
        });
    }

    #[test]
    fn a_row_gives_the_same_bits_whatever_the_batch_and_threads() {
        let row = pseudo_random(129, 3);
        let mut alone = row.clone();
        masked_softmax(
            &mut alone,
            SoftmaxShape {
                sequences: 1,
                rows_per_sequence: 1,
                row_len: 129,
            },
            &[100],
            0.2,
            1,
        )
        .unwrap();
        let mut many: Vec<f32> = (0..600).flat_map(|_| row.clone()).collect();
        masked_softmax(
            &mut many,
            SoftmaxShape {
                sequences: 600,
                rows_per_sequence: 1,
                row_len: 129,
            },
            &[100; 600],
            0.2,
            2,
        )
        .unwrap();
        for copy in many.chunks(129) {
            assert_eq!(copy, &alone[..]);
        }
    }

    #[test]
    fn a_row_without_valid_keys_is_uniform() {
        let mut row = vec![3.0, -1.0, 7.0, 0.5];
        let shape = SoftmaxShape {
            sequences: 1,
            rows_per_sequence: 1,
            row_len: 4,
        };
        masked_softmax(&mut row, shape, &[0], 1.0, 1).unwrap();
        assert_eq!(row, vec![0.25; 4]);
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        let shape = SoftmaxShape {
            sequences: 2,
            rows_per_sequence: 2,
            row_len: 4,
        };
        let mut buf = vec![0.0; 16];
        assert!(masked_softmax(&mut buf, shape, &[4, 4], 1.0, 1).is_ok());
        assert!(masked_softmax(&mut buf[..15], shape, &[4, 4], 1.0, 1).is_err());
        assert!(masked_softmax(&mut buf, shape, &[4], 1.0, 1).is_err());
        assert!(masked_softmax(&mut buf, shape, &[4, 5], 1.0, 1).is_err());
        assert!(masked_softmax(&mut buf, shape, &[4, 4], 0.0, 1).is_err());
        let huge = SoftmaxShape {
            sequences: usize::MAX,
            rows_per_sequence: 2,
            row_len: 4,
        };
        assert!(masked_softmax(&mut buf, huge, &[4, 4], 1.0, 1).is_err());
    }
}
