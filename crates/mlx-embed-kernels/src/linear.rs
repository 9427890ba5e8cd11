//! Linear layers, `out = x @ w^T + bias`, on weights packed once at load.
//!
//! MLX hands its matmuls to the BLAS, which re-packs the whole weight matrix
//! on every call. For the engine's passes (at most a few hundred tokens) that
//! packing is a large share of the work: one short text through MiniLM ran
//! 18 M instructions of OpenBLAS weight packing beside 55 M of its GEMM
//! kernel (callgrind, docs/benchmarks.md), and it streams the weights through
//! memory twice. Here the weights are packed once ([`pack_weights`]) into
//! panels of [`PANEL`] output columns, k-major, so the inner loop reads one
//! contiguous panel row and broadcasts one input value per row of `x`; `x`
//! is read in place (it is small: a pass's tokens times the input width).
//!
//! Every output element is its bias plus the products summed in k order with
//! one fused multiply-add each, whatever the number of rows or the thread
//! split, so a text gets bit-identical results alone or in any batch.

use crate::dispatch::{has_avx512, madd, simd_dispatch};
use crate::gelu::gelu_one;
use crate::KernelError;

/// Output columns per packed panel: two 8-lane registers.
pub const PANEL: usize = 16;

/// Rows of `x` per register tile: 6 x 2 accumulators plus the panel row and
/// the broadcast fill the 16 AVX2 registers.
const ROWS: usize = 6;

/// Rows per tile where AVX-512 is there: a panel row is one 16-lane
/// register, so 12 accumulators leave room in its 32 registers, and each
/// instruction does twice the work (the same multiply-adds in the same
/// order, so the same bits as the AVX2 build).
const ROWS_WIDE: usize = 12;

/// Rows of `x` worked through all panels before the next rows: a multiple
/// of both tile heights, small enough (96 x 1536 floats = 590 KB) to stay
/// in L2 while the weights stream past it from L3.
const ROW_BLOCK: usize = 96;

/// Below this many multiply-adds per thread (~10 µs of work), handing a
/// piece to a helper thread costs more than it saves. With the pool's
/// spinning hand-off, a 14-row [384 -> 384] layer (2 M) ran in 36 µs split
/// against 42 µs on one thread.
const MIN_MADDS_PER_THREAD: usize = 1 << 19;

/// Sizes of one [`linear`] call: `x` is `[rows, inputs]`, the weight
/// `[outputs, inputs]`, `out` `[rows, outputs]`, all row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows of `x` and `out` (tokens).
    pub rows: usize,
    /// Width of `x` (the layer's input features).
    pub inputs: usize,
    /// Width of `out` (the layer's output features).
    pub outputs: usize,
}

/// What [`linear`] applies to each output after the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Nothing.
    None,
    /// Exact (erf) GELU, the same function as [`crate::gelu`].
    Gelu,
}

/// Floats that [`pack_weights`] writes for an `[outputs, inputs]` weight.
pub fn packed_len(outputs: usize, inputs: usize) -> usize {
    outputs.div_ceil(PANEL) * inputs * PANEL
}

/// Packs a row-major `[outputs, inputs]` weight (the layout of `nn.Linear`)
/// for [`linear`]: panel `p`, input `k`, lane `j` holds
/// `w[p * PANEL + j, k]` at `(p * inputs + k) * PANEL + j`, zero past the
/// last output.
pub fn pack_weights(
    w: &[f32],
    outputs: usize,
    inputs: usize,
    packed: &mut [f32],
) -> Result<(), KernelError> {
    if w.len() != outputs * inputs {
        return Err(KernelError::Shape(format!(
            "weight has {} floats, expected {outputs} x {inputs}",
            w.len()
        )));
    }
    if packed.len() != packed_len(outputs, inputs) {
        return Err(KernelError::Shape(format!(
            "packed buffer has {} floats, expected {}",
            packed.len(),
            packed_len(outputs, inputs)
        )));
    }
    for (p, panel) in packed.chunks_exact_mut(inputs * PANEL).enumerate() {
        for (k, lanes) in panel.chunks_exact_mut(PANEL).enumerate() {
            for (j, lane) in lanes.iter_mut().enumerate() {
                let o = p * PANEL + j;
                *lane = if o < outputs { w[o * inputs + k] } else { 0.0 };
            }
        }
    }
    Ok(())
}

