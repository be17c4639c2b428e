"""Model files: where a config's model is (a path, or an ``hf:`` reference fetched from the Hub), GGUF files
converted once and cached, causal LMs loaded with torch."""
