"""pytest plugin for the device stages (`-p pytest_instafail`, bench/ on the path): a failing test's report is
printed the moment it fails, not at the session's end, which a stage cut at its time limit never reaches
(two H200 leases lost their GDN failure messages that way)."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n---", flush=True)