/// `out[r, o] = act(bias[o] + sum_k x[r, k] * w[o, k])` with `w` packed by
/// [`pack_weights`]; `out` is overwritten. Output panels are split across up
/// to `threads` threads (the caller's included) when the call is big enough.
pub fn linear(
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    shape: LinearShape,
    act: Activation,
    threads: usize,
) -> Result<(), KernelError> {
    let LinearShape {
        rows,
        inputs,
        outputs,
    } = shape;
    if inputs == 0 || outputs == 0 {
        return Err(KernelError::Shape("linear: zero inputs or outputs".into()));
    }
    if x.len() != rows * inputs {
        return Err(KernelError::Shape(format!(
            "x has {} floats, expected {rows} x {inputs}",
            x.len()
        )));
    }
    if out.len() != rows * outputs {
        return Err(KernelError::Shape(format!(
            "out has {} floats, expected {rows} x {outputs}",
            out.len()
        )));
    }
    if packed.len() != packed_len(outputs, inputs) {
        return Err(KernelError::Shape(format!(
            "packed weight has {} floats, expected {} for {outputs} x {inputs}",
            packed.len(),
            packed_len(outputs, inputs)
        )));
    }
    if bias.is_some_and(|b| b.len() != outputs) {
        return Err(KernelError::Shape(format!(
            "bias must have {outputs} floats"
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let panels = outputs.div_ceil(PANEL);
    let by_size = (rows * inputs * outputs) / MIN_MADDS_PER_THREAD;
    let pieces = threads.min(by_size).min(panels).max(1);
    let job = Job {
        x,
        packed,
        bias,
        shape,
        act,
    };
    let dst = OutPtr(out.as_mut_ptr());
    if pieces == 1 {
        // SAFETY: `out` holds rows x outputs floats (checked above) and is
        // borrowed mutably for this whole call.
        unsafe { job.run(dst, 0, panels) };
        return Ok(());
    }
    let per_piece = panels.div_ceil(pieces);
    crate::pool::run(pieces, &|piece| {
        let (first, end) = (piece * per_piece, ((piece + 1) * per_piece).min(panels));
        // SAFETY: as above; each piece writes only the columns of its own
        // panels, so no two threads touch the same float, and `run` returns
        // only when every piece is done.
        unsafe { job.run(dst, first, end) };
    });
    Ok(())
}

/// `out`'s base pointer, shared by the threads of one [`linear`] call, each
/// writing its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used inside `linear`, whose threads write disjoint columns
// while `linear` holds the unique borrow of the buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

struct Job<'a> {
    x: &'a [f32],
    packed: &'a [f32],
    bias: Option<&'a [f32]>,
    shape: LinearShape,
    act: Activation,
}

impl Job<'_> {
    /// Computes the output columns of panels `first..end` for every row.
    ///
    /// # Safety
    /// `out` must point to `rows * outputs` writable floats that nobody else
    /// reads or writes in these columns meanwhile.
    unsafe fn run(&self, out: OutPtr, first: usize, end: usize) {
        let LinearShape {
            rows,
            inputs,
            outputs,
        } = self.shape;
        let wide = has_avx512();
        let step = if wide { ROWS_WIDE } else { ROWS };
        let mut tile = [[0.0f32; PANEL]; ROWS_WIDE];
        // Rows in blocks, panels inside: a block of x stays in L2 while the
        // panels stream past it. With the panels outside, all of x is read
        // again for every panel, and at 256 rows it fell out of L2 beside the
        // output and the weights on this loaded machine (20 GFLOP/s).
        for block in (0..rows).step_by(ROW_BLOCK) {
            let block_end = (block + ROW_BLOCK).min(rows);
            for p in first..end {
                let panel = &self.packed[p * inputs * PANEL..(p + 1) * inputs * PANEL];
                let col = p * PANEL;
                let width = PANEL.min(outputs - col);
                let mut init = [0.0f32; PANEL];
                if let Some(b) = self.bias {
                    init[..width].copy_from_slice(&b[col..col + width]);
                }
                // The first row tile pulls the next panel into L2, one line
                // per line it reads: a whole panel's work ahead, longer than
                // a trip to memory, so a pass that streams the weights from
                // DRAM overlaps the two instead of adding them (one 22-token
                // text: 5.88 -> 5.17 ms, in-process A/B, docs/benchmarks.md).
                let mut next = if p + 1 < end {
                    self.packed[(p + 1) * inputs * PANEL..].as_ptr()
                } else {
                    std::ptr::null()
                };
                // Tiles as even as the rows allow: a short tile runs as long
                // per step as a multiply-add's latency, so 17 rows as 9 + 8
                // beat 12 + 5 (same products in the same order either way).
                let block_rows = block_end - block;
                let tiles = block_rows.div_ceil(step);
                let (base, longer) = (block_rows / tiles, block_rows % tiles);
                let mut r = block;
                for t in 0..tiles {
                    let n = base + usize::from(t < longer);
                    let x = &self.x[r * inputs..(r + n) * inputs];
                    if wide {
                        panel_tile_wide(x, inputs, panel, &init, &mut tile, self.act, next);
                    } else {
                        panel_tile(x, inputs, panel, &init, &mut tile, self.act, next);
                    }
                    next = std::ptr::null();
                    for (i, vals) in tile[..n].iter().enumerate() {
                        // SAFETY: row r + i < rows and col + width <= outputs,
                        // so the range lies inside `out`; the caller owns
                        // these columns.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                out.0.add((r + i) * outputs + col),
                                width,
                            )
                        };
                        dst.copy_from_slice(&vals[..width]);
                    }
                    r += n;
                }
            }
        }
    }
}

