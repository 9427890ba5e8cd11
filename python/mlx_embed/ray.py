"""Bulk embedding on Ray Data: one model per actor, ``map_batches`` over a corpus.

Online traffic goes to ``mlx-embed serve`` replicas; an offline corpus goes
through Ray Data, which already knows how to read and write files in
parallel, stream blocks through a pool of stateful actors, restart an actor
that dies and retry its block elsewhere. This module adds only the model
side and the resumable job around it::

    import ray
    from mlx_embed.ray import MlxEmbedder

    ds = ray.data.read_parquet("corpus/")
    # One actor per CPU but one: reading and writing need a CPU too.
    actors = max(1, int(ray.cluster_resources()["CPU"]) - 1)
    ds = ds.map_batches(MlxEmbedder, fn_constructor_kwargs={"model": None, "workers": 1},
                        compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=1,
                        batch_size=256, batch_format="pyarrow")
    ds.write_parquet("vectors/")

(``concurrency=N`` works as well; Ray 2.51 deprecated it for ``compute``.)

``run_bulk`` is what ``mlx-embed bulk`` runs: read Parquet or JSONL, skip the
ids already in the output folder, embed the rest, append Parquet files of the
id column, the text column (under the input's names) and ``embedding``
(``list<float32>``), then check that every input id is in the output exactly
once. The output folder's ``_mlx_embed_bulk.json`` records the model and the
options its vectors were made with; a resume with other ones is refused.
With ``sparse=True`` (a SPLADE model, or a BGE-M3 folder's lexical weights)
the vector column is replaced by ``indices`` (``list<int32>``) and ``values``
(``list<float32>``): each text's non-zero vocabulary entries, as
``Model.embed_sparse`` gives them.

Needs the ``ray`` extra: ``pip install 'mlx-embed[ray]'``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BadRow", "BulkError", "BulkResult", "MlxEmbedder", "read_input", "run_bulk"]

EMBEDDING_COLUMN = "embedding"
# A sparse vector as vector databases take one (Qdrant's, Milvus's indices
# and values), and as `mlx-embed embed --sparse` writes it.
SPARSE_COLUMNS = ("indices", "values")
# Beside the Parquet files; the leading "_" keeps Ray Data's and pyarrow's
# folder readers from taking it for data.
RECORD_NAME = "_mlx_embed_bulk.json"
# CPUs of the cluster that the model actors leave to Ray Data's own tasks.
IO_CPUS = 1
# A batch whose actor dies (an OOM kill, a native abort) runs again on a
# restarted actor this many times. Ray Data's default is without end, so a
# batch that killed its actor every time kept a job going for ever. Actors
# themselves restart without end: deaths on different batches are not one
# batch's fault. An actor holds two batches at once (Ray Data's default: the
# next one queued behind the running one), and a death costs both a retry, so
# a batch also pays for its neighbours' deaths: with 3, an actor that died
# once on each of six batches stopped the job (4 runs in 6). One batch in
# flight per actor would make the count its own, but measured 10% fewer
# texts/s with two actors (454 vs 506, scripts/bench_scale.py --skip-replicas
# --rows 8000), so the budget covers the neighbours instead.
BATCH_RETRIES = 8


class BadRow(ValueError):
    """A row the model cannot embed; the message names the row's id."""


class BulkError(RuntimeError):
    """The bulk job's input or output is not what it must be."""


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "mlx_embed.ray needs Ray Data: pip install 'mlx-embed[ray]'"
        ) from e
    return ray


def _vectors_to_list_array(vecs: np.ndarray):
    """[n, dim] float32 -> pyarrow list<float32> (one list per row), no copy of the values."""
    import pyarrow as pa

    n, dim = vecs.shape
    offsets = pa.array(np.arange(0, (n + 1) * dim, dim, dtype=np.int32))
    values = pa.array(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1))
    return pa.ListArray.from_arrays(offsets, values)


def _ragged_list_array(parts: list[np.ndarray], dtype):
    """Rows of different lengths -> pyarrow list<dtype>, one list per row."""
    import pyarrow as pa

    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def output_columns(sparse: bool) -> tuple[str, ...]:
    """The columns a bulk job adds to the id and text: the vector, or a sparse
    vector's two."""
    return SPARSE_COLUMNS if sparse else (EMBEDDING_COLUMN,)


