"""Internal. What a receiver loads into: vLLM's ``load_weights`` contract, and :class:`CopyInto`,
the batched target for engines that take the trainer's tensors as they are."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .manifest import raw

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


class CopyInto:
    """An engine target for models whose tensors take the trainer's as they are (same names,
    dtypes and shapes, as a plain ``state_dict`` does): each bucket's tensors land in one
    ``torch._foreach_copy_``, one batched launch per bucket on a device instead of a Python
    call and a launch per tensor. Engines that transform weights as they load (vLLM's fused
    projections, quantized layouts) keep their own ``load_weights``.

    ``WeightReceiver(coordinator, CopyInto(model.state_dict()))`` loads through it and checks
    the manifest against the same tensors before any byte moves.

    Args:
        params: Tensor name -> the engine's tensor, written in place.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]):
        self.params = dict(params)
        self.expected = self.params
        # each tensor's bytes as integers (packing.raw: a batched copy keeps NaN payloads then)
        self._raw = {name: raw(t) for name, t in self.params.items()}
        # the same of the tensors given to load: a receiver gives the same views every version
        # (packing.Unpacker), so their integer views are made once; an entry goes with its tensor
        self._given: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}

    def _bits(self, t: torch.Tensor) -> torch.Tensor | None:
        key = id(t)
        got = self._given.get(key)
        if got is None or got[0]() is not t:
            got = self._given[key] = (weakref.ref(t, lambda _, key=key: self._given.pop(key, None)), raw(t))
        return got[1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every (name, tensor) into the engine's tensor of that name, in one batch."""
        dst, src = [], []
        for name, t in weights:
            into, bits = self._raw[name], self._bits(t)
            if into is None or bits is None or bits.dtype != into.dtype:
                self.params[name].copy_(t)  # no integer twin (complex128), or another dtype: converted as copy_ does
            else:
                dst.append(into)
                src.append(bits)
        if dst:
            torch._foreach_copy_(dst, src)
