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
    // What the virtualenv gave: why it added nothing, where that is known.
    static PATHS_SET: PyOnceLock<Option<String>> = PyOnceLock::new();
    Python::initialize();
    Python::attach(|py| {
        let mut first = false;
        let venv_note = PATHS_SET.get_or_try_init(py, || {
            first = true;
            match find_virtualenv() {
                Some(venv) => add_virtualenv(py, &venv),
                None => Ok(None),
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
                    venv: venv_note
                        .as_ref()
                        .map_or_else(String::new, |note| format!("; {note}")),
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

/// Why `workers` engine workers, given as `setting` (a flag's name, say),
/// are more than this process takes, or `None` where they are not: the
/// engine's `mlx_embed.workers.refusal`, the one owner of the bound (4 per
/// core this process may run on, fewer where a container's CPU quota grants
/// fewer, 256 at most) that `load(workers=)` and `MLX_EMBED_WORKERS` are
/// checked by too. A server asks it before any model loads, rather than
/// count cores itself.
pub fn workers_refusal(setting: &str, workers: usize) -> Result<Option<String>, BridgeError> {
    ensure_python()?;
    Python::attach(|py| {
        Ok(py
            .import("mlx_embed.workers")?
            .getattr("refusal")?
            .call1((setting, workers))?
            .extract()?)
    })
}

/// The name `mlx_embed.load(model)` serves a model under
/// (`mlx_embed.loading.served_name`; `None` is the default model), known
/// before it loads: a server can refuse two models of one name before
/// loading either.
pub fn served_name(model: Option<&str>) -> Result<String, BridgeError> {
    ensure_python()?;
    Python::attach(|py| {
        Ok(py
            .import("mlx_embed.loading")?
            .getattr("served_name")?
            .call1((model,))?
            .extract()?)
    })
}

/// The folder `mlx_embed.load(model)` would load from, by
/// `mlx_embed.hub.resolve_model`: a local folder as it is, a Hugging Face
/// repo id as its snapshot in the cache `cache_dir` (default: the
/// environment's, as huggingface_hub finds it) at `revision` (a branch, tag
/// or commit; default `main`), downloaded first unless `HF_HUB_OFFLINE` is
/// set. The bundled model's names, and a path that is not there and cannot
/// be a repo id, come back as they are. One owner of what a name means: a
/// server resolves each model once, then loads, names and tokenizes from the
/// folder this returns.
pub fn resolve_model(
    model: &str,
    revision: Option<&str>,
    cache_dir: Option<&Path>,
) -> Result<String, BridgeError> {
    ensure_python()?;
    Python::attach(|py| {
        let hub = py.import("mlx_embed.hub")?;
        let cache_dir = cache_dir.map(|p| p.to_string_lossy().into_owned());
        match hub
            .getattr("resolve_model")?
            .call1((model, revision, cache_dir))
        {
            Ok(folder) => Ok(folder.extract()?),
            Err(err) if err.is_instance(py, &hub.getattr("ModelNotFound")?) => {
                let value = err.value(py);
                Err(BridgeError::ModelNotFound {
                    name: value.getattr("name")?.extract()?,
                    why: value.getattr("why")?.extract()?,
                })
            }
            Err(err) => Err(err.into()),
        }
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
/// Returns why the venv added nothing, where the reason is known: a venv
/// holds packages for its own Python version only, and a program built
/// against another (PyO3 links the `PYO3_PYTHON` it was built with) finds
/// no site-packages of its version there.
fn add_virtualenv(py: Python<'_>, venv: &Path) -> Result<Option<String>, BridgeError> {
    let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg")).unwrap_or_default();
    let setting = |key: &str| {
        cfg.lines().find_map(|line| {
            let (k, v) = line.split_once('=')?;
            (k.trim().eq_ignore_ascii_case(key)).then(|| v.trim().to_owned())
        })
    };
    let include_system =
        setting("include-system-site-packages").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let locals = PyDict::new(py);
    locals.set_item("venv", venv.to_string_lossy().as_ref())?;
    locals.set_item("include_system", include_system)?;
    py.run(
        c"import os, platform, site, sys
version = platform.python_version()
site_packages = os.path.join(venv, 'lib', f'python{sys.version_info[0]}.{sys.version_info[1]}', 'site-packages')
added = []
already = site_packages in sys.path
if os.path.isdir(site_packages) and not already:
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
    if !added.is_empty() {
        tracing::info!(venv = %venv.display(), "using virtualenv packages");
        return Ok(None);
    }
    // Inside the venv's own python (`mlx-embed serve`) its packages are on the
    // path already: nothing to add, and nothing to warn of.
    let already: bool = locals
        .get_item("already")?
        .map(|a| a.extract())
        .transpose()?
        .unwrap_or(false);
    if already {
        tracing::debug!(venv = %venv.display(), "virtualenv packages already on the path");
        return Ok(None);
    }
    let text = |name: &str| -> Result<String, BridgeError> {
        Ok(locals
            .get_item(name)?
            .map(|s| s.extract())
            .transpose()?
            .unwrap_or_default())
    };
    let (site_packages, ours) = (text("site_packages")?, text("version")?);
    let note = if Path::new(&site_packages).is_dir() {
        format!("the virtualenv {} added no packages", venv.display())
    } else {
        let theirs = setting("version")
            .or_else(|| setting("version_info"))
            .unwrap_or_else(|| "another version".into());
        format!(
            "the virtualenv {} has no {site_packages}: it holds packages for Python {theirs}, \
             and this program embeds Python {ours} (build it with PYO3_PYTHON={}/bin/python)",
            venv.display(),
            venv.display()
        )
    };
    tracing::warn!(venv = %venv.display(), "{note}");
    Ok(Some(note))
}

/// Sends the Python model code's log records (the `mlx_embed` logger's) to
/// `tracing`, at their own level, so the host's log filter and format cover
/// them: left to Python, a server started with `--log-format json` printed
/// its model's warnings (a slow quantized backend) to stderr as bare lines.
/// Idempotent. A server calls it once the interpreter runs; a Rust program
/// that embeds the model may call it too (a Python program keeps its own
/// `logging` setup: nothing calls this there).
pub fn forward_python_logging() -> Result<(), BridgeError> {
    ensure_python()?;
    Python::attach(|py| {
        let sink = pyo3::types::PyCFunction::new_closure(
            py,
            Some(c"to_tracing"),
            None,
            |args, _kwargs| -> PyResult<()> {
                let (level, logger, message): (u32, String, String) = args.extract()?;
                match level {
                    40.. => tracing::error!(logger, "{message}"),
                    30..=39 => tracing::warn!(logger, "{message}"),
                    20..=29 => tracing::info!(logger, "{message}"),
                    10..=19 => tracing::debug!(logger, "{message}"),
                    _ => tracing::trace!(logger, "{message}"),
                }
                Ok(())
            },
        )?;
        // Records below what `tracing` lets through are not even formatted.
        let level = match tracing::level_filters::LevelFilter::current() {
            tracing::level_filters::LevelFilter::TRACE => 1,
            tracing::level_filters::LevelFilter::DEBUG => 10,
            tracing::level_filters::LevelFilter::INFO => 20,
            tracing::level_filters::LevelFilter::WARN => 30,
            tracing::level_filters::LevelFilter::ERROR => 40,
            _ => 100,
        };
        let locals = PyDict::new(py);
        locals.set_item("sink", sink)?;
        locals.set_item("level", level)?;
        py.run(
            c"import logging
log = logging.getLogger('mlx_embed')
if not getattr(log, '_mlx_embed_to_tracing', False):
    class ToTracing(logging.Handler):
        def emit(self, record):
            try:
                sink(record.levelno, record.name, self.format(record))
            except Exception:
                self.handleError(record)
    log.addHandler(ToTracing())
    log.propagate = False
    log._mlx_embed_to_tracing = True
log.setLevel(level)
",
            Some(&locals),
            None,
        )?;
        Ok(())
    })
}
