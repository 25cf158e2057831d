"""Train the embedded byte-level BPE tokenizer on data/corpus/train.txt.gz.

Usage: python data/make_tokenizer.py   (writes data/tokenizer/)
Vocab 2048; <|endoftext|> is the only special token and serves as bos/eos/pad.
No special tokens are added by encode(); decode(encode(s)) == s for any text.
"""
import gzip
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DATA = Path(__file__).resolve().parent
EOT = "<|endoftext|>"
VOCAB = 2048


def main():
    with gzip.open(DATA / "corpus" / "train.txt.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=None,
        clean_up_tokenization_spaces=False, model_max_length=1_000_000)
    out = DATA / "tokenizer"
    fast.save_pretrained(out)
    n_chars = sum(len(s) for s in lines)
    n_tok = sum(len(ids) for ids in fast(lines)["input_ids"])
    print(f"{out}: vocab {len(fast)}, train {n_chars} chars / {n_tok} tokens = {n_chars / n_tok:.3f} chars/token")


if __name__ == "__main__":
    main()
