"""MLA's widths beside its heads (models/mla.py): v_head_dim, qk_nope_head_dim, kv_lora_rank and q_lora_rank.

Pruned == masked on each width alone and all at once, against a reference written here from the layer's maths, not
from the axes table: the unpruned model with the dropped channels zeroed at run time by hooks (o_proj's input for
value channels and heads; the queries' and kv_b_proj's no-RoPE channels, the queries scaled by s' / s since the
softmax scale (nope + rope)**-0.5 follows the kept width; the latent channels at kv_a_proj / q_a_proj's output with
their RMSNorm averaging over the kept ones). The activation and magnitude scores of the new sites are checked against
a direct computation, and the CLI prunes a transformers-saved deepseek_v3 on every MLA width that transformers
reloads with the in-memory pruning's logits (1e-4 fp32) and our parameter count.
The reference is MLA's masking module (tests/kinds/mla.py), which the family suite uses too."""
import copy
import json

import pytest
import torch

from remodel import cli
from remodel.compress.baselines import magnitude_scores, random_scores
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.families import FAMILIES
from remodel.models.params import count_params
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_flags, cli_pair, hf_pair, reloaded_equals_in_memory
from tests.kinds.mla import mask_mla

FAMILY = "deepseek_v3"
WIDTHS = ("mla_heads", "v_head_dim", "qk_nope_head_dim", "kv_lora_rank", "q_lora_rank")
TARGETS = {"mla_heads": 3, "v_head_dim": 3, "qk_nope_head_dim": 4, "kv_lora_rank": 8, "q_lora_rank": 6}


@torch.no_grad()
def masked_mla(model, keep):
    """A copy of `model` whose MLA layers compute with what `keep` drops zeroed at run time (mask_mla)."""
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref.layers):
        if layer.kind == "L":
            mask_mla(ref.cfg, layer.mixer, keep, f"layers.{i}.")
    return ref


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mla")


CASES = [(case, w) for case in ("q_lora_grouped", "direct_q_tied") for w in (*WIDTHS, "all")
         if not (case == "direct_q_tied" and w == "q_lora_rank")]


@pytest.mark.parametrize("case,width", CASES)
def test_pruned_equals_masked(root, case, width):
    _, model, _ = hf_pair(FAMILY, root, case, len(case), **FAMILIES[FAMILY].tiny[case])
    model = copy.deepcopy(model).double()
    cfg = model.cfg
    targets = {w: v for w, v in TARGETS.items() if w in (WIDTHS if width == "all" else (width,))
               and (w != "q_lora_rank" or cfg.mla.q_lora_rank)}
    keep = plan_keep(cfg, random_scores(cfg, seed=CASES.index((case, width))), targets)
    pruned = prune_model(model, keep)
    x = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, full = pruned(x), masked_mla(model, keep)(x), model(x)
    assert {f: getattr(pruned.cfg.mla, f) for f in targets if f != "mla_heads"} == \
        {f: v for f, v in targets.items() if f != "mla_heads"}
    # float64, but SDPA's CPU kernel takes its scale as a float32: the reference's s x (q scaled by s' / s) and the
    # pruned layer's s' round apart by ~3e-8 of the logits (1e-10 holds on every width that keeps the scale)
    assert (a - b).abs().max().item() <= (1e-7 if "qk_nope_head_dim" in targets else 1e-10)
    assert (a - full).abs().max().item() > 1e-3  # the pruning changed the model: the comparison is not vacuous


def test_activation_and_magnitude_scores_of_the_mla_sites(root):
    """The latent's activation score is Wanda's (mean |x| per sample, L2 over samples, times ||W[:, j]||) at
    kv_b_proj's input; the no-RoPE channels' magnitude is the q and kv_b_proj rows', the latent's the a-projection
    rows plus the b-projection columns."""
    _, model, _ = hf_pair(FAMILY, root, "q_lora_grouped", 14, **FAMILIES[FAMILY].tiny["q_lora_grouped"])
    cfg, m = model.cfg, model.layers[0].mixer
    x = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(3))
    seen = []
    h = m.kv_b_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach()))
    scores, _ = score_model(model, [x], loss_increase=False)
    h.remove()
    want = seen[0].abs().mean(1).square().sum(0).sqrt() * m.kv_b_proj.weight.norm(dim=0)
    assert torch.allclose(scores["layers.0.mla_kv_latent"], want, rtol=1e-5)
    c = cfg.mla
    assert scores["layers.0.mla_query"].shape == (c.mla_num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
    assert scores["layers.0.mla_q_latent"].shape == (c.q_lora_rank,)
    mag = magnitude_scores(cfg, model.state_dict().items())
    R = c.kv_lora_rank
    want = (m.kv_a_proj_with_mqa.weight[:R].square().sum(1) + m.kv_b_proj.weight.square().sum(0)).sqrt()
    assert torch.allclose(mag["layers.0.mla_kv_latent"], want, rtol=1e-5)
    want = m.kv_b_proj.weight.square().sum(1).sqrt().view(c.mla_num_heads, -1)
    assert torch.allclose(mag["layers.0.mla_keyval"], want, rtol=1e-5)


def test_cli_prunes_every_mla_width_and_transformers_reloads_it(tmp_path):
    _, ours, d = cli_pair(FAMILY, "q_lora_grouped", tmp_path / "src")
    assert cli.main(["score", str(d), "--data", str(embedded_corpus()[1]), "--out", str(tmp_path / "s"),
                     "--samples", "8", "--seq-len", "32", "--no-loss-increase"]) == 0
    scores, _ = load_scores(tmp_path / "s")
    out = tmp_path / "out"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(TARGETS)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert (hf["num_attention_heads"], hf["v_head_dim"], hf["qk_nope_head_dim"], hf["kv_lora_rank"],
            hf["q_lora_rank"], hf["qk_rope_head_dim"]) == (*TARGETS.values(), ours.cfg.mla.qk_rope_head_dim)
    pruned = prune_model(ours, plan_keep(ours.cfg, scores, TARGETS))
    reloaded_equals_in_memory(out, pruned)
    assert count_params(pruned.cfg)["total"] == sum(p.numel() for p in pruned.parameters())


def test_keep_ranks_each_width_by_its_own_site():
    """No-RoPE channels by |q| x |k| (a big query channel whose keys are zero adds nothing to the logits), value
    channels by o_proj's input, latent channels by their own sites."""
    from remodel.models.hf import config_from_hf
    from remodel.models.mla import MLA
    cfg = config_from_hf({"model_type": FAMILY, **FAMILIES[FAMILY].tiny["q_lora_grouped"]})
    c, n = cfg.mla, cfg.mla.mla_num_heads
    s = {"mla": torch.ones(n, c.v_head_dim), "mla_query": torch.ones(n, c.qk_nope_head_dim + c.qk_rope_head_dim),
         "mla_keyval": torch.ones(n, c.qk_nope_head_dim + c.v_head_dim), "mla_kv_latent": torch.ones(c.kv_lora_rank),
         "mla_q_latent": torch.ones(c.q_lora_rank)}
    s["mla_query"][:, 0], s["mla_keyval"][:, 0] = 100, 0
    s["mla_query"][:, 2], s["mla_keyval"][:, 2] = 3, 3
    s["mla"][:, 4], s["mla_kv_latent"][5], s["mla_q_latent"][6] = 2, 2, 2
    s["mla_keyval"][:, c.qk_nope_head_dim + 1] = 50  # kv_b_proj's v rows do not rank the value channels
    keep = MLA.keep(cfg, lambda name, shape, flags: s[name[len("layers.0."):]],
                    {"qk_nope_head_dim": 1, "v_head_dim": 1, "kv_lora_rank": 1, "q_lora_rank": 1}, "layers.0.")
    assert {k: v.tolist() for k, v in keep.items()} == {"layers.0.mla_nope": [2], "layers.0.mla_v_dim": [4],
                                                         "layers.0.mla_kv_rank": [5], "layers.0.mla_q_rank": [6]}
