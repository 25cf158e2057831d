"""The bad-input contract of the command line, shared by the test modules (a helper, not a test module):
`fails` runs the CLI in-process and asserts exit `rc` with exactly one `remodel CMD: error: ...` line on
stderr (progress-bar lines aside) and no traceback; `listing` is a folder's files, to show nothing new
was written."""
from pathlib import Path

from remodel import cli


def fails(capsys, *argv, rc=2, match=None) -> str:
    """Run the CLI in-process; assert exit `rc` and exactly one error line on stderr; returns it."""
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == rc
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and "it/s]" not in ln]
    assert len(lines) == 1 and lines[0].startswith(f"remodel {argv[0]}: error: "), err
    assert "Traceback" not in err
    if match:
        assert match in lines[0], lines[0]
    return lines[0]


def listing(d) -> set:
    """Every path under `d`, relative to it."""
    return {str(p.relative_to(d)) for p in Path(d).rglob("*")}
