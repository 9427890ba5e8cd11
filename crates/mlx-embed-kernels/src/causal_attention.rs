//! Self-attention of decoders and encoders (causal or bidirectional,
//! grouped-query heads, an optional window, Gemma 2's logit soft-cap or
//! ALiBi's distance bias) over q, k and v as the models hold them after
//! RoPE, one text at a time on its own tokens.
//!
//! Keys go in tiles of [`KEY_TILE`] positions with a streaming softmax: per
//! query row a running maximum and sum, its output rows rescaled when the
//! maximum grows, so no `[queries, keys]` score matrix is ever held; a
//! thread's scratch is one transposed key tile and two floats per position.
//! Tiles start at fixed positions and every sum runs in a fixed order, so a
//! row's bits depend on its own text alone: not on the padded length, the
//! batch, the thread count or which FMA build runs (AVX2 or AVX-512; the
//! generic build, without fused multiply-adds, has bits of its own).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dispatch::{madd, simd_dispatch};
use crate::exp::exp_nonpositive;
use crate::softmax::{exp_shifted_sum, row_max};
use crate::KernelError;

/// Keys per tile of the streaming softmax.
pub const KEY_TILE: usize = 64;

/// Query rows computed together: each key row loaded feeds this many.
const QUERY_BLOCK: usize = 4;

/// Keys per register tile of the scores: two AVX2 registers.
const KEY_CHUNK: usize = 16;

/// Keys per register tile of the AVX-512 build: two of its registers.
const KEY_CHUNK_WIDE: usize = 32;

/// Output features per register tile of the weighted sum of values.
const VALUE_CHUNK: usize = 16;

/// One of q, k, v: `data[b * batch + h * head + t * token + d]` is feature
/// `d` of head `h` at position `t` of text `b` (strides in floats; the
/// features of one head at one position lie side by side), as a NumPy view
/// of an MLX array lays out `[B, heads, L, head_dim]` whatever its transposes.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The floats, from element `[0, 0, 0, 0]` on.
    pub data: &'a [f32],
    /// Floats from one text to the next.
    pub batch: usize,
    /// Floats from one head to the next.
    pub head: usize,
    /// Floats from one position to the next.
    pub token: usize,
}

/// Sizes of one [`decoder_attention`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderShape {
    /// Texts in the batch.
    pub batch: usize,
    /// Positions per text, padding included.
    pub len: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; query head `h` reads kv head `h / (heads / kv_heads)`.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

/// Which keys a query sees, what happens to its scores, and which rows
/// are computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderMask<'a> {
    /// Keys after the query get zero weight (a causal decoder); else every
    /// key of the text (EmbeddingGemma, EuroBERT).
    pub causal: bool,
    /// Only keys at most this many positions from the query (either side;
    /// before it alone when causal): Gemma 2's window `w` is `w - 1`,
    /// EmbeddingGemma's sliding layers' half window as it is.
    pub window: Option<usize>,
    /// Gemma 2's `cap * tanh(s / cap)` on the scaled scores before the mask.
    pub softcap: Option<f32>,
    /// ALiBi (jina-bert-v2): query head `h`'s scaled scores less
    /// `slopes[h] * |i - j|`, one slope per query head. Not with `softcap`.
    pub slopes: Option<&'a [f32]>,
    /// Every one of a text's `len` rows, not only its first
    /// `key_lengths[b]`, attends to the text's keys: an encoder's rows past
    /// its keys (a ColBERT query's expansion tokens) are outputs. A row
    /// that sees no key (past the window's reach) is 0.
    pub all_rows: bool,
}

/// `out[b, i, h, :] = sum_j p_j v[b, kv(h), j, :]` with `p` the softmax of
/// `scale * q[b, h, i] . k[b, kv(h), j]` (soft-capped if asked) over the
/// keys `j < key_lengths[b]` that `mask` lets query `i` see; `out` is
/// `[batch, len, heads * head_dim]` (ready for the output projection) and
/// is overwritten, rows at or past a text's length with zeros (unless
/// `mask.all_rows`). Units of
/// (text, head) are shared out among up to `threads` threads (the caller's
/// included); which thread runs one changes no bit.
#[allow(clippy::too_many_arguments)]
pub fn decoder_attention(
    q: Strided<'_>,
    k: Strided<'_>,
    v: Strided<'_>,
    shape: DecoderShape,
    key_lengths: &[usize],
    scale: f32,
    mask: DecoderMask<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    check(q, k, v, shape, key_lengths, scale, mask, out)?;
    let DecoderShape {
        batch,
        heads,
        head_dim,
        ..
    } = shape;
    out.fill(0.0);
    let units = batch * heads;
    let work: usize = key_lengths.iter().map(|&n| n * n).sum::<usize>() * heads * head_dim;
    let pieces = threads.min(work / MIN_MADDS_PER_THREAD).min(units).max(1);
    let next = AtomicUsize::new(0);
    let dst = OutPtr(out.as_mut_ptr());
    crate::pool::run(pieces, &|_| {
        let mut scratch = Scratch::new(shape.len, head_dim);
        loop {
            let unit = next.fetch_add(1, Ordering::Relaxed);
            if unit >= units {
                break;
            }
            let (b, h) = (unit / heads, unit % heads);
            let text = Text {
                q,
                k,
                v,
                shape,
                b,
                h,
                n: key_lengths[b],
                scale,
                mask,
            };
            // SAFETY: each (b, h) writes only out[b, :, h, :], disjoint from
            // every other unit's; `out` is borrowed mutably for this call and
            // `pool::run` returns only when every piece is done.
            unsafe { one_head(&text, &mut scratch, dst) };
        }
    });
    Ok(())
}

