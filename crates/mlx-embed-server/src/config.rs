//! Server settings: clap flags with `MLX_EMBED_*` environment fallbacks.

use std::time::Duration;

use mlx_embed_core::{BatcherConfig, DeviceKind};

fn core_defaults() -> BatcherConfig {
    BatcherConfig::default()
}

/// The longest batch or regroup window (ms): a minute is already far past
/// any window that gains company, and a deadline that far out overflows.
const MAX_WINDOW_MS: u64 = 60_000;

/// The longest timeout or wait (s): a day. A deadline computed from a
/// larger one can overflow the clock and take the server down.
const MAX_WAIT_SECS: u64 = 86_400;

/// Every setting of the HTTP server and its batcher.
///
/// Each flag falls back to an environment variable (`--port` <- `MLX_EMBED_PORT`, ...);
/// batching defaults come from [`BatcherConfig::default`].
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct ServerArgs {
    /// Address to listen on (TEI's --hostname too, whose default is 0.0.0.0: give it to listen
    /// beyond this machine).
    #[arg(
        long,
        visible_alias = "hostname",
        env = "MLX_EMBED_HOST",
        default_value = "127.0.0.1"
    )]
    pub host: String,

    /// Port to listen on (0 picks a free one, printed on stdout as `listening on http://host:port`).
    #[arg(long, short = 'p', env = "MLX_EMBED_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Also serve Hugging Face TEI's gRPC API (package `tei.v1`: Info, Embed, Predict, Rerank,
    /// Tokenize) on this port, at --host (0 picks a free one, printed on stdout as
    /// `listening on grpc://host:port`). Unset: no gRPC listener.
    #[arg(long, env = "MLX_EMBED_GRPC_PORT")]
    pub grpc_port: Option<u16>,

    /// Model name reported by the APIs (default: the model's own name).
    #[arg(long, env = "MLX_EMBED_SERVED_MODEL_NAME", value_parser = parse_model_name)]
    pub served_model_name: Option<String>,

    /// Most inputs in one model call (TEI's --max-batch-requests: TEI queues each input of a
    /// request as one entry) [default: 64 on the CPU, 256 on a GPU].
    #[arg(long, visible_alias = "max-batch-requests", env = "MLX_EMBED_MAX_BATCH_SIZE",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_size: Option<usize>,

    /// Most padded tokens (longest input x count) in one model call [default: 8192 on the CPU, 32768 on a GPU].
    #[arg(long, env = "MLX_EMBED_MAX_BATCH_TOKENS",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_tokens: Option<usize>,

    /// How long an idle model waits for more requests before running a lone one (ms).
    #[arg(long, env = "MLX_EMBED_BATCH_WINDOW_MS",
          default_value_t = core_defaults().batch_window.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(..=MAX_WINDOW_MS))]
    pub batch_window_ms: u64,

    /// How long a batch may wait, after a batch is answered, for that batch's callers to come
    /// back, so callers that wait for their answers keep sharing one model call (ms; 0: off).
    /// Ends early once as many inputs have arrived as were answered [default: 0 on the CPU, 4 on
    /// a GPU, whose every pass has a fixed cost].
    #[arg(long, env = "MLX_EMBED_REGROUP_WINDOW_MS",
          value_parser = clap::value_parser!(u64).range(..=MAX_WINDOW_MS))]
    pub regroup_window_ms: Option<u64>,

    /// Inputs admitted to the model queue at once, per priority lane and in each of its three
    /// lines (calls of at most --max-priority-batch-size inputs, of at most --max-batch-size,
    /// and larger ones); more wait their turn (FIFO).
    #[arg(long, env = "MLX_EMBED_MAX_CONCURRENT_REQUESTS",
          default_value_t = core_defaults().max_concurrent_requests,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_concurrent_requests: usize,

    /// Inputs allowed to wait for admission before new requests get 429.
    #[arg(long, env = "MLX_EMBED_MAX_WAITING", default_value_t = core_defaults().max_waiting)]
    pub max_waiting: usize,

    /// Longest a request waits for admission before getting 429 (ms).
    #[arg(long, env = "MLX_EMBED_MAX_QUEUE_WAIT_MS",
          default_value_t = core_defaults().max_queue_wait.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(..=MAX_WAIT_SECS * 1000))]
    pub max_queue_wait_ms: u64,

    /// Run one request per model call (no cross-request batching).
    #[arg(long, env = "MLX_EMBED_NO_BATCHING", default_value_t = !core_defaults().enable_batching,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub no_batching: bool,

    /// Most inputs in a batch cut while high-priority inputs wait (normal and
    /// low inputs top it up only this far, so queries get a short batch), and
    /// of a query-sized call (which goes before longer calls in its lane).
    #[arg(long, env = "MLX_EMBED_MAX_PRIORITY_BATCH_SIZE",
          default_value_t = core_defaults().max_priority_batch_size,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_priority_batch_size: usize,

    /// Aging: a normal (or high) lane passed over by this many consecutive batches goes first in the next; low after twice as many.
    #[arg(long, env = "MLX_EMBED_AGING_BATCHES", default_value_t = core_defaults().aging_batches,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub aging_batches: u32,

    /// Model threads per model, each running its own batches on the one loaded model, so one
    /// batch's host work overlaps others' device work (on an H200 more than one lost with
    /// single-text requests and gained nothing over the GPU's bigger batches).
    #[arg(long, env = "MLX_EMBED_MODEL_THREADS", default_value_t = core_defaults().model_threads,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=16))]
    pub model_threads: usize,

    /// Query threads per model: model threads beside --model-threads that take only query-sized
    /// calls (at most --max-priority-batch-size inputs and a sixteenth of --max-batch-tokens) of
    /// the high and normal lanes, so a query never waits behind a long or bulk batch; off (0)
    /// for a model that serves from one thread only [default: 1 on the CPU, 0 on a GPU].
    #[arg(long, env = "MLX_EMBED_QUERY_THREADS",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=4))]
    pub query_threads: Option<usize>,

    /// Embedding cache size in MiB (raw vectors keyed by exact token ids).
    #[arg(long, env = "MLX_EMBED_CACHE_MB", default_value_t = core_defaults().cache_bytes >> 20)]
    pub cache_mb: usize,

    /// Turn the embedding cache off (same as --cache-mb 0).
    #[arg(long, env = "MLX_EMBED_NO_CACHE", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_cache: bool,

    /// Largest request body in bytes; larger bodies get 413 (TEI's --payload-limit).
    #[arg(long, visible_alias = "payload-limit", env = "MLX_EMBED_MAX_BODY_BYTES", default_value_t = 2 * 1024 * 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_body_bytes: usize,

    /// Most inputs in one request; more get 413 (TEI's --max-client-batch-size).
    #[arg(long, visible_alias = "max-client-batch-size", env = "MLX_EMBED_MAX_INPUTS_PER_REQUEST", default_value_t = 2048,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_inputs_per_request: usize,

    /// When set, every route but the probes (/health, /ping, /.well-known/live, /.well-known/ready)
    /// requires `Authorization: Bearer <key>`, /metrics included (a scraper sends the key);
    /// so does every gRPC call but a health check (grpc.health.v1).
    #[arg(long, env = "MLX_EMBED_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Web pages of these origins may call the API from a browser (CORS), e.g.
    /// `https://app.example.com`; comma-separated, or `*` for any origin. Unset:
    /// none, so a page of another origin cannot read answers. Unless --allowed-hosts
    /// is set, the server answers any `Host`, so a page whose name an attacker points
    /// at 127.0.0.1 (DNS rebinding) is not another origin: where browsers run beside a
    /// server, set --allowed-hosts or --api-key.
    #[arg(long, env = "MLX_EMBED_CORS_ALLOW_ORIGIN", value_delimiter = ',',
          value_parser = parse_origin)]
    pub cors_allow_origin: Vec<String>,

    /// Host names this server answers to, comma-separated (`.example.com` takes its
    /// subdomains too), beside IP addresses and `localhost`, which it always answers
    /// to. A request naming another `Host` gets 403, so a web page whose name an
    /// attacker points at this server (DNS rebinding) cannot use it. Unset: any
    /// `Host`, as a proxy in front may pass on its clients' names (deploy/nginx does).
    #[arg(long, env = "MLX_EMBED_ALLOWED_HOSTS", value_delimiter = ',',
          value_parser = parse_host_name)]
    pub allowed_hosts: Vec<String>,

    /// On SIGINT/SIGTERM/SIGHUP, how long to keep answering accepted requests before exiting (s);
    /// those still waiting for a model then are answered 503.
    #[arg(long, env = "MLX_EMBED_DRAIN_TIMEOUT_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(..=MAX_WAIT_SECS))]
    pub drain_timeout_secs: u64,

    /// How long a client may take to send a request's headers (then the connection is closed,
    /// unanswered) or its whole body (then 408),
    /// how long an idle keep-alive connection stays open, and how long an answer may wait for
    /// a client that is not reading it (then the connection is dropped) (s). Longer than a
    /// proxy's upstream keep-alive (60 s in deploy/nginx), so the proxy closes idle connections
    /// first.
    #[arg(long, env = "MLX_EMBED_CLIENT_TIMEOUT_SECS", default_value_t = 75,
          value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_SECS))]
    pub client_timeout_secs: u64,

    /// Room for answers of 256 KiB and more not yet taken by their clients (MiB): a request whose
    /// answer may be that large (`/embed_all`, an embed call of many inputs) keeps room for it
    /// before it is computed, waiting while there is not enough (up to --max-queue-wait-ms, then
    /// 429), so clients that never read large answers cannot hold more memory than this.
    /// Queries' small answers never wait.
    #[arg(long, env = "MLX_EMBED_MAX_UNSENT_ANSWERS_MB", default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 30))]
    pub max_unsent_answers_mb: usize,

    /// Skip the start-up warm-up batch.
    #[arg(long, env = "MLX_EMBED_NO_WARMUP", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_warmup: bool,

    /// The prompt of every embedding model's that an embedding request naming no prompt (no
    /// `prompt_name`, `prompt`, role or task) gets, over the folder's own default, as TEI's
    /// --default-prompt-name; each embedding model must have a prompt of that name.
    #[arg(long, env = "MLX_EMBED_DEFAULT_PROMPT_NAME", conflicts_with = "default_prompt",
          value_parser = parse_prompt_flag)]
    pub default_prompt_name: Option<String>,

    /// Text put before each input of an embedding request naming no prompt (no `prompt_name`,
    /// `prompt`, role or task), over the folder's own default, as TEI's --default-prompt.
    #[arg(long, env = "MLX_EMBED_DEFAULT_PROMPT", value_parser = parse_prompt_flag)]
    pub default_prompt: Option<String>,

    /// Also serve GET /metrics (the same text as the main port's, behind --api-key as there)
    /// on this port, at --host, as TEI's --prometheus-port (0 picks a free one, printed on
    /// stdout as `listening on metrics://host:port`). Unset: /metrics on the main port only.
    #[arg(long, env = "MLX_EMBED_PROMETHEUS_PORT")]
    pub prometheus_port: Option<u16>,
}

