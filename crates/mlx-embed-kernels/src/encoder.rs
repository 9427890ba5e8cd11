//! A stack of post-LN encoder blocks (BERT's) in one call.
//!
//! Driving the kernels one at a time from Python costs a round trip per
//! kernel: an MLX array in, a NumPy view, the call, a copy into a new MLX
//! array out. A 6-layer model makes 42 of them per pass, which for one short
//! text is about as much time as its attention. Here the same kernels run
//! in the same order on the same buffers' values, so the result is the
//! per-kernel path's to the bit, with the intermediates in this thread's
//! scratch buffers.

use std::cell::RefCell;

use crate::{add_layer_norm, attention, linear, Activation, AttentionShape, KernelError};
use crate::{packed_len, LinearShape};

/// A linear layer's weight, packed by [`crate::pack_weights`], and its bias.
#[derive(Debug, Clone, Copy)]
pub struct PackedLinear<'a> {
    /// `packed_len(outputs, inputs)` floats.
    pub packed: &'a [f32],
    /// `outputs` floats.
    pub bias: &'a [f32],
}

/// A layer norm's scale, shift and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct Norm<'a> {
    /// `dim` floats.
    pub weight: &'a [f32],
    /// `dim` floats.
    pub bias: &'a [f32],
    /// Added to the variance inside the square root.
    pub eps: f32,
}

/// One post-LN block: `x = norm1(x + out(attention(qkv(x))))`, then
/// `x = norm2(x + down(gelu(up(x))))`, GELU exact.
#[derive(Debug, Clone, Copy)]
pub struct PostLnBlock<'a> {
    /// Attention heads.
    pub heads: usize,
    /// The scale on the attention scores (1 / sqrt(head_dim) in BERT).
    pub scale: f32,
    /// `[dim] -> [3 * dim]`: q, k, v side by side.
    pub qkv: PackedLinear<'a>,
    /// `[dim] -> [dim]`.
    pub out: PackedLinear<'a>,
    /// After attention.
    pub attention_norm: Norm<'a>,
    /// `[dim] -> [intermediate]`, GELU fused.
    pub up: PackedLinear<'a>,
    /// `[intermediate] -> [dim]`.
    pub down: PackedLinear<'a>,
    /// After the feed-forward.
    pub ffn_norm: Norm<'a>,
}