class MlxEmbedder:
    """Callable class for ``Dataset.map_batches``: loads the model once per actor.

    Takes a batch as a ``pyarrow.Table``, a ``pandas.DataFrame`` or Ray's
    default dict of numpy arrays, with a text column (and, for error
    messages, an id column). Returns the batch with an ``embedding`` column
    of ``list<float32>`` (with ``sparse=True``: ``indices``, ``list<int32>``,
    and ``values``, ``list<float32>``): a Table for Table and dict input (a
    dict would turn the vectors into a tensor column), a DataFrame for
    DataFrame input.

    Keyword arguments (``fn_constructor_kwargs``): ``model`` (a local model
    folder or a Hugging Face repo id, default the bundled all-MiniLM-L6-v2),
    ``revision`` (of a repo id: a branch, tag or commit sha), ``text_column``,
    ``id_column``, ``normalize``, ``truncate`` (False: a text over the
    model's limit fails its row), ``workers`` (MLX threads; match the
    actor's ``num_cpus``), ``sparse`` (each text's sparse weights instead
    of its vector: a SPLADE model, or a BGE-M3 folder's lexical weights;
    ``normalize`` does not apply), ``prompt_name`` (one of the model's
    prompts before each text: ``"document"`` for a corpus), and
    ``dtype``/``quantize``/``instruction`` for ``mlx_embed.load``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        revision: str | None = None,
        text_column: str = "text",
        id_column: str = "id",
        normalize: bool = True,
        truncate: bool = True,
        workers: int = 1,
        dtype: str = "float32",
        quantize: int | None = None,
        instruction: str | None = None,
        sparse: bool = False,
        prompt_name: str | None = None,
    ):
        import mlx_embed

        self.model = mlx_embed.load(
            model, dtype=dtype, quantize=quantize, instruction=instruction, workers=workers,
            revision=revision,
        )
        if sparse and not self.model.has_sparse_output:
            raise BulkError(_no_sparse_output(self.model.name))
        self.text_column = text_column
        self.id_column = id_column
        self.normalize = normalize
        self.truncate = truncate
        self.sparse = sparse
        if prompt_name is not None and prompt_name not in self.model.prompts:
            raise BulkError(_no_prompt(self.model.name, prompt_name, self.model.prompts))
        self.prompt_name = prompt_name

    def __call__(self, batch):
        import pandas as pd
        import pyarrow as pa

        if isinstance(batch, pd.DataFrame):
            table = pa.Table.from_pandas(batch, preserve_index=False)
        elif isinstance(batch, dict):
            table = pa.table({k: pa.array(list(v)) if v.dtype == object else v
                              for k, v in batch.items()})
        else:
            table = batch
        if self.sparse:
            entries = self.embed_table_sparse(table)
            columns = [_ragged_list_array([i for i, _ in entries], np.int32),
                       _ragged_list_array([v for _, v in entries], np.float32)]
        else:
            columns = [_vectors_to_list_array(self.embed_table(table))]
        names = output_columns(self.sparse)
        if isinstance(batch, pd.DataFrame):
            out = batch.copy()
            for name, column in zip(names, columns):
                out[name] = pd.Series(pd.arrays.ArrowExtensionArray(column), index=batch.index)
            return out
        for name, column in zip(names, columns):
            table = table.append_column(name, column)
        return table

    def embed_table(self, table) -> np.ndarray:
        """The vectors of ``table``'s text column, float32 [rows, dim], in row order."""
        ids, texts = self._checked_rows(table)
        if not texts:
            return np.empty((0, self.model.dim), dtype=np.float32)
        return self._embed_rows(
            lambda part: self.model.embed(part, normalize=self.normalize, truncate=self.truncate,
                                          prompt_name=self.prompt_name),
            ids, texts,
        )

    def embed_table_sparse(self, table) -> list[tuple[np.ndarray, np.ndarray]]:
        """The sparse weights of ``table``'s text column, ``(indices, values)``
        per row (int32, float32), in row order."""
        ids, texts = self._checked_rows(table)
        if not texts:
            return []
        return self._embed_rows(
            lambda part: self.model.embed_sparse(part, truncate=self.truncate,
                                                 prompt_name=self.prompt_name),
            ids, texts,
        )

    def _checked_rows(self, table) -> tuple[list, list[str]]:
        """The batch's ids and texts; a row with no text to embed is a BadRow."""
        if self.text_column not in table.column_names:
            raise BulkError(
                f"no {self.text_column!r} column in the batch (columns: {table.column_names})"
            )
        texts = table.column(self.text_column).to_pylist()
        if self.id_column in table.column_names:
            ids = table.column(self.id_column).to_pylist()
        else:
            ids = [None] * len(texts)
        for row_id, text in zip(ids, texts):
            problem = _text_problem(text)
            if problem:
                raise BadRow(f"row {self.id_column}={row_id!r}: {problem}")
        return ids, texts

    def _embed_rows(self, embed, ids: list, texts: list[str]):
        try:
            return embed(texts)
        except Exception:
            # The engine names a failing input by its place in the call; one
            # text at a time finds the row, so the message can name its id.
            for row_id, text in zip(ids, texts):
                try:
                    embed([text])
                except Exception as e:
                    # Alone in the call, the text is "text 0" to the engine.
                    reason = re.sub(r"^text 0\b", "text", str(e))
                    raise BadRow(f"row {self.id_column}={row_id!r}: {reason}") from e
            raise