impl Default for ServerArgs {
    /// The same values as the flags' defaults with no environment set.
    fn default() -> Self {
        let core = core_defaults();
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            grpc_port: None,
            served_model_name: None,
            max_batch_size: None,
            max_batch_tokens: None,
            batch_window_ms: core.batch_window.as_millis() as u64,
            regroup_window_ms: None,
            max_concurrent_requests: core.max_concurrent_requests,
            max_waiting: core.max_waiting,
            max_queue_wait_ms: core.max_queue_wait.as_millis() as u64,
            no_batching: !core.enable_batching,
            max_priority_batch_size: core.max_priority_batch_size,
            aging_batches: core.aging_batches,
            model_threads: core.model_threads,
            query_threads: None,
            cache_mb: core.cache_bytes >> 20,
            no_cache: false,
            max_body_bytes: 2 * 1024 * 1024,
            max_inputs_per_request: 2048,
            api_key: None,
            cors_allow_origin: Vec::new(),
            allowed_hosts: Vec::new(),
            drain_timeout_secs: 30,
            client_timeout_secs: 75,
            max_unsent_answers_mb: 1024,
            no_warmup: false,
            default_prompt_name: None,
            default_prompt: None,
            prometheus_port: None,
        }
    }
}

/// A default prompt (name or text) with some text in it: an empty one (a
/// compose file's `${PROMPT}` with PROMPT unset) would be no prompt, which
/// leaving the flag out says.
fn parse_prompt_flag(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("an empty prompt: leave the flag out for each model's own default".into());
    }
    Ok(s.to_owned())
}

