"""Building the C kernels: a change to a local header a source includes rebuilds it."""

from __future__ import annotations

import shutil

import pytest

from hybridrl.utils import native_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_a_header_change_rebuilds_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "value.h"
    source = tmp_path / "src" / "kernel.c"
    source.parent.mkdir()
    source.write_text('#include "../inc/value.h"\nint value(void) { return VALUE; }\n')
    header.write_text("#define VALUE 7\n")
    assert native_build.build_library(source, "a test kernel").value() == 7
    header.write_text("#define VALUE 11\n")  # same source file, new header
    assert native_build.build_library(source, "a test kernel").value() == 11
    assert len(list((tmp_path / "cache").glob("kernel_*.so"))) == 2


def test_source_bytes_follow_local_includes_once(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n#include "a.h"\nA\n')
    (tmp_path / "b.h").write_text('#include "a.h"\nB\n')
    source = tmp_path / "main.c"
    source.write_text('#include <stdint.h>\n#include "a.h"\n  #  include "b.h"\n#include "missing.h"\nMAIN\n')
    text = native_build.source_bytes(source)
    assert text.count(b"MAIN") == 1 and text.count(b"\nA\n") == 1 and text.count(b"\nB\n") == 1
