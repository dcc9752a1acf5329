"""bench/treemem.py, the throughput bench's memory measure: a process tree's PSS plus the files it holds in a
directory, summed at one instant. A grandchild's memory and a file no process maps are counted; ``wait4``'s peak
(the largest single process, and after a fork and exec the forking process's too) misses both."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.treemem import TreeMemory

MIB = 2**20
HELD_MIB = 120  # in each of the two processes: a child and its grandchild
FILE_MIB = 80  # written to a file that no process maps

TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path
    held = bytearray(os.urandom({held} * 2**20))  # private pages, touched
    if sys.argv[1] == "child":
        grandchild = subprocess.Popen([sys.executable, __file__, "grandchild", sys.argv[2]])
        Path(sys.argv[2], "blob").write_bytes(os.urandom({file} * 2**20))
        time.sleep(1.5)
        grandchild.kill()
    else:
        time.sleep(3)
    """
).format(held=HELD_MIB, file=FILE_MIB)


def test_the_tree_peak_counts_every_process_and_the_files_it_holds(tmp_path) -> None:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    held = tmp_path / "held"
    held.mkdir()
    process = subprocess.Popen([sys.executable, str(script), "child", str(held)])
    with TreeMemory(process.pid, [str(tmp_path / "he*")], interval=0.05) as tree:
        process.wait()
    assert tree.peak_held >= FILE_MIB * MIB
    assert tree.peak_pss >= 2 * HELD_MIB * MIB  # both processes' private pages, at one instant
    assert tree.peak >= (2 * HELD_MIB + FILE_MIB) * MIB * 0.9  # the file was held while both lived
    assert len([name for name in tree.at_peak if "tree.py" in name]) == 2  # the child and the grandchild


def test_a_gone_process_counts_nothing(tmp_path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    time.sleep(0.05)
    tree = TreeMemory(process.pid, [str(Path(tmp_path, "none-*"))])
    assert tree.sample() == 0 and tree.peak == 0
