//! The bridge's one error type, and how a Python exception becomes a typed
//! [`EmbedderError`].

use mlx_embed_core::{EmbedderError, EmbedderErrorKind};
use mlx_embed_tokenizer::TokenizerError;
use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyImportError, PyNotADirectoryError, PyPermissionError,
};
use pyo3::panic::PanicException;
use pyo3::prelude::*;

/// What can go wrong between Rust and the Python model while loading it.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// `mlx_embed` could not be imported; the message says where Python
    /// looked, and why the virtualenv found gave nothing where that is known.
    #[error("cannot import the Python package `mlx_embed`: {message}{venv} (sys.prefix = {prefix}; sys.path = {path}). Install the project into a virtualenv (`make serve` does) and set VIRTUAL_ENV or run the binary from that virtualenv")]
    NotImportable {
        /// Python's `ImportError` message.
        message: String,
        /// The interpreter's `sys.prefix`.
        prefix: String,
        /// The interpreter's `sys.path`, as Python prints it.
        path: String,
        /// Empty, or `"; "` and why the virtualenv added no packages (one
        /// made for another Python version than the one this program embeds).
        venv: String,
    },
    /// Python raised while loading the model; the kind is the exception's,
    /// by class (see [`EmbedderErrorKind`](mlx_embed_core::EmbedderErrorKind)):
    /// `InvalidOption` for the engine's `mlx_embed.errors.InvalidOption` (a
    /// `load()` keyword argument it cannot take), `InvalidModel` for its
    /// `InvalidModel` (the folder missing, its files making no model, a
    /// package the model needs missing) and for a file of the folder that
    /// is not there or cannot be opened, `EngineUnavailable` for an
    /// `ImportError` the engine leaves untyped (its own), `ModelGone` for a
    /// `BaseException` that is not an `Exception`, `ModelFailure` otherwise
    /// (never `InvalidInput`: a load has no input).
    #[error("python: {0}")]
    Python(EmbedderError),
    /// A model's name is neither a local folder nor a Hugging Face repo id
    /// the cache holds or the Hub gave (`mlx_embed.hub.ModelNotFound`):
    /// `why` says which, and how to fetch it.
    #[error("{name}: {why}")]
    ModelNotFound {
        /// The model as it was named.
        name: String,
        /// Why it was not found, and how to fetch it.
        why: String,
    },
    /// The model answered with something the bridge cannot use.
    #[error("unexpected answer from the model: {0}")]
    Protocol(String),
    /// The model's tokenizer could not be built in Rust.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

impl From<PyErr> for BridgeError {
    fn from(err: PyErr) -> Self {
        BridgeError::Python(Python::attach(|py| classify_load(py, &err)))
    }
}

impl From<BridgeError> for EmbedderError {
    fn from(err: BridgeError) -> Self {
        match err {
            // The model's own message is what a caller needs to see, unprefixed.
            BridgeError::Python(err) => err,
            // Setups to fix, each its own kind so a program acts on it
            // without reading the message: a retry would fail the same way.
            err @ BridgeError::NotImportable { .. } => {
                EmbedderError::new(EmbedderErrorKind::EngineUnavailable, err.to_string())
            }
            // The model's own files: no such model, or a tokenizer that
            // cannot be read or contradicts its spec.
            err @ (BridgeError::Tokenizer(_) | BridgeError::ModelNotFound { .. }) => {
                EmbedderError::new(EmbedderErrorKind::InvalidModel, err.to_string())
            }
            err @ BridgeError::Protocol(_) => EmbedderError::model_failure(err.to_string()),
        }
    }
}

