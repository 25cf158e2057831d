"""The commands: each `remodel COMMAND` as one function (convert, inspect, plan, prune, score, search, upcycle, eval, demo) and the reports they write."""
