"""Qwen3.5 and Qwen3.5-MoE as released: transformers' `qwen3_5` / `qwen3_5_moe` (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration), the text models of models/families/qwen3_5.py and qwen3_5_moe.py under
`text_config` and `model.language_model.*`, beside a vision tower and its merger (`model.visual.*`) that pass
through byte-identical (models/families/tower.py). The merger projects into the text model's hidden size, so
the hidden size cannot be pruned; every other axis prunes. eval and score read the text model only."""
from __future__ import annotations

from .qwen3_5 import QWEN3_5_TEXT
from .qwen3_5_moe import QWEN3_5_MOE_TEXT
from .tower import WithTower

VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, temporal_patch_size=1,
              spatial_merge_size=2, num_position_embeddings=16,
              out_hidden_size=QWEN3_5_TEXT.tiny["plain"]["hidden_size"])  # the merger's output: the text hidden size
_TOWER = dict(nested="text_config", passthrough=("model.visual.",), tower="vision_config",
              feeds={"hidden_size": "vision_config.out_hidden_size"},
              why="the vision merger (model.visual.merger) projects into the text model's hidden size")

QWEN3_5 = WithTower.around(QWEN3_5_TEXT, "qwen3_5", "Qwen3_5ForConditionalGeneration", upcycles_to="qwen3_5_moe",
                           upcycle_help="qwen3_5_moe (its shared expert is gated; the tower passes through)",
                           tiny={"plain": dict(text_config=QWEN3_5_TEXT.tiny["plain"], vision_config=VISION)}, **_TOWER)
QWEN3_5_MOE = WithTower.around(QWEN3_5_MOE_TEXT, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
                               upcycle_help="none (already MoE)",
                               tiny={"plain": dict(text_config=QWEN3_5_MOE_TEXT.tiny["plain"], vision_config=VISION)},
                               **_TOWER)

REGISTER = (QWEN3_5, QWEN3_5_MOE)  # the families this module adds to models.families.FAMILIES, in order
