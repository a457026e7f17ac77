"""The stand: replay agent turns under load against OpenAI-compatible endpoints and report."""
