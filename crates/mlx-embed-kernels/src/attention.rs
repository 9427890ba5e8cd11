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
    crate::check_keys(key_lengths, batch, len, scale)?;
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

/// Keys per register tile of [`block_scores`]: two registers of the AVX2
/// build, one of the AVX-512 build.
const KEY_CHUNK: usize = 16;

/// Keys per register tile of the AVX-512 build: two of its registers, so the
/// query block keeps eight multiply-add chains in flight, as AVX2's does.
const KEY_CHUNK_WIDE: usize = 32;

/// One head's keys transposed (`[head_dim, stride]`), its values gathered
/// (`[len, head_dim]`) and [`QUERY_BLOCK`] rows of scores (`stride` apart).
/// `stride` is `len` rounded up to whole key tiles: the keys' padding
/// columns stay zero, so every tile is a full one (a score past the keys is
/// computed and never read), and no key falls to a scalar remainder loop.
struct Scratch {
    stride: usize,
    keys_t: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
}

impl Scratch {
    fn new(len: usize, head_dim: usize) -> Self {
        let stride = len.div_ceil(KEY_CHUNK_WIDE) * KEY_CHUNK_WIDE;
        Self {
            stride,
            keys_t: vec![0.0; head_dim * stride],
            values: vec![0.0; len * head_dim],
            scores: vec![0.0; QUERY_BLOCK * stride],
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
    let stride = scratch.stride;
    let at = |pos: usize, part: usize| ((b * len + pos) * 3 + part) * width + h * head_dim;
    for j in 0..len {
        let k = &qkv[at(j, 1)..at(j, 1) + head_dim];
        for (d, &v) in k.iter().enumerate() {
            scratch.keys_t[d * stride + j] = v;
        }
        scratch.values[j * head_dim..(j + 1) * head_dim]
            .copy_from_slice(&qkv[at(j, 2)..at(j, 2) + head_dim]);
    }
    // A sequence without valid keys attends uniformly over all of them.
    let keys = if valid == 0 { len } else { valid };
    let mut rows = [0.0f32; QUERY_BLOCK * MAX_HEAD_DIM_IN_REGISTERS];
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
            stride,
            keys,
            &mut scratch.scores,
        );
        let rows = &mut rows[..QUERY_BLOCK * head_dim];
        let row_keys = RowKeys {
            len,
            stride,
            valid,
            keys,
            scale,
        };
        let in_registers = block_attend(&mut scratch.scores, row_keys, n, &scratch.values, rows);
        for r in 0..n {
            let row = (b * len + first + r) * width + h * head_dim;
            // SAFETY: row + head_dim <= batch * len * width (first + r < len,
            // h < heads), and these floats belong to this (b, h) alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(row), head_dim) };
            if in_registers {
                dst.copy_from_slice(&rows[r * head_dim..(r + 1) * head_dim]);
            } else {
                let scores = &mut scratch.scores[r * stride..r * stride + len];
                attend_one(scores, valid, keys, scale, &scratch.values, dst);
            }
        }
    }
}

// `scores[r, j] = q_r . k_j` for the QUERY_BLOCK queries at `q_at` and the
// first `keys` keys rounded up to whole tiles (rows of `stride` floats), each
// a chain of multiply-adds over the features in order: the bits of one query
// at a time, with each loaded key feature used by every query.
simd_dispatch! {
    fn block_scores<FMA, WIDE>(
        qkv: &[f32],
        q_at: &[usize; QUERY_BLOCK],
        head_dim: usize,
        keys_t: &[f32],
        stride: usize,
        keys: usize,
        scores: &mut [f32],
    ) {
        if WIDE {
            score_tiles::<FMA, KEY_CHUNK_WIDE>(qkv, q_at, head_dim, keys_t, stride, keys, scores);
        } else {
            score_tiles::<FMA, KEY_CHUNK>(qkv, q_at, head_dim, keys_t, stride, keys, scores);
        }
    }
}

