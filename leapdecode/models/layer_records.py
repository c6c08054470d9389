"""Quantized layers' packed records kept in one safetensors file between loads of the same file.

Why: converting a GGUF's blocks to the kernel's layout is seconds of reshuffling for a 1.5B
model; reading the converted records back is a copy. The file holds, per layer, its records and
[bits, outputs, inputs, super-block form, whether they are the source file's own values]; a
layer the file lacks (or a file that does not fit) is built afresh, and then the whole set is
written again. The cache only saves time: a failed read or write is logged, never raised.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from leapdecode.models.embedding import QuantizedEmbedding
from leapdecode.models.quantize import QuantizedLinear, huge_page_empty

Build = Callable[[], tuple[QuantizedLinear | None, bool]]  # a layer (None: none fits) and whether exact


class LayerRecords:
    """The layers kept in `path` (None: nothing kept), read on request; `exact` says, per layer
    name, whether its records are the source file's own values (not rounded again)."""

    def __init__(self, path: Path | None, stale: str, log: Callable[[str], None]) -> None:
        self.path, self.stale, self.log = path, stale, log
        self.exact: dict[str, bool] = {}
        self.fresh = 0
        self._index: dict[str, tuple[str, list[int], int, int]] = {}  # name → dtype, shape, start, end
        if path is not None and path.is_file():
            try:
                self._index = _safetensors_index(path)
            except (OSError, ValueError) as exc:
                log(f"ignoring the kept layers in {path} ({exc})")

    def layer(self, name: str, bias: torch.Tensor | None, build: Build) -> QuantizedLinear | None:
        """`name`'s layer as kept, else `build()`'s."""
        kept = self._read(name, bias)
        if kept is not None:
            return kept
        layer, exact = build()
        if layer is not None:
            self.exact[name] = exact
            self.fresh += 1
        return layer

    def _tensor(self, key: str) -> torch.Tensor:
        """One tensor read from the file straight into memory of its own (huge pages for packed
        records: one copy, from the page cache into the layer's final memory; nothing mapped)."""
        assert self.path is not None
        dtype, shape, start, end = self._index[key]
        kind = {"U8": torch.uint8, "I64": torch.int64}.get(dtype)
        if kind is None or end - start != int(np.prod(shape)) * kind.itemsize:
            raise ValueError(f"{key}: {dtype} {shape} over {end - start} bytes")
        out = huge_page_empty(tuple(shape)) if kind == torch.uint8 else torch.empty(shape, dtype=kind)
        with open(self.path, "rb") as fh:
            fh.seek(start)
            if fh.readinto(memoryview(out.numpy()).cast("B")) != end - start:
                raise ValueError(f"{key} runs past the end of the file")
        return out

    def _read(self, name: str, bias: torch.Tensor | None) -> QuantizedLinear | None:
        if f"{name}.shape" not in self._index or f"{name}.packed" not in self._index:
            return None
        try:
            bits, out_features, in_features, super_blocks, exact = self._tensor(f"{name}.shape").tolist()
            packed = self._tensor(f"{name}.packed")  # already in huge pages: taken as it is
            layer = QuantizedLinear(packed, bits, out_features, in_features, bias, bool(super_blocks), copy=False)
        except (ValueError, RuntimeError, OSError) as exc:
            self.log(f"rebuilding {name}: its kept records do not fit ({exc})")
            return None
        self.exact[name] = bool(exact)
        return layer

    def keep(self, model: nn.Module) -> None:
        """Write every quantized layer's records (an embedding sharing a layer's: once) when any
        was built afresh; remove older files matching `stale` beside it."""
        if self.path is None or not self.fresh:
            return
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        modules = sorted(model.named_modules(), key=lambda item: isinstance(item[1], QuantizedEmbedding))
        for name, module in modules:  # the layers first: an embedding sharing one's records is left out
            if not isinstance(module, QuantizedLinear | QuantizedEmbedding) or module.packed.data_ptr() in seen:
                continue
            seen.add(module.packed.data_ptr())
            shape = (
                (module.out_features, module.in_features)
                if isinstance(module, QuantizedLinear)
                else (
                    module.num_embeddings,
                    module.embedding_dim,
                )
            )
            tensors[f"{name}.packed"] = module.packed
            tensors[f"{name}.shape"] = torch.tensor(
                [module.bits, *shape, module.super_blocks, self.exact.get(name, False)], dtype=torch.int64
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=self.path.name, suffix=".partial", dir=self.path.parent)
        os.close(handle)
        try:
            save_file(tensors, partial)
            Path(partial).replace(self.path)
        except (OSError, SafetensorError) as exc:
            self.log(f"could not keep the quantized layers in {self.path} ({exc})")
            return
        finally:
            Path(partial).unlink(missing_ok=True)
        self.log(f"kept the quantized layers in {self.path}")
        for old in self.path.parent.glob(self.stale):
            if old != self.path:
                old.unlink(missing_ok=True)


def _safetensors_index(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """A safetensors file's tensors: name → (dtype, shape, first byte, byte past the end), from its
    header (8 bytes of length, then JSON)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size < 100 << 20:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(fh.read(size))
    base = 8 + size
    return {
        name: (entry["dtype"], list(entry["shape"]), base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }
