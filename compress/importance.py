"""Activation importance (Minitron / Minitron-SSM / MiniPuzzle) from hooks attached outside the model.

Every activation X [batch, seq, D] is aggregated in fp32: a = |X|.mean(over non-padded seq) -> [batch, D],
acc += (a**2).sum(over batch), score = sqrt(acc). Sites (names as in the SCORES contract, compress/scores.py):

  hidden           output of every layers[i].norm and of norm_f (gamma applied); per-site scores summed
  layers.i.ffn     input of mixer.down_proj, times ||down_proj[:, j]||        '-'   [F]
  layers.i.attn    input of mixer.o_proj, per head                              '*'   [nq, head_dim]
  layers.i.mamba_x input of mixer.out_proj (the gated norm's output, channels as the x segment),
                   times ||out_proj[:, c]|| of the same inner channel c        'M'   [nh, hd]
                   (--method activation_in: the x segment of in_proj's output, before conv, as
                   before issue 55; bench/RESULTS.md "Mamba head criteria" chose out_proj's input)
  layers.i.experts REAP: mean over routed tokens of ||w * expert(x)|| (arXiv 2510.13999)  'E' [E]
                   (w: the router weight the token's output is multiplied by, from the unbiased
                   score: e_score_correction_bias only chooses experts, so it never enters w)
  layers.i.expert_contribution  sum over routed tokens of |w| * ||expert(x)||        [E]
  layers.i.expert_frequency     number of (non-padded) tokens routed to each expert  [E]
  layers.i.expert_reconstruction  elimination order by routed-output reconstruction (expert_select) [E]
                   (routed experts only: the shared expert sees every token and is never an
                   expert candidate; compress/expert_scores.py picks which one ranks experts)
  layers.i.expert_ffn  input of each expert's down projection; the seq mean runs over the tokens of
                   each sample routed to that expert (samples with none add 0)       [E, Fm]
  layers.i.expert_ffn_contribution  the same of |w * h| times ||down_proj[e][:, j]||: what channel j
                   writes through the router weight (the channels of the routed expert methods) [E, Fm]
  layers.i.shared_ffn  input of shared_experts.down_proj                              [S]
  layers.i.latent  LatentMoE: the latent the experts read (fc1_latent_proj output) plus the
                   latent they write (fc2_latent_proj input), per-site scores summed like hidden  [Lt]
  mtp.layers.j.<site>  MTP head block j (models/mtp.py), the sites of a trunk block of its kind, from
                   the head run on the calibration data after the trunk (run_mtp, vLLM's formula; row t
                   real when tokens t and t + 1 + step are); it adds no hidden or depth scores
  block_importance 1 - mean cos(x_in, x_out) over non-padded tokens                  [L]
  loss_increase    LM loss with layer i alone skipped minus the full model's         [L]

Deviation from pruning.md: ffn and mamba_x are "Wanda"-style, activation times the L2 norm of the weight
column the unit feeds (chosen by held-out loss, bench/bench_prune_quality.py).

Fused experts have no per-expert module: while attached, an expert hook of the dispatch
(models.moe.Experts.register_expert_hook) records each expert's activation and output. The padding mask comes from each Block's `attention_mask` (or Scorer.update).

Two runners give identical numbers: `score_model` (whole model in memory, batch by batch) and
compress.streaming's `score_streaming` (one layer's weights at a time; calibration hidden states kept in a
StateStore that spills to safetensors files past a byte budget). loss_increase over k batches: whole mode
runs L full forwards; streaming L(L-1)/2 layer passes (each layer loaded once), keeping L+1 branches of states.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from remodel.models.config import ModelConfig
from remodel.models.layout import axis_size
from remodel.models.model import Block
from remodel.models.mtp import MTPBlock
from remodel.models.trunk import walk_mtp
from remodel.models.norm import RMSNorm

from .expert_select import RoutedSample

LOGITS_BYTES = 256 * 1024**2  # fp32 logits materialised at once by lm_loss_sums


def seq_mean_abs(x: torch.Tensor, mask=None) -> torch.Tensor:
    """|x| [b, l, D] averaged over the (non-padded) sequence -> [b, D], fp32."""
    a = x.detach().float().abs()
    m = torch.ones(a.shape[:2], device=a.device) if mask is None else mask.to(a.dtype)
    return torch.bmm(m[:, None, :], a)[:, 0] / m.sum(1).clamp(min=1)[:, None]  # bmm: faster than .mean(1)


def col_norms(w: torch.Tensor) -> torch.Tensor:
    """L2 norm of every input column of a Linear weight [out, in] -> [in], fp32."""
    return w.detach().float().norm(dim=0)


class Scorer:
    """Accumulates every importance of the contract while attached to a HybridLM (attach()) or to
    single blocks (attach_layer(i, block), attach_final(norm_f)) as the streaming runner does."""

    def __init__(self, model=None, cfg: ModelConfig | None = None, in_sites: bool = False):
        """in_sites: each kind's in_sites() instead of sites() (score --method activation_in)."""
        self.model, self.cfg, self.in_sites = model, cfg or model.cfg, in_sites
        self.acc: dict[str, torch.Tensor] = {}
        self.wnorm: dict[str, torch.Tensor] = {}  # per-unit norm of the weight column a site feeds
        self.mask, self._samples, self.tokens, self._sites = None, {}, 0, {}  # _sites: {key: score shape}
        self._handles = []

    # ---- attaching ------------------------------------------------------------------
    def attach(self) -> "Scorer":
        for i, block in enumerate(self.model.layers):
            self.attach_layer(i, block)
        self.attach_final(self.model.norm_f)
        for j, block in enumerate(self.model.mtp.layers if self.cfg.mtp_layers else []):
            self.attach_mtp(j, block)
        return self

    def attach_layer(self, i: int, block: Block):
        hook = self._handles.append
        hook(block.register_forward_pre_hook(self._capture_mask(1), with_kwargs=True))
        hook(block.norm.register_forward_hook(self._output(f"hidden.{i}")))
        hook(block.register_forward_hook(self._block_hook(i)))
        self._attach_mixer(f"layers.{i}.", block)

    def attach_mtp(self, j: int, block: MTPBlock):
        """MTP block j: its own units as `mtp.layers.{j}.*`. hidden and the depth scores stay the
        trunk's (the head shares the trunk's hidden channels and is never dropped)."""
        self._handles.append(block.register_forward_pre_hook(self._capture_mask(2), with_kwargs=True))
        self._attach_mixer(f"mtp.layers.{j}.", block)

    def _attach_mixer(self, p: str, block: Block):
        """The sites the block's kind names (models.spec.Site); a routed kind records its experts."""
        m, hook = block.mixer, self._handles.append
        for site in (block.spec.in_sites if self.in_sites else block.spec.sites)(self.cfg):
            key, module = p + site.name, m.get_submodule(site.module)
            self._sites[key] = tuple(axis_size(self.cfg, a) for a in block.spec.scored[site.name])
            if site.norm_of:
                self.wnorm[key] = col_norms(m.get_parameter(site.norm_of))
            if site.read == "input":
                hook(module.register_forward_pre_hook(self._input(key)))
            else:
                hook(module.register_forward_hook(self._output(key, site.part or slice(None))))
        if block.spec.routed:
            self._attach_moe(p, m)

    def attach_final(self, norm_f: RMSNorm):
        self._handles.append(norm_f.register_forward_hook(self._final_hook))

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        for p, sample in self._samples.items():  # scored as each layer is done (streaming: one at a time)
            if (order := sample.scores()) is not None:
                self.acc[p + "expert_reconstruction"] = order
        self._samples = {}

    def update(self, attention_mask):
        """Set the padding mask [b, l] (1 = real token) for the next hooked calls; every Block call
        sets it from its own attention_mask argument, so this is only needed before a lone norm_f."""
        self.mask = None if attention_mask is None else attention_mask.bool()

    # ---- hooks ------------------------------------------------------------------------
    def _add(self, name, value):
        if name in self.acc:
            self.acc[name] += value
        else:
            self.acc[name] = value.clone()

    def _acc(self, name, x):
        self._add(name, seq_mean_abs(x, self.mask).square().sum(0))

    def _capture_mask(self, pos):  # attention_mask is argument `pos` of Block (1) / MTPBlock (2)
        return lambda module, args, kwargs: self.update(args[pos] if len(args) > pos else kwargs.get("attention_mask"))

    def _input(self, name):
        return lambda module, args: self._acc(name, args[0])

    def _output(self, name, part=slice(None)):
        return lambda module, args, out: self._acc(name, out[..., part])

    def _final_hook(self, module, args, out):
        self._acc(f"hidden.{self.cfg.num_layers}", out)
        self.tokens += out.shape[0] * out.shape[1] if self.mask is None else int(self.mask.sum())

    def _block_hook(self, i):
        def hook(module, args, out):
            cos = F.cosine_similarity(args[0].detach().float(), out.detach().float(), dim=-1)  # [b, l]
            if self.mask is None:
                n = torch.tensor(float(cos.numel()), dtype=torch.float64, device=cos.device)
            else:
                cos, n = cos * self.mask, self.mask.sum().double()
            self._add(f"layers.{i}.cos", torch.stack([cos.sum(dtype=torch.float64), n]))
        return hook

    def _attach_moe(self, p, moe):
        cfg, experts, ctx = self.cfg, moe.experts, {}
        E, self._samples[p] = cfg.moe.n_routed_experts, RoutedSample(moe)
        self.wnorm[p + "expert_ffn"] = experts.down_proj.detach().float().norm(dim=1)  # [E, Fm]

        def pre_moe(module, args):
            ctx["bl"] = args[0].shape[:2]

        def pre_experts(module, args):  # (x [T, L], weights [T, k], idx [T, k])
            _, w, idx = args[:3]
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)  # tokens of expert e, ascending, as the dispatch sees them
            counts = torch.bincount(flat, minlength=E).tolist()
            starts = [sum(counts[:e]) for e in range(E)]
            ctx.update(token=order // idx.shape[1], w=w.reshape(-1)[order].float(), counts=counts, starts=starts)
            self._samples[p].add(args[0], self.mask)

        self._handles.append(moe.register_forward_pre_hook(pre_moe))
        self._handles.append(experts.register_forward_pre_hook(pre_experts))
        self._handles.append(experts.register_expert_hook(lambda _, e, h, y: self._expert_stats(p, e, h, y, ctx)))
        if moe.cfg.moe.moe_latent_size:
            def latent_in(module, args, out):  # [T, Lt] for tokens flattened by the MoE
                self._acc(p + "latent_in", out.view(*ctx["bl"], -1))

            def latent_out(module, args):
                self._acc(p + "latent_out", args[0].view(*ctx["bl"], -1))
            self._handles.append(moe.fc1_latent_proj.register_forward_hook(latent_in))
            self._handles.append(moe.fc2_latent_proj.register_forward_pre_hook(latent_out))
        if moe.shared_experts is not None:
            def pre_shared_down(module, args):  # the MoE runs its shared expert on tokens flattened to [T, S]
                self._acc(p + "shared_ffn", args[0].view(*ctx["bl"], -1))
            self._handles.append(moe.shared_experts.down_proj.register_forward_pre_hook(pre_shared_down))

    def _expert_stats(self, p, e, h, y, ctx):
        s, n = ctx["starts"][e], ctx["counts"][e]
        assert n == h.shape[0], "expert dispatch order changed: scorer out of sync with Experts.forward"
        tok, w = ctx["token"][s:s + n], ctx["w"][s:s + n]
        b, l = ctx["bl"]
        h, y = h.detach().float(), y.detach().float()
        if self.mask is not None:
            keep = self.mask.reshape(-1)[tok]
            tok, w, h, y = tok[keep], w[keep], h[keep], y[keep]
        E, dev = self.cfg.moe.n_routed_experts, h.device
        if p + "expert_ffn" not in self.acc:
            for k in ("expert_ffn", "expert_ffn_routed"):
                self.acc[p + k] = torch.zeros(E, h.shape[1], device=dev)
            self.acc[p + "experts"] = torch.zeros(2, E, dtype=torch.float64, device=dev)  # sum of norms, count
        sample, per = tok // l, torch.zeros(b, h.shape[1], device=dev)
        n_of = torch.bincount(sample, minlength=b).clamp(min=1)[:, None]
        for k, x in (("expert_ffn", h.abs()), ("expert_ffn_routed", h.abs() * w.abs()[:, None])):
            self.acc[p + k][e] += (per.zero_().index_add_(0, sample, x) / n_of).square().sum(0)
        self.acc[p + "experts"][0, e] += (y.norm(dim=-1) * w.abs()).sum(dtype=torch.float64)
        self.acc[p + "experts"][1, e] += len(tok)

    # ---- result -------------------------------------------------------------------------
    def _block_result(self, p: str) -> dict[str, torch.Tensor]:
        """The unit scores of one block (prefix p: 'layers.3.' or 'mtp.layers.1.')."""
        acc, out = self.acc, {}
        for key, shape in self._sites.items():
            if key.startswith(p) and "." not in key[len(p):] and key in acc:
                a = acc[key].sqrt()
                out[key] = (a * self.wnorm[key].to(a.device) if key in self.wnorm else a).view(shape)
        if p + "experts" in acc:
            s, n = acc[p + "experts"]
            out[p + "experts"] = s / n.clamp(min=1)
            out[p + "expert_contribution"], out[p + "expert_frequency"] = s, n
            if p + "expert_reconstruction" in acc:  # absent when every token was padding
                out[p + "expert_reconstruction"] = acc[p + "expert_reconstruction"]
            out[p + "expert_ffn"] = acc[p + "expert_ffn"].sqrt()
            wn = self.wnorm[p + "expert_ffn"].to(acc[p + "expert_ffn"].device)
            out[p + "expert_ffn_contribution"] = acc[p + "expert_ffn_routed"].sqrt() * wn
        if p + "shared_ffn" in acc:
            out[p + "shared_ffn"] = acc[p + "shared_ffn"].sqrt()
        if p + "latent_in" in acc:
            out[p + "latent"] = acc[p + "latent_in"].sqrt() + acc[p + "latent_out"].sqrt()
        return out

    def result(self) -> dict[str, torch.Tensor]:
        """The contract's tensors (fp32, CPU) for every site seen so far."""
        cfg, acc, out = self.cfg, self.acc, {}
        sites = [acc[f"hidden.{i}"] for i in range(cfg.num_layers + 1) if f"hidden.{i}" in acc]
        if sites:
            out["hidden"] = torch.stack(sites).sqrt().sum(0)
        blocks = [f"layers.{i}." for i in range(cfg.num_layers)] + [f"mtp.layers.{j}." for j in
                                                                      range(len(cfg.mtp_full_pattern))]
        for p in blocks:
            out.update(self._block_result(p))
        if any(f"layers.{i}.cos" in acc for i in range(cfg.num_layers)):
            unseen = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
            c = torch.stack([acc.get(f"layers.{i}.cos", unseen).cpu() for i in range(cfg.num_layers)])
            out["block_importance"] = 1 - c[:, 0] / c[:, 1].clamp(min=1)
        return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


# ---- language-model loss ----------------------------------------------------------------

def lm_loss_sums(h, weight, ids, mask=None) -> tuple[torch.Tensor, int]:
    """(sum, count) of next-token cross-entropy from final hidden states h [b, l, H] (after norm_f)
    and the output embedding weight [V, H]; logits are built a bounded chunk of tokens at a time."""
    x, y = h[:, :-1].reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1).to(h.device)
    if mask is not None:
        keep = (mask[:, 1:].bool() & mask[:, :-1].bool()).reshape(-1).to(h.device)
        x, y = x[keep], y[keep]
    step = max(1, LOGITS_BYTES // (4 * weight.shape[0]))
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for s in range(0, len(y), step):
        logits = F.linear(x[s:s + step], weight).float()
        total += F.cross_entropy(logits, y[s:s + step], reduction="sum").double()
    return total, len(y)


def mean_loss(sums) -> float:
    """Mean LM loss over (loss sum, token count) pairs (lm_loss_sums of each batch)."""
    return float(sum(s for s, _ in sums)) / max(1, sum(n for _, n in sums))


def head_weight(model) -> torch.Tensor:
    return model.embeddings.weight if model.lm_head is None else model.lm_head.weight


class Skip(nn.Module):
    """Stands in for a removed layer: the residual stream passes unchanged."""

    def forward(self, x, *args, **kwargs):
        return x


# ---- whole model in memory ------------------------------------------------------------

def _get(seq, b):
    return None if seq is None else seq[b]


@torch.no_grad()
def model_loss(model, batches, masks=None) -> float:
    dev, W = head_weight(model).device, head_weight(model)
    sums = []
    for b, ids in enumerate(batches):
        mask = _get(masks, b)
        mask = None if mask is None else mask.to(dev)
        h, _ = model.hidden(ids.to(dev), mask)
        sums.append(lm_loss_sums(h, W, ids, mask))
    return mean_loss(sums)


def mtp_mask(mask, k: int):
    """Padding mask of MTP step k's rows [b, l - 1 - k]: row t pairs position t with token t + 1 + k,
    real only when both are."""
    if mask is None:
        return None
    n = mask.shape[1] - 1 - k
    return mask[:, :n].bool() & mask[:, k + 1:].bool()


@torch.no_grad()
def run_mtp(model, h, ids, mask=None):
    """Every MTP step on the trunk's output h [b, l, H] (after norm_f), as HybridLM.forward_mtp (vLLM's
    formula), so an attached Scorer sees the head's own activations; nothing without an MTP head."""
    walk_mtp(model.cfg, lambda j: model.mtp.layers[j], {"x": h}, ("x",), lambda key, k: model.embeddings(ids[:, k + 1:]),
             lambda key, k: mtp_mask(mask, k))


@torch.no_grad()
def layer_loss_increase(model, batches, masks=None, base: float | None = None, progress=False) -> torch.Tensor:
    """[L]: LM loss on `batches` with layer i replaced by the identity, minus the full model's."""
    base = model_loss(model, batches, masks) if base is None else base
    out = []
    for i in tqdm(range(len(model.layers)), desc="loss increase", disable=not progress):
        keep = model.layers[i]
        model.layers[i] = Skip()
        try:
            out.append(model_loss(model, batches, masks) - base)
        finally:
            model.layers[i] = keep
    return torch.tensor(out, dtype=torch.float32)


@torch.no_grad()
def score_model(model, batches, masks=None, loss_increase=True, loss_batches=4, progress=False, in_sites=False):
    """Whole-model scoring -> (scores dict, info {baseline_loss, tokens, loss_batches}); in_sites as Scorer's."""
    dev, W = head_weight(model).device, head_weight(model)
    scorer = Scorer(model, in_sites=in_sites).attach()
    sums = []
    try:
        for b, ids in enumerate(tqdm(batches, desc="calibration", disable=not progress)):
            mask = _get(masks, b)
            mask = None if mask is None else mask.to(dev)
            h, _ = model.hidden(ids.to(dev), mask)
            sums.append(lm_loss_sums(h, W, ids, mask))
            run_mtp(model, h, ids.to(dev), mask)
    finally:
        scorer.detach()
    scores = scorer.result()
    k = min(loss_batches, len(batches)) if loss_increase else 0
    if k:
        lm = None if masks is None else masks[:k]
        scores["loss_increase"] = layer_loss_increase(model, batches[:k], lm, mean_loss(sums[:k]), progress)
    return scores, {"baseline_loss": mean_loss(sums), "tokens": int(scorer.tokens), "loss_batches": k}
