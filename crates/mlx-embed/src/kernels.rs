//! `mlx_embed._native.masked_softmax_`,
//! `gelu_`, `gated_linear_unit_`, `add_layer_norm_`,
//! `attention_`, `decoder_attention_`, `linear_` (with `pack_linear_weights`) and
//! `post_ln_encoder_`: the CPU kernels of
//! `mlx-embed-kernels` over float32 buffers (in the engine, NumPy views of
//! evaluated MLX arrays), run outside the GIL so the engine's other MLX
//! worker keeps going meanwhile.

use mlx_embed_kernels::{
    add_layer_norm, attention, decoder_attention, gated_linear_unit, gelu, linear, masked_softmax,
    pack_weights, packed_len, post_ln_encoder, Activation, AttentionShape, DecoderMask,
    DecoderShape, GateActivation, LinearShape, Norm, PackedLinear, PostLnBlock, SoftmaxShape,
    Strided,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A writable, C-contiguous float32 buffer: the only layout the kernels take.
pub(crate) fn writable_f32(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<f32>> {
    let buf = PyBuffer::<f32>::get(obj)?;
    if buf.readonly() {
        return Err(PyValueError::new_err("buffer is read-only"));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be C-contiguous"));
    }
    Ok(buf)
}

/// A C-contiguous float32 buffer the kernel only reads.
fn readable_f32(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<f32>> {
    let buf = PyBuffer::<f32>::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be C-contiguous"));
    }
    Ok(buf)
}

/// Runs `work` on the buffer's floats with the GIL released.
pub(crate) fn with_floats_detached<R: Send>(
    py: Python<'_>,
    buf: &PyBuffer<f32>,
    work: impl FnOnce(&mut [f32]) -> R + Send,
) -> R {
    let (addr, len) = (buf.buf_ptr() as usize, buf.item_count());
    py.detach(move || {
        // SAFETY: `buf` holds the exporter's buffer export for this whole
        // call, so the memory stays allocated and un-resized; it was checked
        // writable, contiguous float32 of `len` items. Python code racing on
        // the same array would see torn values, as with any NumPy ufunc that
        // releases the GIL, but memory safety does not depend on it.
        let floats = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, len) };
        work(floats)
    })
}

/// Runs `work` on `written`'s floats with the GIL released, handing it
/// `read`'s floats too; refuses buffers that share memory (`names`: how the
/// error calls the two, written first).
fn with_input_detached<R: Send>(
    py: Python<'_>,
    written: &Bound<'_, PyAny>,
    read: &Bound<'_, PyAny>,
    names: (&str, &str),
    work: impl FnOnce(&mut [f32], &[f32]) -> R + Send,
) -> PyResult<R> {
    let out = writable_f32(written)?;
    let input = readable_f32(read)?;
    if overlaps(byte_range(&input), byte_range(&out)) {
        return Err(PyValueError::new_err(format!(
            "{} must not share memory with {}",
            names.0, names.1
        )));
    }
    let (addr, len) = (input.buf_ptr() as usize, input.item_count());
    Ok(with_floats_detached(py, &out, |floats| {
        // SAFETY: `input`'s export lives until this function returns, is
        // contiguous float32 of `len` items, and was checked not to overlap
        // the buffer written.
        let read = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
        work(floats, read)
    }))
}

