"""Tools for multi-turn rollouts: the interface, the registry (verl's tool-config YAML), the built-in
calculator and sandboxed Python tools, and tool-call parsing (see docs/multiturn.md)."""

from hybridrl.tools.base import BaseTool, Tool, ToolResult
from hybridrl.tools.calculator import CalculatorTool
from hybridrl.tools.parser import ParsedTurn, ToolCall, parse_tool_calls
from hybridrl.tools.registry import CallJob, ToolConfigError, ToolRegistry, load_tool_config

__all__ = [
    "BaseTool", "CalculatorTool", "CallJob", "ParsedTurn", "Tool", "ToolCall", "ToolConfigError", "ToolRegistry",
    "ToolResult", "load_tool_config", "parse_tool_calls",
]