thread_local! {
    /// q/k/v, then the attention output's projection and the first norm.
    static QKV: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Merged attention heads.
    static HEADS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The feed-forward's inner activations.
    static INNER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// Runs `blocks` in order over `x` (`[batch, len, dim]`, overwritten with
/// the last block's output); keys at or past `key_lengths[sequence]` get
/// zero attention weight. Each kernel uses up to `threads` threads.
pub fn post_ln_encoder(
    x: &mut [f32],
    key_lengths: &[usize],
    len: usize,
    blocks: &[PostLnBlock<'_>],
    threads: usize,
) -> Result<(), KernelError> {
    let batch = key_lengths.len();
    let rows = batch * len;
    let Some(first) = blocks.first() else {
        return Ok(());
    };
    let dim = first.attention_norm.weight.len();
    if rows == 0 || x.len() != rows * dim {
        return Err(KernelError::Shape(format!(
            "x has {} floats, expected {batch} x {len} x {dim}",
            x.len()
        )));
    }
    for (i, b) in blocks.iter().enumerate() {
        check_block(b, dim).map_err(|e| KernelError::Shape(format!("block {i}: {e}")))?;
    }
    QKV.with_borrow_mut(|qkv_buf| {
        HEADS.with_borrow_mut(|heads_buf| {
            INNER.with_borrow_mut(|inner_buf| {
                // `x @ w^T + bias` of one packed layer, `rows` rows wide.
                let run = |x: &[f32], l: PackedLinear, out: &mut [f32], outputs, act| {
                    let inputs = x.len() / rows;
                    let shape = LinearShape {
                        rows,
                        inputs,
                        outputs,
                    };
                    linear(x, l.packed, Some(l.bias), out, shape, act, threads)
                };
                for b in blocks {
                    let inner = b.up.bias.len();
                    let qkv = sized(qkv_buf, rows * 3 * dim);
                    run(x, b.qkv, qkv, 3 * dim, Activation::None)?;
                    let merged = sized(heads_buf, rows * dim);
                    let att = AttentionShape {
                        batch,
                        len,
                        heads: b.heads,
                        head_dim: dim / b.heads,
                    };
                    attention(qkv, key_lengths, att, b.scale, merged, threads)?;
                    // q/k/v are spent: the projection and first norm reuse them.
                    let x1 = &mut qkv[..rows * dim];
                    run(merged, b.out, x1, dim, Activation::None)?;
                    let n = b.attention_norm;
                    add_layer_norm(x1, x, n.weight, n.bias, n.eps, threads)?;
                    let hidden = sized(inner_buf, rows * inner);
                    run(x1, b.up, hidden, inner, Activation::Gelu)?;
                    // The block's input is spent too: the output goes there.
                    run(hidden, b.down, x, dim, Activation::None)?;
                    let n = b.ffn_norm;
                    add_layer_norm(x, x1, n.weight, n.bias, n.eps, threads)?;
                }
                Ok(())
            })
        })
    })
}

fn check_block(b: &PostLnBlock<'_>, dim: usize) -> Result<(), String> {
    if b.heads == 0 || !dim.is_multiple_of(b.heads) {
        return Err(format!("{} heads do not divide width {dim}", b.heads));
    }
    let inner = b.up.bias.len();
    let linears = [
        ("qkv", b.qkv, 3 * dim, dim),
        ("out", b.out, dim, dim),
        ("up", b.up, inner, dim),
        ("down", b.down, dim, inner),
    ];
    for (name, l, outputs, inputs) in linears {
        if inputs == 0 || l.bias.len() != outputs || l.packed.len() != packed_len(outputs, inputs) {
            return Err(format!(
                "{name} is not a packed [{inputs} -> {outputs}] layer with bias"
            ));
        }
    }
    for (name, n) in [
        ("attention_norm", b.attention_norm),
        ("ffn_norm", b.ffn_norm),
    ] {
        if n.weight.len() != dim || n.bias.len() != dim {
            return Err(format!("{name} must have {dim} weights and biases"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack_weights;

    struct Layer {
        packed: Vec<f32>,
        bias: Vec<f32>,
    }

    fn rand(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    fn pl(l: &Layer) -> PackedLinear<'_> {
        PackedLinear {
            packed: &l.packed,
            bias: &l.bias,
        }
    }

    fn layer(seed: &mut u64, outputs: usize, inputs: usize) -> Layer {
        let w = rand(seed, outputs * inputs, 0.2);
        let mut packed = vec![0.0; packed_len(outputs, inputs)];
        pack_weights(&w, outputs, inputs, &mut packed).unwrap();
        Layer {
            packed,
            bias: rand(seed, outputs, 0.1),
        }
    }

    /// The fused stack equals the kernels called one by one, to the bit.
    #[test]
    fn equals_the_kernels_one_by_one() {
        let (batch, len, dim, inner, heads) = (3, 7, 32, 64, 4);
        let lengths = [7, 3, 5];
        let mut seed = 7;
        let layers: Vec<[Layer; 4]> = (0..2)
            .map(|_| {
                [
                    layer(&mut seed, 3 * dim, dim),
                    layer(&mut seed, dim, dim),
                    layer(&mut seed, inner, dim),
                    layer(&mut seed, dim, inner),
                ]
            })
            .collect();
        let norm_w = rand(&mut seed, dim, 1.0);
        let norm_b = rand(&mut seed, dim, 0.2);
        let norm = Norm {
            weight: &norm_w,
            bias: &norm_b,
            eps: 1e-12,
        };
        let blocks: Vec<PostLnBlock> = layers
            .iter()
            .map(|[qkv, out, up, down]| PostLnBlock {
                heads,
                scale: (dim as f32 / heads as f32).powf(-0.5),
                qkv: pl(qkv),
                out: pl(out),
                attention_norm: norm,
                up: pl(up),
                down: pl(down),
                ffn_norm: norm,
            })
            .collect();
        let x0 = rand(&mut seed, batch * len * dim, 2.0);
        for threads in [1, 2] {
            let mut fused = x0.clone();
            post_ln_encoder(&mut fused, &lengths, len, &blocks, threads).unwrap();

            let mut x = x0.clone();
            let rows = batch * len;
            // One kernel call, one fresh output: the path the engine took
            // before the fused call.
            let lin = |x: &[f32], l: PackedLinear, inputs: usize, outputs: usize, act| {
                let mut out = vec![0.0; rows * outputs];
                let shape = LinearShape {
                    rows,
                    inputs,
                    outputs,
                };
                linear(x, l.packed, Some(l.bias), &mut out, shape, act, 1).unwrap();
                out
            };
            for b in &blocks {
                let qkv = lin(&x, b.qkv, dim, 3 * dim, Activation::None);
                let mut merged = vec![0.0; rows * dim];
                let att = AttentionShape {
                    batch,
                    len,
                    heads,
                    head_dim: dim / heads,
                };
                attention(&qkv, &lengths, att, b.scale, &mut merged, 1).unwrap();
                let mut x1 = lin(&merged, b.out, dim, dim, Activation::None);
                add_layer_norm(&mut x1, &x, norm.weight, norm.bias, norm.eps, 1).unwrap();
                let hidden = lin(&x1, b.up, dim, inner, Activation::Gelu);
                let mut y = lin(&hidden, b.down, inner, dim, Activation::None);
                add_layer_norm(&mut y, &x1, norm.weight, norm.bias, norm.eps, 1).unwrap();
                x = y;
            }
            assert_eq!(fused, x, "threads={threads}");
            assert!(x.iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn refuses_mismatched_shapes() {
        let mut seed = 1;
        let (dim, inner) = (16, 32);
        let [qkv, out, up, down] = [
            layer(&mut seed, 3 * dim, dim),
            layer(&mut seed, dim, dim),
            layer(&mut seed, inner, dim),
            layer(&mut seed, dim, inner),
        ];
        let w = vec![1.0; dim];
        let b = vec![0.0; dim];
        let norm = Norm {
            weight: &w,
            bias: &b,
            eps: 1e-5,
        };
        let block = PostLnBlock {
            heads: 3,
            scale: 0.5,
            qkv: pl(&qkv),
            out: pl(&out),
            attention_norm: norm,
            up: pl(&up),
            down: pl(&down),
            ffn_norm: norm,
        };
        let mut x = vec![0.0; 2 * 4 * dim];
        let err = post_ln_encoder(&mut x, &[4, 2], 4, &[block], 1).unwrap_err();
        assert!(
            err.to_string().contains("3 heads do not divide width 16"),
            "{err}"
        );
        let block = PostLnBlock {
            heads: 4,
            qkv: pl(&out),
            ..block
        };
        let err = post_ln_encoder(&mut x, &[4, 2], 4, &[block], 1).unwrap_err();
        assert!(
            err.to_string().contains("qkv is not a packed [16 -> 48]"),
            "{err}"
        );
        let block = PostLnBlock {
            qkv: pl(&qkv),
            ..block
        };
        let err = post_ln_encoder(&mut x[..10], &[4, 2], 4, &[block], 1).unwrap_err();
        assert!(err.to_string().contains("expected 2 x 4 x 16"), "{err}");
        post_ln_encoder(&mut x, &[4, 2], 4, &[block], 1).unwrap();
    }
}
