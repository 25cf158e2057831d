"""Data from disk: text corpora, token sets (tokenize, validate, blend) and the resumable sampler."""
