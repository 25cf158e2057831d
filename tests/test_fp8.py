"""FP8 (pipelines/training/fp8.py): which Linear layers run in FP8 under the Nemotron-H recipe's exceptions, that
torchao's swap converts exactly those (checked on CPU; the FP8 matmuls themselves need an H100), and that
a run asking for FP8 off CUDA is refused with one line before any work."""
import pytest
import torch

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.training.fp8 import convert, fp8_modules


def model():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, pattern="M*-E-M", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                      chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return init_weights(HybridLM(cfg), seed=0)


def test_fp8_picks_the_recipe_layers_and_torchao_swaps_exactly_those():
    m = model()
    names = fp8_modules(m)
    assert names and all(not n.startswith(("layers.0.", "layers.5.")) for n in names)  # first / last stay bf16
    assert "layers.1.mixer.q_proj" in names and "layers.2.mixer.down_proj" in names
    assert not any(".gate" in n for n in names)  # the MoE router stays bf16
    keys = set(m.state_dict())
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear
    assert convert(m) == sorted(names)
    swapped = sorted(n for n, x in m.named_modules() if isinstance(x, Float8Linear))
    assert swapped == sorted(names) and set(m.state_dict()) == keys  # checkpoints keep their names
    assert not isinstance(m.lm_head, Float8Linear) and not isinstance(m.layers[0].mixer.in_proj, Float8Linear)


def test_fp8_off_cuda_is_refused_before_work(tmp_path):
    from remodel.pipelines.training.train import train
    with pytest.raises(RemodelError, match="--fp8"):
        train(tmp_path / "missing", tmp_path / "o", tmp_path / "d.txt", steps=1, fp8=True, device="cpu")
    assert not (tmp_path / "o").exists()


def test_fp8_linears_run_compiled_and_equal_eager(monkeypatch):
    """With the compiled path forced on CPU (as on CUDA), every FP8 Linear's forward goes through one
    torch.compile'd function (dynamo compiles frames) and the model's logits and gradients equal the eager
    FP8 model's (1e-5): the compiled form is a speed-up, not other numerics."""
    pytest.importorskip("torchao")
    import copy

    import remodel.pipelines.training.fp8 as fp8
    monkeypatch.setattr(fp8, "_on_gpu", lambda x: True)
    base = model()
    convert(base)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    results, frames = [], []
    for on in (True, False):
        monkeypatch.setattr(fp8, "COMPILE", on)
        m = copy.deepcopy(base)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        logits = m(x)
        logits.square().mean().backward()
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        results.append([logits.detach()] + [p.grad for p in m.parameters()])
    assert frames[0] >= 1 and frames[1] == 0, frames
    for a, b in zip(*results):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