/// `masked_softmax_(scores, key_lengths, scale, threads=1)`: in place over
/// `scores` shaped `[sequences, ..., keys]`, softmax of `scale * scores` over
/// the last axis with keys at or past `key_lengths[sequence]` set to zero.
#[pyfunction]
#[pyo3(name = "masked_softmax_", signature = (scores, key_lengths, scale, threads = 1))]
fn masked_softmax_py(
    py: Python<'_>,
    scores: &Bound<'_, PyAny>,
    key_lengths: Vec<usize>,
    scale: f32,
    threads: usize,
) -> PyResult<()> {
    let buf = writable_f32(scores)?;
    let dims = buf.shape();
    if dims.len() < 2 {
        return Err(PyValueError::new_err("scores need at least 2 dimensions"));
    }
    let shape = SoftmaxShape {
        sequences: dims[0],
        rows_per_sequence: dims[1..dims.len() - 1].iter().product(),
        row_len: dims[dims.len() - 1],
    };
    with_floats_detached(py, &buf, |floats| {
        masked_softmax(floats, shape, &key_lengths, scale, threads.max(1))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `gelu_(x, threads=1)`: exact (erf) GELU in place.
#[pyfunction]
#[pyo3(name = "gelu_", signature = (x, threads = 1))]
fn gelu_py(py: Python<'_>, x: &Bound<'_, PyAny>, threads: usize) -> PyResult<()> {
    let buf = writable_f32(x)?;
    with_floats_detached(py, &buf, |floats| gelu(floats, threads.max(1)));
    Ok(())
}

/// `gated_linear_unit_(gate, up, activation, threads=1)`: in place,
/// `gate = act(gate) * up` with `activation` "silu" (SwiGLU) or "gelu_tanh"
/// (GeGLU), element by element over flat buffers of equal length (the
/// caller checks shapes).
#[pyfunction]
#[pyo3(name = "gated_linear_unit_", signature = (gate, up, activation, threads = 1))]
fn gated_linear_unit_py(
    py: Python<'_>,
    gate: &Bound<'_, PyAny>,
    up: &Bound<'_, PyAny>,
    activation: &str,
    threads: usize,
) -> PyResult<()> {
    let activation = match activation {
        "silu" => GateActivation::Silu,
        "gelu_tanh" => GateActivation::GeluTanh,
        other => {
            return Err(PyValueError::new_err(format!(
                "activation must be 'silu' or 'gelu_tanh', got {other:?}"
            )))
        }
    };
    with_input_detached(py, gate, up, ("gate", "up"), |floats, up| {
        gated_linear_unit(floats, up, activation, threads.max(1))
    })?
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `add_layer_norm_(x, residual, weight, bias, eps, threads=1)`: in place,
/// `x = layer_norm(x + residual) * weight + bias` over rows of `weight.size`;
/// `residual`'s rows repeat over `x`'s where it has fewer (position rows
/// over a batch of sequences).
#[pyfunction]
#[pyo3(name = "add_layer_norm_", signature = (x, residual, weight, bias, eps, threads = 1))]
fn add_layer_norm_py(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    bias: &Bound<'_, PyAny>,
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    let out = writable_f32(x)?;
    let inputs = [
        readable_f32(residual)?,
        readable_f32(weight)?,
        readable_f32(bias)?,
    ];
    let out_range = byte_range(&out);
    if inputs.iter().any(|b| overlaps(byte_range(b), out_range)) {
        return Err(PyValueError::new_err(
            "x must not share memory with the other arguments",
        ));
    }
    let [residual, weight, bias] = inputs.map(|b| (b.buf_ptr() as usize, b.item_count()));
    with_floats_detached(py, &out, |floats| {
        // SAFETY: the three input exports live until this function returns,
        // are contiguous float32 of the given lengths, and were checked not
        // to overlap the one buffer written.
        let read = |(addr, len): (usize, usize)| unsafe {
            std::slice::from_raw_parts(addr as *const f32, len)
        };
        add_layer_norm(
            floats,
            read(residual),
            read(weight),
            read(bias),
            eps,
            threads.max(1),
        )
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `linear_packed_len(outputs, inputs)`: floats `pack_linear_weights` writes.
#[pyfunction]
#[pyo3(name = "linear_packed_len")]
fn linear_packed_len_py(outputs: usize, inputs: usize) -> usize {
    packed_len(outputs, inputs)
}

/// `pack_linear_weights(w, outputs, inputs, packed)`: packs a row-major
/// `[outputs, inputs]` weight into `packed` (`linear_packed_len` floats) for
/// `linear_`; once per layer, at load.
#[pyfunction]
#[pyo3(name = "pack_linear_weights")]
fn pack_linear_weights_py(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    outputs: usize,
    inputs: usize,
    packed: &Bound<'_, PyAny>,
) -> PyResult<()> {
    with_input_detached(py, packed, w, ("packed", "w"), |floats, w| {
        pack_weights(w, outputs, inputs, floats)
    })?
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `linear_(x, packed, bias, out, inputs, outputs, gelu=False, threads=1)`:
/// `out = x @ w^T + bias` (then exact GELU if `gelu`) over rows of `inputs`
/// floats, `w` packed by `pack_linear_weights`; `bias` may be None; `out`
/// (rows x `outputs` floats) is overwritten.
#[pyfunction]
#[pyo3(name = "linear_", signature = (x, packed, bias, out, inputs, outputs, gelu = false, threads = 1))]
#[allow(clippy::too_many_arguments)]
fn linear_py(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    packed: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    inputs: usize,
    outputs: usize,
    gelu: bool,
    threads: usize,
) -> PyResult<()> {
    let dst = writable_f32(out)?;
    let mut reads = vec![readable_f32(x)?, readable_f32(packed)?];
    if let Some(b) = bias {
        reads.push(readable_f32(b)?);
    }
    let out_range = byte_range(&dst);
    if reads.iter().any(|b| overlaps(byte_range(b), out_range)) {
        return Err(PyValueError::new_err(
            "out must not share memory with the other arguments",
        ));
    }
    if inputs == 0 || reads[0].item_count() % inputs != 0 {
        return Err(PyValueError::new_err(format!(
            "x has {} floats, not whole rows of {inputs}",
            reads[0].item_count()
        )));
    }
    let shape = LinearShape {
        rows: reads[0].item_count() / inputs,
        inputs,
        outputs,
    };
    let views: Vec<(usize, usize)> = reads
        .iter()
        .map(|b| (b.buf_ptr() as usize, b.item_count()))
        .collect();
    let act = if gelu {
        Activation::Gelu
    } else {
        Activation::None
    };
    with_floats_detached(py, &dst, |floats| {
        // SAFETY: the input exports live until this function returns, are
        // contiguous float32 of the given lengths, and were checked not to
        // overlap the one buffer written.
        let read = |(addr, len): (usize, usize)| unsafe {
            std::slice::from_raw_parts(addr as *const f32, len)
        };
        let bias = views.get(2).map(|&v| read(v));
        linear(
            read(views[0]),
            read(views[1]),
            bias,
            floats,
            shape,
            act,
            threads.max(1),
        )
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `attention_(qkv, key_lengths, heads, scale, out, threads=1)`: multi-head
/// attention of `qkv` shaped `[batch, len, 3 * heads * head_dim]` (the fused
/// projection) into `out` shaped `[batch, len, heads * head_dim]`, keys at or
/// past `key_lengths[sequence]` weighted zero.
#[pyfunction]
#[pyo3(name = "attention_", signature = (qkv, key_lengths, heads, scale, out, threads = 1))]
fn attention_py(
    py: Python<'_>,
    qkv: &Bound<'_, PyAny>,
    key_lengths: Vec<usize>,
    heads: usize,
    scale: f32,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let dst = writable_f32(out)?;
    let src = readable_f32(qkv)?;
    if overlaps(byte_range(&src), byte_range(&dst)) {
        return Err(PyValueError::new_err("qkv and out must not share memory"));
    }
    let dims = src.shape();
    if dims.len() != 3 || heads == 0 || dims[2] % (3 * heads) != 0 {
        return Err(PyValueError::new_err(
            "qkv must be [batch, len, 3 * heads * head_dim]",
        ));
    }
    let shape = AttentionShape {
        batch: dims[0],
        len: dims[1],
        heads,
        head_dim: dims[2] / (3 * heads),
    };
    let (addr, len) = (src.buf_ptr() as usize, src.item_count());
    with_floats_detached(py, &dst, |floats| {
        // SAFETY: `src` is a live, contiguous float32 export of `len` items
        // for this whole call, checked not to overlap the buffer written.
        let qkv = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
        attention(qkv, &key_lengths, shape, scale, floats, threads.max(1))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A float32 `[batch, heads, len, head_dim]` buffer in any layout whose
/// features lie side by side at non-negative strides (a NumPy view of a
/// transposed MLX array): its shape, its strides in floats (0 along an axis
/// of one, whose stride an exporter may set to anything) and the span of
/// floats from its first element to one past its last.
fn heads_view(name: &str, buf: &PyBuffer<f32>) -> PyResult<([usize; 4], [usize; 3], usize)> {
    let (dims, strides) = (buf.shape(), buf.strides());
    let item = std::mem::size_of::<f32>() as isize;
    let shape: [usize; 4] = dims.try_into().map_err(|_| {
        PyValueError::new_err(format!("{name} must be [batch, heads, len, head_dim]"))
    })?;
    let used = |i: usize| shape[i] > 1;
    if used(3) && strides[3] != item {
        return Err(PyValueError::new_err(format!(
            "{name}'s features must lie side by side (strides {strides:?})"
        )));
    }
    if (0..3).any(|i| used(i) && (strides[i] < 0 || strides[i] % item != 0)) {
        return Err(PyValueError::new_err(format!(
            "{name}'s strides must be non-negative whole floats (strides {strides:?})"
        )));
    }
    let floats: [usize; 3] = std::array::from_fn(|i| {
        if used(i) {
            (strides[i] / item) as usize
        } else {
            0
        }
    });
    let span = if shape.contains(&0) {
        0
    } else {
        (0..3).map(|i| (shape[i] - 1) * floats[i]).sum::<usize>() + shape[3]
    };
    Ok((shape, floats, span))
}

/// `decoder_attention_(q, k, v, key_lengths, scale, out, causal=True,
/// window=None, softcap=None, slopes=None, all_rows=False, threads=1)`: a
/// decoder's or an encoder's self-attention of q
/// `[batch, heads, len, head_dim]` against k and v `[batch, kv_heads, len,
/// head_dim]` (any strides with the features side by side: the arrays as
/// they lie after RoPE) into `out` `[batch, len, heads * head_dim]`, text
/// `b` over its first `key_lengths[b]` positions (the rest of its rows 0,
/// or with `all_rows` attending to those keys too); `window`: keys at most
/// that many positions from the query; `slopes`: ALiBi's per-head slopes.
#[pyfunction]
#[pyo3(
    name = "decoder_attention_",
    signature = (q, k, v, key_lengths, scale, out, causal = true, window = None, softcap = None, slopes = None, all_rows = false, threads = 1)
)]
#[allow(clippy::too_many_arguments)]
fn decoder_attention_py(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    key_lengths: Vec<usize>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    causal: bool,
    window: Option<usize>,
    softcap: Option<f32>,
    slopes: Option<Vec<f32>>,
    all_rows: bool,
    threads: usize,
) -> PyResult<()> {
    let dst = writable_f32(out)?;
    let bufs = [
        PyBuffer::<f32>::get(q)?,
        PyBuffer::<f32>::get(k)?,
        PyBuffer::<f32>::get(v)?,
    ];
    let mut views = Vec::with_capacity(3);
    for (name, buf) in ["q", "k", "v"].iter().zip(&bufs) {
        let (dims, strides, span) = heads_view(name, buf)?;
        let start = buf.buf_ptr() as usize;
        if overlaps((start, start + span * 4), byte_range(&dst)) {
            return Err(PyValueError::new_err(format!(
                "{name} and out must not share memory"
            )));
        }
        views.push((dims, strides, span, start));
    }
    let (qd, kd, vd) = (views[0].0, views[1].0, views[2].0);
    if kd != vd || qd[0] != kd[0] || qd[2] != kd[2] || qd[3] != kd[3] {
        return Err(PyValueError::new_err(format!(
            "q {qd:?} and k {kd:?}, v {vd:?} must agree on batch, len and head_dim"
        )));
    }
    let shape = DecoderShape {
        batch: qd[0],
        len: qd[2],
        heads: qd[1],
        kv_heads: kd[1],
        head_dim: qd[3],
    };
    let mask = DecoderMask {
        causal,
        window,
        softcap,
        slopes: slopes.as_deref(),
        all_rows,
    };
    with_floats_detached(py, &dst, |floats| {
        let [q, k, v] = std::array::from_fn(|i| {
            let (_, strides, span, start) = views[i];
            // SAFETY: each buffer export in `bufs` lives for this whole call;
            // its floats from the first element span `span` items within the
            // exporter's memory (non-negative strides, checked above), and
            // none overlaps the buffer written.
            let data = unsafe { std::slice::from_raw_parts(start as *const f32, span) };
            Strided {
                data,
                batch: strides[0],
                head: strides[1],
                token: strides[2],
            }
        });
        decoder_attention(
            q,
            k,
            v,
            shape,
            &key_lengths,
            scale,
            mask,
            floats,
            threads.max(1),
        )
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// One block's buffers as `post_ln_encoder_` takes them: heads, scale, then
/// the 14 float arrays and the two epsilons in `PostLnBlock` order.
struct BlockExports {
    heads: usize,
    scale: f32,
    /// qkv (packed, bias), out, attention norm (weight, bias), up, down, ffn norm.
    arrays: Vec<PyBuffer<f32>>,
    eps: [f32; 2],
}

impl BlockExports {
    fn extract(t: &Bound<'_, PyTuple>) -> PyResult<Self> {
        if t.len() != 16 {
            return Err(PyValueError::new_err(format!(
                "a block is 16 items (heads, scale, qkv w/b, out w/b, norm w/b/eps, up w/b, \
                 down w/b, norm w/b/eps), got {}",
                t.len()
            )));
        }
        let mut arrays = Vec::with_capacity(12);
        for i in [2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14] {
            arrays.push(readable_f32(&t.get_item(i)?)?);
        }
        Ok(Self {
            heads: t.get_item(0)?.extract()?,
            scale: t.get_item(1)?.extract()?,
            arrays,
            eps: [t.get_item(8)?.extract()?, t.get_item(15)?.extract()?],
        })
    }

    fn views(&self) -> BlockViews {
        BlockViews {
            heads: self.heads,
            scale: self.scale,
            arrays: self
                .arrays
                .iter()
                .map(|b| (b.buf_ptr() as usize, b.item_count()))
                .collect(),
            eps: self.eps,
        }
    }
}

/// [`BlockExports`] as plain addresses, to cross into the GIL-free closure.
struct BlockViews {
    heads: usize,
    scale: f32,
    arrays: Vec<(usize, usize)>,
    eps: [f32; 2],
}

impl BlockViews {
    /// SAFETY: the exports these were taken from must be alive and not
    /// written while the returned block is used.
    unsafe fn block(&self) -> PostLnBlock<'_> {
        let read = |i: usize| {
            let (addr, len) = self.arrays[i];
            unsafe { std::slice::from_raw_parts(addr as *const f32, len) }
        };
        let linear = |i: usize| PackedLinear {
            packed: read(i),
            bias: read(i + 1),
        };
        PostLnBlock {
            heads: self.heads,
            scale: self.scale,
            qkv: linear(0),
            out: linear(2),
            attention_norm: Norm {
                weight: read(4),
                bias: read(5),
                eps: self.eps[0],
            },
            up: linear(6),
            down: linear(8),
            ffn_norm: Norm {
                weight: read(10),
                bias: read(11),
                eps: self.eps[1],
            },
        }
    }
}

/// `post_ln_encoder_(x, key_lengths, len, blocks, threads=1)`: BERT's
/// post-LN blocks in order over `x` (`[batch, len, dim]`, overwritten), keys
/// at or past `key_lengths[sequence]` weighted zero. Each block is a tuple
/// `(heads, scale, qkv_packed, qkv_bias, out_packed, out_bias, norm1_weight,
/// norm1_bias, norm1_eps, up_packed, up_bias, down_packed, down_bias,
/// norm2_weight, norm2_bias, norm2_eps)`; the linears are packed by
/// `pack_linear_weights` and the up projection gets the exact GELU.
#[pyfunction]
#[pyo3(name = "post_ln_encoder_", signature = (x, key_lengths, len, blocks, threads = 1))]
fn post_ln_encoder_py(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    key_lengths: Vec<usize>,
    len: usize,
    blocks: Vec<Bound<'_, PyTuple>>,
    threads: usize,
) -> PyResult<()> {
    let out = writable_f32(x)?;
    let exports = blocks
        .iter()
        .map(BlockExports::extract)
        .collect::<PyResult<Vec<_>>>()?;
    let out_range = byte_range(&out);
    if exports
        .iter()
        .flat_map(|e| &e.arrays)
        .any(|b| overlaps(byte_range(b), out_range))
    {
        return Err(PyValueError::new_err(
            "x must not share memory with the weights",
        ));
    }
    let views: Vec<BlockViews> = exports.iter().map(BlockExports::views).collect();
    with_floats_detached(py, &out, |floats| {
        // SAFETY: `exports` keeps every weight export alive until this
        // function returns; they are only read, and were checked not to
        // overlap the one buffer written.
        let blocks: Vec<PostLnBlock> = views.iter().map(|v| unsafe { v.block() }).collect();
        post_ln_encoder(floats, &key_lengths, len, &blocks, threads.max(1))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

fn byte_range(buf: &PyBuffer<f32>) -> (usize, usize) {
    let start = buf.buf_ptr() as usize;
    (start, start + buf.len_bytes())
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// `mlx_embed._native.kernel_api`: raised whenever a kernel entry point or
/// argument is added, so `ops.native_available` can tell an extension built
/// from an older tree (it then offers no native path rather than failing a
/// pass). 2: `masked_softmax_positions_(causal=)`; 3: `decoder_attention_`
/// (and `causal=` gone again: the decoders' attention is that kernel's);
/// 4: `decoder_attention_(slopes=, all_rows=)` (the encoders' too;
/// `masked_softmax_positions_` gone).
const KERNEL_API: u32 = 4;

pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    // A mistyped cap fails the import, not silently runs the widest build.
    mlx_embed_kernels::check_simd_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
    module.add_function(wrap_pyfunction!(masked_softmax_py, module)?)?;
    module.add_function(wrap_pyfunction!(gelu_py, module)?)?;
    module.add_function(wrap_pyfunction!(gated_linear_unit_py, module)?)?;
    module.add_function(wrap_pyfunction!(add_layer_norm_py, module)?)?;
    module.add_function(wrap_pyfunction!(linear_packed_len_py, module)?)?;
    module.add_function(wrap_pyfunction!(pack_linear_weights_py, module)?)?;
    module.add_function(wrap_pyfunction!(linear_py, module)?)?;
    module.add_function(wrap_pyfunction!(attention_py, module)?)?;
    module.add_function(wrap_pyfunction!(decoder_attention_py, module)?)?;
    module.add_function(wrap_pyfunction!(post_ln_encoder_py, module)?)?;
    module.add("kernel_simd", mlx_embed_kernels::simd_level())?;
    module.add("kernel_api", KERNEL_API)?;
    Ok(())
}
