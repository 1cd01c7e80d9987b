"""`make test-vllm` sets HYBRIDRL_REQUIRE_VLLM=1: there a vLLM that does not import is an error, not a
reason to skip the tier (CI would otherwise pass without testing anything)."""

from __future__ import annotations

import os

if os.environ.get("HYBRIDRL_REQUIRE_VLLM") == "1":
    import vllm.entrypoints.llm  # noqa: F401
