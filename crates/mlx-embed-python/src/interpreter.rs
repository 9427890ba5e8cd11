//! Starting (or joining) the Python interpreter and finding the project's packages.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::BridgeError;

/// Makes sure an interpreter is running and `mlx_embed` is importable.
///
/// Inside a Python process this only checks the import. In a Rust program it
/// starts the interpreter, then adds the site-packages of the virtualenv named
/// by `VIRTUAL_ENV`, or else of the first `pyvenv.cfg` found beside or above the
/// running binary (so `target/release/x` of a checkout finds `./.venv`).
/// It fails fast, logging `sys.prefix`, when `mlx_embed` still cannot be imported.
pub fn ensure_python() -> Result<(), BridgeError> {
    Python::initialize();
    Python::attach(|py| {
        if let Some(venv) = find_virtualenv() {
            add_virtualenv(py, &venv)?;
        }
        let sys = py.import("sys")?;
        let prefix: String = sys.getattr("prefix")?.extract()?;
        tracing::info!(sys_prefix = %prefix, "python interpreter ready");
        match py.import("mlx_embed") {
            Ok(_) => Ok(()),
            Err(err) => {
                let path = sys.getattr("path")?.str()?.to_string();
                tracing::error!(sys_prefix = %prefix, "mlx_embed is not importable");
                Err(BridgeError::NotImportable { message: err.to_string(), prefix, path })
            }
        }
    })
}

fn find_virtualenv() -> Option<PathBuf> {
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(venv));
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).find_map(|dir| {
        [dir.to_path_buf(), dir.join(".venv")].into_iter().find(|candidate| candidate.join("pyvenv.cfg").is_file())
    })
}

/// `site.addsitedir` rather than PYTHONPATH so `.pth` files (editable installs) are honoured.
fn add_virtualenv(py: Python<'_>, venv: &Path) -> Result<(), BridgeError> {
    let sys = py.import("sys")?;
    let version = sys.getattr("version_info")?;
    let (major, minor): (u32, u32) = (version.getattr("major")?.extract()?, version.getattr("minor")?.extract()?);
    let site_packages = venv.join("lib").join(format!("python{major}.{minor}")).join("site-packages");
    if !site_packages.is_dir() {
        tracing::warn!(venv = %venv.display(), "virtualenv has no site-packages for python {major}.{minor}");
        return Ok(());
    }
    let site_packages = site_packages.to_string_lossy().into_owned();
    let path = sys.getattr("path")?.cast_into::<PyList>().map_err(|e| BridgeError::Python(e.to_string()))?;
    if !path.contains(&site_packages)? {
        py.import("site")?.call_method1("addsitedir", (&site_packages,))?;
        tracing::info!(site_packages = %site_packages, "added virtualenv packages");
    }
    Ok(())
}
