"""Regional ``torch.compile``: each transformer block's forward compiled, the rest left eager.

On CPU the matmuls of a training step already run in MKL/oneDNN near the machine's rate; what
costs beyond them is the elementwise work inside each block (RMSNorm, rotary embedding, SwiGLU,
residual adds, forward and backward), each op a full pass over a token x hidden tensor in memory.
Inductor fuses those into a few loops per block. Measured on the 2-core CPU (docs/performance.md):
a SmolLM2 update step 11.0-12.0 s eager -> 9.2-9.8 s compiled, 25M model 10.2-12.0 -> 7.1-8.6 s,
same losses to 1e-6 relative.

Compiling every block of a model costs one compilation, not one per block: the blocks share their
forward code, and ``dynamic=True`` makes sequence length and batch size symbolic from the start,
so micro-batches of any shape reuse the graph, except that a micro-batch of one row gets graphs
of its own (torch specializes sizes 0 and 1; ``backed_size_oblivious``, which would not, failed a
compiled backward's stride assertion in torch 2.13). Training and no-grad forwards (log-probs) are
one graph each. The first call pays the compilation (15-30 s per process on 2 cores for Qwen2/Llama
blocks, 40-60 s on a Zen 1 with its one-row graphs; inductor's on-disk cache makes later processes
faster).

Only ``forward`` is replaced, so module hooks (FSDP2's parameter gathers, activation
checkpointing) stay eager around the compiled body.

The norms outside the blocks (the final RMSNorm before the LM head) are compiled the same way: in
eager mode its forward and backward were about ten passes over the last hidden states (the tiny
model's update: 3-4 ms of a 0.26 s step, e.g. 0.95 ms in one ``mean``).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil

import torch
from torch import nn

from hybridrl.engine.fsdp import block_modules
from hybridrl.models.loading import without_hub_kernels

__all__ = ["compile_blocks"]

_CXX = ("c++", "g++", "clang++")


def compile_blocks(model: nn.Module, device: torch.device) -> int:
    """Replace each transformer block's ``forward`` of ``model`` with its compiled version; returns
    how many blocks were compiled. Raises if the model has no repeated blocks, or if inductor could
    not build kernels (no C++ compiler on PATH for CPU, no triton for CUDA), before any step runs."""
    blocks = block_modules(model)
    if not blocks:
        raise ValueError(
            f"torch compile: found no transformer blocks in {type(model).__name__} (no _no_split_modules and "
            "no ModuleList of one class); set use_torch_compile=false"
        )
    if device.type == "cpu" and not any(shutil.which(cxx) for cxx in _CXX):
        raise RuntimeError(
            "torch compile on CPU builds C++ kernels, but no C++ compiler (c++, g++ or clang++) is on PATH; "
            "install one or set use_torch_compile=false"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise RuntimeError("torch compile on CUDA builds Triton kernels, but triton is not installed; "
                           "install it or set use_torch_compile=false")
    without_hub_kernels(model)  # else the final norm's compiled forward goes at the first train()
    for module in blocks + _norms_outside(model, blocks):
        module.forward = _without_duck_shapes(torch.compile(module.forward, dynamic=True))
    return len(blocks)


def _norms_outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The normalisation modules (class name ending in ``Norm``: RMSNorm, LayerNorm ...) that no
    block contains, e.g. the final norm before the LM head."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [m for m in model.modules() if id(m) not in inside and type(m).__name__.endswith("Norm")]


def _without_duck_shapes(compiled):
    """``compiled`` traced without duck shaping: by default two dimensions that happen to be equal
    when a graph is first traced share one symbol, and a later call where they differ recompiles
    (seconds on a CPU). A micro-batch of 16 distinct prompts trimmed to 16 tokens (shared prompts,
    ``hybridrl.engine.shared_prefix``) made the next step's shapes recompile every block; without
    duck shaping each dimension gets its own symbol once."""
    from torch.fx.experimental import _config as shape_config

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with shape_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return forward