def _no_sparse_output(name: str) -> str:
    return (f"{name} has no sparse output: sparse needs a SPLADE model or a BGE-M3 folder "
            "(its sparse_linear.pt)")


def _no_prompt(name: str, prompt_name: str, prompts) -> str:
    return f"{name} has no prompt named {prompt_name!r} (its prompts: {', '.join(sorted(prompts)) or 'none'})"


def _bad_row_message(error: BaseException) -> str | None:
    """The BadRow message inside the error Ray raised for a failed UDF, if any.

    Ray wraps the actor's exception (RayTaskError, UserCodeException) and keeps
    the original in its cause chain or, across processes, in the text."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, BadRow):
            return str(e)
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    match = re.search(r"BadRow: (.+)", str(error))
    return match.group(1).strip() if match else None


def _text_problem(text: Any) -> str | None:
    if text is None:
        return "text is null"
    if not isinstance(text, str):
        return f"text must be a string, got {type(text).__name__}"
    # Only "" is refused, as the server's routes do; a whitespace-only text
    # is embedded there too (its vector is the model's for no words).
    if not text:
        return "text is empty"
    return None


# ------------------------------------------------------------------ the job


@dataclass
class BulkResult:
    """What one ``run_bulk`` call did."""

    input_rows: int
    already_done: int  # rows found in the output folder before this run
    embedded: int  # rows embedded by this run
    removed_files: list[str]  # unreadable output files (an interrupted write) deleted before resuming
    output_files: int
    seconds: float


def input_format(paths: Sequence[str]) -> str:
    """"parquet" or "jsonl": what the inputs are. Refuses a local path that
    is not there (a URI, such as s3://, is left to Ray), a folder of neither
    kind, other files, and a mix."""
    kinds = set()
    for p in paths:
        p = os.fspath(p)
        path = Path(p)
        if "://" not in p and not path.exists():
            raise FileNotFoundError(f"{p}: no such file or folder")
        if path.is_dir():
            # Skipped as Ray Data's reader skips them (a _SUCCESS marker, our record).
            names = [f.name for f in path.iterdir()
                     if f.is_file() and not f.name.startswith((".", "_"))]
            if names and all(n.endswith(".parquet") for n in names):
                kinds.add("parquet")
            elif names and all(n.endswith((".jsonl", ".json")) for n in names):
                kinds.add("jsonl")
            else:
                raise BulkError(f"{p}: a folder of .parquet or of .jsonl files expected")
        elif path.suffix == ".parquet":
            kinds.add("parquet")
        elif path.suffix in (".jsonl", ".json"):
            kinds.add("jsonl")
        else:
            raise BulkError(f"{p}: .parquet or .jsonl input expected")
    if len(kinds) != 1:
        raise BulkError("inputs mix Parquet and JSONL; give one kind")
    return kinds.pop()


def _check_output_outside_inputs(paths: Sequence[str], out: Path) -> None:
    """An output folder inside an input folder would be read back as input
    by the next run (Ray reads subfolders): its ids then appear twice and
    the resume is refused, for ever."""
    where = out.resolve()
    for p in paths:
        p = os.fspath(p)
        if "://" in p or not Path(p).is_dir():
            continue
        folder = Path(p).resolve()
        if where == folder or folder in where.parents:
            raise BulkError(
                f"the output folder {out} is inside the input folder {p}: the next run would read "
                "its files as input; write the vectors to a folder outside it"
            )


def read_input(paths: Sequence[str]):
    """A Ray Dataset over Parquet files or JSONL files (one JSON object per line)."""
    ray = _import_ray()
    paths = [os.fspath(p) for p in paths]
    if input_format(paths) == "parquet":
        return ray.data.read_parquet(paths)
    return ray.data.read_json(paths, lines=True)


def _scan_output(output_dir: Path, id_column: str) -> tuple[list, list[str], int]:
    """Ids already written (in file order), unreadable files removed, files kept.

    Each output file is written whole by one write task; a file cut short by
    a killed job has no Parquet footer, so it is deleted and its rows done again.
    """
    import pyarrow.parquet as pq

    done: list = []
    removed: list[str] = []
    kept = 0
    if not output_dir.exists():
        return done, removed, kept
    for f in sorted(output_dir.glob("*.parquet")):
        try:
            pq.read_metadata(f)
        except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
            f.unlink()
            removed.append(f.name)
            continue
        try:
            done.extend(pq.read_table(f, columns=[id_column]).column(id_column).to_pylist())
        except (KeyError, ValueError) as e:
            raise BulkError(f"{f}: no {id_column!r} column; not this job's output ({e})") from e
        kept += 1
    return done, removed, kept


def _drop_done(done_ref, id_column: str):
    """A batch function that drops the rows whose id is already in the output (resume)."""
    cache: dict = {}

    def drop(table):
        import pyarrow.compute as pc

        if "done" not in cache:
            cache["done"] = _import_ray().get(done_ref)
        return table.filter(pc.invert(pc.is_in(table.column(id_column), value_set=cache["done"])))

    return drop


def _unreadable(error) -> BulkError:
    """The reader's own error (a JSON id too big for int64...) in one line."""
    cause = getattr(error, "cause", None) or error
    return BulkError(f"cannot read the input: {type(cause).__name__}: {cause}")


def _check_ids(ids, where: str) -> None:
    """Ids must be present and unique: resuming and the final check go by id."""
    import pyarrow as pa
    import pyarrow.compute as pc

    nulls = ids.null_count
    if nulls:
        raise BulkError(f"{where}: {nulls} rows have a null id")
    try:
        distinct = pc.count_distinct(ids).as_py()
    except pa.ArrowNotImplementedError:
        # JSONL ids of mixed types ("a", 1) come as pickled Python objects.
        raise BulkError(
            f"{where}: ids must all have one type, such as all strings or all integers "
            f"(they are {ids.type})"
        ) from None
    if distinct != len(ids):
        counts = pc.value_counts(ids)
        dup = next(v for v in counts.to_pylist() if v["counts"] > 1)
        raise BulkError(
            f"{where}: id {dup['values']!r} appears {dup['counts']} times; ids must be unique"
        )


# ------------------------------------------------------------ what made the output

# Bytes read from each end of a big model file for its fingerprint: a
# fine-tuned copy of a model has the same file sizes, but not these bytes
# (its first and last layers), and hashing whole multi-GB weights would
# delay every start.
_FINGERPRINT_SAMPLE = 1 << 20


def _folder_fingerprint(folder: str | os.PathLike) -> str:
    """A hash of a model folder's files (names, sizes, small files whole, big
    ones sampled at both ends): equal for a copy of the folder elsewhere,
    different for another model, or another revision put in its place."""
    root = Path(folder)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        # A README or git metadata changes no vector.
        if not f.is_file() or rel.startswith(".") or "/." in rel or f.suffix.lower() == ".md":
            continue
        size = f.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= 2 * _FINGERPRINT_SAMPLE:
                h.update(fh.read())
            else:
                h.update(fh.read(_FINGERPRINT_SAMPLE))
                fh.seek(-_FINGERPRINT_SAMPLE, os.SEEK_END)
                h.update(fh.read(_FINGERPRINT_SAMPLE))
    return h.hexdigest()[:32]


def model_identity(model: str | None = None, *, dtype: str = "float32",
                   quantize: int | None = None, instruction: str | None = None,
                   revision: str | None = None) -> dict:
    """What the model the actors would load is: name, resolved folder, vector
    width, max_length, the folder's fingerprint and whether it has sparse
    output; and, for a repo id, the commit its snapshot is (``commit``)."""
    import mlx_embed
    from mlx_embed import hub

    m = mlx_embed.load(model, dtype=dtype, quantize=quantize, instruction=instruction, workers=1,
                       revision=revision)
    return {
        "name": m.name, "path": os.path.realpath(m.path), "dim": int(m.dim),
        "max_length": int(m.max_length), "fingerprint": _folder_fingerprint(m.path),
        "sparse_output": bool(m.has_sparse_output), "prompts": sorted(m.prompts),
        # Only where a repo id led to the snapshot (a snapshot folder given
        # as a path is loaded as that path).
        "commit": m.revision if model and hub.snapshot_of(model) is None else None,
    }


def _remote_model_identity(ray, model, dtype, quantize, instruction, revision=None) -> dict:
    """model_identity, run where the actors run (on a cluster the model folder
    need not exist beside the driver), in a worker that then exits: a model
    loaded and dropped on the caller's thread could abort the process at exit
    when that thread was not the main one, and the driver keeps no copy."""
    task = ray.remote(num_cpus=1, max_calls=1, max_retries=0)(model_identity)
    try:
        return ray.get(task.remote(model, dtype=dtype, quantize=quantize, instruction=instruction,
                                   revision=revision))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None) or e
        raise BulkError(
            f"cannot load the model {model or '(the bundled default)'}: "
            f"{type(cause).__name__}: {cause}"
        ) from None