/// Below this many multiply-adds per thread, a helper costs more than it saves.
const MIN_MADDS_PER_THREAD: usize = 1 << 18;

#[allow(clippy::too_many_arguments)]
fn check(
    q: Strided<'_>,
    k: Strided<'_>,
    v: Strided<'_>,
    shape: DecoderShape,
    key_lengths: &[usize],
    scale: f32,
    mask: DecoderMask<'_>,
    out: &[f32],
) -> Result<(), KernelError> {
    let DecoderShape {
        batch,
        len,
        heads,
        kv_heads,
        head_dim,
    } = shape;
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(KernelError::Shape(format!(
            "{heads} query heads are not a multiple of {kv_heads} kv heads"
        )));
    }
    for (name, t, h) in [("q", q, heads), ("k", k, kv_heads), ("v", v, kv_heads)] {
        if batch == 0 || len == 0 || head_dim == 0 {
            break;
        }
        let last = (batch - 1)
            .checked_mul(t.batch)
            .zip((h - 1).checked_mul(t.head))
            .zip((len - 1).checked_mul(t.token))
            .and_then(|((a, b), c)| a.checked_add(b)?.checked_add(c)?.checked_add(head_dim));
        if last.is_none_or(|end| end > t.data.len()) {
            return Err(KernelError::Shape(format!(
                "{name} holds {} floats, too few for {batch}x{h}x{len}x{head_dim} at strides {}/{}/{}",
                t.data.len(),
                t.batch,
                t.head,
                t.token
            )));
        }
    }
    if out.len() != batch * len * heads * head_dim {
        return Err(KernelError::Shape(format!(
            "out has {} floats, expected {batch}x{len}x{}",
            out.len(),
            heads * head_dim
        )));
    }
    crate::check_keys(key_lengths, batch, len, scale)?;
    if let Some(cap) = mask.softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(KernelError::Shape(format!(
                "softcap must be positive, got {cap}"
            )));
        }
    }
    if let Some(slopes) = mask.slopes {
        if len > i32::MAX as usize {
            return Err(KernelError::Shape(format!(
                "ALiBi's distances are i32: {len} positions"
            )));
        }
        if slopes.len() != heads || mask.softcap.is_some() {
            return Err(KernelError::Shape(format!(
                "{} ALiBi slopes for {heads} heads{}",
                slopes.len(),
                if mask.softcap.is_some() {
                    ", with a softcap"
                } else {
                    ""
                }
            )));
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used inside `decoder_attention`, whose units write disjoint heads.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One unit's inputs: head `h` of text `b`, its first `n` positions real.
struct Text<'a> {
    q: Strided<'a>,
    k: Strided<'a>,
    v: Strided<'a>,
    shape: DecoderShape,
    b: usize,
    h: usize,
    n: usize,
    scale: f32,
    mask: DecoderMask<'a>,
}

impl Text<'_> {
    /// Keys `[lo, hi)` that query `i` sees.
    fn keys(&self, i: usize) -> (usize, usize) {
        let lo = self.mask.window.map_or(0, |w| i.saturating_sub(w));
        let hi = if self.mask.causal {
            // Capped for a row past the keys (`all_rows`).
            (i + 1).min(self.n)
        } else {
            // Saturating: a window as wide as usize (Python's int) is no window.
            self.mask.window.map_or(self.n, |w| {
                i.saturating_add(w).saturating_add(1).min(self.n)
            })
        };
        (lo, hi)
    }
}

/// A thread's working memory: one key tile transposed (`[head_dim,
/// KEY_TILE]`), a block's scores, each position's running maximum and sum,
/// and spare output rows for a short last block.
struct Scratch {
    keys_t: Vec<f32>,
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    spare: Vec<f32>,
}

impl Scratch {
    fn new(len: usize, head_dim: usize) -> Self {
        Self {
            keys_t: vec![0.0; head_dim * KEY_TILE],
            scores: vec![0.0; QUERY_BLOCK * KEY_TILE],
            max: vec![0.0; len],
            sum: vec![0.0; len],
            spare: vec![0.0; QUERY_BLOCK * head_dim],
        }
    }
}

/// How one block's rows meet one key tile.
#[derive(Clone, Copy)]
struct BlockTile {
    /// Columns `[lo, hi)` of the tile some row of the block sees.
    lo: usize,
    hi: usize,
    /// Each row's own columns (empty: the row sees none of the tile).
    rows: [(usize, usize); QUERY_BLOCK],
    /// Real rows in the block.
    count: usize,
}

