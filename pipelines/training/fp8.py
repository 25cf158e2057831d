"""FP8 training of the Linear layers with torchao.float8 (torchtitan's route; CUDA, H100-class GPUs).

`fp8_modules` picks the Linear layers that run in FP8 under the Nemotron-H FP8 recipe's exceptions: the
first and the last block and lm_head stay in bf16, and so do the MoE routers (their logits pick experts)
and any Linear whose widths are not multiples of 16 (the FP8 matmul's alignment). `apply_fp8` swaps
exactly those for torchao's Float8Linear (dynamic tensorwise scaling) before the model is sharded; the
teacher's forward can run in FP8 as well.
"""
from __future__ import annotations

from torch import nn

from remodel.models.errors import RemodelError


def fp8_modules(model) -> list[str]:
    """Names of the Linear modules that run in FP8 (see the module doc)."""
    last = len(model.layers) - 1
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not name.startswith("layers."):
            continue
        block = int(name.split(".")[1])
        if block in (0, last) or ".gate" in name or m.in_features % 16 or m.out_features % 16:
            continue
        names.append(name)
    return names


def apply_fp8(model, device) -> list[str]:
    """Swap the `fp8_modules` of `model` for torchao Float8Linear; -> their names. CUDA only."""
    if getattr(device, "type", str(device)) != "cuda":
        raise RemodelError("--fp8 needs a CUDA GPU with FP8 matmuls (H100-class); this run is on "
                           f"{device}")
    return convert(model)


def convert(model) -> list[str]:
    """The module swap itself (device-independent, so CPU tests can check what is converted)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise RemodelError("--fp8 needs torchao: pip install -e '.[gpu]'") from None
    chosen = set(fp8_modules(model))
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda m, fqn: fqn in chosen)
    return sorted(chosen)