# Options whose change changes the vectors (or which rows they belong to).
# Truncation is not one: with it off, a text over the limit fails the job
# instead of being cut, so every vector written is the same either way.
_RECORDED_OPTIONS = ("normalize", "dtype", "quantize", "instruction", "id_column", "text_column",
                     "sparse", "prompt_name")
# What a record written before an option existed meant by its absence.
_OPTION_DEFAULTS = {"sparse": False, "prompt_name": None}


def _settings_differences(old: dict, new: dict) -> list[str]:
    """What differs between the settings recorded in an output folder and a
    run's, one phrase each ("normalize: True then, False now")."""
    diffs = []
    was, now = old.get("model") or {}, new["model"]
    # A copy of the same folder elsewhere (or a different name for it) is
    # the same model: the files decide, not where they are.
    if was.get("fingerprint") != now["fingerprint"] or was.get("dim") != now["dim"]:
        diffs.append(
            f"model: {was.get('name')} at {was.get('path')}, {was.get('dim')} dims then, "
            f"{now['name']} at {now['path']}, {now['dim']} dims now"
        )
    for key in _RECORDED_OPTIONS:
        then, now = (s.get(key, _OPTION_DEFAULTS.get(key)) for s in (old, new))
        if then != now:
            diffs.append(f"{key}: {then!r} then, {now!r} now")
    return diffs


