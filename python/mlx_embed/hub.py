"""Models named by their Hugging Face Hub repo id, as TEI's ``--model-id`` and
``SentenceTransformer("org/name")`` take them.

:func:`resolve_model` is the one place a model's name becomes a folder:
``load()``, the CLI and the server (through the Rust bridge) all call it.
A name that is a local folder stays one; a repo id is looked up in the local
Hugging Face cache, laid out as huggingface_hub writes it::

    <cache>/models--org--name/refs/<branch or tag>   (a file holding a commit sha)
    <cache>/models--org--name/snapshots/<sha>/...     (links into ../../blobs/)

and only when it is not there, and ``HF_HUB_OFFLINE`` is not set, downloaded
into that cache with huggingface_hub (the files the engine reads, nothing
more: see :func:`engine_files`). A branch or tag is looked up on the Hub as
huggingface_hub does it: one request for the commit it is at now; where it
moved, that commit's files are fetched and ``refs/`` updated, else the
cached snapshot serves as it is. A full commit sha names its snapshot for
good and asks nothing. Offline, or where the Hub cannot be asked (refused,
timed out, busy, a token it refuses), a whole cached snapshot serves, with a
warning naming its commit; a partial one (:func:`missing_files`) is
completed from the Hub, or refused naming what it lacks.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Iterable, Optional

from .errors import ModelFolderMissing

log = logging.getLogger("mlx_embed")

# huggingface_hub's REGEX_COMMIT_HASH: a full sha names a snapshot itself.
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A snapshot folder: .../models--<repo id, "/" written "--">/snapshots/<sha>.
_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/([^/]+)/?$")
# What huggingface_hub takes for "set" in a boolean variable.
_TRUE = {"1", "ON", "YES", "TRUE"}
# Folders of other runtimes' exports, whose files the engine never reads.
_OTHER_EXPORTS = ("onnx/", "openvino/", "coreml/")


class ModelNotFound(ModelFolderMissing):
    """``name`` is neither a local folder nor a repo id the cache holds or
    the Hub gave: ``why`` says which and how to fetch it."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.name = name
        self.why = why


def hub_cache(cache_dir: Optional[str] = None) -> str:
    """The Hugging Face cache folder: ``cache_dir``, else ``HF_HUB_CACHE``,
    else the older ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub`` (``HF_HOME``
    defaulting to ``$XDG_CACHE_HOME/huggingface``, else
    ``~/.cache/huggingface``): huggingface_hub's order (its ``constants``),
    read at each call rather than once at import."""
    env = os.environ
    chosen = cache_dir or env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not chosen:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
        )
        chosen = os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")
    return os.path.expandvars(os.path.expanduser(os.fspath(chosen)))


def offline() -> bool:
    """Whether downloads are off: ``HF_HUB_OFFLINE`` (or transformers'
    ``TRANSFORMERS_OFFLINE``) set true, as huggingface_hub reads them."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a repo id the Hub allows (``name`` or ``org/name``):
    huggingface_hub's own rule."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_of(path: str) -> Optional[tuple[str, str]]:
    """(repo id, commit sha) where ``path`` is a snapshot folder of the cache,
    else None. Repo ids hold no ``--`` (the Hub refuses them), so the folder
    name reads back unambiguously."""
    m = _SNAPSHOT.search(os.path.abspath(os.fspath(path)))
    if m is None:
        return None
    return m.group(1).replace("--", "/"), m.group(2)


def repo_name(path: str) -> str:
    """A folder's model name without its organization: a snapshot's repo
    name (``bge-reranker-base`` of ``models--BAAI--bge-reranker-base``), else
    the folder's own name."""
    snapshot = snapshot_of(path)
    if snapshot is not None:
        return snapshot[0].rpartition("/")[2]
    return os.path.basename(os.path.abspath(os.fspath(path)).rstrip("/"))


def repo_folder(cache: str, repo_id: str) -> str:
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def bad_revision(revision: str) -> Optional[str]:
    """Why ``revision`` cannot name a branch, tag or commit, or None. It
    becomes a path under the cache's ``refs/`` (``refs/pr/1`` too, as
    huggingface_hub files it), so it is held to git's ref-name rules that
    keep it there: no absolute path, no empty, ``.`` or ``..`` component, no
    backslash or control character."""
    if not revision.strip():
        return "it is empty"
    if revision.startswith("/") or "\\" in revision or any(ord(c) < 0x20 or c == "\x7f" for c in revision):
        return "it is an absolute path or holds a backslash or control character"
    if any(part in ("", ".", "..") for part in revision.split("/")):
        return "it has an empty, '.' or '..' component"
    return None


