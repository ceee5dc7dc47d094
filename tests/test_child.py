"""What every engine child process does: giving back its libraries' pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from structllm.engine.child import library_ranges

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11
7f1c20000000-7f1c20021000 rw-p 00000000 00:00 0
7f1c2a000000-7f1c2b200000 r-xp 00400000 08:01 77 /venv/paddle/base/libpaddle.so
7f1c2b200000-7f1c2b300000 r--p 01600000 08:01 77 /venv/paddle/base/libpaddle.so
7f1c2b300000-7f1c2b400000 rw-p 01700000 08:01 77 /venv/paddle/base/libpaddle.so
7f1c2c000000-7f1c2c100000 r-xp 00000000 08:01 90 /usr/lib/libstdc++.so.6.0.30
7f1c2d000000-7f1c2d100000 r--p 00000000 08:01 91 /opt/old/libgone.so (deleted)
7f1c2e000000-7f1c2e100000 r--s 00000000 08:01 92 /models/SmolLM2.Q4_1.gguf
7f1c2f000000-7f1c2f001000 r--p 00000000 08:01 93 /data/notes.so.txt
7f1c30000000-7f1c30001000 r-xp 00000000 08:01 94 /venv/numpy/_core/_umath.cpython-311-x86_64-linux-gnu.so
7ffd5a000000-7ffd5a021000 rw-p 00000000 00:00 0                          [stack]
7ffd5a1f0000-7ffd5a1f2000 r-xp 00000000 00:00 0                          [vdso]
"""


def test_only_read_only_mappings_of_shared_objects_are_chosen() -> None:
    assert library_ranges(MAPS) == [
        (0x7F1C2A000000, 0x7F1C2B200000),  # libpaddle.so's code
        (0x7F1C2B200000, 0x7F1C2B300000),  # and constants; not its globals
        (0x7F1C2C000000, 0x7F1C2C100000),  # a versioned name
        (0x7F1C30000000, 0x7F1C30001000),  # an extension module
    ]


def test_a_path_with_spaces_is_one_name() -> None:
    line = "7f00-7f10 r-xp 00000000 08:01 5 /home/a user/lib/libx.so\n"
    assert library_ranges(line) == [(0x7F00, 0x7F10)]
    assert library_ranges("garbage\n\n7f00-7f10 r-xp 0 08:01 5\n") == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, madvise")
def test_a_librarys_pages_that_no_one_else_maps_are_reclaimed(
    tmp_path: Path,
) -> None:
    # a file of its own (no other process maps it), named like a library,
    # mapped read-only and read through: its pages are resident until given
    # back, and read again correctly after
    script = textwrap.dedent(
        f"""
        import mmap, os
        from structllm.engine.child import release_library_pages

        path = {str(tmp_path / "libprobe.so")!r}
        data = os.urandom(8 << 20)
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # clean pages: reclaimable without writeback
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert m[:] == data  # every page touched

        def resident():
            with open("/proc/self/smaps") as f:
                lines = f.read().splitlines()
            at = next(i for i, ln in enumerate(lines) if ln.endswith(path))
            rss = next(ln for ln in lines[at:] if ln.startswith("Rss:"))
            return int(rss.split()[1]) << 10

        before = resident()
        advised = release_library_pages()
        print(before, resident(), advised, m[:] == data)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    before, after, advised, same = out.stdout.split()
    if int(advised) == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux < 5.4)")
    assert int(before) == 8 << 20
    assert int(after) < 1 << 20  # the kernel may keep a few
    assert int(advised) >= 8 << 20
    assert same == "True"