def _readable_output_files(out: Path) -> list[Path]:
    """The output's Parquet files with a footer (a file cut short holds nothing)."""
    import pyarrow.parquet as pq

    files = []
    for f in sorted(out.glob("*.parquet")) if out.is_dir() else ():
        try:
            pq.read_metadata(f)
        except (OSError, ValueError):
            continue
        files.append(f)
    return files


def _check_unrecorded_vectors(out: Path, files: list[Path], settings: dict) -> None:
    """An output folder from before the record: its vectors must have the
    model's width (and be unit length when this run normalizes), the only
    settings its files still show; another model of the same width and the
    same options cannot be told apart, which is why the record exists."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if settings.get("sparse"):
        # Bulk wrote only dense vectors before it kept a record.
        raise BulkError(
            f"{out} has no {RECORD_NAME} (it was written before mlx-embed recorded its "
            "settings, when bulk wrote dense vectors only): adding sparse weights would mix "
            "two kinds of output; write to a new output folder"
        )
    dim = settings["model"]["dim"]
    for f in files:
        try:
            column = pq.read_table(f, columns=[EMBEDDING_COLUMN]).column(EMBEDDING_COLUMN)
        except (KeyError, ValueError) as e:
            raise BulkError(f"{f}: no {EMBEDDING_COLUMN!r} column; not this job's output ({e})") from e
        column = column.combine_chunks()
        if not len(column):
            continue
        lengths = pc.list_value_length(column)
        widths = sorted({w for w in pc.unique(lengths).to_pylist() if w is not None})
        if widths != [dim]:
            raise BulkError(
                f"{out} has no {RECORD_NAME} (it was written before mlx-embed recorded its "
                f"settings) and {f.name} holds vectors of {', '.join(map(str, widths))} dims, "
                f"where {settings['model']['name']} gives {dim}: resuming would mix two models' "
                "vectors; write to a new output folder"
            )
        if settings["normalize"]:
            vecs = np.asarray(pc.list_flatten(column), dtype=np.float32).reshape(-1, dim)
            norms = np.linalg.norm(vecs, axis=1)
            if np.abs(norms - 1).max() > 1e-2:
                raise BulkError(
                    f"{out} has no {RECORD_NAME} (it was written before mlx-embed recorded its "
                    f"settings) and {f.name} holds vectors that are not unit length, where this "
                    "run normalizes them: it was written with --no-normalize (normalize=False); "
                    "resume with that, or write to a new output folder"
                )


def _check_and_record_settings(out: Path, settings: dict) -> None:
    """Refuses to add to an output folder written with other settings, then
    (re)writes the folder's record of them; raises BulkError, writing
    nothing, if they differ."""
    import mlx_embed

    record_path = out / RECORD_NAME
    files = _readable_output_files(out)
    if record_path.exists():
        try:
            old = json.loads(record_path.read_text())
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise BulkError(f"{record_path}: unreadable ({e}); write to a new output folder") from None
        diffs = _settings_differences(old, settings)
        if diffs and files:
            raise BulkError(
                f"{out} was written with other settings ({'; '.join(diffs)}; its {RECORD_NAME} "
                "says which): resuming would mix vectors of two kinds in one folder. Run with the "
                "settings it was written with, or write to a new output folder"
            )
        if not diffs:
            return
        # A record but no vectors (the first run stopped before writing any):
        # nothing to mix, so this run's settings replace it.
    elif files:
        _check_unrecorded_vectors(out, files, settings)
    out.mkdir(parents=True, exist_ok=True)
    record = {"written_by": f"mlx-embed {mlx_embed.__version__}", **settings}
    tmp = out / (RECORD_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, record_path)  # a killed write leaves the old record or the new, whole


def run_bulk(
    inputs: str | Sequence[str],
    output_dir: str | os.PathLike,
    *,
    model: str | None = None,
    revision: str | None = None,
    id_column: str = "id",
    text_column: str = "text",
    concurrency: int | None = None,
    cpus_per_actor: float = 1.0,
    workers_per_actor: int | None = None,
    batch_size: int = 256,
    rows_per_file: int = 10_000,
    normalize: bool = True,
    truncate: bool = True,
    dtype: str = "float32",
    quantize: int | None = None,
    instruction: str | None = None,
    sparse: bool = False,
    prompt_name: str | None = None,
) -> BulkResult:
    """Embeds ``inputs`` (Parquet or JSONL with ``id_column`` and
    ``text_column``) into Parquet files of those two columns, under their own
    names, and ``embedding``, under ``output_dir``, on the Ray cluster this
    process is connected to (a local one is started if none is). With
    ``sparse=True`` the files hold ``indices`` and ``values`` (each text's
    sparse weights, from a SPLADE model or a BGE-M3 folder) instead of
    ``embedding``; ``normalize`` does not apply to them. ``prompt_name``:
    one of the model's prompts before each text (``"document"``).
    ``model`` may be a Hugging Face repo id at ``revision`` (see
    ``mlx_embed.hub``): resolved once, and every actor loads that commit.

    Resumes: ids already in ``output_dir`` are skipped. The folder's
    ``_mlx_embed_bulk.json`` records the model (name, folder, width, a
    fingerprint of its files) and the options that change vectors; a run
    with any other is refused with ``BulkError`` before anything is written.
    A folder without the record (written before it existed) is resumed only
    if its vectors have the model's width and, when normalizing, unit length.
    Afterwards every input id must be in the output exactly once, else
    ``BulkError``. A row the
    model cannot embed fails the job with ``BadRow`` naming its id. (Ray Data
    lets a failed job's actors go only once Python has collected the failed
    executor; ``mlx-embed bulk`` runs one job per process.)
    """
    import time

    import pyarrow as pa
    import pyarrow.compute as pc

    ray = _import_ray()
    started = time.perf_counter()
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    out = Path(output_dir)
    if batch_size < 1 or rows_per_file < 1 or cpus_per_actor <= 0:
        raise ValueError("batch_size and rows_per_file must be >= 1, cpus_per_actor > 0")
    outputs = output_columns(sparse)
    if id_column == text_column or {id_column, text_column} & set(outputs):
        raise BulkError(
            f"the id and text columns must be two columns, named neither "
            f"{' nor '.join(map(repr, outputs))} (the output's vector columns): got "
            f"{id_column!r} and {text_column!r}"
        )
    if not ray.is_initialized():
        ray.init()
    # Ray Data's file listing, reading, re-blocking and writing are tasks that
    # each claim one CPU; actors holding every CPU would leave them waiting
    # forever (the job would hang at 0 rows), so one CPU stays theirs.
    cpus = ray.cluster_resources().get("CPU", 0)
    if concurrency is None:
        concurrency = max(1, int((cpus - IO_CPUS) // cpus_per_actor))
    if concurrency < 1 or concurrency * cpus_per_actor > cpus - IO_CPUS:
        raise BulkError(
            f"{concurrency} actors x {cpus_per_actor:g} CPUs leave less than {IO_CPUS} of the "
            f"cluster's {cpus:g} CPUs for reading and writing; lower --concurrency or "
            "--cpus-per-actor (an actor may claim 0.5 CPU and still run its MLX workers)"
        )
    if workers_per_actor is None:
        workers_per_actor = max(1, round(cpus_per_actor))

    _check_output_outside_inputs(inputs, out)
    ds = read_input(inputs)
    try:
        schema = ds.schema()
    except ray.exceptions.RayTaskError as e:
        raise _unreadable(e) from None
    if schema is None:  # an empty JSONL file (or one of blank lines) has no columns
        raise BulkError("the input has no rows")
    missing = {id_column, text_column} - set(schema.names)
    if missing:
        raise BulkError(
            f"input has no {sorted(missing)} column(s) (columns: {schema.names}); "
            "--id-column/--text-column name them"
        )
    ds = ds.select_columns([id_column, text_column])
    # The ids alone, read once up front: a duplicate or null id fails the job
    # before any compute, and the end check compares id sets.
    try:
        tables = ray.get(ds.select_columns([id_column]).to_arrow_refs())
    except ray.exceptions.RayTaskError as e:
        raise _unreadable(e) from None
    chunks = [t.column(id_column).combine_chunks() for t in tables if t.num_rows]
    if not chunks:
        raise BulkError("the input has no rows")
    # A block whose ids are all null reads as type null beside the others.
    null_rows = sum(len(c) for c in chunks if pa.types.is_null(c.type))
    if null_rows:
        raise BulkError(f"input: {null_rows} rows have a null id")
    try:
        input_ids = pa.concat_arrays(chunks)
    except pa.ArrowInvalid:  # blocks whose ids were read as different types
        raise BulkError(
            "input: ids must all have one type, such as all strings or all integers (their "
            "types differ: " + ", ".join(sorted({str(c.type) for c in chunks})) + ")"
        ) from None
    _check_ids(input_ids, "input")
    input_rows = len(input_ids)

    identity = _remote_model_identity(ray, model, dtype, quantize, instruction, revision)
    # Capabilities, not settings: the record keeps what made the vectors.
    prompts = identity.pop("prompts")
    # Every actor loads the commit this resolved: a branch that moves on the
    # Hub mid-job (an actor on another node downloading) mixes no two models.
    commit = identity.pop("commit")
    if not identity.pop("sparse_output") and sparse:
        raise BulkError(_no_sparse_output(identity["name"]))
    if prompt_name is not None and prompt_name not in prompts:
        raise BulkError(_no_prompt(identity["name"], prompt_name, prompts))
    settings = {
        "model": identity,
        # Sparse weights are never normalized, whatever was asked.
        "normalize": bool(normalize) and not sparse, "dtype": dtype, "quantize": quantize,
        "instruction": instruction, "id_column": id_column, "text_column": text_column,
        "sparse": bool(sparse), "prompt_name": prompt_name,
    }
    # Before the scan below deletes anything: a refused run leaves the folder as it was.
    _check_and_record_settings(out, settings)

    done, removed, _ = _scan_output(out, id_column)
    done = pa.array(done, type=input_ids.type) if done else pa.array([], type=input_ids.type)
    if len(done):
        _check_ids(done, str(out))
        if not pc.all(pc.is_in(done, value_set=input_ids)).as_py():
            raise BulkError(f"{out} holds ids that are not in the input: not this job's output")
        ds = ds.map_batches(
            _drop_done(ray.put(done), id_column), batch_format="pyarrow"
        )
    todo = input_rows - len(done)
    if todo > 0:
        # Blocks of one model batch each spread the rows over all actors
        # (the reader may hand over a whole file as one block).
        ds = ds.repartition(target_num_rows_per_block=batch_size)
        ds = ds.map_batches(
            MlxEmbedder,
            fn_constructor_kwargs={
                "model": model, "revision": commit or revision,
                "text_column": text_column, "id_column": id_column,
                "normalize": normalize, "truncate": truncate,
                "workers": workers_per_actor, "dtype": dtype,
                "quantize": quantize, "instruction": instruction, "sparse": sparse,
                "prompt_name": prompt_name,
            },
            batch_size=batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=concurrency),
            num_cpus=cpus_per_actor,
            max_restarts=-1,
            max_task_retries=BATCH_RETRIES,
        )
        out.mkdir(parents=True, exist_ok=True)
        bad_row = None
        try:
            ds.write_parquet(os.fspath(out), min_rows_per_file=rows_per_file, mode="append")
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
            raise BulkError(
                f"model actors died with the same batch on them {BATCH_RETRIES + 1} times (the kernel's "
                "out-of-memory killer, or a crash in native code; Ray's logs say which): the job "
                f"stopped. The files written to {out} are kept; the same command resumes once the "
                "cause is fixed (fewer --workers-per-actor or a smaller --batch-size use less memory)"
            ) from None
        except Exception as e:
            bad_row = _bad_row_message(e)
            if bad_row is None:
                raise
        if bad_row is not None:
            # Ray Data lets a failed job's actors go when nothing refers to
            # them any more; Ray's error, through its traceback, still would.
            # So the BadRow is raised outside the handler, without that error,
            # and the actors' CPUs are free for the caller's next job.
            del ds
            gc.collect()
            raise BadRow(bad_row)

    final, _, files = _scan_output(out, id_column)
    final = pa.array(final, type=input_ids.type) if final else pa.array([], type=input_ids.type)
    _check_ids(final, str(out))
    if len(final) != input_rows or not pc.all(pc.is_in(final, value_set=input_ids)).as_py():
        raise BulkError(f"{out} holds {len(final)} rows, not the input's {input_rows} ids")
    return BulkResult(
        input_rows=input_rows,
        already_done=len(done),
        embedded=len(final) - len(done),
        removed_files=removed,
        output_files=files,
        seconds=time.perf_counter() - started,
    )
