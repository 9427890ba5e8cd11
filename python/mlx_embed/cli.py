"""``mlx-embed`` / ``python -m mlx_embed`` command line.

    mlx-embed embed [TEXT ...] [-i FILE] [--jsonl] [-o OUT.jsonl|OUT.npy] [--model DIR|ORG/NAME [--revision R]]
    mlx-embed serve ...        (everything after "serve" goes to the Rust server)
    mlx-embed info [--model DIR|ORG/NAME [--revision R]]
    mlx-embed --version        (the version `mlx-embed serve --version` shows)
    mlx-embed bulk INPUT... -o OUT_DIR [--concurrency N] ...   (Ray Data; the `ray` extra)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Iterable, Optional


def _read_file_text(name: str) -> str:
    r"""The whole of ``name`` ("-": stdin) as UTF-8, a leading BOM skipped
    (utf-8-sig, as the server reads bodies) and line endings untranslated:
    text mode's universal newlines would end a line at a bare \r too, which
    shifted every later row off its line."""
    if name == "-":
        buffer = getattr(sys.stdin, "buffer", None)
        if buffer is None:  # a stdin replaced by a text stream (tests, embedding hosts)
            data = sys.stdin.read()
            return data.removeprefix("\ufeff")
        raw = buffer.read()
    else:
        with open(name, "rb") as f:
            raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        where = "stdin" if name == "-" else name
        raise ValueError(f"{where}: not UTF-8 text ({e})") from None


def _is_jsonl(args) -> bool:
    """Whether ``-i`` is read as JSONL: --jsonl, or a .jsonl name (any case,
    as -o's) without --lines."""
    return args.jsonl or (args.input.lower().endswith(".jsonl") and not args.lines)


def _check_input_flags(args) -> None:
    """Refuses the input flags that would be ignored, as argument errors
    (exit 2): they once did nothing, silently."""
    if not args.input:
        given = [flag for flag, on in (("--jsonl", args.jsonl), ("--lines", args.lines),
                                       ("--field", args.field is not None)) if on]
        if given:
            args.parser.error(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} "
                              "the -i FILE input; give -i FILE (or -i - for stdin)")
    elif args.field is not None and not _is_jsonl(args):
        args.parser.error(f"--field names a JSONL field, but {args.input} is read as plain "
                          "lines (give --jsonl to read it as JSONL)")


def _read_inputs(args) -> list[str]:
    texts: list[str] = list(args.texts or [])
    if not args.input:
        return texts
    field = args.field or "text"
    jsonl = _is_jsonl(args)
    # Lines end at \n alone; a \r\n ending's \r is dropped.
    lines = _read_file_text(args.input).split("\n")
    if lines[-1] == "":
        lines.pop()  # what follows the last line's \n is no line
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    # Blank lines after the last text shift no row, so they are dropped (an
    # editor's trailing newlines are no texts); a blank line before a text
    # keeps its row: an empty text as plain lines, refused in JSONL.
    while lines and not lines[-1].strip():
        lines.pop()
    if not jsonl:
        texts.extend(lines)
        return texts
    for n, line in enumerate(lines, 1):
        if not line.strip():
            # Skipping it would shift every later text's output index off its line.
            raise SystemExit(
                f"{args.input}:{n}: blank line (each line must hold a JSON "
                "object: the output's index goes by the lines)"
            )
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{args.input}:{n}: invalid JSON: {e}")
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise SystemExit(f"{args.input}:{n}: expected an object with a string {field!r}")
        texts.append(obj[field])
    return texts


