//! Starting (or joining) the Python interpreter and finding the project's packages.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

use mlx_embed_core::DeviceKind;

use crate::BridgeError;

/// Makes sure an interpreter is running and `mlx_embed` is importable.
///
/// Inside a Python process this only checks the import. In a Rust program it
/// starts the interpreter, then adds the site-packages of the virtualenv named
/// by `VIRTUAL_ENV`, or else of the first `pyvenv.cfg` found beside or above the
/// running binary (so `target/release/x` of a checkout finds `./.venv`).
/// It fails fast, logging `sys.prefix`, when `mlx_embed` still cannot be imported.
pub fn ensure_python() -> Result<(), BridgeError> {
    // Models load on their own threads, often at once (two models in one
    // server, parallel tests): one of them rewrites `sys.path`, and the
    // others wait for it to finish before they import (an import while
    // `sys.path` was being rewritten failed with ModuleNotFoundError).
    static PATHS_SET: PyOnceLock<()> = PyOnceLock::new();
    Python::initialize();
    Python::attach(|py| {
        let mut first = false;
        PATHS_SET.get_or_try_init(py, || {
            first = true;
            match find_virtualenv() {
                Some(venv) => add_virtualenv(py, &venv),
                None => Ok(()),
            }
        })?;
        let sys = py.import("sys")?;
        let prefix: String = sys.getattr("prefix")?.extract()?;
        if first {
            tracing::info!(sys_prefix = %prefix, "python interpreter ready");
        }
        match py.import("mlx_embed") {
            Ok(_) => Ok(()),
            Err(err) => {
                let path = sys.getattr("path")?.str()?.to_string();
                tracing::error!(sys_prefix = %prefix, "mlx_embed is not importable");
                Err(BridgeError::NotImportable {
                    message: err.to_string(),
                    prefix,
                    path,
                })
            }
        }
    })
}

/// Where MLX computes in this process (`mlx_embed.device.is_cpu()`): the
/// device every model loads onto, known before any is loaded, so a server
/// can pick its batching defaults first.
pub fn default_device() -> Result<DeviceKind, BridgeError> {
    ensure_python()?;
    Python::attach(|py| {
        let on_cpu: bool = py
            .import("mlx_embed.device")?
            .getattr("is_cpu")?
            .call0()?
            .extract()?;
        Ok(if on_cpu {
            DeviceKind::Cpu
        } else {
            DeviceKind::Accelerator
        })
    })
}

fn find_virtualenv() -> Option<PathBuf> {
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(venv));
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).find_map(|dir| {
        [dir.to_path_buf(), dir.join(".venv")]
            .into_iter()
            .find(|candidate| candidate.join("pyvenv.cfg").is_file())
    })
}

/// `site.addsitedir` rather than PYTHONPATH so `.pth` files (editable installs)
/// are honoured; the venv's entries go first, and the base interpreter's own
/// site-packages go away unless the venv asks for them, as in a venv's python.
fn add_virtualenv(py: Python<'_>, venv: &Path) -> Result<(), BridgeError> {
    let include_system = std::fs::read_to_string(venv.join("pyvenv.cfg"))
        .map(|cfg| {
            cfg.lines().any(|l| {
                l.replace(' ', "")
                    .eq_ignore_ascii_case("include-system-site-packages=true")
            })
        })
        .unwrap_or(false);
    let locals = PyDict::new(py);
    locals.set_item("venv", venv.to_string_lossy().as_ref())?;
    locals.set_item("include_system", include_system)?;
    py.run(
        c"import os, site, sys
site_packages = os.path.join(venv, 'lib', f'python{sys.version_info[0]}.{sys.version_info[1]}', 'site-packages')
added = []
if os.path.isdir(site_packages) and site_packages not in sys.path:
    before = list(sys.path)
    system = set(site.getsitepackages()) if not include_system else set()
    site.addsitedir(site_packages)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + [p for p in before if p not in system]
",
        // One dict as globals: comprehensions cannot see exec's separate locals.
        Some(&locals),
        None,
    )?;
    let added: Vec<String> = locals
        .get_item("added")?
        .map(|a| a.extract())
        .transpose()?
        .unwrap_or_default();
    if added.is_empty() {
        tracing::warn!(venv = %venv.display(), "virtualenv added no packages");
    } else {
        tracing::info!(venv = %venv.display(), "using virtualenv packages");
    }
    Ok(())
}