def cached_snapshot(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> Optional[str]:
    """The cache's snapshot folder of ``repo_id`` at ``revision`` (a branch or
    tag, through ``refs/``, or a full commit sha; default ``main``), or None.
    A ref file must hold a full commit sha: anything else (a half-written
    file, a path) would name a folder outside ``snapshots/``."""
    folder = repo_folder(hub_cache(cache_dir), repo_id)
    revision = revision or "main"
    if bad_revision(revision):
        return None
    if _COMMIT.fullmatch(revision):
        sha = revision
    else:
        try:
            with open(os.path.join(folder, "refs", revision), encoding="utf-8", errors="replace") as f:
                sha = f.read(200).strip()
        except OSError:
            return None
        if not _COMMIT.fullmatch(sha):
            log.warning("%s: the cache's refs/%s holds no commit sha (%r): ignored", repo_id, revision, sha[:60])
            return None
    snapshot = os.path.join(folder, "snapshots", sha)
    return snapshot if os.path.isdir(snapshot) else None


def missing_files(snapshot: str) -> list[str]:
    """What a cached snapshot lacks for the engine to load it, as far as its
    own files tell (an interrupted download, or an ``hf download`` of a few
    files): ``config.json`` (but a sentence-transformers folder of modules
    alone, a static embedding, has none), any weights, any tokenizer file
    (``tokenizer.json``, a vocabulary, a sentencepiece model), the shards its
    ``*.index.json`` files list, the module folders ``modules.json`` lists
    (with a file in each; but a Normalize module's, which has none), and
    files whose blob is gone (a link to nothing). Empty: complete."""
    from .json_files import read_json

    missing = []
    modules = read_json(os.path.join(snapshot, "modules.json"))
    if not os.path.exists(os.path.join(snapshot, "config.json")) and not modules:
        missing.append("config.json")
    if isinstance(modules, list):
        for module in modules:
            sub = module.get("path") if isinstance(module, dict) else None
            # A Normalize module keeps no file: sentence-transformers saves
            # its folder empty, which git, and so the Hub, does not keep
            # (nomic-embed-text-v1.5's 2_Normalize, potion's 1_Normalize).
            kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
            if kind == "Normalize":
                continue
            # An empty one is a download cut short: huggingface_hub makes a
            # file's folder before it fetches the file.
            if isinstance(sub, str) and sub and not any(fs for _, _, fs in os.walk(os.path.join(snapshot, sub))):
                missing.append(sub + "/")
    weights = tokenizer = False
    for d, _, fs in os.walk(snapshot):
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), snapshot)
            if not os.path.exists(os.path.join(d, f)):
                missing.append(rel)
            elif f.endswith(".safetensors") or re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", f):
                weights = True
            elif f in ("tokenizer.json", "vocab.txt", "vocab.json") or f.endswith(".model"):
                tokenizer = True
            if f.endswith(".index.json"):
                index = read_json(os.path.join(d, f))
                shards = index.get("weight_map") if isinstance(index, dict) else None
                if isinstance(shards, dict):
                    missing += [
                        os.path.relpath(os.path.join(d, s), snapshot)
                        for s in sorted(set(map(str, shards.values())))
                        if not os.path.exists(os.path.join(d, s))
                    ]
    if not weights:
        missing.append("weights (*.safetensors or pytorch_model.bin)")
    if not tokenizer:
        missing.append("a tokenizer (tokenizer.json)")
    return sorted(set(missing))