/// A served name clients can send back: not empty, no whitespace at either
/// end (an empty name lists as `:latest` on Ollama's routes).
fn parse_model_name(s: &str) -> Result<String, String> {
    if s.trim().is_empty() || s.trim() != s {
        return Err(format!(
            "{s:?} cannot be a model's name: it must be non-empty, with no whitespace at either end"
        ));
    }
    Ok(s.to_owned())
}

/// `*`, or an origin as browsers send it: `http(s)://host[:port]`, no path,
/// written as a browser writes its `Origin` header (which CORS compares byte
/// for byte): scheme and host lowercase, no default port. `https://App.example.com:443`
/// is kept as `https://app.example.com`, which a browser sends; as written, no
/// page would ever match it.
fn parse_origin(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s == "*" {
        return Ok(s.to_owned());
    }
    let bad =
        |why: &str| format!("{s:?} is not an origin ({why}): expected http(s)://host[:port] or *");
    // As copied from an address bar: the root path names no more than the origin.
    let origin = s.strip_suffix('/').unwrap_or(s);
    let (scheme, authority) = origin
        .split_once("://")
        .ok_or_else(|| bad("no http:// or https://"))?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => "80",
        "https" => "443",
        _ => return Err(bad("only http and https pages send requests")),
    };
    if authority.is_empty()
        || !authority.is_ascii()
        || authority.contains(['/', '?', '#', '@', ' ', '*', '\\'])
    {
        return Err(bad(
            "a host and port alone: no path, query, fragment, user or wildcard",
        ));
    }
    // `[v6]:port`, or `name:port`: the port is after the last colon past any `]`.
    let port_at = authority
        .rfind(':')
        .filter(|&at| !authority[at..].contains(']'));
    let (host, port) = match port_at {
        Some(at) => (&authority[..at], Some(&authority[at + 1..])),
        None => (authority, None),
    };
    if host.is_empty() || (host.contains(':') && !(host.starts_with('[') && host.ends_with(']'))) {
        return Err(bad("no host"));
    }
    let host = host.to_ascii_lowercase();
    match port {
        None => Ok(format!("{scheme}://{host}")),
        Some(port) => {
            let number: u16 = port
                .parse()
                .ok()
                .filter(|&n| n > 0 && port.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
            if number.to_string() == default_port {
                Ok(format!("{scheme}://{host}"))
            } else {
                Ok(format!("{scheme}://{host}:{number}"))
            }
        }
    }
}