/// [`classify`] for an exception `mlx_embed.load` raised: the engine's
/// typed refusals (`mlx_embed.errors.InvalidOption`, `InvalidModel`) by
/// their class. An `ImportError` the engine leaves untyped is the engine
/// unavailable: the engine types one of a package a model needs
/// (`mlx_embed.errors.MissingDependency`, an `InvalidModel` naming it), so
/// only its own modules or MLX failing to import stay plain. A file the load
/// opens that is missing, not a folder or not readable is the folder's
/// (`InvalidModel`). Nothing at a load is `InvalidInput` or `CutTooShort`,
/// which blame a call's input: an untyped `ValueError` or `TypeError` (or an
/// engine `InvalidInput` reached at load) is the load failing,
/// `ModelFailure`, as a plain one while running is.
pub(crate) fn classify_load(py: Python<'_>, err: &PyErr) -> EmbedderError {
    let message = err.to_string();
    if is_engine_error(py, err, "InvalidOption") {
        EmbedderError::new(EmbedderErrorKind::InvalidOption, message)
    } else if is_engine_error(py, err, "InvalidModel") {
        EmbedderError::new(EmbedderErrorKind::InvalidModel, message)
    } else if err.is_instance_of::<PyImportError>(py) {
        // `mlx_embed` imported, but the engine behind `load()` did not (its
        // MLX backend missing): the engine cannot start, as when the
        // package itself is not there.
        EmbedderError::new(EmbedderErrorKind::EngineUnavailable, message)
    } else if err.is_instance_of::<PyFileNotFoundError>(py)
        || err.is_instance_of::<PyNotADirectoryError>(py)
        || err.is_instance_of::<PyPermissionError>(py)
    {
        EmbedderError::new(EmbedderErrorKind::InvalidModel, message)
    } else {
        let classified = classify(py, err);
        match classified.kind {
            EmbedderErrorKind::InvalidInput | EmbedderErrorKind::CutTooShort => {
                EmbedderError::model_failure(message)
            }
            _ => classified,
        }
    }
}

/// Whether `err` is the engine's exception class `name` (`mlx_embed.errors`).
fn is_engine_error(py: Python<'_>, err: &PyErr, name: &str) -> bool {
    py.import("mlx_embed.errors")
        .and_then(|m| m.getattr(name))
        .is_ok_and(|class| err.is_instance(py, &class))
}

/// A Python exception from the running model as the kind the core acts on,
/// by class: `mlx_embed.errors.CutTooShort` is the request's cut's fault,
/// `mlx_embed.errors.InvalidInput` (the engine's own checks of a call's
/// input) the input's; a `BaseException` that is not an
/// `Exception` (`SystemExit`, `KeyboardInterrupt`) or a Rust panic inside
/// Python means the interpreter cannot be trusted again; anything else is a
/// failure of this batch, a plain `ValueError` too (MLX raises its shape
/// errors as one: an engine bug on some batch, not the caller's to fix).
pub(crate) fn classify(py: Python<'_>, err: &PyErr) -> EmbedderError {
    // `ExceptionClass: message`, as the last line of a Python traceback.
    let message = err.to_string();
    let is = |name: &str| is_engine_error(py, err, name);
    if is("CutTooShort") {
        // The server puts its own field's name before the message.
        EmbedderError::cut_too_short(err.value(py).to_string())
    } else if is("InvalidInput") {
        EmbedderError::invalid_input(message)
    } else if err.is_instance_of::<PanicException>(py) || !err.is_instance_of::<PyException>(py) {
        EmbedderError::model_gone(message)
    } else {
        EmbedderError::model_failure(message)
    }
}

#[cfg(test)]
mod tests {
    use mlx_embed_core::EmbedderErrorKind;
    use pyo3::types::PyDict;

    use super::*;

    /// The kind the bridge gives the exception `raise_it` raises.
    fn kind_of(raise_it: &std::ffi::CStr) -> (EmbedderErrorKind, String) {
        crate::interpreter::ensure_python().expect("python");
        Python::attach(|py| {
            let globals = PyDict::new(py);
            let err = py
                .run(raise_it, Some(&globals), None)
                .expect_err("the snippet raises");
            let e = classify(py, &err);
            (e.kind, e.message)
        })
    }

    #[test]
    fn exceptions_map_to_kinds_by_class() {
        use EmbedderErrorKind::*;
        assert_eq!(
            kind_of(c"from mlx_embed.errors import InvalidInput\nraise InvalidInput('token id 7 is bad')"),
            (InvalidInput, "InvalidInput: token id 7 is bad".into())
        );
        // Its own kind, and only its message: the server names the cut field before it.
        assert_eq!(
            kind_of(
                c"from mlx_embed.errors import CutTooShort\nraise CutTooShort('a cut at 1 tokens')"
            ),
            (CutTooShort, "a cut at 1 tokens".into())
        );
        // A plain ValueError while running (MLX's shape errors are) is the
        // model's failure: only the engine's own input checks blame the caller.
        assert_eq!(kind_of(c"raise ValueError('bad')").0, ModelFailure);
        assert_eq!(kind_of(c"raise TypeError('bad')").0, ModelFailure);
        assert_eq!(
            kind_of(
                c"from mlx_embed.errors import InputTooLong\nraise InputTooLong('text', 0, 9, 8)"
            )
            .0,
            InvalidInput
        );
        assert_eq!(
            kind_of(c"raise RuntimeError('out of memory')"),
            (ModelFailure, "RuntimeError: out of memory".into())
        );
        assert_eq!(kind_of(c"raise MemoryError()").0, ModelFailure);
        assert_eq!(kind_of(c"raise SystemExit(3)").0, ModelGone);
        assert_eq!(kind_of(c"raise KeyboardInterrupt()").0, ModelGone);
        // Only a load takes a missing file as the caller's fault.
        assert_eq!(kind_of(c"raise FileNotFoundError('x')").0, ModelFailure);
    }

