//! `mlx_embed._native.unit_rows_`: the server's normalization
//! (`mlx_embed_core::l2_normalize`) for the Python library, so a vector the
//! library answers is the server's to the last bit.

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

pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(unit_rows_py, module)?)
}
