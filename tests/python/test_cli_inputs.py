"""`mlx-embed embed` and `mlx-embed bulk`: how inputs are read and which
flags and inputs are refused, and the load()/API listing checks that go with
them (the black-box probe's findings)."""

import io
import json
import os
import subprocess
import sys
import time

import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES, ROOT
from mlx_embed import cli

PY_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python")}


def read(*argv: str) -> list[str]:
    """The texts `mlx-embed embed ARGV` would embed, without a model."""
    args = cli.build_parser().parse_args(["embed", *argv])
    if hasattr(cli, "_check_input_flags"):
        cli._check_input_flags(args)
    return cli._read_inputs(args)


def stdin_of(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


# ---------------------------------------------------------------- line ends


def test_a_bare_cr_does_not_end_a_line_in_a_file_or_on_stdin(tmp_path, monkeypatch):
    """`printf 'a\\rb\\n' > cr.txt; mlx-embed embed -i cr.txt` gave 2 rows
    (text mode's universal newlines) where stdin gave 1: every later row was
    off its line."""
    body = b"a\rb\nsecond\r\nthird"
    src = tmp_path / "cr.txt"
    src.write_bytes(body)
    assert read("-i", str(src)) == ["a\rb", "second", "third"]
    stdin_of(monkeypatch, body)
    assert read("-i", "-") == ["a\rb", "second", "third"]

    jsonl = tmp_path / "cr.jsonl"
    jsonl.write_bytes(b'{"text": "one"}\r\n{"text": "two"}\r\n')
    assert read("-i", str(jsonl)) == ["one", "two"]


def test_a_bare_cr_line_is_one_row_end_to_end(tmp_path):
    src = tmp_path / "cr.txt"
    src.write_bytes(b"a\rb\n")
    for args, stdin in ((["-i", str(src)], None), (["-i", "-"], b"a\rb\n")):
        r = subprocess.run([sys.executable, "-m", "mlx_embed", "embed", *args, "--progress", "never"],
                           input=stdin, capture_output=True, timeout=120, env=PY_ENV)
        assert r.returncode == 0, r.stderr
        rows = r.stdout.decode().splitlines()
        assert len(rows) == 1, args
        assert json.loads(rows[0])["index"] == 0


# ---------------------------------------------------------------- .JSONL, BOM


def test_a_jsonl_name_in_capitals_is_read_as_jsonl(tmp_path):
    src = tmp_path / "IN.JSONL"
    src.write_text('{"text": "hello"}\n{"text": "world"}\n')
    assert read("-i", str(src)) == ["hello", "world"]
    assert read("-i", str(src), "--lines") == ['{"text": "hello"}', '{"text": "world"}']


def test_a_leading_utf8_bom_is_skipped_in_files_and_on_stdin(tmp_path, monkeypatch):
    """JSONL starting with a BOM was refused ("Unexpected UTF-8 BOM"), and a
    plain file's first text began with U+FEFF."""
    bom = "\ufeff".encode()
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(bom + b'{"text": "caf\xc3\xa9"}\n{"text": "b"}\n')
    assert read("-i", str(jsonl)) == ["café", "b"]
    txt = tmp_path / "bom.txt"
    txt.write_bytes(bom + b"first\nsecond\n")
    assert read("-i", str(txt)) == ["first", "second"]
    stdin_of(monkeypatch, bom + b'{"text": "x"}\n')
    assert read("-i", "-", "--jsonl") == ["x"]
    # Only a leading one: a BOM inside the text is the text's.
    txt.write_bytes(b"a\n" + bom + b"b\n")
    assert read("-i", str(txt)) == ["a", "\ufeffb"]


def test_a_file_that_is_not_utf8_is_named_in_the_error(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8 text"):
        read("-i", str(src))


# ---------------------------------------------------------------- blank lines


def test_trailing_blank_lines_are_dropped_in_plain_text_as_in_jsonl(tmp_path):
    """They became empty-text rows in plain text, where JSONL dropped them."""
    txt = tmp_path / "in.txt"
    txt.write_text("one\n\ntwo\n \nthree\n\n  \n\r\n")
    # A blank line before a text keeps its row (line i+1 is row i).
    assert read("-i", str(txt)) == ["one", "", "two", " ", "three"]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "one"}\n{"text": ""}\n\n  \n\r\n')
    assert read("-i", str(jsonl)) == ["one", ""]
    # Only blank lines: no texts at all.
    txt.write_text("\n \n")
    assert read("-i", str(txt)) == []


def test_trailing_blank_lines_add_no_rows_end_to_end(tmp_path, minilm):
    txt = tmp_path / "in.txt"
    txt.write_text("one\n\ntwo\n\n\n")
    out = tmp_path / "out.npy"
    assert cli.main(["embed", "-i", str(txt), "-o", str(out), "--progress", "never"]) == 0
    arr = np.load(out)
    assert arr.shape == (3, 384)
    assert np.abs(arr - minilm.embed(["one", "", "two"])).max() <= 1e-6


def test_a_blank_jsonl_line_before_a_text_is_still_refused(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "one"}\n\n{"text": "three"}\n\n')
    with pytest.raises(SystemExit, match=rf"{src}:2: blank line"):
        read("-i", str(src))


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("flags", [["--jsonl"], ["--lines"], ["--field", "body"],
                                   ["--jsonl", "--field", "body"]])
def test_input_flags_without_an_input_are_argument_errors(flags, capsys):
    """They were ignored silently: `mlx-embed embed x --jsonl` embedded "x"."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["embed", "some text", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"mlx-embed embed: error: {', '.join(f for f in flags if f.startswith('--'))} " in err
    assert "give -i FILE" in err


def test_field_on_plain_lines_and_jsonl_with_lines_are_argument_errors(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["embed", "-i", str(src), "--field", "body"])
    assert exit_.value.code == 2
    assert "--field names a JSONL field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["embed", "-i", str(src), "--jsonl", "--lines"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    # With --jsonl, --field is used.
    src.write_text('{"body": "b"}\n')
    assert read("-i", str(src), "--jsonl", "--field", "body") == ["b"]


@pytest.mark.parametrize("folder,route", [("tiny-bert-reranker", "/rerank"),
                                          ("tiny-bert-classifier", "/predict")])
def test_embed_with_a_scoring_model_says_what_the_cli_user_can_do(folder, route, capsys):
    """The message named Python methods ("use predict(), score() or
    rerank()") the CLI has no command for."""
    path = str(ROOT / "tests" / "fixtures" / folder)
    assert cli.main(["embed", "x", "-m", path, "--progress", "never"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mlx-embed embed: {folder} is a "), err
    assert f"mlx-embed serve --model {path}" in err and route in err, err
    assert "in Python" in err and "not embed()" not in err, err


# ---------------------------------------------------------------- bulk


@pytest.mark.parametrize("names", [["missing.jsonl"], ["missing-folder"], ["ok.jsonl", "missing.parquet"]])
def test_bulk_refuses_a_missing_input_before_starting_ray(names, tmp_path, monkeypatch, capsys):
    """It started Ray (~5 s), then said only `mlx-embed: error: /nonexistent.jsonl`."""
    ray = pytest.importorskip("ray")

    def no_ray(*a, **k):
        raise AssertionError("Ray was started for a missing input")

    monkeypatch.setattr(ray, "init", no_ray)
    (tmp_path / "ok.jsonl").write_text('{"id": 1, "text": "a"}\n')
    paths = [str(tmp_path / n) for n in names]
    assert cli.main(["bulk", *paths, "-o", str(tmp_path / "out")]) == 1
    missing = paths[-1]
    assert capsys.readouterr().err == f"mlx-embed bulk: error: {missing}: no such file or folder\n"
    assert not (tmp_path / "out").exists()


def test_bulk_on_a_missing_input_is_quick_from_the_shell(tmp_path):
    pytest.importorskip("ray")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mlx_embed", "bulk", str(tmp_path / "none.jsonl"),
                        "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, env=PY_ENV)
    assert r.returncode == 1
    assert r.stderr.strip().endswith("none.jsonl: no such file or folder"), r.stderr
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------- Python API


@pytest.mark.parametrize("name", ["", " ", " x ", "x ", "\tx", "x\n"])
def test_load_refuses_an_empty_or_padded_name(name):
    """`load(name="")` silently used the folder's name and `name=" x "` was
    kept; the server refuses both in --served-model-name."""
    with pytest.raises(ValueError, match=r"^name .* cannot be a model's name"):
        mlx_embed.load(name=name)


def test_load_keeps_a_good_name():
    assert mlx_embed.load(name="my model").name == "my model"


def test_the_api_listing_gives_score_its_real_shape():
    """The listing said `[len(pairs)]`; a reranker's score() is (len(pairs), 1)."""
    line = next(x for x in mlx_embed.__doc__.splitlines() if "model.score(pairs" in x)
    assert line.rstrip().endswith("[len(pairs), labels]"), line
    model = mlx_embed.load(str(ROOT / "tests" / "fixtures" / "tiny-bert-reranker"))
    assert model.score([("q", "a"), ("q", "b")]).shape == (2, 1)


PROMPTED_TEXTS = ["the cat sat on the mat", "hybrid search with sparse weights", "x"]

def test_prompt_name_on_embed(tmp_path, capsys):
    """`--prompt-name`: the model's named prompt before each text, as the
    library's prompt_name (bulk indexing of documents needs the document
    prompt; the CLI had no way to ask for it)."""
    folder = str(FIXTURES / "tiny-gemma3")
    out = tmp_path / "out.jsonl"
    argv = ["embed", *PROMPTED_TEXTS, "-m", folder, "--prompt-name", "document", "-o", str(out), "--progress", "never"]
    assert cli.main(argv) == 0
    got = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()], dtype=np.float32)
    model = mlx_embed.load(folder)
    want = model.embed(PROMPTED_TEXTS, prompt_name="document")
    assert np.abs(got - want).max() <= 1e-6
    assert np.abs(want - model.embed(PROMPTED_TEXTS)).max() > 1e-3  # the prompt changes the vectors
    assert cli.main(["embed", "x", "-m", folder, "--prompt-name", "passage", "--progress", "never"]) == 1
    assert capsys.readouterr().err == (
        "mlx-embed embed: tiny-gemma3 has no prompt named 'passage' (its prompts: document, query)\n"
    )