/// # Safety
/// `out` must point to the call's `[batch, len, heads * head_dim]` buffer,
/// with nobody else touching head `h` of text `b` meanwhile.
unsafe fn one_head(text: &Text<'_>, scratch: &mut Scratch, out: OutPtr) {
    let n = text.n;
    if n == 0 {
        return;
    }
    let DecoderShape {
        len,
        heads,
        kv_heads,
        head_dim,
        ..
    } = text.shape;
    let width = heads * head_dim;
    let kv = text.h / (heads / kv_heads);
    let k_base = text.b * text.k.batch + kv * text.k.head;
    let v_base = text.b * text.v.batch + kv * text.v.head;
    let q_base = text.b * text.q.batch + text.h * text.q.head;
    let row_at = |i: usize| (text.b * len + i) * width + text.h * head_dim;
    // The rows computed: the text's, or every one with `all_rows`.
    let m = if text.mask.all_rows { len } else { n };
    let slope = text.mask.slopes.map(|s| s[text.h]);
    scratch.max[..m].fill(f32::NEG_INFINITY);
    scratch.sum[..m].fill(0.0);
    for first_key in (0..n).step_by(KEY_TILE) {
        let tile_keys = KEY_TILE.min(n - first_key);
        // The register tiles read up to the widest one's end past the keys
        // (score_tiles); no further.
        let read = tile_keys.next_multiple_of(KEY_CHUNK_WIDE).min(KEY_TILE);
        for d in 0..head_dim {
            let row = &mut scratch.keys_t[d * KEY_TILE..(d + 1) * KEY_TILE];
            for (c, slot) in row[..tile_keys].iter_mut().enumerate() {
                *slot = text.k.data[k_base + (first_key + c) * text.k.token + d];
            }
            // Columns past the text: finite, computed and never weighted.
            row[tile_keys..read].fill(0.0);
        }
        let values = &text.v.data[v_base + first_key * text.v.token..];
        // The query blocks that see some key of this tile.
        let tile_end = first_key + tile_keys;
        let first_row = match (text.mask.causal, text.mask.window) {
            (true, _) => first_key,
            (false, Some(w)) => first_key.saturating_sub(w),
            (false, None) => 0,
        };
        let first_block = first_row / QUERY_BLOCK * QUERY_BLOCK;
        for start in (first_block..m).step_by(QUERY_BLOCK) {
            let count = QUERY_BLOCK.min(m - start);
            let mut rows = [(0usize, 0usize); QUERY_BLOCK];
            let (mut lo, mut hi) = (KEY_TILE, 0);
            for (r, cols) in rows.iter_mut().enumerate().take(count) {
                let (a, z) = text.keys(start + r);
                let (a, z) = (a.max(first_key), z.min(tile_end));
                if a < z {
                    *cols = (a - first_key, z - first_key);
                    lo = lo.min(cols.0);
                    hi = hi.max(cols.1);
                }
            }
            if lo >= hi {
                // With a window, the blocks past this tile's reach see none
                // of it either.
                if text.mask.window.is_some() && start > tile_end {
                    break;
                }
                continue;
            }
            let tile = BlockTile {
                lo,
                hi,
                rows,
                count,
            };
            // A short last block repeats its last query; its rows are dropped.
            let q_at: [usize; QUERY_BLOCK] =
                std::array::from_fn(|r| q_base + (start + r.min(count - 1)) * text.q.token);
            block_scores(
                text.q.data,
                &q_at,
                head_dim,
                &scratch.keys_t,
                tile.lo,
                tile.hi,
                &mut scratch.scores,
            );
            let bias = slope.map(|slope| Alibi {
                slope,
                // Distances of the block's first row from the tile's first key.
                offset: start as isize - first_key as isize,
            });
            let alpha = block_softmax(
                &mut scratch.scores,
                tile,
                text.scale,
                text.mask.softcap,
                bias,
                &mut scratch.max[start..start + count],
                &mut scratch.sum[start..start + count],
            );
            let mut spare = scratch.spare.chunks_exact_mut(head_dim);
            let mut rows: [&mut [f32]; QUERY_BLOCK] = std::array::from_fn(|r| {
                if r < count {
                    // SAFETY: row start + r < n of head h belongs to this
                    // unit alone (the caller's contract), and the block's
                    // rows are distinct.
                    unsafe {
                        std::slice::from_raw_parts_mut(out.0.add(row_at(start + r)), head_dim)
                    }
                } else {
                    spare.next().expect("a spare row per missing one")
                }
            });
            accumulate(
                &scratch.scores,
                tile,
                &alpha,
                values,
                text.v.token,
                &mut rows,
            );
        }
    }
    for i in 0..m {
        // A row that saw no key (all_rows, past the window) stays 0.
        let sum = scratch.sum[i];
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        // SAFETY: row i of head h belongs to this unit alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(row_at(i)), head_dim) };
        for o in dst {
            *o *= inv;
        }
    }
}

