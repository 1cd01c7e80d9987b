"""The built-in Python tool: run model-written code in the sandbox and return what it printed.

Execution goes through ``hybridrl.rewards.sandbox.run_sandboxed`` (child process with resource
limits, no network where namespaces work, a wall-clock kill). The tool's ``timeout_s`` is the
sandbox's wall limit; the agent loop's own timeout is set a little above it so the sandbox, not
the loop, reports the time-out.
"""

from __future__ import annotations

from typing import Any

from hybridrl.rewards.sandbox import SandboxLimits, run_sandboxed
from hybridrl.tools.base import BaseTool, ToolResult


class PythonTool(BaseTool):
    """``python(code: str)``: stdout of the code (stderr's last lines on failure).

    config keys: ``timeout_s`` (wall seconds, default 10), ``cpu_s`` (default 5), ``memory_mb``
    (default 512), ``max_output_chars`` (default 2000).
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.limits = SandboxLimits(wall_s=self.timeout_s, cpu_s=int(self.config.get("cpu_s", 5)),
                                    memory_mb=int(self.config.get("memory_mb", 512)))
        self.max_output_chars = int(self.config.get("max_output_chars", 2000))
        self.timeout_s += 5.0  # headroom for interpreter start-up: the sandbox's own wall limit fires first

    def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResult(f"Error: 'code' must be a string, got {type(code).__name__}", error=True)
        result = run_sandboxed(code, self.limits)
        if result.ok:
            return ToolResult(result.stdout[-self.max_output_chars:])
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        text = f"Error: {result.reason()}" + (f"\n{tail}" if tail else "")
        return ToolResult(text[-self.max_output_chars:], error=True)