def engine_files(repo_files: Iterable[str]) -> list[str]:
    """Of a repo's files, those ``load()`` may read: every JSON file (configs,
    tokenizer and sentence-transformers settings, shard indexes, adapters),
    the tokenizer's vocabularies (``*.txt``, sentencepiece ``*.model``, a
    ``*.jinja`` chat template), ColBERT's ``artifact.metadata``, the weights
    as ``*.safetensors`` (any folder: ``2_Dense/``, adapters), a folder's
    ``pytorch_model*.bin`` only where that folder has no safetensors, and
    BGE-M3's ``sparse_linear.pt``. Other runtimes' exports (ONNX, OpenVINO)
    and other frameworks' weights stay on the Hub."""
    files = [f for f in repo_files if not f.startswith(_OTHER_EXPORTS)]
    with_safetensors = {os.path.dirname(f) for f in files if f.endswith(".safetensors")}
    wanted = []
    for f in files:
        base = os.path.basename(f)
        if base.endswith((".json", ".txt", ".model", ".jinja", ".safetensors")) or base in (
            "artifact.metadata",
            "sparse_linear.pt",
        ):
            wanted.append(f)
        elif re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", base) and os.path.dirname(f) not in with_safetensors:
            wanted.append(f)
    return sorted(wanted)


def _fetch_hint(repo_id: str, revision: Optional[str], cache: str) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"fetch it with `hf download {repo_id}{rev} --cache-dir {cache}` where the Hub can be reached"


def _cached_revisions(repo_id: str, cache: str) -> str:
    refs = os.path.join(repo_folder(cache, repo_id), "refs")
    names = (
        sorted(os.path.relpath(os.path.join(d, f), refs) for d, _, fs in os.walk(refs) for f in fs)
        if os.path.isdir(refs)
        else []
    )
    return f" (cached: {', '.join(names)})" if names else ""


def download(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None, info=None) -> str:
    """Downloads the files the engine reads (:func:`engine_files`) of
    ``repo_id`` at ``revision`` into the cache, with ``HF_TOKEN`` (or the
    saved token) where the repo needs one; returns the snapshot folder and
    points ``refs/<revision>`` at its commit. ``info`` is the Hub's answer
    for that revision where the caller asked already (its commit and file
    list), else it is asked here. Files the snapshot holds already are kept,
    and so are blobs an older commit shares with it (snapshot_download links
    them instead of fetching them again)."""
    HfApi = _hub_api()
    from huggingface_hub import snapshot_download

    cache = hub_cache(cache_dir)
    revision = revision or "main"
    if info is None:
        info = _repo_info(HfApi(endpoint=endpoint()), repo_id, revision)
    sha = _commit_of(info)
    files = engine_files(s.rfilename for s in info.siblings or ())
    log.info(
        "downloading %s (revision %s, commit %s) from %s into %s: %s",
        repo_id,
        revision,
        sha,
        shown_endpoint(),
        cache,
        ", ".join(files),
    )
    # By its commit: the files of the commit the Hub named, whatever the
    # branch does meanwhile, and no second lookup of the branch.
    folder = snapshot_download(repo_id, revision=sha, cache_dir=cache, allow_patterns=files, endpoint=endpoint())
    if revision != sha:
        _write_ref(cache, repo_id, revision, sha)
    return folder


def _commit_of(info) -> str:
    sha = getattr(info, "sha", None)
    if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
        raise ValueError(f"the Hub's answer names no commit ({sha!r})")
    return sha


def _write_ref(cache: str, repo_id: str, revision: str, sha: str) -> None:
    """Points the cache's ``refs/<revision>`` at ``sha`` as huggingface_hub
    does: only where it changed (a cache mounted read-only is never written
    while its refs hold), through a file renamed over it so that no reader
    sees half a sha. A ref that cannot be written is a warning: the snapshot
    is there, and the next start looks the branch up again."""
    import uuid

    path = os.path.join(repo_folder(cache, repo_id), "refs", revision)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            if f.read(200).strip() == sha:
                return
    except OSError:
        pass
    scratch = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(scratch, "w", encoding="utf-8") as f:
            f.write(sha)
        os.replace(scratch, path)
    except OSError as e:
        # Not left behind (a full disk, a folder where the ref goes): in
        # refs/ it reads as a ref to no commit, which `hf cache scan`
        # reports as a corrupted cache.
        try:
            os.remove(scratch)
        except OSError:
            pass
        log.warning("%s: could not record revision %s as commit %s in the cache (%s)", repo_id, revision, sha, e)


# A Hub under load (huggingface_hub's retried statuses): asked again after
# 1, 2 and 4 s.
_BUSY = (429, 500, 502, 503, 504)
_WAITS = (1.0, 2.0, 4.0)