    #[test]
    fn a_load_types_its_failures_by_what_to_fix_and_never_as_input() {
        use EmbedderErrorKind::*;
        crate::interpreter::ensure_python().expect("python");
        let load_kind = |raise_it: &std::ffi::CStr| {
            Python::attach(|py| {
                let err = py
                    .run(raise_it, None, None)
                    .expect_err("the snippet raises");
                classify_load(py, &err).kind
            })
        };
        // The engine's own refusals, by class (their built-in bases too).
        assert_eq!(
            load_kind(c"from mlx_embed.errors import InvalidOption\nraise InvalidOption('workers must be at least 1')"),
            InvalidOption
        );
        assert_eq!(
            load_kind(c"from mlx_embed.errors import InvalidOptionType\nraise InvalidOptionType('pipeline must be True')"),
            InvalidOption
        );
        assert_eq!(
            load_kind(c"from mlx_embed.errors import InvalidModel\nraise InvalidModel('unsupported model_type')"),
            InvalidModel
        );
        assert_eq!(
            load_kind(c"from mlx_embed.errors import ModelFolderMissing\nraise ModelFolderMissing('no config.json')"),
            InvalidModel
        );
        assert_eq!(
            load_kind(c"from mlx_embed.hub import ModelNotFound\nraise ModelNotFound('a/b', 'not on the Hub')"),
            InvalidModel
        );
        assert_eq!(
            load_kind(c"raise ModuleNotFoundError('no mlx', name='mlx')"),
            EngineUnavailable
        );
        // A package a model needs, typed by the engine: the model's.
        assert_eq!(
            load_kind(c"from mlx_embed.errors import MissingDependency\nraise MissingDependency('needs mlx_lm')"),
            InvalidModel
        );
        // A file of the folder missing or unreadable is the folder's.
        assert_eq!(
            load_kind(c"raise FileNotFoundError('no config.json')"),
            InvalidModel
        );
        assert_eq!(load_kind(c"raise NotADirectoryError('x')"), InvalidModel);
        assert_eq!(load_kind(c"raise PermissionError('x')"), InvalidModel);
        // Nothing at a load blames a call's input: an untyped ValueError
        // or TypeError is the load failing (an engine bug).
        assert_eq!(load_kind(c"raise ValueError('a bad file')"), ModelFailure);
        assert_eq!(load_kind(c"raise TypeError('x')"), ModelFailure);
        assert_eq!(
            load_kind(c"from mlx_embed.errors import InvalidInput\nraise InvalidInput('x')"),
            ModelFailure
        );
        assert_eq!(
            load_kind(c"from mlx_embed.errors import CutTooShort\nraise CutTooShort('x')"),
            ModelFailure
        );
        assert_eq!(load_kind(c"raise OSError('disk')"), ModelFailure);
        assert_eq!(load_kind(c"raise MemoryError()"), ModelFailure);
        assert_eq!(load_kind(c"raise SystemExit(3)"), ModelGone);
    }

    #[test]
    fn each_setup_to_fix_has_its_kind_and_a_bad_answer_is_a_failure() {
        use EmbedderErrorKind::*;
        let kind = |err: BridgeError| EmbedderError::from(err).kind;
        let missing = BridgeError::NotImportable {
            message: "No module named 'mlx_embed'".into(),
            prefix: "/usr".into(),
            path: "[]".into(),
            venv: String::new(),
        };
        assert_eq!(kind(missing), EngineUnavailable);
        let not_found = BridgeError::ModelNotFound {
            name: "a/b".into(),
            why: "not on the Hub".into(),
        };
        assert_eq!(kind(not_found), InvalidModel);
        let tokenizer = TokenizerError::Load {
            path: "tokenizer.json".into(),
            message: "missing".into(),
        };
        assert_eq!(kind(tokenizer.into()), InvalidModel);
        assert_eq!(
            kind(BridgeError::Protocol("no vectors".into())),
            ModelFailure
        );
    }
}
