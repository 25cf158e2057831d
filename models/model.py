"""The hybrid causal LM: embeddings -> [x + mixer(norm(x))] per pattern character -> norm_f -> lm_head.

Module and parameter names follow transformers' `nemotron_h` in-memory layout (without the
`model.` prefix), so hooks, pruning tables and conversion all speak one vocabulary.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .block import Block
from .config import ModelConfig
from .mtp import MTP
from .norm import trunk_norm
from .trunk import finish, start, walk, walk_mtp

__all__ = ["Block", "HybridLM"]


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight skips nn.Embedding's own normal_ init: on the meta device (load_model) that call
        # goes through torch._refs and imports dynamo, 2.5 s per model load for nothing
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                       _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if not self.embeddings.weight.is_meta:
            nn.init.normal_(self.embeddings.weight)
        self.layers = nn.ModuleList(Block(cfg, s.kind.char) for s in cfg.slots)
        self.norm_f = trunk_norm(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_input = nn.Identity()  # what the output projection reads (tensor parallelism puts its entry here)
        if cfg.mtp_layers:  # only when the checkpoint has an MTP head; the trunk never reads it
            self.mtp = MTP(cfg)

    def init_buffers(self, device) -> HybridLM:
        """The non-persistent buffers of every layer, trunk and MTP head, on `device` (see init_buffers)."""
        return init_buffers(self, device)

    def hidden(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states=False):
        """-> (the final hidden states: norm_f's output divided by cfg.scales.logits_scaling (times cfg.scales.lm_head_multiplier),
        so that any output projection of them gives the model's logits; the residual stream after every layer, or None)."""
        x = start(self.cfg, self.embed(input_ids))
        record = [x] if output_hidden_states else None

        def passes(i, block):
            yield ("x",), contextlib.nullcontext()
            if record is not None:
                record.append(stream["x"])

        stream = {"x": x}
        walk(len(self.layers), self.layers.__getitem__, stream, passes, lambda key: (attention_mask, position_ids))
        return finish(self.cfg, self.norm_f, stream["x"]), record

    def embed(self, ids):
        """The embedding rows of `ids` [b, l] -> [b, l, H]; the row cfg.padding_idx gets no gradient from this
        lookup (transformers' nn.Embedding padding_idx, where the family builds it: ModelConfig.padding_idx, None
        to train every row). Masked here on the lookup's output, not by nn.Embedding's own padding_idx, so that any
        module standing in for the embedding (tensor parallelism's vocab-parallel one) freezes the same row; the
        row's weights are never touched (it is still read, and a tied lm_head still trains it)."""
        x = self.embeddings(ids)
        p = self.cfg.padding_idx
        if p is None or not x.requires_grad:
            return x
        return torch.where((ids == p).unsqueeze(-1), x.detach(), x)

    def logits(self, h):
        w = self.embeddings.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(self.logit_input(h), w)

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states=False,
                return_hidden=False):
        """-> logits [b, l, V] (and the residual stream after every layer, embeddings first).
        return_hidden: the final hidden states [b, l, H] (as `hidden` gives them) instead of the logits, for a
        loss that applies the lm_head itself (pipelines.training.fused_loss); through forward, not `hidden`, so
        that FSDP's root hooks gather (and keep until the backward) the embeddings, norm_f and lm_head."""
        h, states = self.hidden(input_ids, attention_mask, position_ids, output_hidden_states)
        out = h if return_hidden else self.logits(h)
        return (out, states) if output_hidden_states else out

    def mtp_logits(self, h, next_ids, step: int = 0, attention_mask=None):
        """MTP step `step` -> logits [b, l, V]: h [b, l, H] is the trunk's output after norm_f (or
        step-1's output), next_ids [b, l] the tokens one position further on (input_ids[:, 1:] for
        step 0); row t then predicts token t + 2 + step."""
        return self.logits(self.mtp.step(step, h, self.embed(next_ids), attention_mask))

    def forward_mtp(self, input_ids):
        """-> (trunk logits [b, l, V], [MTP logits of step k: [b, l - 1 - k, V] for every step])."""
        h, _ = self.hidden(input_ids)
        out, stream, P = [], {"x": h}, len(self.cfg.mtp_pattern)

        def around(j, block):  # a step's logits after its last block
            return contextlib.nullcontext(), (lambda j: out.append(self.logits(stream["x"])) if j % P == P - 1 else None)

        walk_mtp(self.cfg, lambda j: self.mtp.layers[j], stream, ("x",), lambda key, k: self.embed(input_ids[:, k + 1:]),
                 around=around)
        return self.logits(h), out

    def moe_layers(self):
        """The trunk's MoE mixers (the MTP head's are under self.mtp.layers)."""
        return [layer.mixer for layer in self.layers if layer.spec.routed]


def init_buffers(module: nn.Module, device) -> nn.Module:
    """Rebuild the non-persistent buffers (RoPE frequencies, ...) of `module` (a model, a block, any
    part) on `device`: every submodule that has them says how in its build_buffers(device)."""
    for m in module.modules():
        if hasattr(type(m), "build_buffers"):
            m.build_buffers(device)
    return module


@torch.no_grad()
def init_weights(model: HybridLM, std: float = 0.02, seed: int | None = None) -> HybridLM:
    """Fresh initialisation in the style of transformers' _init_weights: each mixer's own parameters (A_log,
    dt_bias, its convs) as its kind says (LayerKind.init_param), the rest generic: norms one, biases zero,
    weights normal(std), the residual-out projections std / sqrt(2 * layers) (nemotron_h)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    cfg = model.cfg
    blocks = [(f"layers.{i}.mixer.", b) for i, b in enumerate(model.layers)]
    blocks += [(f"mtp.layers.{j}.mixer.", b) for j, b in enumerate(model.mtp.layers)] if cfg.mtp_layers else []
    owner = {p + n: (b.spec, n) for p, b in blocks for n, _ in b.mixer.named_parameters()}
    for name, p in model.named_parameters():
        init_tensor(cfg, name, p, g, std, owner.get(name))
    return model


@torch.no_grad()
def init_tensor(cfg, name: str, p, g, std: float, owner=None):
    """init_weights' rule for one parameter `name` (the model's name for it), drawn from generator g; owner:
    (its layer's spec, its name in the mixer) for a mixer's own parameter (upcycle.hybridize: one layer alone)."""
    leaf = name.rsplit(".", 1)[-1]
    if owner is not None and owner[0].init_param(cfg, owner[1], p, g, std):
        return
    if name.endswith("norm.weight") or name.endswith("_norm.weight"):
        p.fill_(1.0)
    elif leaf == "bias" or name.endswith("gate.weight") and p.shape[0] == 1:
        p.zero_()
    else:
        s = std / math.sqrt(2 * cfg.num_layers) if leaf in ("out_proj", "o_proj", "down_proj") or name.endswith(
            ("out_proj.weight", "o_proj.weight", "down_proj.weight")) else std
        p.normal_(0.0, s, generator=g)