/// An `--allowed-hosts` entry: a host name, or `.name` for it and its
/// subdomains, kept lowercase and without a final dot, as requests' hosts
/// are compared.
fn parse_host_name(s: &str) -> Result<String, String> {
    let s_trimmed = s.trim();
    let name = s_trimmed
        .strip_suffix('.')
        .unwrap_or(s_trimmed)
        .to_ascii_lowercase();
    let bare = name.strip_prefix('.').unwrap_or(&name);
    // Labels of letters, digits, `-` and `_`, none empty: `a..b` names no host.
    let valid = bare.split('.').all(|label| {
        !label.is_empty()
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    });
    if !valid {
        return Err(format!(
            "{s:?} is not a host name: expected a name such as embed.example.com, or \
             .example.com for it and its subdomains (no port, scheme or *; leave the flag \
             unset to answer any Host)"
        ));
    }
    Ok(name)
}

impl ServerArgs {
    /// The batcher settings these flags describe for a model on `device`:
    /// the batch caps and the regroup window not given are that device's
    /// defaults ([`BatcherConfig::for_device`]).
    pub fn batcher_config(&self, device: DeviceKind) -> BatcherConfig {
        let caps = BatcherConfig::for_device(device);
        let max_batch_size = self.max_batch_size.unwrap_or(caps.max_batch_size);
        BatcherConfig {
            max_batch_size,
            max_batch_tokens: self.max_batch_tokens.unwrap_or(caps.max_batch_tokens),
            batch_window: Duration::from_millis(self.batch_window_ms),
            regroup_window: self
                .regroup_window_ms
                .map_or(caps.regroup_window, Duration::from_millis),
            max_concurrent_requests: self.max_concurrent_requests,
            max_waiting: self.max_waiting,
            max_queue_wait: Duration::from_millis(self.max_queue_wait_ms),
            enable_batching: !self.no_batching,
            max_priority_batch_size: self.max_priority_batch_size.min(max_batch_size),
            aging_batches: self.aging_batches,
            model_threads: self.model_threads,
            query_threads: self.query_threads.unwrap_or(caps.query_threads),
            cache_bytes: if self.no_cache {
                0
            } else {
                self.cache_mb.saturating_mul(1 << 20)
            },
        }
    }

