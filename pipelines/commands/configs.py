"""The options of every `remodel` command but train / distill (TrainConfig): one dataclass per command, each field
with its default, help line and rule (pipelines.commands.options generates the parser from them; the Python API
takes the same names). A default lives here and nowhere else."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.compress.baselines import METHODS
from remodel.compress.expert_scores import EXPERT_METHODS
from remodel.models.families import FAMILIES, UPCYCLE_TARGETS
from remodel.models.recompute import RECOMPUTE_MODES
from remodel.upcycle.hybridize import INITS, MIXERS
from remodel.upcycle.virtual_groups import ROUTER_MODES

from ..data.shards import SHARD_TOKENS
from ..training.train_config import DOC_SPLITS, DTYPES, Check, count, ints, positive
from .options import opt, train_opt

SEED = ints(0, 2**32 - 1)
SEQ_LEN = ints(2, 2**24)
BATCH = ints(1, 2**20)
MODES = ("auto", "whole", "streaming")


def _tasks_help(on: str) -> str:
    return (f"comma-separated lm-eval task names run on {on}, offline on local data: the shipped remodel_cloze, "
            "remodel_nextphrase, or a task of --task-dir (None: no tasks; needs pip install remodel[eval])")


TASK_DIR = "folder of lm-eval task YAMLs (dataset_path: json, data_files beside them)"
LIMIT = "items per task (None: every item)"
TRUST_TASK_CODE = ("run Python a task folder names (`!function`, custom datasets and filters, `include:` outside "
                   "--task-dir, dataset scripts), as trust_remote_code does for a model: only for a folder you trust")
OVERWRITE = "replace an existing non-empty OUT"


@dataclass
class ScoreOptions:
    COMMAND = "score"
    model: object = opt(None, "checkpoint directory to score", positional=True)
    data: object = opt(None, "calibration text (needed for --method activation_measured, activation, activation_in and loo)")
    out: object = opt(None, "new SCORES directory (reused by prune, plan and search)", required=True)
    method: str = opt("activation_measured", "activation_measured: activation importance, with Gated DeltaNet key-head "
                      "groups (the units a kind names as few) ranked by the loss increase of each one removed alone over "
                      "the first 4 calibration batches (one extra forward per key-head group from its layer on, per batch: "
                      "with the other defaults ~4-6x the activation pass on Qwen3-Next / Qwen3.5 shapes, see "
                      "bench/RESULTS.md 'Scoring overhead'; no other kind has such units: there it equals activation); "
                      "activation: importance from "
                      "activations alone; magnitude / random: data-free baselines; loo: every Mamba and Gated DeltaNet "
                      "head (and key-head group) ranked by the calibration loss increase of each one removed alone "
                      "(one forward per head over the calibration set; the model held whole); activation_in: activation "
                      "with Mamba-2 heads read at in_proj's x segment (the default before issue 55) instead of "
                      "out_proj's input",
                      choices=METHODS)
    seed: int = opt(0, "seed of --method random", check=SEED)
    expert_method: str = opt(
        "reconstruction", "what ranks MoE experts: reconstruction (default: greedy elimination of the experts whose "
        "removal, tokens re-routed, moves the routed output least), contribution (router weight x output norm summed "
        "over tokens), routing frequency, reap (REAP, arXiv 2510.13999: the mean over routed tokens of router weight x "
        "output norm; `mean` is its alias), or random (--seed)", choices=EXPERT_METHODS[:4] + ("mean", "random"))
    samples: int = opt(1024, "calibration sequences", check=ints(1, 2**24))
    seq_len: int = opt(1024, "tokens per calibration sequence", cli_default=512, check=SEQ_LEN)
    batch: int = opt(4, "sequences per forward pass", check=BATCH)
    mode: str = opt("auto", "whole model in memory, or layer by layer (streaming); auto picks by free memory",
                    choices=MODES)
    loss_increase: bool = opt(True, "skip the per-layer loss increase score (it costs one extra forward per layer)",
                              negate="no_loss_increase")
    overwrite: bool = opt(False, OVERWRITE)
    max_memory_bytes: int | None = opt(None, "calibration hidden states held in streaming mode (None: a quarter of "
                                       "the available memory)", cli=False)
    loss_batches: int = opt(4, "batches the loss increase is measured on", cli=False)
    device: str | None = opt(None, "torch device (None: cuda when available, else cpu)", cli=False)
    progress: bool = opt(True, "progress bars", cli=False)


@dataclass
class PruneOptions:
    COMMAND = "prune"
    UNKNOWN = "scoring options, prune options or pruning targets"  # prune(**kw) takes all three
    GROUPS = {"source": False, "depth": False}  # mutually exclusive groups: required?
    model: object = opt(None, "checkpoint directory to prune", positional=True)
    out: object = opt(None, "new output directory", positional=True)
    scores: object = opt(None, "SCORES directory from `remodel score` (one of --scores / --data is required, "
                         "but for --plan: data-free magnitude scores then)", group="source")
    data: object = opt(None, "calibration text: score first, then prune", group="source")
    widths: dict = opt({}, "{width name: target}: a flag per prunable width (models.kinds.WIDTHS)", widths=True)
    num_layers: int | None = opt(None, "keep this many layers, the least important dropped", group="depth",
                                 check=ints(1, 2**16))
    drop_layers: object = opt(None, "comma-separated layer indices to drop, e.g. 3,7", group="depth", ints=True,
                              check=ints(0, 2**16))
    plan: object = opt(None, "PLAN file from `remodel plan --out`: prune to one of its candidates exactly",
                       group="depth")
    candidate: int = opt(1, "which candidate of --plan (the # of its table)", check=ints(1, 10**4))
    allow_attention_free: bool = opt(False, "accept a depth cut that removes every attention layer (refused "
                                     "otherwise)")
    tasks: list | None = opt(None, _tasks_help("the result, in its report"), names=True)
    task_dir: str | None = opt(None, TASK_DIR)
    task_limit: int | None = opt(None, LIMIT, flag="limit", check=ints(1, 2**31))
    trust_task_code: bool = opt(False, TRUST_TASK_CODE)
    dtype: str | None = opt(None, "dtype of the written weights (default None: as read; a quantized source, FP8, "
                            "is written in its own format, a dtype writes plain weights)", choices=DTYPES)
    overwrite: bool = opt(False, OVERWRITE)
    max_shard_bytes: int = opt(2 * 1024**3, "bytes per written shard file", cli=False)
    score: dict = opt({}, "keywords of `score` for the --data path (samples, seq_len, batch, ...)", cli=False)


def _axes_help() -> str:
    from remodel.models.kinds import PRUNABLE
    return f"what to search: width, depth, all, or a comma list of axes from {', '.join(PRUNABLE + ('depth',))}"


@dataclass
class PlanOptions:
    COMMAND = "plan"
    model: object = opt(None, "checkpoint dir, config.json or shipped config name (no weights needed)",
                        positional=True)
    params: int | None = opt(None, "total parameter budget, e.g. 4.5e9 or 47B", count=True, required=True,
                             check=count())
    active_params: int | None = opt(None, "budget of parameters active per token (MoE)", count=True, check=count())
    memory_gb: float | None = opt(None, "inference budget in GiB: bf16 weights + cache at --batch/--seq-len",
                                  check=positive(1e9))
    train_memory_gb: float | None = opt(None, "training budget in GiB per rank: distilling from MODEL, weights + grads "
                                        "+ Adam + activations at --tp/--ep/--dp/--recompute/--train-batch",
                                        check=positive(1e9))
    scores: object = opt(None, "SCORES dir from `remodel score`: depth choices follow layer importance")
    axes: object = opt(None, _axes_help)
    tol: float = opt(0.02, "accepted relative shortfall below the budget", check=Check(float, 0, 1, open_hi=True))
    top: int = opt(20, "candidates to list", check=ints(1, 10**4))
    batch: int = opt(1, "sequences of the inference cache for --memory-gb", check=BATCH)
    seq_len: int = opt(4096, "sequence length for the memory estimates", check=SEQ_LEN)
    train_batch: int = opt(8, "sequences per micro-batch over the dp ranks (distill's --batch) for --train-memory-gb",
                           check=BATCH)
    tp: int = opt(1, "tensor-parallel size for --train-memory-gb", check=ints(1, 1024))
    ep: int = opt(1, "expert-parallel size for --train-memory-gb (equal to --tp or --dp)", check=ints(1, 1024))
    dp: int = opt(1, "data-parallel size for --train-memory-gb", check=ints(1, 2**20))
    recompute: str = opt("none", "activation recomputation for --train-memory-gb", choices=RECOMPUTE_MODES)
    json: bool = opt(False, "print the candidates as JSON instead of a table (nothing else printed)")
    out: object = opt(None, "write the candidates to this PLAN file (JSON) for `remodel prune MODEL OUT --plan PLAN` "
                      "(None: not written)")
    overwrite: bool = opt(False, "replace an existing PLAN file")
    max_width_cut: float = opt(0.45, "largest fraction of a width removed", cli=False)
    max_depth_cut: float = opt(0.2, "largest fraction of the layers removed", cli=False)
    max_type_cut: float = opt(0.5, "largest fraction of one layer type removed", cli=False)
    divisors: dict | None = opt(None, "{axis: divisor} overriding the reference width divisors", cli=False)
    pool: int = opt(200, "with scores: how many candidates closest to the budget the loss estimate ranks", cli=False,
                    check=ints(1, 10**5))
    verbose: bool = opt(True, "print the table", cli=False)


@dataclass
class SearchOptions:
    COMMAND = "search"
    model: object = opt(None, "checkpoint directory to search from", positional=True)
    out: object = opt(None, "new output directory (the best candidate and the report)", positional=True)
    data: object = opt(None, "calibration and training text", required=True)
    params: int | None = opt(None, "total parameter budget, e.g. 4.5e9 or 47B (a budget or --plan is required)",
                             count=True, check=count())
    plan: object = opt(None, "PLAN file from `remodel plan --out`: search its candidates instead of a budget's")
    candidate: int | None = opt(None, "with --plan: only this candidate (the # of its table; None: all of them)",
                                check=ints(1, 10**4))
    candidates: int = opt(3, "best candidates re-ranked after distillation", check=ints(1, 1000))
    distill_tokens: int = opt(0, "short distillation before the re-ranking", count=True, check=count(0))
    scores: object = opt(None, "SCORES dir from `remodel score` (computed into OUT/scores otherwise)")
    active_params: int | None = opt(None, "budget of parameters active per token (MoE)", count=True, check=count())
    memory_gb: float | None = opt(None, "inference budget in GiB: bf16 weights + cache", check=positive(1e9))
    top: int = opt(20, "plan candidates pruned and evaluated", check=ints(1, 10**4))
    eval_data: object = opt(None, "held-out text (None: every 20th document of DATA)")
    seq_len: int = opt(256, "tokens per sequence (scoring, ranking, distillation)", check=SEQ_LEN)
    batch: int = opt(8, "sequences per step", check=BATCH)
    tasks: list | None = opt(None, _tasks_help("the written best candidate, in the report"), names=True)
    task_dir: str | None = opt(None, TASK_DIR)
    task_limit: int | None = opt(None, LIMIT, flag="limit", check=ints(1, 2**31))
    trust_task_code: bool = opt(False, TRUST_TASK_CODE)
    overwrite: bool = opt(False, OVERWRITE)
    plan_options: dict | None = opt(None, "extra plan() keywords (axes, tol, divisors, max cuts, ...)", cli=False)
    score_samples: int = opt(64, "calibration sequences of the scoring run", cli=False)
    eval_tokens: int = opt(16384, "held-out tokens that rank the candidates", cli=False)
    lr: float = opt(1e-3, "peak learning rate of the distillation", cli=False)
    seed: int = opt(0, "seed of the distillation", cli=False)
    progress: bool = opt(True, "progress bars and the pick's line", cli=False)


def _router_help() -> str:
    from .upcycle_defaults import router_defaults
    return ("router scoring: topk-softmax and sigmoid renormalise the chosen scores (exact), softmax-topk and "
            f"sigmoid-raw gate by the raw scores; default (None): {router_defaults()}")


def _to_help() -> str:
    from remodel.models.families import upcycle_defaults
    first = upcycle_defaults("to").split("; ")[:2]  # the two commonest sources; the whole table is README's
    return f"output family; default (None): {'; '.join(first)}; the others in README (\"Upcycling targets\")"


@dataclass
class UpcycleOptions:
    COMMAND = "upcycle"
    model: object = opt(None, "dense checkpoint directory (its MLP layers become MoE layers)", positional=True)
    out: object = opt(None, "new output directory", positional=True)
    experts: int | None = opt(None, "N, routed experts per layer: N = E x G (E copies of the MLP, each cut into G "
                              "shards)", required=True, check=ints(1, 2**16))
    granularity: int = opt(4, "G, shards per copy of the dense MLP (expert width = dense width / G); N = E x G",
                           check=ints(1, 2**16))
    top_k: int | None = opt(None, "T, experts per token; None: 2G (two virtual groups per token, README's "
                            "recommendation), at most N; a multiple of G keeps the dense model's output",
                            check=ints(1, 2**16))
    shared_expert_size: int = opt(0, "dense neurons kept as an always-on shared expert (0: none)",
                                  check=ints(0, 2**24))
    router: str | None = opt(None, _router_help, choices=ROUTER_MODES)
    to: str | None = opt(None, _to_help, choices=UPCYCLE_TARGETS)
    exact: bool = opt(False, "reproduce the dense model at step 0 (whole scale on down_proj) or refuse")
    dtype: object = opt(None, "dtype of the written weights (None: the checkpoint's)", choices=DTYPES)
    drop_ratio: float = opt(0.0, "Drop-Upcycling: fraction R in [0, 1] of each routed expert's neurons "
                            "re-initialised (README); 0: plain copies of the dense MLP; not with --exact",
                            check=Check(float, 0, 1))
    seed: int = opt(0, "seed of the random router rows and of --drop-ratio's draws", check=SEED)
    overwrite: bool = opt(False, OVERWRITE)


@dataclass
class HybridizeOptions:
    COMMAND = "hybridize"
    model: object = opt(None, "dense attention checkpoint directory (most attention layers become MIXER layers)",
                        positional=True)
    out: object = opt(None, "new output directory", positional=True)
    mixer: str = opt("mamba2", "the linear mixer put in place of the replaced attention layers (mamba2: Mamba-2; "
                     "gdn: Gated DeltaNet; kda: Kimi Delta Attention)", choices=tuple(MIXERS))
    keep_attention: int | None = opt(None, "N attention layers kept, evenly spaced (or --keep-layers)",
                                     check=ints(0, 2**16))
    keep_layers: list | None = opt(None, "the attention layers kept, by index among them (0,5; or --keep-attention)",
                                   ints=True, check=ints(0, 2**16))
    select: str | None = opt(None, "which --keep-attention N layers keep attention: kl: the N whose replacement "
                             "alone moves the output most (KL to MODEL on --data), or even: evenly spaced (None: kl "
                             "when --data and --keep-attention N > 0 are given, else even)", choices=("even", "kl"))
    samples: int = opt(16, "calibration sequences of --select kl (--seq-len tokens each)", check=ints(1, 2**20))
    init: str = opt("attention", "attention: the new mixers from the attention weights (Mamba-2: MambaInLlama; Gated "
                    "DeltaNet: q / k / v / out <- Q / K / V / O); random: as "
                    "transformers initialises them", choices=INITS)
    to: str | None = opt(None, "target family, a hybrid one of --to's list in `remodel convert --help` (None: the first "
                        "that holds the hybrid)")
    seed: int = train_opt("seed", "seed of the new mixers' initial weights (and of the training's data order)")
    data: object = opt(None, "stage two: distil the hybrid from MODEL on this data (distill's --data; with --steps), "
                       "and --select kl's calibration text; None: write the initialised hybrid")
    steps: int | None = train_opt("steps", "optimizer steps of the distillation (stage two; or --tokens)")
    tokens: int | None = train_opt("tokens", "token budget of the distillation (stage two; or --steps), e.g. 2M: "
                                   "steps = ceil(tokens / (batch * grad_accum * seq_len))")
    transfer_steps: int = opt(0, "stage one, before the distillation (needs --data): optimizer steps of attention "
                              "transfer, the new mixers alone trained (the rest frozen; see --transfer-target); 0: "
                              "none", check=ints(0, 2**40))
    transfer_target: str = opt("layer", "stage one's target: layer: each new mixer fed MODEL's own hidden state and "
                               "fitted to its attention layer's output there (teacher forcing, as LoLCATs; mean "
                               "squared error), so each layer is fitted alone; stream: MODEL's residual "
                               "stream after every layer (1 - cos), the hybrid run freely", choices=("layer", "stream"))
    seq_len: int = train_opt("seq_len")
    batch: int = train_opt("batch")
    lr: float = train_opt("lr")
    resume: bool = opt(False, "continue each stage from its newest checkpoint (OUT.transfer.run/, OUT.run/)")
    train: dict = opt({}, "distill's further settings for both stages (TrainConfig names: eval_data, warmup, tp, "
                      "...): on the command line a flag each, distill's", train=True)
    overwrite: bool = opt(False, OVERWRITE)


@dataclass
class DemoOptions:
    COMMAND = "demo"
    out: object = opt("remodel-demo", "output directory (checkpoints, plots, report)")
    quick: bool = opt(False, "smaller budgets (CI)")
    overwrite: bool = opt(False, "replace a non-demo OUT directory")


@dataclass
class InspectOptions:
    COMMAND = "inspect"
    model: object = opt(None, "checkpoint dir, dir with config.json, config.json path, or a shipped config name",
                        positional=True)
    json: bool = opt(False, "print the figures as JSON instead of a table")


@dataclass
class ConvertOptions:
    COMMAND = "convert"
    model: object = opt(None, "checkpoint directory to read", positional=True)
    out: object = opt(None, "new output directory", positional=True)
    to: str | None = opt(None, "output family (default None: the input's own family)", choices=FAMILIES)
    dtype: str | None = opt(None, "dtype of the written weights (default None: as read; a quantized source, FP8, "
                            "is written in its own format, a dtype writes plain weights)", choices=DTYPES)
    overwrite: bool = opt(False, OVERWRITE)


@dataclass
class EvalOptions:
    COMMAND = "eval"
    model: object = opt(None, "checkpoint directory to evaluate", positional=True)
    data: object = opt(None, "held-out text for loss and perplexity (None: only --tasks)")
    seq_len: int = opt(256, "tokens per sequence", check=SEQ_LEN)
    batch: int = opt(8, "sequences per forward pass", check=BATCH)
    max_tokens: int | None = opt(None, "stop after this many tokens (None: all of DATA); distill's held-out figures: "
                                 "its --eval-data, --seq-len and --eval-tokens", count=True, check=count())
    tasks: list | None = opt(None, _tasks_help("MODEL"), names=True)
    task_dir: str | None = opt(None, TASK_DIR)
    limit: int | None = opt(None, LIMIT, check=ints(1, 2**31))
    trust_task_code: bool = opt(False, TRUST_TASK_CODE)


@dataclass
class TokenizeOptions:
    COMMAND = "tokenize"
    data: object = opt(None, "text file/folder, .jsonl/.json, .parquet or save_to_disk folder", positional=True)
    out: object = opt(None, "new token-set directory (tokens.bin, docs.idx, meta.json; with --format megatron: "
                      "data.bin, data.idx)", positional=True)
    tokenizer: object = opt(None, "tokenizer folder or model checkpoint directory", required=True)
    num_proc: int = opt(1, "tokenizing processes", check=ints(1, 1024))
    doc_split: str = opt("line", "what a document of a .txt file is: each non-empty line (newlines dropped), each "
                         "blank-line separated paragraph, or the whole file (both keep newlines)", choices=DOC_SPLITS)
    eos: bool = opt(True, "do not append eos after each document", negate="no_eos")
    shard_tokens: int = opt(SHARD_TOKENS, "tokens per work shard (a killed run resumes from its finished shards)",
                            check=ints(1, 2**40))
    format: str = opt("remodel", "remodel: a token set; megatron: Megatron-Core's indexed dataset OUT/data.bin + "
                      "OUT/data.idx (one sequence per document; --data takes OUT or OUT/data)",
                      choices=("remodel", "megatron"))
    overwrite: bool = opt(False, OVERWRITE)


COMMAND_OPTIONS = {c.COMMAND: c for c in (DemoOptions, InspectOptions, ConvertOptions, ScoreOptions, PruneOptions,
                                          PlanOptions, SearchOptions, UpcycleOptions, TokenizeOptions, EvalOptions,
                                          HybridizeOptions)}
