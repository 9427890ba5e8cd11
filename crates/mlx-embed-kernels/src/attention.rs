//! Multi-head self-attention from the fused q/k/v projection to merged heads.
//!
//! The MLX route for one encoder layer's attention is a contiguous copy of
//! the q/k/v transpose, two batched matmuls, the masked softmax between them
//! (an evaluation point), and a copy that merges the heads back (another).
//! For the engine's passes each of those is small, and the copies and the
//! hand-offs to MLX's stream thread cost more than the arithmetic. Here one
//! call reads the projection `[batch, len, 3, heads, head_dim]` as it lies
//! and writes `[batch, len, heads * head_dim]`, ready for the output
//! projection; per (sequence, head) the keys are transposed once into a
//! scratch block so the scores of eight keys come from one vector
//! multiply-add per feature.

use crate::dispatch::{madd, simd_dispatch};
use crate::softmax::softmax_row;
use crate::KernelError;

/// Sizes of one [`attention`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the batch (one key length each).
    pub batch: usize,
    /// Positions per sequence, padding included.
    pub len: usize,
    /// Attention heads.
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

/// Below this many multiply-adds per thread, a helper thread costs more than
/// it saves.
const MIN_MADDS_PER_THREAD: usize = 1 << 18;

/// `out[b, i, h, :] = sum_j p[j] v[b, j, h, :]` with
/// `p = softmax(scale * q[b, i, h, :] . k[b, j, h, :])` over the first
/// `key_lengths[b]` keys (padding keys get exactly zero weight; a sequence
/// with no valid key attends uniformly, as an additive -1e9 mask would
/// make it). `qkv` is `[batch, len, 3, heads, head_dim]` (q, k, v of each
/// position side by side, as the fused projection writes them); `out` is
/// `[batch, len, heads * head_dim]` and is overwritten. Heads are split
/// across up to `threads` threads (the caller's included).
pub fn attention(
    qkv: &[f32],
    key_lengths: &[usize],
    shape: AttentionShape,
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let AttentionShape {
        batch,
        len,
        heads,
        head_dim,
    } = shape;
    let width = heads * head_dim;
    if qkv.len() != batch * len * 3 * width {
        return Err(KernelError::Shape(format!(
            "qkv has {} floats, shape {batch}x{len}x3x{heads}x{head_dim} needs {}",
            qkv.len(),
            batch * len * 3 * width
        )));
    }
    if out.len() != batch * len * width {
        return Err(KernelError::Shape(format!(
            "out has {} floats, expected {batch}x{len}x{width}",
            out.len()
        )));
    }
    if key_lengths.len() != batch {
        return Err(KernelError::Shape(format!(
            "{} key lengths for {batch} sequences",
            key_lengths.len()
        )));
    }
    if let Some(&bad) = key_lengths.iter().find(|&&k| k > len) {
        return Err(KernelError::Shape(format!(
            "key length {bad} > sequence length {len}"
        )));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return Err(KernelError::Shape(format!(
            "scale must be positive, got {scale}"
        )));
    }
    if out.is_empty() {
        return Ok(());
    }
    let units = batch * heads;
    let by_size = (batch * len * len * width * 2) / MIN_MADDS_PER_THREAD;
    let pieces = threads.min(by_size).min(units).max(1);
    let per_piece = units.div_ceil(pieces);
    let dst = OutPtr(out.as_mut_ptr());
    crate::pool::run(pieces, &|piece| {
        let mut scratch = Scratch::new(len, head_dim);
        for unit in piece * per_piece..((piece + 1) * per_piece).min(units) {
            let (b, h) = (unit / heads, unit % heads);
            // SAFETY: each (b, h) writes only out[b, :, h, :], disjoint from
            // every other unit's; `out` is borrowed mutably for this call and
            // `pool::run` returns only when every piece is done.
            unsafe { head(qkv, key_lengths[b], shape, b, h, scale, &mut scratch, dst) };
        }
    });
    Ok(())
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used inside `attention`, whose pieces write disjoint heads.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Queries whose scores are computed together: each key row loaded is used
/// by this many queries (one query at a time, the scores' loads and stores
/// outnumbered the multiply-adds).
const QUERY_BLOCK: usize = 4;

/// Keys per register tile of [`block_scores`] (two AVX2 registers).
const KEY_CHUNK: usize = 16;

/// One head's keys transposed (`[head_dim, len]`), its values gathered
/// (`[len, head_dim]`) and [`QUERY_BLOCK`] rows of scores.
struct Scratch {
    keys_t: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
}

impl Scratch {
    fn new(len: usize, head_dim: usize) -> Self {
        Self {
            keys_t: vec![0.0; head_dim * len],
            values: vec![0.0; len * head_dim],
            scores: vec![0.0; QUERY_BLOCK * len],
        }
    }
}

/// # Safety
/// `out` must point to the call's `[batch, len, heads * head_dim]` buffer,
/// with nobody else touching head `h` of sequence `b` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn head(
    qkv: &[f32],
    valid: usize,
    shape: AttentionShape,
    b: usize,
    h: usize,
    scale: f32,
    scratch: &mut Scratch,
    out: OutPtr,
) {
    let AttentionShape {
        len,
        heads,
        head_dim,
        ..
    } = shape;
    let width = heads * head_dim;
    let at = |pos: usize, part: usize| ((b * len + pos) * 3 + part) * width + h * head_dim;
    for j in 0..len {
        let k = &qkv[at(j, 1)..at(j, 1) + head_dim];
        for (d, &v) in k.iter().enumerate() {
            scratch.keys_t[d * len + j] = v;
        }
        scratch.values[j * head_dim..(j + 1) * head_dim]
            .copy_from_slice(&qkv[at(j, 2)..at(j, 2) + head_dim]);
    }
    // A sequence without valid keys attends uniformly over all of them.
    let keys = if valid == 0 { len } else { valid };
    for first in (0..len).step_by(QUERY_BLOCK) {
        let n = QUERY_BLOCK.min(len - first);
        // A short last block repeats its last query; the extra rows are
        // computed and dropped.
        let q_at: [usize; QUERY_BLOCK] = std::array::from_fn(|r| at(first + r.min(n - 1), 0));
        block_scores(
            qkv,
            &q_at,
            head_dim,
            &scratch.keys_t,
            len,
            keys,
            &mut scratch.scores,
        );
        for r in 0..n {
            let scores = &mut scratch.scores[r * len..(r + 1) * len];
            let row = (b * len + first + r) * width + h * head_dim;
            // SAFETY: row + head_dim <= batch * len * width (first + r < len,
            // h < heads), and these floats belong to this (b, h) alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(row), head_dim) };
            attend(scores, valid, keys, scale, &scratch.values, dst);
        }
    }
}