    /// How long shutdown waits for accepted requests and the batcher.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }

    pub fn client_timeout(&self) -> Duration {
        Duration::from_secs(self.client_timeout_secs)
    }

    /// What the flags' parsers cannot say alone; `serve` refuses to start
    /// on it. A launcher calls it before loading models (minutes, for a
    /// big one) so a bad setting fails at once.
    pub fn check(&self) -> Result<(), String> {
        if let Some(key) = self.api_key.as_deref() {
            if key.trim().is_empty() {
                return Err("--api-key must not be empty".into());
            }
            // HTTP strips a header value's outer whitespace, cannot carry a
            // line break, and gives no text for bytes past ASCII: such a key
            // could never match, and every client would get 401 with nothing
            // said why.
            let printable = key.chars().all(|c| c == ' ' || c.is_ascii_graphic());
            if key.trim() != key || !printable {
                return Err(
                    "--api-key must be printable ASCII with no whitespace at either end (a \
                     trailing newline from a secret file?): an Authorization header carries \
                     nothing else"
                        .into(),
                );
            }
        }
        if self.max_body_bytes == 0 || self.max_inputs_per_request == 0 {
            return Err("--max-body-bytes and --max-inputs-per-request must be at least 1".into());
        }
        Ok(())
    }

    /// Settings that work but refuse some requests for good, or that act
    /// other than they read, said at start; `max_batch_size` is the one in
    /// effect (the flag's, or the device's default).
    pub fn warnings(&self, max_batch_size: usize) -> Vec<String> {
        let mut out = Vec::new();
        // Only where it was set: a smaller --max-batch-size alone quietly
        // bounds the default priority batch too.
        let priority_set = self.max_priority_batch_size != core_defaults().max_priority_batch_size;
        if priority_set && max_batch_size < self.max_priority_batch_size {
            let whose = if self.max_batch_size.is_some() {
                "--max-batch-size"
            } else {
                "the device's default --max-batch-size"
            };
            out.push(format!(
                "--max-priority-batch-size {} is above {whose} {max_batch_size}: it acts as \
                 {max_batch_size}",
                self.max_priority_batch_size
            ));
        }
        if self.max_waiting < self.max_inputs_per_request {
            out.push(format!(
                "--max-waiting {} is below --max-inputs-per-request {}: a request of more than \
                 {} inputs is answered 429 whenever it has to wait for room, however often it \
                 retries",
                self.max_waiting, self.max_inputs_per_request, self.max_waiting
            ));
        }
        out
    }

