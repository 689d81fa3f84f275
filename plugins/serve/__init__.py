"""``crosstrain serve``: an OpenAI-compatible HTTP server for a trained model, with continuous batching and hot
update from a live run (docs/serve.md)."""
