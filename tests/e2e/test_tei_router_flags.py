"""A Hugging Face TEI `text-embeddings-router` command line runs unchanged
against the real server binary (crates/mlx-embed/src/launch.rs' TeiArgs and
the TEI aliases of crates/mlx-embed-server/src/config.rs): each TEI flag
does what it does in TEI, is ignored with a warning where that is harmless,
or is refused at start naming what to do instead."""

import json

import numpy as np
import requests
from harness import NOMIC, free_port, start_server
from test_launch_flags import _assert_refused, _refused

KEY = {"Authorization": "Bearer k"}


def _events(server) -> list[dict]:
    """The log as --json-output wrote it: every line one JSON object."""
    return [json.loads(line) for line in server.log().splitlines() if line.strip()]


def _vector(server, path: str, body: dict, headers: dict | None = None) -> np.ndarray:
    r = server.post(path, body, headers=KEY if headers is None else headers)
    assert r.status_code == 200, r.text
    data = r.json()
    if isinstance(data, list):  # TEI's /embed
        row = data[0]
    else:
        row = data["data"][0]["embedding"] if "data" in data else data["embeddings"][0]
    return np.asarray(row, dtype=np.float32)


def test_a_tei_command_line_serves_with_its_settings(tmp_path):
    metrics_port = free_port()
    server = start_server(
        tmp_path,
        "--model-id", str(NOMIC), "--hostname", "127.0.0.1",
        "--max-client-batch-size", "4", "--max-batch-tokens", "4096", "--max-batch-requests", "8",
        "--payload-limit", "3000", "--auto-truncate", "--json-output", "--api-key", "k",
        "--default-prompt-name", "query", "--prometheus-port", str(metrics_port),
        "--tokenization-workers", "4", "--uds-path", "/tmp/text-embeddings-inference-server",
        "--otlp-service-name", "tei", "--device-id", "0", "--no-warmup",
        host=None,
    )
    try:
        info = server.get("/info", headers=KEY).json()
        assert (info["max_client_batch_size"], info["max_batch_tokens"], info["max_batch_requests"],
                info["auto_truncate"]) == (4, 4096, 8, True), info
        # --max-client-batch-size: a fifth input is TEI's 413; --payload-limit: so is a body past 3000 bytes.
        assert server.post("/embed", {"inputs": ["a"] * 5}, headers=KEY).status_code == 413
        assert server.post("/embed", {"inputs": ["a"] * 4}, headers=KEY).status_code == 200
        assert server.post("/embed", {"inputs": "a" * 3000}, headers=KEY).status_code == 413
        assert server.post("/embed", {"inputs": "a"}).status_code == 401
        # --default-prompt-name query: a request naming no prompt gets the query prompt, on every
        # embedding route, not the folder's default (document); one naming a prompt keeps it.
        query = _vector(server, "/api/v1/embed", {"texts": ["hello"], "prompt_name": "query"})
        document = _vector(server, "/embed", {"inputs": "hello", "prompt_name": "document"})
        assert float(np.max(np.abs(query - document))) > 1e-3
        for path, body in [("/embed", {"inputs": "hello"}), ("/v1/embeddings", {"input": "hello"}),
                           ("/api/v1/embed", {"texts": ["hello"]})]:
            np.testing.assert_array_equal(_vector(server, path, body), query, err_msg=path)
        # /tokenize lists the tokens an embedding runs: the default prompt's too, as TEI lists them.
        tokens = {name: server.post("/tokenize", {"inputs": "hello", **body}, headers=KEY).json()[0]
                  for name, body in [("default", {}), ("query", {"prompt_name": "query"}),
                                     ("document", {"prompt_name": "document"})]}
        assert tokens["default"] == tokens["query"] != tokens["document"], tokens
        # --prometheus-port: /metrics alone, behind the key as on the main port.
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        scraped = requests.get(metrics_url + "/metrics", headers=KEY, timeout=30)
        assert scraped.status_code == 200 and "mlx_embed_" in scraped.text, scraped.text[:300]
        assert requests.get(metrics_url + "/metrics", timeout=30).status_code == 401
        assert requests.post(metrics_url + "/embed", json={"inputs": "a"}, headers=KEY,
                             timeout=30).status_code == 404
        assert server.get("/metrics", headers=KEY).status_code == 200
    finally:
        assert server.stop() == 0
    events = _events(server)
    warned = [e["message"] for e in events if e["level"] == "WARN"]
    for said in ("--tokenization-workers 4 is ignored", "--uds-path is ignored",
                 "--otlp-service-name is ignored"):
        assert sum(m.startswith(said) for m in warned) == 1, warned
    done = [e for e in events if e.get("message") == "request done"]
    assert done and all("span" in e for e in done), done[:3]
    # The port closed with the server.
    try:
        requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        raise AssertionError("the metrics port outlived the server")
    except requests.ConnectionError:
        pass


