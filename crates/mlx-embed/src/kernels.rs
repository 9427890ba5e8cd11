//! `mlx_embed._native.masked_softmax_`, `gelu_` and `add_layer_norm_`: the
//! CPU kernels of `mlx-embed-kernels` over a writable float32 buffer (in the
//! engine, a NumPy view of an evaluated MLX array), run outside the GIL so
//! the engine's other MLX worker keeps going meanwhile.

use mlx_embed_kernels::{add_layer_norm, gelu, masked_softmax, SoftmaxShape};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A writable, C-contiguous float32 buffer: the only layout the kernels take.
fn writable_f32(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<f32>> {
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
fn with_floats_detached<R: Send>(
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

/// `add_layer_norm_(x, residual, weight, bias, eps, threads=1)`: in place,
/// `x = layer_norm(x + residual) * weight + bias` over rows of `weight.size`.
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

fn byte_range(buf: &PyBuffer<f32>) -> (usize, usize) {
    let start = buf.buf_ptr() as usize;
    (start, start + buf.len_bytes())
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(masked_softmax_py, module)?)?;
    module.add_function(wrap_pyfunction!(gelu_py, module)?)?;
    module.add_function(wrap_pyfunction!(add_layer_norm_py, module)?)?;
    module.add("kernel_simd", mlx_embed_kernels::simd_level())?;
    Ok(())
}