// `scores[r, c] = q_r . k_c` for the QUERY_BLOCK queries at `q_at` and the
// tile's columns [lo, hi) widened to whole register tiles, each a chain of
// multiply-adds over the features in order.
simd_dispatch! {
    fn block_scores<FMA, WIDE>(
        q: &[f32],
        q_at: &[usize; QUERY_BLOCK],
        head_dim: usize,
        keys_t: &[f32],
        lo: usize,
        hi: usize,
        scores: &mut [f32],
    ) {
        if WIDE {
            score_tiles::<FMA, KEY_CHUNK_WIDE>(q, q_at, head_dim, keys_t, lo, hi, scores);
        } else {
            score_tiles::<FMA, KEY_CHUNK>(q, q_at, head_dim, keys_t, lo, hi, scores);
        }
    }
}

#[inline(always)]
fn score_tiles<const FMA: bool, const KC: usize>(
    q: &[f32],
    q_at: &[usize; QUERY_BLOCK],
    head_dim: usize,
    keys_t: &[f32],
    lo: usize,
    hi: usize,
    scores: &mut [f32],
) {
    let rows: [&[f32]; QUERY_BLOCK] = std::array::from_fn(|r| &q[q_at[r]..q_at[r] + head_dim]);
    let mut j = lo / KC * KC;
    while j < hi {
        // The last chunk as narrow as its columns allow (a short text's 8
        // keys are not a 32-key tile's work): each column is its own chain
        // of multiply-adds whatever the chunk's width, so no bit changes.
        let left = hi - j;
        if KC > 8 && left <= 8 {
            score_chunk::<FMA, 8>(&rows, head_dim, keys_t, j, scores);
            j += 8;
        } else if KC > 16 && left <= 16 {
            score_chunk::<FMA, 16>(&rows, head_dim, keys_t, j, scores);
            j += 16;
        } else {
            score_chunk::<FMA, KC>(&rows, head_dim, keys_t, j, scores);
            j += KC;
        }
    }
}

