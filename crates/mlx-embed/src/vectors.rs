//! `mlx_embed._native.unit_rows_` and `scores_`: the server's normalization
//! (`mlx_embed_core::l2_normalize`) and scores from logits
//! (`mlx_embed_core::activate`) for the Python library, so what the library
//! answers is the server's to the last bit.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{with_floats_detached, writable_f32};

/// `unit_rows_(rows)`: in place over a C-contiguous float32 array
/// `[..., width]`, each row of its last axis scaled to unit length.
#[pyfunction]
#[pyo3(name = "unit_rows_")]
fn unit_rows_py(py: Python<'_>, rows: &Bound<'_, PyAny>) -> PyResult<()> {
    let buf = writable_f32(rows)?;
    let width = match buf.shape().last() {
        Some(&w) if w > 0 => w,
        Some(_) => return Ok(()),
        None => return Err(PyValueError::new_err("rows need at least 1 dimension")),
    };
    with_floats_detached(py, &buf, |floats| {
        floats
            .chunks_exact_mut(width)
            .for_each(mlx_embed_core::l2_normalize)
    });
    Ok(())
}

/// `scores_(logits, multi_label)`: in place over a C-contiguous float32
/// array `[n, labels]`, each row's scores (a sigmoid of each label with
/// `multi_label` or one label, else a softmax).
#[pyfunction]
#[pyo3(name = "scores_")]
fn scores_py(py: Python<'_>, logits: &Bound<'_, PyAny>, multi_label: bool) -> PyResult<()> {
    let buf = writable_f32(logits)?;
    let labels = match buf.shape() {
        [_, 0] => return Ok(()),
        [_, labels] => *labels,
        _ => return Err(PyValueError::new_err("logits must be [n, labels]")),
    };
    with_floats_detached(py, &buf, |floats| {
        for row in floats.chunks_exact_mut(labels) {
            if multi_label {
                mlx_embed_core::sigmoid_each(row);
            } else {
                mlx_embed_core::activate(row);
            }
        }
    });
    Ok(())
}

pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(unit_rows_py, module)?)?;
    module.add_function(wrap_pyfunction!(scores_py, module)?)
}
