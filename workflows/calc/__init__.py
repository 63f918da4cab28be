"""The calculator tool environment: multi-turn OpenAI tool calling sized for a 135M model."""
