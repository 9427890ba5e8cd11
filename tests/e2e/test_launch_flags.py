"""The launcher's start-up flags (crates/mlx-embed/src/launch.rs): a value
that cannot be meant is refused at start, before Python starts (a model's
name, or a bound the engine owns as --workers': before any model loads),
with a message naming the flag; the usage line names the program."""

import os
import re
import subprocess
import sys
from pathlib import Path

from harness import FIXTURES, ROOT, SERVER_BINARY, start_server

CONSOLE_SCRIPT = Path(sys.prefix) / "bin" / "mlx-embed"
# The engine's first log lines: a refusal before them came before Python started.
PYTHON_STARTED = ("python interpreter ready", "python model loaded")
# A model's checks come once Python has resolved its name: before any loads.
NO_MODEL_LOADED = ("python model loaded",)


def _refused(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The server run with `args` and `env` alone of the MLX_EMBED_* settings,
    which must exit (never serve) within the timeout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLX_EMBED_")}
    return subprocess.run(
        [str(SERVER_BINARY), "--host", "127.0.0.1", "--port", "0", "--no-warmup", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**clean, "VIRTUAL_ENV": sys.prefix, "MLX_EMBED_LOG": "info", **(env or {})},
    )


def _assert_refused(run: subprocess.CompletedProcess, code: int, message: str,
                    not_reached: tuple[str, ...] = PYTHON_STARTED) -> None:
    assert run.returncode == code, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert message in run.stderr, run.stderr[-2000:]
    for line in not_reached:
        assert line not in run.stdout + run.stderr, run.stdout[-2000:]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_workers_past_256_or_4_per_core_are_refused_before_any_model_loads():
    """`--workers 65535` passed /health, then its first batch failed "can't
    start new thread" with 22,000 threads running. The bound is the engine's
    (mlx_embed/workers.py, which counts a container's CPU quota too): the
    launcher asks it once Python runs, before any model loads, and exits 2
    as for any flag's bad value (as clap's range refusal did)."""
    from mlx_embed.workers import most_workers

    most, why = most_workers()
    env_note = "(the value of --workers came from the environment variable MLX_EMBED_WORKERS)"
    for args, env, workers in (
        (("--workers", "65535"), None, 65535),
        ((), {"MLX_EMBED_WORKERS": "257"}, 257),
        (("--workers", str(most + 1)), None, most + 1),
    ):
        run = _refused(*args, env=env)
        _assert_refused(
            run, 2,
            f"error: --workers must be at most {most} ({why}), got {workers} "
            "(each worker is a thread computing on a core of its own)",
            NO_MODEL_LOADED)
        # The variable is named only where the value came from it.
        assert (env_note in run.stderr) == (env is not None), run.stderr[-2000:]
    # The bound itself is taken: the start goes on to the next check (the
    # model folder's, which refuses this one).
    run = _refused("--workers", str(most), "--model", "/nonexistent-model-folder")
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "mlx-embed: --model /nonexistent-model-folder: no such folder" in run.stderr, run.stderr[-2000:]
    assert "--workers must be at most" not in run.stderr, run.stderr[-2000:]
    assert most == min(256, 4 * int(re.match(r"4 per core on (\d+) cores?", why).group(1))), why
    assert int(re.match(r"4 per core on (\d+) cores?", why).group(1)) <= _cores(), why


def test_an_empty_instruction_is_refused_at_start():
    """An empty instruction (compose's `MLX_EMBED_INSTRUCTION=${INSTR}` with
    INSTR unset) made every Qwen3 query "Instruct: \\nQuery:..."."""
    message = ("for '--instruction <INSTRUCTION>': an empty instruction: give the query instruction's text, "
               "or leave the flag out for the model's own")
    _assert_refused(_refused("--instruction", ""), 2, f"error: invalid value '' {message}")
    _assert_refused(_refused("--instruction", " \t"), 2, message)
    for value in ("", "   "):
        run = _refused(env={"MLX_EMBED_INSTRUCTION": value})
        _assert_refused(run, 2, message)
        assert ("(the value of --instruction came from the environment variable MLX_EMBED_INSTRUCTION)"
                in run.stderr), run.stderr


def test_comma_separated_models_are_trimmed(tmp_path):
    """`MLX_EMBED_MODEL="all-MiniLM-L6-v2, <folder>"` failed after loading the
    first model: "could not load  <folder>" (a leading space)."""
    server = start_server(tmp_path, "--no-warmup",
                          env={"MLX_EMBED_MODEL": f"all-MiniLM-L6-v2, {FIXTURES / 'tiny-mpnet'} "})
    try:
        names = [m["id"] for m in server.get("/v1/models").json()["data"]]
        assert names == ["all-MiniLM-L6-v2", "tiny-mpnet"], names
    finally:
        server.stop()
    _assert_refused(_refused("--model", "all-MiniLM-L6-v2, ,x"), 2,
                    "for '--model <MODEL>': an empty model (a comma too many?)")


def test_a_missing_or_repeated_model_is_refused_before_any_loads(tmp_path):
    """A missing folder was found only once the models before it had loaded,
    the same folder twice only once both had. Python starts first: it
    resolves each name (a Hugging Face repo id, test_hub_models_e2e.py) to
    the folder checked here."""
    mpnet = "tests/fixtures/tiny-mpnet"
    reranker = "tests/fixtures/tiny-bert-reranker"
    hint = ("(a model is a local Hugging Face model folder, a Hugging Face repo id such as "
            "BAAI/bge-small-en-v1.5, or all-MiniLM-L6-v2 for the bundled one)")
    missing = tmp_path / "nonexistent"
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    for args, message in (
        (["--model", "all-MiniLM-L6-v2", "--model", str(missing)],
         f"mlx-embed: --model {missing}: no such folder {hint}"),
        (["--model", "all-MiniLM-L6-v2", "--rerank-model", str(missing)],
         f"mlx-embed: --rerank-model {missing}: no such folder {hint}"),
        (["--model", str(weights)],
         f"mlx-embed: --model {weights}: not a folder (a model is a Hugging Face model folder)"),
        (["--model", "all-MiniLM-L6-v2,all-MiniLM-L6-v2"],
         "mlx-embed: --model all-MiniLM-L6-v2 and --model all-MiniLM-L6-v2 are the same model "
         "(the bundled all-MiniLM-L6-v2): give each model once"),
        (["--model", mpnet, "--model", f"{mpnet}/"],
         f"mlx-embed: --model {mpnet} and --model {mpnet}/ are the same model "
         f"(the folder {ROOT / mpnet}): give each model once"),
        (["--model", f"{ROOT / reranker}", "--rerank-model", reranker],
         f"mlx-embed: --model {ROOT / reranker} and --rerank-model {reranker} are the same model "
         f"(the folder {ROOT / reranker}): give each model once"),
        (["--rerank-model", "all-MiniLM-L6-v2"],
         "mlx-embed: the default model (no --model) and --rerank-model all-MiniLM-L6-v2 are the same "
         "model (the bundled all-MiniLM-L6-v2): give each model once"),
    ):
        _assert_refused(_refused(*args), 1, message, NO_MODEL_LOADED)
    _assert_refused(_refused(env={"MLX_EMBED_MODEL": f"{mpnet}, {mpnet}/."}), 1,
                    f"mlx-embed: --model {mpnet} and --model {mpnet}/. are the same model", NO_MODEL_LOADED)


def test_two_folders_of_one_name_are_refused_before_any_loads(tmp_path):
    """`--model /a/bge,/b/bge` (two different models, both served as "bge")
    was refused only once both had loaded."""
    for side, fixture in (("a", "tiny-mpnet"), ("b", "tiny-gte-en")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "model").symlink_to(FIXTURES / fixture)
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    message = ('mlx-embed: invalid server settings: two models are named "model": requests could not '
               "tell them apart (rename the folder, or the first model with --served-model-name)")
    for args in (["--model", f"{first},{second}"],
                 ["--model", str(first), "--rerank-model", str(tmp_path / "b" / "model")]):
        run = _refused(*args)
        assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
        assert message in run.stderr, run.stderr[-2000:]
        assert "python model loaded" not in run.stdout + run.stderr, run.stderr[-2000:]
    # Renaming the first one serves both.
    server = start_server(tmp_path, "--no-warmup", "--model", f"{first},{second}",
                          "--served-model-name", "first")
    try:
        names = [m["id"] for m in server.get("/v1/models").json()["data"]]
        assert names == ["first", "model"], names
    finally:
        server.stop()


def test_an_empty_log_filter_is_refused_at_start():
    """`--log ""` (MLX_EMBED_LOG set empty) turned every log line off."""
    message = ("error: invalid value '' for '--log <LOG>': an empty filter would turn every log line off "
               "(\"off\" does that): use a level (off, error, warn, info, debug, trace) or target=level "
               "directives")
    _assert_refused(_refused("--log", ""), 2, message)
    run = _refused(env={"MLX_EMBED_LOG": ""})
    _assert_refused(run, 2, message)
    assert "(the value of --log came from the environment variable MLX_EMBED_LOG)" in run.stderr, run.stderr


def test_out_of_range_numbers_name_their_flag():
    """`--cache-limit-mb 18446744073709551615` failed inside Python with a
    pybind TypeError; a --max-input-tokens the model refuses named only the
    engine's `max_length`."""
    _assert_refused(
        _refused("--cache-limit-mb", "18446744073709551615"), 2,
        "error: invalid value '18446744073709551615' for '--cache-limit-mb <CACHE_LIMIT_MB>': "
        "18446744073709551615 is not in 0..=16777216")
    for tokens, why in (
        ("4294967295", "InvalidOption: max_length 4294967295 > the 512 positions bert models have"),
        ("1", "InvalidOption: max_length=1 leaves no room for content (2 special tokens)"),
    ):
        run = _refused("--max-input-tokens", tokens)
        assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
        assert (f"mlx-embed: could not load the default model with --max-input-tokens {tokens} "
                f"(the engine's max_length): {why}") in run.stderr, run.stderr[-2000:]


def test_a_model_whose_weights_cannot_be_read_is_refused_as_the_models_fault(tmp_path):
    """A folder whose model.safetensors is not one (a download that
    failed) once failed the load as the caller's input; the engine names
    the file, as the model's fault (InvalidModel), and the server exits 1
    as for any model that does not load."""
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(FIXTURES / "tiny-mpnet", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"<html>rate limited</html>")
    run = _refused("--model", str(folder))
    _assert_refused(
        run, 1,
        f"mlx-embed: could not load {folder}: InvalidModel: {weights} cannot be read as safetensors "
        f"weights: [load_safetensors] Invalid json header length file {weights}",
        not_reached=NO_MODEL_LOADED,
    )


def test_the_usage_line_names_the_program():
    """`mlx-embed-server --help` printed `Usage: mlx-embed serve`; the
    console script's `mlx-embed serve --help` keeps that name."""
    run = subprocess.run([str(SERVER_BINARY), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "\nUsage: mlx-embed-server [OPTIONS]\n" in run.stdout, run.stdout[:500]
    assert "mlx-embed serve" not in run.stdout, run.stdout[:500]
    version = subprocess.run([str(SERVER_BINARY), "--version"], capture_output=True, text=True, timeout=60)
    assert re.fullmatch(r"mlx-embed-server \d+\.\d+\.\d+\S*\n", version.stdout), version.stdout
    bad = subprocess.run([str(SERVER_BINARY), "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Usage: mlx-embed-server [OPTIONS]" in bad.stderr, bad.stderr
    script = subprocess.run([str(CONSOLE_SCRIPT), "serve", "--help"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "VIRTUAL_ENV": sys.prefix})
    assert script.returncode == 0, script.stderr
    assert "\nUsage: mlx-embed serve [OPTIONS]\n" in script.stdout, script.stdout[:500]