/// `scores[r, j..j + W] = q_r . k_c` for the block's rows, one register
/// tile of `W` key columns.
#[inline(always)]
fn score_chunk<const FMA: bool, const W: usize>(
    rows: &[&[f32]; QUERY_BLOCK],
    head_dim: usize,
    keys_t: &[f32],
    j: usize,
    scores: &mut [f32],
) {
    let mut acc = [[0.0f32; W]; QUERY_BLOCK];
    for d in 0..head_dim {
        let k: &[f32; W] = keys_t[d * KEY_TILE + j..d * KEY_TILE + j + W]
            .try_into()
            .expect("a W-long slice");
        for r in 0..QUERY_BLOCK {
            let qd = rows[r][d];
            for c in 0..W {
                acc[r][c] = madd::<FMA>(qd, k[c], acc[r][c]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        scores[r * KEY_TILE + j..r * KEY_TILE + j + W].copy_from_slice(a);
    }
}

// The streaming softmax's step for one block and tile: each row's scores
// (scaled, soft-capped) become weights relative to the row's new running
// maximum, zero outside the row's own columns within [lo, hi); the running
// sums take the tile's weights; returns each row's factor on what its
// output rows hold so far (1 where the maximum did not grow).
simd_dispatch! {
    fn block_softmax<FMA>(
        scores: &mut [f32],
        tile: BlockTile,
        scale: f32,
        softcap: Option<f32>,
        alibi: Option<Alibi>,
        max: &mut [f32],
        sum: &mut [f32],
    ) -> [f32; QUERY_BLOCK] {
        let mut alpha = [1.0f32; QUERY_BLOCK];
        for r in 0..tile.count {
            let row = &mut scores[r * KEY_TILE + tile.lo..r * KEY_TILE + tile.hi];
            let (a, z) = tile.rows[r];
            if a >= z {
                row.fill(0.0);
                continue;
            }
            let (a, z) = (a - tile.lo, z - tile.lo);
            // The exponent's factor: the scale, or 1 once a cap has applied it.
            let post = match softcap {
                Some(cap) => {
                    let inner = scale / cap;
                    for s in row[a..z].iter_mut() {
                        *s = cap * tanh::<FMA>(*s * inner);
                    }
                    1.0
                }
                None => match alibi {
                    Some(Alibi { slope, offset }) => {
                        // Key column c (of the tile) is |offset + r - c|
                        // positions from row r: a plain multiply and
                        // subtract, the same bits in every build. In i32
                        // (positions are far below 2^31), which vectorizes.
                        let base = (offset + r as isize - (tile.lo + a) as isize) as i32;
                        for (c, s) in row[a..z].iter_mut().enumerate() {
                            let dist = (base - c as i32).abs();
                            *s = *s * scale - slope * dist as f32;
                        }
                        1.0
                    }
                    None => scale,
                },
            };
            let tile_max = row_max(&row[a..z]);
            let old = max[r];
            let new = if tile_max > old { tile_max } else { old };
            if new > old {
                // An old maximum of -inf (the row's first tile) gives a tiny
                // factor on outputs and a sum that are still 0.
                alpha[r] = exp_nonpositive::<FMA>((old - new) * post);
            }
            max[r] = new;
            row[..a].fill(0.0);
            row[z..].fill(0.0);
            let total = exp_shifted_sum::<FMA>(&mut row[a..z], new, post);
            sum[r] = madd::<FMA>(sum[r], alpha[r], total);
        }
        alpha
    }
}

/// ALiBi's bias for one block against one tile.
#[derive(Clone, Copy)]
struct Alibi {
    /// The head's slope.
    slope: f32,
    /// The block's first query position less the tile's first key position.
    offset: isize,
}

/// `tanh(x)`: an odd Taylor polynomial near 0 (where `1 - e^-2|x|` would
/// lose the digits), `(1 - e) / (1 + e)` with `e = e^-2|x|` beyond; within
/// 3e-7 of the exact value. Compare-selects only, so a loop vectorizes.
#[inline(always)]
fn tanh<const FMA: bool>(x: f32) -> f32 {
    // tanh's Taylor coefficients to x^15: the next term is under 1e-8 of
    // tanh(x) for |x| <= 0.5.
    const C: [f32; 8] = [
        1.0,
        -1.0 / 3.0,
        2.0 / 15.0,
        -17.0 / 315.0,
        62.0 / 2835.0,
        -1382.0 / 155_925.0,
        21_844.0 / 6_081_075.0,
        -929_569.0 / 638_512_875.0,
    ];
    let a = if x < 0.0 { -x } else { x };
    let t = x * x;
    let mut p = C[7];
    for &c in C[..7].iter().rev() {
        p = madd::<FMA>(p, t, c);
    }
    let small = x * p;
    let e = exp_nonpositive::<FMA>(-2.0 * a);
    let large = (1.0 - e) / (1.0 + e);
    let large = if x < 0.0 { -large } else { large };
    if a <= 0.5 {
        small
    } else {
        large
    }
}

// `out_r = alpha_r out_r + sum_c p[r, c] v_c` over the tile's columns
// [lo, hi) in key order, for the block's rows, VALUE_CHUNK features at a
// time so the partial sums stay in registers. `rows` past the block's real
// ones are spare rows whose sums nobody reads.
simd_dispatch! {
    fn accumulate<FMA>(
        p: &[f32],
        tile: BlockTile,
        alpha: &[f32; QUERY_BLOCK],
        values: &[f32],
        value_stride: usize,
        rows: &mut [&mut [f32]; QUERY_BLOCK],
    ) {
        let head_dim = rows[0].len();
        let full = head_dim / VALUE_CHUNK * VALUE_CHUNK;
        for d in (0..full).step_by(VALUE_CHUNK) {
            let mut acc = [[0.0f32; VALUE_CHUNK]; QUERY_BLOCK];
            for (a, (row, &f)) in acc.iter_mut().zip(rows.iter().zip(alpha)) {
                for (x, &o) in a.iter_mut().zip(&row[d..d + VALUE_CHUNK]) {
                    *x = o * f;
                }
            }
            for j in tile.lo..tile.hi {
                let v: &[f32; VALUE_CHUNK] = values[j * value_stride + d..j * value_stride + d + VALUE_CHUNK]
                    .try_into()
                    .expect("a VALUE_CHUNK-long slice");
                for (r, a) in acc.iter_mut().enumerate() {
                    let pj = p[r * KEY_TILE + j];
                    for c in 0..VALUE_CHUNK {
                        a[c] = madd::<FMA>(pj, v[c], a[c]);
                    }
                }
            }
            for (row, a) in rows.iter_mut().zip(&acc) {
                row[d..d + VALUE_CHUNK].copy_from_slice(a);
            }
        }
        for d in full..head_dim {
            for (r, row) in rows.iter_mut().enumerate() {
                let mut acc = row[d] * alpha[r];
                for j in tile.lo..tile.hi {
                    acc = madd::<FMA>(p[r * KEY_TILE + j], values[j * value_stride + d], acc);
                }
                row[d] = acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    /// q as `[B, H, L, hd]`, k as `[B, L, Hkv, hd]` seen through its
    /// transpose, v as `[B, Hkv, L, hd]`: the layouts differ on purpose.
    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        shape: DecoderShape,
    }

    impl Inputs {
        fn new(shape: DecoderShape, seed: u64) -> Self {
            let DecoderShape {
                batch,
                len,
                heads,
                kv_heads,
                head_dim,
            } = shape;
            Self {
                q: values(batch * heads * len * head_dim, seed),
                k: values(batch * kv_heads * len * head_dim, seed + 1),
                v: values(batch * kv_heads * len * head_dim, seed + 2),
                shape,
            }
        }

        fn q(&self) -> Strided<'_> {
            let s = self.shape;
            Strided {
                data: &self.q,
                batch: s.heads * s.len * s.head_dim,
                head: s.len * s.head_dim,
                token: s.head_dim,
            }
        }

        fn k(&self) -> Strided<'_> {
            let s = self.shape;
            Strided {
                data: &self.k,
                batch: s.len * s.kv_heads * s.head_dim,
                head: s.head_dim,
                token: s.kv_heads * s.head_dim,
            }
        }

        fn v(&self) -> Strided<'_> {
            let s = self.shape;
            Strided {
                data: &self.v,
                batch: s.kv_heads * s.len * s.head_dim,
                head: s.len * s.head_dim,
                token: s.head_dim,
            }
        }

        fn run(
            &self,
            lens: &[usize],
            scale: f32,
            mask: DecoderMask<'_>,
            threads: usize,
        ) -> Vec<f32> {
            let s = self.shape;
            let mut out = vec![f32::NAN; s.batch * s.len * s.heads * s.head_dim];
            decoder_attention(
                self.q(),
                self.k(),
                self.v(),
                s,
                lens,
                scale,
                mask,
                &mut out,
                threads,
            )
            .unwrap();
            out
        }

        fn reference(&self, lens: &[usize], scale: f64, mask: DecoderMask<'_>) -> Vec<f64> {
            let s = self.shape;
            let at = |t: Strided<'_>, b: usize, h: usize, i: usize, d: usize| {
                t.data[b * t.batch + h * t.head + i * t.token + d] as f64
            };
            let width = s.heads * s.head_dim;
            let mut out = vec![0.0; s.batch * s.len * width];
            for (b, &n) in lens.iter().enumerate() {
                for h in 0..s.heads {
                    let kv = h / (s.heads / s.kv_heads);
                    let rows = if mask.all_rows { s.len } else { n };
                    for i in 0..rows {
                        let seen: Vec<usize> = (0..n)
                            .filter(|&j| {
                                (!mask.causal || j <= i)
                                    && mask.window.is_none_or(|w| i.abs_diff(j) <= w)
                            })
                            .collect();
                        let scores: Vec<f64> = seen
                            .iter()
                            .map(|&j| {
                                let raw = scale
                                    * (0..s.head_dim)
                                        .map(|d| {
                                            at(self.q(), b, h, i, d) * at(self.k(), b, kv, j, d)
                                        })
                                        .sum::<f64>();
                                let bias = mask
                                    .slopes
                                    .map_or(0.0, |sl| -(sl[h] as f64) * i.abs_diff(j) as f64);
                                match mask.softcap {
                                    Some(c) => c as f64 * (raw / c as f64).tanh(),
                                    None => raw + bias,
                                }
                            })
                            .collect();
                        if seen.is_empty() {
                            // A row past the keys and the window: 0.
                            continue;
                        }
                        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                        let total: f64 = e.iter().sum();
                        for d in 0..s.head_dim {
                            out[(b * s.len + i) * width + h * s.head_dim + d] = seen
                                .iter()
                                .zip(&e)
                                .map(|(&j, p)| p / total * at(self.v(), b, kv, j, d))
                                .sum();
                        }
                    }
                }
            }
            out
        }
    }

    const CAUSAL: DecoderMask = DecoderMask {
        causal: true,
        window: None,
        softcap: None,
        slopes: None,
        all_rows: false,
    };

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        let worst = got
            .iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs())
            .fold(0.0, f64::max);
        assert!(worst < 2e-5, "{what}: worst |diff| {worst:e}");
    }

    /// Each mask's output within float precision of the float64 reference,
    /// in every SIMD build and thread count.
    fn matches_the_reference_in_every_build(
        inputs: &Inputs,
        lens: &[usize],
        masks: &[(&str, DecoderMask<'_>)],
    ) {
        for &(name, mask) in masks {
            let want = inputs.reference(lens, 0.3, mask);
            crate::dispatch::tests::each_build(|build, threads| {
                let got = inputs.run(lens, 0.3, mask, threads);
                assert_close(
                    &got,
                    &want,
                    &format!("{name}, {build} build, {threads} threads"),
                );
            });
        }
    }

    #[test]
    fn matches_a_float64_reference_at_tile_boundaries() {
        let t = KEY_TILE;
        let masks = [
            ("causal", CAUSAL),
            (
                "causal window",
                DecoderMask {
                    window: Some(t / 2 + 3),
                    ..CAUSAL
                },
            ),
            (
                "soft-capped causal window",
                DecoderMask {
                    causal: true,
                    window: Some(t + 1),
                    softcap: Some(2.0),
                    slopes: None,
                    all_rows: false,
                },
            ),
            (
                "bidirectional",
                DecoderMask {
                    causal: false,
                    window: None,
                    softcap: None,
                    slopes: None,
                    all_rows: false,
                },
            ),
            (
                "bidirectional window",
                DecoderMask {
                    causal: false,
                    window: Some(t / 4 + 1),
                    softcap: None,
                    slopes: None,
                    all_rows: false,
                },
            ),
        ];
        // Grouped heads (4 over 2), a head width with a scalar remainder
        // (20 = 16 + 4), lengths around the tile and one padded text.
        let shape = DecoderShape {
            batch: 6,
            len: 3 * t + 5,
            heads: 4,
            kv_heads: 2,
            head_dim: 20,
        };
        let lens = [1, t - 1, t, t + 1, 3 * t + 5, 7];
        matches_the_reference_in_every_build(&Inputs::new(shape, 11), &lens, &masks);
    }

    #[test]
    fn soft_capping_matches_at_large_scores() {
        // Scores far past the cap (scale 4 on features of size 2): tanh's
        // both branches, and the cap bounding the exponent.
        let shape = DecoderShape {
            batch: 1,
            len: 70,
            heads: 2,
            kv_heads: 1,
            head_dim: 32,
        };
        let inputs = Inputs::new(shape, 5);
        let mask = DecoderMask {
            softcap: Some(30.0),
            ..CAUSAL
        };
        let want = inputs.reference(&[70], 4.0, mask);
        assert_close(&inputs.run(&[70], 4.0, mask, 1), &want, "soft-capped");
    }

    #[test]
    fn tanh_is_within_float_precision() {
        let mut worst = 0.0f64;
        for i in -40_000..=40_000 {
            let x = i as f32 / 4_000.0;
            for got in [tanh::<false>(x), tanh::<true>(x)] {
                worst = worst.max((got as f64 - (x as f64).tanh()).abs());
            }
        }
        assert!(worst < 3e-7, "worst |diff| {worst:e}");
    }

    #[test]
    fn a_text_gives_the_same_bits_alone_padded_or_batched() {
        let t = KEY_TILE;
        let shape = DecoderShape {
            batch: 3,
            len: 2 * t + 9,
            heads: 3,
            kv_heads: 1,
            head_dim: 16,
        };
        let lens = [2 * t + 9, t + 3, 5];
        let batched = Inputs::new(shape, 3);
        for mask in [
            CAUSAL,
            DecoderMask {
                causal: false,
                window: Some(9),
                softcap: None,
                slopes: None,
                all_rows: false,
            },
            DecoderMask {
                slopes: Some(&SLOPES[..3]),
                all_rows: true,
                ..BIDIRECTIONAL
            },
            DecoderMask {
                window: Some(KEY_TILE / 2),
                all_rows: true,
                ..BIDIRECTIONAL
            },
        ] {
            let together = batched.run(&lens, 0.25, mask, 2);
            let generic =
                crate::dispatch::tests::on_generic_kernels(|| batched.run(&lens, 0.25, mask, 1));
            for (b, &n) in lens.iter().enumerate() {
                // The text alone at its own length, cut from the batch's q/k/v.
                let single = DecoderShape {
                    batch: 1,
                    len: n,
                    ..shape
                };
                let (hq, hk) = (shape.heads, shape.kv_heads);
                let hd = shape.head_dim;
                let mut alone = Inputs::new(single, 0);
                for h in 0..hq {
                    for i in 0..n {
                        let src = ((b * hq + h) * shape.len + i) * hd;
                        alone.q[(h * n + i) * hd..(h * n + i + 1) * hd]
                            .copy_from_slice(&batched.q[src..src + hd]);
                    }
                }
                for h in 0..hk {
                    for i in 0..n {
                        let src = ((b * shape.len + i) * hk + h) * hd;
                        alone.k[(i * hk + h) * hd..(i * hk + h + 1) * hd]
                            .copy_from_slice(&batched.k[src..src + hd]);
                        let src = ((b * hk + h) * shape.len + i) * hd;
                        alone.v[(h * n + i) * hd..(h * n + i + 1) * hd]
                            .copy_from_slice(&batched.v[src..src + hd]);
                    }
                }
                let width = hq * hd;
                crate::dispatch::tests::each_build(|build, threads| {
                    let got = alone.run(&[n], 0.25, mask, threads);
                    // The generic build has no fused multiply-add: bits of its own.
                    let together = if build == "generic" {
                        &generic
                    } else {
                        &together
                    };
                    let rows = &together[b * shape.len * width..(b * shape.len + n) * width];
                    assert!(
                        got.iter()
                            .zip(rows)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "text {b}, {build} build, {threads} threads: other bits than in the batch"
                    );
                });
                // Padding rows are zeros (unless computed).
                let pad = &together[(b * shape.len + n) * width..(b + 1) * shape.len * width];
                assert!(
                    mask.all_rows || pad.iter().all(|&x| x == 0.0),
                    "text {b}'s padding rows"
                );
            }
        }
    }

    /// ALiBi slopes for 4 heads, steep (2^-2) to flat (2^-8) as
    /// jina-bert-v2's run.
    const SLOPES: [f32; 4] = [0.25, 0.0625, 0.015625, 0.00390625];

    const BIDIRECTIONAL: DecoderMask = DecoderMask {
        causal: false,
        window: None,
        softcap: None,
        slopes: None,
        all_rows: false,
    };

    #[test]
    fn encoder_masks_match_a_float64_reference_at_tile_boundaries() {
        let t = KEY_TILE;
        let alibi = DecoderMask {
            slopes: Some(&SLOPES),
            ..BIDIRECTIONAL
        };
        let masks = [
            ("alibi", alibi),
            (
                "alibi, every row",
                DecoderMask {
                    all_rows: true,
                    ..alibi
                },
            ),
            (
                "alibi window",
                DecoderMask {
                    window: Some(t / 2 + 1),
                    ..alibi
                },
            ),
            (
                "symmetric window",
                DecoderMask {
                    window: Some(t / 2),
                    ..BIDIRECTIONAL
                },
            ),
            (
                "symmetric window, every row",
                DecoderMask {
                    window: Some(t / 2),
                    all_rows: true,
                    ..BIDIRECTIONAL
                },
            ),
            (
                "every row",
                DecoderMask {
                    all_rows: true,
                    ..BIDIRECTIONAL
                },
            ),
        ];
        // Lengths around the tile, one past three tiles, padded texts whose
        // rows past the keys (every row) see some keys or, past the
        // window's reach, none.
        let shape = DecoderShape {
            batch: 6,
            len: 3 * t + 5,
            heads: 4,
            kv_heads: 2,
            head_dim: 24,
        };
        let lens = [1, t - 1, t, t + 1, 3 * t + 5, 100];
        matches_the_reference_in_every_build(&Inputs::new(shape, 21), &lens, &masks);
    }

    #[test]
    fn refuses_slopes_that_do_not_fit() {
        let shape = DecoderShape {
            batch: 1,
            len: 4,
            heads: 4,
            kv_heads: 4,
            head_dim: 8,
        };
        let inputs = Inputs::new(shape, 1);
        let mut out = vec![0.0; 4 * 4 * 8];
        for mask in [
            DecoderMask {
                slopes: Some(&SLOPES[..3]),
                ..BIDIRECTIONAL
            },
            DecoderMask {
                slopes: Some(&SLOPES),
                softcap: Some(1.0),
                ..BIDIRECTIONAL
            },
        ] {
            let err = decoder_attention(
                inputs.q(),
                inputs.k(),
                inputs.v(),
                shape,
                &[4],
                1.0,
                mask,
                &mut out,
                1,
            );
            assert!(err.is_err(), "{mask:?}");
        }
    }

    #[test]
    fn a_window_past_the_text_is_no_window() {
        // usize::MAX too (what a Python int may be), which must not wrap.
        let shape = DecoderShape {
            batch: 2,
            len: 2 * KEY_TILE + 6,
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
        };
        let lens = [2 * KEY_TILE + 6, 33];
        let inputs = Inputs::new(shape, 9);
        for causal in [true, false] {
            let plain = DecoderMask {
                causal,
                window: None,
                softcap: None,
                slopes: None,
                all_rows: false,
            };
            let want = inputs.run(&lens, 0.5, plain, 1);
            for w in [2 * KEY_TILE + 5, 10_000, usize::MAX] {
                let mask = DecoderMask {
                    window: Some(w),
                    ..plain
                };
                let got = inputs.run(&lens, 0.5, mask, 1);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "causal {causal}, window {w}"
                );
            }
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_fit() {
        let shape = DecoderShape {
            batch: 1,
            len: 4,
            heads: 3,
            kv_heads: 2,
            head_dim: 8,
        };
        let inputs = Inputs::new(
            DecoderShape {
                kv_heads: 1,
                ..shape
            },
            1,
        );
        let mut out = vec![0.0; 4 * 3 * 8];
        let err = decoder_attention(
            inputs.q(),
            inputs.k(),
            inputs.v(),
            shape,
            &[4],
            1.0,
            CAUSAL,
            &mut out,
            1,
        )
        .unwrap_err();
        assert_eq!(
            err,
            KernelError::Shape("3 query heads are not a multiple of 2 kv heads".into())
        );
        let shape = DecoderShape {
            kv_heads: 1,
            ..shape
        };
        let call = |lens: &[usize], scale: f32, mask: DecoderMask<'_>, out: &mut [f32]| {
            decoder_attention(
                inputs.q(),
                inputs.k(),
                inputs.v(),
                shape,
                lens,
                scale,
                mask,
                out,
                1,
            )
        };
        assert!(
            call(&[5], 1.0, CAUSAL, &mut out).is_err(),
            "length past len"
        );
        assert!(
            call(&[4, 4], 1.0, CAUSAL, &mut out).is_err(),
            "lengths per text"
        );
        assert!(call(&[4], 0.0, CAUSAL, &mut out).is_err(), "scale");
        let capped = DecoderMask {
            softcap: Some(-1.0),
            ..CAUSAL
        };
        assert!(call(&[4], 1.0, capped, &mut out).is_err(), "softcap");
        assert!(call(&[4], 1.0, CAUSAL, &mut out[1..]).is_err(), "out");
        let short = Strided {
            data: &inputs.q[1..],
            ..inputs.q()
        };
        let err = decoder_attention(
            short,
            inputs.k(),
            inputs.v(),
            shape,
            &[4],
            1.0,
            CAUSAL,
            &mut out,
            1,
        );
        assert!(err.is_err(), "q too short");
    }
}
