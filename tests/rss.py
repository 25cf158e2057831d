"""Code prepended to the memory-measuring subprocess scripts of the tests.

Peak RSS of the subprocess's own address space (VmHWM). getrusage's ru_maxrss is not used: after
fork+exec it also counts the parent (pytest) process's peak, which hides the growth we measure.
`reset_peak()` resets the high-water mark to the current RSS and returns that RSS as the baseline.
"""

PEAK_RSS = '''
import re as _re
def status(field):
    return int(_re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
def reset_peak():
    base = status("VmRSS")
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        base = status("VmHWM")
    return base
'''
