"""Sibling linears that read the same input, run as one matmul.

mlx-lm's decoder blocks call ``q_proj(x), k_proj(x), v_proj(x)`` and
``gate_proj(x), up_proj(x)``: three and two matrix products of one input.
Each is a kernel a GPU pass launches, where a pass's fixed cost is per kernel;
a bf16 Qwen3-0.6B pass runs 196 such GEMMs where 112 would do. ``join`` makes
each such group one linear after load (``load(joined_linears=True)``; why it
is off by default: docs/benchmarks.md, "A decoder's projections as one matmul
each"). The first sibling's module takes the concatenated weights (so a
quantized one keeps its settings), and every sibling's name becomes a
``_Part`` that returns its columns of that one product. mlx-lm's code runs as
it is. With MLX's ops on the CPU the vectors are the same bit for bit: each
output column is reduced the same way whatever the matrix's width. (The
native SiLU kernel, ``ops.native_swiglu``, needs a contiguous gate, so a joined
gate takes MLX's: float32 rounding apart.)

A group computes its product when a part is called with an input other than
the one it last saw (by identity: mlx-lm never changes an input in place
between a group's calls), and keeps the other parts' slices until each has
been taken. So calls in any order, and parts called with inputs of their own
(two threads building graphs at once), still get their own columns of their
own input.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn

from .models import LINEAR_TENSORS

log = logging.getLogger(__name__)

_QUANT_SETTINGS = ("group_size", "bits", "mode")


class _Pending(NamedTuple):
    input: mx.array
    slices: list
    untaken: set


class _Group:
    """One joined linear and the slices of its last output not yet taken."""

    def __init__(self, owner: nn.Module, joined: str, bounds: Sequence[int]):
        # Weak: the owner holds the parts that hold this group, and a cycle
        # would keep a dropped model's weights until the cyclic collector ran.
        self._owner = weakref.ref(owner)
        self._joined = joined
        self._bounds = list(bounds)
        self._pending = None

    def take(self, index: int, x: mx.array) -> mx.array:
        pending = self._pending
        if pending is None or pending.input is not x or index not in pending.untaken:
            y = self._owner()[self._joined](x)
            slices = [y[..., a:b] for a, b in zip(self._bounds, self._bounds[1:])]
            pending = _Pending(x, slices, set(range(len(slices))))
        pending.untaken.discard(index)
        # Dropped once every part is taken: the slices hold the pass's graph.
        self._pending = pending if pending.untaken else None
        return pending.slices[index]


class _Part:
    """What a joined sibling's name calls: its columns of the group's product."""

    def __init__(self, group: _Group, index: int):
        self._group = group
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.take(self._index, x)


def _joinable(modules: list) -> bool:
    first = modules[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear):
        return False
    return all(
        type(m) is type(first)
        and set(m.keys()) == set(first.keys())
        and m.weight.shape[1] == first.weight.shape[1]
        and m.weight.dtype == first.weight.dtype
        and all(getattr(m, s, None) == getattr(first, s, None) for s in _QUANT_SETTINGS)
        for m in modules
    )


def join(model: nn.Module, groups: Iterable[tuple[Sequence[str], str]]) -> int:
    """Join, in every module of ``model`` that has all of a group's sibling
    linears (``(("q_proj", "k_proj", "v_proj"), "qkv_proj")``), those
    siblings into one linear named by the group's second item. Siblings of
    different kinds, input widths, dtypes or quantization stay apart, and so
    do siblings whose module already has a child of the joined name.
    Returns how many groups were joined."""
    groups = [(tuple(names), joined) for names, joined in groups]
    # Only the owners are kept while joining, so each group's separate
    # weights are freed as soon as its joined ones exist.
    owners = [(module, names, joined) for _, module in model.named_modules() for names, joined in groups
              if joined not in module and all(module.get(n) is not None for n in names)]
    count = 0
    for module, names, joined in owners:
        parts = [module[n] for n in names]
        if not _joinable(parts):
            continue
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.weight.shape[0])
        target = parts[0]
        for key in LINEAR_TENSORS:
            if key in target:
                target[key] = mx.concatenate([p[key] for p in parts], axis=0)
        mx.eval(target.parameters())
        setattr(module, joined, target)
        group = _Group(module, joined, bounds)
        for i, name in enumerate(names):
            setattr(module, name, _Part(group, i))
        count += 1
    if count:
        log.debug("joined %d groups of sibling linears", count)
    return count
