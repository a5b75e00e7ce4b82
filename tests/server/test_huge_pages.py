"""The server's process asks for transparent huge pages for torch's large CPU buffers."""
import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import reuse_server, torch, os
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
huge = 0
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        huge = int(line.split()[1])
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge)
"""


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def test_importing_the_server_turns_on_huge_pages_for_torch_s_buffers():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}  # this process's import set it
    env_value, huge_kib = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                                         check=True).stdout.split()
    assert env_value == "1"
    if thp_mode() != "never":  # the kernel grants them where it may ("always" or "madvise", as here)
        assert int(huge_kib) >= 32 << 10