def test_a_default_prompt_text_and_spans_off(tmp_path):
    server = start_server(tmp_path, "--model-id", str(NOMIC), "--default-prompt", "search_query: ",
                          "--json-output", "--disable-spans", "--no-warmup")
    try:
        given = _vector(server, "/embed", {"inputs": "hello", "prompt_name": "query"}, headers={})
        np.testing.assert_array_equal(_vector(server, "/embed", {"inputs": "hello"}, headers={}), given)
    finally:
        assert server.stop() == 0
    done = [e for e in _events(server) if e.get("message") == "request done"]
    assert len(done) >= 2 and not any("span" in e for e in done), done  # /health too


def test_tei_flags_this_server_cannot_honour_are_refused_at_start():
    # --otlp-endpoint is TEI's and works (test_otlp.py); only an address that is none is refused.
    _assert_refused(_refused("--otlp-endpoint", "localhost:4317"), 2,
                    "error: --otlp-endpoint localhost:4317: no scheme (http:// or https://); give the collector's "
                    "OTLP gRPC address, e.g. http://localhost:4317")
    _assert_refused(_refused("--device-id", "1"), 2,
                    "error: --device-id 1: the engine runs on the first device it sees; leave the flag out "
                    "and start the server with CUDA_VISIBLE_DEVICES=1")
    _assert_refused(_refused("--dense-path", "2_Dense_1024"), 2,
                    "error: --dense-path 2_Dense_1024: the Dense modules run are the ones the model folder's "
                    "modules.json lists")
    _assert_refused(_refused("--default-prompt-name", "query", "--default-prompt", "q: "), 2,
                    "error: the argument '--default-prompt-name <DEFAULT_PROMPT_NAME>' cannot be used with "
                    "'--default-prompt <DEFAULT_PROMPT>'")
    # --json-output is --log-format json: beside --log-format text on the command line one would
    # silently overrule the other; MLX_EMBED_LOG_FORMAT=text is overruled by the flag, as any variable is.
    for args in (("--json-output", "--log-format", "text"), ("--log-format=text", "--json-output")):
        _assert_refused(_refused(*args), 2,
                        "error: --json-output and --log-format text contradict each other: --json-output "
                        "writes JSON log lines (it is --log-format json); give one of them")
    run = _refused("--json-output", "--model-id", "test-org/absent",
                   env={"MLX_EMBED_LOG_FORMAT": "text", "HF_HUB_OFFLINE": "1"})
    _assert_refused(run, 1, "not a local folder", not_reached=())
    logged = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert any(e["level"] == "ERROR" and "not a local folder" in e["message"] for e in logged), run.stdout
    # A prompt name the model lacks would make every request naming none a 400: refused once loaded.
    run = _refused("--model-id", str(NOMIC), "--default-prompt-name", "nope")
    _assert_refused(run, 1, '--default-prompt-name "nope": tiny-nomic-bert has no prompt of that name (its '
                    "prompts: classification, clustering, document, query)", not_reached=())
    # TEI's generic environment names are not read: Docker sets HOSTNAME to the container's name.
    _assert_refused(_refused("--model-id", str(NOMIC), "--default-prompt-name", "nope",
                             env={"HOSTNAME": "no-such-host.invalid"}), 1, "has no prompt of that name",
                    not_reached=())
