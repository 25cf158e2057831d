"""Training memory per rank (compress.train_memory, issue 59 Deliver 3): the arithmetic against a hand count
on a tiny model's own parameters, `plan --train-memory-gb` filtering by it, and GiB as the one unit."""
import pytest

from remodel.compress.train_memory import TrainSetup, train_memory_bytes
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.model import HybridLM
from remodel.pipelines.commands.plan import plan

TINY = ModelConfig(vocab_size=64, hidden_size=16, pattern="*-M", num_attention_heads=2, num_key_value_heads=1,
                   head_dim=8, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                   chunk_size=8, tie_word_embeddings=False)


def _by_layer(model) -> tuple[list[int], int]:
    """Parameters of each layer (its pre-norm included) and of the rest, counted on the module itself."""
    per, rest = [0] * model.cfg.num_layers, 0
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            per[int(name.split(".")[1])] += p.numel()
        else:
            rest += p.numel()
    return per, rest


@pytest.mark.parametrize("mode", ["none", "full"])
def test_hand_count(mode):
    per, rest = _by_layer(HybridLM(TINY))
    s = TrainSetup(tp=2, dp=2, batch=4, seq_len=8, recompute=mode, act_bytes=2, teacher_params=1000)
    T, H, V = 4 // 2 * 8, 16, 64  # the rank's micro-batch: 2 sequences of 8 tokens
    state = sum(p * 16 // 4 for p in per) + rest * 16 // 4  # fp32 weight + grad + 2 Adam moments, over tp * dp
    if mode == "none":  # dense: every parameter active; 3 x (params / hidden) saved per token, bf16, split over tp
        act = sum(T * (3 * p // H) * 2 // 2 for p in per)
    else:  # each layer's input, plus the largest layer replayed
        act = len(per) * T * H * 2 // 2 + T * (3 * max(per) // H) * 2 // 2
    logits, teacher = T * V * 12 // 2, 1000 * 4 // 4
    got = train_memory_bytes(TINY, s)
    assert (got["state"], got["activations"], got["logits"], got["teacher"]) == (state, act, logits, teacher)
    assert got["total"] == state + act + logits + teacher


def test_setup_rules():
    for bad, match in ((dict(ep=3, tp=2, dp=4), "--ep 3"), (dict(batch=6, dp=4), "--batch 6"),
                       (dict(recompute="some"), "--recompute"), (dict(tp=0), "--tp")):
        with pytest.raises(RemodelError, match=match):
            train_memory_bytes(TINY, TrainSetup(**bad))
    one, four = (train_memory_bytes(TINY, TrainSetup(dp=d, batch=4, seq_len=8)) for d in (1, 4))
    assert four["state"] < one["state"] // 3 and four["activations"] < one["activations"] // 3  # sharded, split


def test_plan_filters_by_train_memory(capsys):
    kw = dict(params=6e9, top=20, verbose=False, tp=2, dp=4, recompute="selective", train_batch=8, seq_len=8192)
    free = plan("nemotron-h-8b", **kw)["candidates"]
    cap = min(c["train_memory_bytes"] for c in free) - 2**24
    bound = plan("nemotron-h-8b", train_memory_gb=cap / 2**30, **kw)["candidates"]
    assert bound and all(c["train_memory_bytes"] <= cap and c["params"] <= 6e9 for c in bound)
    assert not {c["pattern"] + str(c["widths"]) for c in bound} & {c["pattern"] + str(c["widths"]) for c in free}
    # each row's figure is the function's on the row's own config (the teacher: the source)
    from remodel.pipelines.commands.plan_file import candidate_config
    from remodel.pipelines.commands.inspection import resolve_source
    from remodel.models.params import count_params
    src = resolve_source("nemotron-h-8b")[0]
    s = TrainSetup(tp=2, dp=4, recompute="selective", batch=8, seq_len=8192, teacher_params=count_params(src)["total"])
    assert bound[0]["train_memory_bytes"] == train_memory_bytes(candidate_config(src, bound[0]), s)["total"]
    from remodel.cli import main
    assert main(["plan", "nemotron-h-8b", "--params", "6B", "--train-memory-gb", f"{cap / 2**30:.3f}", "--tp", "2",
                 "--dp", "4", "--recompute", "selective", "--seq-len", "8192", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"train memory <= {cap / 2**30:.2f} GiB" in out and " GB" not in out and "tp 2 ep 1 dp 4" in out
    assert main(["plan", "nemotron-h-8b", "--params", "6B", "--train-memory-gb", "9", "--tp", "2", "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert "--ep 3" in err and len(err.strip().splitlines()) == 1


def test_one_unit_inspect_and_plan(capsys):
    """inspect's memory total and plan's source figure: the same bytes, the same GiB (they were 16.85 GiB and
    18.09 GB for qwen3.5-9b)."""
    from remodel.cli import main
    assert main(["inspect", "qwen3.5-9b"]) == 0
    total = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("total ")][-1].split()[-2:]
    d = plan("qwen3.5-9b", params=7e9, top=1)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(" ".join(total)) and total[1] == "GiB"
    assert f"{d['source_params']['memory_bytes'] / 2**30:.2f}" == total[0]