class Progress:
    """A dependency-free progress bar on stderr, shown only for long inputs
    on a terminal (or when forced) so pipes and logs stay clean."""

    def __init__(self, total: int, enabled: bool, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.start = time.perf_counter()
        self.done = 0

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / max(self.total, 1)
        fill = int(self.width * frac)
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * fill + "-" * (self.width - fill)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {rate:6.1f} texts/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _chunks(seq: list, size: int) -> Iterable[tuple[int, list]]:
    for i in range(0, len(seq), size):
        yield i, seq[i : i + size]


def _not_an_embedder(name: str, kind: str, folder: Optional[str]) -> str:
    """What to do with a reranker or classifier, which `embed` cannot run:
    the CLI has no scoring command, the server and the Python API have."""
    folder = folder or "DIR"
    route, method = ("/rerank (or /score)", "rerank()") if kind == "reranker" else (
        "/predict", "predict()")
    return (f"{name} is a {kind}, which scores texts rather than embedding them; serve it "
            f"(mlx-embed serve --model {folder}) and send them to {route}, or in Python "
            f"call mlx_embed.load({folder!r}).{method} or score()")


def cmd_embed(args) -> int:
    import numpy as np

    import mlx_embed
    from mlx_embed.errors import InputTooLong

    out = args.output
    as_npy = bool(out) and out.lower().endswith(".npy")
    if out and out != "-" and not as_npy and not out.lower().endswith(".jsonl"):
        # Writing JSONL into vectors.csv or vectors.npz would leave a file its
        # reader cannot parse.
        print(f"mlx-embed embed: -o must name a .jsonl or .npy file (or - for stdout), got {out!r}",
              file=sys.stderr)
        return 2
    if args.sparse and as_npy:
        # Each text has its own number of entries: no one array holds them.
        print("mlx-embed embed: --sparse writes JSONL (indices and values per text), not .npy",
              file=sys.stderr)
        return 2
    _check_input_flags(args)
    texts = _read_inputs(args)
    if not texts:
        print("mlx-embed embed: no input texts (give TEXT arguments or -i FILE)", file=sys.stderr)
        return 2
    model = mlx_embed.load(
        args.model, dtype=args.dtype, quantize=args.quantize, instruction=args.instruction,
        revision=args.revision,
    )
    if model.kind != "embedding":
        print(f"mlx-embed embed: {_not_an_embedder(model.name, model.kind, args.model)}",
              file=sys.stderr)
        return 1
    if args.prompt_name is not None and args.prompt_name not in model.prompts:
        print(f"mlx-embed embed: {model.name} has no prompt named {args.prompt_name!r} (its prompts: "
              f"{', '.join(sorted(model.prompts)) or 'none'})", file=sys.stderr)
        return 1
    if args.sparse and not model.has_sparse_output:
        print(f"mlx-embed embed: {model.name} has no sparse output: --sparse needs a SPLADE model "
              "or a BGE-M3 folder (its sparse_linear.pt)", file=sys.stderr)
        return 1
    show = args.progress == "always" or (
        args.progress == "auto" and len(texts) >= 2 * args.chunk and sys.stderr.isatty()
    )
    bar = Progress(len(texts), show)
    out_vecs = None if args.sparse else np.empty((len(texts), model.dim), dtype=np.float32)
    sparse: list = [None] * len(texts) if args.sparse else []
    counts = [0] * len(texts)
    try:
        # Chunks only exist to drive the progress bar; the engine still sorts
        # and sub-batches within each chunk.
        for start, part in _chunks(texts, args.chunk):
            try:
                if args.sparse:
                    sparse[start : start + len(part)], c = model.embed_sparse_with_counts(
                        part, truncate=not args.no_truncate, prompt_name=args.prompt_name
                    )
                else:
                    vecs, c = model.embed_with_counts(
                        part, normalize=not args.no_normalize, truncate=not args.no_truncate,
                        prompt_name=args.prompt_name,
                    )
                    out_vecs[start : start + len(part)] = vecs
            except InputTooLong as e:
                print(f"mlx-embed embed: text {start + e.index} has {e.tokens} tokens, more than the "
                      f"model's {e.max_length} (drop --no-truncate to cut it)", file=sys.stderr)
                return 1
            counts[start : start + len(part)] = c
            bar.update(len(part))
    finally:
        bar.close()

    if as_npy:
        # Through a file object: np.save(name) appends ".npy" to "OUT.NPY".
        with open(out, "wb") as f:
            np.save(f, out_vecs)
        return 0
    f = sys.stdout if not out or out == "-" else open(out, "w", encoding="utf-8")
    try:
        for i in range(len(texts)):
            rec = {"index": i, "tokens": counts[i]}
            if args.sparse:
                rec["indices"], rec["values"] = (a.tolist() for a in sparse[i])
            else:
                rec["embedding"] = out_vecs[i].tolist()
            f.write(json.dumps(rec) + "\n")
    finally:
        if f is not sys.stdout:
            f.close()
    return 0


def cmd_bulk(args) -> int:
    """Embeds a Parquet/JSONL corpus on Ray Data into Parquet (its id and text, embedding)."""
    try:
        import ray

        from mlx_embed.ray import BadRow, BulkError, input_format, run_bulk
    except ImportError as e:
        print(f"mlx-embed bulk: needs the ray extra (pip install 'mlx-embed[ray]'): {e}",
              file=sys.stderr)
        return 1
    try:
        # Before Ray starts (seconds): a missing or unreadable input is said at once.
        input_format(args.inputs)
    except (BulkError, OSError) as e:
        print(f"mlx-embed bulk: error: {e}", file=sys.stderr)
        return 1
    started_ray = not ray.is_initialized()
    session_dir = None
    # Ray's logs are kept only when the job ended in an error of Ray's own
    # (a traceback), where they may tell more.
    said_why = False
    try:
        if started_ray:
            # "local" (Ray's word for a new local cluster) joins nothing.
            joining = (args.address or os.environ.get("RAY_ADDRESS") or "local") != "local"
            if joining and args.num_cpus is not None:
                print("mlx-embed bulk: error: --num-cpus sizes a local cluster; a cluster joined "
                      "(--address or RAY_ADDRESS) has its own CPUs", file=sys.stderr)
                return 2
            # No --address and no RAY_ADDRESS: a new local cluster of
            # --num-cpus CPUs ("local": Ray would otherwise join one that
            # `ray start` left running on this machine).
            ray.init(address=args.address if joining else "local",
                     num_cpus=None if joining else args.num_cpus)
            session_dir = None if joining else _local_session_dir(ray)
            if threading.current_thread() is threading.main_thread():
                # A supervisor's SIGTERM (timeout, a Kubernetes Job) stops the
                # job as Ctrl-C does: one line, the files kept for the resume.
                signal.signal(signal.SIGTERM, signal.default_int_handler)
        result = run_bulk(
            args.inputs, args.output, model=args.model, revision=args.revision, id_column=args.id_column,
            text_column=args.text_column, concurrency=args.concurrency,
            cpus_per_actor=args.cpus_per_actor, workers_per_actor=args.workers_per_actor,
            batch_size=args.batch_size, rows_per_file=args.rows_per_file,
            normalize=not args.no_normalize, truncate=not args.no_truncate,
            dtype=args.dtype, quantize=args.quantize, instruction=args.instruction,
            sparse=args.sparse, prompt_name=args.prompt_name,
        )
        said_why = True
    except (BadRow, BulkError) as e:
        said_why = True
        print(f"mlx-embed bulk: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        said_why = True
        # A second Ctrl-C while Ray shuts down ends the process at once, with
        # no second traceback either.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        print(f"mlx-embed bulk: interrupted; the files written to {args.output} are kept: run "
              "the same command again to resume", file=sys.stderr)
        return 130
    finally:
        if started_ray:
            # Also ends the workers' log forwarding, so the summary is stdout's last line.
            ray.shutdown()
            if session_dir is not None and said_why:
                # Its logs served this run alone, whose outcome is printed; a
                # folder per run would pile up under /tmp/ray.
                shutil.rmtree(session_dir, ignore_errors=True)
    summary = {
        "input_rows": result.input_rows, "already_done": result.already_done,
        "embedded": result.embedded, "removed_files": result.removed_files,
        "output_files": result.output_files, "seconds": round(result.seconds, 2),
        "texts_per_s": round(result.embedded / max(result.seconds, 1e-9), 1),
    }
    print(json.dumps(summary))
    return 0


def _local_session_dir(ray) -> Optional[str]:
    """The session folder of the local Ray cluster this process just started
    (None where Ray does not say)."""
    try:
        node = ray._private.worker._global_node  # Ray has no public name for it
        return node.get_session_dir_path() if node is not None and node.head else None
    except AttributeError:
        return None


def cmd_info(args) -> int:
    import mlx_embed

    info = {"blas": mlx_embed.blas_info()}
    if not args.blas_only:
        info["model"] = mlx_embed.load(args.model, revision=args.revision).info()
    print(json.dumps(info, indent=2))
    return 0


def cmd_serve(rest: list[str]) -> int:
    # Imported here: _native is the Rust extension built by maturin and is only
    # needed (and only present) for the server.
    try:
        from mlx_embed import _native
    except ImportError as e:
        print(
            "mlx-embed serve: the server extension mlx_embed._native is not built "
            f"({e}); install the package with pip/maturin",
            file=sys.stderr,
        )
        return 1
    except ValueError as e:  # a setting the extension refuses as it loads (MLX_EMBED_SIMD)
        print(f"mlx-embed: error: {e}", file=sys.stderr)
        return 1
    previous = _leave_sigint_to_the_server()
    try:
        code = _native.serve(["mlx-embed", *rest])
        sys.stdout.flush()
        sys.stderr.flush()
        # The server has answered everything; skip interpreter finalization, which
        # would tear MLX and OpenBLAS down while the model thread may still hold
        # MLX objects (the same exit-time crash the Rust binary avoids with _exit).
        os._exit(code)
    finally:
        # Reached only if serve raised, or where os._exit is stubbed (tests).
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return code


def _leave_sigint_to_the_server():
    """Puts SIGINT back to the OS default for the server's life, as the Rust
    binary has it; returns the handler it replaced (None if it kept it).

    Python's own SIGINT handler (the one raising KeyboardInterrupt) would
    otherwise stay underneath the server's: tokio's signal handling (the
    signal-hook registry) chains to a previous handler that is not SIG_DFL or
    SIG_IGN, so a Ctrl-C that drained the server also left Python a pending
    KeyboardInterrupt. It was raised as soon as serve returned, before
    os._exit, so the process ran interpreter finalization and then, as Python
    does after an uncaught KeyboardInterrupt, killed itself with SIGINT: exit
    status -2 (130 in a shell) after a clean drain, where SIGTERM (no Python
    handler) exited 0. With the default action, a Ctrl-C before the server
    installs its handlers (while the model loads) ends the process at once,
    as it does the binary's; Python's handler could not even run then, its
    main thread being inside serve. A handler someone else installed, or an
    ignored SIGINT (a background job's), is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal.signal works on the main thread only
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return previous


def _count(raw: str) -> int:
    """An argparse type for a count or size: 0 or below is refused at the
    command line, naming the flag (a negative --chunk embedded nothing)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {raw}")
    return value


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {raw}")
    return value


def _version() -> str:
    """The version `mlx-embed serve --version` prints: the server extension's
    (its Cargo version), or the package's where the extension is not built."""
    try:
        from mlx_embed import _native

        return _native.__version__
    except (ImportError, AttributeError):
        import mlx_embed

        return mlx_embed.__version__


class _VersionAction(argparse.Action):
    """``--version``: like argparse's own, but reads the version only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show the version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit(0)


MODEL_HELP = ("model folder, or Hugging Face repo id (its snapshot in the local Hugging Face cache, "
              "downloaded there unless HF_HUB_OFFLINE is set) (default: bundled all-MiniLM-L6-v2)")
REVISION_HELP = "branch, tag or commit sha of a --model given by repo id (default: main)"
PROMPT_NAME_HELP = ("the model's prompt to put before each text (one of its sentence-transformers "
                    "prompts, e.g. query or document; default: its default prompt, if any)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-embed", description="Text embeddings with MLX.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("embed", help="embed texts and write vectors")
    e.add_argument("texts", nargs="*", help="texts to embed")
    e.add_argument("-i", "--input", help="file with one text per line, or JSONL ('-' = stdin); "
                   "output index i is the input's text i, so a blank JSONL line before the "
                   "last text is refused")
    kind = e.add_mutually_exclusive_group()
    kind.add_argument("--jsonl", action="store_true",
                      help="-i is JSONL ({\"text\": ...} per line; a .jsonl name says so too)")
    kind.add_argument("--lines", action="store_true", help="treat a .jsonl -i input as plain lines")
    e.add_argument("--field", help="JSONL field holding the text (default: text)")
    e.add_argument("-o", "--output", help="output .jsonl (default stdout) or .npy")
    e.add_argument("-m", "--model", help=MODEL_HELP)
    e.add_argument("--revision", help=REVISION_HELP)
    e.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    e.add_argument("--quantize", type=int, choices=[4, 8])
    e.add_argument("--instruction", help="query instruction for instruction-tuned decoders (Qwen3, Qwen2/Mistral-style e5/gte); goes in the model's query prompt")
    e.add_argument("--no-normalize", action="store_true", help="do not L2-normalize")
    e.add_argument("--sparse", action="store_true",
                   help="write each text's sparse weights (a SPLADE model's, or a BGE-M3 folder's "
                   "lexical weights) as JSONL indices and values, unnormalized")
    e.add_argument("--no-truncate", action="store_true", help="fail on texts over max_length")
    e.add_argument("--prompt-name", help=PROMPT_NAME_HELP)
    e.add_argument("--chunk", type=_count, default=256, help="texts per progress step")
    e.add_argument("--progress", choices=["auto", "always", "never"], default="auto")
    e.set_defaults(func=cmd_embed, parser=e)

    b = sub.add_parser(
        "bulk", help="embed a Parquet/JSONL corpus on Ray Data into Parquet (resumable)",
        description="Reads Parquet or JSONL rows with an id and a text, embeds them on a pool "
        "of Ray actors (one model each) and appends Parquet files of the id and text columns "
        "(under the input's names) and embedding (list<float32>) to OUT_DIR. Ids already in "
        "OUT_DIR are skipped, so running the same command again resumes; OUT_DIR's "
        "_mlx_embed_bulk.json records the model and options, and a resume with others is "
        "refused. With --sparse the files hold indices (list<int32>) and values "
        "(list<float32>), each text's sparse weights, instead of embedding. A row that cannot "
        "be embedded (a null or empty text) fails the job with its id. Ctrl-C stops the job; "
        "the files written are kept for the resume.",
    )
    b.add_argument("inputs", nargs="+", help=".parquet / .jsonl files or folders of them")
    b.add_argument("-o", "--output", required=True, help="output folder of .parquet files")
    b.add_argument("-m", "--model", help=MODEL_HELP)
    b.add_argument("--revision", help=REVISION_HELP)
    b.add_argument("--id-column", default="id")
    b.add_argument("--text-column", default="text")
    b.add_argument("--concurrency", type=_count,
                   help="model actors (default: the cluster's CPUs less one, / --cpus-per-actor)")
    b.add_argument("--cpus-per-actor", type=_positive_float, default=1.0,
                   help="CPUs each actor claims from Ray (default 1)")
    b.add_argument("--workers-per-actor", type=_count,
                   help="MLX threads per actor (default: --cpus-per-actor, at least 1)")
    b.add_argument("--batch-size", type=_count, default=256, help="rows per model call")
    b.add_argument("--rows-per-file", type=_count, default=10_000,
                   help="rows per output file at least (the last may hold fewer)")
    b.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else local)")
    b.add_argument("--num-cpus", type=_count, help="CPUs of the local cluster (default: all)")
    b.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    b.add_argument("--quantize", type=int, choices=[4, 8])
    b.add_argument("--instruction", help="query instruction for instruction-tuned decoders (Qwen3, Qwen2/Mistral-style e5/gte); goes in the model's query prompt")
    b.add_argument("--no-normalize", action="store_true", help="do not L2-normalize")
    b.add_argument("--no-truncate", action="store_true", help="fail on texts over max_length")
    b.add_argument("--prompt-name", help=PROMPT_NAME_HELP)
    b.add_argument("--sparse", action="store_true",
                   help="write each text's sparse weights (a SPLADE model's, or a BGE-M3 folder's "
                   "lexical weights) as indices and values columns, unnormalized, instead of "
                   "embedding")
    b.set_defaults(func=cmd_bulk)

    i = sub.add_parser("info", help="show BLAS and model information")
    i.add_argument("-m", "--model", help=MODEL_HELP)
    i.add_argument("--revision", help=REVISION_HELP)
    i.add_argument("--blas-only", action="store_true")
    i.set_defaults(func=cmd_info)

    # Declared for --help only; main() intercepts "serve" before parsing so
    # that its arguments reach the Rust parser untouched.
    sub.add_parser("serve", help="run the HTTP server (arguments go to the server)", add_help=False)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`mlx-embed embed ... | head`): stop quietly,
        # as a Unix filter does, and let nothing flush into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, TypeError) as e:
        # OSError: a file that cannot be read or written (a folder, no
        # permission); FileNotFoundError is one.
        print(f"mlx-embed: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
