"""torch.compile for the served model: regional compilation of the repeated blocks and of the
action expert's glue, with one-pass row reductions on the GPU.

Regional compilation: blocks of one kind share code, so Dynamo traces each kind once and
reuses the compiled graph for every instance (parameters are graph inputs), which keeps
compile time to seconds for the full-size model; the CUDA graph captured around the whole
query (`EngineConfig.cuda_graphs`) removes the launch gaps between blocks. Everything here
compiles in place and is idempotent.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger('molmobot_policy.engine')

# Rows of up to this many elements reduced in one pass under compile on a GPU
# (`wide_row_reductions`); 0 leaves Inductor's heuristic (1024) alone.
PERSISTENT_ROW_LIMIT = 4096


def wide_row_reductions(fn: Callable, limit: int) -> Callable:
    """`fn` with Inductor's persistent-reduction heuristic widened while it runs (and compiles).

    A row reduction (LayerNorm, RMSNorm) over more than 1024 elements is compiled by default
    as a looped reduction that reads its rows twice (statistics, then normalization); a
    persistent one keeps the row in registers and reads it once. The ViT's LayerNorms (rows of
    1152) and the LLM's RMSNorms (2560) are above that default, and read once they take less
    memory traffic. This installs, for the duration of each call, an `InductorChoices` whose
    `should_use_persistent_reduction` also accepts inner reductions of up to `limit` elements
    (the override route that `torch._inductor.choices.InductorChoices` documents; per thread,
    restored afterwards). It changes generated code only, never results beyond reduction
    order. `compile_module_` wraps every compiled block with it, so the first call, wherever
    it comes from, compiles the served kernels. Inductor's on-disk cache keys do not see the
    handler: code cached by a compile with another limit in the same cache directory keeps its
    kernels. Returns `fn` unchanged when `limit` <= 1024 or the hook is missing from this torch.
    """
    if limit <= 1024:
        return fn
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.choices import InductorChoices
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V
    except ImportError as err:   # pragma: no cover - depends on the torch build
        log.info('persistent-reduction hook unavailable (%s); Inductor defaults', err)
        return fn

    class WideRowChoices(InductorChoices):
        def should_use_persistent_reduction(self, features, cooperative_reduction):
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return bool(inductor_config.triton.persistent_reductions
                        and not cooperative_reduction
                        and features.get_reduction_hint() == ReductionHint.INNER
                        and V.graph.sizevars.statically_known_leq(features.reduction_numel,
                                                                  limit))

    choices = WideRowChoices()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with V.set_choices_handler(choices):
            return fn(*args, **kwargs)
    return wrapped


def served_row_limit(module: torch.nn.Module, row_limit: int | None = None) -> int:
    """The one-pass row limit to compile `module` with: `row_limit` if given, else
    PERSISTENT_ROW_LIMIT for a module on a CUDA device and 0 (Inductor's own heuristic)
    elsewhere."""
    if row_limit is not None:
        return row_limit
    return PERSISTENT_ROW_LIMIT if next(module.parameters()).is_cuda else 0


def compile_module_(module: torch.nn.Module, row_limit: int, **compile_kwargs) -> None:
    """`module.compile(**compile_kwargs)` whose compiled call runs, and so compiles, under
    `wide_row_reductions(..., row_limit)`: whoever calls the module first gets the served
    kernels (`nn.Module.compile` keeps the compiled callable in `_compiled_call_impl`, which
    `nn.Module.__call__` runs in place of `forward`). In place."""
    module.compile(**compile_kwargs)
    module._compiled_call_impl = wide_row_reductions(module._compiled_call_impl, row_limit)


def compile_repeated_blocks_(model, row_limit: int | None = None) -> int:
    """torch.compile each repeated block (ViT resblocks, LLM blocks, action-expert blocks) of
    a `MolmoBot`, each with the one-pass row reductions of `served_row_limit(model, row_limit)`
    (`compile_module_`). In place and idempotent. Returns the number of blocks compiled now.
    """
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    vit_blocks = model.vision_backbone.image_vit.transformer.resblocks
    groups = (vit_blocks, model.transformer.blocks, model.action_expert.blocks)
    on_gpu = next(model.parameters()).is_cuda
    limit = served_row_limit(model, row_limit)
    count = 0
    for blocks in groups:
        # The ViT's LayerNorm kernels (rows of 1152) run faster with Inductor's tuned launch
        # configurations; `triton.multi_kernel` is not used: torch 2.11 crashes when a later
        # process loads such a block from Inductor's cache.
        options = ({'coordinate_descent_tuning': True} if on_gpu and blocks is vit_blocks
                   else None)
        for block in blocks:
            if not getattr(block, '_molmobot_compiled', False):
                compile_module_(block, limit, dynamic=False, fullgraph=True, options=options)
                block._molmobot_compiled = True
                count += 1
    return count


def compile_action_expert_glue_(ae, row_limit: int | None = None) -> bool:
    """torch.compile the action expert's per-query and per-step pieces around its blocks:
    `context_rows` (once per query: the context LayerNorm, the state-token concatenation and
    the alignment padding become one kernel instead of three passes over the context),
    `embed_actions` and `final_layer` (every flow step: a few small kernels each, fused).
    The K/V GEMMs and the blocks (or the fused kernel) stay as they are. Row reductions as
    in `compile_repeated_blocks_`. In place and idempotent; returns whether it compiled now."""
    if getattr(ae, '_molmobot_glue_compiled', False):
        return False
    limit = served_row_limit(ae, row_limit)
    # bound methods compiled and set on the instance (they shadow the class's methods)
    for name in ('context_rows', 'embed_actions'):
        setattr(ae, name, wide_row_reductions(
            torch.compile(getattr(ae, name), dynamic=False, fullgraph=True), limit))
    compile_module_(ae.final_layer, limit, dynamic=False, fullgraph=True)
    ae._molmobot_glue_compiled = True
    return True
