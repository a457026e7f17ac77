"""The recorder: an OpenAI-compatible pass-through proxy that turns an agent's traffic into a workload."""