#[inline(always)]
fn score_tiles<const FMA: bool, const KC: usize>(
    qkv: &[f32],
    q_at: &[usize; QUERY_BLOCK],
    head_dim: usize,
    keys_t: &[f32],
    stride: usize,
    keys: usize,
    scores: &mut [f32],
) {
    let q: [&[f32]; QUERY_BLOCK] = std::array::from_fn(|r| &qkv[q_at[r]..q_at[r] + head_dim]);
    for j in (0..keys).step_by(KC) {
        let mut acc = [[0.0f32; KC]; QUERY_BLOCK];
        for d in 0..head_dim {
            let k: &[f32; KC] = keys_t[d * stride + j..d * stride + j + KC]
                .try_into()
                .expect("a KC-long slice");
            for r in 0..QUERY_BLOCK {
                let qd = q[r][d];
                for c in 0..KC {
                    acc[r][c] = madd::<FMA>(qd, k[c], acc[r][c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            scores[r * stride + j..r * stride + j + KC].copy_from_slice(a);
        }
    }
}

/// How a block's score rows are laid out and weighted.
#[derive(Clone, Copy)]
struct RowKeys {
    /// Scores per row that the softmax covers (the positions).
    len: usize,
    /// Floats from one score row to the next.
    stride: usize,
    /// Keys that are not padding (0: none, attend uniformly).
    valid: usize,
    /// Keys summed over: `valid`, or `len` where none is valid.
    keys: usize,
    /// Factor on the scores before the softmax.
    scale: f32,
}

/// The widest head whose output rows [`block_attend`] keeps in registers.
const MAX_HEAD_DIM_IN_REGISTERS: usize = 64;

// The softmax of the QUERY_BLOCK score rows (`stride` apart, `len` long),
// then `rows[r] = sum_j p_rj v_j` in key order, for the head widths whose
// output rows fit in registers; several queries at a time, so each loaded
// value row feeds independent chains of multiply-adds (one query's chain
// per lane waited on its own previous multiply-add). Returns false, having
// done nothing, for other widths.
simd_dispatch! {
    fn block_attend<FMA, WIDE>(
        scores: &mut [f32],
        row_keys: RowKeys,
        n: usize,
        values: &[f32],
        rows: &mut [f32],
    ) -> bool {
        let RowKeys {
            len,
            stride,
            valid,
            keys,
            scale,
        } = row_keys;
        let head_dim = rows.len() / QUERY_BLOCK;
        if head_dim != 32 && head_dim != 64 {
            return false;
        }
        for r in 0..n {
            softmax_row::<FMA>(&mut scores[r * stride..r * stride + len], valid, scale);
        }
        let scores = &*scores;
        // Rows past `n` (a short last block) are left as they are: their
        // sums are dropped.
        match (head_dim, WIDE) {
            (32, true) => weighted_sums::<FMA, 32, 4>(scores, stride, keys, values, rows),
            (64, true) => weighted_sums::<FMA, 64, 4>(scores, stride, keys, values, rows),
            (32, false) => weighted_sums::<FMA, 32, 2>(scores, stride, keys, values, rows),
            _ => weighted_sums::<FMA, 64, 1>(scores, stride, keys, values, rows),
        }
        true
    }
}

/// `rows[r] = sum_j p[r, j] * values[j]` over rows of `HD` floats, in key
/// order, for the QUERY_BLOCK rows of `p`, `Q` of them at a time.
#[inline(always)]
fn weighted_sums<const FMA: bool, const HD: usize, const Q: usize>(
    p: &[f32],
    stride: usize,
    keys: usize,
    values: &[f32],
    rows: &mut [f32],
) {
    for first in (0..QUERY_BLOCK).step_by(Q) {
        let mut acc = [[0.0f32; HD]; Q];
        for j in 0..keys {
            let v: &[f32; HD] = values[j * HD..(j + 1) * HD]
                .try_into()
                .expect("an HD-long slice");
            for q in 0..Q {
                let pj = p[(first + q) * stride + j];
                for c in 0..HD {
                    acc[q][c] = madd::<FMA>(pj, v[c], acc[q][c]);
                }
            }
        }
        for (q, a) in acc.iter().enumerate() {
            rows[(first + q) * HD..(first + q + 1) * HD].copy_from_slice(a);
        }
    }
}

// One query's softmax over its scores, then `dst = sum_j p_j v_j` in key
// order: the same sums as `weighted_sums`, for any head width.
simd_dispatch! {
    fn attend_one<FMA>(
        scores: &mut [f32],
        valid: usize,
        keys: usize,
        scale: f32,
        values: &[f32],
        dst: &mut [f32],
    ) {
        softmax_row::<FMA>(scores, valid, scale);
        let head_dim = dst.len();
        dst.fill(0.0);
        for (j, &pj) in scores[..keys].iter().enumerate() {
            let v = &values[j * head_dim..(j + 1) * head_dim];
            for (o, &x) in dst.iter_mut().zip(v) {
                *o = madd::<FMA>(pj, x, *o);
            }
        }
    }
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
        // Head widths of the fallback (8, 48) and of the register paths (32,
        // 64); 13 positions end in a short query block, 37 span two key tiles.
        for (len, head_dim) in [(13, 8), (13, 32), (37, 32), (13, 64), (37, 64), (5, 48)] {
            let heads = 4;
            let s = AttentionShape {
                batch: 3,
                len,
                heads,
                head_dim,
            };
            let qkv = values(3 * len * 3 * heads * head_dim, head_dim);
            let lens = [len, 5.min(len - 1), 0];
            let want = reference(&qkv, &lens, s, 0.3);
            crate::dispatch::tests::each_build(|build, threads| {
                let mut out = vec![f32::NAN; 3 * len * heads * head_dim];
                attention(&qkv, &lens, s, 0.3, &mut out, threads).unwrap();
                // Scores reach about 12 here; float32 rounding of a score
                // that size moves its weight by ~1e-6 relative.
                for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - w).abs() < 1e-5,
                        "{build} x{threads} {s:?} at {i}: {g} vs {w}"
                    );
                }
            });
        }
    }

    #[test]
    fn a_sequence_gets_the_same_bits_alone_and_padded_in_a_batch() {
        for head_dim in [16, 32, 64] {
            let heads = 3;
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
            // The same sequence second in a batch padded to 41 positions (two
            // key tiles where the alone pass has one).
            let s_two = AttentionShape {
                batch: 2,
                len: 41,
                heads,
                head_dim,
            };
            let mut two = values(2 * 41 * 3 * width, 3);
            let start = 41 * 3 * width;
            two[start..start + 7 * 3 * width].copy_from_slice(&one);
            let mut batch = vec![0.0; 2 * 41 * width];
            attention(&two, &[41, 7], s_two, 0.25, &mut batch, 2).unwrap();
            assert_eq!(
                alone[..],
                batch[41 * width..41 * width + 7 * width],
                "head_dim {head_dim}"
            );
        }
    }

    #[test]
    fn the_avx512_and_avx2_builds_give_the_same_bits() {
        for head_dim in [8, 32, 64] {
            let s = AttentionShape {
                batch: 2,
                len: 45,
                heads: 2,
                head_dim,
            };
            let qkv = values(2 * 45 * 3 * 2 * head_dim, 5);
            let lens = [45, 30];
            let mut wide = vec![0.0; 2 * 45 * 2 * head_dim];
            let mut narrow = wide.clone();
            attention(&qkv, &lens, s, 0.2, &mut wide, 1).unwrap();
            crate::dispatch::tests::on_avx2_kernels(|| {
                attention(&qkv, &lens, s, 0.2, &mut narrow, 1).unwrap()
            });
            assert_eq!(wide, narrow, "head_dim {head_dim}");
        }
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
