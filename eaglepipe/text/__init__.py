"""Text derived from token ids: reasoning, tool calls, gpt-oss harmony, the readable record, later turns."""