/// `tile_rows` for as many rows as `x` holds, from the listed counts (one
/// row otherwise): the row count must be a constant of the register tile.
macro_rules! tile_by_rows {
    ($fma:tt; $($r:literal)*; $x:ident, $inputs:ident, $panel:ident, $init:ident, $tile:ident, $next:ident) => {
        match $x.len() / $inputs {
            $($r => tile_rows::<$fma, $r>($x, $inputs, $panel, $init, $tile, $next),)*
            _ => tile_rows::<$fma, 1>($x, $inputs, $panel, $init, $tile, $next),
        }
    };
}

simd_dispatch! {
    fn panel_tile<FMA>(
        x: &[f32],
        inputs: usize,
        panel: &[f32],
        init: &[f32; PANEL],
        tile: &mut [[f32; PANEL]; ROWS_WIDE],
        act: Activation,
        next: *const f32,
    ) {
        #[cfg(target_arch = "x86_64")]
        if FMA {
            // SAFETY: FMA is true only in the builds for AVX2+FMA or wider,
            // which run where the CPU has them.
            unsafe { avx2_tile(x, inputs, panel, init, tile, next) };
        } else {
            tile_by_rows!(FMA; 6 5 4 3 2; x, inputs, panel, init, tile, next);
        }
        // Off x86-64 only the generic build exists.
        #[cfg(not(target_arch = "x86_64"))]
        tile_by_rows!(FMA; 6 5 4 3 2; x, inputs, panel, init, tile, next);
        if act == Activation::Gelu {
            for row in tile.iter_mut() {
                for v in row.iter_mut() {
                    *v = gelu_one::<FMA>(*v);
                }
            }
        }
    }
}

