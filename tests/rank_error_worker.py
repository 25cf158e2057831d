"""torchrun worker for tests/test_rank_errors.py: `remodel ARGS...` (cli.main), where the rank named by
REMODEL_TEST_BAD_RANK alone gives its sampler a 5-token vocabulary, so the first batch that rank reads
holds an id outside it: the sampler's own RemodelError, on that rank alone, after the process group
formed (as a bad token id in a row only that rank reads).

    torchrun --standalone --nproc_per_node 2 tests/rank_error_worker.py train MODEL OUT --data ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remodel import cli  # noqa: E402
from remodel.pipelines.data import sampler  # noqa: E402

if os.environ.get("RANK") == os.environ.get("REMODEL_TEST_BAD_RANK"):
    real = sampler.sequences

    def five_token_vocabulary(*a, **kw):
        return real(*a, **{**kw, "vocab_size": 5})
    sampler.sequences = five_token_vocabulary

sys.exit(cli.main(sys.argv[1:]))
