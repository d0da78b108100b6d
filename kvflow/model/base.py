"""What every kvflow decoder model offers the engine, and the weight loading they share.

A model file (``llama.py``, ...) holds architecture only: it subclasses ``CausalLM``, builds
its layers from ``kvflow.layers`` (parallel linears, ``VocabParallelEmbedding``,
``ParallelLMHead``, norms, rotary, ``Attention``) and writes ``forward``. The engine then
calls:

- ``forward(input_ids, positions, kv_caches, metadata) -> hidden`` over a step's flat
  token batch;
- ``compute_logits(hidden) -> float32 logits`` of the full vocabulary;
- ``kv_cache_spec``: this rank's KV cache geometry (``kvflow.config.KVCacheSpec``);
- ``load_weights(iterable of (Hugging Face name, tensor))``;
- ``forward_prompt(token_ids) -> hidden``: one standalone prefill through a throwaway cache
  (calibration, e.g. AWQ's, which runs the float model outside any engine).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.attention.kv_cache import allocate_kv_cache
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
from kvflow.config import KVCacheSpec, ModelConfig
from kvflow.distributed.parallel_state import TensorParallel


class CausalLM(nn.Module):
    """Base of kvflow's decoder-only language models.

    Subclasses set ``self.config`` (the full model's ``ModelConfig``), ``self.tp``,
    ``self.embed_tokens`` (``VocabParallelEmbedding``) and ``self.lm_head``
    (``ParallelLMHead``), and may extend ``stacked_params_mapping`` / ``skip_weights`` or
    ``map_weight_name`` (names with an index inside, e.g. ``experts.{e}.``). A module whose
    parameters take different checkpoint parts declares them per parameter in
    ``param_shard_ids`` (``{"w13_weight": ((0, "w1"), (0, "w3"), ...)}``), else one tuple in
    ``shard_ids``.

    Attributes:
        stacked_params_mapping: (our parameter part, checkpoint part, shard id): checkpoint
            tensors that load into one part of a fused parameter (``q_proj`` into
            ``qkv_proj`` as shard "q", ...).
        skip_weights: substrings of checkpoint names that hold nothing to load.
        arch_specs: the model_types it runs and how to read them (``kvflow.model.arch``).
        renamed_prefixes: (checkpoint prefix, replacement) pairs, the first that matches
            applied before the ``model.`` prefix is stripped (a multimodal checkpoint's
            ``language_model.model.`` -> ``model.``).
    """

    stacked_params_mapping: list[tuple[str, str, object]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    skip_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    #: One ``kvflow.model.arch.ArchSpec`` per HF model_type the class runs (collected by
    #: ``kvflow.model.registry``); a subclass declares its own.
    arch_specs: tuple = ()

    config: ModelConfig
    tp: TensorParallel | None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's KV cache geometry."""
        world, rank = (1, 0) if self.tp is None else (self.tp.world_size, self.tp.rank)
        return self.config.kv_cache_spec(world, rank)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab rows of this rank, hidden_size]; the embedding matrix when embeddings are tied."""
        return self.lm_head.dense

    @torch.inference_mode()
    def forward_prompt(self, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
        """Run the model over ``token_ids`` as one prompt (positions 0..T-1, one prefill, on the
        PyTorch attention path) through a paged KV cache made for it and dropped after.

        Returns:
            hidden states [T, hidden_size] in the model's dtype.
        """
        param = next(self.parameters())
        n = len(token_ids)
        num_blocks = -(-n // block_size)
        spec = self.kv_cache_spec
        kv_caches = [allocate_kv_cache(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, param.dtype,
                                       param.device) for _ in range(spec.num_layers)]
        positions = torch.arange(n, device=param.device)
        group = AttentionGroup.build(0, [n], [n], [list(range(num_blocks))], block_size, param.device)
        return self(torch.tensor(token_ids, device=param.device), positions, kv_caches,
                    GroupedMetadata(positions.clone(), [group]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: [N, hidden_size] -> float32 logits [N, vocab_size] of the full model
        (under tensor parallelism every rank gets all of them)."""
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        """Our parameter name and shard id for a checkpoint tensor name (``model.`` prefix
        already stripped): ``stacked_params_mapping`` applied (shard id None: the whole
        parameter). Models with other layouts (stacked experts) extend it."""
        for ours, theirs, sid in self.stacked_params_mapping:
            marker = f".{theirs}."
            if marker in name:
                return name.replace(marker, f".{ours}."), sid
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model through each layer's
        ``weight_loader`` (which takes this rank's slice and fuses Q/K/V and gate/up).

        Raises:
            ValueError: for an unexpected tensor name or shape, or when a parameter is left
                without a value or a part of it arrives twice.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: dict[str, set] = {name: set() for name in params}
        for hf_name, tensor in weights:
            if any(skip in hf_name for skip in self.skip_weights):
                continue
            name = hf_name
            for theirs, ours in self.renamed_prefixes:
                if name.startswith(theirs):
                    name = ours + name[len(theirs) :]
                    break
            name = name[len("model.") :] if name.startswith("model.") else name
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard_id = self.map_weight_name(name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r}")
            owner = modules[name.rsplit(".", 1)[0]] if "." in name else self
            parts = _shard_ids(owner, name) if shard_id is None else (shard_id,)
            if loaded[name] & set(parts):
                raise ValueError(f"checkpoint repeats weight {hf_name!r}")
            try:
                loader = getattr(owner, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor, shard_id)
                elif param.shape != tensor.shape:
                    raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                else:
                    param.data.copy_(tensor)
            except ValueError as exc:
                raise ValueError(f"weight {hf_name!r} has {exc}") from None
            loaded[name].update(parts)
        missing = sorted(
            name for name in params
            if loaded[name] != set(_shard_ids(modules.get(name.rsplit(".", 1)[0] if "." in name else ""), name))
        )
        if missing:
            raise ValueError(f"checkpoint is missing or repeats tensors of {len(missing)} parameters, e.g. {missing[:3]}")


def _shard_ids(owner: nn.Module | None, param_name: str) -> tuple:
    """The parts parameter ``param_name`` must receive: its owner's ``param_shard_ids`` entry
    (a module whose parameters take different parts, e.g. stacked experts), else the owner's
    ``shard_ids``, else the whole tensor once ((None,))."""
    per_param = getattr(owner, "param_shard_ids", None) or {}
    leaf = param_name.rsplit(".", 1)[-1]
    return per_param.get(leaf) or getattr(owner, "shard_ids", (None,))
