"""Tool schemas the engine tests offer the model.

The calculator is the calc workflow's shape (``workflows/calc``): ``a op b`` on integers, strict,
so vLLM's grammar constrains every argument. The OpenAI function tool, the Responses function tool
and the Anthropic tool each wrap these same parameters.
"""

from __future__ import annotations

from typing import Any

CALCULATOR_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "op", "b"],
    "properties": {
        "a": {"type": "integer"},
        "op": {"type": "string", "enum": ["add", "multiply"]},
        "b": {"type": "integer"},
    },
}
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b.",
        "strict": True,  # without it vLLM 0.32's named tool_choice lets any JSON through
        "parameters": CALCULATOR_PARAMETERS,
    },
}
"""The calculator as an OpenAI chat function tool."""
