"""The commands: each `remodel COMMAND` as one function (convert, inspect, plan, prune, score, search, upcycle, eval,
demo) and the reports they write; configs.py holds each command's options as one dataclass, and options.py
generates its parser from the fields."""