/// [`panel_tile`] for up to [`ROWS_WIDE`] rows, built for AVX-512; only
/// called where [`has_avx512`] said yes.
fn panel_tile_wide(
    x: &[f32],
    inputs: usize,
    panel: &[f32],
    init: &[f32; PANEL],
    tile: &mut [[f32; PANEL]; ROWS_WIDE],
    act: Activation,
    next: *const f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn wide(
            x: &[f32],
            inputs: usize,
            panel: &[f32],
            init: &[f32; PANEL],
            tile: &mut [[f32; PANEL]; ROWS_WIDE],
            act: Activation,
            next: *const f32,
        ) {
            tile_by_rows!(true; 12 11 10 9 8 7 6 5 4 3 2; x, inputs, panel, init, tile, next);
            if act == Activation::Gelu {
                for row in tile.iter_mut() {
                    for v in row.iter_mut() {
                        *v = gelu_one::<true>(*v);
                    }
                }
            }
        }
        // SAFETY: callers check has_avx512() (AVX-512F, AVX2 and FMA) first.
        unsafe { wide(x, inputs, panel, init, tile, act, next) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    panel_tile(x, inputs, panel, init, tile, act, next)
}

/// [`tile_rows`] for up to [`ROWS`] rows in AVX2 registers, written with
/// the intrinsics: the portable loop, compiled for AVX2, kept six row
/// lengths for its bounds checks, which pushed row pointers onto the stack
/// and the panel row into every multiply-add's memory operand (22 loads per
/// 12 multiply-adds: 84 GFLOP/s on one Zen 5 core, where OpenBLAS's AVX2
/// GEMM makes 127). Here the panel row sits in two registers and each row's
/// value is broadcast once: 8 loads per 12 multiply-adds. The same fused
/// multiply-adds in the same k order as [`tile_rows`], so the same bits.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_tile(
    x: &[f32],
    inputs: usize,
    panel: &[f32],
    init: &[f32; PANEL],
    tile: &mut [[f32; PANEL]; ROWS_WIDE],
    next: *const f32,
) {
    match x.len() / inputs {
        6 => avx2_rows::<6>(x, inputs, panel, init, tile, next),
        5 => avx2_rows::<5>(x, inputs, panel, init, tile, next),
        4 => avx2_rows::<4>(x, inputs, panel, init, tile, next),
        3 => avx2_rows::<3>(x, inputs, panel, init, tile, next),
        2 => avx2_rows::<2>(x, inputs, panel, init, tile, next),
        _ => avx2_rows::<1>(x, inputs, panel, init, tile, next),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_rows<const R: usize>(
    x: &[f32],
    inputs: usize,
    panel: &[f32],
    init: &[f32; PANEL],
    tile: &mut [[f32; PANEL]; ROWS_WIDE],
    next: *const f32,
) {
    use std::arch::x86_64::{
        _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_storeu_ps,
    };
    // Checked once here instead of per step.
    assert!(R <= ROWS && x.len() >= R * inputs && panel.len() == inputs * PANEL);
    let (x, panel) = (x.as_ptr(), panel.as_ptr());
    // SAFETY (every pointer below): r < R rows of `inputs` floats in x,
    // k < inputs panel rows of PANEL (= 16) floats, init and tile rows of 16.
    let mut lo = [_mm256_loadu_ps(init.as_ptr()); R];
    let mut hi = [_mm256_loadu_ps(init.as_ptr().add(8)); R];
    for k in 0..inputs {
        if !next.is_null() {
            prefetch(next.wrapping_add(k * PANEL));
        }
        let w_lo = _mm256_loadu_ps(panel.add(k * PANEL));
        let w_hi = _mm256_loadu_ps(panel.add(k * PANEL + 8));
        for r in 0..R {
            let a = _mm256_broadcast_ss(&*x.add(r * inputs + k));
            lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(tile[r].as_mut_ptr(), lo[r]);
        _mm256_storeu_ps(tile[r].as_mut_ptr().add(8), hi[r]);
    }
}

/// A hint to bring the line at `p` into the cache; never dereferences it.
#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it does not fault on any address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The register tile: `R` rows of `x` against one panel, k in order; with
/// a non-null `next`, each step also prefetches the line `next` holds at
/// the same step.
#[inline(always)]
fn tile_rows<const FMA: bool, const R: usize>(
    x: &[f32],
    inputs: usize,
    panel: &[f32],
    init: &[f32; PANEL],
    tile: &mut [[f32; PANEL]; ROWS_WIDE],
    next: *const f32,
) {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[r * inputs..(r + 1) * inputs]);
    let mut acc = [*init; R];
    for (k, lanes) in panel.chunks_exact(PANEL).enumerate() {
        if !next.is_null() {
            prefetch(next.wrapping_add(k * PANEL));
        }
        let lanes: &[f32; PANEL] = lanes.try_into().expect("chunks_exact yields PANEL floats");
        for r in 0..R {
            let a = rows[r][k];
            for j in 0..PANEL {
                acc[r][j] = madd::<FMA>(a, lanes[j], acc[r][j]);
            }
        }
    }
    tile[..R].copy_from_slice(&acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_avx512_and_avx2_builds_give_the_same_bits() {
        let s = LinearShape {
            rows: 29,
            inputs: 70,
            outputs: 45,
        };
        let x = values(29 * 70, 9);
        let w = values(45 * 70, 10);
        let b = values(45, 11);
        let pw = packed(&w, 45, 70);
        let mut wide = vec![0.0; 29 * 45];
        let mut narrow = vec![0.0; 29 * 45];
        linear(&x, &pw, Some(&b), &mut wide, s, Activation::Gelu, 1).unwrap();
        crate::dispatch::tests::on_avx2_kernels(|| {
            linear(&x, &pw, Some(&b), &mut narrow, s, Activation::Gelu, 1).unwrap()
        });
        assert_eq!(wide, narrow);
    }

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, s: LinearShape) -> Vec<f64> {
        let mut out = vec![0.0f64; s.rows * s.outputs];
        for r in 0..s.rows {
            for o in 0..s.outputs {
                let mut acc = bias.map_or(0.0, |b| b[o] as f64);
                for k in 0..s.inputs {
                    acc += x[r * s.inputs + k] as f64 * w[o * s.inputs + k] as f64;
                }
                out[r * s.outputs + o] = acc;
            }
        }
        out
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0) * 0.5)
            .collect()
    }

    fn packed(w: &[f32], outputs: usize, inputs: usize) -> Vec<f32> {
        let mut p = vec![f32::NAN; packed_len(outputs, inputs)];
        pack_weights(w, outputs, inputs, &mut p).unwrap();
        p
    }

    #[test]
    fn matches_a_float64_matmul_on_ragged_shapes() {
        // Rows not a multiple of the tile, outputs not a multiple of a panel,
        // and one shape big enough to be split across threads.
        for (rows, inputs, outputs) in [(1, 3, 1), (7, 33, 17), (13, 64, 40), (70, 384, 200)] {
            let s = LinearShape {
                rows,
                inputs,
                outputs,
            };
            let x = values(rows * inputs, 1);
            let w = values(outputs * inputs, 2);
            let b = values(outputs, 3);
            let pw = packed(&w, outputs, inputs);
            for bias in [None, Some(&b[..])] {
                let want = reference(&x, &w, bias, s);
                crate::dispatch::tests::each_build(|build, threads| {
                    let mut out = vec![f32::NAN; rows * outputs];
                    linear(&x, &pw, bias, &mut out, s, Activation::None, threads).unwrap();
                    for (i, (&g, &e)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{build} x{threads} {s:?} at {i}: {g} vs {e}"
                        );
                    }
                });
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_and_in_any_batch() {
        // Row counts whose tiles come out uneven on every build (12 + 11,
        // 9 + 8, 7 + 6; 6 + 6 + 6 + 5, ...).
        let (inputs, outputs) = (96, 50);
        let x = values(23 * inputs, 4);
        let w = values(outputs * inputs, 5);
        let b = values(outputs, 6);
        let pw = packed(&w, outputs, inputs);
        crate::dispatch::tests::each_build(|build, threads| {
            for rows in [23, 17, 13] {
                let all = LinearShape {
                    rows,
                    inputs,
                    outputs,
                };
                let mut batch = vec![0.0; rows * outputs];
                let x = &x[..rows * inputs];
                linear(x, &pw, Some(&b), &mut batch, all, Activation::Gelu, threads).unwrap();
                for r in 0..rows {
                    let one = LinearShape {
                        rows: 1,
                        inputs,
                        outputs,
                    };
                    let mut alone = vec![0.0; outputs];
                    linear(
                        &x[r * inputs..(r + 1) * inputs],
                        &pw,
                        Some(&b),
                        &mut alone,
                        one,
                        Activation::Gelu,
                        1,
                    )
                    .unwrap();
                    assert_eq!(
                        alone[..],
                        batch[r * outputs..(r + 1) * outputs],
                        "{build}: row {r} of {rows}"
                    );
                }
            }
        });
    }

    #[test]
    fn gelu_epilogue_equals_the_gelu_kernel() {
        let s = LinearShape {
            rows: 9,
            inputs: 40,
            outputs: 33,
        };
        let x = values(9 * 40, 7);
        let w = values(33 * 40, 8);
        let pw = packed(&w, 33, 40);
        let mut plain = vec![0.0; 9 * 33];
        let mut fused = vec![0.0; 9 * 33];
        linear(&x, &pw, None, &mut plain, s, Activation::None, 1).unwrap();
        linear(&x, &pw, None, &mut fused, s, Activation::Gelu, 1).unwrap();
        crate::gelu(&mut plain, 1);
        assert_eq!(plain, fused);
    }

    #[test]
    fn refuses_mismatched_buffers() {
        let s = LinearShape {
            rows: 2,
            inputs: 4,
            outputs: 3,
        };
        let pw = packed(&values(12, 1), 3, 4);
        let mut out = vec![0.0; 6];
        let x = values(8, 2);
        assert!(linear(&x[..7], &pw, None, &mut out, s, Activation::None, 1).is_err());
        assert!(linear(&x, &pw[..10], None, &mut out, s, Activation::None, 1).is_err());
        assert!(linear(&x, &pw, Some(&[0.0; 2]), &mut out, s, Activation::None, 1).is_err());
        assert!(linear(&x, &pw, None, &mut out[..5], s, Activation::None, 1).is_err());
        assert!(pack_weights(&values(11, 1), 3, 4, &mut vec![0.0; 64]).is_err());
    }
}