def _lookup_timeout() -> float:
    """Seconds the Hub gets to answer a revision's lookup: huggingface_hub's
    ``HF_HUB_ETAG_TIMEOUT`` (its wait for a file's metadata before it falls
    back to the cache), 10 by default. The client waits forever otherwise,
    and a Hub whose packets are dropped would hold a start that the cache
    could serve."""
    try:
        seconds = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    except ValueError:
        return 10.0
    return seconds if seconds > 0 else 10.0


def _repo_info(api, repo_id: str, revision: str, *, wait_busy: bool = True):
    """The repo's info at ``revision`` (its commit and file list): one
    request, asked again while the Hub answers that it is busy (unless
    ``wait_busy`` is false), but not where the connection itself fails:
    huggingface_hub's tree listing retries that five times (about 24 s)
    before a server start could say the Hub cannot be reached."""
    import time

    from huggingface_hub.errors import HfHubHTTPError

    for wait in (*(_WAITS if wait_busy else ()), None):
        try:
            return api.model_info(repo_id, revision=revision, timeout=_lookup_timeout())
        except HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            if wait is None or status not in _BUSY:
                raise
            log.warning("%s: the Hub answered %s; asking again in %.0f s", repo_id, status, wait)
            time.sleep(wait)


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` (a mirror), read at each call as
    the cache's variables are, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _hide_userinfo(text: str) -> str:
    # A mirror's address may carry a user and password (https://u:p@host):
    # they stay out of logs and error messages, as a token does.
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1***@", text)


def shown_endpoint() -> str:
    """:func:`endpoint` as logs and messages show it: without a password."""
    return _hide_userinfo(endpoint())


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return _hide_userinfo(f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": "))


def resolve_model(name: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """The folder ``name`` loads from: ``name`` itself where it exists (a
    local folder wins over a repo id of the same spelling; ``revision`` and
    ``cache_dir`` apply to repo ids only) or cannot be a repo id (a missing
    path, which the loader then names), else the snapshot of the repo id
    ``name`` at ``revision`` (default ``main``) in the cache: for a branch or
    tag, the commit the Hub names now (fetched where the cache lacks it),
    else, offline or where the Hub cannot be asked, the cached one (see the
    module's text). The bundled model's names come back as they are
    (``load()`` knows them). Raises :class:`ModelNotFound` (a
    ``FileNotFoundError``) saying why not."""
    from .loading import is_default_name

    name = os.fspath(name)
    if os.path.exists(name) or is_default_name(name):
        if revision:
            log.warning("%s is not loaded from the Hub: revision %s applies to Hub repo ids only", name, revision)
        return name
    if not is_repo_id(name):
        # A path that is not there: the loader names what is missing.
        return name
    cache = hub_cache(cache_dir)
    why_bad = None if revision is None else bad_revision(revision)
    if why_bad:
        raise ModelNotFound(name, f"revision {revision!r} is not a branch, tag or commit sha: {why_bad}")
    rev = revision or "main"
    pinned = _COMMIT.fullmatch(rev) is not None
    found = cached_snapshot(name, rev, cache)
    missing = missing_files(found) if found is not None else []
    # A whole snapshot of the revision, which serves where the Hub says
    # nothing newer (or cannot be asked).
    whole = found if found is not None and not missing else None
    if whole is not None and (pinned or offline()):
        log.info("%s (revision %s): the Hugging Face cache's %s", name, rev, whole)
        return whole
    if found is None:
        where = (
            f"not a local folder, and revision {rev} of the Hugging Face repo {name} is not in "
            f"the cache {cache}{_cached_revisions(name, cache)}"
        )
    else:
        # A partial snapshot would fail later, or load without a module.
        where = f"the Hugging Face cache's snapshot {found} lacks {', '.join(missing)}"
    if offline():
        raise ModelNotFound(
            name, f"{where}; HF_HUB_OFFLINE is set, so nothing is downloaded: {_fetch_hint(name, revision, cache)}"
        )
    info = None
    if not pinned:
        from huggingface_hub.errors import RevisionNotFoundError

        try:
            # Inside the try: huggingface_hub's client refuses to import
            # over a bad variable of its own, which leaves the cache serving.
            HfApi = _hub_api()
            # With a whole snapshot cached, a busy Hub is not waited out.
            info = _repo_info(HfApi(endpoint=endpoint()), name, rev, wait_busy=whole is None)
            sha = _commit_of(info)
        except Exception as e:  # noqa: BLE001  (the Hub's, the network's: the cache serves if it can)
            if whole is not None and isinstance(e, RevisionNotFoundError):
                # The Hub answered: the branch or tag is gone (huggingface_hub
                # refuses it too), which no cache should hide.
                raise ModelNotFound(
                    name,
                    f"the Hub {shown_endpoint()} has no revision {rev} of {name} ({_first_line(e)}); the cache "
                    f"{cache} holds it at commit {_sha(whole)}: name that commit as the revision to serve it",
                ) from None
            if whole is None:
                raise ModelNotFound(
                    name,
                    f"{where}, and downloading it from {shown_endpoint()} failed "
                    f"({_first_line(e)}): {_fetch_hint(name, revision, cache)}",
                ) from None
            log.warning(
                "%s: could not ask %s which commit revision %s is (%s): serving the cached commit %s",
                name,
                shown_endpoint(),
                rev,
                _first_line(e),
                _sha(whole),
            )
            return whole
        current = cached_snapshot(name, sha, cache)
        absent = _absent(current, info) if current is not None else []
        if current is not None and not missing_files(current) and not absent:
            _write_ref(cache, name, rev, sha)
            if whole is not None and current != whole:
                log.info(
                    "%s: revision %s moved on the Hub from commit %s to %s, which the cache holds",
                    name,
                    rev,
                    _sha(whole),
                    sha,
                )
            log.info("%s (revision %s): the Hugging Face cache's %s", name, rev, current)
            return current
        if whole is not None and current == whole:
            # The Hub's commit, cached, short of files the Hub lists for it:
            # fetched below; where that fails (a read-only cache made by
            # `hf download --include`), it serves as it did.
            log.info("%s: the cache's %s lacks %s, which the Hub lists: fetching them", name, whole, ", ".join(absent))
        elif whole is not None:
            log.info("%s: revision %s moved on the Hub from commit %s to %s: fetching it", name, rev, _sha(whole), sha)
    if found is not None and whole is None:
        log.warning("%s: %s: fetching what is missing", name, where)
    try:
        folder = download(name, rev, cache, info=info)
    except Exception as e:  # noqa: BLE001  (the Hub's, the network's or the disk's: all end the same way)
        if whole is not None:
            log.warning(
                "%s: fetching commit %s of revision %s from %s failed (%s): serving the cached commit %s",
                name,
                sha,
                rev,
                shown_endpoint(),
                _first_line(e),
                _sha(whole),
            )
            return whole
        raise ModelNotFound(
            name,
            f"{where}, and downloading it from {shown_endpoint()} failed "
            f"({_first_line(e)}): {_fetch_hint(name, revision, cache)}",
        ) from None
    still = missing_files(folder)
    if still:
        raise ModelNotFound(name, f"the Hub's revision {rev} of {name} lacks {', '.join(still)}")
    return folder


def _absent(snapshot: str, info) -> list[str]:
    """The engine's files of the Hub's listing ``info`` of a commit that its
    cached ``snapshot`` lacks. Exact where :func:`missing_files` can only
    guess: a download cut short (a crash, or another process still
    fetching) leaves a file's folder made before the file, and a module
    folder without its config reads as whole; snapshot_download fills it
    in, with no request for the files already there."""
    return [
        f
        for f in engine_files(s.rfilename for s in info.siblings or ())
        if not os.path.exists(os.path.join(snapshot, f))
    ]


def _hub_api():
    """huggingface_hub's HfApi. Its import reads HF_HUB_ETAG_TIMEOUT and
    HF_HUB_DOWNLOAD_TIMEOUT as whole seconds and fails on anything else
    with a message that names neither: said here by name."""
    try:
        from huggingface_hub import HfApi
    except ValueError as e:
        bad = []
        for variable in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
            value = os.environ.get(variable)
            try:
                if value is not None:
                    int(value)
            except ValueError:
                bad.append(f"{variable}={value!r}")
        if not bad:
            raise
        raise ValueError(f"huggingface_hub cannot start: {' and '.join(bad)} is not a whole number of seconds") from e
    return HfApi


def _sha(snapshot: str) -> str:
    return os.path.basename(os.path.normpath(snapshot))
