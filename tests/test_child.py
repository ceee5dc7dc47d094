"""What every engine child process does: giving back its libraries' pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from structllm.engine.child import library_ranges


def smaps(*mappings: tuple[str, int]) -> str:
    """``/proc/PID/smaps`` text: each mapping's header line and fields, with
    the given anonymous kB."""
    fields = "Size: 4 kB\nRss: 4 kB\nAnonymous: {} kB\nVmFlags: rd mr me\n"
    return "".join(f"{head}\n" + fields.format(anon) for head, anon in mappings)


SMAPS = smaps(
    ("55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11", 0),
    ("7f1c20000000-7f1c20021000 rw-p 00000000 00:00 0", 132),
    ("7f1c2a000000-7f1c2b200000 r-xp 00400000 08:01 77 /v/paddle/libpaddle.so", 0),
    ("7f1c2b200000-7f1c2b300000 r--p 01600000 08:01 77 /v/paddle/libpaddle.so", 0),
    # RELRO: read-only now, its pages relocated (the process's own)
    ("7f1c2b300000-7f1c2b380000 r--p 01700000 08:01 77 /v/paddle/libpaddle.so", 512),
    ("7f1c2b380000-7f1c2b400000 rw-p 01780000 08:01 77 /v/paddle/libpaddle.so", 8),
    (
        "7f1c2c000000-7f1c2c100000 r-xp 00000000 08:01 90 /usr/lib/libstdc++.so.6.0.30",
        0,
    ),
    ("7f1c2d000000-7f1c2d100000 r--p 00000000 08:01 91 /opt/libgone.so (deleted)", 0),
    ("7f1c2e000000-7f1c2e100000 r--s 00000000 08:01 92 /models/SmolLM2.Q4_1.gguf", 0),
    ("7f1c2f000000-7f1c2f001000 r--p 00000000 08:01 93 /data/notes.so.txt", 0),
    ("7f1c30000000-7f1c30001000 r-xp 00000000 08:01 94 /v/np/_umath.cpython-311.so", 0),
    ("7f1c31000000-7f1c31001000 r-xp 00000000 08:01 95 /home/a user/lib/libx.so", 0),
    ("7ffd5a000000-7ffd5a021000 rw-p 00000000 00:00 0                  [stack]", 12),
    ("7ffd5a1f0000-7ffd5a1f2000 r-xp 00000000 00:00 0                  [vdso]", 0),
)


def test_only_the_files_pages_of_read_only_shared_objects_are_chosen() -> None:
    assert library_ranges(SMAPS) == [
        (0x7F1C2A000000, 0x7F1C2B200000),  # libpaddle.so's code
        (0x7F1C2B200000, 0x7F1C2B300000),  # and constants; not RELRO, globals
        (0x7F1C2C000000, 0x7F1C2C100000),  # a versioned name
        (0x7F1C30000000, 0x7F1C30001000),  # an extension module
        (0x7F1C31000000, 0x7F1C31001000),  # a path with a space
    ]
    assert library_ranges("") == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, madvise")
def test_a_librarys_pages_leave_the_process_and_its_own_pages_stay(
    tmp_path: Path,
) -> None:
    # a file named like a library, mapped read-only and read through: its
    # pages leave the process and map back, unchanged, when read again; a
    # private mapping of it written and then made read-only (as the loader
    # does to a library's relocated tables) keeps its written bytes
    script = textwrap.dedent(
        f"""
        import ctypes, mmap, os
        from structllm.engine.child import release_library_pages

        path = {str(tmp_path / "libprobe.so")!r}
        data = os.urandom(8 << 20)
        with open(path, "wb") as f:
            f.write(data)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        with open(path, "r+b") as f:
            own = mmap.mmap(f.fileno(), 1 << 20, access=mmap.ACCESS_COPY)
        own[:5] = b"moved"  # a copy of the page, the process's own
        address = ctypes.addressof(ctypes.c_char.from_buffer(own))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(address, 1 << 20, mmap.PROT_READ) == 0
        assert m[:] == data  # every page touched

        def resident():
            with open("/proc/self/smaps") as f:
                lines = f.read().splitlines()
            rss = {{}}
            for at, line in enumerate(lines):
                if line.endswith(path):
                    kb = next(ln for ln in lines[at:] if ln.startswith("Rss:"))
                    rss[line.split()[1]] = int(kb.split()[1]) << 10
            return rss

        before = resident()
        dropped = release_library_pages()
        after = resident()
        print(before["r--s"], after["r--s"], dropped, m[:] == data)
        print(after["r--p"] >= 4096, bytes(own[:5]) == b"moved", own[5:] == data[5:1 << 20])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    (before, after, dropped, same), (kept, written, rest) = (
        line.split() for line in out.stdout.splitlines()
    )
    assert int(before) == 8 << 20 and int(after) == 0
    assert int(dropped) >= 8 << 20 and same == "True"
    assert kept == written == rest == "True"