    /// Binds `--host:--port` once and lets it go: a port in use or an
    /// address that is not this machine's shows before the models load,
    /// not after. (The port stays closed meanwhile, so clients and
    /// balancers see "refused" during the load, not a hang.)
    pub fn check_address(&self) -> Result<(), String> {
        let addr = format!("{}:{}", self.host, self.port);
        std::net::TcpListener::bind(&addr)
            .map(drop)
            .map_err(|err| format!("cannot listen on {addr}: {err}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: ServerArgs,
    }

    #[test]
    fn a_waiting_line_shorter_than_a_request_is_warned_of() {
        assert!(ServerArgs::default().warnings(64).is_empty());
        let args = ServerArgs {
            max_waiting: 100,
            max_inputs_per_request: 2048,
            ..ServerArgs::default()
        };
        assert_eq!(
            args.warnings(64),
            vec![
                "--max-waiting 100 is below --max-inputs-per-request 2048: a request of more than \
                 100 inputs is answered 429 whenever it has to wait for room, however often it \
                 retries"
                    .to_string()
            ]
        );
    }

    #[test]
    fn a_priority_batch_above_the_batch_is_bounded_by_it() {
        let args = Cli::try_parse_from(["x", "--max-batch-size", "8"])
            .unwrap()
            .args;
        assert!(args.warnings(8).is_empty());
        assert_eq!(
            args.batcher_config(DeviceKind::Cpu).max_priority_batch_size,
            8
        );
        let args = Cli::try_parse_from([
            "x",
            "--max-batch-size",
            "8",
            "--max-priority-batch-size",
            "100",
        ])
        .unwrap()
        .args;
        assert_eq!(
            args.warnings(8),
            vec![
                "--max-priority-batch-size 100 is above --max-batch-size 8: it acts as 8"
                    .to_string()
            ]
        );
        // Above the device's default, with no --max-batch-size given: said too.
        let above_default = Cli::try_parse_from(["x", "--max-priority-batch-size", "100"])
            .unwrap()
            .args;
        assert_eq!(
            above_default.warnings(64),
            vec![
                "--max-priority-batch-size 100 is above the device's default --max-batch-size \
                 64: it acts as 64"
                    .to_string()
            ]
        );
        assert!(above_default.warnings(256).is_empty());
        assert_eq!(
            args.batcher_config(DeviceKind::Cpu).max_priority_batch_size,
            8
        );
        // Without --max-batch-size the device's cap bounds it.
        let args = Cli::try_parse_from(["x", "--max-priority-batch-size", "100"])
            .unwrap()
            .args;
        assert_eq!(
            args.batcher_config(DeviceKind::Cpu).max_priority_batch_size,
            64
        );
        assert_eq!(
            args.batcher_config(DeviceKind::Accelerator)
                .max_priority_batch_size,
            100
        );
    }

    #[test]
    fn timeouts_and_windows_past_their_range_are_refused_naming_the_flag() {
        for (flag, bad, good) in [
            ("--client-timeout-secs", "86401", "86400"),
            ("--drain-timeout-secs", "18446744073709551615", "86400"),
            ("--max-queue-wait-ms", "86400001", "86400000"),
            ("--batch-window-ms", "60001", "60000"),
            ("--regroup-window-ms", "100000000", "0"),
        ] {
            let err = Cli::try_parse_from(["x", flag, bad])
                .expect_err(flag)
                .to_string();
            assert!(err.contains(flag) && err.contains(bad), "{err}");
            assert!(
                Cli::try_parse_from(["x", flag, good]).is_ok(),
                "{flag} {good}"
            );
        }
    }

    #[test]
    fn a_served_name_must_be_one_clients_can_send() {
        for bad in ["", " ", " name", "name\n"] {
            let err = Cli::try_parse_from(["x", "--served-model-name", bad]).expect_err(bad);
            assert!(
                err.to_string().contains("cannot be a model's name"),
                "{err}"
            );
        }
        let args = Cli::try_parse_from(["x", "--served-model-name", "my model"])
            .unwrap()
            .args;
        assert_eq!(args.served_model_name.as_deref(), Some("my model"));
    }

    #[test]
    fn flag_defaults_match_default_impl_and_core() {
        let parsed = Cli::try_parse_from(["x"]).unwrap().args;
        // Environment may carry MLX_EMBED_* in odd setups; only compare when clean.
        if std::env::vars().all(|(k, _)| !k.starts_with("MLX_EMBED_")) {
            assert_eq!(parsed, ServerArgs::default());
        }
        assert_eq!(
            ServerArgs::default().batcher_config(DeviceKind::Cpu),
            BatcherConfig::for_device(DeviceKind::Cpu)
        );
    }

    #[test]
    fn a_query_thread_on_the_cpu_none_on_a_gpu_and_the_flag_wins() {
        let default = ServerArgs::default();
        assert_eq!(default.batcher_config(DeviceKind::Cpu).query_threads, 1);
        assert_eq!(
            default
                .batcher_config(DeviceKind::Accelerator)
                .query_threads,
            0
        );
        for (flag, want) in [("0", 0), ("2", 2)] {
            let given = Cli::try_parse_from(["x", "--query-threads", flag])
                .unwrap()
                .args;
            for device in [DeviceKind::Cpu, DeviceKind::Accelerator] {
                assert_eq!(given.batcher_config(device).query_threads, want);
            }
        }
        assert!(Cli::try_parse_from(["x", "--query-threads", "5"]).is_err());
    }

    #[test]
    fn batch_caps_default_by_device_and_flags_win() {
        let gpu = ServerArgs::default().batcher_config(DeviceKind::Accelerator);
        assert_eq!((gpu.max_batch_size, gpu.max_batch_tokens), (256, 32_768));
        assert_eq!(
            gpu,
            BatcherConfig {
                max_batch_size: 256,
                max_batch_tokens: 32_768,
                regroup_window: Duration::from_millis(4),
                ..BatcherConfig::default()
            }
        );
        let off = Cli::try_parse_from(["x", "--regroup-window-ms", "0"])
            .unwrap()
            .args;
        assert_eq!(
            off.batcher_config(DeviceKind::Accelerator).regroup_window,
            Duration::ZERO
        );
        let given = Cli::try_parse_from(["x", "--max-batch-size", "48"])
            .unwrap()
            .args;
        for device in [DeviceKind::Cpu, DeviceKind::Accelerator] {
            assert_eq!(given.batcher_config(device).max_batch_size, 48);
        }
        assert_eq!(given.batcher_config(DeviceKind::Cpu).max_batch_tokens, 8192);
        assert_eq!(
            given
                .batcher_config(DeviceKind::Accelerator)
                .max_batch_tokens,
            32_768
        );
    }

    #[test]
    fn flags_parse() {
        let a = Cli::try_parse_from([
            "x",
            "--port",
            "9",
            "--no-batching",
            "--max-queue-wait-ms",
            "5",
            "--api-key",
            "k",
            "--served-model-name",
            "m",
        ])
        .unwrap()
        .args;
        assert_eq!(a.port, 9);
        let config = a.batcher_config(DeviceKind::Cpu);
        assert!(!config.enable_batching);
        assert_eq!(config.max_queue_wait, Duration::from_millis(5));
        assert_eq!(a.api_key.as_deref(), Some("k"));
        assert!(Cli::try_parse_from(["x", "--max-batch-size", "0"]).is_err());
    }

    #[test]
    fn an_api_key_no_header_can_carry_is_refused_at_start() {
        let with_key = |key: &str| ServerArgs {
            api_key: Some(key.into()),
            ..ServerArgs::default()
        };
        assert_eq!(with_key("s3cret key").check(), Ok(()));
        assert_eq!(
            with_key("  ").check(),
            Err("--api-key must not be empty".into())
        );
        for bad in [
            "secret\n",
            " secret",
            "secret\t",
            "sec\nret",
            "sec\u{7f}ret",
            "abcé",
            "a\u{2028}b",
        ] {
            let err = with_key(bad).check().unwrap_err();
            assert!(err.contains("trailing newline"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn cors_origins_parse() {
        let parse = |v: &str| Cli::try_parse_from(["x", "--cors-allow-origin", v]);
        assert_eq!(
            parse("http://a.example, https://b.example:8443")
                .unwrap()
                .args
                .cors_allow_origin,
            ["http://a.example", "https://b.example:8443"]
        );
        assert_eq!(parse("*").unwrap().args.cors_allow_origin, ["*"]);
        // As browsers write their Origin header, which CORS compares byte for byte.
        assert_eq!(
            parse("HTTPS://App.Example.com:443/,http://b.com:80,http://[::1]:8080,http://[::1]")
                .unwrap()
                .args
                .cors_allow_origin,
            [
                "https://app.example.com",
                "http://b.com",
                "http://[::1]:8080",
                "http://[::1]"
            ]
        );
        for bad in [
            "ftp://x",
            "a.example",
            "http://",
            "http://a.example/path",
            "http://a.example//",
            "http://*.example",
            "http://a.com:99999",
            "http://a.com:abc",
            "http://a.com:",
            "http://a.com:+80",
            "https://a.com?x=1",
            "https://a.com#f",
            "https://user@a.com",
            "http://::1",
            "http://:80",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(Cli::try_parse_from(["x"])
            .unwrap()
            .args
            .cors_allow_origin
            .is_empty());
    }

    #[test]
    fn allowed_hosts_parse() {
        let parse = |v: &str| Cli::try_parse_from(["x", "--allowed-hosts", v]);
        assert_eq!(
            parse("Embed.Example.com, .corp.example., embed_1")
                .unwrap()
                .args
                .allowed_hosts,
            ["embed.example.com", ".corp.example", "embed_1"]
        );
        for bad in [
            "",
            ".",
            "*",
            "*.example.com",
            "embed.example.com:8080",
            "http://embed.example.com",
            "..example.com",
            "a..b",
            "a.b..",
            "a b",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(Cli::try_parse_from(["x"])
            .unwrap()
            .args
            .allowed_hosts
            .is_empty());
    }

    #[test]
    fn cache_and_lane_flags() {
        let parse = |args: &[&str]| {
            let mut all = vec!["x"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all)
                .unwrap()
                .args
                .batcher_config(DeviceKind::Cpu)
        };
        assert_eq!(parse(&[]).cache_bytes, 128 << 20);
        assert_eq!(parse(&["--cache-mb", "3"]).cache_bytes, 3 << 20);
        assert_eq!(parse(&["--cache-mb", "0"]).cache_bytes, 0);
        assert_eq!(parse(&["--no-cache", "--cache-mb", "3"]).cache_bytes, 0);
        let lanes = parse(&["--max-priority-batch-size", "4", "--aging-batches", "2"]);
        assert_eq!((lanes.max_priority_batch_size, lanes.aging_batches), (4, 2));
        assert!(Cli::try_parse_from(["x", "--aging-batches", "0"]).is_err());
    }
}
