#!/usr/bin/env python3
"""The engine on a GPU, beside torch on the same weights and token ids.

For three model shapes with seeded random weights (MiniLM-L6, BERT-base,
Qwen3-0.6B) it reports:

* parity: fp32 engine vs fp32 transformers on the same ids (min cosine, max |diff|);
* texts/s for one call and for calls of 32 (back to back, and with the next
  call submitted before the previous is collected), in bf16 and fp32, beside
  torch fp16 (BERT shapes) / bf16 (Qwen3) at batch 32 and 256;
* one-text latency (fp32);
* MLX memory (active/cache/peak) and device memory before and after 2,000
  calls of varied shapes;
* with ``--sweep``: the device sub-batch budget (``batch_tokens``) and the
  stream count, one call and calls of 32;
* with ``--quantized``: Qwen3 shape bf16 vs 8-bit vs 4-bit quantized kernels,
  one call and two-text latency (the measured choice behind dequantizing
  pre-quantized checkpoints on CUDA).

Torch is optional: without it the peer and parity rows are left out.

    python scripts/bench_gpu.py --out results/            # on a CUDA (or Metal) machine
    python scripts/bench_gpu.py --shapes minilm --sweep
    python scripts/bench_gpu.py --dry-run                 # tiny shapes on the CPU (make test)

Token ids are generated (seeded, mixed lengths, ~64 tokens on average), not
tokenized text, so engine and peer see exactly the same input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import mlx_embed  # noqa: E402  (before mlx.core: it picks the CPU BLAS)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

TOKENIZER = ROOT / "tests" / "fixtures" / "tiny-qwen3" / "tokenizer.json"

_BERT = {
    "model_type": "bert", "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0,
    "architectures": ["BertModel"],
}
_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 151669, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "architectures": ["Qwen3Model"],
}
SHAPES = {
    "minilm": ({**_BERT, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                "intermediate_size": 1536}, 8192),
    "bert-base": ({**_BERT, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "intermediate_size": 3072}, 4096),
    "qwen3-0.6b": ({**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                    "intermediate_size": 3072}, 2048),
}
DRY_SHAPES = {
    "tiny-bert": ({**_BERT, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "intermediate_size": 128}, 48),
    "tiny-qwen3": ({**_QWEN3, "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "intermediate_size": 128}, 48),
}


def corpus(n: int, seed: int, max_len: int = 256) -> list[list[int]]:
    """[CLS] content [SEP] with mixed lengths: 30% short, 55% medium, 15% long
    (about 64 tokens on average)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        k = int(rng.integers(3, 20) if r < 0.3 else rng.integers(30, 100) if r < 0.85
                else rng.integers(120, max_len - 1))
        out.append([101, *rng.integers(1000, 29000, k).tolist(), 102])
    return out


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def make_checkpoint(name: str, config: dict, folder: Path, seed: int, use_torch: bool) -> None:
    """A Hugging Face folder with seeded random weights: made by transformers
    when torch is here (so the peer loads the very same weights), otherwise
    by the engine's own model classes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    if use_torch:
        import torch
        from transformers import AutoConfig, AutoModel

        torch.manual_seed(seed)
        cfg = AutoConfig.for_model(**config)
        model = AutoModel.from_config(cfg, torch_dtype=torch.float32)
        model.save_pretrained(folder, safe_serialization=True)
        return
    from mlx.utils import tree_flatten

    from mlx_embed import loading

    arch = loading.architecture(config["model_type"])
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))


def seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_rates(model, ids: list[list[int]], reps: int, call: int) -> dict:
    def one_call():
        model.embed_ids(ids)

    def calls_of(n):
        for i in range(0, len(ids), n):
            model.embed_ids(ids[i : i + n])

    def overlapped(n):
        # What a model thread can do: submit batch k+1 before collecting k.
        prev = None
        for i in range(0, len(ids), n):
            cur = model.submit_ids(ids[i : i + n])
            if prev is not None:
                prev.result()
            prev = cur
        if prev is not None:
            prev.result()

    one_call()
    calls_of(call)
    n = len(ids)
    return {
        "one_call": n / seconds(one_call, reps),
        f"calls_of_{call}": n / seconds(lambda: calls_of(call), reps),
        f"calls_of_{call}_overlapped": n / seconds(lambda: overlapped(call), reps),
    }


def latency_ms(model, ids: list[list[int]], reps: int) -> float:
    one = [ids[0]]
    model.embed_ids(one)
    return 1e3 * seconds(lambda: model.embed_ids(one), reps)


def mlx_vectors(model, ids) -> np.ndarray:
    return np.frombuffer(model.embed_ids(ids).vectors, "<f4").reshape(len(ids), -1)


class TorchPeer:
    def __init__(self, folder: Path, pooling: str, dtype: str):
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = getattr(torch, dtype)
        self.model = AutoModel.from_pretrained(folder, torch_dtype=self.dtype).to(self.dev).eval()
        self.pooling = pooling

    def embed(self, ids: list[list[int]], batch: int) -> np.ndarray:
        torch = self.torch
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # as sentence-transformers
        out = np.empty((len(ids), self.model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for s in range(0, len(order), batch):
                idx = order[s : s + batch]
                L = max(len(ids[i]) for i in idx)
                arr = torch.zeros((len(idx), L), dtype=torch.long)
                mask = torch.zeros((len(idx), L), dtype=torch.long)
                for r, i in enumerate(idx):
                    arr[r, : len(ids[i])] = torch.tensor(ids[i])
                    mask[r, : len(ids[i])] = 1
                arr, mask = arr.to(self.dev), mask.to(self.dev)
                h = self.model(input_ids=arr, attention_mask=mask).last_hidden_state
                if self.pooling == "mean":
                    m = mask.unsqueeze(-1).to(h.dtype)
                    v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                else:
                    v = h[torch.arange(len(idx), device=self.dev), mask.sum(1) - 1]
                out[idx] = v.float().cpu().numpy()
        return out

    def rate(self, ids, batch: int, reps: int) -> float:
        self.embed(ids[: batch * 2], batch)
        return len(ids) / seconds(lambda: self.embed(ids, batch), reps)


def device_used_bytes():
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return total - free
    except ImportError:
        pass
    return None


def memory_run(model, calls: int, seed: int, max_rows: int) -> dict:
    """Varied shapes, as a server sees them: every call a new padded shape."""
    rng = np.random.default_rng(seed)
    pool = corpus(4096, seed + 1)
    before = {**model.memory(), "device_used_bytes": device_used_bytes()}
    for _ in range(calls):
        rows = int(rng.integers(1, max_rows + 1))
        pick = rng.integers(0, len(pool), rows)
        model.embed_ids([pool[i] for i in pick])
    mx.synchronize()
    after = {**model.memory(), "device_used_bytes": device_used_bytes()}
    return {"calls": calls, "before": before, "after": after}


def bench_shape(name, config, n_texts, args, use_torch, workdir: Path) -> dict:
    folder = workdir / name
    make_checkpoint(name, config, folder, args.seed, use_torch)
    ids = corpus(n_texts, args.seed)
    pooling = "last" if config["model_type"] == "qwen3" else "mean"
    res: dict = {"texts": len(ids), "tokens": sum(map(len, ids))}
    common = {"batch_tokens": args.batch_tokens} if args.batch_tokens else {}
    models = {}
    for dtype in ("bfloat16", "float32"):
        m = mlx_embed.load(folder, dtype=dtype, **common)
        models[dtype] = m
        res[f"engine_{dtype}"] = engine_rates(m, ids, args.reps, args.call)
        print(f"{name} engine {dtype}: {res[f'engine_{dtype}']}", flush=True)
    fp32 = models["float32"]
    res["device"] = fp32.device
    res["engine_details"] = fp32.spec().details
    res["latency_ms_fp32"] = latency_ms(fp32, ids, max(5, args.reps * 5))
    if use_torch:
        sub = ids[: min(len(ids), 256)]
        ref = TorchPeer(folder, pooling, "float32").embed(sub, 32)
        got = mlx_vectors(fp32, sub)
        cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
        res["parity_fp32"] = {"min_cosine": float(cos.min()),
                              "max_abs_diff": float(np.abs(ref - got).max())}
        half = "bfloat16" if config["model_type"] == "qwen3" else "float16"
        peer = TorchPeer(folder, pooling, half)
        res[f"torch_{half}"] = {f"batch_{b}": peer.rate(ids, b, args.reps) for b in (32, 256)}
        peer32 = TorchPeer(folder, pooling, "float32")
        one = [ids[0]]
        peer32.embed(one, 1)
        res["torch_latency_ms_fp32"] = 1e3 * seconds(lambda: peer32.embed(one, 1), max(5, args.reps * 5))
        del peer, peer32
        print(f"{name} torch: {res[f'torch_{half}']} parity {res['parity_fp32']}", flush=True)
    del models
    if config["model_type"] == "qwen3" or args.dry_run:
        m = mlx_embed.load(folder, dtype="bfloat16", **common)
        res["memory"] = memory_run(m, args.memory_calls, args.seed, args.call * 2)
        print(f"{name} memory: {res['memory']}", flush=True)
    if args.sweep:
        res["sweep"] = {}
        budgets = (1024, 2048) if args.dry_run else (2048, 4096, 8192, 16384, 32768)
        for bt in budgets:
            for streams in (1, 2, 4):
                m = mlx_embed.load(folder, dtype="bfloat16", batch_tokens=bt, streams=streams)
                res["sweep"][f"batch_tokens={bt},streams={streams}"] = engine_rates(
                    m, ids, args.reps, args.call)
        print(f"{name} sweep: {res['sweep']}", flush=True)
    if args.quantized and config["model_type"] == "qwen3":
        res["quantized"] = {}
        big = ids[: min(len(ids), 1024)]
        for label, kw in (("bf16", {}), ("8-bit", {"quantize": 8}), ("4-bit", {"quantize": 4})):
            m = mlx_embed.load(folder, dtype="bfloat16", group_size=64, **kw)
            m.embed_ids(big)
            rate = len(big) / seconds(lambda m=m: m.embed_ids(big), args.reps)
            two = big[:2]
            m.embed_ids(two)
            lat = 1e3 * seconds(lambda m=m: m.embed_ids(two), max(5, args.reps * 5))
            res["quantized"][label] = {"texts_per_s_one_call": rate, "two_texts_ms": lat}
        print(f"{name} quantized: {res['quantized']}", flush=True)
    return res


def summary(results: dict, call: int) -> str:
    lines = ["| shape | engine bf16 one call | bf16 calls of {c} | overlapped | engine fp32 one call "
             "| torch half b256 | torch half b32 | 1-text ms engine/torch | parity min cos |".format(c=call),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        b, f = r["engine_bfloat16"], r["engine_float32"]
        peer = r.get("torch_float16") or r.get("torch_bfloat16") or {}
        par = r.get("parity_fp32", {}).get("min_cosine")
        lines.append(
            f"| {name} | {b['one_call']:.0f} | {b[f'calls_of_{call}']:.0f} | "
            f"{b[f'calls_of_{call}_overlapped']:.0f} | {f['one_call']:.0f} | "
            f"{peer.get('batch_256', float('nan')):.0f} | {peer.get('batch_32', float('nan')):.0f} | "
            f"{r['latency_ms_fp32']:.1f} / {r.get('torch_latency_ms_fp32', float('nan')):.1f} | "
            f"{'-' if par is None else f'{par:.7f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, seconds not minutes")
    p.add_argument("--allow-cpu", action="store_true", help="run the real shapes without a GPU")
    p.add_argument("--no-torch", action="store_true", help="leave the torch peer and parity out")
    p.add_argument("--sweep", action="store_true", help="batch_tokens x streams sweep")
    p.add_argument("--quantized", action="store_true", help="Qwen3 shape: 8/4-bit kernels vs bf16")
    p.add_argument("--batch-tokens", type=int, help="device sub-batch budget (default: the engine's)")
    p.add_argument("--call", type=int, default=32, help="texts per call for the small-call rows")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--memory-calls", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)

    if args.dry_run:
        mx.set_default_device(mx.cpu)
        shapes = DRY_SHAPES
        args.reps, args.memory_calls, args.call = 1, min(args.memory_calls, 40), 8
    else:
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = set(names) - set(SHAPES)
        if unknown:
            p.error(f"unknown shapes {sorted(unknown)}")
        shapes = {n: SHAPES[n] for n in names}
        if mx.default_device() == mx.cpu and not args.allow_cpu:
            p.error("no GPU: MLX runs on the CPU here (use --dry-run or --allow-cpu)")
    use_torch = torch_available() and not args.no_torch and not args.dry_run
    meta = {"mlx": mx.__version__, "device": None, "torch": None, "argv": sys.argv[1:]}
    if use_torch:
        import torch

        meta["torch"] = torch.__version__
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        for name, (config, n) in shapes.items():
            results[name] = bench_shape(name, config, n, args, use_torch, Path(tmp))
            meta["device"] = results[name]["device"]
    print(f"\n# {meta}")
    print(summary(results, args.call))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
