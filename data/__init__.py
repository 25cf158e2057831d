"""The embedded corpus, tokenizer and checkpoints, and the scripts that made them (run as scripts)."""