// `scores[r, j] = q_r . k_j` for the QUERY_BLOCK queries at `q_at` and the
// first `keys` keys (rows of `len` floats), each a chain of multiply-adds
// over the features in order: the bits of one query at a time, with each
// loaded key feature used by every query.
simd_dispatch! {
    fn block_scores<FMA>(
        qkv: &[f32],
        q_at: &[usize; QUERY_BLOCK],
        head_dim: usize,
        keys_t: &[f32],
        len: usize,
        keys: usize,
        scores: &mut [f32],
    ) {
        let q: [&[f32]; QUERY_BLOCK] = std::array::from_fn(|r| &qkv[q_at[r]..q_at[r] + head_dim]);
        let mut j = 0;
        while j + KEY_CHUNK <= keys {
            let mut acc = [[0.0f32; KEY_CHUNK]; QUERY_BLOCK];
            for d in 0..head_dim {
                let k: &[f32; KEY_CHUNK] = keys_t[d * len + j..d * len + j + KEY_CHUNK]
                    .try_into()
                    .expect("a KEY_CHUNK-long slice");
                for r in 0..QUERY_BLOCK {
                    let qd = q[r][d];
                    for c in 0..KEY_CHUNK {
                        acc[r][c] = madd::<FMA>(qd, k[c], acc[r][c]);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                scores[r * len + j..r * len + j + KEY_CHUNK].copy_from_slice(a);
            }
            j += KEY_CHUNK;
        }
        for jj in j..keys {
            for r in 0..QUERY_BLOCK {
                let mut s = 0.0;
                for d in 0..head_dim {
                    s = madd::<FMA>(q[r][d], keys_t[d * len + jj], s);
                }
                scores[r * len + jj] = s;
            }
        }
    }
}

// One query's softmax over its scores, then `dst = sum_j p_j v_j` in key
// order.
simd_dispatch! {
    fn attend<FMA>(
        scores: &mut [f32],
        valid: usize,
        keys: usize,
        scale: f32,
        values: &[f32],
        dst: &mut [f32],
    ) {
        softmax_row::<FMA>(scores, valid, scale);
        let p = &scores[..keys];
        // The output row in registers for the usual head widths; it was
        // loaded and stored once per key.
        match dst.len() {
            32 => weighted_sum::<FMA, 32>(p, values, dst),
            64 => weighted_sum::<FMA, 64>(p, values, dst),
            head_dim => {
                dst.fill(0.0);
                for (j, &pj) in p.iter().enumerate() {
                    let v = &values[j * head_dim..(j + 1) * head_dim];
                    for (o, &x) in dst.iter_mut().zip(v) {
                        *o = madd::<FMA>(pj, x, *o);
                    }
                }
            }
        }
    }
}

/// `dst = sum_j p[j] * values[j]` over rows of `HD` floats, in key order.
#[inline(always)]
fn weighted_sum<const FMA: bool, const HD: usize>(p: &[f32], values: &[f32], dst: &mut [f32]) {
    let mut acc = [0.0f32; HD];
    for (j, &pj) in p.iter().enumerate() {
        let v: &[f32; HD] = values[j * HD..(j + 1) * HD]
            .try_into()
            .expect("an HD-long slice");
        for c in 0..HD {
            acc[c] = madd::<FMA>(pj, v[c], acc[c]);
        }
    }
    dst.copy_from_slice(&acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0) * 2.0)
            .collect()
    }

    fn reference(qkv: &[f32], lens: &[usize], s: AttentionShape, scale: f64) -> Vec<f64> {
        let AttentionShape {
            batch,
            len,
            heads,
            head_dim,
        } = s;
        let width = heads * head_dim;
        let at = |b: usize, pos: usize, part: usize, h: usize, d: usize| {
            qkv[((b * len + pos) * 3 + part) * width + h * head_dim + d] as f64
        };
        let mut out = vec![0.0; batch * len * width];
        for b in 0..batch {
            let keys = if lens[b] == 0 { len } else { lens[b] };
            for h in 0..heads {
                for i in 0..len {
                    let sc: Vec<f64> = (0..keys)
                        .map(|j| {
                            scale
                                * (0..head_dim)
                                    .map(|d| at(b, i, 0, h, d) * at(b, j, 1, h, d))
                                    .sum::<f64>()
                        })
                        .collect();
                    let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    // No valid key: uniform, as the additive mask's -1e9
                    // swamps every score in float32.
                    let e: Vec<f64> = if lens[b] == 0 {
                        vec![1.0; keys]
                    } else {
                        sc.iter().map(|v| (v - max).exp()).collect()
                    };
                    let z: f64 = e.iter().sum();
                    for d in 0..head_dim {
                        out[(b * len + i) * width + h * head_dim + d] =
                            (0..keys).map(|j| e[j] / z * at(b, j, 2, h, d)).sum();
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_a_float64_reference_with_padding_and_threads() {
        let s = AttentionShape {
            batch: 3,
            len: 13,
            heads: 4,
            head_dim: 8,
        };
        let qkv = values(3 * 13 * 3 * 32, 1);
        let lens = [13, 5, 0];
        let want = reference(&qkv, &lens, s, 0.3);
        crate::dispatch::tests::each_build(|build, threads| {
            let mut out = vec![f32::NAN; 3 * 13 * 32];
            attention(&qkv, &lens, s, 0.3, &mut out, threads).unwrap();
            for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() < 2e-6,
                    "{build} x{threads} at {i}: {g} vs {w}"
                );
            }
        });
    }

    #[test]
    fn a_sequence_gets_the_same_bits_alone_and_padded_in_a_batch() {
        let (heads, head_dim) = (3, 16);
        let width = heads * head_dim;
        let s_one = AttentionShape {
            batch: 1,
            len: 7,
            heads,
            head_dim,
        };
        let one = values(7 * 3 * width, 2);
        let mut alone = vec![0.0; 7 * width];
        attention(&one, &[7], s_one, 0.25, &mut alone, 1).unwrap();
        // The same sequence second in a batch padded to 11 positions.
        let s_two = AttentionShape {
            batch: 2,
            len: 11,
            heads,
            head_dim,
        };
        let mut two = values(2 * 11 * 3 * width, 3);
        let start = 11 * 3 * width;
        two[start..start + 7 * 3 * width].copy_from_slice(&one);
        let mut batch = vec![0.0; 2 * 11 * width];
        attention(&two, &[11, 7], s_two, 0.25, &mut batch, 2).unwrap();
        assert_eq!(alone[..], batch[11 * width..11 * width + 7 * width]);
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        let s = AttentionShape {
            batch: 1,
            len: 2,
            heads: 1,
            head_dim: 2,
        };
        let qkv = values(12, 1);
        let mut out = vec![0.0; 4];
        assert!(attention(&qkv[..11], &[2], s, 1.0, &mut out, 1).is_err());
        assert!(attention(&qkv, &[3], s, 1.0, &mut out, 1).is_err());
        assert!(attention(&qkv, &[2, 2], s, 1.0, &mut out, 1).is_err());
        assert!(attention(&qkv, &[2], s, 0.0, &mut out, 1).is_err());
        assert!(attention(&qkv, &[2], s, 1.0, &mut out[..3], 1).is_err());
    }
}
